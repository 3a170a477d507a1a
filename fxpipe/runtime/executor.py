"""The pipeline executor: runs this rank's action list over torch.distributed, exactly.

Every rank holds the stage modules its pipeline rank owns (``schedule.stages_of_rank``) and runs
its action list from the :class:`~fxpipe.schedule.actions.Schedule` once per training step:

* ``F`` - forward of one micro-batch (:class:`~fxpipe.runtime.stage.StageWork`); the stage that
  produces ``plan.model_output`` also computes ``loss_fn(output, target_mb) / m`` (so gradients
  accumulated over the ``m`` micro-batches equal those of the mean loss over the whole batch).
* ``SEND_F``/``RECV_F``/``SEND_B``/``RECV_B`` - point-to-point transfer of the values on the edge
  between two stages (activations forward, their gradients backward; :mod:`fxpipe.runtime.
  transfers`, each wait bounded by the timeout). Values that flow between two stages held by the
  same rank (interleaved / V placements) are handed over in memory; comm actions between them
  are no-ops. Up to :data:`RECV_LOOKAHEAD` receives are posted ahead of their action.
* ``B`` - backward. Full (input and weight gradients) unless ``schedule.split_backward``; then
  ``B`` computes input gradients only and ``W`` the weight gradients, no work done twice
  (:mod:`fxpipe.runtime.backward_split`; Zero Bubble Pipeline Parallelism, Qi et al., 2023). A
  value read by several stages receives the SUM of their gradients before its producer's
  backward.
* ``ALLREDUCE`` - the stage ran its last backward: its gradients' reduction starts (the rank's
  one :mod:`gradient reducer <fxpipe.runtime.grad_reducer>`: data-parallel all-reduce with tied
  parameters summed over their holders, exact or compressed; sharded reduce-scatter; or none).
* ``STEP`` - wait for the reductions and outstanding sends, ``optimizer.step()``, clear gradients
  (with ``optimizer=None`` the gradients stay in ``.grad`` and accumulate over steps).

:meth:`PipelineExecutor.evaluate` runs the forward actions only (``F``, ``SEND_F``, ``RECV_F``,
in the schedule's order) without gradients: the batch's loss for evaluation.

Mixed precision (``bf16`` / ``fp16``, :mod:`fxpipe.runtime.precision`): the forward and the loss
run under ``torch.autocast``, parameters, gradients and the optimizer stay fp32, fp32 values
travel between stages in 16 bits. fp16 adds dynamic loss scaling (:mod:`fxpipe.runtime.
step_grads`): a step with an inf/NaN gradient on any rank is skipped on every rank.

Activations of a micro-batch are released after its last backward (``B``, or ``W`` when split).
An output that only stages of other ranks read is released earlier, once it is sent to each
of them (:meth:`StageWork.sent <fxpipe.runtime.stage.StageWork.sent>`: the stage keeps its
graph, B starts there): from then on only the send holds its data, until the send is finished:
as soon as it reports completion (NCCL, checked at each send) or, at the latest, when the
consumer's gradient for that micro-batch arrives (its receipt proves the send done; gloo's
sends report completion only once waited), else at the end of the step.
The executor counts the micro-batches whose activations are held per stage (peak in flight) and
the bytes it sends per step (:class:`BytesSent`), and records one wall-clock event per action
(and, at tensor degree > 1, per tensor-group collective, reported to the mesh's recorder) for
Chrome traces. Weight gradients of ``linear`` / ``addmm`` / ``embedding`` nodes accumulate
straight into ``.grad`` (:mod:`fxpipe.execution.grad_fusion`). The action lists follow
torch.distributed.pipelining's ``_Action`` IR; no DDP is used (see data_parallel).
"""

from __future__ import annotations

