"""Data-parallel gradient synchronisation without DDP: flat, asynchronous all-reduces (exact, or
compressed by :mod:`fxpipe.runtime.compression`).

Each stage's gradients are averaged over its data-parallel group once per step, started right
after the stage's last backward (the ``ALLREDUCE`` action) so the other stages of the rank keep
computing while the all-reduce runs (the overlap DDP gets from its bucket hooks; Li et al.,
"PyTorch Distributed", VLDB 2020). Parameters used by several stages (tied embedding / head) are
summed over every rank holding them in every replica and divided by the number of replicas
(Megatron-LM's embedding all-reduce), so the result equals single-process training.

DDP is deliberately not used: in torch 2.13 DDP composed with pipeline schedules asserts at the
second GPipe step and gives wrong gradients with ``static_graph=True`` (see FIELD-NOTES).

What a bucket sends (exact fp32, 16-bit casts, PowerSGD, top-k) is its reducer's job
(:mod:`fxpipe.runtime.compression`); a bucket of the same parameters is reused step after step,
so a compression's error feedback carries over.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from fxpipe.errors import RuntimeFailure, comm_error_text, failed_how
from fxpipe.runtime.compression import Compression, as_compression, make_reducer
from fxpipe.runtime.p2p import describe_peers


class GradBucket:
    """The gradients of a fixed list of parameters, all-reduced as one flat buffer.

    The buffer layout is the list order, so every rank of ``group`` must build its bucket from the
    same parameters (same shapes) in the same order, and launch its buckets in the same order.

    Args:
        name: label used in error messages (e.g. ``"stage 1 data-parallel"``).
        params: parameters whose ``.grad`` is reduced. A missing ``.grad`` counts as zeros.
        group: process group (``None``: a group of one rank; nothing is communicated, the
            gradient is only divided by ``divisor``).
        divisor: the summed gradient is divided by this (the number of replicas).
        compression: ``"none"`` (exact, fp32 sum), ``"fp16"`` / ``"bf16"`` (the flat buffer is
            pre-divided and cast to 16 bits: half the bytes, not exact), ``"powersgd"`` /
            ``"topk"``, or a :class:`~fxpipe.runtime.compression.Compression` with settings.

    Attributes:
        bytes_sent: bytes this rank sent for the bucket's last all-reduce (ring algorithm).

    Raises:
        RuntimeFailure: unknown compression, or a PowerSGD rank larger than a matrix's side.
    """

    def __init__(self, name: str, params: Sequence[torch.nn.Parameter], group, divisor: float,
                 compression: "str | Compression" = "none"):
        self.name, self.params, self.group = name, list(params), group
        self.divisor, self.compression = float(divisor), as_compression(compression)
        self._reducer = (make_reducer(self.compression, [p.shape for p in self.params], group,
                                      divisor) if group is not None and self.params else None)
        self._busy = False
        self.launched = False
        self.bytes_sent = 0
        self.nbytes = sum(p.numel() * p.element_size() for p in self.params)
        #: the other global ranks of the all-reduce (named when it fails)
        self.peers = ([r for r in dist.get_process_group_ranks(group) if r != dist.get_rank()]
                      if group is not None else [])

    def launch(self) -> None:
        """Flatten the gradients and start the asynchronous all-reduce (SUM) of the bucket."""
        if self.launched:
            return
        self.launched = True
        if not self.params:
            return
        if self.group is None:
            if self.divisor != 1.0:
                for p in self.params:
                    if p.grad is not None:
                        p.grad.div_(self.divisor)
            return
        flat = torch.cat([
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
            for p in self.params
        ])
        self._reducer.launch(flat)
        self._busy = True

    def _failed(self, e: Exception, timeout_s: float) -> RuntimeFailure:
        who, logs = describe_peers(self.peers)
        return RuntimeFailure(
            f"{self.name} gradient all-reduce ({self.nbytes} bytes) with {who} "
            f"{failed_how(e, timeout_s)}: {comm_error_text(e)}. Check {logs}; raise "
            "train.timeout_s if a peer is only slow")

    def progress(self, timeout_s: float) -> None:
        """Start a multi-round compression's next round (PowerSGD's second all-reduce); call
        on every rank of the group at the same point, in the buckets' launch order.

        Raises:
            RuntimeFailure: the first round failed or timed out.
        """
        if self._busy:
            try:
                self._reducer.progress(timeout_s)
            except Exception as e:  # gloo/NCCL raise RuntimeError / DistBackendError
                raise self._failed(e, timeout_s) from None

    def wait(self, timeout_s: float) -> None:
        """Wait for the all-reduce and write the averaged gradient back into every ``.grad``.

        Raises:
            RuntimeFailure: a member of the group did not join within ``timeout_s`` seconds,
                or the group failed (a peer died).
        """
        if not self.launched:
            raise RuntimeFailure(f"{self.name} all-reduce waited before it was launched (bug)")
        if not self._busy:
            return
        try:
            flat = self._reducer.result(timeout_s)
        except Exception as e:  # gloo/NCCL raise RuntimeError / DistBackendError
            raise self._failed(e, timeout_s) from None
        self._busy = False
        self.bytes_sent = self._reducer.bytes_sent
        offset = 0
        for p in self.params:
            n = p.numel()
            g = flat[offset:offset + n].view_as(p)
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)
            offset += n

    def end_step(self, applied: bool) -> None:
        """The step's gradients were applied, or (``applied=False``: an fp16 step skipped for
        inf/NaN gradients) dropped: then the compression's error memory is rolled back."""
        if self._reducer is not None:
            self._reducer.end_step(applied)

    def residual(self) -> torch.Tensor | None:
        """The error memory of a compression with error feedback (what this rank's gradients
        still owe the group, flat, in parameter order); None when nothing is kept."""
        return self._reducer.residual() if self._reducer is not None else None

    def reset(self) -> None:
        """Forget this step's state (call after the optimizer step)."""
        self.launched = False
        self._busy = False
        self.bytes_sent = 0


