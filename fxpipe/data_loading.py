"""Turn a spec's ``data`` section into batches.

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


class Batches(Protocol):
    """Deterministic source of global batches: ``get(step, split) -> (inputs, target)``."""

    def get(self, step: int, split: str = "train") -> tuple[Any, torch.Tensor]: ...


def make_batches(spec) -> Batches:
    """Build the batch source for ``spec`` (a :class:`fxpipe.specs.schema.ParallelSpec`).

    Raises:
        SpecError: the dataset callable cannot be imported or returns something unusable.
    """
    from fxpipe.specs.loader import resolve_callable

    fn = resolve_callable(spec.data.dataset, "data.dataset", spec=spec)
    params = inspect.signature(fn).parameters
    offered = {"batch_size": spec.data.batch_size, "seq_len": spec.data.seq_len,
               "seed": spec.train.seed}
    kwargs = {k: v for k, v in offered.items() if k in params}
    source = fn(**kwargs)
    if isinstance(source, str):
        source = source.encode()
    if isinstance(source, (bytes, bytearray)):
        return ByteBatches(bytes(source), spec.data.batch_size, spec.data.seq_len, spec.train.seed)
    if hasattr(source, "get"):
        return source
    raise SpecError(
        f"data.dataset {spec.data.dataset!r} returned {type(source).__name__}; it must return "
        "bytes/str (a text corpus) or an object with get(step, split) -> (inputs, target)"
    )


def as_tuple(inputs: Any) -> tuple[torch.Tensor, ...]:
    """Model inputs as a tuple of tensors (a single tensor becomes a 1-tuple)."""
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