import time
import weakref
from contextlib import nullcontext
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from fxpipe.errors import FxpipeError, PlanError, RuntimeFailure, ScheduleError
from fxpipe.execution.dtypes import autocast_dtype
from fxpipe.execution.compiled_stage import CompileSetting, compile_stages, eager_reason
from fxpipe.execution.fp8 import fp8_stage
from fxpipe.execution.grad_fusion import fuse_weight_grads
from fxpipe.plans.param_blocks import has_blocks
from fxpipe.plans.plan import Plan
from fxpipe.plans.values import MODEL_INPUT, needs_grad
from fxpipe.runtime import p2p
from fxpipe.runtime.block_gather import BlockGather
from fxpipe.runtime.checks import check_actions, check_fits, loss_stage, split_batch
from fxpipe.runtime.compile_warmup import warm_up
from fxpipe.runtime.compression import Compression, as_compression
from fxpipe.runtime.data_sharding import DataSharding
from fxpipe.runtime.grad_reducer import make_grad_reducer, shared_param_map, sharding_of
from fxpipe.runtime.mesh import Mesh
from fxpipe.runtime.precision import LossScaler
from fxpipe.runtime.stage import StageWork, trainable_parameters
from fxpipe.runtime.step_grads import StepGrads
from fxpipe.runtime.step_state import ActionList, BytesSent, Event, StepState
from fxpipe.runtime.transfers import Transfers
from fxpipe.schedule.actions import Action, Op, Schedule
from fxpipe.schedule.timeline import TimelineEvent
from fxpipe.units import human_bytes

