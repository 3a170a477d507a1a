"""Data-parallel gradient synchronisation without DDP: flat, asynchronous, exact all-reduces.

Each stage's gradients are averaged over its data-parallel group once per step, started right
after the stage's last backward (the ``ALLREDUCE`` action) so the other stages of the rank keep
computing while the all-reduce runs (the overlap DDP gets from its bucket hooks; Li et al.,
"PyTorch Distributed", VLDB 2020). Parameters used by several stages (tied embedding / head) are
summed over every rank holding them in every replica and divided by the number of replicas
(Megatron-LM's embedding all-reduce), so the result equals single-process training.

DDP is deliberately not used: in torch 2.13 DDP composed with pipeline schedules asserts at the
second GPipe step and gives wrong gradients with ``static_graph=True`` (see FIELD-NOTES).
"""

from __future__ import annotations

import datetime
from typing import Sequence

import torch
import torch.distributed as dist

from fxpipe.errors import RuntimeFailure

COMPRESSIONS = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}


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
        compression: ``"none"`` (exact, fp32 sum), ``"fp16"`` or ``"bf16"`` (the flat buffer is
            pre-divided and cast to 16 bits for the all-reduce: half the bytes, not exact).
    """

    def __init__(self, name: str, params: Sequence[torch.nn.Parameter], group, divisor: float,
                 compression: str = "none"):
        if compression not in COMPRESSIONS:
            raise RuntimeFailure(
                f"gradient compression {compression!r} is unknown; use one of "
                f"{sorted(COMPRESSIONS)}")
        self.name, self.params, self.group = name, list(params), group
        self.divisor, self.compression = float(divisor), compression
        self._work = None
        self._flat: torch.Tensor | None = None
        self.launched = False
        self.nbytes = sum(p.numel() * p.element_size() for p in self.params)

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
        wire = COMPRESSIONS[self.compression]
        if wire is not None:
            flat = flat.div_(self.divisor).to(wire)
        self._flat = flat
        self._work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

    def wait(self, timeout_s: float) -> None:
        """Wait for the all-reduce and write the averaged gradient back into every ``.grad``.

        Raises:
            RuntimeFailure: a member of the group did not join within ``timeout_s`` seconds,
                or the group failed (a peer died).
        """
        if not self.launched:
            raise RuntimeFailure(f"{self.name} all-reduce waited before it was launched (bug)")
        if self._work is None:
            return
        try:
            self._work.wait(datetime.timedelta(seconds=timeout_s))
        except Exception as e:  # gloo/NCCL raise RuntimeError / DistBackendError
            raise RuntimeFailure(
                f"{self.name} gradient all-reduce ({self.nbytes} bytes) failed or timed out after "
                f"{timeout_s:g} s: {e}. Check the other ranks' logs; raise train.timeout_s if a "
                "peer is only slow") from None
        flat = self._flat
        if COMPRESSIONS[self.compression] is not None:
            flat = flat.to(self.params[0].dtype)
        else:
            flat.div_(self.divisor)
        offset = 0
        for p in self.params:
            n = p.numel()
            g = flat[offset:offset + n].view_as(p)
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)
            offset += n
        self._work = None
        self._flat = None

    def reset(self) -> None:
        """Forget this step's state (call after the optimizer step)."""
        self.launched = False
        self._work = None
        self._flat = None


class GradSynchronizer:
    """Launches each parameter's all-reduce once all of this rank's stages that use it are done.

    Args:
        stage_params: local stage index -> its parameters (objects; a parameter held by two local
            stages, e.g. a tied weight in a V placement, appears under both and is reduced once).
        shared: parameter object id -> (pipeline ranks holding it, its name), for parameters the
            plan lists as shared between stages; reduced over ``mesh.replica_group(ranks)``.
        mesh: the :class:`~fxpipe.runtime.mesh.Mesh` (its ``dp_group`` reduces the others).
        compression: see :class:`GradBucket`.

    Order of launches is deterministic (the order of :meth:`stage_done` calls, parameters in module
    order), so replicas running the same action list launch matching buckets.
    """

    def __init__(self, stage_params: dict[int, list[torch.nn.Parameter]],
                 shared: dict[int, tuple[tuple[int, ...], str]], mesh, compression: str = "none"):
        self.mesh, self.compression = mesh, compression
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
        if ready:
            self._launched_params.update(ready)
            bucket = GradBucket(f"stage {stage} data-parallel", [self._param[p] for p in ready],
                                self.mesh.dp_group, self.mesh.dp, self.compression)
            bucket.launch()
            self._buckets.append(bucket)
        for users, bucket in self._shared_buckets:
            if not bucket.launched and users <= self._done:
                bucket.launch()

    def finish(self, timeout_s: float) -> None:
        """Launch whatever is left (stages without an ``ALLREDUCE`` action) and wait for all.

        Raises:
            RuntimeFailure: an all-reduce timed out or failed.
        """
        for s in sorted(set().union(*self._users.values()) - self._done) if self._users else []:
            self.stage_done(s)
        for bucket in self._buckets:
            bucket.wait(timeout_s)
        for _, bucket in self._shared_buckets:
            bucket.launch()
            bucket.wait(timeout_s)

    def reset(self) -> None:
        """Start a new step."""
        self._buckets = []
        self._done = set()
        self._launched_params = set()
        for _, bucket in self._shared_buckets:
            bucket.reset()
