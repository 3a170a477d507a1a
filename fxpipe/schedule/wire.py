"""Bytes a rank puts on the wire in the data-parallel collectives, under the ring algorithms:
an all-reduce of ``S`` bytes over ``n`` ranks sends ``2 (n-1)/n x S``, an all-gather of ``S``
bytes per rank ``(n-1) x S``; a bucket of gradients under each ``train.grad_compression`` as
the reducers of :mod:`fxpipe.runtime.compression` count it. Pure arithmetic, shared by the
planner's price of a step (:mod:`fxpipe.schedule.step_price`) and the runtime's counts."""

from __future__ import annotations

import math
from typing import Sequence

# torch's PowerSGD test of whether a rank-r approximation of a rows x cols matrix sends fewer
# numbers (pure arithmetic; the runtime's reducer decides with the same function)
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

from fxpipe.specs.schema import low_rank_view

__all__ = ["MIN_COMPRESSION_RATE", "WIRE16", "ring_allreduce_bytes", "ring_allgather_bytes",
           "compressed_bytes"]

#: a matrix is compressed when it shrinks at least this much (torch's ``min_compression_rate``)
MIN_COMPRESSION_RATE = 2.0
#: the methods that send 16-bit payloads
WIRE16 = ("fp16", "bf16")


def ring_allreduce_bytes(nbytes: int, n: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``nbytes`` over ``n`` ranks."""
    return round(2 * (n - 1) * nbytes / n) if n > 1 else 0


def ring_allgather_bytes(nbytes: int, n: int) -> int:
    """Bytes one rank sends in a ring all-gather of ``nbytes`` per rank over ``n`` ranks."""
    return (n - 1) * nbytes


def compressed_bytes(method: str, shapes: Sequence[Sequence[int]], n: int, *, rank: int = 1,
                     ratio: float = 0.01, element_size: int = 4) -> int:
    """Bytes one rank sends per step for a bucket of gradients of ``shapes`` over ``n`` ranks
    once compressing (after the warm-up): ``none`` the ring all-reduce of the fp32 bucket,
    ``fp16`` / ``bf16`` of half of it, ``powersgd`` (at ``rank``) the all-reduce of the exact
    tensors with every compressed matrix's ``P`` (rows x rank), then that of the ``Q``
    (cols x rank), ``topk`` (at ``ratio``) the all-gather of ``k`` values and ``k`` int32
    indices."""
    numel = sum(math.prod(s) for s in shapes)
    if method in WIRE16:
        return ring_allreduce_bytes(numel * 2, n)
    if method == "topk":
        k = max(1, min(numel, math.ceil(ratio * numel))) if numel else 0
        return ring_allgather_bytes(8 * k, n)
    if method == "powersgd":
        first = second = 0
        for shape in shapes:
            view = low_rank_view(tuple(shape))
            if view is not None and min(view) >= rank and \
                    _should_compress(*view, rank, MIN_COMPRESSION_RATE)[0]:
                first += view[0] * rank
                second += view[1] * rank
            else:
                first += math.prod(shape)
        if not second:  # nothing to compress: the exact all-reduce
            return ring_allreduce_bytes(numel * element_size, n)
        return (ring_allreduce_bytes(first * element_size, n)
                + ring_allreduce_bytes(second * element_size, n))
    return ring_allreduce_bytes(numel * element_size, n)