#: receives posted ahead of their RECV action (in list order, so NCCL's per-pair ordering holds):
#: the peer's data then flows while this rank computes, as the simulator assumes, instead of
#: starting only when the RECV is reached. Costs at most this many extra receive buffers.
RECV_LOOKAHEAD = 4


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
        sync_gradients: True (default): reduce the gradients over the replicas (and sum
            tied ones over the ranks holding them); False (``train.updates: async``): each
            replica keeps its own gradients (:class:`~fxpipe.runtime.grad_reducer.NoGradSync`),
            which parameter servers sum and apply (:mod:`fxpipe.runtime.parameter_server`), and
            :meth:`step` returns the replica's loss, reduced over its pipeline only.
        fuse_grad_accumulation: True (default): the steps run copies of the stage modules,
            sharing their parameters, whose ``linear`` / ``addmm`` / ``embedding`` nodes
            accumulate their weight gradients into ``.grad`` in place
            (:mod:`fxpipe.execution.grad_fusion`; fp32 and a full backward only).
        compile: ``train.compile`` resolved on this device
            (:func:`~fxpipe.execution.compiled_stage.resolve_compile`); None or off: eager.
            Compiled stages run through ``torch.compile`` (:mod:`fxpipe.execution.
            compiled_stage`), without gradient-accumulation fusion.
        fp8_config: under ``precision="fp8"``, torchao's float8 config the stages' weight
            matmuls run under (:mod:`fxpipe.execution.fp8`; the rest as ``bf16``).
        data_sharding: ``"none"`` or a level of :mod:`fxpipe.runtime.data_sharding`
            (``parallel.data_sharding``): with more than one replica the non-tied parameters'
            gradients are reduce-scattered into this replica's slice.

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
        grad_reducer: the rank's one :class:`~fxpipe.runtime.grad_reducer.GradReducer`;
            sharding: its :class:`~fxpipe.runtime.data_sharding.DataSharding` part, or None.

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
                 data_sharding: str = "none", compile: CompileSetting | None = None,
                 fp8_config=None):
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
        #: values and gradients to and from the other pipeline ranks (wire dtypes, tags, peers)
        self.links = Transfers(plan, self.edges, self._stage_rank, mesh, precision,
                               self.timeout_s)
        self._model_inputs = set(plan.model_inputs) | {
            n for n, v in plan.values.items() if v.producer == MODEL_INPUT}
        # consumers of each value = stages whose inputs name it (gradient contributions to sum)
        self._consumers: dict[str, list[int]] = {}
        for (_, t), names in self.edges.items():
            for n in names:
                self._consumers.setdefault(n, []).append(t)
        self.loss_stage = loss_stage(plan)
        self._split = bool(schedule.split_backward)
        # the modules the training steps run: copies whose weight gradients accumulate in place
        # (runtime.grad_fusion), fp32 and a full backward only; self.modules stay as given
        blocks = self._block_stages(data_sharding, sync_gradients)  # per-block gathering
        compiling = compile is not None and compile.on
        #: train.compile as resolved here (None: not given, eager)
        self.compile_setting = compile
        run = {s: (fuse_weight_grads(self.modules[s]) if fuse_grad_accumulation
                   and not self._split and self._amp_dtype is None and s not in blocks
                   and not compiling else (self.modules[s], 0))
               for s in self.local_stages}
        #: stage -> weight matmuls running in float8 (train.precision: fp8)
        self.fp8_nodes = self._float8(run, blocks, fp8_config)
        #: train.compile: the stages compiled here and those left eager (with the reason)
        self.compiled = (compile_stages(
            {s: run[s][0] for s in self.local_stages},
            {s: eager_reason(self.stage_plans[s], s in blocks) for s in self.local_stages},
            compile, self._split) if compiling else None)
        #: stage -> nodes whose weight gradients accumulate in place
        self.fused_nodes = {s: n for s, (_, n) in run.items()}
        check_actions(schedule, mesh.pipe_rank, self.local_stages, self.edges,
                      self.links.dtypes)
        shared = (shared_param_map(plan, self.modules, self._stage_rank, mesh)
                  if sync_gradients else {})
        #: stage -> its per-block gathering (``StagePlan.param_gather: block``), which runs a
        #: rewritten copy of the stage module (:mod:`fxpipe.runtime.block_gather`)
        self.block_gathers = {s: BlockGather(run[s][0], [
            p for p in trainable_parameters(run[s][0]) if id(p) not in shared], s)
            for s in blocks}
        self.work = self._stage_work({s: (self.block_gathers[s].module if s in blocks
                                          else run[s][0]) for s in self.local_stages},
                                     self._split)
        self._stage_params = {s: w.params for s, w in self.work.items()}
        #: parameter object id -> (pipeline ranks holding it, canonical FQN), for the tied /
        #: shared parameters of this rank's stages (their gradient is summed over those ranks)
        self.shared_param_ranks = dict(shared)
        self.compression = as_compression(grad_compression)
        # all-reduce, sharded (tied parameters all-reduced), or none (sync_gradients=False)
        groups = {id(p): (gi, g) for bg in self.block_gathers.values()
                  for gi, (g, ps) in enumerate(bg.groups) for p in ps}
        self.grad_reducer = make_grad_reducer(self._stage_params, shared, mesh,
                                              self.compression, data_sharding, sync_gradients,
                                              groups or None)
        self.sharding: DataSharding | None = sharding_of(self.grad_reducer)
        if self.block_gathers:
            buckets = self.sharding.group_buckets()
            for s, bg in self.block_gathers.items():
                bg.attach(buckets, self.timeout_s)
                self.work[s].gather = bg
        # loss-scale unscaling, the inf/NaN verdict, earlier steps' gradients set aside
        self.grads = StepGrads(self._stage_params, self.loss_scaler, shared,
                               self.compression.exact)
        self._train_actions = ActionList.of(schedule.actions[mesh.pipe_rank],
                                            self.links.same_rank, self._split, reduce=True)
        self._handlers = {Op.F: self._forward, Op.B: self._backward, Op.W: self._weight,
                          Op.SEND_F: self._send_f, Op.RECV_F: self._recv_f,
                          Op.SEND_B: self._send_b, Op.RECV_B: self._recv_b,
                          Op.ALLREDUCE: self._allreduce,
                          Op.STEP: lambda a, st: self._finish_step(st, a)}
        self.events: list[Event] = []
        self.peak_inflight: dict[int, int] = {s: 0 for s in self.local_stages}
        self.last_peak_inflight: dict[int, int] = {s: 0 for s in self.local_stages}
        self.step_times_s: list[float] = []
        self.step_starts_s: list[float] = []
        self.skipped_steps: list[int] = []
        self.step_bytes_sent: list[BytesSent] = []
        self._step_gradient_bytes = 0
        #: forward sends of the last step still unfinished at its end (values whose consumer
        #: sends no gradient back, or an action list without that RECV_B); what they read was
        #: held until then
        self.open_forward_sends = 0
        self._steps_run = 0
        self._warmed = False  # train.compile: compiled stages warmed up (compile_warmup)
        self._fwd_only: ActionList | None = None
        self._eval_work: dict[tuple[int, ...], dict[int, StageWork]] = {}
        self._clock0 = time.time() - time.perf_counter()
        # the other ranks of the step's loss all-reduce (named when it fails): every rank, or
        # this replica's pipeline without gradient sync
        ranks = (range(mesh.world_size) if sync_gradients
                 else [mesh.global_rank(j) for j in range(mesh.pipeline)])
        self._loss_peers = [r for r in ranks if r != self.rank]
        # the tensor group's collectives and the expert group's all-to-alls report to the
        # mesh's recorder (timeline: _run_actions); bytes by kind, cumulative
        self._tp_recorder = (getattr(mesh, "tp_recorder", None)
                             if max(getattr(mesh, "tensor", 1), getattr(mesh, "expert", 1),
                                    getattr(mesh, "context", 1)) > 1 else None)
        self.collective_bytes: dict[str, int] = {}

    @property
    def _grouped(self) -> bool:
        """The ranks of an expert or context group run collectives inside every forward and
        backward: each must run all of them, together."""
        return max(getattr(self.mesh, "expert", 1), getattr(self.mesh, "context", 1)) > 1

    def _float8(self, run: dict, blocks: set[int], config) -> dict[int, int]:
        """``precision: fp8``: each stage's weight matmuls rewritten to float8
        (:func:`fxpipe.execution.fp8.fp8_stage`) under torchao ``config``.

        Raises:
            RuntimeFailure: fp8 without a config, or with per-block gathering.
        """
        if self.precision != "fp8":
            return {}
        if config is None:
            raise RuntimeFailure("precision fp8 needs fp8_config (torchao's Float8LinearConfig, "
                                 "fxpipe.execution.fp8.float8_config)")
        if blocks:
            raise RuntimeFailure(f"stage {min(blocks)} gathers its parameters per block "
                                 "(param_gather: block), which fp8 matmuls do not run under; "
                                 "use param_gather: stage or precision bf16")
        return {s: fp8_stage(run[s][0], config) for s in self.local_stages}

    def _block_stages(self, data_sharding: str, sync_gradients: bool) -> set[int]:
        """The local stages whose plan gathers their parameters per block (with more than
        one replica to gather from).

        Raises:
            PlanError: per-block gathering without ``data_sharding: full``, or of a model
                without repeated blocks.
        """
        wanted = {s for s in self.local_stages
                  if getattr(self.stage_plans[s], "param_gather", "stage") == "block"}
        if not wanted:
            return set()
        if data_sharding != "full":
            raise PlanError(f"stage {min(wanted)} gathers its parameters per block "
                            f"(param_gather: block), which needs parallel.data_sharding: full, "
                            f"not {data_sharding!r}; re-plan with data_sharding: full")
        if not has_blocks(list(self.plan.param_shapes)):
            raise PlanError("parallel.param_gather: block gathers one block of the model at a "
                            "time, but the model has no repeated blocks (no parameter path "
                            "through a module list, such as transformer.h.3): use "
                            "param_gather: stage")
        return wanted if self.mesh.dp > 1 and sync_gradients else set()

    def _stage_work(self, modules: dict[int, nn.Module], split: bool) -> dict[int, StageWork]:
        work = {s: StageWork(self.stage_plans[s], modules[s], self.plan.values, self._consumers,
                             split, self._autocast, lambda i: self._ctx(self._action),
                             self.plan.model_output if s == self.loss_stage else None)
                for s in self.local_stages}
        compiled = set(self.compiled.compiled) if self.compiled is not None else set()
        for s, w in work.items():
            w.release_after = self._released_outputs(s)
            if w.offload is not None and s in compiled:  # its backward wants saved strides
                w.offload.keep_layout = True
        return work

    def _released_outputs(self, s: int) -> dict[str, int]:
        """Stage ``s``'s outputs whose data it stops holding once sent: those whose every
        consumer stage is on another pipeline rank (a value handed over in memory is the
        consumer's input, and the loss stage's model output is read by the loss), each with
        how many sends (one per consumer stage) come first."""
        out = {}
        for n in self.stage_plans[s].outputs:
            readers = self._consumers.get(n, [])
            if (readers and n != self.plan.model_output
                    and not any(self.links.same_rank(s, t) for t in readers)):
                out[n] = len(set(readers))
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
        if self.block_gathers:  # per block: each group comes back when its forward reads it
            self.sharding.start_step(self.timeout_s)
        else:
            self.grad_reducer.ensure_gathered(self.timeout_s)  # sharded ``full``: they come back
        st = self._prepare(inputs, target, loss_weights, "step")
        if self.compiled is not None and not self._warmed:  # compiled as the first step starts
            self._warmed = True
            warm_up({s: self.work[s].module for s in self.compiled.compiled},
                    lambda s: self._example_args(s, st), self._autocast, self.mesh,
                    # in waves the first replica compiles while the others wait: its experts'
                    # all-to-alls need them too (parallel.expert), so all compile at once
                    waves=self.sync_gradients and not self._grouped,
                    retain=self._split,
                    failed=self._compile_failed if self.compile_setting.fallback else None)
        self.grads.begin()
        self._run_actions(self._train_actions, st)
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
            self._fwd_only = ActionList.of(
                [a for a in self.schedule.actions[self.mesh.pipe_rank]
                 if a.op in (Op.F, Op.SEND_F, Op.RECV_F)], self.links.same_rank, self._split)
        mods = self.modules if modules is None else dict(modules)
        if sorted(mods) != self.local_stages:
            raise RuntimeFailure(f"evaluate() got modules for stages {sorted(mods)}; this rank "
                                 f"holds stages {self.local_stages}")
        key = tuple(id(mods[s]) for s in self.local_stages)
        if key not in self._eval_work:
            self._eval_work[key] = self._stage_work(mods, False)
        saved, self.work = self.work, self._eval_work[key]
        self.grad_reducer.ensure_gathered(self.timeout_s)
        try:
            st = self._prepare(inputs, target, loss_weights, "evaluate")
            with torch.no_grad():
                self._run_actions(self._fwd_only, st, record=False)
            for pend, ctx in st.sends:
                p2p.wait(pend, ctx, self.timeout_s)
            return self._reduce_loss(st)
        finally:
            for w in self.work.values():
                w.reset()
            self.work = saved

    def _run_actions(self, actions: ActionList, st: StepState, record: bool = True) -> None:
        """Run the actions in order (``record``: their events and the tensor group's on the
        timeline), keeping the next :data:`RECV_LOOKAHEAD` cross-rank receives posted."""
        acts, recvs, labels, reduce_after = actions
        posted_upto = 0
        tp = self._tp_recorder if record else None
        with tp.to(self._tp_event) if tp is not None else nullcontext():
            for idx, a in enumerate(acts):
                start = time.perf_counter()
                st.index, self._action = idx, a
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
                    self.events.append(TimelineEvent(self.rank, labels[idx],
                                                     self._clock0 + start,
                                                     self._clock0 + time.perf_counter()))
                if reduce_after.get(a.stage) == idx:
                    self._stage_done(a.stage)

    def _tp_event(self, kind: str, nbytes: int, t0: float, t1: float) -> None:
        """A tensor-group collective (or an expert group's all-to-all) of the running action,
        on the timeline's tensor lane; its bytes added to :attr:`collective_bytes`."""
        self.collective_bytes[kind] = self.collective_bytes.get(kind, 0) + int(nbytes)
        who = ("EP" if kind == "all-to-all" else "CP" if kind.startswith("context")
               else "TP")
        self.events.append(TimelineEvent(
            self.rank, f"{who} {kind} {human_bytes(nbytes)} s{self._action.stage}",
            self._clock0 + t0, self._clock0 + t1, "tensor"))

    def _prepare(self, inputs: dict[str, torch.Tensor], target,
                 loss_weights: list[float] | None, call: str) -> StepState:
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
        if loss_weights is not None and len(loss_weights) != self.m:
            raise RuntimeFailure(f"rank {self.rank}: {call}() got {len(loss_weights)} loss "
                                 f"weights for {self.m} micro-batches; give one per micro-batch")
        for w in self.work.values():
            w.reset()
        return StepState(chunks=chunks, target=tgt,
                          weights=list(loss_weights) if loss_weights is not None else None)

    def _chunk(self, name: str, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        info = self.plan.values.get(name) if name in self._model_inputs else None
        return split_batch(name, x, self.m, self.plan.microbatch_size, info, self.device)

    def _ctx(self, a: Action) -> str:
        where = (f"micro-batch {a.microbatch} action {a}" if a.microbatch >= 0
                 else f"action {a.op.value} (after its micro-batches)")  # e.g. the optimizer's
        return (f"rank {self.rank} (pipeline rank {self.mesh.pipe_rank}, replica "
                f"{self.mesh.dp_rank}) stage {a.stage} {where}")

    def _run(self, a: Action, st: StepState) -> None:
        self._handlers[a.op](a, st)

    def _allreduce(self, a: Action, st: StepState) -> None:
        self._stage_done(a.stage)

    # ------------------------------------------------------------------ compute
    def _forward(self, a: Action, st: StepState) -> None:
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
                    v = self.links.handover(n, outs[n].detach())
                    slot[n] = v.requires_grad_() if needs_grad(v.dtype) else v

    def _compile_failed(self, s: int, e: BaseException) -> None:
        """``train.compile: auto``: stage ``s`` failed to compile; it runs eagerly."""
        first = next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        self.compiled.uncompile(s, self.work[s].module,
                                f"compiling it failed ({type(e).__name__}: {first[:200]})")

    def _example_args(self, s: int, st: StepState) -> list[torch.Tensor]:
        """Stage ``s``'s inputs for compiling it: micro-batch 0's model inputs, zeros of the
        plan's shape and dtype for received values (leaves requiring gradients where a
        received value does)."""
        args = []
        for name in self.stage_plans[s].inputs:
            if name in self._model_inputs:
                args.append(st.chunks[name][0])
                continue
            info = self.plan.values[name]
            t = torch.zeros(info.shape, dtype=getattr(torch, info.dtype), device=self.device)
            args.append(t.requires_grad_() if needs_grad(t.dtype) else t)
        return args

    def _microbatch_loss(self, output: torch.Tensor, target: torch.Tensor | None,
                         weight: float | None) -> torch.Tensor | None:
        """The loss of one micro-batch as its share of the step's mean (gradients accumulated
        over the micro-batches then equal those of the whole batch's mean loss): ``1/m`` of it,
        or ``weight``; None when the weight is 0 (nothing counts, no backward from it)."""
        if weight is None:
            return self.loss_fn(output, target) / self.m
        if weight == 0 and not self._grouped:
            return None
        loss = self.loss_fn(output, target)
        if weight == 0:  # the backward runs anyway: its collectives meet the group's
            return torch.nan_to_num(loss) * 0.0
        return loss * weight

    def _autocast(self):
        """``torch.autocast`` for this rank's device with the precision's dtype (off for fp32)."""
        return torch.autocast(self.device.type, dtype=self._amp_dtype or torch.float32,
                              enabled=self._amp_dtype is not None)

    def _backward(self, a: Action, st: StepState) -> None:
        s, i = a.stage, a.microbatch
        for name, g in self.work[s].backward(i):
            producer = self.plan.values[name].producer
            if producer in self.modules:  # rounded as if it had travelled
                self.work[producer].add_output_grad(i, name, self.links.handover(name, g))
            else:
                st.send_grads.setdefault((s, i), {})[name] = g

    def _weight(self, a: Action, st: StepState) -> None:
        self.work[a.stage].weight(a.microbatch)

    # ------------------------------------------------------------------ communication
    def _send_f(self, a: Action, st: StepState) -> None:
        s, t, i = a.stage, a.peer, a.microbatch
        if not self.links.same_rank(s, t):
            names = self.edges[(s, t)]
            self._send(st, a, [(n, self.work[s].output(i, n)) for n in names], s, t, False)
            for n in names:  # the send holds its own alias: the stage may let go of the data
                self.work[s].sent(i, n)

    def _send(self, st: StepState, a: Action, items: list[tuple[str, torch.Tensor]], s: int,
              t: int, backward: bool) -> None:
        self._reap_sends(st)
        sends, nbytes = self.links.send(items, s, t, a.microbatch, backward, self._ctx(a))
        st.sends.extend(sends)
        st.message_bytes += nbytes
        if not backward:  # finished at the latest when t's gradient for them arrives (weak
            # references: a send reaped before that is let go)
            st.sent_f.setdefault((s, t, a.microbatch), []).extend(
                weakref.ref(p) for p, _ in sends)

    def _finish_sent_f(self, st: StepState, s: int, t: int, i: int) -> None:
        """Stage ``t``'s gradient of micro-batch ``i`` arrived: it received what stage ``s``
        sent it for ``i``, so those sends are done; finish them now (the wait returns at once),
        freeing what they held rather than at the end of the step (gloo's send works report
        completion only once waited)."""
        done = [p for p in (r() for r in st.sent_f.pop((s, t, i), ())) if p is not None]
        if not done:
            return
        ids = {id(p) for p in done}
        left = []
        for pend, ctx in st.sends:
            if id(pend) in ids:
                p2p.wait(pend, ctx, self.timeout_s)
            else:
                left.append((pend, ctx))
        st.sends[:] = left

    def _reap_sends(self, st: StepState) -> None:
        """Finish the sends that have completed (their errors surface here), so that what they
        read is freed as the pipeline goes, not held to the end of the step: the planner
        counts a stage's activations per micro-batch in flight, not per micro-batch sent.
        (NCCL's works report completion; gloo's send works report it only once waited, so
        on CPU a forward send is finished when its consumer's gradient arrives,
        :meth:`_finish_sent_f`, or at the end of the step.)"""
        left = []
        for pend, ctx in st.sends:
            if pend.work.is_completed():
                p2p.wait(pend, ctx, self.timeout_s)
            else:
                left.append((pend, ctx))
        st.sends[:] = left

    def _from_wire(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """A received ``t`` back in value ``name``'s plan dtype."""
        return self.links.from_wire(name, t)

    def _post_recv(self, a: Action) -> list[tuple[str, p2p.Pending]]:
        """Post the receives of a cross-rank RECV_F / RECV_B action (values or gradients)."""
        return self.links.post_recv(a, self._ctx(a))

    def _received(self, a: Action, st: StepState) -> list[tuple[str, torch.Tensor]]:
        """What a cross-rank RECV action brings (posted ahead, or now), in the plan dtypes."""
        return self.links.wait(st.posted.pop(st.index, None) or self._post_recv(a), self._ctx(a))

    def _recv_f(self, a: Action, st: StepState) -> None:
        t, s, i = a.stage, a.peer, a.microbatch
        if self.links.same_rank(s, t):
            return
        slot = st.inputs.setdefault((t, i), {})
        for name, buf in self._received(a, st):
            slot[name] = buf.requires_grad_() if needs_grad(buf.dtype) else buf

    def _send_b(self, a: Action, st: StepState) -> None:
        t, s, i = a.stage, a.peer, a.microbatch
        names = [] if self.links.same_rank(s, t) else self.links.grad_names(s, t)
        if not names:
            return
        grads = st.send_grads.get((t, i))
        if grads is None or any(n not in grads for n in names):
            raise ScheduleError(f"{self._ctx(a)}: gradient send before the stage's backward")
        self._send(st, a, [(n, grads.pop(n)) for n in names], s, t, True)
        if not grads:
            del st.send_grads[(t, i)]

    def _recv_b(self, a: Action, st: StepState) -> None:
        s, t, i = a.stage, a.peer, a.microbatch
        if not self.links.same_rank(s, t):
            for n, g in self._received(a, st):
                self.work[s].add_output_grad(i, n, g)
            self._finish_sent_f(st, s, t, i)

    # ------------------------------------------------------------------ step end
    def _stage_done(self, stage: int) -> None:
        """``stage`` finished its last backward this step: unscale (loss scaling) the gradients of
        the parameters whose every local user is now done, then start their reduction."""
        self.grads.stage_done(stage)
        self.grad_reducer.stage_done(stage)

    def _finish_step(self, st: StepState, a: Action) -> None:
        self.open_forward_sends = sum(r() is not None for refs in st.sent_f.values()
                                      for r in refs)
        for pend, ctx in st.sends:
            p2p.wait(pend, ctx, self.timeout_s)
        st.sends.clear()
        st.sent_f.clear()
        for s in self.local_stages:  # stages the schedule did not all-reduce explicitly
            if not self.grads.is_done(s):
                self._stage_done(s)
        red = self.grad_reducer
        try:
            red.finish(self.timeout_s)
            if self.loss_scaler is not None and self.block_gathers:  # reduced still scaled
                self.loss_scaler.unscale_(self.sharding.scaled_pending())
            # loss scaling: inf/NaN on any rank (sharded: this replica's slices, not committed)
            skip = self.grads.skip_step(red.pending(), self.device, self.mesh.world_size,
                                        self.timeout_s)
        except RuntimeFailure as e:
            raise RuntimeFailure(f"{self._ctx(a)}: {e}") from None
        if skip:
            self.skipped_steps.append(self._steps_run)
        red.commit(applied=not skip)  # a skipped step rolls back error feedback
        self._step_gradient_bytes = red.take_bytes()
        self.grads.restore(skip)
        if self.optimizer is not None:
            if not skip:
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            for s in self.local_stages:
                for p in self._stage_params[s]:
                    p.grad = None
        red.reset()
        self.grads.end()
        st.stepped = True

    def _reduce_loss(self, st: StepState) -> float:
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
