"""The collectives a tensor-parallel stage runs, as autograd functions over one process group.

Each keeps the invariant of :mod:`fxpipe.tensor.analysis`: a replicated value has the whole
gradient on every rank.

* :func:`copy_to` (Megatron's ``f``): identity forward, all-reduce of the gradient backward.
* :func:`reduce_from` (``g``): all-reduce forward (a partial sum becomes replicated), identity
  backward.
* :func:`gather` along a dimension (sharded -> replicated; ``blocks`` for a fused projection's
  strided shards); backward takes this rank's part of the gradient, or with ``partial`` (the
  gathered value feeds a sharded op) reduce-scatters it.
* :func:`scatter` (replicated -> this rank's slice); backward all-gathers the gradient.
* :func:`reduce_scatter` (a partial sum -> this rank's slice of the sum, sequence
  parallelism); backward all-gathers.
* :func:`vocab_embedding`: this rank's rows of an embedding whose table is split by
  vocabulary (ids outside its range give zeros); the caller reduces the partial rows.
* :func:`vocab_cross_entropy`: cross entropy of logits whose classes are split over the
  ranks: the max, the sum of exponentials and the target's logit are all-reduced (a few bytes per
  row); the logits are never gathered.

gloo on CPU and NCCL on CUDA alike (``all_gather`` into a list, ``reduce_scatter_single``,
``all_reduce``).

Timing is passed explicitly: each function's ``group`` is a process group or a
:class:`TimedGroup` (a process group with a :class:`CollectiveRecorder`; the mesh gives one per
tensor group, ``Mesh.tp_collectives``), whose recorder reports every collective run (its kind,
whole-tensor bytes, start and end) to the sinks listening at the time (the executor's timeline
while it runs a step, a script counting collectives around it: :meth:`CollectiveRecorder.to`).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
import torch.distributed as dist

#: torch 2.13 renamed ``reduce_scatter_tensor`` (deprecated there)
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

#: ``sink(kind, nbytes of the whole tensor, start_s, end_s)`` (``time.perf_counter`` seconds)
Sink = Callable[[str, int, float, float], None]


class CollectiveRecorder:
    """Where the collectives of one tensor group report what they ran: to every sink listening
    (:meth:`to`, nested), nowhere (and untimed) while none does."""

    def __init__(self) -> None:
        self.sink: Sink | None = None

    @contextmanager
    def to(self, sink: Sink | None) -> Iterator[None]:
        """Report to ``sink`` inside the ``with`` block, besides the sinks already listening
        (then to those alone again)."""
        previous = self.sink
        if sink is not None and previous is not None:
            def both(kind: str, nbytes: int, t0: float, t1: float) -> None:
                previous(kind, nbytes, t0, t1)
                sink(kind, nbytes, t0, t1)
            self.sink = both
        elif sink is not None:
            self.sink = sink
        try:
            yield
        finally:
            self.sink = previous


class TimedGroup:
    """A process group (``group``; None: the world) and the :class:`CollectiveRecorder` its
    collectives report to; accepted wherever a function here takes ``group``."""

    def __init__(self, group, recorder: CollectiveRecorder):
        self.group, self.recorder = group, recorder

    def __repr__(self) -> str:
        return f"TimedGroup({self.group!r})"


def _pg(group):
    """The process group of ``group`` (a :class:`TimedGroup` or a process group)."""
    return group.group if isinstance(group, TimedGroup) else group


@contextmanager
def _timed(kind: str, nbytes: int, group) -> Iterator[None]:
    sink = group.recorder.sink if isinstance(group, TimedGroup) else None
    if sink is None:
        yield
        return
    t0 = time.perf_counter()
    yield
    sink(kind, int(nbytes), t0, time.perf_counter())


def _world(group) -> int:
    return dist.get_world_size(_pg(group))


def _rank(group) -> int:
    return dist.get_rank(_pg(group))


def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    x = x.contiguous().clone()
    with _timed("all-reduce", x.numel() * x.element_size(), group):
        dist.all_reduce(x, op=op, group=_pg(group))
    return x


def _all_gather(x: torch.Tensor, dim: int, blocks: int, group) -> torch.Tensor:
    n = _world(group)
    parts = [torch.empty_like(x) for _ in range(n)]
    with _timed("all-gather", n * x.numel() * x.element_size(), group):
        dist.all_gather(parts, x.contiguous(), group=_pg(group))
    if blocks == 1:
        return torch.cat(parts, dim=dim)
    # each part holds its slice of every block: interleave them block by block
    split = [p.chunk(blocks, dim=dim) for p in parts]
    return torch.cat([split[r][k] for k in range(blocks) for r in range(n)], dim=dim)


def _local(x: torch.Tensor, dim: int, blocks: int, group) -> torch.Tensor:
    n, r = _world(group), _rank(group)
    if blocks == 1:
        return x.chunk(n, dim=dim)[r].contiguous()
    return torch.cat([b.chunk(n, dim=dim)[r] for b in x.chunk(blocks, dim=dim)],
                     dim=dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, blocks: int, group) -> torch.Tensor:
    n = _world(group)
    if blocks > 1:  # order the blocks' slices rank by rank, then scatter plainly
        x = torch.cat([torch.cat([b.chunk(n, dim=dim)[r] for b in x.chunk(blocks, dim=dim)],
                                 dim=dim) for r in range(n)], dim=dim)
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((moved.shape[0] // n, *moved.shape[1:]), dtype=x.dtype, device=x.device)
    with _timed("reduce-scatter", x.numel() * x.element_size(), group):
        _REDUCE_SCATTER(out, moved, group=_pg(group))
    return out.movedim(0, dim).contiguous()


def _eager(fn):
    """Run ``fn`` outside compiled regions (a compiled stage, ``train.compile``, breaks its
    graph here): the collectives' timing and their error reporting are Python."""
    return torch.compiler.disable(fn, recursive=True)


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group), None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, blocks, partial, group):
        ctx.args = (dim, blocks, partial, group)
        return _all_gather(x, dim, blocks, group)

    @staticmethod
    def backward(ctx, g):
        dim, blocks, partial, group = ctx.args
        out = (_reduce_scatter(g, dim, blocks, group) if partial
               else _local(g, dim, blocks, group))
        return out, None, None, None, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, blocks, group):
        ctx.args = (dim, blocks, group)
        return _local(x, dim, blocks, group)

    @staticmethod
    def backward(ctx, g):
        dim, blocks, group = ctx.args
        return _all_gather(g, dim, blocks, group), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.args = (dim, group)
        return _reduce_scatter(x, dim, 1, group)

    @staticmethod
    def backward(ctx, g):
        dim, group = ctx.args
        return _all_gather(g, dim, 1, group), None, None


