"""Gradient compression: what one data-parallel bucket's flat gradient becomes on the wire.

A :class:`~fxpipe.runtime.data_parallel.GradBucket` hands its flat gradient (this rank's, this
step's) to a *reducer* made once per bucket, which lives across steps (error feedback and
PowerSGD's warm start are state), and gets back the sum over the group divided by ``divisor``
(the average over the replicas). Every rank of the group gets the same result, so replicas stay
identical; only the error memory is per rank.

* ``none``: fp32 all-reduce, exact.
* ``fp16`` / ``bf16``: divide, cast to 16 bits, all-reduce, cast back. Half the bytes; each
  entry is rounded (relative error about 5e-4 in fp16, 4e-3 in bf16), nothing is remembered.
* ``powersgd`` (Vogels, Karimireddy and Jaggi, "PowerSGD", NeurIPS 2019; the algorithm of
  torch's ``ddp_comm_hooks.powerSGD_hook``, whose orthogonalisation and "does compressing pay"
  test are reused): every gradient matrix ``M`` (a parameter viewed as ``shape[0] x rest``,
  :func:`fxpipe.specs.schema.low_rank_view`) plus the error this rank kept from the last step is
  approximated by one power-iteration step warm-started from the last step's ``Q``:
  ``P = M Q``, all-reduce ``P``, orthonormalise ``P``, ``Q = M^T P``, all-reduce ``Q``; the
  average over the group is ``P Q^T / n``. Vectors (biases, norms) and matrices too small to
  shrink travel exactly in the first all-reduce. Error feedback: the rank keeps
  ``M - P Q^T / n`` and adds it to the next step's gradient, so what one step leaves out is sent
  later (the sum of the errors over the group is exactly what the group's average missed).
  ``(rows + cols) x rank`` numbers per matrix instead of ``rows x cols``.
* ``topk`` (Stich, Cordonnier and Jaggi, "Sparsified SGD with memory", NeurIPS 2018; Lin et
  al., "Deep Gradient Compression", ICLR 2018): every rank sends the ``k = ceil(ratio x N)``
  entries of (gradient + error) of largest magnitude as (value, index) pairs, gathered by every
  rank of the group (``all_gather``: the ranks pick different entries); the average is their sum
  / ``divisor``. The entries not sent stay in the rank's error for the next step.

Both lossy methods all-reduce exactly (fp32) for a bucket's first ``warmup_steps`` launches.

Overlap: :meth:`launch` only starts work (PowerSGD's first all-reduce, top-k's all-gather), the
executor launches a bucket right after its stage's last backward, and the rank goes on with
its other stages' work; PowerSGD's second round starts in :meth:`progress`, which the
synchroniser calls for every bucket in launch order once the step's launches are done (the same
point on every rank, so collectives on one group are issued in the same order everywhere).

``bytes_sent``: the bytes this rank puts on the wire for the bucket under the ring algorithms:
an all-reduce of ``S`` bytes over ``n`` ranks sends ``2 (n-1)/n x S``, an all-gather of ``S``
bytes per rank ``(n-1) x S``.

An fp16 step skipped for inf/NaN gradients (loss scaling) calls :meth:`end_step` with
``applied=False``: the error memory and ``Q`` go back to what they were before the step.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
# torch's PowerSGD helpers (used by its DDP hook): Gram-Schmidt / QR of a batch of matrices,
# and whether a rank-r approximation of an n x m matrix sends fewer numbers
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (_orthogonalize,
                                                                      _should_compress)

from fxpipe.errors import RuntimeFailure
from fxpipe.specs.schema import GRAD_COMPRESSIONS, CompressionSpec, low_rank_view

__all__ = ["Compression", "as_compression", "bucket_bytes_sent", "make_reducer",
           "ring_allreduce_bytes", "ring_allgather_bytes"]

_DEFAULTS = CompressionSpec()
#: a matrix is compressed when it shrinks at least this much (torch's ``min_compression_rate``)
MIN_COMPRESSION_RATE = 2.0
#: added to column norms when orthonormalising P and Q, so an all-zero column gives zeros, not
#: NaN (torch's ``orthogonalization_epsilon``)
ORTHO_EPSILON = 1e-8
#: seed of the initial Q (the same on every rank of a group, as torch's PowerSGD requires)
Q_SEED = 0
_WIRE16 = {"fp16": torch.float16, "bf16": torch.bfloat16}
#: the all-gather into one tensor: ``all_gather_single`` where torch has it (2.13), else its
#: older name ``all_gather_into_tensor`` (deprecated in 2.13, the only one in 2.11)
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class Compression:
    """A gradient compression: ``method`` (``train.grad_compression``) and its settings
    (``train.compression``; defaults as :class:`~fxpipe.specs.schema.CompressionSpec`).

    Raises:
        RuntimeFailure: an unknown method, a rank below 1, a ratio outside (0, 1], negative
            warm-up steps.
    """

    method: str = "none"
    rank: int = _DEFAULTS.rank
    ratio: float = _DEFAULTS.ratio
    warmup_steps: int = _DEFAULTS.warmup_steps

    def __post_init__(self) -> None:
        if self.method not in GRAD_COMPRESSIONS:
            raise RuntimeFailure(f"gradient compression {self.method!r} is unknown; use one of "
                                 f"{list(GRAD_COMPRESSIONS)}")
        if not (isinstance(self.rank, int) and self.rank >= 1):
            raise RuntimeFailure(f"PowerSGD rank must be a positive integer, got {self.rank!r}")
        if not (isinstance(self.ratio, (int, float)) and 0 < self.ratio <= 1):
            raise RuntimeFailure(f"top-k ratio must be in (0, 1], got {self.ratio!r}")
        if not (isinstance(self.warmup_steps, int) and self.warmup_steps >= 0):
            raise RuntimeFailure(f"compression warm-up steps must be >= 0, got "
                                 f"{self.warmup_steps!r}")

    @property
    def exact(self) -> bool:
        """Whether the all-reduce is exact (``none``)."""
        return self.method == "none"

    @classmethod
    def from_train(cls, train) -> "Compression":
        """From a spec's ``train`` section (``grad_compression`` and ``compression``)."""
        c = train.compression
        return cls(train.grad_compression, c.rank, c.ratio, c.warmup_steps)


