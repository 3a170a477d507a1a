"""The pipeline executor: runs this rank's action list over torch.distributed, exactly.

Every rank holds the stage modules its pipeline rank owns (``schedule.stages_of_rank``) and runs
its action list from the :class:`~fxpipe.schedule.actions.Schedule` once per training step:

* ``F`` - forward of one micro-batch; the stage that produces ``plan.model_output`` also computes
  ``loss_fn(output, target_mb) / m`` (so gradients accumulated over the ``m`` micro-batches equal
  those of the mean loss over the whole batch).
* ``SEND_F``/``RECV_F``/``SEND_B``/``RECV_B`` - point-to-point transfer of the values on the edge
  between two stages (activations forward, their gradients backward), one tensor per value, each
  bounded by the timeout (:mod:`fxpipe.runtime.p2p`). Values that flow between two stages held by
  the same rank (interleaved / V placements) are handed over in memory; comm actions between them
  are no-ops.
* ``B`` - backward. Full (input and weight gradients) unless ``schedule.split_backward``; then
  ``B`` computes input gradients only and ``W`` the weight gradients from the gradients B
  recorded at the edge of the weight-only part of the graph, so no work is done twice
  (:mod:`fxpipe.runtime.backward_split`), as in Zero Bubble Pipeline Parallelism (Qi et al.,
  2023). A value read by several stages receives the SUM of
  their gradients before its producer's backward.
* ``ALLREDUCE`` - start the asynchronous data-parallel all-reduce of the stage's gradients
  (:mod:`fxpipe.runtime.data_parallel`; tied parameters summed across the stages holding them;
  exact, or compressed by :mod:`fxpipe.runtime.compression`).
* ``STEP`` - wait for the all-reduces and outstanding sends, ``optimizer.step()``, clear gradients
  (with ``optimizer=None`` the gradients stay in ``.grad`` and accumulate over steps).

:meth:`PipelineExecutor.evaluate` runs the forward actions only (``F``, ``SEND_F``, ``RECV_F``,
in the schedule's order) without gradients: the batch's loss for evaluation.

Mixed precision (``precision="bf16"``/``"fp16"``, :mod:`fxpipe.runtime.precision`): each stage's
forward and the loss run under ``torch.autocast(device.type, dtype)``; parameters, gradients and
the optimizer stay fp32. Every fp32 value (in the plan, ``ValueInfo.dtype``) that goes from one
stage to another travels in the 16-bit dtype, and so does its gradient on the way back
(:func:`~fxpipe.runtime.precision.message_dtype`; integer and bool values as they are): half
the bytes. The receiver casts it back to the plan dtype, so its stage computes as planned; a
value handed over in memory (two stages on one rank) is rounded the same way, so the numbers do
not depend on the placement. fp16 adds
dynamic loss scaling (``torch.amp.GradScaler`` semantics): the loss is multiplied by the scale
before the backward, each gradient is divided by it before its data-parallel all-reduce, and a
step with an inf/NaN gradient on any rank is skipped on every rank (one extra world all-reduce
of a flag per step) while the scale backs off.

Activations of a micro-batch are released after its last backward (``B``, or ``W`` when split).
The executor counts the micro-batches whose activations are held per stage (peak in flight) and
the bytes it sends per step (:class:`BytesSent`: stage messages, gradient all-reduces), and
records one wall-clock event per action for Chrome traces.

Weight gradients of ``linear`` / ``addmm`` / ``embedding`` nodes accumulate straight into
``.grad`` over the micro-batches (:mod:`fxpipe.runtime.grad_fusion`; fp32 stages with a full
backward, ``fuse_grad_accumulation=False`` turns it off): no per-micro-batch ``vocab x width``
buffer for a large head or embedding. The schedule format and per-rank action
lists follow torch.distributed.pipelining's ``_Action`` IR; no DDP is used (see data_parallel).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from fxpipe.errors import FxpipeError, PlanError, RuntimeFailure, ScheduleError
from fxpipe.plans.plan import Plan
from fxpipe.plans.values import MODEL_INPUT, needs_grad
from fxpipe.runtime import p2p
from fxpipe.runtime.checks import check_actions, check_fits
from fxpipe.runtime.compression import Compression, as_compression
from fxpipe.runtime.data_parallel import GradSynchronizer
from fxpipe.runtime.data_sharding import WIRE_DTYPES, DataSharding
from fxpipe.runtime.grad_fusion import fuse_weight_grads
from fxpipe.runtime.mesh import Mesh
from fxpipe.runtime.precision import LossScaler, autocast_dtype, found_nonfinite, message_dtype
from fxpipe.runtime.stage import StageWork
from fxpipe.schedule.actions import Action, Op, Schedule
from fxpipe.schedule.timeline import TimelineEvent, action_label

#: receives posted ahead of their RECV action (in list order, so NCCL's per-pair ordering holds):
#: the peer's data then flows while this rank computes, as the simulator assumes, instead of
#: starting only when the RECV is reached. Costs at most this many extra receive buffers.
RECV_LOOKAHEAD = 4

#: one wall-clock event per executed action: ``TimelineEvent(global rank, action_label(action),
#: start_s, end_s, "compute")`` (a tuple, the format of :mod:`fxpipe.schedule.timeline` and the
#: simulator); seconds since the epoch (monotonic within a process), comparable across the ranks
#: of one host. Receives are blocking, so a RECV event spans the wait for the peer.
Event = TimelineEvent


@dataclass
class BytesSent:
    """Bytes one rank sent: ``messages`` (activations and their gradients to the stages of other
    pipeline ranks, point to point) and ``gradients`` (its data-parallel all-reduces, counted as
    the ring algorithms send them: ``2 (n-1)/n x`` the payload of an all-reduce over ``n``
    ranks, ``(n-1) x`` that of an all-gather). The loss and inf/NaN-flag all-reduces (a few
    bytes) are not counted."""

    messages: int = 0
    gradients: int = 0

    @property
    def total(self) -> int:
        """``messages + gradients``."""
        return self.messages + self.gradients


@dataclass
class _StepState:
    """What one step's actions hand each other across stages and ranks."""

    chunks: dict[str, tuple[torch.Tensor, ...]]
    target: tuple[torch.Tensor, ...] | None
    inputs: dict[tuple[int, int], dict[str, torch.Tensor]] = field(default_factory=dict)
    send_grads: dict[tuple[int, int], dict[str, torch.Tensor]] = field(default_factory=dict)
    sends: list[tuple[p2p.Pending, str]] = field(default_factory=list)
    loss_sum: torch.Tensor | None = None
    weights: list[float] | None = None  # per micro-batch; None: 1/m each
    stepped: bool = False
    posted: dict[int, list[tuple[str, p2p.Pending]]] = field(default_factory=dict)  # by index
    index: int = -1  # index of the action being run
    message_bytes: int = 0  # sent to other ranks this step