@_eager
def copy_to(x: torch.Tensor, group) -> torch.Tensor:
    """Megatron's ``f``: identity forward, all-reduce of the gradient backward."""
    return _CopyTo.apply(x, group)


@_eager
def reduce_from(x: torch.Tensor, group) -> torch.Tensor:
    """Megatron's ``g``: all-reduce (sum) forward, identity backward."""
    return _ReduceFrom.apply(x, group)


@_eager
def gather(x: torch.Tensor, dim: int, blocks: int, partial: bool, group) -> torch.Tensor:
    """All-gather along ``dim`` (``blocks`` interleaved); see the module doc."""
    return _Gather.apply(x, dim, blocks, partial, group)


@_eager
def scatter(x: torch.Tensor, dim: int, blocks: int, group) -> torch.Tensor:
    """This rank's slice along ``dim`` of a replicated ``x``; gradient all-gathered."""
    return _Scatter.apply(x, dim, blocks, group)


@_eager
def reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's slice along ``dim`` of the sum of the ranks' ``x``; gradient all-gathered."""
    return _ReduceScatter.apply(x, dim, group)


# ------------------------------------------------- overlapped (chunked, asynchronous) forms
class _Async:
    """One collective in flight: :meth:`wait` returns its result (and reports its timing from
    launch to completion)."""

    def __init__(self, kind: str, nbytes: int, group, work, result: Callable[[], torch.Tensor]):
        self.kind, self.nbytes, self.group, self.work, self.result = kind, nbytes, group, work, result
        self.t0 = time.perf_counter()

    def wait(self) -> torch.Tensor:
        self.work.wait()
        sink = self.group.recorder.sink if isinstance(self.group, TimedGroup) else None
        if sink is not None:
            sink(self.kind, self.nbytes, self.t0, time.perf_counter())
        return self.result()


def _launch(kind: str, x: torch.Tensor, dim: int, group) -> _Async:
    """Start ``kind`` (``all_reduce``, ``all_gather`` or ``reduce_scatter`` along ``dim``) on
    ``x`` without waiting."""
    pg = _pg(group)
    if kind == "all_reduce":
        buf = x.contiguous().clone()
        work = dist.all_reduce(buf, group=pg, async_op=True)
        return _Async("all-reduce", buf.numel() * buf.element_size(), group, work, lambda: buf)
    n = _world(group)
    if kind == "all_gather":
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(n)]
        work = dist.all_gather(parts, x, group=pg, async_op=True)
        return _Async("all-gather", n * x.numel() * x.element_size(), group, work,
                      lambda: torch.cat(parts, dim=dim))
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((moved.shape[0] // n, *moved.shape[1:]), dtype=x.dtype, device=x.device)
    work = _REDUCE_SCATTER(out, moved, group=pg, async_op=True)
    return _Async("reduce-scatter", x.numel() * x.element_size(), group, work,
                  lambda: out.movedim(0, dim).contiguous())


class OverlapState:
    """The collectives in flight of one overlapped site in one forward (or its backward): chunk
    index -> :class:`_Async`. A new one per call of the site (``overlap_state``)."""

    def __init__(self) -> None:
        self.fwd: dict[int, _Async] = {}
        self.bwd: dict[int, _Async] = {}


#: a site's collective -> (forward kind or None, backward kind or None) per chunk
_INPUT_KINDS = {"copy_to": (None, "all_reduce"), "gather": ("all_gather", None),
                "gather_rs": ("all_gather", "reduce_scatter")}
_REDUCE_KINDS = {"all_reduce": ("all_reduce", None),
                 "reduce_scatter": ("reduce_scatter", "all_gather")}


class _Ready:
    """A value already there, waited for like an :class:`_Async`."""

    def __init__(self, value: torch.Tensor):
        self.value = value

    def wait(self) -> torch.Tensor:
        return self.value


# The four functions below pass data between a site's nodes through its OverlapState; what
# flows along the autograd edges between them is an empty token (the graph's order).
class _ReduceStart(torch.autograd.Function):
    """Forward: start chunk ``c``'s reduction of a row-parallel partial product. Backward: the
    chunk's gradient (all-gathered under sequence parallelism, started by
    :class:`_ReduceJoin`'s backward)."""

    @staticmethod
    def forward(ctx, y, state, c, kind, dim, group):
        ctx.args = (state, c)
        state.fwd[c] = _launch(_REDUCE_KINDS[kind][0], y, dim, group)
        return y.new_empty(0)

    @staticmethod
    def backward(ctx, token):
        state, c = ctx.args
        return state.bwd.pop(c).wait(), None, None, None, None, None


