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