class PipelineExecutor:
    """Runs a :class:`Schedule` for this rank's stages over torch.distributed.

    Args:
        plan: the Plan (stages' ``inputs``/``outputs``, ``values`` with per-micro-batch shapes and
            dtypes, ``model_inputs``, ``model_output``, ``shared_params``, ``param_aliases``,
            ``pipeline``, ``dp``, ``microbatches``).
        schedule: per-pipeline-rank action lists including communication actions
            (``add_communication``); ``num_ranks == plan.pipeline``.
        stage_modules: stage index -> module for exactly the stages of this rank
            (``schedule.stages_of_rank(mesh.pipe_rank)``). ``module(*inputs)`` takes the values
            named by ``StagePlan.inputs`` in order and returns a tuple in ``StagePlan.outputs``
            order (a bare tensor is accepted for one output); parameters are named by their
            original FQNs (stages of one rank share tied Parameter objects).
        mesh: this rank's :class:`~fxpipe.runtime.mesh.Mesh` (``pipeline``/``dp`` as the plan).
        loss_fn: ``loss_fn(output, target) -> scalar tensor``, mean-reduced over the micro-batch
            (e.g. cross entropy). Called on the stage that produces ``plan.model_output``.
        optimizer: optimizer over this rank's parameters, or ``None`` (then ``STEP`` only
            synchronises gradients and leaves them in ``.grad``, where several steps accumulate
            exactly: each all-reduce sums only its own step's gradients, tied ones included;
            an fp16 step skipped for inf/NaN gradients adds nothing).
        timeout_s: seconds any single wait (receive, send, all-reduce) may take.
        grad_compression: ``"none"`` (exact), ``"fp16"`` / ``"bf16"`` all-reduce payloads,
            ``"powersgd"`` / ``"topk"`` (default settings), or a
            :class:`~fxpipe.runtime.compression.Compression` with its settings (spec
            ``train.grad_compression`` and ``train.compression``).
        precision: ``"fp32"`` (default, exact), ``"bf16"`` or ``"fp16"``: forward and loss under
            ``torch.autocast`` with fp32 master weights (spec ``train.precision``); fp32 values
            sent between stages, and their gradients, travel in the 16-bit dtype.
        loss_scaler: the :class:`~fxpipe.runtime.precision.LossScaler` to use; default a new one
            for ``"fp16"`` and none otherwise (a scaler given with bf16/fp32 is used too).
        needs_target: False when the model computes its own loss (its labels are a model
            input): :meth:`step` then takes ``target=None``.
        sync_gradients: True (default): all-reduce the gradients over the replicas (and sum
            tied ones over the ranks holding them); False (``train.updates: async``): each
            replica keeps its own gradients, which parameter servers sum and apply
            (:mod:`fxpipe.runtime.parameter_server`), and :meth:`step` returns the replica's
            loss, reduced over its pipeline only (no rank waits for another replica).
        fuse_grad_accumulation: True (default): the stage GraphModules' ``linear`` /
            ``addmm`` / ``embedding`` nodes of trained parameters accumulate their weight
            gradients into ``.grad`` in place: the steps run copies of the stage modules
            (:mod:`fxpipe.runtime.grad_fusion`; fp32 and a full backward only) that share their
            parameters; the given modules are not changed.

    Attributes:
        events: one :data:`Event` ``(rank, label, start_s, end_s, lane)`` per executed action,
            all steps; ``fxpipe.schedule.timeline.write_chrome_trace(ex.events, path)`` dumps them.
        peak_inflight: stage -> peak micro-batches with activations held, over all steps.
        last_peak_inflight: the same for the last step.
        step_times_s: wall-clock seconds of each :meth:`step`.
        fused_nodes: stage -> how many nodes accumulate their weight gradients in place.
        step_starts_s: start of each step, same clock as ``events``.
        skipped_steps: indices (0-based, counted by :meth:`step` calls) of the steps whose
            optimizer step was skipped because a gradient was inf/NaN (loss scaling only).
        step_bytes_sent: one :class:`BytesSent` per :meth:`step`; :attr:`bytes_sent` is their
            sum.

    Raises:
        ScheduleError: the schedule does not match the plan (ranks, stages, micro-batches) or lacks
            a forward/backward/send/receive this rank needs.
        RuntimeFailure: mismatch between plan, mesh and modules (the message says which).
    """

    def __init__(self, plan: Plan, schedule: Schedule, stage_modules: dict[int, nn.Module],
                 mesh: Mesh, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 optimizer: torch.optim.Optimizer | None, timeout_s: float = 300.0, *,
                 grad_compression: "str | Compression" = "none", precision: str = "fp32",
                 loss_scaler: LossScaler | None = None, needs_target: bool = True,
                 sync_gradients: bool = True, fuse_grad_accumulation: bool = True,
                 data_sharding: str = "none"):
        self.plan, self.schedule, self.mesh = plan, schedule, mesh
        self.sync_gradients = sync_gradients
        self.precision = precision
        self._amp_dtype = autocast_dtype(precision)  # raises on an unknown precision
        self.loss_scaler = loss_scaler if loss_scaler is not None else (
            LossScaler() if precision == "fp16" else None)
        self.loss_fn, self.optimizer, self.timeout_s = loss_fn, optimizer, float(timeout_s)
        self.needs_target = needs_target
        self.modules = dict(stage_modules)
        self.device = mesh.device
        self.rank = mesh.rank
        self.m = plan.microbatches
        check_fits(plan, schedule, mesh)
        self.local_stages = schedule.stages_of_rank(mesh.pipe_rank)
        if sorted(self.modules) != self.local_stages:
            raise RuntimeFailure(
                f"rank {self.rank} (pipeline rank {mesh.pipe_rank}) holds stages "
                f"{self.local_stages} in the schedule but was given modules for stages "
                f"{sorted(self.modules)}; pass exactly the stages of schedule.stages_of_rank()")
        self.stage_plans = {sp.index: sp for sp in plan.stages}
        try:
            self.edges = plan.stage_edges()
        except PlanError as e:
            raise RuntimeFailure(str(e)) from None
        self._stage_rank = list(schedule.stage_to_rank)
        self._value_index = {name: i for i, name in enumerate(sorted(plan.values))}
        self._dtypes = {name: getattr(torch, v.dtype) for name, v in plan.values.items()}
        #: the dtype each value (and its gradient) travels in between stages
        self._wire = {name: message_dtype(d, precision) for name, d in self._dtypes.items()}
        self._model_inputs = set(plan.model_inputs) | {
            n for n, v in plan.values.items() if v.producer == MODEL_INPUT}
        # consumers of each value = stages whose inputs name it (gradient contributions to sum)
        self._consumers: dict[str, list[int]] = {}
        for (_, t), names in self.edges.items():
            for n in names:
                self._consumers.setdefault(n, []).append(t)
        self.loss_stage = self._find_loss_stage(plan)
        self._split = bool(schedule.split_backward)
        # the modules the training steps run: copies whose weight gradients accumulate in place
        # (runtime.grad_fusion), fp32 and a full backward only; self.modules stay as given
        run = {s: (fuse_weight_grads(self.modules[s]) if fuse_grad_accumulation
                   and not self._split and self._amp_dtype is None else (self.modules[s], 0))
               for s in self.local_stages}
        #: stage -> nodes whose weight gradients accumulate in place
        self.fused_nodes = {s: n for s, (_, n) in run.items()}
        check_actions(schedule, mesh.pipe_rank, self.local_stages, self.edges, self._dtypes)
        self.work = {s: StageWork(self.stage_plans[s], run[s][0], plan.values,
                                  self._consumers, self._split, self._autocast,
                                  lambda i: self._ctx(self._action),
                                  plan.model_output if s == self.loss_stage else None)
                     for s in self.local_stages}
        self._stage_params = {s: w.params for s, w in self.work.items()}
        shared = self._shared_map() if sync_gradients else {}
        #: parameter object id -> (pipeline ranks holding it, canonical FQN), for the tied /
        #: shared parameters of this rank's stages (their gradient is summed over those ranks)
        self.shared_param_ranks = dict(shared)
        self.compression = as_compression(grad_compression)
        #: sharded data parallelism (:mod:`fxpipe.runtime.data_sharding`), or None: the
        #: replicas reduce-scatter the non-shared parameters' gradients instead
        self.sharding: DataSharding | None = None
        whole = self._stage_params
        if data_sharding != "none" and sync_gradients and mesh.dp > 1:
            if self.compression.method not in WIRE_DTYPES:
                raise RuntimeFailure(f"sharded data parallelism reduce-scatters its gradients: "
                                     f"gradient compression {self.compression.method!r} does not "
                                     f"fit it (use one of {sorted(WIRE_DTYPES)})")
            self.sharding = DataSharding(data_sharding, self._stage_params, set(shared),
                                         mesh.dp_group, mesh.dp, mesh.dp_rank,
                                         WIRE_DTYPES[self.compression.method])
            whole = {s: [p for p in ps if not self.sharding.owns(p)]
                     for s, ps in self._stage_params.items()}
        # without all-reduce: a mesh view with no data-parallel group (buckets only collect)
        self._sync = GradSynchronizer(whole, shared, mesh if sync_gradients else
                                      SimpleNamespace(dp=1, dp_group=None), self.compression)
        # stages whose ALLREDUCE the schedule leaves out: launched after their last backward
        self._auto_reduce_after: dict[int, int] = {}
        self._labels = [action_label(a) for a in schedule.actions[mesh.pipe_rank]]  # for events
        self._handlers = {Op.F: self._forward, Op.B: self._backward, Op.W: self._weight,
                          Op.SEND_F: self._send_f, Op.RECV_F: self._recv_f,
                          Op.SEND_B: self._send_b, Op.RECV_B: self._recv_b,
                          Op.ALLREDUCE: self._allreduce,
                          Op.STEP: lambda a, st: self._finish_step(st, a)}
        # list positions of this rank's cross-rank receives (pre-posted, see RECV_LOOKAHEAD)
        self._recv_positions = [
            k for k, a in enumerate(schedule.actions[mesh.pipe_rank])
            if a.op in (Op.RECV_F, Op.RECV_B) and not self._same_rank(a.stage, a.peer)]
        acts = schedule.actions[mesh.pipe_rank]
        has_ar = {a.stage for a in acts if a.op is Op.ALLREDUCE}
        last_bwd = Op.W if self._split else Op.B
        for idx, a in enumerate(acts):
            if a.op is last_bwd and a.stage not in has_ar:
                self._auto_reduce_after[a.stage] = idx
        self.events: list[Event] = []
        self.peak_inflight: dict[int, int] = {s: 0 for s in self.local_stages}
        self.last_peak_inflight: dict[int, int] = {s: 0 for s in self.local_stages}
        self.step_times_s: list[float] = []
        self.step_starts_s: list[float] = []
        self.skipped_steps: list[int] = []
        self.step_bytes_sent: list[BytesSent] = []
        self._step_gradient_bytes = 0
        self._steps_run = 0
        # loss scaling: a parameter is unscaled once every local stage using it is done
        self._param_users: dict[int, tuple[nn.Parameter, set[int]]] = {}
        for s, ps in self._stage_params.items():
            for p in ps:
                self._param_users.setdefault(id(p), (p, set()))[1].add(s)
        self._done_stages: set[int] = set()
        self._unscaled: set[int] = set()
        # gradients from earlier steps (accumulation, optimizer=None) set aside during a step:
        # of shared parameters always, of every parameter under loss scaling or compression
        exact_sum = self.loss_scaler is None and self.compression.exact
        self._aside_ids = [pid for pid in self._param_users
                           if not exact_sum or pid in shared]
        self._aside: dict[int, torch.Tensor] = {}
        self._fwd_only: tuple[list[Action], list[int], list[str]] | None = None
        self._eval_work: dict[tuple[int, ...], dict[int, StageWork]] = {}
        self._clock0 = time.time() - time.perf_counter()
        # the other ranks of the step's loss all-reduce (named when it fails): every rank, or
        # this replica's pipeline without gradient sync
        ranks = (range(mesh.world_size) if sync_gradients
                 else [mesh.global_rank(j) for j in range(mesh.pipeline)])
        self._loss_peers = [r for r in ranks if r != self.rank]
        self._recording = False
        if getattr(mesh, "tensor", 1) > 1:  # the tensor group's collectives on the timeline
            from fxpipe.tensor import collectives
            from fxpipe.units import human_bytes

            def tp_event(kind: str, nbytes: int, t0: float, t1: float) -> None:
                if self._recording:
                    self.events.append(TimelineEvent(
                        self.rank, f"TP {kind} {human_bytes(nbytes)} s{self._action.stage}",
                        self._clock0 + t0, self._clock0 + t1, "tensor"))
            collectives.record_with(tp_event)

    def _find_loss_stage(self, plan: Plan) -> int:
        holders = [sp.index for sp in plan.stages if plan.model_output in sp.outputs]
        if len(holders) != 1:
            raise RuntimeFailure(
                f"the model output {plan.model_output!r} is in the outputs of stages {holders}; "
                "exactly one stage must return it - re-create the plan")
        return holders[0]

    def _shared_map(self) -> dict[int, tuple[tuple[int, ...], str]]:
        """Parameter object id -> (pipeline ranks holding it, canonical FQN), for shared params.

        Calls ``mesh.replica_group`` for every shared parameter's rank set on every rank (in
        sorted order) so that the collective group creation matches across ranks.
        """
        plan, aliases = self.plan, self.plan.param_aliases
        out: dict[int, tuple[tuple[int, ...], str]] = {}
        for fqn in sorted(plan.shared_params):
            stages = plan.shared_params[fqn]
            key = tuple(sorted({self._stage_rank[s] for s in stages}))
            self.mesh.replica_group(key)  # collective: all ranks, same order
            for s in stages:
                if s not in self.modules:
                    continue
                found = None
                for name, p in self.modules[s].named_parameters(remove_duplicate=False):
                    if aliases.get(name, name) == fqn or name == fqn:
                        found = p
                        break
                if found is None:
                    raise RuntimeFailure(
                        f"plan.shared_params lists {fqn!r} for stage {s}, but stage {s}'s module "
                        "has no parameter of that name (or an alias of it); build the stage "
                        "modules with the original parameter names")
                if id(found) in out and out[id(found)][0] != key:
                    raise RuntimeFailure(f"parameter {fqn!r} is shared inconsistently in the plan")
                out[id(found)] = (key, fqn)
        return out

    # ------------------------------------------------------------------ the step
    def step(self, inputs: dict[str, torch.Tensor], target: torch.Tensor | None,
             loss_weights: list[float] | None = None) -> float:
        """Run one training step (one pass over this rank's action list).

        Args:
            inputs: model input name (``plan.model_inputs``) -> this replica's whole batch,
                ``[m * microbatch_size, ...]``; split into ``m`` micro-batches along dim 0.
                Ranks may pass every input; each stage reads only what it uses.
            target: this replica's targets ``[m * microbatch_size, ...]`` (needed on the rank
                holding the loss stage unless the model computes its own loss; may be ``None``
                elsewhere).
            loss_weights: the weight of each micro-batch's loss in the step's loss, summing to
                about 1 per replica (``fxpipe.training.losses.microbatch_weights``: the share of
                the counted targets); default ``1/m`` each. A weight of 0 skips that micro-batch's
                loss (nothing in it counts).

        Returns:
            The step's loss: mean over micro-batches and replicas; the same float on every rank.

        Raises:
            RuntimeFailure: bad batch (size, missing input), a peer timed out or died, a stage
                returned values whose shape/dtype differ from the plan.
        """
        t0 = time.perf_counter()
        self.step_starts_s.append(self._clock0 + t0)
        if self.sharding is not None:  # ``full``: the parameters come back for the step
            self.sharding.ensure_gathered(self.timeout_s)
        st = self._prepare(inputs, target)
        if loss_weights is not None and len(loss_weights) != self.m:
            raise RuntimeFailure(f"rank {self.rank}: step() got {len(loss_weights)} loss weights "
                                 f"for {self.m} micro-batches; give one per micro-batch")
        st.weights = list(loss_weights) if loss_weights is not None else None
        self._done_stages.clear()
        self._unscaled.clear()
        self._set_aside_grads()
        self._run_actions(self.schedule.actions[self.mesh.pipe_rank], self._recv_positions,
                          self._labels, st, self._auto_reduce_after)
        if not st.stepped:
            first = self.local_stages[0] if self.local_stages else -1
            self._finish_step(st, Action(Op.STEP, first))
        leftovers = ([f"{s}:{i}" for s, w in self.work.items() for i in w.leftovers()]
                     + [f"{s}:{i}" for (s, i) in st.send_grads])
        if leftovers:
            raise ScheduleError(
                f"rank {self.rank}: the schedule left stage:micro-batch {leftovers} without their "
                "backward or gradient send; check the schedule with the validator")
        self.step_bytes_sent.append(BytesSent(st.message_bytes, self._step_gradient_bytes))
        loss = self._reduce_loss(st)
        self.last_peak_inflight = {s: w.peak for s, w in self.work.items()}
        for s, v in self.last_peak_inflight.items():
            self.peak_inflight[s] = max(self.peak_inflight.get(s, 0), v)
        self.step_times_s.append(time.perf_counter() - t0)
        self._steps_run += 1
        return loss

    def evaluate(self, inputs: dict[str, torch.Tensor], target: torch.Tensor | None,
                 loss_weights: list[float] | None = None,
                 modules: dict[int, nn.Module] | None = None) -> float:
        """Forward-only pass of one batch: the schedule's ``F``, ``SEND_F`` and ``RECV_F``
        actions in their order, under ``torch.no_grad()``; no backward, no all-reduce of
        gradients, no optimizer step, ``.grad`` untouched. Collective: every rank calls it.

        Args:
            inputs, target, loss_weights: as for :meth:`step`.
            modules: stage modules to run instead of the training ones (same stages, e.g.
                copies whose graphs run dropout and BatchNorm in eval mode); default the
                training modules.

        Returns:
            The batch's loss (as :meth:`step` computes it); the same float on every rank.
        """
        if self._fwd_only is None:
            acts = [a for a in self.schedule.actions[self.mesh.pipe_rank]
                    if a.op in (Op.F, Op.SEND_F, Op.RECV_F)]
            recvs = [k for k, a in enumerate(acts)
                     if a.op is Op.RECV_F and not self._same_rank(a.stage, a.peer)]
            self._fwd_only = (acts, recvs, [action_label(a) for a in acts])
        mods = self.modules if modules is None else dict(modules)
        if sorted(mods) != self.local_stages:
            raise RuntimeFailure(f"evaluate() got modules for stages {sorted(mods)}; this rank "
                                 f"holds stages {self.local_stages}")
        key = tuple(id(mods[s]) for s in self.local_stages)
        if key not in self._eval_work:
            self._eval_work[key] = {
                s: StageWork(self.stage_plans[s], mods[s], self.plan.values, self._consumers,
                             False, self._autocast, lambda i: self._ctx(self._action),
                             self.plan.model_output if s == self.loss_stage else None)
                for s in self.local_stages}
        saved, self.work = self.work, self._eval_work[key]
        if self.sharding is not None:
            self.sharding.ensure_gathered(self.timeout_s)
        try:
            st = self._prepare(inputs, target)
            if loss_weights is not None and len(loss_weights) != self.m:
                raise RuntimeFailure(f"rank {self.rank}: evaluate() got {len(loss_weights)} loss "
                                     f"weights for {self.m} micro-batches; give one per "
                                     "micro-batch")
            st.weights = list(loss_weights) if loss_weights is not None else None
            acts, recvs, labels = self._fwd_only
            with torch.no_grad():
                self._run_actions(acts, recvs, labels, st, {}, record=False)
            for pend, ctx in st.sends:
                p2p.wait(pend, ctx, self.timeout_s)
            return self._reduce_loss(st)
        finally:
            for w in self.work.values():
                w.reset()
            self.work = saved

    def _run_actions(self, acts: list[Action], recvs: list[int], labels: list[str],
                     st: _StepState, reduce_after: dict[int, int], record: bool = True) -> None:
        """Run ``acts`` in order (``recvs``: positions of the cross-rank receives, posted
        ahead; ``reduce_after``: stage -> position after which its all-reduce starts)."""
        posted_upto = 0
        for idx, a in enumerate(acts):
            start = time.perf_counter()
            st.index, self._action = idx, a
            self._recording = record
            try:
                # keep the next RECV_LOOKAHEAD receives posted (the current one included)
                while posted_upto < len(recvs) and recvs[posted_upto] < idx:
                    posted_upto += 1
                for k in range(posted_upto, min(posted_upto + RECV_LOOKAHEAD, len(recvs))):
                    if recvs[k] not in st.posted:
                        st.posted[recvs[k]] = self._post_recv(acts[recvs[k]])
                self._run(a, st)
            except FxpipeError:
                raise
            except Exception as e:
                raise RuntimeFailure(f"{self._ctx(a)}: {type(e).__name__}: {e}") from e
            if record:
                self.events.append(TimelineEvent(self.rank, labels[idx], self._clock0 + start,
                                                 self._clock0 + time.perf_counter()))
            if reduce_after.get(a.stage) == idx:
                self._stage_done(a.stage)

    def _prepare(self, inputs: dict[str, torch.Tensor], target) -> _StepState:
        needed = sorted({n for s in self.local_stages for n in self.stage_plans[s].inputs
                         if n in self._model_inputs})
        missing = [n for n in needed if n not in inputs]
        if missing:
            raise RuntimeFailure(
                f"rank {self.rank}: step() got inputs {sorted(inputs)} but stages "
                f"{self.local_stages} need {missing}; pass every model input by its placeholder "
                f"name ({self.plan.model_inputs})")
        chunks = {n: self._chunk(n, inputs[n]) for n in needed}
        tgt = None
        if self.loss_stage in self.modules:
            if target is None and self.needs_target:
                raise RuntimeFailure(f"rank {self.rank} holds the loss stage {self.loss_stage} but "
                                     "step() got target=None; pass the batch's targets")
            tgt = None if target is None else self._chunk("target", target)
        for w in self.work.values():
            w.reset()
        return _StepState(chunks=chunks, target=tgt)

    def _chunk(self, name: str, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        b, m, mbs = x.shape[0], self.m, self.plan.microbatch_size
        if b % m:
            raise RuntimeFailure(
                f"{name!r} has batch {b}, which does not split into {m} equal micro-batches; use a "
                f"per-replica batch divisible by {m} (global batch = dp x micro-batches x "
                "micro-batch size)")
        if mbs and b // m != mbs:
            raise RuntimeFailure(
                f"{name!r} has batch {b} = {m} micro-batches of {b // m}, but the plan was made "
                f"for micro-batches of {mbs} samples (it fixes the shapes sent between stages); pass a "
                f"per-replica batch of {m * mbs} or re-plan with this batch size")
        info = self.plan.values.get(name) if name in self._model_inputs else None
        if info is not None and (list(x.shape[1:]) != list(info.shape[1:])
                                 or str(x.dtype).removeprefix("torch.") != info.dtype):
            raise RuntimeFailure(
                f"model input {name!r} is {tuple(x.shape[1:])} {str(x.dtype).removeprefix('torch.')}"
                f" per sample but the plan was made for {tuple(info.shape[1:])} {info.dtype} (it "
                "fixes the shapes sent between stages); feed inputs of the planned shape (e.g. the "
                "same data.seq_len) or re-plan with this one")
        return x.to(self.device).split(b // m, dim=0)

    def _ctx(self, a: Action) -> str:
        where = (f"micro-batch {a.microbatch} action {a}" if a.microbatch >= 0
                 else f"action {a.op.value} (after its micro-batches)")  # e.g. the optimizer's
        return (f"rank {self.rank} (pipeline rank {self.mesh.pipe_rank}, replica "
                f"{self.mesh.dp_rank}) stage {a.stage} {where}")

    def _run(self, a: Action, st: _StepState) -> None:
        self._handlers[a.op](a, st)

    def _allreduce(self, a: Action, st: _StepState) -> None:
        self._stage_done(a.stage)

    # ------------------------------------------------------------------ compute
    def _forward(self, a: Action, st: _StepState) -> None:
        s, i = a.stage, a.microbatch
        received = st.inputs.pop((s, i), {})
        args = []
        for name in self.stage_plans[s].inputs:
            if name in self._model_inputs:
                args.append(st.chunks[name][i])
                continue
            t = received.get(name)
            if t is None:
                raise ScheduleError(f"{self._ctx(a)}: input {name!r} has not arrived (its RECV_F "
                                    "or the producing stage's F comes later in the schedule)")
            args.append(t)
        scale = self.loss_scaler.scale if self.loss_scaler is not None else None
        target = st.target[i] if s == self.loss_stage and st.target is not None else None
        weight = None if st.weights is None else st.weights[i]
        outs, loss = self.work[s].forward(
            i, args, lambda out, tgt: self._microbatch_loss(out, tgt, weight), target, scale)
        if loss is not None:
            st.loss_sum = loss.clone() if st.loss_sum is None else st.loss_sum + loss
        # same-rank hand-over (interleaved / V placements): a fresh leaf, like a received value
        for (p, t), names in self.edges.items():
            if p == s and t in self.modules:
                slot = st.inputs.setdefault((t, i), {})
                for n in names:
                    v = self._from_wire(n, self._to_wire(n, outs[n].detach()))
                    slot[n] = v.requires_grad_() if needs_grad(v.dtype) else v

    def _microbatch_loss(self, output: torch.Tensor, target: torch.Tensor | None,
                         weight: float | None) -> torch.Tensor | None:
        """The loss of one micro-batch as its share of the step's mean (gradients accumulated
        over the micro-batches then equal those of the whole batch's mean loss): ``1/m`` of it,
        or ``weight``; None when the weight is 0 (nothing counts, no backward from it)."""
        if weight is None:
            return self.loss_fn(output, target) / self.m
        if weight == 0:
            return None
        return self.loss_fn(output, target) * weight

    def _autocast(self):
        """``torch.autocast`` for this rank's device with the precision's dtype (off for fp32)."""
        return torch.autocast(self.device.type, dtype=self._amp_dtype or torch.float32,
                              enabled=self._amp_dtype is not None)

    def _backward(self, a: Action, st: _StepState) -> None:
        s, i = a.stage, a.microbatch
        for name, g in self.work[s].backward(i):
            producer = self.plan.values[name].producer
            if producer in self.modules:  # rounded as if it had travelled
                self.work[producer].add_output_grad(i, name,
                                                    self._from_wire(name, self._to_wire(name, g)))
            else:
                st.send_grads.setdefault((s, i), {})[name] = g

    def _weight(self, a: Action, st: _StepState) -> None:
        self.work[a.stage].weight(a.microbatch)

    # ------------------------------------------------------------------ communication
    def _peer_rank(self, stage: int) -> int:
        return self.mesh.global_rank(self._stage_rank[stage])

    def _tag(self, name: str, consumer: int, i: int, backward: bool) -> int:
        return p2p.tag_for(self._value_index[name], consumer, i, backward, self.plan.num_stages,
                           self.m)

    def _same_rank(self, s: int, t: int) -> bool:
        return self._stage_rank[s] == self._stage_rank[t]

    def _send_f(self, a: Action, st: _StepState) -> None:
        s, t, i = a.stage, a.peer, a.microbatch
        if self._same_rank(s, t):
            return
        ctx, dst = self._ctx(a), self._peer_rank(t)
        for name in self.edges[(s, t)]:
            msg = self._to_wire(name, self.work[s].output(i, name))
            pend = p2p.isend(msg, dst, self._tag(name, t, i, False),
                             f"send of {name!r} to stage {t}", ctx, self.timeout_s)
            st.sends.append((pend, ctx))
            st.message_bytes += msg.numel() * msg.element_size()

    def _to_wire(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """``t`` (value ``name`` or its gradient) in the dtype it travels in."""
        want = self._wire[name]
        return t if t.dtype == want else t.to(want)

    def _from_wire(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """A received ``t`` back in value ``name``'s plan dtype."""
        want = self._dtypes[name]
        return t if t.dtype == want else t.to(want)

    def _post_recv(self, a: Action) -> list[tuple[str, p2p.Pending]]:
        """Post the receives of a cross-rank RECV_F / RECV_B action (values or gradients)."""
        ctx = self._ctx(a)
        if a.op is Op.RECV_F:
            t, s, i = a.stage, a.peer, a.microbatch
            src = self._peer_rank(s)
            return [(n, p2p.irecv(self.plan.values[n].shape, self._wire[n], self.device, src,
                                  self._tag(n, t, i, False), f"receive of {n!r} from stage {s}",
                                  ctx, self.timeout_s)) for n in self.edges[(s, t)]]
        s, t, i = a.stage, a.peer, a.microbatch
        src = self._peer_rank(t)
        return [(n, p2p.irecv(self.plan.values[n].shape, self._wire[n], self.device, src,
                              self._tag(n, t, i, True),
                              f"receive of the gradient of {n!r} from stage {t}", ctx,
                              self.timeout_s)) for n in self._float_names(s, t)]

    def _recv_f(self, a: Action, st: _StepState) -> None:
        t, s, i = a.stage, a.peer, a.microbatch
        if self._same_rank(s, t):
            return
        ctx = self._ctx(a)
        pend = st.posted.pop(st.index, None) or self._post_recv(a)
        slot = st.inputs.setdefault((t, i), {})
        for name, pd in pend:
            buf = self._from_wire(name, p2p.wait(pd, ctx, self.timeout_s))
            slot[name] = buf.requires_grad_() if needs_grad(buf.dtype) else buf

    def _float_names(self, s: int, t: int) -> list[str]:
        return [n for n in self.edges[(s, t)] if self.plan.values[n].requires_grad]

    def _send_b(self, a: Action, st: _StepState) -> None:
        t, s, i = a.stage, a.peer, a.microbatch
        if self._same_rank(s, t):
            return
        names = self._float_names(s, t)
        if not names:
            return
        grads = st.send_grads.get((t, i))
        if grads is None or any(n not in grads for n in names):
            raise ScheduleError(f"{self._ctx(a)}: gradient send before the stage's backward")
        ctx, dst = self._ctx(a), self._peer_rank(s)
        for n in names:
            msg = self._to_wire(n, grads.pop(n))
            pend = p2p.isend(msg, dst, self._tag(n, t, i, True),
                             f"send of the gradient of {n!r} to stage {s}", ctx, self.timeout_s)
            st.sends.append((pend, ctx))
            st.message_bytes += msg.numel() * msg.element_size()
        if not grads:
            del st.send_grads[(t, i)]

    def _recv_b(self, a: Action, st: _StepState) -> None:
        s, t, i = a.stage, a.peer, a.microbatch
        if self._same_rank(s, t):
            return
        ctx = self._ctx(a)
        pend = st.posted.pop(st.index, None) or self._post_recv(a)
        for n, pd in pend:
            self.work[s].add_output_grad(i, n, self._from_wire(n, p2p.wait(pd, ctx,
                                                                           self.timeout_s)))

    # ------------------------------------------------------------------ step end
    def _stage_done(self, stage: int) -> None:
        """``stage`` finished its last backward this step: unscale (loss scaling) the gradients of
        the parameters whose every local user is now done, then launch their all-reduce."""
        self._done_stages.add(stage)
        if self.loss_scaler is not None:
            ready = [p for pid, (p, users) in self._param_users.items()
                     if pid not in self._unscaled and users <= self._done_stages]
            self._unscaled.update(id(p) for p in ready)
            self.loss_scaler.unscale_(p.grad for p in ready)
        self._sync.stage_done(stage)
        if self.sharding is not None:
            self.sharding.stage_done(stage)

    def _finish_step(self, st: _StepState, a: Action) -> None:
        for pend, ctx in st.sends:
            p2p.wait(pend, ctx, self.timeout_s)
        st.sends.clear()
        for s in self.local_stages:  # stages the schedule did not all-reduce explicitly
            if s not in self._done_stages:
                self._stage_done(s)
        try:
            self._sync.finish(self.timeout_s)
            if self.sharding is not None:
                self.sharding.finish(self.timeout_s)
        except RuntimeFailure as e:
            raise RuntimeFailure(f"{self._ctx(a)}: {e}") from None
        skip = False
        if self.loss_scaler is not None:  # sharded: this replica's slices (inf/NaN carry over)
            grads = [p.grad for p, _ in self._param_users.values()] + (
                self.sharding.pending() if self.sharding is not None else [])
            try:
                skip = found_nonfinite(grads, self.device, self.mesh.world_size, self.timeout_s)
            except RuntimeFailure as e:
                raise RuntimeFailure(f"{self._ctx(a)}: {e}") from None
            self.loss_scaler.update(skip)
            if skip:
                self.skipped_steps.append(self._steps_run)
        self._sync.end_step(applied=not skip)  # a skipped step rolls back error feedback
        if self.sharding is not None:
            self.sharding.commit(applied=not skip)
        self._step_gradient_bytes = self._sync.bytes_sent + (
            self.sharding.take_bytes() if self.sharding is not None else 0)
        self._restore_aside(skip)
        if self.optimizer is not None:
            if not skip:
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            for s in self.local_stages:
                for p in self._stage_params[s]:
                    p.grad = None
        self._sync.reset()
        if self.sharding is not None:
            self.sharding.reset()
        self._done_stages.clear()
        self._unscaled.clear()
        st.stepped = True

    def _set_aside_grads(self) -> None:
        """Take the gradients earlier steps left in ``.grad`` (gradient accumulation with
        ``optimizer=None``) out of this step's all-reduce: those of shared parameters (their
        all-reduce sums every holder's copy, so an already reduced gradient would count once per
        holder), and every gradient under loss scaling (unscaled once) or compression (16-bit
        payloads carry this step's gradients only). :meth:`_restore_aside` adds them back."""
        self._aside = {}
        for pid in self._aside_ids:
            p = self._param_users[pid][0]
            if p.grad is not None:
                self._aside[pid] = p.grad
                p.grad = None

    def _restore_aside(self, drop_this_step: bool) -> None:
        """Add the gradients set aside at the start of the step to this step's; with
        ``drop_this_step`` (an fp16 step with inf/NaN gradients) keep only the set-aside ones,
        so the skipped step contributes nothing to an accumulation."""
        if drop_this_step:
            for pid, (p, _) in self._param_users.items():
                p.grad = self._aside.get(pid)
        else:
            for pid, g in self._aside.items():
                p = self._param_users[pid][0]
                if p.grad is not None:
                    g.add_(p.grad)
                p.grad = g
        self._aside = {}

    def _reduce_loss(self, st: _StepState) -> float:
        local = st.loss_sum if st.loss_sum is not None else torch.zeros((), device=self.device)
        buf = local.detach().to(torch.float64).reshape(1).clone()
        group = None if self.sync_gradients else self.mesh.pipe_group  # async: this replica
        if (self.mesh.world_size > 1) if self.sync_gradients else group is not None:
            work = dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group, async_op=True)
            p2p.wait(p2p.Pending(work, buf, self._loss_peers, "loss all-reduce"),
                     f"rank {self.rank} end of step", self.timeout_s)
        # every rank of a tensor group computed the same loss: counted once
        return float(buf.item()) / (self.mesh.dp * getattr(self.mesh, "tensor", 1)
                                    if self.sync_gradients else 1)

    # ------------------------------------------------------------------ accounting
    def reset_stats(self) -> None:
        """Clear events, peak in-flight counters, step times and bytes sent."""
        self.events.clear()
        self.step_times_s.clear()
        self.step_starts_s.clear()
        self.step_bytes_sent.clear()
        self.peak_inflight = {s: 0 for s in self.local_stages}
        self.last_peak_inflight = {s: 0 for s in self.local_stages}

    @property
    def bytes_sent(self) -> BytesSent:
        """Bytes this rank sent over all steps since the last :meth:`reset_stats` (the sum of
        :attr:`step_bytes_sent`)."""
        return BytesSent(sum(b.messages for b in self.step_bytes_sent),
                         sum(b.gradients for b in self.step_bytes_sent))