class GradSynchronizer:
    """Launches each parameter's all-reduce once all of this rank's stages that use it are done
    (the all-reduce :class:`~fxpipe.runtime.grad_reducer.GradReducer`).

    Args:
        stage_params: local stage index -> its parameters (objects; a parameter held by two local
            stages, e.g. a tied weight in a V placement, appears under both and is reduced once).
        shared: parameter object id -> (pipeline ranks holding it, its name), for parameters the
            plan lists as shared between stages; reduced over ``mesh.replica_group(ranks)``.
        mesh: the :class:`~fxpipe.runtime.mesh.Mesh` (its ``dp_group`` reduces the others).
        compression: see :class:`GradBucket`.

    Order of launches is deterministic (the order of :meth:`stage_done` calls, parameters in module
    order), so replicas running the same action list launch matching buckets. A bucket is kept
    for the same parameters step after step (a compression's error memory lives in it).
    """

    def __init__(self, stage_params: dict[int, list[torch.nn.Parameter]],
                 shared: dict[int, tuple[tuple[int, ...], str]], mesh,
                 compression: "str | Compression" = "none"):
        self.mesh, self.compression = mesh, as_compression(compression)
        self._users: dict[int, set[int]] = {}
        self._param: dict[int, torch.nn.Parameter] = {}
        self._order: list[int] = []
        for s in sorted(stage_params):
            for p in stage_params[s]:
                if not p.requires_grad:
                    continue
                if id(p) not in self._param:
                    self._param[id(p)] = p
                    self._order.append(id(p))
                self._users.setdefault(id(p), set()).add(s)
        self._shared = {pid: v for pid, v in shared.items() if pid in self._param}
        # One bucket per shared group (all its parameters, sorted by name: same layout on all
        # members), launched once every local user of every parameter in it is done.
        by_key: dict[tuple[int, ...], list[tuple[str, int]]] = {}
        for pid, (key, name) in self._shared.items():
            by_key.setdefault(key, []).append((name, pid))
        self._shared_buckets: list[tuple[set[int], GradBucket]] = []
        for key in sorted(by_key):
            entries = sorted(by_key[key])
            users = set().union(*(self._users[pid] for _, pid in entries))
            bucket = GradBucket(f"shared parameters {[n for n, _ in entries]} (pipeline ranks "
                                f"{list(key)})", [self._param[pid] for _, pid in entries],
                                mesh.replica_group(key), mesh.dp, compression)
            self._shared_buckets.append((users, bucket))
        self._buckets: list[GradBucket] = []
        self._dp_buckets: dict[tuple[int, ...], GradBucket] = {}  # by parameter ids, all steps
        self._done: set[int] = set()
        self._launched_params: set[int] = set()

    @property
    def buckets(self) -> list[GradBucket]:
        """All buckets launched this step plus the shared ones."""
        return self._buckets + [b for _, b in self._shared_buckets]

    def stage_done(self, stage: int) -> None:
        """``stage`` finished its last backward this step: launch every bucket that became ready."""
        self._done.add(stage)
        ready = [pid for pid in self._order
                 if pid not in self._launched_params and pid not in self._shared
                 and self._users[pid] <= self._done]
        self._launched_params.update(ready)
        experts = [p for p in ready if getattr(self._param[p], "fxpipe_expert", False)]
        ready = [p for p in ready if p not in set(experts)]
        # an expert's gradient already sums its group's tokens: summed over the replicas
        # holding the same experts, divided by all replicas (the batch mean)
        for ids, group, what in ((ready, self.mesh.dp_group, "data-parallel"),
                                 (experts, getattr(self.mesh, "expert_dp_group", None),
                                  "expert-replica")):
            if not ids:
                continue
            key = tuple(ids)
            bucket = self._dp_buckets.get(key)
            if bucket is None:
                bucket = self._dp_buckets[key] = GradBucket(
                    f"stage {stage} {what}", [self._param[p] for p in ids], group,
                    self.mesh.dp, self.compression)
            bucket.launch()
            self._buckets.append(bucket)
        for users, bucket in self._shared_buckets:
            if not bucket.launched and users <= self._done:
                bucket.launch()

    def finish(self, timeout_s: float) -> None:
        """Launch whatever is left (stages without an ``ALLREDUCE`` action), start every
        bucket's next round (PowerSGD), in launch order, then wait for all.

        Raises:
            RuntimeFailure: an all-reduce timed out or failed.
        """
        for s in sorted(set().union(*self._users.values()) - self._done) if self._users else []:
            self.stage_done(s)
        for _, bucket in self._shared_buckets:
            bucket.launch()
        for bucket in self.buckets:
            bucket.progress(timeout_s)
        for bucket in self.buckets:
            bucket.wait(timeout_s)

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank sent for this step's all-reduces (after :meth:`finish`)."""
        return sum(b.bytes_sent for b in self.buckets)

    def take_bytes(self) -> int:
        """:attr:`bytes_sent`, counted once: the buckets' counts restart at 0."""
        total = self.bytes_sent
        for bucket in self.buckets:
            bucket.bytes_sent = 0
        return total

    def pending(self) -> list[torch.Tensor]:
        """Nothing: the averaged gradients are in ``.grad`` once :meth:`finish` returns."""
        return []

    def commit(self, applied: bool = True) -> None:
        """After :meth:`finish`: the step's gradients were applied, or dropped (an fp16 step
        skipped for inf/NaN gradients; the compressions' error memory is rolled back)."""
        for bucket in self.buckets:
            bucket.end_step(applied)

    def ensure_gathered(self, timeout_s: float) -> None:
        """Nothing: every replica keeps its whole parameters."""

    def reset(self) -> None:
        """Start a new step."""
        for bucket in self.buckets:
            bucket.reset()
        self._buckets = []
        self._done = set()
        self._launched_params = set()
