"""The collectives of a context-parallel stage, over the context group.

* :func:`localize`: this rank's positions of a whole value (an index; its gradient goes back
  to those positions, zero elsewhere: the other ranks' parts arrive through the gradient
  all-reduce of the data-parallel group the context ranks belong to).
* :func:`gather`: the whole value from every rank's positions (all-gather, then the positions
  put in order); backward: the gradients of every rank's uses summed and each rank's
  positions handed back (reduce-scatter). Keys and values of attention.
* :func:`whole_output`: the model output gathered for a loss that needs all of it; backward
  takes this rank's positions of the gradient (every rank computed the same loss) times the
  degree (the gradients are averaged over the context ranks with the data-parallel ones).
* :func:`global_count`: the number of counted targets over the micro-batch (all-reduced).

gloo on CPU, NCCL on CUDA. ``group`` is a process group or a
:class:`fxpipe.tensor.collectives.TimedGroup`; the recorder gets every all-gather and
reduce-scatter (kinds ``context all-gather`` / ``context reduce-scatter``, the bytes of the
whole tensor).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from fxpipe.context.layout import gathered_order, positions
from fxpipe.tensor.collectives import TimedGroup

_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _pg(group):
    return group.group if isinstance(group, TimedGroup) else group


def _report(group, kind: str, nbytes: int, t0: float) -> None:
    sink = group.recorder.sink if isinstance(group, TimedGroup) else None
    if sink is not None:
        sink(kind, int(nbytes), t0, time.perf_counter())


def _split_seq(x: torch.Tensor, dim: int, inner: int, seq: int) -> torch.Tensor:
    """``x`` with dimension ``dim`` as ``(outer, seq, inner)``."""
    shape = list(x.shape)
    return x.reshape(shape[:dim] + [shape[dim] // (seq * inner), seq, inner] + shape[dim + 1:])


def _merge_seq(x: torch.Tensor, dim: int) -> torch.Tensor:
    shape = list(x.shape)
    return x.reshape(shape[:dim] + [shape[dim] * shape[dim + 1] * shape[dim + 2]]
                     + shape[dim + 3:])


def take(x: torch.Tensor, dim: int, inner: int, seq: int, index: torch.Tensor) -> torch.Tensor:
    """The positions ``index`` of ``x``'s sequence (``seq`` long) along ``dim``."""
    return _merge_seq(_split_seq(x, dim, inner, seq).index_select(dim + 1, index), dim)


def _eager(fn):
    return torch.compiler.disable(fn, recursive=True)


def _all_gather(x, dim, inner, n, seq_local, group):
    parts = [torch.empty_like(x) for _ in range(n)]
    t0 = time.perf_counter()
    dist.all_gather(parts, x.contiguous(), group=_pg(group))
    _report(group, "context all-gather", n * x.numel() * x.element_size(), t0)
    joined = torch.cat([_split_seq(p, dim, inner, seq_local) for p in parts], dim=dim + 1)
    order = gathered_order(n, n * seq_local, x.device)
    return _merge_seq(joined.index_select(dim + 1, order), dim)


def _reduce_scatter(g, dim, inner, n, seq, group):
    held = torch.cat([positions(r, n, seq, g.device) for r in range(n)])
    parts = _split_seq(g, dim, inner, seq).index_select(dim + 1, held)  # rank order
    moved = parts.movedim(dim + 1, 0).contiguous()
    out = torch.empty((moved.shape[0] // n, *moved.shape[1:]), dtype=g.dtype, device=g.device)
    t0 = time.perf_counter()
    _REDUCE_SCATTER(out, moved, group=_pg(group))
    _report(group, "context reduce-scatter", g.numel() * g.element_size(), t0)
    return _merge_seq(out.movedim(0, dim + 1), dim)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, inner, n, seq, group):
        ctx.args = (dim, inner, n, seq, group)
        return _all_gather(x, dim, inner, n, seq // n, group)

    @staticmethod
    def backward(ctx, g):
        dim, inner, n, seq, group = ctx.args
        return _reduce_scatter(g, dim, inner, n, seq, group), None, None, None, None, None


class _WholeOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, inner, n, seq, rank, group):
        ctx.args = (dim, inner, n, seq, rank)
        return _all_gather(x, dim, inner, n, seq // n, group)

    @staticmethod
    def backward(ctx, g):
        dim, inner, n, seq, rank = ctx.args
        mine = take(g, dim, inner, seq, positions(rank, n, seq, g.device))
        return mine * n, None, None, None, None, None, None


def localize(x: torch.Tensor, dim: int, inner: int, seq: int, index: torch.Tensor
             ) -> torch.Tensor:
    """This rank's positions (``index``) of a whole value (see the module doc)."""
    return take(x, dim, inner, seq, index.to(x.device))


@_eager
def gather(x: torch.Tensor, dim: int, inner: int, n: int, seq: int, group) -> torch.Tensor:
    """The whole value along the sequence from every rank's positions (module doc)."""
    return _Gather.apply(x, dim, inner, n, seq, group)


@_eager
def whole_output(x: torch.Tensor, dim: int, inner: int, n: int, seq: int, rank: int, group
                 ) -> torch.Tensor:
    """The model output gathered for a loss that reads all of it (module doc)."""
    return _WholeOutput.apply(x, dim, inner, n, seq, rank, group)


@_eager
def global_count(local: torch.Tensor, group) -> torch.Tensor:
    """``local`` (a count) summed over the context group, no gradient."""
    out = local.detach().to(torch.float64).reshape(1).clone()
    dist.all_reduce(out, group=_pg(group))
    return out[0].to(local.dtype)
