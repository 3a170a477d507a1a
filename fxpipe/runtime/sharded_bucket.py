"""One stage's flat bucket of sharded parameters (:class:`ShardedBucket`): the slices its
data-parallel replicas own, the reduce-scatter of its gradients into them and the all-gather
of the parameters back (:mod:`fxpipe.runtime.data_sharding` holds one per stage, or per
block under per-block gathering, :mod:`fxpipe.runtime.block_gather`)."""

from __future__ import annotations

import datetime
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from fxpipe.errors import RuntimeFailure, comm_error_text, failed_how
from fxpipe.runtime.compression import ring_allgather_bytes
from fxpipe.runtime.p2p import describe_peers

_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _timeout(timeout_s: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=timeout_s)


def wait_collective(work, what: str, name: str, nbytes: int, peers: list[int],
                    timeout_s: float, slow_hint: bool = False) -> None:
    """Wait for a collective's ``work`` over the data-parallel group, or raise a
    :class:`~fxpipe.errors.RuntimeFailure` naming it (``name``'s ``what``, ``nbytes`` bytes),
    the peers and how it failed (``slow_hint``: add that a merely slow peer needs a longer
    ``train.timeout_s``)."""
    try:
        work.wait(_timeout(timeout_s))
    except Exception as e:  # gloo/NCCL raise RuntimeError / DistBackendError
        who, logs = describe_peers(peers)
        raise RuntimeFailure(
            f"{name} {what} ({nbytes} bytes) with {who} {failed_how(e, timeout_s)}: "
            f"{comm_error_text(e)}. Check {logs}"
            + ("; raise train.timeout_s if a peer is only slow" if slow_hint else "")) from None


