"""Ring attention: this rank's queries against every rank's keys and values, the key/value
blocks passed around the context group's ring instead of all-gathered.

Rank ``r`` holds its queries, keys and values at its positions (:mod:`fxpipe.context.layout`).
In ``N`` steps it computes its queries against the block it holds (its own first, then the
one its predecessor held), while sending that block on to its successor and receiving the
next (``isend``/``irecv`` over the context group, overlapped with the block's compute). Each
block's partial result is merged by its log-sum-exp (the online softmax of flash attention:
Liu et al., "Ring Attention with Blockwise Transformers", 2023), so the output equals
attention over the whole sequence. Causal attention compares positions (query position >= key
position); a mask the model gives (this rank's query rows, every key column) is read at the
block's columns. The backward passes the blocks around again, with the gradients of their
keys and values travelling one step behind them (sent while the next block computes) and
handed back to their rank at the end. Only the
rank's own keys and values are kept for the backward (not the gathered whole), at the price of
``N - 1`` messages per direction and the blocks' scores computed unfused.

gloo on CPU, NCCL on CUDA; the ``group`` is a process group or a
:class:`fxpipe.tensor.collectives.TimedGroup` (kind ``context ring``, the bytes this rank sends).
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from fxpipe.context.layout import positions
from fxpipe.tensor.collectives import TimedGroup


def _pg(group):
    return group.group if isinstance(group, TimedGroup) else group


class _Shift:
    """Send ``tensors`` to the next rank of the ring and receive as many from the previous
    one, asynchronously (:meth:`wait` returns what arrived)."""

    def __init__(self, tensors: list[torch.Tensor], group, rank: int, n: int):
        pg = _pg(group)
        nxt = dist.get_global_rank(pg, (rank + 1) % n) if pg is not None else (rank + 1) % n
        prv = dist.get_global_rank(pg, (rank - 1) % n) if pg is not None else (rank - 1) % n
        self.group, self.t0 = group, time.perf_counter()
        self.bytes = sum(t.numel() * t.element_size() for t in tensors)
        self.got = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
        self.works = []
        for t, buf in zip(tensors, self.got):
            self.works.append(dist.isend(t.contiguous(), nxt, group=pg))
            self.works.append(dist.irecv(buf, prv, group=pg))

    def wait(self) -> list[torch.Tensor]:
        for w in self.works:
            w.wait()
        sink = self.group.recorder.sink if isinstance(self.group, TimedGroup) else None
        if sink is not None:
            sink("context ring", self.bytes, self.t0, time.perf_counter())
        return self.got


def _allowed(mask, causal: bool, mine: torch.Tensor, theirs: torch.Tensor):
    """Which (query, key) pairs of the block count (bool), and an additive mask (or None)."""
    ok, add = None, None
    if causal:
        ok = mine[:, None] >= theirs[None, :]
    if mask is not None:
        cols = mask.index_select(-1, theirs)
        if cols.dtype == torch.bool:
            ok = cols if ok is None else ok & cols
        else:
            add = cols
    return ok, add


def _scores(q, k, scale, ok, add):
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    if add is not None:
        s = s + add
    if ok is not None:
        s = s.masked_fill(~ok, float("-inf"))
    return s


def _repeat(x: torch.Tensor, rep: int) -> torch.Tensor:
    return x if rep == 1 else x.repeat_interleave(rep, dim=-3)


def _fold(g: torch.Tensor, rep: int) -> torch.Tensor:
    """The gradient of repeated key/value heads summed back onto each head."""
    if rep == 1:
        return g
    shape = list(g.shape)
    return g.reshape(shape[:-3] + [shape[-3] // rep, rep] + shape[-2:]).sum(-3)


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, rank, n, seq, scale, causal, group):
        rep = q.shape[-3] // k.shape[-3]
        held = [positions(j, n, seq, q.device) for j in range(n)]
        mine = held[rank]
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        cur_k, cur_v, owner = k, v, rank
        for step in range(n):
            shift = _Shift([cur_k, cur_v], group, rank, n) if step < n - 1 else None
            ok, add = _allowed(mask, causal, mine, held[owner])
            s = _scores(q, _repeat(cur_k, rep), scale, ok, add).float()
            blk = torch.logsumexp(s, dim=-1)
            p = torch.exp(s - blk[..., None]).nan_to_num(0.0)
            o = torch.matmul(p.to(v.dtype), _repeat(cur_v, rep)).float()
            new = torch.logaddexp(lse, blk)
            a = torch.exp(lse - new).nan_to_num(0.0)
            b = torch.exp(blk - new).nan_to_num(0.0)
            out = out * a[..., None] + o * b[..., None]
            lse = new
            if shift is not None:
                cur_k, cur_v = shift.wait()
                owner = (owner - 1) % n
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, *([mask] if mask is not None else []))
        ctx.args = (rank, n, seq, scale, causal, group, mask is not None)
        return out

    @staticmethod
    def backward(ctx, g):
        rank, n, seq, scale, causal, group, has_mask = ctx.args
        q, k, v, out, lse, *rest = ctx.saved_tensors
        mask = rest[0] if has_mask else None
        rep = q.shape[-3] // k.shape[-3]
        held = [positions(j, n, seq, q.device) for j in range(n)]
        mine = held[rank]
        d = (g.float() * out.float()).sum(-1)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        cur_k, cur_v, owner = k, v, rank
        passing = None  # the previous block's key/value gradients, on their way on
        for step in range(n):
            shift = _Shift([cur_k, cur_v], group, rank, n) if step < n - 1 else None
            ok, add = _allowed(mask, causal, mine, held[owner])
            kk, vv = _repeat(cur_k, rep), _repeat(cur_v, rep)
            s = _scores(q, kk, scale, ok, add).float()
            p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
            dv = _fold(torch.matmul(p.transpose(-2, -1), g.float()), rep)
            dp = torch.matmul(g.float(), vv.float().transpose(-2, -1))
            ds = p * (dp - d[..., None])
            dq = dq + torch.matmul(ds, kk.float()) * scale
            dk = _fold(torch.matmul(ds.transpose(-2, -1), q.float()) * scale, rep)
            if passing is not None:  # what the block's earlier readers added (sent last step)
                before = passing.wait()
                dk, dv = dk + before[0], dv + before[1]
            # the block's key/value gradients travel on with it, to its next reader (after the
            # last step: back to its own rank), while the next block computes
            passing = _Shift([dk, dv], group, rank, n)
            if shift is not None:
                cur_k, cur_v = shift.wait()
                owner = (owner - 1) % n
        dk, dv = passing.wait()  # this rank's own block's, from every rank
        gmask = None
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), gmask, None, None, None, None,
                None, None)


@torch.compiler.disable(recursive=True)
def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, rank: int, n: int,
                   seq: int, scale: float | None, causal: bool, group) -> torch.Tensor:
    """Attention of this rank's queries ``[..., H, S/n, D]`` against every rank's keys and
    values (``[..., Hk, S/n, D]``, ``H`` a multiple of ``Hk``: grouped queries) passed around
    the ring (module doc). ``mask``: None, or this rank's query rows against every key column
    (bool: True where a key counts; or additive)."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return _Ring.apply(q, k, v, mask, rank, n, seq, scale, causal, group)
