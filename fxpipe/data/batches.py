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
from typing import Any, Protocol

import torch

from fxpipe.errors import SpecError
from fxpipe.examples.data import ByteBatches
from fxpipe.specs.loader import resolve_callable, spec_location
from fxpipe.specs.schema import ParallelSpec


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
    ref = spec.data.dataset
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


def as_tuple(inputs: Any) -> tuple[torch.Tensor, ...]:
    """Model inputs as a tuple of tensors (a single tensor becomes a 1-tuple)."""
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def _example_batch(spec: ParallelSpec) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Batch 0 of the spec's dataset as ``(inputs, target)``, checked.

    Raises:
        SpecError: the dataset cannot be built (see :func:`fxpipe.data.batches.make_batches`),
            or its ``get(0, "train")`` raises or does not return ``(inputs, target)`` tensors.
    """
    batches = make_batches(spec)
    head = _head(spec)
    try:
        batch = batches.get(0, "train")
    except SpecError:
        raise
    except Exception as err:  # the user's get() failed
        raise SpecError(f"{head}: get(0, 'train') of the object that {spec.data.dataset} "
                        f"returned raised {type(err).__name__}: "
                        f"{' '.join(str(err).split())[:300]}; fix its get(step, split) method"
                        ) from err
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise SpecError(f"{head}: get(0, 'train') of the object that {spec.data.dataset} "
                        f"returned gave a {type(batch).__name__}, not a pair (inputs, target); "
                        "make get() return (inputs, target)")
    inputs = as_tuple(batch[0])
    if not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
        raise SpecError(f"{head}: get(0, 'train') returned inputs that are not tensors "
                        f"({', '.join(type(t).__name__ for t in inputs) or 'none'}); return a "
                        "tensor or a tuple of tensors, each [batch_size, ...]")
    if not isinstance(batch[1], torch.Tensor):
        raise SpecError(f"{head}: get(0, 'train') returned a {type(batch[1]).__name__} target; "
                        "return the target as a tensor [batch_size, ...]")
    return inputs, batch[1]


def example_microbatch(spec: ParallelSpec, size: int | None = None) -> tuple:
    """One micro-batch of real inputs from the spec's dataset (dim 0 = ``size``, default the
    spec's micro-batch size when the parallel sizes are fixed, else 1).

    Raises:
        SpecError: see :func:`_example_batch`.
    """
    if size is None:
        par = spec.parallel
        if isinstance(par.data, int) and isinstance(par.microbatches, int):
            size = spec.data.batch_size // (par.data * par.microbatches)
        else:
            size = 1
    inputs, _ = _example_batch(spec)
    return tuple(t[:size] for t in inputs)


def example_target(spec: ParallelSpec, size: int) -> torch.Tensor:
    """The targets of one micro-batch of ``size`` samples from the spec's dataset."""
    return _example_batch(spec)[1][:size]