class ShardedBucket:
    """One stage's (or one set of stages') non-shared parameters, split over ``group``.

    Args:
        name: label for messages.
        params: the parameters, in a fixed order (every replica builds the same bucket), of one
            dtype.
        group: the data-parallel group; ``n`` its size, ``index`` this rank's place in it.
        level: ``optimizer``, ``gradients`` or ``full`` (see the module doc).
        wire: dtype the gradients travel in (float32, or 16 bits under ``fp16`` / ``bf16``
            gradient compression: divided by ``n`` first, as the all-reduce does).

    Attributes:
        segments: ``(param, first, last, offset)``: elements ``first..last`` of the flattened
            parameter are elements ``offset..`` of this rank's slice.
        master: this rank's slice of the parameters, one tensor per segment: views of the
            parameters themselves (``optimizer``, ``gradients``), or of a flat buffer of the
            slice in the parameters' dtype (``full``, whose whole parameters are freed).
        grad: float32 slice of the averaged gradient, accumulated over ``step()`` calls.
        bytes_sent: bytes sent this step (reduce-scatter and all-gather, ring algorithms).
    """

    def __init__(self, name: str, params: Sequence[nn.Parameter], group, n: int, index: int,
                 level: str, wire: torch.dtype = torch.float32):
        self.name, self.params, self.group = name, list(params), group
        self.n, self.index, self.level, self.wire = n, index, level, wire
        self.numel = sum(p.numel() for p in self.params)
        self.slice = -(-self.numel // n) if self.numel else 0
        self.padded = self.slice * n
        start = index * self.slice
        self.segments: list[tuple[nn.Parameter, int, int, int]] = []
        at = 0
        for p in self.params:
            a, b = max(at, start), min(at + p.numel(), start + self.slice)
            if a < b:
                self.segments.append((p, a - at, b - at, a - start))
            at += p.numel()
        self.dtype = self.params[0].dtype if self.params else torch.float32
        self._flat_master = (torch.zeros(self.slice, dtype=self.dtype, device=self._device())
                             if level == "full" else None)
        self.master = [self._master_piece(p, a, b, off) for p, a, b, off in self.segments]
        self.grad = torch.zeros(self.slice, dtype=torch.float32, device=self._device())
        self.bytes_sent = 0
        self._work = self._out = self._pending = None
        self.launched = False
        self.shapes = {id(p): p.shape for p in self.params}
        self.numels = {id(p): p.numel() for p in self.params}  # p.numel() is 0 once freed
        self.peers = ([r for r in dist.get_process_group_ranks(group) if r != dist.get_rank()]
                      if group is not None else [])
        self._wire_bytes = self.padded * torch.empty(0, dtype=wire).element_size()

    def _device(self) -> torch.device:
        return self.params[0].device if self.params else torch.device("cpu")

    def _master_piece(self, p: nn.Parameter, a: int, b: int, off: int) -> torch.Tensor:
        if self._flat_master is None:  # the parameter's own elements (never replaced)
            return p.data.view(-1)[a:b]
        piece = self._flat_master[off:off + b - a]
        piece.copy_(p.detach().reshape(-1)[a:b])
        return piece

    # ------------------------------------------------------------------ gradients
    def launch(self) -> None:
        """Start the reduce-scatter of this step's gradients (asynchronous)."""
        if self.launched:
            return
        self.launched = True
        if not self.params:
            return
        flat = torch.zeros(self.padded, dtype=self.wire, device=self._device())
        at = 0
        for p in self.params:
            if p.grad is not None:
                g = p.grad.reshape(-1)
                flat[at:at + p.numel()] = g if self.wire == torch.float32 else g / self.n
            at += p.numel()
        self._out = torch.empty(self.slice, dtype=self.wire, device=flat.device)
        if self.group is None:
            self._out.copy_(flat)
            return
        self._work = _REDUCE_SCATTER(self._out, flat, group=self.group, async_op=True)
        self.bytes_sent += round((self.n - 1) / self.n * self._wire_bytes)

    def wait(self, timeout_s: float) -> None:
        """Take this rank's slice of the averaged gradient (added to :attr:`grad` by
        :meth:`commit`); the whole gradients are zeroed (``optimizer``) or freed (``gradients``,
        ``full``)."""
        if not self.launched:
            raise RuntimeFailure(f"{self.name} reduce-scatter waited before it was launched (bug)")
        if self._out is None:
            return
        if self._work is not None:
            wait_collective(self._work, "gradient reduce-scatter", self.name, self._wire_bytes,
                            self.peers, timeout_s, slow_hint=True)
        out = self._out.float()
        self._pending = out.div_(self.n) if self.wire == torch.float32 else out
        self._work = self._out = None
        for p in self.params:
            if self.level == "optimizer" and p.grad is not None:
                p.grad.zero_()
            else:
                p.grad = None
        if self.level == "full":
            self.free()

    def commit(self, applied: bool = True) -> None:
        """Add this step's averaged slice to :attr:`grad` (``applied`` False: an fp16 step whose
        gradients held an inf or NaN is dropped, as the loss scaler drops it unsharded)."""
        if self._pending is not None and applied:
            self.grad.add_(self._pending)
        self._pending = None

    def reset(self) -> None:
        """A new step (the gradient slice keeps accumulating until the optimizer's step)."""
        self.launched = False

    # ------------------------------------------------------------------ parameters
    def gather(self, timeout_s: float) -> None:
        """All-gather the master slices into the whole parameters."""
        if not self.params:
            return
        mine = (self._flat_master if self._flat_master is not None
                else torch.zeros(self.slice, dtype=self.dtype, device=self._device()))
        if self._flat_master is None:
            for piece, (_, a, b, off) in zip(self.master, self.segments):
                mine[off:off + b - a] = piece
        full = torch.empty(self.padded, dtype=self.dtype, device=mine.device)
        if self.group is None:
            full.copy_(mine)
        else:
            work = dist.all_gather(list(full.chunk(self.n)), mine, group=self.group,
                                   async_op=True)
            wait_collective(work, "parameter all-gather", self.name,
                            full.numel() * full.element_size(), self.peers, timeout_s)
            self.bytes_sent += ring_allgather_bytes(self.slice * full.element_size(), self.n)
        at = 0
        with torch.no_grad():
            for p in self.params:
                k = self.numels[id(p)]
                whole = full[at:at + k].view(self.shapes[id(p)])
                if p.data.numel() == k:
                    p.data.copy_(whole)
                else:
                    p.data = whole.clone()
                at += k

    def free(self) -> None:
        """Drop the whole parameters (``full``: only the master slice stays)."""
        for p in self.params:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def refresh_master(self) -> None:
        """``full``: take the master slice from the whole parameters again (set from outside);
        the other levels' master is the parameters themselves."""
        if self._flat_master is None:
            return
        with torch.no_grad():
            for piece, (p, a, b, _) in zip(self.master, self.segments):
                piece.copy_(p.detach().reshape(-1)[a:b])

    @property
    def gathered(self) -> bool:
        return all(p.data.numel() == self.numels[id(p)] for p in self.params)

    def held_bytes(self) -> dict[str, int]:
        """Bytes of whole parameters, gradients (whole and this rank's slice) and separate
        master slice this bucket holds now (storage sizes)."""
        params = sum(p.data.numel() * p.element_size() for p in self.params)
        grads = sum(p.grad.numel() * p.grad.element_size() for p in self.params
                    if p.grad is not None)
        master = (self._flat_master.numel() * self._flat_master.element_size()
                  if self._flat_master is not None else 0)
        return {"params": params, "grads": grads + self.grad.numel() * 4, "master": master}