class _ReduceJoin(torch.autograd.Function):
    """Forward: wait for every chunk's reduction, in order. Backward: each chunk's gradient to
    its start (under sequence parallelism every chunk's all-gather started, last chunk first,
    the order the backward engine takes the starts in)."""

    @staticmethod
    def forward(ctx, state, kind, dim, group, *tokens):
        ctx.args = (state, kind, dim, group)
        return tuple(state.fwd.pop(c).wait() for c in range(len(tokens)))

    @staticmethod
    def backward(ctx, *gs):
        state, kind, dim, group = ctx.args
        back = _REDUCE_KINDS[kind][1]
        for c in reversed(range(len(gs))):
            state.bwd[c] = _launch(back, gs[c], dim, group) if back else _Ready(gs[c])
        return (None, None, None, None, *[g.new_empty(0) for g in gs])


class _InputStart(torch.autograd.Function):
    """Forward: split ``x`` into ``k`` chunks along ``dim`` and start every chunk's all-gather
    (sequence parallelism). Backward: wait for every chunk's input-gradient collective, put the
    chunks back together."""

    @staticmethod
    def forward(ctx, x, state, kind, dim, k, group):
        ctx.args = (state, dim)
        fwd = _INPUT_KINDS[kind][0]
        for c, piece in enumerate(x.chunk(k, dim=dim)):
            state.fwd[c] = _launch(fwd, piece, dim, group) if fwd else _Ready(piece.clone())
        return tuple(x.new_empty(0) for _ in range(k))

    @staticmethod
    def backward(ctx, *tokens):
        state, dim = ctx.args
        parts = [state.bwd.pop(c).wait() for c in range(len(tokens))]
        return torch.cat(parts, dim=dim), None, None, None, None, None


class _InputWait(torch.autograd.Function):
    """Forward: chunk ``c`` of the read value (its all-gather waited for). Backward: start the
    chunk's input-gradient collective (all-reduce for ``f``, reduce-scatter after a gather) or
    take this rank's rows (a gather read whole)."""

    @staticmethod
    def forward(ctx, token, state, c, kind, dim, group):
        ctx.args = (state, c, kind, dim, group)
        return state.fwd.pop(c).wait()

    @staticmethod
    def backward(ctx, g):
        state, c, kind, dim, group = ctx.args
        back = _INPUT_KINDS[kind][1]
        if back:
            state.bwd[c] = _launch(back, g, dim, group)
        else:  # a gather read whole: this rank's rows of the chunk
            state.bwd[c] = _Ready(_local(g, dim, 1, group))
        return g.new_empty(0), None, None, None, None, None


@_eager
def overlap_state() -> OverlapState:
    """A new :class:`OverlapState` (one per overlapped site per call)."""
    return OverlapState()


