"""Data: the spec's ``data`` section becomes batches (the partitioner's example inputs, every
rank's training and validation batches).

``data.dataset`` names a callable (``"package.module:function"``). It may return:

* ``bytes`` or ``str``: a text corpus, cut into next-byte batches by
  :class:`fxpipe.examples.data.ByteBatches` (inputs and targets int64 ``[batch, seq_len]``);
* an object with ``get(step: int, split: str) -> (inputs, target)`` returning the whole global
  batch for that step (``inputs`` a tensor or tuple of tensors, each ``[batch_size, ...]``).

Every rank calls the same callable with the same seed, so all ranks see identical batches.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from fxpipe.errors import SpecError
from fxpipe.examples.data import ByteBatches
from fxpipe.specs.loader import resolve_callable, spec_location
from fxpipe.specs.schema import ParallelSpec
from fxpipe.units import plural


class Batches(Protocol):
    """Deterministic source of global batches: ``get(step, split) -> (inputs, target)``."""

    def get(self, step: int, split: str = "train") -> tuple[Any, torch.Tensor]:
        """The global batch of ``step`` (``split``: ``"train"`` or ``"val"``) as ``(inputs, target)``."""
        ...


def _head(spec) -> str:
    """``"FILE:LINE: data.dataset"`` (or just ``"data.dataset"`` for a spec without a file)."""
    where = spec_location(spec, "data.dataset")
    return f"{where}: data.dataset" if where else "data.dataset"


def _one_line(err: BaseException, limit: int = 300) -> str:
    text = " ".join(str(err).split()) or "(no message)"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def make_batches(spec) -> Batches:
    """Build the batch source for ``spec`` (a :class:`fxpipe.specs.schema.ParallelSpec`).

    Calls the ``data.dataset`` callable with those of ``batch_size``, ``seq_len`` and ``seed``
    (``train.seed``) that its signature accepts.

    Raises:
        SpecError (every message starts ``FILE:LINE: data.dataset`` and says how to fix it): the
            dataset callable cannot be imported; calling it raises (e.g. ``OSError`` for a
            missing file, or ``FileNotFoundError`` from the bundled ``python_source_text`` when
            the Python standard library sources are not installed); it returns an empty or too
            short text corpus for ``data.seq_len``; it returns an object whose ``get`` is not
            callable, or something that is neither text nor such an object.
    """
    if spec.data.source != "dataset":
        return _named_data(spec)
    ref = spec.data.dataset_ref
    fn = resolve_callable(ref, "data.dataset", spec=spec)
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins without a signature: offer nothing
        params = {}
    offered = {"batch_size": spec.data.batch_size, "seq_len": spec.data.seq_len,
               "seed": spec.train.seed}
    kwargs = {k: v for k, v in offered.items() if k in params}
    try:
        source = fn(**kwargs)
    except SpecError:
        raise
    except SystemExit as err:
        raise SpecError(f"{_head(spec)}: calling {ref} called sys.exit({err.code!r}); a dataset "
                        "callable must return the data") from None
    except Exception as err:  # the user's (or the bundled) dataset callable failed
        raise SpecError(
            f"{_head(spec)}: calling {ref}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())}) "
            f"raised {type(err).__name__}: {_one_line(err)}; fix the dataset callable or what it "
            "reads, or point data.dataset at another 'package.module:callable'"
        ) from err
    if isinstance(source, str):
        source = source.encode()
    if isinstance(source, (bytes, bytearray, memoryview)):
        try:
            return ByteBatches(bytes(source), spec.data.batch_size, spec.data.seq_len,
                               spec.train.seed)
        except ValueError as err:  # empty or too short corpus (ByteBatches explains)
            raise SpecError(f"{_head(spec)}: {ref} returned a text corpus that cannot be used: "
                            f"{err}") from None
    if hasattr(source, "get"):
        if not callable(source.get):
            kind = type(source.get).__name__
            raise SpecError(
                f"{_head(spec)}: {ref} returned a {type(source).__name__} whose 'get' is "
                f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}, not a method; give it a method "
                "get(step, split) -> (inputs, target), or return bytes/str (a text corpus)"
            )
        return source
    raise SpecError(
        f"{_head(spec)}: {ref!r} returned {type(source).__name__}; it must return "
        "bytes/str (a text corpus) or an object with get(step, split) -> (inputs, target)"
    )


def _named_data(spec):
    """:class:`~fxpipe.data.token_batches.TokenBatches` over the spec's ``files``,
    ``hf_dataset`` or ``tokens`` (errors start with the key's ``FILE:LINE``)."""
    from fxpipe.data.text_sources import spec_tokens
    from fxpipe.data.token_batches import TokenBatches, read_token_file
    from fxpipe.data.tokenizer import load_tokenizer

    d = spec.data
    src = d.source
    where = spec_location(spec, f"data.{src}")
    head = f"{where}: data.{src}" if where else f"data.{src}"
    try:
        if src == "tokens":
            train = read_token_file(d.tokens, d.dtype, "data.tokens")
            val = (read_token_file(d.val_tokens, d.dtype, "data.val_tokens")
                   if d.val_tokens is not None else None)
            vocab = load_tokenizer(d.tokenizer).vocab_size if d.vocabulary_known else None
        else:
            train, val = spec_tokens(d)
            vocab = load_tokenizer(d.tokenizer).vocab_size
        return TokenBatches(train, val, d.batch_size, d.seq_len, spec.train.seed,
                            d.val_fraction, vocab, what=f"data.{src}")
    except SpecError as e:
        msg = str(e)
        raise SpecError(f"{where}: {msg}" if where and not msg.startswith(where) else msg
                        ) from None
    except OSError as e:
        raise SpecError(f"{head}: {e}") from None


def data_vocab_size(spec) -> int | None:
    """The vocabulary the spec's named data is tokenised with (``data.tokenizer``), or None for
    a ``data.dataset`` callable and a token file given without a tokenizer."""
    from fxpipe.data.tokenizer import load_tokenizer

    d = spec.data
    if not d.vocabulary_known:
        return None
    return load_tokenizer(d.tokenizer).vocab_size


def check_vocabulary(model, spec) -> None:
    """The model's token embedding holds every id of the spec's tokenizer.

    The embedding is the model's ``nn.Embedding`` with the most rows (or a transformers
    model's ``get_input_embeddings()``).

    Raises:
        SpecError: the tokenizer's vocabulary is larger than the embedding.
    """
    import torch.nn as nn

    vocab = data_vocab_size(spec)
    if vocab is None:
        return
    emb = None
    getter = getattr(model, "get_input_embeddings", None)
    if callable(getter):
        try:
            emb = getter()
        except (NotImplementedError, AttributeError):
            emb = None
    if not isinstance(emb, nn.Embedding):
        embs = [m for m in model.modules() if isinstance(m, nn.Embedding)]
        emb = max(embs, key=lambda m: m.num_embeddings, default=None)
    if emb is None or emb.num_embeddings >= vocab:
        return
    where = spec_location(spec, "data.tokenizer")
    raise SpecError(f"{where + ': ' if where else ''}data.tokenizer: {spec.data.tokenizer} has "
                    f"{vocab:,} tokens but the model's embedding has {emb.num_embeddings:,} rows; "
                    f"set the model's vocabulary to at least {vocab:,} (e.g. vocab_size in "
                    "model.args / model.config) or use a smaller tokenizer")


@dataclass
class Batch:
    """One batch (global, per replica or per micro-batch) in the form the model takes it.

    Attributes:
        args: positional model inputs, each ``[batch, ...]``.
        kwargs: keyword model inputs by name (e.g. ``input_ids``, ``attention_mask``, and
            ``labels`` when the model computes its own loss), each ``[batch, ...]``.
        target: what the loss compares the model output with, ``[batch, ...]``; None when the
            model computes its own loss.
    """

    args: tuple[torch.Tensor, ...]
    kwargs: dict[str, torch.Tensor]
    target: torch.Tensor | None

    @property
    def size(self) -> int:
        """Samples in the batch (dim 0 of the first input)."""
        first = self.args[0] if self.args else next(iter(self.kwargs.values()))
        return int(first.shape[0])

    def named(self, model_inputs: list[str], input_kwargs: list[str]) -> dict[str, torch.Tensor]:
        """The inputs by graph input name: positional inputs take the names of the plan's
        positional model inputs in order, keyword inputs keep theirs (those the model does not
        take are left out).

        Raises:
            SpecError: the batch has another number of positional inputs than planned.
        """
        positional = [n for n in model_inputs if n not in input_kwargs]
        if len(self.args) != len(positional):
            raise SpecError(f"the batch has {plural(len(self.args), 'positional input')} but the "
                            f"plan takes {len(positional)} ({positional}); feed batches like the ones "
                            "planned")
        named = dict(zip(positional, self.args))
        named.update({k: v for k, v in self.kwargs.items() if k in model_inputs})
        return named

    def tensors(self) -> list[torch.Tensor]:
        """The model inputs in call order: positional, then keyword."""
        return [*self.args, *self.kwargs.values()]

    def slice(self, lo: int, hi: int) -> "Batch":
        """Samples ``lo .. hi-1`` of every input and of the target."""
        return Batch(tuple(a[lo:hi] for a in self.args),
                     {k: v[lo:hi] for k, v in self.kwargs.items()},
                     None if self.target is None else self.target[lo:hi])

    def to(self, device: Any) -> "Batch":
        """Every tensor on ``device``."""
        return Batch(tuple(a.to(device) for a in self.args),
                     {k: v.to(device) for k, v in self.kwargs.items()},
                     None if self.target is None else self.target.to(device))


def as_batch(raw: Any, model_loss: bool, head: str = "data.dataset") -> Batch:
    """Read what a dataset's ``get(step, split)`` returned as a :class:`Batch`.

    Accepted forms: ``(inputs, target)`` with ``inputs`` a tensor, a tuple/list of tensors or a
    dict of named tensors (keyword inputs); or a dict of named tensors alone. In a dict batch,
    ``labels`` is the target for a built-in or user loss, and a model input when the model
    computes its own loss (``model_loss``). A pair's target may be None only with ``model_loss``.

    Raises:
        SpecError: any other form (the message says what was returned and what to return).
    """
    what = f"{head}: get(step, split) returned"
    target = None
    if isinstance(raw, dict):
        kwargs = dict(raw)
        if not model_loss:
            if "labels" not in kwargs:
                raise SpecError(f"{what} a dict without 'labels' ({', '.join(map(str, kwargs))}) "
                                "but train.loss needs a target; add 'labels' (the target), return "
                                "(inputs, target), or set train.loss: model when the model "
                                "computes its own loss")
            target = kwargs.pop("labels")
        args: tuple = ()
    elif isinstance(raw, (tuple, list)) and len(raw) == 2:
        inputs, target = raw
        if isinstance(inputs, dict):
            args, kwargs = (), dict(inputs)
        else:
            args, kwargs = as_tuple(inputs), {}
    else:
        raise SpecError(f"{what} a {type(raw).__name__}, not a pair (inputs, target) or a dict of "
                        "named tensors; make get() return one of those")
    bad = [f"{k}: {type(v).__name__}" for k, v in [*enumerate(args), *kwargs.items()]
           if not isinstance(v, torch.Tensor)]
    if bad or not (args or kwargs):
        raise SpecError(f"{what} inputs that are not tensors ({', '.join(bad) or 'none'}); return "
                        "tensors (positional, or named in a dict), each [batch_size, ...]")
    if not all(isinstance(k, str) and k.isidentifier() for k in kwargs):
        raise SpecError(f"{what} named inputs {list(kwargs)}; their names must be the model's "
                        "forward() argument names")
    if target is None and not model_loss:
        raise SpecError(f"{what} no target; return (inputs, target), or set train.loss: model "
                        "when the model computes its own loss")
    if target is not None and not isinstance(target, torch.Tensor):
        raise SpecError(f"{what} a {type(target).__name__} target; return the target as a "
                        "tensor [batch_size, ...]")
    sizes = {int(v.shape[0]) if v.dim() else -1
             for v in [*args, *kwargs.values(), *([target] if target is not None else [])]}
    if len(sizes) != 1 or -1 in sizes:
        raise SpecError(f"{what} tensors whose first dimensions differ or are missing "
                        f"({sorted(sizes)}); every input and the target need the batch first")
    return Batch(tuple(args), kwargs, target)


def as_tuple(inputs: Any) -> tuple[torch.Tensor, ...]:
    """Model inputs as a tuple of tensors (a single tensor becomes a 1-tuple)."""
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def get_batch(batches: Batches, spec: ParallelSpec, step: int, split: str = "train") -> Batch:
    """The global batch of ``step`` as a :class:`Batch` (``train.loss: model`` decides where
    ``labels`` of a dict batch go).

    Raises:
        SpecError: ``get`` raised (its type and message are named) or returned another form.
    """
    head = _head(spec)
    try:
        raw = batches.get(step, split)
    except SpecError:
        raise
    except SystemExit as err:
        raise SpecError(f"{head}: get({step}, {split!r}) called sys.exit({err.code!r}); it must "
                        "return the batch") from None
    except Exception as err:  # the user's get() failed
        raise SpecError(f"{head}: get({step}, {split!r}) of the object that {spec.data.dataset_ref} "
                        f"returned raised {type(err).__name__}: "
                        f"{' '.join(str(err).split())[:300]}; fix its get(step, split) method"
                        ) from err
    return as_batch(raw, spec.train.loss == "model", head)


def example_microbatch(spec: ParallelSpec, size: int | None = None) -> Batch:
    """One micro-batch of real inputs (and target) from the spec's dataset: the first ``size``
    samples of batch 0 (default: the spec's micro-batch size when the parallel sizes are fixed,
    else 1).

    Raises:
        SpecError: see :func:`make_batches` and :func:`get_batch`.
    """
    if size is None:
        par = spec.parallel
        if isinstance(par.data, int) and isinstance(par.microbatches, int):
            size = spec.data.batch_size // (par.data * par.microbatches)
        else:
            size = 1
    return get_batch(make_batches(spec), spec, 0).slice(0, size)
