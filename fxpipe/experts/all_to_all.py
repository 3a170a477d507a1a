"""The all-to-alls of expert parallelism, as autograd functions over the expert group.

Each of the group's ``N`` ranks holds ``E/N`` of a layer's ``E`` experts (rank ``r`` the
experts ``r E/N .. (r+1) E/N - 1``) and its own tokens. :func:`dispatch` sends every rank's
token slots ``[E, C, ...]`` to the ranks holding their experts, so a rank gets ``[E/N, N C,
...]``: its experts' slots from every rank of the group, in rank order. :func:`combine` is the
inverse: each expert's outputs back to the rank of the tokens, ``[E, C, ...]`` again. The
backward of each is the other (both move values, exactly). ``torch.distributed.
all_to_all_single`` (gloo on CPU, NCCL on CUDA).

``group`` is a process group or a :class:`fxpipe.tensor.collectives.TimedGroup`, whose recorder
gets every all-to-all (kind ``all-to-all``, the bytes this rank sends to the others, start and
end).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from fxpipe.tensor.collectives import TimedGroup


def _pg(group):
    return group.group if isinstance(group, TimedGroup) else group


def _exchange(x: torch.Tensor, group) -> torch.Tensor:
    """``all_to_all_single`` of ``x`` (dimension 0 in ``N`` equal blocks, block ``j`` to rank
    ``j``), timed."""
    x = x.contiguous()
    out = torch.empty_like(x)
    n = dist.get_world_size(_pg(group))
    sink = group.recorder.sink if isinstance(group, TimedGroup) else None
    t0 = time.perf_counter()
    dist.all_to_all_single(out, x, group=_pg(group))
    if sink is not None:
        sink("all-to-all", x.numel() * x.element_size() * (n - 1) // n, t0, time.perf_counter())
    return out


def _dispatch(x: torch.Tensor, group) -> torch.Tensor:
    n = dist.get_world_size(_pg(group))
    e, c, rest = x.shape[0], x.shape[1], tuple(x.shape[2:])
    got = _exchange(x, group)  # block i: rank i's slots of my experts
    return got.view(n, e // n, c, *rest).transpose(0, 1).reshape(e // n, n * c, *rest)


def _combine(y: torch.Tensor, group) -> torch.Tensor:
    n = dist.get_world_size(_pg(group))
    local, nc, rest = y.shape[0], y.shape[1], tuple(y.shape[2:])
    c = nc // n
    blocks = y.view(local, n, c, *rest).transpose(0, 1).reshape(n * local, c, *rest)
    return _exchange(blocks, group)  # block i: expert group i's outputs for my tokens


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _dispatch(x, group)

    @staticmethod
    def backward(ctx, g):
        return _combine(g, ctx.group), None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group):
        ctx.group = group
        return _combine(y, group)

    @staticmethod
    def backward(ctx, g):
        return _dispatch(g, ctx.group), None


@torch.compiler.disable
def dispatch(x: torch.Tensor, group) -> torch.Tensor:
    """``[E, C, ...]`` token slots -> ``[E/N, N C, ...]`` of this rank's experts."""
    return _Dispatch.apply(x, group)


@torch.compiler.disable
def combine(y: torch.Tensor, group) -> torch.Tensor:
    """``[E/N, N C, ...]`` expert outputs -> ``[E, C, ...]`` for this rank's tokens."""
    return _Combine.apply(y, group)


# ----------------------------------------------------------------- the dropless form's rows
class RowsState:
    """One dropless region's exchange in one forward: the row counts sent to and received from
    each rank, the order that groups the received rows by local expert, this rank's offsets."""

    send: list[int]
    recv: list[int]
    order: torch.Tensor
    offsets: torch.Tensor


def _swap_rows(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """``all_to_all_single`` of rows with split sizes (``send[j]`` rows to rank ``j``,
    ``recv[i]`` from rank ``i``), timed (bytes this rank sends to the others)."""
    x = x.contiguous()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    sink = group.recorder.sink if isinstance(group, TimedGroup) else None
    t0 = time.perf_counter()
    dist.all_to_all_single(out, x, recv, send, group=_pg(group))
    if sink is not None:
        me = dist.get_rank(_pg(group))
        row = x[0].numel() * x.element_size() if x.shape[0] else 0
        sink("all-to-all", (sum(send) - send[me]) * row, t0, time.perf_counter())
    return out


def _plan_rows(offsets: torch.Tensor, experts: int, group, state: RowsState) -> None:
    """Exchange the rows per expert and fill ``state`` (see :class:`RowsState`)."""
    n = dist.get_world_size(_pg(group))
    local = experts // n
    ends = offsets.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))  # rows per expert, this rank's
    got = torch.empty_like(counts)
    dist.all_to_all_single(got, counts, group=_pg(group))  # [source, my local expert]
    got = got.view(n, local)
    state.send = counts.view(n, local).sum(1).tolist()
    state.recv = got.sum(1).tolist()
    # received rows come source by source, each by local expert; group them expert by expert
    starts = torch.cumsum(got.reshape(-1), 0) - got.reshape(-1)
    pieces = [torch.arange(int(starts[i * local + e]), int(starts[i * local + e] + got[i, e]))
              for e in range(local) for i in range(n)]
    state.order = (torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)).to(
        offsets.device)
    state.offsets = torch.cumsum(got.sum(0), 0).to(offsets.dtype)


class _RowsDispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, offsets, state, experts, group):
        _plan_rows(offsets, experts, group, state)
        ctx.args = (state, group)
        return _swap_rows(x, state.send, state.recv, group)[state.order]

    @staticmethod
    def backward(ctx, g):
        state, group = ctx.args
        back = torch.empty_like(g)
        back[state.order] = g
        return _swap_rows(back, state.recv, state.send, group), None, None, None, None


class _RowsCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, state, group):
        ctx.args = (state, group)
        back = torch.empty_like(y)
        back[state.order] = y
        return _swap_rows(back, state.recv, state.send, group)

    @staticmethod
    def backward(ctx, g):
        state, group = ctx.args
        return _swap_rows(g, state.send, state.recv, group)[state.order], None, None


@torch.compiler.disable
def rows_state() -> RowsState:
    """A new :class:`RowsState` (one per dropless region per call)."""
    return RowsState()


@torch.compiler.disable
def rows_dispatch(x: torch.Tensor, offsets: torch.Tensor, state: RowsState, experts: int,
                  group) -> torch.Tensor:
    """Rows sorted by expert (``offsets``: cumulative rows per expert, ``experts`` of them) ->
    this rank's experts' rows from every rank of the group, grouped by expert."""
    return _RowsDispatch.apply(x, offsets, state, experts, group)


@torch.compiler.disable
def rows_offsets(rows: torch.Tensor, state: RowsState) -> torch.Tensor:
    """The cumulative rows per local expert of what :func:`rows_dispatch` gave (``rows`` orders
    the call after it)."""
    return state.offsets


@torch.compiler.disable
def rows_combine(y: torch.Tensor, state: RowsState, group) -> torch.Tensor:
    """The inverse of :func:`rows_dispatch`: each row back to its rank, in its order."""
    return _RowsCombine.apply(y, state, group)