@_eager
def reduce_start(y: torch.Tensor, state: OverlapState, c: int, kind: str, dim: int,
                 group) -> torch.Tensor:
    """Start reducing chunk ``c`` of a row-parallel partial product (``kind``:
    ``all_reduce`` or ``reduce_scatter`` along ``dim``); returns a token for
    :func:`reduce_join`."""
    return _ReduceStart.apply(y, state, c, kind, dim, group)


@_eager
def reduce_join(state: OverlapState, kind: str, dim: int, group,
                *tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Every chunk's reduced value, in chunk order."""
    return _ReduceJoin.apply(state, kind, dim, group, *tokens)


@_eager
def input_start(x: torch.Tensor, state: OverlapState, kind: str, dim: int, k: int,
                group) -> tuple[torch.Tensor, ...]:
    """Split ``x`` (this rank's part) into ``k`` chunks and start their collectives
    (``kind``: ``copy_to``, ``gather``, ``gather_rs``); returns one token per chunk for
    :func:`input_wait`."""
    return _InputStart.apply(x, state, kind, dim, k, group)


@_eager
def input_wait(token: torch.Tensor, state: OverlapState, c: int, kind: str, dim: int,
               group) -> torch.Tensor:
    """Chunk ``c`` as the matmuls read it (gathered, for a gather)."""
    return _InputWait.apply(token, state, c, kind, dim, group)


def vocab_embedding(weight: torch.Tensor, ids: torch.Tensor, start: int,
                    padding_idx: int = -1) -> torch.Tensor:
    """Rows ``start .. start + len(weight)`` of a vocabulary-split embedding: the looked-up rows
    of the ids in this range, zeros for the others (a partial sum over the ranks).
    ``padding_idx`` (the whole table's) gets no gradient, as in ``nn.Embedding``."""
    n = weight.shape[0]
    outside = (ids < start) | (ids >= start + n)
    local = (ids - start).masked_fill(outside, 0)
    pad = padding_idx - start if padding_idx >= 0 and start <= padding_idx < start + n else -1
    rows = torch.ops.aten.embedding.default(weight, local, pad)
    return rows * (~outside).unsqueeze(-1).to(rows.dtype)


class _VocabCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, start, ignore_index, reduction, group):
        x = logits.float()
        m = x.amax(dim=1, keepdim=True)
        with _timed("all-reduce", m.numel() * m.element_size(), group):
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=_pg(group))
        shifted = x - m
        exp = shifted.exp()
        total = exp.sum(dim=1, keepdim=True)
        n = x.shape[1]
        inside = (target >= start) & (target < start + n) & (target != ignore_index)
        local = (target - start).masked_fill(~inside, 0)
        picked = shifted.gather(1, local.unsqueeze(1)) * inside.unsqueeze(1).to(x.dtype)
        both = torch.cat([total, picked], dim=1)
        with _timed("all-reduce", both.numel() * both.element_size(), group):
            dist.all_reduce(both, group=_pg(group))
        total, picked = both[:, :1], both[:, 1:]
        counted = target != ignore_index
        loss = (total.log() - picked).squeeze(1) * counted.to(x.dtype)
        count = counted.sum()
        ctx.save_for_backward(exp, total, local, inside, counted, count)
        ctx.reduction, ctx.dtype = reduction, logits.dtype
        out = torch.promote_types(logits.dtype, torch.float32)  # as autocast runs the loss
        if reduction == "none":
            return loss.to(out)
        if reduction == "sum":
            return loss.sum().to(out)
        return (loss.sum() / count).to(out)

    @staticmethod
    def backward(ctx, g):
        exp, total, local, inside, counted, count = ctx.saved_tensors
        grad = exp / total
        grad.scatter_add_(1, local.unsqueeze(1), -inside.unsqueeze(1).to(grad.dtype))
        grad = grad * counted.unsqueeze(1).to(grad.dtype)
        if ctx.reduction == "none":
            grad = grad * g.float().unsqueeze(1)
        elif ctx.reduction == "sum":
            grad = grad * g.float()
        else:
            grad = grad * (g.float() / count)
        return grad.to(ctx.dtype), None, None, None, None, None


_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


@_eager
def vocab_cross_entropy(logits: torch.Tensor, target: torch.Tensor, start: int,
                        ignore_index: int = -100, reduction: str | int = "mean",
                        group=None) -> torch.Tensor:
    """Cross entropy of ``logits[N, classes / t]`` holding classes ``start ..`` of each row
    against int64 ``target[N]`` (``ignore_index`` skipped; ``reduction`` ``mean`` over the
    counted targets, ``sum`` or ``none``, or aten's 0/1/2), the same value on every rank."""
    if isinstance(reduction, int):
        reduction = _REDUCTIONS[reduction]
    return _VocabCrossEntropy.apply(logits, target, start, ignore_index, reduction, group)