def as_compression(c: "str | Compression") -> Compression:
    """A method name (default settings) or a :class:`Compression` as it is."""
    return c if isinstance(c, Compression) else Compression(c)


def ring_allreduce_bytes(nbytes: int, n: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``nbytes`` over ``n`` ranks."""
    return round(2 * (n - 1) * nbytes / n) if n > 1 else 0


def ring_allgather_bytes(nbytes: int, n: int) -> int:
    """Bytes one rank sends in a ring all-gather of ``nbytes`` per rank over ``n`` ranks."""
    return (n - 1) * nbytes


def bucket_bytes_sent(compression: "str | Compression", shapes: Sequence[Sequence[int]],
                      n: int, element_size: int = 4) -> int:
    """Bytes one rank sends per step for a bucket of gradients of ``shapes`` over ``n`` ranks
    once compressing (after ``warmup_steps``), as the reducers count their ``bytes_sent``:
    ``none`` the ring all-reduce of the fp32 bucket, ``fp16`` / ``bf16`` of half of it,
    ``powersgd`` the all-reduce of the exact tensors with every compressed matrix's ``P``
    (rows x rank) then that of the ``Q`` (cols x rank), ``topk`` the all-gather of ``k`` values
    and ``k`` int32 indices. What the simulator prices (:func:`~fxpipe.schedule.simulate.
    simulate_plan`)."""
    c = as_compression(compression)
    numel = sum(math.prod(s) for s in shapes)
    if c.method in _WIRE16:
        return ring_allreduce_bytes(numel * 2, n)
    if c.method == "topk":
        k = max(1, min(numel, math.ceil(c.ratio * numel))) if numel else 0
        return ring_allgather_bytes(8 * k, n)
    if c.method == "powersgd":
        first = second = 0
        for shape in shapes:
            view = low_rank_view(torch.Size(shape))
            if view is not None and min(view) >= c.rank and \
                    _should_compress(*view, c.rank, MIN_COMPRESSION_RATE)[0]:
                first += view[0] * c.rank
                second += view[1] * c.rank
            else:
                first += math.prod(shape)
        if not second:  # nothing to compress: the exact all-reduce
            return ring_allreduce_bytes(numel * element_size, n)
        return (ring_allreduce_bytes(first * element_size, n)
                + ring_allreduce_bytes(second * element_size, n))
    return ring_allreduce_bytes(numel * element_size, n)


def _wait(work, timeout_s: float) -> None:
    work.wait(datetime.timedelta(seconds=timeout_s))


class _AllReduce:
    """fp32 (exact) or 16-bit all-reduce of the whole flat buffer."""

    def __init__(self, group, divisor: float, wire: torch.dtype | None = None):
        self.group, self.divisor, self.wire = group, float(divisor), wire
        self.size = dist.get_world_size(group)
        self.bytes_sent = 0
        self._work = self._flat = None
        self._dtype = torch.float32

    def launch(self, flat: torch.Tensor) -> None:
        self._dtype = flat.dtype
        if self.wire is not None:
            flat = flat.div_(self.divisor).to(self.wire)
        self._flat = flat
        self.bytes_sent = ring_allreduce_bytes(flat.numel() * flat.element_size(), self.size)
        self._work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group,
                                     async_op=True)

    def progress(self, timeout_s: float) -> None:
        pass

    def result(self, timeout_s: float) -> torch.Tensor:
        _wait(self._work, timeout_s)
        flat, self._flat, self._work = self._flat, None, None
        return flat.to(self._dtype) if self.wire is not None else flat.div_(self.divisor)

    def end_step(self, applied: bool) -> None:
        pass

    def residual(self) -> torch.Tensor | None:
        return None


class _Warmed:
    """Counts a lossy reducer's launches; the first ``warmup_steps`` go to an exact all-reduce."""

    def __init__(self, group, divisor: float, warmup_steps: int):
        self.group, self.divisor = group, float(divisor)
        self.size = dist.get_world_size(group)
        self.warmup_steps = warmup_steps
        self.launches = 0
        self.bytes_sent = 0
        self._exact = _AllReduce(group, divisor)
        self._warm = False
        self._undo = None
        #: the gradients' device (CUDA under NCCL): every buffer and error memory lives there
        self._device = torch.device("cpu")

    def _start(self, flat: torch.Tensor) -> bool:
        """Count a launch of ``flat``; True when this one is still in the warm-up (exact)."""
        self._device = flat.device
        self.launches += 1
        self._undo = None
        self._warm = self.launches <= self.warmup_steps
        return self._warm

    def end_step(self, applied: bool) -> None:
        if not applied and self._undo is not None:
            self._restore(self._undo)
        self._undo = None

    def _restore(self, state) -> None:  # pragma: no cover - overridden
        raise NotImplementedError


class _PowerSGD(_Warmed):
    """Low-rank compression with error feedback and warm start (see the module docstring)."""

    def __init__(self, shapes: Sequence[torch.Size], group, divisor: float, rank: int,
                 warmup_steps: int):
        super().__init__(group, divisor, warmup_steps)
        self.rank = rank
        self._exact_spans: list[tuple[int, int]] = []
        self._groups: dict[tuple[int, int], list[int]] = {}  # (rows, cols) -> offsets
        offset = 0
        for shape in shapes:
            numel = math.prod(shape)
            view = low_rank_view(shape)
            if view is not None and min(view) < rank:
                raise RuntimeFailure(
                    f"PowerSGD rank {rank} is larger than the smaller side of a "
                    f"{view[0]} x {view[1]} gradient matrix (parameter shape {tuple(shape)}); "
                    f"set train.compression.rank to at most {min(view)}")
            if view is not None and _should_compress(*view, rank, MIN_COMPRESSION_RATE)[0]:
                self._groups.setdefault(view, []).append(offset)
            else:
                self._exact_spans.append((offset, numel))
            offset += numel
        self.numel = offset
        self._q: dict[tuple[int, int], torch.Tensor] = {}
        self._error: dict[tuple[int, int], torch.Tensor] = {}
        self._gen = torch.Generator().manual_seed(Q_SEED)
        self._phase = 0

    def launch(self, flat: torch.Tensor) -> None:
        if self._start(flat) or not self._groups:
            self._warm = True
            self._exact.launch(flat)
            self.bytes_sent = self._exact.bytes_sent
            return
        self._dtype = flat.dtype
        self._m, self._p = {}, {}
        parts = [flat[o:o + k] for o, k in self._exact_spans]
        for view, offsets in self._groups.items():
            rows, cols = view
            m = torch.stack([flat[o:o + rows * cols].view(rows, cols) for o in offsets])
            if view in self._error:
                m.add_(self._error[view])
            q = self._q.get(view)
            if q is None:
                # drawn on the CPU (the same seeded Q on every rank, whatever its device),
                # then moved to the gradients' device
                q = torch.randn(len(offsets), cols, self.rank, generator=self._gen,
                                dtype=torch.float32).to(device=m.device, dtype=m.dtype)
            else:
                q = q.clone()
            _orthogonalize(q, ORTHO_EPSILON)
            self._m[view] = m
            parts.append(torch.bmm(m, q).reshape(-1))
        buf = torch.cat(parts) if parts else flat.new_zeros(0)
        self._buf1 = buf
        self.bytes_sent = ring_allreduce_bytes(buf.numel() * buf.element_size(), self.size)
        self._work = dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self._phase = 1

    def progress(self, timeout_s: float) -> None:
        if self._warm or self._phase != 1:
            return
        _wait(self._work, timeout_s)
        buf, at = self._buf1, sum(k for _, k in self._exact_spans)
        qs = []
        for view, offsets in self._groups.items():
            rows, _ = view
            n = len(offsets) * rows * self.rank
            p = buf[at:at + n].view(len(offsets), rows, self.rank)
            at += n
            _orthogonalize(p, ORTHO_EPSILON)
            self._p[view] = p
            qs.append(torch.bmm(self._m[view].transpose(1, 2), p).reshape(-1))
        self._buf2 = torch.cat(qs)
        self.bytes_sent += ring_allreduce_bytes(self._buf2.numel() * self._buf2.element_size(),
                                                self.size)
        self._work = dist.all_reduce(self._buf2, op=dist.ReduceOp.SUM, group=self.group,
                                     async_op=True)
        self._phase = 2

    def result(self, timeout_s: float) -> torch.Tensor:
        if self._warm:
            return self._exact.result(timeout_s)
        self.progress(timeout_s)
        _wait(self._work, timeout_s)
        out = torch.empty(self.numel, dtype=self._dtype, device=self._device)
        at = 0
        for o, k in self._exact_spans:
            out[o:o + k] = self._buf1[at:at + k] / self.divisor
            at += k
        self._undo = (dict(self._error), dict(self._q))
        at, to_result = 0, self.size / self.divisor
        for view, offsets in self._groups.items():
            rows, cols = view
            n = len(offsets) * cols * self.rank
            q = self._buf2[at:at + n].view(len(offsets), cols, self.rank).div_(self.size)
            at += n
            mean = torch.bmm(self._p[view], q.transpose(1, 2))  # the group's average of M
            self._error[view] = self._m[view] - mean
            self._q[view] = q
            mean.mul_(to_result)
            for i, o in enumerate(offsets):
                out[o:o + rows * cols] = mean[i].reshape(-1)
        self._m = self._p = self._buf1 = self._buf2 = self._work = None
        self._phase = 0
        return out

    def _restore(self, state) -> None:
        self._error, self._q = state

    def residual(self) -> torch.Tensor:
        out = torch.zeros(self.numel, device=self._device)
        for view, offsets in self._groups.items():
            if view in self._error:
                for i, o in enumerate(offsets):
                    out[o:o + view[0] * view[1]] = self._error[view][i].reshape(-1)
        return out


class _TopK(_Warmed):
    """Top-k sparsification with error feedback (see the module docstring)."""

    def __init__(self, numel: int, group, divisor: float, ratio: float, warmup_steps: int):
        super().__init__(group, divisor, warmup_steps)
        self.numel = numel
        self.k = max(1, min(numel, math.ceil(ratio * numel)))
        self._error: torch.Tensor | None = None

    def launch(self, flat: torch.Tensor) -> None:
        if self._start(flat):
            self._exact.launch(flat)
            self.bytes_sent = self._exact.bytes_sent
            return
        self._dtype = flat.dtype
        acc = flat if self._error is None else flat.add_(self._error)  # flat is our own copy
        idx = acc.abs().topk(self.k, sorted=False).indices
        values = acc[idx].to(torch.float32)
        self._undo = (self._error,)
        acc[idx] = 0  # what is not sent stays for the next step
        self._error = acc
        payload = torch.cat([values.view(torch.int32), idx.to(torch.int32)])
        self._out = torch.empty(self.size * payload.numel(), dtype=torch.int32,
                                device=payload.device)
        self.bytes_sent = ring_allgather_bytes(payload.numel() * 4, self.size)
        self._work = _ALL_GATHER(self._out, payload, group=self.group, async_op=True)

    def progress(self, timeout_s: float) -> None:
        pass

    def result(self, timeout_s: float) -> torch.Tensor:
        if self._warm:
            return self._exact.result(timeout_s)
        _wait(self._work, timeout_s)
        got = self._out.view(self.size, 2, self.k)
        values = got[:, 0].contiguous().view(torch.float32).reshape(-1)
        idx = got[:, 1].reshape(-1).to(torch.int64)
        dense = torch.zeros(self.numel, dtype=torch.float32,
                            device=values.device).index_add_(0, idx, values)
        self._out = self._work = None
        return dense.div_(self.divisor).to(self._dtype)

    def _restore(self, state) -> None:
        (self._error,) = state

    def residual(self) -> torch.Tensor:
        return (torch.zeros(self.numel, device=self._device) if self._error is None
                else self._error.clone())


def make_reducer(compression: Compression, shapes: Sequence[torch.Size], group, divisor: float):
    """The reducer of one bucket whose flat buffer holds tensors of ``shapes`` in order:
    ``launch(flat)`` (takes ownership of ``flat``), ``progress(timeout_s)``,
    ``result(timeout_s) -> flat average``, ``end_step(applied)``, ``bytes_sent`` and
    ``residual()`` (the flat error memory this rank still owes the group; None when exact).

    Raises:
        RuntimeFailure: PowerSGD with a rank larger than a matrix's smaller side.
    """
    m = compression.method
    if m == "powersgd":
        return _PowerSGD(shapes, group, divisor, compression.rank, compression.warmup_steps)
    if m == "topk":
        return _TopK(sum(math.prod(s) for s in shapes), group, divisor, compression.ratio,
                     compression.warmup_steps)
    return _AllReduce(group, divisor, _WIRE16.get(m))
