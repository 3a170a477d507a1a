"""The partitioner's driver, ``fxpipe.plan()``: from a model and a spec to a :class:`Plan`.

Takes an ``nn.Module`` (real or on the meta device), a spec and one micro-batch of example
inputs; gives a :class:`~fxpipe.plans.plan.Plan`. The steps, each in its own module: trace
(torch.export) -> cost (fake-tensor FLOPs and bytes) -> graph (networkx units) -> the cut problem
-> the exact solvers (min-bottleneck cut, memory-checked; with ``auto``, every layout of
:mod:`fxpipe.partitioner.search` priced by the simulator) -> boundaries (stage inputs and
outputs) -> Plan.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

import networkx as nx
import numpy as np
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor

from fxpipe.data.batches import check_vocabulary, example_microbatch
from fxpipe.errors import FxpipeError, PlanError, SpecError, TraceError
from fxpipe.partitioner.blocks import (KEEP, UnitTable, check_run, find_block_run, fold,
                                       reduced, resolve_folded)
from fxpipe.partitioner.boundaries import GUARDS_FN, stage_boundaries
from fxpipe.partitioner.cost import NodeCost, price
from fxpipe.partitioner.gpu_model import GpuRates, gpu_rates, gpu_times
from fxpipe.partitioner.gpu_model import profile as gpu_profile
from fxpipe.partitioner.graph import PricedGraph, build_graph
from fxpipe.partitioner.loss_cost import (analytic_loss_times, loss_node, measured_loss_times,
                                          output_bytes, with_loss)
from fxpipe.partitioner.problem import CutProblem, PartitionResult, Value, evaluate
from fxpipe.partitioner.profile import (SendCost, cache_dir, load_profile, load_send_cost,
                                        profile_graph, profile_key, save_profile,
                                        send_cost_path)
from fxpipe.partitioner.recompute import apply_recompute, cheap_values, is_clone
from fxpipe.partitioner.refine import MAX_CUTS, MAX_RIVALS, NEAR, refine_cuts
from fxpipe.partitioner.servers import assign_servers, even_server_bytes
from fxpipe.partitioner.search import (Candidate, candidates, rank_inflight, stage_inflight,
                                       tensor_degrees)
from fxpipe.partitioner.solvers import chain_bottleneck, optimal_partition
from fxpipe.partitioner.split import build_stages
from fxpipe.partitioner.stage_timing import (StageTimes, side_by_side_groups, stage_times_key,
                                             time_stages)
from fxpipe.partitioner.tensor_costs import (TensorPricing, expand_blocks, scaled_costs,
                                             scaled_times, tensor_pricing, with_comm)
from fxpipe.partitioner.timing import NodeTimes, analytic_times, sum_times
from fxpipe.partitioner.trace import TracedModel, fake_on_device, trace
from fxpipe.plans.plan import Plan, StagePlan
from fxpipe.plans.values import needs_grad
from fxpipe.runtime.grad_fusion import fuse_weight_grads
from fxpipe.plans.placement import (global_rank, grid_slots_per_node, node_of,
                                    nodes_of_stage_rank, pair_crosses_nodes, ring_crosses_nodes,
                                    ring_members_per_node,
                                    stage_to_rank)
from fxpipe.schedule.lowering import compute_schedule
from fxpipe.schedule.simulate import (Links, LoweredSchedule, SimResult, StageCosts, predict,
                                      simulate)
from fxpipe.tensor.choose import DegreeError
from fxpipe.tensor.stages import plan_stage_sharding
from fxpipe.specs.loader import build_model, load_spec, spec_location
from fxpipe.specs.gpus import link_curve
from fxpipe.specs.schema import (ParallelSpec,
                                 compression_rank_problems, stages_per_rank, state_factor)
from fxpipe.training.losses import MODEL_LOSS
from fxpipe.units import human_bytes, plural

#: the planner's phases (tracing, pricing, profiling, the auto search), at INFO: silent unless a
#: caller listens (``fxpipe.reports.progress.planning_progress`` shows them on a terminal)
_progress = logging.getLogger("fxpipe.progress")


#: Sender-side seconds per message of a CPU (gloo) send when none was measured.
CPU_SEND_OVERHEAD_S = 30e-6


def as_spec(spec: Any) -> ParallelSpec:
    """A :class:`ParallelSpec` as it is, or loaded from a YAML path, bundled name or dict."""
    return spec if isinstance(spec, ParallelSpec) else load_spec(spec)


def _boundary_bandwidths(spec: ParallelSpec, cand: Candidate, stage_to_rank: list[int]
                         ) -> list[float]:
    """Bytes/s of the link between stage j and j+1 (inter-node when any replica's pair spans
    two nodes). Stages on one rank exchange values in memory (infinite bandwidth)."""
    links = spec.cluster.links
    dpn = grid_slots_per_node(spec.cluster.devices_per_node, cand.tensor)
    out = []
    for a, b in zip(stage_to_rank[:-1], stage_to_rank[1:]):
        if a == b:
            out.append(float("inf"))
        elif pair_crosses_nodes(a, b, cand.pipeline, cand.dp, dpn, cand.layout):
            out.append(links.inter_node_GBps * 1e9)
        else:
            out.append(links.intra_node_GBps * 1e9)
    return out


def _cheap_values(pg: PricedGraph, spec: ParallelSpec) -> set[str]:
    """Values cheaper to rebuild in each stage than to send (:mod:`fxpipe.partitioner.recompute`):
    priced over the fastest link, so the choice holds wherever a cut falls."""
    traced = pg.traced
    params = {k for k, fqn in traced.param_fqns.items() if fqn not in traced.buffer_fqns}
    sizes = {}
    for row in pg.values:
        dtype = pg.value_info(row.name)[1]
        sizes[row.name] = (row.nbytes, needs_grad(dtype))
    links = spec.cluster.links
    return cheap_values(traced.gm, {n: c.fwd_flops for n, c in pg.costs.items()}, params, sizes,
                        spec.cluster.device_tflops * 1e12,
                        max(links.intra_node_GBps, links.inter_node_GBps) * 1e9, links.latency_s)


@dataclass
class Priced:
    """A traced graph with everything the planner prices it by.

    Attributes:
        traced: the traced model (at ``batch`` samples per micro-batch).
        costs: FLOPs and bytes per FX node.
        times: seconds per FX node (:mod:`fxpipe.partitioner.timing`: roofline or measured).
        pg: the networkx graph of planning units.
        cheap: values cheaper to rebuild in each stage than to send.
        send: the sender-side cost of one message.
        batch: the micro-batch size traced.
        loss: the loss's seconds (already in ``times``, on the node producing the model output).
        loss_at: the node whose times include the loss's (None when nothing was added).
        tensor: at a tensor-parallel degree above 1, the sharding and its costs (the costs
            and times above are then one rank's: :mod:`fxpipe.partitioner.tensor_costs`).
    """

    traced: TracedModel
    costs: dict[str, NodeCost]
    times: dict[str, NodeTimes]
    pg: PricedGraph
    cheap: set[str]
    send: SendCost
    batch: int
    table: UnitTable | None = None
    loss: NodeTimes = dataclasses.field(default_factory=NodeTimes)
    loss_at: str | None = None
    tensor: TensorPricing | None = None

    @property
    def degree(self) -> int:
        """The tensor-parallel degree these costs are for."""
        return self.tensor.t if self.tensor is not None else 1

    def __post_init__(self) -> None:
        if self.table is None:
            self.table = _node_table(self)


def _node_table(pr: "Priced") -> UnitTable:
    """The node-level units of the priced graph (one per FX node, getitems merged)."""
    pg, g = pr.pg, pr.pg.graph
    times = []
    for u in pg.order:
        t = sum_times(pr.times, g.nodes[u]["members"])
        times.append((t.fwd_s, t.bwd_input_s, t.bwd_weight_s))
    n = len(pg.order)
    values = []
    for row in pg.values:
        users = tuple(u for u in row.user_positions if u < n)  # n = the loss, on the last stage
        if users and row.name not in pr.cheap:
            grad = needs_grad(pg.value_info(row.name)[1])
            values.append(Value(row.producer_pos, users, row.nbytes, grad, row.name))
    return UnitTable(
        list(pg.order), times,
        [(g.nodes[u]["fwd_flops"], g.nodes[u]["bwd_flops"], g.nodes[u]["bwd_weight_flops"])
         for u in pg.order],
        [g.nodes[u]["param_bytes"] for u in pg.order],
        [g.nodes[u]["saved_bytes"] for u in pg.order], values, list(pg.forced_cuts),
        dict(pg.pins))


def _send_cost(spec: ParallelSpec) -> SendCost:
    """What a send costs, charged to the sending rank: with ``cluster.costs: measured`` what
    ``fxpipe profile`` measured (sender and receiver on busy ranks) when cached, else on CPU
    (gloo copies in the sender's thread) a fixed overhead plus the bytes at memory speed, and
    nothing on CUDA (NCCL works on the device)."""
    measured = load_send_cost(spec.cluster.device) if spec.cluster.costs == "measured" else None
    if measured is not None:
        return measured
    if spec.cluster.device == "cpu":
        return SendCost(CPU_SEND_OVERHEAD_S, spec.cluster.memory_Bps)
    return SendCost(0.0, float("inf"))


def _analytic_times(costs: dict[str, NodeCost], spec: ParallelSpec) -> dict[str, NodeTimes]:
    """Analytic seconds per node: on CUDA the GPU model (:mod:`fxpipe.partitioner.gpu_model`),
    else the roofline of :mod:`fxpipe.partitioner.timing`."""
    cl = spec.cluster
    if cl.device == "cuda":
        return gpu_times(costs, _gpu_rates(spec))
    return analytic_times(costs, cl.device_tflops * 1e12, cl.memory_Bps, cl.op_overhead_s)


def _gpu_rates(spec: ParallelSpec) -> GpuRates:
    cl = spec.cluster
    return gpu_rates(gpu_profile(cl.gpu), cl.device_tflops, cl.memory_Bps / 1e9,
                     spec.train.precision, cl.op_overhead_s, cl.attention)


def _loss_Bps(spec: ParallelSpec) -> float:
    """Memory bandwidth the analytic loss runs at: on CUDA the achievable HBM rate (the loss
    runs in fp32 under autocast), else ``cluster.memory_Bps``."""
    cl = spec.cluster
    if cl.device == "cuda":
        return cl.memory_Bps * gpu_profile(cl.gpu).hbm_efficiency
    return cl.memory_Bps


def _collective_curve(spec: ParallelSpec) -> dict:
    """The tensor group's collective pricing on CUDA (message-size curve, NVLink all-reduce
    bus bandwidth, 16-bit activations on the wire): :func:`tensor_pricing`'s keywords."""
    cl = spec.cluster
    if cl.device != "cuda":
        return {}
    prof = gpu_profile(cl.gpu)
    # the all-reduce's extra (NVLink SHARP) in proportion to the ring bandwidth given
    ar = cl.links.intra_node_GBps * prof.nvlink_allreduce_busbw_GBps / prof.nvlink_busbw_GBps
    return {"half_bytes": prof.intra_half_MB * 1e6, "allreduce_GBps": ar,
            "byte_scale": 0.5 if spec.train.precision in ("bf16", "fp16") else 1.0}


def _node_times(traced: TracedModel, costs: dict[str, NodeCost], spec: ParallelSpec,
                profile_model: nn.Module | None, inputs: list
                ) -> tuple[dict[str, NodeTimes], NodeTimes]:
    """Seconds per node: the roofline, or with ``cluster.costs: measured`` the cached profile
    (measured now on ``profile_model``, a model with real weights, when none is cached); the
    loss's forward and backward (:mod:`fxpipe.partitioner.loss_cost`) added to the node that
    produces the model output. Also returns the loss's times alone.

    Raises:
        PlanError: measured costs are asked for, none are cached and the model has no real
            weights to measure.
    """
    cl = spec.cluster
    node = loss_node(traced, costs)
    loss_name = spec.train.loss if node is not None else MODEL_LOSS  # else nothing to add it to
    if cl.costs == "analytic":
        times = _analytic_times(costs, spec)
        loss = analytic_loss_times(loss_name, output_bytes(traced), _loss_Bps(spec),
                                   cl.op_overhead_s)
        return with_loss(times, node, loss), loss
    precision = spec.train.precision
    key = profile_key(traced, cl.device, precision)
    times = load_profile(key)
    if times is None:
        if torch.device(cl.device).type == "cuda" and not torch.cuda.is_available():
            raise PlanError(
                "cluster.costs is 'measured' but this model's costs have not been measured on "
                f"{cl.device}, and this machine has no CUDA device to measure them: run "
                "`fxpipe profile SPEC` on a machine with the spec's devices and copy its "
                f"{cache_dir() / 'profiles'} here, or plan with cluster.costs: analytic")
        if profile_model is None:
            raise PlanError(
                "cluster.costs is 'measured' but this model's costs have not been measured on "
                f"{cl.device}; run `fxpipe profile SPEC` first, or plan a model with real "
                "weights (not on the meta device)")
        real = trace(profile_model, traced_args(traced, inputs)[0], spec.model.tracer,
                     example_kwargs=traced_args(traced, inputs)[1], output=spec.loss_output)
        times = profile_graph(real, inputs, cl.device, precision=precision,
                              progress=lambda done, total: (
            _progress.info("profiling %d/%d nodes (cluster.costs: measured)", done, total)))
        save_profile(key, times, {"model": traced.model_name, "device": cl.device,
                                  "precision": precision})
    missing = [n for n in costs if n not in times]
    if missing:
        raise PlanError(f"the measured costs do not cover nodes {missing[:5]}; re-run "
                        "`fxpipe profile SPEC`")
    if torch.device(cl.device).type == "cuda" and not torch.cuda.is_available():
        loss = analytic_loss_times(loss_name, output_bytes(traced), _loss_Bps(spec),
                                   cl.op_overhead_s)  # no device here to time the loss on
    else:
        size = next((int(t.shape[0]) for t in inputs if isinstance(t, torch.Tensor) and t.dim()),
                    1)
        loss = measured_loss_times(traced, loss_name, cl.device, precision=precision,
                                   ignore_index=spec.train.ignore_index,
                                   target=lambda: example_microbatch(spec, size).target)
    return with_loss(times, node, loss), loss


def at_degree(pr: Priced, spec: ParallelSpec, t: int) -> Priced:
    """``pr``'s costs for one rank of a tensor group of ``t`` ranks
    (:mod:`fxpipe.partitioner.tensor_costs`): per-node work, bytes and parameters shared where
    sharded, the tensor group's collectives added; ``pr`` itself at degree 1.

    Raises:
        DegreeError: the model's heads or vocabulary do not divide by ``t``.
    """
    if t <= 1:
        return pr
    cl, traced = spec.cluster, pr.traced
    trainable = {k for k, fqn in traced.param_fqns.items() if fqn not in traced.buffer_fqns}
    tp = tensor_pricing(traced.gm, t, sequence_parallel=spec.parallel.sequence_parallel,
                        output_loss=None if spec.train.loss == MODEL_LOSS else spec.train.loss,
                        trainable=trainable, intra_node_GBps=cl.links.intra_node_GBps,
                        latency_s=cl.links.latency_s, strict=spec.parallel.tensor != "auto",
                        **_collective_curve(spec))
    costs = scaled_costs(pr.costs, tp)
    loss = (pr.loss.scaled(tp.fraction.get(pr.loss_at, 1.0)) if pr.loss_at is not None
            else pr.loss)
    if cl.costs == "analytic":
        times = with_comm(with_loss(_analytic_times(costs, spec), pr.loss_at, loss), tp)
    else:
        times = scaled_times(pr.times, tp)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the degree-1 graph said what there is to say
        pg = build_graph(traced, costs)
    out = Priced(traced, costs, times, pg, pr.cheap, pr.send, pr.batch, loss=loss,
                 loss_at=pr.loss_at, tensor=tp)
    if pr.table.folding is not None:
        folded = fold(pg, pr.table.folding.run, out.table.times, pr.cheap)
        if folded is None:  # pragma: no cover - the degree-1 graph folded
            raise PlanError("the model's blocks fold at tensor degree 1 but not at "
                            f"{t}; plan it with parallel.tensor: 1")
        out.table = folded
    return out


def _tensor_inputs(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensor inputs in call order: what a trace's ``input_names`` name."""
    return [v for v in [*args, *kwargs.values()] if isinstance(v, torch.Tensor)]


def traced_args(traced: TracedModel, inputs: list) -> tuple[tuple, dict]:
    """Split placeholder values (graph order) back into positional and keyword inputs."""
    kw = traced.input_kwargs
    named = dict(zip(traced.input_names, inputs))
    return (tuple(v for n, v in named.items() if n not in kw), {n: named[n] for n in kw})


def _slowdowns(spec: ParallelSpec, cand: Candidate, stage_to_rank: list[int]) -> list[float]:
    """Per stage, how much slower than ``device_tflops`` its devices compute
    (``cluster.node_tflops``; the slowest replica of the stage counts), 1 without per-node
    speeds."""
    cl = spec.cluster
    if not cl.node_tflops:
        return [1.0] * len(stage_to_rank)
    slots = grid_slots_per_node(cl.devices_per_node, cand.tensor)
    return [max(cl.device_tflops / cl.node_tflops[nd] for nd in nodes_of_stage_rank(
        r, cand.pipeline, cand.dp, slots, cand.layout)) for r in stage_to_rank]


def _fastest_slowdown(spec: ParallelSpec) -> float:
    """The smallest per-stage slowdown any layout can give (:func:`_slowdowns`): 1 without
    per-node speeds, else the fastest node's ``device_tflops / node_tflops``."""
    cl = spec.cluster
    if not cl.node_tflops:
        return 1.0
    return min(1.0, min(cl.device_tflops / t for t in cl.node_tflops))


def _recompute_held(values: list[Value]) -> float:
    """Bytes a recomputing stage keeps per micro-batch in flight: its input, at most the
    largest value between units (the planner's memory model of recomputation)."""
    return max((v.nbytes for v in values), default=0.0)


def _held_note(capacity: float, inflight: float, held: float, mbs: float, whole: bool) -> str:
    """Why recomputation leaves less (or no) device memory: the stage inputs it keeps."""
    keep = (f"{human_bytes(held, True)} per micro-batch in flight on the stage (the largest "
            f"value between units at micro-batch size {mbs:g}; up to {inflight:g} in flight: "
            f"{human_bytes(inflight * held, True)})")
    if whole:
        return (f"with activation recomputation each stage keeps its input for every "
                f"micro-batch in flight, {keep}, which fills the device's "
                f"{human_bytes(capacity, True)}; use smaller micro-batches (more of them)")
    return (f"with activation recomputation that is the device's {human_bytes(capacity, True)} "
            f"less the stage inputs kept for recomputation, {keep}")


def _cut_problem(pr: Priced, spec: ParallelSpec, cand: Candidate, scale: float,
                 share: int = 1, inflight: Sequence[float] | None = None) -> CutProblem:
    """The cut problem of one candidate layout at ``scale`` x the traced micro-batch, over the
    priced units (node-level, or blocks when the model folds); cheap values are not in it
    (each stage rebuilds them). ``share``: each stage may use 1/share of its device (a rank
    that holds several stages); ``inflight``: micro-batches in flight per stage to bound each
    stage's memory by, instead of the stage's own peak (:func:`_shared_inflight`)."""
    tb = pr.table
    values = [Value(v.producer, v.users, v.nbytes * scale, v.grad, v.name) for v in tb.values]
    peaks, stage_to_rank = stage_inflight(cand)
    inflight = list(peaks) if inflight is None else list(inflight)
    k = cand.num_stages
    capacity: float | list[float] = spec.cluster.memory_gb * 1e9 / share
    if cand.recompute:  # keep each stage's input per micro-batch, run the forward again
        compute = [(2 * f + bi + bw) * scale for f, bi, bw in tb.times]
        saved = [0.0] * len(tb.saved)
        held = _recompute_held(values)
        if max(inflight) * held >= capacity:
            raise PlanError(_held_note(capacity, max(inflight), held, scale * pr.batch, True))
        capacity = [capacity - n * held for n in inflight]
    else:
        compute = [sum(x) * scale for x in tb.times]
        saved = [s * scale for s in tb.saved]
    return CutProblem(
        compute, tb.params, saved, values, k,
        bandwidth_Bps=_boundary_bandwidths(spec, cand, stage_to_rank) if k > 1 else 1.0,
        latency_s=spec.cluster.links.latency_s,
        capacity_bytes=capacity,
        param_multiplier=state_factor(spec.train.optimizer, cand.sharding, cand.dp),
        inflight=inflight,
        forced_cuts=tb.forced_cuts,
        pins=tb.pins,
        unit_names=tb.names,
        slowdown=_slowdowns(spec, cand, stage_to_rank),
    )


class _Recompute(NamedTuple):
    """Activation recomputation of one cut, stage by stage (:func:`_recompute_stages`).

    Attributes:
        flags: per stage, whether it recomputes.
        plain: the cut priced without recomputation, where some stage of a recomputing
            candidate keeps its activations (its activation and memory bytes); else None.
        memory: per stage, the bytes its rank holds for it as planned (a recomputing stage's
            inputs kept per micro-batch in flight included); None without recomputation (the
            solver's figures are those bytes).
    """

    flags: list[bool]
    plain: PartitionResult | None
    memory: list[float] | None


def _recompute_stages(pr: Priced, spec: ParallelSpec, cand: Candidate, cuts: Sequence[int],
                      scale: float) -> _Recompute:
    """Which stages of a cut recompute their activations. None in a candidate without
    recomputation and every stage with ``train.activation_recompute: on``; with ``auto`` a
    stage keeps its activations (and skips the second forward) where its rank's device still
    holds all the rank's stages: the cut was solved with every stage recomputing, and stages
    drop it rank by rank, the one saving the most time first."""
    k = cand.num_stages
    if not cand.recompute:
        return _Recompute([False] * k, None, None)
    inflight, s2r = stage_inflight(cand)
    rc_problem = _cut_problem(pr, spec, cand, scale)
    with_rc = evaluate(rc_problem, list(cuts), method="given")
    held = _recompute_held(rc_problem.values)
    memory = [float(with_rc.memory_bytes[j]) + inflight[j] * held for j in range(k)]
    if spec.train.activation_recompute == "on":
        return _Recompute([True] * k, None, memory)
    plain = evaluate(_cut_problem(pr, spec, dataclasses.replace(cand, recompute=False), scale),
                     list(cuts), method="given")
    device = spec.cluster.memory_gb * 1e9
    flags = [True] * k
    static = [float(with_rc.memory_bytes[j]) for j in range(k)]  # nothing saved per micro-batch
    per_mb = [held] * k
    for st, tops in rank_inflight(cand):
        for j in sorted(st, key=lambda j: (plain.compute_s[j] - with_rc.compute_s[j], j)):
            was, per_mb[j] = per_mb[j], float(plain.saved_bytes[j])
            if _rank_peak(st, tops, static, per_mb) <= device:
                flags[j], memory[j] = False, float(plain.memory_bytes[j])
            else:
                per_mb[j] = was
    return _Recompute(flags, None if all(flags) else plain, memory)


def _rank_peak(stages: Sequence[int], tops: Sequence[Sequence[int]], static: Sequence[float],
               per_mb: Sequence[float]) -> float:
    """Peak bytes of a rank holding ``stages``: their static bytes and, at the worst moment
    (``tops``: :func:`~fxpipe.partitioner.search.rank_inflight`), the micro-batches in flight
    on each times its bytes per micro-batch."""
    return (sum(static[j] for j in stages)
            + max(sum(n * per_mb[j] for n, j in zip(top, stages)) for top in tops))


def _stage_bytes(spec: ParallelSpec, cand: Candidate, result: PartitionResult,
                 rc: _Recompute) -> tuple[list[float], list[float]]:
    """Per stage of a cut: the bytes held whatever is in flight (parameters, gradients,
    optimizer state) and the bytes per micro-batch in flight (its activations, or the input a
    recomputing stage keeps)."""
    peaks = stage_inflight(cand)[0]
    mem = rc.memory if rc.memory is not None else [float(b) for b in result.memory_bytes]
    mult = state_factor(spec.train.optimizer, cand.sharding, cand.dp)
    static = [mult * float(b) for b in result.param_bytes]
    return static, [max(0.0, (mem[j] - static[j]) / peaks[j]) for j in range(len(static))]


def _shared_inflight(cand: Candidate) -> list[float]:
    """Per stage, the micro-batches in flight of its rank at the rank's peak, shared evenly by
    the rank's stages: a rank's activations fit when each of its ``n`` stages holds this many
    within 1/n of the device and the stages' activations per micro-batch are alike."""
    out = [0.0] * cand.num_stages
    for st, tops in rank_inflight(cand):
        for j in st:
            out[j] = max(sum(t) for t in tops) / len(st)
    return out


def _rank_memory(spec: ParallelSpec, cand: Candidate, result: PartitionResult,
                 rc: _Recompute) -> str | None:
    """Why the ranks' devices cannot hold the cut's stages (each fits alone, but a rank that
    holds several holds them all, at its peak: :func:`_rank_peak`, not the sum of each stage's
    own peak), or None when every rank's stages fit."""
    static, per_mb = _stage_bytes(spec, cand, result, rc)
    device = spec.cluster.memory_gb * 1e9
    for r, (mine, tops) in enumerate(rank_inflight(cand)):
        need = _rank_peak(mine, tops, static, per_mb) if len(mine) > 1 else 0.0
        if need > device:
            return (f"rank {r} holds stages {', '.join(map(str, mine))}, which need "
                    f"{human_bytes(need, True)} together at their peak but the device "
                    f"has {human_bytes(device, True)}")
    return None


def _solve_fitting(pr: Priced, spec: ParallelSpec, cand: Candidate, scale: float,
                   solved: dict | None = None
                   ) -> tuple[CutProblem, PartitionResult, _Recompute]:
    """The candidate's optimal cut and its recomputation, such that every rank's device holds
    all of its stages: the solver bounds each stage by the device; where a rank holds several
    (interleaved, the V schedules) and they do not fit together at the rank's peak, the cut is
    solved again with each stage bounded by its share of the device (the device / stages per
    rank), first with the rank's peak in flight shared by its stages (:func:`_shared_inflight`),
    then, if that cut does not fit either, with each stage's own peak.

    Raises:
        PlanError: no cut fits.
    """
    def solve(problem: CutProblem) -> tuple[CutProblem, PartitionResult, _Recompute]:
        result = (_solve_cached(problem, solved) if solved is not None
                  else optimal_partition(problem))
        return problem, result, _recompute_stages(pr, spec, cand, result.cuts, scale)

    first = solve(_cut_problem(pr, spec, cand, scale))
    over = _rank_memory(spec, cand, first[1], first[2])
    if over is None:
        return first
    share = cand.num_stages // cand.pipeline
    shared = _shared_inflight(cand)
    tries = [shared, None] if shared != [float(x) for x in stage_inflight(cand)[0]] else [None]
    why: str | None = None
    for inflight in tries:
        try:
            again = solve(_cut_problem(pr, spec, cand, scale, share, inflight))
        except PlanError as e:
            why = why or f"{over}; with each stage held to 1/{share} of the device: {e}"
            continue
        still = _rank_memory(spec, cand, again[1], again[2])
        if still is None:
            return again
        why = why or still
    raise PlanError(why)


def _slowest(stages: list[StagePlan], result: PartitionResult) -> int:
    """The bottleneck stage as planned: the solver's, unless some stages dropped
    recomputation after the solve (:func:`_recompute_stages`) and another is now slower."""
    times = [st.time_s for st in stages]
    return result.bottleneck if times[result.bottleneck] >= max(times) else times.index(max(times))


def _lower_bound(stages: list[StagePlan], result: PartitionResult) -> float:
    """Total compute per micro-batch over the stages (no cut can beat it), with the stages'
    recomputation as planned (the solver's figure counts every stage recomputing)."""
    if all(st.recompute for st in stages) or not any(st.recompute for st in stages):
        return result.lower_bound_s
    now = sum(st.compute_time_s for st in stages)
    solved = now + sum(st.fwd_time_s for st in stages if not st.recompute)
    return result.lower_bound_s * now / solved if solved > 0 else result.lower_bound_s


def _assemble(pr: Priced, result: PartitionResult, cand: Candidate, spec: ParallelSpec,
              microbatch_size: int, explain: list[str], scale: float = 1.0,
              final: bool = True) -> Plan:
    """Turn a partition of units into a Plan (stage boundaries from the traced graph).

    ``scale`` (micro-batch size / traced batch size) scales times and value bytes when ranking
    candidates of another micro-batch size than the one traced; the final plan uses 1. The
    final plan rewrites ``traced.gm`` so that each stage rebuilds the ``cheap`` values it reads
    (:func:`~fxpipe.partitioner.recompute.apply_recompute`); a ranking plan leaves the graph as
    it is and prices those values at 0 bytes instead."""
    traced, pg, costs, times, cheap = pr.traced, pr.pg, pr.costs, pr.times, pr.cheap
    g = pg.graph
    node_stage: dict[str, int] = {}
    for pos, stage in enumerate(result.stage_of()):
        for member in g.nodes[pg.order[pos]]["members"]:
            node_stage[member] = stage
    recomputed: dict[str, list[int]] = {}
    if final and cheap:
        for name in sorted(cheap):
            s = node_stage.get(name)
            readers = {node_stage[u.name] for u in traced.node(name).users
                       if node_stage.get(u.name, s) != s}
            if s is not None and readers:
                recomputed[name] = sorted(readers)
        node_stage = apply_recompute(traced.gm, recomputed, node_stage)
        costs, times = dict(costs), dict(times)
        for n in node_stage:
            if is_clone(n):
                costs[n] = costs[n.rsplit("__r", 1)[0]]
                times[n] = times[n.rsplit("__r", 1)[0]]
    bounds = stage_boundaries(traced.gm, node_stage, cand.num_stages)
    slow = _slowdowns(spec, cand, stage_to_rank(cand.schedule, cand.pipeline, cand.num_stages))
    rc, plain, _ = _recompute_stages(pr, spec, cand, result.cuts, scale)
    stages = []
    for j, sb in enumerate(bounds.stages):
        nodes = [n for n in sb.nodes if n in costs]
        fwd = scale * float(sum(costs[n].fwd_flops for n in nodes))
        bwd = scale * float(sum(costs[n].bwd_flops for n in nodes))
        bwd_w = scale * float(sum(costs[n].bwd_weight_flops for n in nodes))
        tj = sum_times(times, nodes).scaled(scale * slow[j])
        if rc[j]:  # the backward runs the forward again first
            tj = NodeTimes(tj.fwd_s, tj.fwd_s + tj.bwd_input_s, tj.bwd_weight_s)
        mem = result if rc[j] or plain is None else plain  # a stage that keeps its activations
        loss_s = (pr.loss.total_s * scale * slow[j] if pr.loss.total_s > 0
                  and j == cand.num_stages - 1 else 0.0)
        stages.append(StagePlan(
            index=j, nodes=list(sb.nodes), params=list(sb.params), buffers=list(sb.buffers),
            inputs=list(sb.inputs), outputs=list(sb.outputs),
            fwd_flops=fwd, bwd_flops=bwd, bwd_weight_flops=bwd_w,
            param_bytes=int(result.param_bytes[j]), activation_bytes=int(mem.saved_bytes[j]),
            recv_bytes=int(result.recv_bytes[j]), send_bytes=int(result.send_bytes[j]),
            compute_time_s=tj.total_s, comm_time_s=result.comm_s[j],
            time_s=tj.total_s + result.comm_s[j], memory_bytes=int(mem.memory_bytes[j]),
            fwd_time_s=tj.fwd_s, bwd_input_time_s=tj.bwd_input_s,
            bwd_weight_time_s=tj.bwd_weight_s,
            recompute=rc[j], loss_time_s=float(loss_s),
        ))
    values = {k: dataclasses.replace(v, nbytes=0 if k in cheap else int(v.nbytes * scale))
              for k, v in bounds.values.items()}
    plan = Plan(
        model=traced.model_name or type(traced.gm).__name__,
        num_stages=cand.num_stages, pipeline=cand.pipeline, dp=cand.dp,
        microbatches=cand.microbatches, schedule=cand.schedule,
        virtual_stages=stages_per_rank(cand.schedule, cand.virtual_stages),
        microbatch_size=microbatch_size, stages=stages, values=values,
        model_inputs=list(bounds.model_inputs), model_output=bounds.model_outputs[0],
        shared_params=dict(bounds.shared_params), param_aliases=dict(bounds.param_aliases),
        bottleneck_stage=_slowest(stages, result), lower_bound_s=_lower_bound(stages, result),
        explain=list(explain), spec=spec.model_dump(mode="json"), recomputed=recomputed,
        placement=cand.layout, data_sharding=cand.sharding,
    )
    _set_tensor(plan, pr, spec)
    _set_send_times(plan, pr.send)
    plan.predicted = predict(plan)
    return plan


def _stage_nodes(plan: Plan, pr: Priced) -> list[list[str]]:
    """The traced graph's nodes each stage runs (with repeats: a folded plan's stage runs the
    representative block's nodes once per block it holds)."""
    fo = pr.table.folding
    if fo is None:
        return [list(st.nodes) for st in plan.stages]
    pg, rec = pr.pg, plan.folded
    out: list[list[str]] = [[] for _ in plan.stages]
    for node, s in rec["prologue"].items():
        out[s].append(node)
    block = [m for u in fo.block_units[-1] for m in pg.graph.nodes[pg.order[u]]["members"]]
    for s in rec["blocks"]:
        out[s] += block
    after = [m for u in fo.epilogue for m in pg.graph.nodes[pg.order[u]]["members"]]
    for node, s in zip(after, rec["epilogue"]):
        out[s].append(node)
    return out


def _stage_comms(plan: Plan, pr: Priced, spec: ParallelSpec) -> list[list]:
    """Per stage, the tensor group's collectives of one micro-batch: as the runtime runs each
    stage's own graph (its inputs and outputs whole: a value split where a cut falls is gathered
    there); a plan of repeated blocks counts the traced graph's nodes block by block."""
    tp = pr.tensor
    if plan.folded:
        return [[c for n in nodes if n in tp.sharding.nodes for c in tp.sharding.nodes[n].comm]
                for nodes in _stage_nodes(plan, pr)]
    loss = None if spec.train.loss == MODEL_LOSS else spec.train.loss
    mods = build_stages(plan, pr.traced, list(range(plan.num_stages)))
    return [[c for ns in plan_stage_sharding(plan, s, mods[s], loss)[0].nodes.values()
             for c in ns.comm] for s in range(plan.num_stages)]


def _set_tensor(plan: Plan, pr: Priced, spec: ParallelSpec) -> None:
    """The plan's tensor-parallel fields from the priced units' sharding, and what it says:
    how many parameters are split how, what stays whole, and the collectives per
    micro-batch."""
    tp = pr.tensor
    if tp is None:
        return
    plan.tensor, plan.sequence_parallel = tp.t, tp.sequence_parallel
    text = tp.placements_text()
    fo = pr.table.folding
    if fo is not None:  # names of the reduced trace -> every block of the full model
        text = {fo.run.full_name(k): v for k, v in text.items()}
        text = expand_blocks(text, fo.run.prefix, fo.run.start, fo.run.count)
    plan.tensor_params = dict(sorted(text.items()))
    plan.tensor_replicated = tp.replicated()
    for st, comms in zip(plan.stages, _stage_comms(plan, pr, spec)):
        st.tensor_collectives = len(comms)
        st.tensor_bytes = [float(sum(c.nbytes for c in comms if c.phase == "fwd")),
                           float(sum(c.nbytes for c in comms if c.phase == "bwd"))]
    kinds = {"S(0)": 0, "other": 0}
    for v in tp.choice.params.values():
        kinds["S(0)" if v.dim == 0 else "other"] += 1
    fwd = sum(b for b, _ in tp.comm_bytes.values())
    bwd = sum(b for _, b in tp.comm_bytes.values())
    count = sum(len(ns.comm) for ns in tp.sharding.nodes.values())
    whole = (f"; {len(plan.tensor_replicated)} layers or ops run whole in their group "
             f"(plan.tensor_replicated)" if plan.tensor_replicated else "")
    plan.explain.append(
        f"tensor parallelism {tp.t}{' with sequence parallelism' if tp.sequence_parallel else ''}:"
        f" {len(tp.choice.params)} parameters of the traced graph split (plan.tensor_params: "
        f"{kinds['S(0)']} on dim 0 - column-parallel outputs, vocabularies - and {kinds['other']}"
        f" on another dim - row-parallel inputs, Conv1D columns){whole}; per micro-batch "
        f"{count} collectives over the tensor group move {human_bytes(fwd, True)} forward and "
        f"{human_bytes(bwd, True)} backward (whole tensors; ring on the intra-node link)")


def _resize(t: Any, size: int) -> Any:
    """A tensor with dim 0 resized to ``size`` (repeating or slicing); other values as they are."""
    if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] == size:
        return t
    if t.shape[0] > size:
        return t[:size]
    reps = -(-size // t.shape[0])
    return t.repeat(reps, *([1] * (t.dim() - 1)))[:size]


def _is_fake(model: nn.Module) -> bool:
    return any(isinstance(t, FakeTensor) for t in [*model.parameters(), *model.buffers()])


def _model_device(model: nn.Module) -> str:
    for t in [*model.parameters(), *model.buffers()]:
        return t.device.type
    return "cpu"


def tracing_model(model: nn.Module, args: tuple, kwargs: dict, device: str
                  ) -> tuple[nn.Module, tuple, dict, str]:
    """What to trace so that the graph is the one a worker on ``device`` traces: the model
    itself when it already lives there, else a fake copy on ``device`` (:func:`fake_on_device`;
    a meta model costs no memory), or on meta when ``device`` is CUDA and this machine has none
    (the workers then check the graph and explain a difference). Returns the model, inputs and
    the device type traced on."""
    here = _model_device(model)
    if device == "cuda" and not torch.cuda.is_available():
        if here == "cuda":  # pragma: no cover - a CUDA model without CUDA cannot exist
            return model, args, kwargs, here
        meta = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        fake, fargs, fkw = fake_on_device(model, tuple(a.to("meta") for a in args), meta, "meta")
        return fake, fargs, fkw, "meta"
    if here == device:
        return model, tuple(a.to(device) for a in args), {
            k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}, device
    fake, fargs, fkw = fake_on_device(model, args, kwargs, device)
    return fake, fargs, fkw, device


@dataclass(order=True)
class _Ranked:
    step_s: float
    label: str
    cand: Candidate = dataclasses.field(compare=False)
    result: PartitionResult = dataclasses.field(compare=False)
    mbs: int = dataclasses.field(compare=False)


def _unit_prefix(pr: Priced) -> np.ndarray:
    """``(3, n+1)`` prefix sums of the units' forward, input-gradient, weight-gradient seconds."""
    arr = np.asarray(pr.table.times, dtype=np.float64).T.reshape(3, -1)
    return np.concatenate([np.zeros((3, 1)), np.cumsum(arr, axis=1)], axis=1)


def edge_send_times(messages: dict[tuple[int, int], list[float]], num_stages: int,
                    send: SendCost) -> list[float]:
    """Per stage, what one of its SEND actions costs: the mean over the edges it sends on
    (``{(sender, receiver): [bytes of each tensor]}``) of the send costs of the edge's tensors,
    summed (the runtime sends each tensor as its own message); 0 for a stage that sends none."""
    out: list[list[float]] = [[] for _ in range(num_stages)]
    for (s, _), sizes in messages.items():
        out[s].append(sum(send.seconds(b) for b in sizes))
    return [sum(x) / len(x) if x else 0.0 for x in out]


def _set_send_times(plan: Plan, send: SendCost) -> None:
    """Fill each stage's ``send_time_s`` and ``grad_send_time_s`` from the plan's edges (a
    gradient goes back from the consumer to the producer of a value)."""
    fwd: dict[tuple[int, int], list[float]] = {}
    grad: dict[tuple[int, int], list[float]] = {}
    for (ps, cs), names in plan.stage_edges().items():
        fwd[(ps, cs)] = [plan.values[n].nbytes for n in names]
        g = [plan.values[n].nbytes for n in names if plan.values[n].requires_grad]
        if g:
            grad[(cs, ps)] = g
    n = len(plan.stages)
    for st, f, g in zip(plan.stages, edge_send_times(fwd, n, send),
                        edge_send_times(grad, n, send)):
        st.send_time_s, st.grad_send_time_s = f, g


@functools.lru_cache(maxsize=4)
def _full_schedule(name: str, p: int, m: int, v: int, edges: frozenset, grad_edges: frozenset):
    """``build_schedule`` for the search, as a :class:`LoweredSchedule` (the simulator's
    compiled form of it, without building its communication actions: it prices exactly the
    same), kept for the few most recent layouts: both placements of a grid and cuts with the
    same stage edges share it (the simulator only reads it; a schedule of hundreds of
    micro-batches takes seconds to build)."""
    return LoweredSchedule(compute_schedule(name, p, m, v), set(edges), set(grad_edges))


def _simulate_cut(pr: Priced, prefix: np.ndarray, problem: CutProblem,
                  result: PartitionResult, cand: Candidate, spec: ParallelSpec,
                  scale: float,
                  recompute: _Recompute | None = None
                  ) -> SimResult:
    """Simulate one step of a candidate's partition straight from the cut (no Plan built):
    per-stage F/B/W from the unit prefix sums, edge bytes from the values crossing the cuts.
    ``recompute``: :func:`_recompute_stages` of the cut (None: worked out here)."""
    cuts = list(result.cuts) + [problem.n]
    recompute, plain, _ = recompute or _recompute_stages(pr, spec, cand, result.cuts, scale)
    per = [(prefix[:, b] - prefix[:, a]) * scale * problem.slow[j]
           for j, (a, b) in enumerate(zip(cuts[:-1], cuts[1:]))]
    per = [np.array([x[0], x[0] + x[1], x[2]]) if rc else x for x, rc in zip(per, recompute)]
    stage_of = result.stage_of()
    fwd: dict[tuple[int, int], list[float]] = {}
    grad: dict[tuple[int, int], list[float]] = {}  # keyed by (sender of the gradient, receiver)
    for v in problem.values:
        if v.producer < 0:
            continue
        ps = stage_of[v.producer]
        for cs in sorted({stage_of[u] for u in v.users} - {ps}):
            fwd.setdefault((ps, cs), []).append(v.nbytes)
            if v.grad:
                grad.setdefault((cs, ps), []).append(v.nbytes)
    factor = float(problem.param_multiplier)
    costs = StageCosts([float(x[0]) for x in per], [float(x[1]) for x in per],
                       [float(x[2]) for x in per],
                       activation_bytes=[int((result if rc or plain is None else plain)
                                             .saved_bytes[j]) for j, rc in enumerate(recompute)],
                       static_bytes=[int(b * factor) for b in result.param_bytes],
                       send_s=edge_send_times(fwd, len(per), pr.send),
                       grad_send_s=edge_send_times(grad, len(per), pr.send))
    fwd_bytes = {e: sum(v) for e, v in fwd.items()}
    grad_bytes = {(ps, cs): sum(v) for (cs, ps), v in grad.items()}
    sched = _full_schedule(cand.schedule, cand.pipeline, cand.microbatches,
                           cand.virtual_stages, frozenset(fwd_bytes), frozenset(grad_bytes))
    cl = spec.cluster
    servers = cl.parameter_servers if spec.train.updates == "async" else 0
    links = Links.from_cluster(cand.pipeline, cand.dp, cl.nodes,
                               grid_slots_per_node(cl.devices_per_node, cand.tensor),
                               cl.links.intra_node_GBps, cl.links.inter_node_GBps,
                               cl.links.latency_s, cand.layout, servers,
                               **link_curve(cl.device, cl.gpu))
    return simulate(sched, costs, fwd_bytes, links, dp=cand.dp, allreduce_bytes=list(
        result.param_bytes), grad_edge_bytes=grad_bytes, check=False, timeline=False,
        server_bytes=even_server_bytes(list(result.param_bytes), servers) if servers else None)


def _folded_record(pr: Priced, stage_of: list[int]) -> dict:
    """``Plan.folded`` of a folded partition (``stage_of``: the stage of every folded unit):
    the stage of each prologue node, of each block and of each epilogue node, for
    :func:`fxpipe.partitioner.blocks.resolve_folded`."""
    fo, pg = pr.table.folding, pr.pg
    g, run, n_pro = pg.graph, fo.run, len(fo.prologue)
    folded_unit = {p_: i for i, p_ in enumerate(fo.prologue)}
    folded_unit.update({p_: n_pro + run.count + i for i, p_ in enumerate(fo.epilogue)})
    return {"run": run.to_dict(),
            "prologue": {m: stage_of[folded_unit[p_]] for p_ in fo.prologue
                         for m in g.nodes[pg.order[p_]]["members"]},
            "blocks": [stage_of[n_pro + b] for b in range(run.count)],
            "epilogue": [stage_of[folded_unit[p_]] for p_ in fo.epilogue
                         for _ in g.nodes[pg.order[p_]]["members"]],
            "cheap": sorted(pr.cheap)}


def _assemble_folded(pr: Priced, result: PartitionResult, cand: Candidate, spec: ParallelSpec,
                     mbs: int, explain: list[str]) -> Plan:
    """A Plan of a folded partition: stages as blocks (``Plan.folded`` records which node goes
    where), with times, memory and the prediction from the folded units. Workers resolve it to
    nodes against the full graph (:func:`fxpipe.partitioner.blocks.resolve_folded`)."""
    tb, fo, pg = pr.table, pr.table.folding, pr.pg
    run = fo.run
    g = pg.graph
    stage_of = result.stage_of()
    n_pro = len(fo.prologue)
    rep_index = run.start + KEEP - 1
    rep_prefix = f"{run.block(rep_index)}."
    rep = {"params": [], "buffers": []}
    for p_ in fo.block_units[-1]:
        for kind, held in rep.items():
            for fqn in g.nodes[pg.order[p_]][kind]:
                if fqn.startswith(rep_prefix) and fqn not in held:
                    held.append(fqn)
    record = _folded_record(pr, stage_of)
    block_stage = record["blocks"]
    prefix = _unit_prefix(pr)
    cuts = list(result.cuts) + [len(tb.names)]
    fl = np.concatenate([np.zeros((3, 1)), np.cumsum(np.asarray(tb.flops, dtype=np.float64).T
                                                      .reshape(3, -1), axis=1)], axis=1)
    slow = _slowdowns(spec, cand, stage_to_rank(cand.schedule, cand.pipeline, cand.num_stages))
    rc, plain, _ = _recompute_stages(pr, spec, cand, result.cuts, 1.0)
    stages = []
    for j, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
        params: list[str] = []
        buffers: list[str] = []
        for u in range(a, b):
            if n_pro <= u < n_pro + run.count:
                at = f"{run.block(run.start + u - n_pro)}."
                params += [at + f[len(rep_prefix):] for f in rep["params"]]
                buffers += [at + f[len(rep_prefix):] for f in rep["buffers"]]
            else:
                pos = fo.prologue[u] if u < n_pro else fo.epilogue[u - n_pro - run.count]
                params += [run.full_name(f) for f in g.nodes[pg.order[pos]]["params"]]
                buffers += [run.full_name(f) for f in g.nodes[pg.order[pos]]["buffers"]]
        f_s, bi_s, bw_s = (prefix[:, b] - prefix[:, a]) * slow[j]
        if rc[j]:  # the backward runs the forward again first
            bi_s = bi_s + f_s
        mem = result if rc[j] or plain is None else plain  # a stage that keeps its activations
        ff, bf, wf = (fl[:, b] - fl[:, a])
        stages.append(StagePlan(
            index=j, nodes=[], params=list(dict.fromkeys(params)),
            buffers=list(dict.fromkeys(buffers)), inputs=[], outputs=[],
            fwd_flops=float(ff), bwd_flops=float(bf), bwd_weight_flops=float(wf),
            param_bytes=int(result.param_bytes[j]), activation_bytes=int(mem.saved_bytes[j]),
            recv_bytes=int(result.recv_bytes[j]), send_bytes=int(result.send_bytes[j]),
            compute_time_s=float(f_s + bi_s + bw_s), comm_time_s=result.comm_s[j],
            time_s=float(f_s + bi_s + bw_s) + result.comm_s[j],
            memory_bytes=int(mem.memory_bytes[j]), fwd_time_s=float(f_s),
            bwd_input_time_s=float(bi_s), bwd_weight_time_s=float(bw_s),
            recompute=rc[j],
            loss_time_s=float(pr.loss.total_s * slow[j]) if j == cand.num_stages - 1 else 0.0,
        ))
    # shapes of the model's inputs and output (their names hold in the full graph too, but
    # the output's: workers rename it when they resolve the plan)
    one = stage_boundaries(pr.traced.gm, {n.name: 0 for n in pr.traced.compute_nodes()
                                          if n.name != GUARDS_FN}, 1)
    values = {k: v for k, v in one.values.items()
              if k in one.model_inputs or k in one.model_outputs}
    users: dict[str, list[int]] = {}
    for st in stages:
        for fqn in st.params:
            users.setdefault(fqn, []).append(st.index)
    explain = list(explain) + [
        f"planned as blocks: {run.count} identical {run.prefix or 'top-level '}* blocks, two "
        f"of them traced and priced; stage "
        + ", stage ".join(f"{s}: " + _block_range(run, record, s)
                          for s in range(cand.num_stages))]
    plan = Plan(
        model=pr.traced.model_name, num_stages=cand.num_stages, pipeline=cand.pipeline,
        dp=cand.dp, microbatches=cand.microbatches, schedule=cand.schedule,
        virtual_stages=stages_per_rank(cand.schedule, cand.virtual_stages),
        microbatch_size=mbs, stages=stages, values=values,
        model_inputs=list(one.model_inputs), model_output=one.model_outputs[0],
        shared_params={k: v for k, v in users.items() if len(v) > 1},
        param_aliases={run.full_name(a): run.full_name(c) for a, c in one.param_aliases.items()},
        bottleneck_stage=_slowest(stages, result),
        lower_bound_s=_lower_bound(stages, result), explain=explain, spec=spec.model_dump(mode="json"),
        folded=record, placement=cand.layout, data_sharding=cand.sharding,
    )
    _set_tensor(plan, pr, spec)
    problem = _cut_problem(pr, spec, cand, 1.0)
    _set_send_times(plan, pr.send)
    plan.predicted = _simulate_cut(pr, prefix, problem, result, cand, spec, 1.0).predicted()
    return plan


def _placement_note(plan: Plan, spec: ParallelSpec) -> str:
    """Which groups the chosen layout keeps inside a node, and which cross nodes."""
    dpn = grid_slots_per_node(spec.cluster.devices_per_node, plan.tensor)
    p, d = plan.pipeline, plan.dp
    pairs = [(a, a + 1) for a in range(p - 1)]
    crossing = [f"{a}->{b}" for a, b in pairs
                if pair_crosses_nodes(a, b, p, d, dpn, plan.placement)]
    cross_d = sum(ring_crosses_nodes(r, p, d, dpn, plan.placement) for r in range(p))
    other = "data-inner" if plan.placement == "pipeline-inner" else "pipeline-inner"
    shown = 16
    nodes = [node_of(global_rank(r, 0, p, d, plan.placement), dpn) for r in range(min(p, shown))]
    where = (f"; replica 0's pipeline ranks 0..{p - 1} sit on nodes "
             f"{', '.join(map(str, nodes))}{', ...' if p > shown else ''}")
    if crossing:
        where += (f"; pipeline-rank links that cross nodes: {', '.join(crossing[:shown])}"
                  f"{', ...' if len(crossing) > shown else ''}")
    speeds = spec.cluster.node_tflops
    if speeds is not None and len(set(speeds)) > 1:
        where += (f"; node speeds {', '.join(f'{s:g}' for s in speeds[:shown])}"
                  f"{', ...' if len(speeds) > shown else ''} TFLOP/s: stages on slower nodes "
                  "were given less work (priced at their node's speed)")
    return (f"placement {plan.placement}: {len(crossing)} of {len(pairs)} stage-to-stage links and "
            f"{cross_d} of {p} data-parallel groups cross nodes (inter-node "
            f"{spec.cluster.links.inter_node_GBps:g} GB/s, intra-node "
            f"{spec.cluster.links.intra_node_GBps:g} GB/s); {other} priced slower or equal"
            + where)


def _block_range(run, record: dict, s: int) -> str:
    """What stage ``s`` of a folded plan holds: its range of the run's blocks and how many
    nodes before and after the run (``h.3-5 + 12 nodes after them``)."""
    idx = [run.start + b for b, st in enumerate(record["blocks"]) if st == s]
    parts = [f"{run.block(idx[0])}-{idx[-1]}"] if idx else []
    before = sum(st == s for st in record["prologue"].values())
    after = sum(st == s for st in record["epilogue"])
    if before:
        parts.append(f"{plural(before, 'node')} before the blocks")
    if after:
        parts.append(f"{plural(after, 'node')} after them")
    return " + ".join(parts) or "nothing"


def _ring_s(nbytes: float, n: int, spec: ParallelSpec, pipeline: int, dp: int,
            layout: str = "pipeline-inner", latency: bool = True, tensor: int = 1) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` over ``n`` ranks on the link its group uses
    (0 under async updates: parameter servers replace the all-reduce, and the bounds this
    serves stay valid). Pipeline rank 0's group decides the link: no rank's group uses a
    faster one than rank 0's under either layout, so this never exceeds a rank's own ring.
    ``latency=False`` leaves the per-hop latency out (for a bound on an average over ranks,
    some of which may hold no parameters and run no all-reduce at all)."""
    if n <= 1 or nbytes <= 0 or spec.train.updates == "async":
        return 0.0
    links = spec.cluster.links
    slots = grid_slots_per_node(spec.cluster.devices_per_node, tensor)
    crosses = ring_crosses_nodes(0, pipeline, dp, slots, layout)
    bw = (links.inter_node_GBps if crosses else links.intra_node_GBps) * 1e9
    if crosses and spec.cluster.device == "cuda":  # rails: the fastest rank's ring bounds
        k = max(ring_members_per_node(pipeline, dp, slots, layout))
        bw = min(links.intra_node_GBps, k * links.inter_node_GBps) * 1e9
    return 2 * (n - 1) / n * nbytes / bw + (2 * (n - 1) * links.latency_s if latency else 0.0)


#: schedules whose backward is split into B (input gradients) and W (weight gradients)
_SPLIT_BACKWARD = frozenset({"zb-h1", "zb-v", "v-half", "v-min", "dualpipev"})


def _cut_bound(prefix: np.ndarray, result: PartitionResult, cand: Candidate, spec: ParallelSpec,
               scale: float, slow: np.ndarray, recompute: list[bool]) -> float:
    """A lower bound on the simulated step time of a cut, whatever the schedule does.

    For every rank ``r`` whose lowest stage is ``s0``: nothing runs on ``r`` before micro-batch
    data has gone forward through stages ``0 .. s0-1`` (``fill``: their forwards, all on other
    ranks). After that the rank computes all its ``m`` micro-batches' work, then the all-reduce
    of the stage it finished last (at least the smallest of its stages' all-reduces; the
    others may overlap its compute). And its last backward of ``s0`` (after every F and B of
    its stages, but not necessarily after its split-off W's) is followed by the input
    gradients of stages ``s0-1 .. 0`` (``drain``). Sends and latencies only add time."""
    cuts = list(result.cuts) + [prefix.shape[1] - 1]
    split = cand.schedule in _SPLIT_BACKWARD
    f, b, w = [], [], []
    for j, (a, e) in enumerate(zip(cuts[:-1], cuts[1:])):
        x = (prefix[:, e] - prefix[:, a]) * scale * slow[j]
        f.append(float(x[0]))
        b.append(float(x[1] + (x[0] if recompute[j] else 0.0)))
        w.append(float(x[2]))
    ranks = stage_to_rank(cand.schedule, cand.pipeline, cand.num_stages)
    work = [0.0] * cand.pipeline
    fb = [0.0] * cand.pipeline  # what must precede the rank's last B of its lowest stage
    low = [cand.num_stages] * cand.pipeline
    ars: list[list[float]] = [[] for _ in range(cand.pipeline)]
    for j, r in enumerate(ranks):
        work[r] += f[j] + b[j] + w[j]
        fb[r] += f[j] + b[j] + (0.0 if split else w[j])
        low[r] = min(low[r], j)
        ars[r].append(_ring_s(result.param_bytes[j], cand.dp, spec, cand.pipeline, cand.dp,
                              cand.layout, tensor=cand.tensor))
    fcum = np.concatenate([[0.0], np.cumsum(f)])
    bcum = np.concatenate([[0.0], np.cumsum(b)])
    best = 0.0
    for r in range(cand.pipeline):
        s0 = low[r]
        fill, drain = float(fcum[s0]), float(bcum[s0])
        best = max(best, fill + cand.microbatches * work[r] + min(ars[r]),
                   fill + cand.microbatches * fb[r] + drain, sum(ars[r]))
    return best


def _problem_key(problem: CutProblem) -> tuple:
    """Everything :func:`optimal_partition` reads of a cut problem (unit names only label its
    messages), hashable: equal keys, equal answers."""
    def flat(x):
        if x is None or isinstance(x, (int, float)):
            return x
        return tuple(flat(y) for y in x) if isinstance(x, (list, tuple, np.ndarray)) else x
    return (flat(problem.compute_s), flat(problem.param_bytes), flat(problem.saved_bytes),
            tuple((v.producer, tuple(v.users), float(v.nbytes), bool(v.grad))
                  for v in problem.values),
            problem.num_stages, flat(problem.bandwidth_Bps), float(problem.latency_s),
            flat(problem.capacity_bytes), float(problem.param_multiplier),
            flat(problem.inflight), flat(problem.forced_cuts),
            tuple(sorted((problem.pins or {}).items())), flat(problem.slowdown))


#: how close to optimal the auto search's cuts are (relative bottleneck): candidates are
#: ranked on such cuts, and the chosen one is cut exactly afterwards
SEARCH_TOLERANCE = 1e-4


def _solve_cached(problem: CutProblem, cache: dict) -> PartitionResult:
    """``optimal_partition(problem, explain=False)`` within :data:`SEARCH_TOLERANCE`, once per
    distinct problem in ``cache`` (an infeasible one raises its error again)."""
    key = _problem_key(problem)
    if key not in cache:
        try:
            cache[key] = optimal_partition(problem, explain=False, tolerance=SEARCH_TOLERANCE)
        except PlanError as e:
            cache[key] = e
    got = cache[key]
    if isinstance(got, PlanError):
        raise got
    return got


def _fits_without_recompute(pr: Priced, spec: ParallelSpec, cand: Candidate,
                            scale: float) -> bool:
    """Whether some cut could hold every stage's parameters, gradients, optimizer state and
    the activations of its micro-batches in flight on the device, recomputing nothing: the
    greedy cover (each stage as long as the device holds it) is optimal for this question, and
    ignoring that a rank may hold several stages only makes it say yes more often. False means
    the candidate must recompute (no solve needed to know)."""
    tb = pr.table
    mult = state_factor(spec.train.optimizer, cand.sharding, cand.dp)
    inflight, _ = stage_inflight(cand)
    cap = spec.cluster.memory_gb * 1e9
    P = np.concatenate([[0.0], np.cumsum(np.asarray(tb.params, dtype=np.float64))])
    A = np.concatenate([[0.0], np.cumsum(np.asarray(tb.saved, dtype=np.float64) * scale)])
    n, pos = len(tb.params), 0
    memo: dict[int, np.ndarray] = {}
    for j in range(cand.num_stages):
        k = int(inflight[j])
        if k not in memo:
            memo[k] = mult * P + k * A  # non-decreasing in the end
        d = memo[k]
        end = int(np.searchsorted(d, d[pos] + cap, "right")) - 1
        if end <= pos:
            return False
        pos = end
        if pos >= n:
            return True
    return False


def _fill_drain_floor(total: float, fill_share: float, work_share: float, m: int,
                      p: int) -> float:
    """A lower bound (seconds per micro-batch unit of ``total``) on :func:`_cut_bound`'s term
    of the last pipeline rank against the busiest other one, whatever the cut, for one stage
    per rank: the last rank starts after the forwards of every other stage and its last
    backward is followed by theirs (``fill_share`` of their time at least: the smallest
    (F + B) / (F + B + W) of any unit), and it runs ``m`` x its own work (``work_share`` of its
    time at least); some other rank runs ``m`` x its work, at least the others' average. With
    ``x`` the last stage's time: ``max(a (T - x) + c x, c (T - x) / (p - 1))`` with ``a =
    fill_share``, ``c = m work_share``, minimised over ``x`` in [0, T] (an end or the
    crossing: both are linear)."""
    if p < 2 or total <= 0:
        return 0.0
    a, c = fill_share, m * work_share

    def worst(x: float) -> float:
        return max(a * (total - x) + c * x, c * (total - x) / (p - 1))

    points = [0.0, total]
    den = c * p / (p - 1) - a
    if den > 0:
        points.append(min(total, max(0.0, total * (c / (p - 1) - a) / den)))
    return min(worst(x) for x in points)


def _unit_shares(prefix: np.ndarray, recompute: bool, split: bool) -> tuple[float, float, float]:
    """``(total, fill share, work share)`` of the units for :func:`_fill_drain_floor`: per
    micro-batch seconds of all units (the forward twice when recomputing) and the smallest
    shares of F + B and of the work a rank holds a micro-batch for (F + B, + W unless split)."""
    f, b, w = (np.diff(prefix[i]) for i in range(3))
    if recompute:
        b = b + f
    tot = f + b + w
    live = tot > 0
    if not live.any():
        return 0.0, 1.0, 1.0
    fb = (f + b)[live] / tot[live]
    work = fb if split else np.ones_like(fb)
    return float(tot.sum()), float(fb.min()), float(work.min())


def _candidate_bound(cand: Candidate, scale: float, spec: ParallelSpec, total: float,
                     total_params: float, biggest: float, fastest: float,
                     stage_floor: float = 0.0, shares: tuple[float, float, float] | None = None
                     ) -> float:
    """A lower bound on the simulated step time of any cut of the candidate (before solving
    it): some rank computes at least the average share of the work, the costliest unit
    (``biggest``) and the slowest stage of the best compute-only cut (``stage_floor``:
    :func:`chain_bottleneck` into the candidate's stages), ``m`` times; with one stage per
    rank, each rank's all-reduce follows all its work (so the average rank's work plus its
    all-reduce, bandwidth term only: a rank without parameters runs none); with several stages
    per rank the all-reduces of stages finished early may overlap compute, so only their sum on
    one rank counts. ``shares``: :func:`_unit_shares` for the last rank's fill and drain
    (:func:`_fill_drain_floor`); ``total`` then is theirs."""
    m = cand.microbatches * scale * fastest
    if shares is not None:
        total = shares[0]
    work = m * max(total / cand.pipeline, biggest, stage_floor)
    ring = _ring_s(total_params / cand.pipeline, cand.dp, spec, cand.pipeline, cand.dp,
                   cand.layout, latency=False, tensor=cand.tensor)
    if cand.num_stages == cand.pipeline:
        fill = (scale * fastest * _fill_drain_floor(shares[0], shares[1], shares[2],
                                                    cand.microbatches, cand.pipeline)
                if shares is not None else 0.0)
        return max(work, m * total / cand.pipeline + ring, fill)
    return max(work, ring)


def _search(pr_at: Callable[[int], Priced], spec: ParallelSpec, prune: bool = True
            ) -> tuple[Candidate, PartitionResult, int, list[str]]:
    """The fastest candidate layout that fits, and the explanation of the ranking.

    ``pr_at(t)``: the priced units at tensor-parallel degree ``t`` (one rank's costs). Every
    degree of :func:`~fxpipe.partitioner.search.tensor_degrees` is tried; a degree the model
    cannot take (heads, vocabulary) is left out and said why.

    Candidates are visited in the order of a lower bound on their step time (every rank runs
    its share of ``m`` micro-batches, ``m x total / p``, and all-reduces its share of the
    parameters); a candidate whose bound, or whose cut's bound (:func:`_cut_bound`), cannot beat
    the best simulated step so far is not simulated. Where activations do not fit, the
    candidate is tried again with activation recomputation (``train.activation_recompute``).
    The bounds are valid lower bounds and a candidate is pruned only when its bound exceeds
    the best step (ties are simulated), so ``prune=False`` (simulate every candidate that fits)
    picks the same layout and cut."""
    bounds = []
    fastest = _fastest_slowdown(spec)
    degrees = tensor_degrees(spec)
    mode = spec.train.activation_recompute
    left_out: list[str] = []
    first_error: FxpipeError | None = None
    priced: dict[int, Priced] = {}
    for t in degrees:
        try:
            pr = priced[t] = pr_at(t)
            cands = candidates(spec, max_stages=len(pr.table.names), tensor=t)
        except (DegreeError, PlanError) as e:
            left_out.append(f"tensor {t}: {e}")
            first_error = first_error or e
            continue
        prefix = _unit_prefix(pr)
        total = float(prefix[:, -1].sum())
        total_params = float(sum(pr.table.params))
        biggest = float(np.diff(prefix.sum(axis=0)).max(initial=0.0))  # the costliest unit
        cumulative = [float(x) for x in prefix.sum(axis=0)]
        with_rc = [float(x) for x in prefix.sum(axis=0) + prefix[0]]  # the forward twice
        floors: dict[tuple[int, bool], float] = {}  # the best compute-only cut's slowest stage
        shares: dict[tuple[bool, bool], tuple[float, float, float]] = {}
        for cand in cands:
            mbs = spec.data.batch_size // (cand.dp * cand.microbatches)
            if mbs < 1:
                continue
            scale, k = mbs / pr.batch, cand.num_stages
            if cand.schedule in _LOW_MEMORY and mode == "auto":
                rc_only = None  # told in the loop below, if the candidate is tried at all
            else:
                rc_only = (mode == "on" or (mode == "auto" and not _fits_without_recompute(
                    pr, spec, cand, scale)))
            rcb = bool(rc_only)  # (not recomputing: a lower bound either way)
            if (k, rcb) not in floors:
                floors[(k, rcb)] = chain_bottleneck(with_rc if rcb else cumulative, k)
            floor = floors[(k, rcb)] if k == cand.pipeline else 0.0  # one stage per rank
            split = cand.schedule in _SPLIT_BACKWARD
            if (rcb, split) not in shares:
                shares[(rcb, split)] = _unit_shares(prefix, rcb, split)
            lb = _candidate_bound(cand, scale, spec, total, total_params, biggest, fastest,
                                  floor, shares[(rcb, split)])
            bounds.append((lb, cand.label(), cand, mbs, pr, prefix, rc_only))
    if not bounds:
        if len(degrees) == 1 and first_error is not None:
            raise first_error
        raise PlanError("no tensor-parallel degree fits the model:\n  " + "\n  ".join(left_out))
    bounds.sort(key=lambda x: (x[0], x[1]))
    best: _Ranked | None = None
    ranked: list[_Ranked] = []
    failed: list[tuple[float, Candidate, float, Priced]] = []  # (bound, candidate, scale, pr)
    pruned = 0
    capacity = spec.cluster.memory_gb * 1e9
    solved: dict = {}  # identical cut problems (e.g. the two placements of one grid) solve once
    fit: dict[tuple, str] = {}  # (layout key, schedule) -> how it fits device memory
    # V-Half / V-Min are tried at a layout only where ZB-V (for V-Min, also V-Half) does not
    # fit it without recomputation, and then only without it: they are ZB-V's placement with
    # fewer micro-batches in flight, so where it fits they only add bubble; with recomputation
    # on, only where those do not fit at all. One met before those waits for them (twice: V-Min
    # for V-Half, which may wait for ZB-V).
    enough = "fits only with recomputation" if mode == "on" else "fits"
    queue, waited, skipped = list(bounds), Counter(), 0
    i = -1
    while i + 1 < len(queue):
        i += 1
        lb, label, cand, mbs, pr, prefix, rc_only = queue[i]
        _progress.info("auto search: candidate %d/%d (%s)%s", i + 1, len(bounds), label,
                       f", best so far {best.step_s * 1e3:.3g} ms/step" if best else "")
        if prune and best is not None and lb > best.step_s:
            pruned += 1
            continue
        scale = mbs / pr.batch
        fkey = (_layout_key(cand), cand.schedule)
        if cand.schedule in _LOW_MEMORY:
            full = [fit.get((fkey[0], s)) for s in _LOW_MEMORY_VERSUS[cand.schedule]]
            if "fits" in full or enough in full:
                skipped += 1
                continue
            if None in full and waited[label] < 2:
                waited[label] += 1
                queue.append(queue[i])
                continue
            if mode == "auto" and not _fits_without_recompute(pr, spec, cand, scale):
                skipped += 1
                continue
            rc_only = mode == "on"
        if _static_share(pr, spec, cand) > capacity:  # cannot fit, whatever the cut
            failed.append((lb, cand, scale, pr))
            fit[fkey] = "does not fit"
            continue
        found = None
        low = cand.schedule in _LOW_MEMORY and mode == "auto"  # tried without recomputation
        for rc in ((False,) if mode == "off" or low else (True,) if rc_only else (False, True)):
            c = dataclasses.replace(cand, recompute=rc)
            try:
                found = (c, *_solve_fitting(pr, spec, c, scale, solved))
                break
            except PlanError:
                continue
        if found is None:
            failed.append((lb, cand, scale, pr))
            fit[fkey] = "does not fit"
            continue
        fit[fkey] = "fits only with recomputation" if found[0].recompute else "fits"
        cand, problem, result, rc = found
        if prune and best is not None and _cut_bound(prefix, result, cand, spec, scale,
                                                     problem.slow, rc.flags) > best.step_s:
            pruned += 1
            continue
        if len(bounds) == 1:
            return cand, result, mbs, _degree_notes(left_out) + _sharding_notes(pr, spec, cand)
        r = _Ranked(_simulate_cut(pr, prefix, problem, result, cand, spec, scale,
                                  rc).step_time_s, cand.label(), cand, result, mbs)
        ranked.append(r)
        best = r if best is None or r < best else best
    if best is None:
        raise _nothing_fits(spec, failed)
    ranked.sort()
    explain = [f"auto search: {len(bounds)} candidates, {len(ranked)} simulated, {pruned} "
               f"pruned by a lower bound, {len(failed)} infeasible; ranked by simulated step "
               "time:"]
    explain += [f"  {i + 1}. {r.label:40s} {r.step_s * 1e3:10.2f} ms/step"
                for i, r in enumerate(ranked[:5])]
    explain += _degree_notes(left_out, ranked, degrees)
    if spec.parallel.sequence_parallel and best.cand.tensor == 1:
        explain.append("parallel.sequence_parallel is off in this plan: it splits the sequence "
                       "over a tensor group, and the search chose tensor 1")
    explain += _sharding_notes(priced[best.cand.tensor], spec, best.cand, ranked, failed)
    explain += _memory_schedule_notes(best.cand, fit)
    if skipped:
        explain.append(f"v-half / v-min not tried at {skipped} candidate layouts: they are tried "
                       "only where zb-v (for v-min, also v-half) needs activation recomputation "
                       "and they do not (elsewhere they would only add bubble)")
    return best.cand, best.result, best.mbs, explain


#: schedules that trade bubble for activation memory, and the ones they are weighed against
_LOW_MEMORY = ("v-half", "v-min")
_FULL_MEMORY = ("zb-v", "1f1b", "zb-h1", "dualpipev", "interleaved", "gpipe")
#: a layout tries V-Half / V-Min only where none of these fits it without recomputation (the
#: same placement with more micro-batches in flight: less bubble)
_LOW_MEMORY_VERSUS = {"v-half": ("zb-v",), "v-min": ("zb-v", "v-half")}


def _layout_key(cand: Candidate) -> tuple:
    """A candidate's layout without its schedule (and recomputation)."""
    return (cand.pipeline, cand.dp, cand.microbatches, cand.tensor, cand.sharding, cand.layout)


def _memory_schedule_notes(best: Candidate, fit: dict[tuple, str]) -> list[str]:
    """Where the search picked a memory-capped V schedule (V-Half, V-Min) without
    recomputation, why: the schedules that hold more activations at the same layout and how
    they fared against the device memory (only those the search tried)."""
    if best.schedule not in _LOW_MEMORY or best.recompute:
        return []
    key = _layout_key(best)
    others = [f"{s} {fit[(key, s)]}" for s in _FULL_MEMORY if (key, s) in fit
              and fit[(key, s)] != "fits"]
    if not others:
        return []
    return [f"memory: {best.schedule} keeps {'half' if best.schedule == 'v-half' else 'a third'}"
            f" of 1F1B's activations in flight and fits device memory without activation "
            f"recomputation at pp={best.pipeline} dp={best.dp} m={best.microbatches}, where "
            + ", ".join(others) + " (chosen by step time among what fits)"]


def _sharding_notes(pr: Priced, spec: ParallelSpec, cand: Candidate,
                    ranked: list[_Ranked] | None = None, failed: list | None = None
                    ) -> list[str]:
    """What ``parallel.data_sharding`` bought the chosen layout: the training state per rank
    with and without it and, when the search weighed both, the fastest unsharded layout it
    simulated (those it pruned have step-time bounds above the chosen step)."""
    if cand.sharding == "none":
        return []
    opt = spec.train.optimizer
    total = sum(pr.table.params) / cand.pipeline
    with_, without = total * state_factor(opt, cand.sharding, cand.dp), total * state_factor(opt)
    line = (f"data sharding {cand.sharding} over {cand.dp} replicas: parameters, gradients and "
            f"optimizer state {human_bytes(with_, True)} per rank on average instead of "
            f"{human_bytes(without, True)}")
    if ranked is not None and spec.parallel.data_sharding == "auto":
        best = ranked[0] if ranked else None
        plain = next((r for r in ranked if r.cand.sharding == "none"), None)
        if plain is not None and best is not None:
            line += (f"; the fastest unsharded layout the search simulated, {plain.label}, "
                     "is "
                     f"{plain.step_s * 1e3:.2f} ms/step ({(plain.step_s / best.step_s - 1) * 100:+.1f}%"
                     f"{', recomputing' if plain.cand.recompute and not cand.recompute else ''})")
        elif any(c.sharding == "none" for _, c, _, _ in failed or []):
            line += "; no unsharded layout fits device memory"
        else:
            line += "; the unsharded layouts were pruned by their step-time bounds"
    return [line]


def _static_share(pr: Priced, spec: ParallelSpec, cand: Candidate) -> float:
    """Bytes of parameters, gradients and optimizer state the fullest rank of the candidate
    holds at least: every parameter is on some rank, so some rank holds the average share."""
    return (sum(pr.table.params) * state_factor(spec.train.optimizer, cand.sharding, cand.dp)
            / cand.pipeline)


def _degree_notes(left_out: list[str], ranked: list[_Ranked] | None = None,
                  degrees: list[int] | None = None) -> list[str]:
    """Why the chosen tensor degree: the degrees left out and, with several tried, the best
    layout of another degree and how much slower it is."""
    out = [f"left out {line}" for line in left_out]
    if not ranked or not degrees or len(degrees) < 2:
        return out
    best = ranked[0]
    other = next((r for r in ranked if r.cand.tensor != best.cand.tensor), None)
    if other is not None:
        out.append(f"tensor {best.cand.tensor} chosen: the best layout at another tensor degree "
                   f"({other.label}) is {other.step_s * 1e3:.2f} ms/step, "
                   f"{(other.step_s / best.step_s - 1) * 100:+.1f}% (tensor degrees tried: "
                   f"{', '.join(map(str, degrees))})")
    else:
        out.append(f"tensor {best.cand.tensor} chosen: no layout of another degree was "
                   f"simulated (fits or bounds; tensor degrees tried: "
                   f"{', '.join(map(str, degrees))})")
    return out


def _nothing_fits(spec: ParallelSpec, failed: list) -> PlanError:
    """Why no candidate fits, and what would: the explanation of the candidates that came
    closest, and the levers (more pipeline stages, recomputation, smaller micro-batches)."""
    lines = []
    for lb, cand, scale, pr in failed[:3]:
        c = dataclasses.replace(cand, recompute=spec.train.activation_recompute != "off")
        try:
            _solve_fitting(pr, spec, c, scale)
        except PlanError as e:
            text = str(e)
            if c.recompute and "but the device has" in text:  # its capacity less the inputs
                held = _recompute_held(_cut_problem(pr, spec, dataclasses.replace(
                    c, recompute=False), scale).values)
                note = _held_note(spec.cluster.memory_gb * 1e9, max(stage_inflight(c)[0]),
                                  held, scale * pr.batch, False)
                text += f" ({note})"
            lines.append(f"{c.label()}: {text}")
    if not any(w in line for line in lines for w in ("memory", "device has", "device's")):
        # a pin, a pipe_split() marker or the number of units: memory is not what failed
        return PlanError("no feasible plan:\n  " + "\n  ".join(lines))
    pr = failed[0][3] if failed else None
    factor = min((state_factor(spec.train.optimizer, c.sharding, c.dp) for _, c, _, _ in failed),
                 default=state_factor(spec.train.optimizer))
    need = sum(pr.table.params) * factor if pr else 0.0
    cap = spec.cluster.memory_gb * 1e9
    stages = int(np.ceil(need / cap))
    tried = max((c.pipeline for _, c, _, _ in failed), default=0)
    fix = (f"parameters, gradients and optimizer state alone need {human_bytes(need, True)}: at "
           f"least {plural(stages, 'pipeline stage')} of {human_bytes(cap, True)} devices")
    if tried >= stages:  # that many did not do: units cannot be split, and activations count
        fix = (f"parameters, gradients and optimizer state alone need {human_bytes(need, True)} "
               f"({plural(stages, 'device')} of {human_bytes(cap, True)} at the very least), "
               f"but {plural(tried, 'pipeline stage')} did not fit (a stage holds whole "
               f"planning units, and activations too): more than {tried} pipeline stages")
    if spec.train.activation_recompute == "off":
        fix += "; allow activation recomputation (train.activation_recompute: auto)"
    if spec.parallel.tensor == 1 and spec.cluster.devices_per_node > 1:
        fix += ("; tensor parallelism (parallel.tensor: auto, or a divisor of "
                f"cluster.devices_per_node={spec.cluster.devices_per_node}) splits every "
                "layer's parameters over the devices of a node")
    return PlanError("no feasible plan (nothing fits device memory):\n  " + "\n  ".join(lines)
                     + f"\nwhat would fit: {fix}; smaller micro-batches (more of them: "
                     "parallel.microbatches) shrink the activations held per micro-batch; or "
                     "devices with more memory (cluster.memory_gb)")


def _check_compression_rank(model: nn.Module, spec: ParallelSpec) -> None:
    """``train.compression.rank`` against the model's matrix parameters (PowerSGD).

    Raises:
        SpecError: ``FILE:LINE: train.compression.rank: ...`` naming the smallest matrix."""
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad}
    problems = compression_rank_problems(spec, shapes)
    if problems:
        lines = []
        for path, text in problems:
            dotted = ".".join(path)
            where = spec_location(spec, dotted)
            lines.append(f"{where}: {dotted}: {text}" if where else f"{dotted}: {text}")
        raise SpecError("\n".join(lines))


#: ``cluster.measure_stages`` is skipped when timing the stages would take longer than this
#: (estimated from the profile: one whole forward and backward per round and cut)
REFINE_BUDGET_S = 60.0

#: rounds of the timing that decides between the visited cuts and their near ties, all side by
#: side: they are often within a few percent of each other, and a median of 7 rounds moves by
#: about that much on a shared CPU; more rounds than the timings that only steer the search
DECIDING_ROUNDS = {"min_rounds": 15, "max_rounds": 61, "min_time_s": 2.0}


def _warn_again(caught: list) -> None:
    """Issue again the warnings that ``warnings.catch_warnings(record=True)`` held back."""
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def _loss_unit(pr: Priced) -> int | None:
    """The unit of ``pr.table`` whose times include the loss's, or None."""
    if pr.loss_at is None or pr.loss.total_s <= 0:
        return None
    g, order = pr.pg.graph, pr.pg.order
    pos = next((p for p, u in enumerate(order) if pr.loss_at in g.nodes[u]["members"]), None)
    fo = pr.table.folding
    if pos is None or fo is None:
        return pos
    if pos in fo.prologue:
        return list(fo.prologue).index(pos)
    if pos in fo.epilogue:
        return len(fo.prologue) + fo.run.count + list(fo.epilogue).index(pos)
    return None


def _loss_row(pr: Priced) -> np.ndarray:
    return np.array([pr.loss.fwd_s, pr.loss.bwd_input_s, pr.loss.bwd_weight_s])


def _raw_unit_times(pr: Priced) -> np.ndarray:
    """``(n, 3)`` unit times of ``pr.table`` without the loss (what a stage's own run takes)."""
    t = np.asarray(pr.table.times, dtype=np.float64).reshape(-1, 3).copy()
    lu = _loss_unit(pr)
    if lu is not None:
        t[lu] = np.maximum(t[lu] - _loss_row(pr), 0.0)
    return t


def _with_unit_times(pr: Priced, times: np.ndarray) -> Priced:
    """``pr`` with its units' times (without the loss, as :func:`_raw_unit_times`) replaced by
    ``times``; the loss is added back, and node by node (what :func:`_assemble` sums) each
    unit's members are scaled to its new times."""
    t = np.asarray(times, dtype=np.float64).reshape(-1, 3).copy()
    lu = _loss_unit(pr)
    if lu is not None:
        t[lu] += _loss_row(pr)
    rows = [tuple(float(x) for x in r) for r in t]
    table = dataclasses.replace(pr.table, times=rows)
    if table.folding is not None:  # folded plans are assembled from the table's units
        return dataclasses.replace(pr, table=table)
    node_times = dict(pr.times)
    g = pr.pg.graph
    for pos, u in enumerate(pr.pg.order):
        members = list(g.nodes[u]["members"])
        old = sum_times(pr.times, members)
        olds = (old.fwd_s, old.bwd_input_s, old.bwd_weight_s)
        for i, m in enumerate(members):
            tm = pr.times.get(m, NodeTimes())
            vals = (tm.fwd_s, tm.bwd_input_s, tm.bwd_weight_s)
            node_times[m] = NodeTimes(*(v * new / o if o > 0 else (new if i == 0 else 0.0)
                                        for v, new, o in zip(vals, rows[pos], olds)))
    return dataclasses.replace(pr, times=node_times, table=table)


def _node_stages(pr: Priced, cuts: list[int], full: TracedModel) -> dict[str, int]:
    """Node -> stage of the full trace ``full`` for the stage starts ``cuts``."""
    ends = list(cuts[1:]) + [len(pr.table.names)]
    stage_of = [j for j, (a, b) in enumerate(zip(cuts, ends)) for _ in range(a, b)]
    if pr.table.folding is not None:
        return resolve_folded(_folded_record(pr, stage_of), full)
    g = pr.pg.graph
    return {m: s for pos, s in enumerate(stage_of) for m in g.nodes[pr.pg.order[pos]]["members"]}


class _NotTimed(Exception):
    """The stages cannot be timed here (the message says why)."""


def _ranks_beside(spec: ParallelSpec, cand: Candidate) -> tuple[list[int], list[int]] | None:
    """``(stage -> pipeline rank, pipeline rank -> node)`` of the first replica where ranks
    share a CPU (two of its pipeline ranks on one node of a ``cpu`` cluster): the stages of
    each node are then timed side by side
    (:func:`~fxpipe.partitioner.stage_timing.time_stages`); None where each rank has its node
    or its own device."""
    cl = spec.cluster
    if cl.device != "cpu" or cand.pipeline < 2:
        return None
    nodes = [node_of(global_rank(r, 0, cand.pipeline, cand.dp, cand.layout),
                     grid_slots_per_node(cl.devices_per_node, cand.tensor))
             for r in range(cand.pipeline)]
    if len(set(nodes)) == len(nodes):
        return None
    return stage_to_rank(cand.schedule, cand.pipeline, cand.num_stages), nodes


def _refine_by_stages(pr: Priced, spec: ParallelSpec, cand: Candidate, result: PartitionResult,
                      model: nn.Module | None, args: tuple, kwargs: dict
                      ) -> tuple[Priced, PartitionResult, str]:
    """``cluster.measure_stages``: the planned cut checked against its stages timed whole, and
    moved where they disagree (:mod:`fxpipe.partitioner.refine`). The stage timings are cached
    cut by cut (:class:`~fxpipe.partitioner.stage_timing.StageTimes`), the decision is made
    again under this spec. ``model``: the model with real weights on the device (None: only
    cached timings can be used). Returns the Priced with the chosen cut's stage times,
    the partition, and a line for the plan's explanation."""
    cl = spec.cluster
    first = [int(c) for c in result.cuts]
    # the weight gradients accumulate in place where the executor will do it (fp32 stages with
    # a full backward: not the zero-bubble schedules, which split it)
    split = compute_schedule(cand.schedule, cand.pipeline, cand.microbatches,
                             cand.virtual_stages).split_backward
    fuse = (spec.train.fuse_grad_accumulation and spec.train.precision == "fp32"
            and not split)
    raw = _raw_unit_times(pr)

    last: dict = {}

    def problem_of(times: np.ndarray) -> tuple[Priced, CutProblem]:
        key = np.asarray(times, dtype=np.float64).tobytes()
        if last.get("key") != key:  # the near-tie scan prices many cuts under one calibration
            p2 = _with_unit_times(pr, times)
            last.update(key=key, built=(p2, _cut_problem(p2, spec, cand, 1.0)))
        return last["built"]

    def solve(times: np.ndarray) -> list[int]:
        return list(optimal_partition(problem_of(times)[1]).cuts)

    def step_s(times: np.ndarray, cuts) -> float:
        p2, prob = problem_of(times)
        res = evaluate(prob, list(cuts), method="given")
        if res.violations:  # memory, a pin or a pipe_split() marker: not a cut to take
            return math.inf
        return _simulate_cut(p2, _unit_prefix(p2), prob, res, cand, spec, 1.0).step_time_s

    beside = _ranks_beside(spec, cand)
    ranks, nodes = beside if beside is not None else (None, None)
    groups = side_by_side_groups(ranks, nodes) if ranks is not None else None
    store = StageTimes(stage_times_key(profile_key(pr.traced, cl.device, spec.train.precision),
                                       list(pr.table.names),
                                       f"fuse={fuse};beside={groups};"
                                       f"decide={DECIDING_ROUNDS['min_rounds']}"))
    skip = "cluster.measure_stages: the cut's stages were not timed whole"
    timer: dict = {}

    def time_now(cut_list: list[list[int]], rounds: dict) -> list[list[tuple[float, float]]]:
        if "full" not in timer:
            if model is None:
                raise _NotTimed(f"no model with real weights on {cl.device} here")
            est = float(raw.sum()) * (9 * MAX_CUTS + (2 + DECIDING_ROUNDS["min_rounds"])
                                      * (MAX_CUTS + MAX_RIVALS))
            if est > REFINE_BUDGET_S:
                raise _NotTimed(f"that would take about {est:.0f} s, over "
                               f"{REFINE_BUDGET_S:.0f} s")
            _progress.info("timing the planned stages whole (cluster.measure_stages)")
            full = trace(model, args, spec.model.tracer, example_kwargs=kwargs,
                         output=spec.loss_output)
            timer["full"] = full
            timer["inputs"] = dict(zip(full.input_names, _tensor_inputs(args, kwargs)))
        full = timer["full"]
        assigns = [_node_stages(pr, c, full) for c in cut_list]
        return time_stages(full.gm, assigns, cand.num_stages, timer["inputs"], cl.device,
                           rewrite=fuse_weight_grads if fuse else None, ranks=ranks,
                           nodes=nodes, precision=spec.train.precision, **rounds)

    def measure(cut_list: list[list[int]]) -> list[list[tuple[float, float]]]:
        if len(cut_list) == 1:  # one cut alone: while refining
            sig = store.sig(cut_list)
            if sig not in store.alone:
                store.alone[sig] = time_now(cut_list, {})[0]
                store.save()
            return [store.alone[sig]]
        sig = store.sig(cut_list)  # the cuts visited, side by side: the decision
        if sig not in store.together:
            store.together[sig] = time_now(cut_list, DECIDING_ROUNDS)
            store.save()
        return store.together[sig]

    try:
        ref = refine_cuts(raw, first, solve, step_s, measure)
    except _NotTimed as e:
        return pr, result, f"{skip} ({e}); the per-node sums stand"
    except Exception as e:  # noqa: BLE001 - the user's model: a stage that cannot run alone
        why = (str(e).splitlines() or [""])[0][:200]
        return pr, result, f"{skip} ({type(e).__name__}: {why}); the per-node sums stand"
    pr2 = _with_unit_times(pr, ref.times)
    res2 = evaluate(_cut_problem(pr2, spec, cand, 1.0), list(ref.cuts), method="given")
    i = ref.visited.index(list(ref.cuts))
    ends = list(first[1:]) + [len(raw)]
    summed = [float(raw[a:b].sum()) for a, b in zip(first, ends)]
    timed = [f + b for f, b in ref.measured[0]]
    ms = ", ".join
    ties = (f" ({ref.rivals} of them near ties: within {NEAR:.0%} of the cut's simulated step "
            "with its timed stages)" if ref.rivals else "")
    note = (f"cluster.measure_stages: {plural(len(ref.visited), 'cut')} timed stage by stage"
            f"{ties}; "
            f"the planned cut's stages (forward + backward per micro-batch, without the loss) "
            f"summed node by node {ms(f'{x * 1e3:.3g}' for x in summed)} ms, timed whole "
            f"{ms(f'{x * 1e3:.3g}' for x in timed)} ms; ")
    if ref.moved:
        note += (f"the cut moved from units {first} to {list(ref.cuts)} (simulated step "
                 f"{ref.step_s[0] * 1e3:.4g} -> {ref.step_s[i] * 1e3:.4g} ms with the timed "
                 "stages)")
    else:
        note += "the planned cut stays"
    return pr2, res2, note


def plan_with_graph(model: nn.Module, spec: Any, example_inputs: Any = None,
                    example_kwargs: dict | None = None, *, cuts: list[int] | None = None,
                    units_only: bool = False) -> tuple[Plan, "nx.DiGraph"]:
    """:func:`plan`, also returning the priced networkx graph of planning units (for
    ``plan.dump(dir, graph)``'s DOT drawing; None for a plan made as blocks).

    ``cuts`` (a fixed layout only): plan exactly these stage starts (unit positions, see
    :func:`planning_units`) instead of the optimal ones, e.g. to measure other cuts.
    ``units_only``: return ``(unit table, None)`` without planning (see
    :func:`planning_units`). The global random number generators are as before afterwards
    (profiling draws random targets and runs dropout)."""
    spec = as_spec(spec)
    cuda = spec.cluster.device == "cuda" and torch.cuda.is_available()
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if cuda else []):
        return _plan_with_graph(model, spec, example_inputs, example_kwargs, cuts, units_only)


def _plan_with_graph(model: nn.Module, spec: ParallelSpec, example_inputs: Any,
                     example_kwargs: dict | None, cuts: list[int] | None, units_only: bool
                     ) -> tuple[Plan, "nx.DiGraph"]:
    _check_compression_rank(model, spec)
    if example_inputs is None and example_kwargs is None:
        batch = example_microbatch(spec, 1)
        args, kwargs = batch.args, batch.kwargs
    else:
        if isinstance(example_inputs, torch.Tensor):
            example_inputs = (example_inputs,)
        args, kwargs = tuple(example_inputs or ()), dict(example_kwargs or {})
    tensors = [t for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor) and t.dim()]
    b0 = int(tensors[0].shape[0]) if tensors else 1
    par = spec.parallel
    if "auto" not in (par.data, par.microbatches) and \
            spec.data.batch_size % (par.data * par.microbatches) == 0:
        # the micro-batch size is fixed: trace once, at it, rather than at the example's size
        # for the search and again at the micro-batch's for the plan
        b0 = spec.data.batch_size // (par.data * par.microbatches)
    run = find_block_run(model)
    given = model
    key = spec.loss_output
    tracers: dict[bool, tuple] = {}  # short (blocks folded) or full -> (model, args, kwargs, on)

    def tracing(short: bool) -> tuple:
        """The model to trace (a fake copy on the device, of the shortened model when folding:
        copying 96 blocks' tensors costs seconds, two of them nothing)."""
        if short not in tracers:
            with reduced(given, run) if short else contextlib.nullcontext():
                m, a, kw, on = tracing_model(given, tuple(args), dict(kwargs),
                                             spec.cluster.device)
            tracers[short] = (m, tuple(a), kw, on)
        return tracers[short]

    def priced_at(size: int, short: bool) -> Priced:
        m, args_, kwargs_, on = tracing(short)
        real = None if on == "meta" or _is_fake(m) else m
        a = tuple(_resize(x, size) for x in args_)
        kw = {k: _resize(v, size) for k, v in kwargs_.items()}
        same = m is given and short  # shortening a model traced as it is: swap its blocks
        with reduced(m, run) if same else contextlib.nullcontext():
            _progress.info("tracing %s%s at micro-batch %d", type(m).__name__,
                           " (two of its repeated blocks)" if short else "", size)
            traced = trace(m, a, spec.model.tracer, example_kwargs=kw, output=key)
            _progress.info("pricing %d nodes", len(traced.gm.graph.nodes))
            costs = price(traced)
            times, loss = _node_times(traced, costs, spec, real, _tensor_inputs(a, kw))
        with warnings.catch_warnings(record=True) as held:
            warnings.simplefilter("always")
            pg = build_graph(traced, costs)
        pr = Priced(traced, costs, times, pg, _cheap_values(pg, spec), _send_cost(spec), size,
                    loss=loss, loss_at=loss_node(traced, costs) if loss.total_s > 0 else None)
        if short:
            pr.table = fold(pg, run, pr.table.times, pr.cheap)
            held_back[:] = held  # said only where the fold stands (see priced)
        else:
            _warn_again(held)
        return pr

    # the two-block trace's warnings are about the model only where the fold stands (a
    # pipe_split() after block 1 is "after the last computation" of two blocks); else the full
    # trace is planned and warns for itself
    held_back: list = []
    unfolded: list[str] = []  # why a run of identical blocks was not planned as blocks
    checked: list[bool] = []  # the full model ran once and repeats as the fold assumes

    def priced(size: int) -> Priced:
        nonlocal run
        if run is not None:
            pr = priced_at(size, True)
            why = None if pr.table is not None else (
                "the graph between them does not repeat block by block (a block's value read "
                "by a later block, the parent's nodes between blocks that differ or hold "
                "parameters, or pipe_split()/annotate() in the run)")
            if why is None and not checked:
                _progress.info("checking that the model's %d blocks repeat", run.count)
                why = check_run(given, run, tuple(_resize(x, 1) for x in args),
                                {k: _resize(v, 1) for k, v in kwargs.items()})
                checked.append(why is None)
            if why is None:
                _warn_again(held_back)
                return pr
            unfolded.append(
                f"not planned as blocks: {run.count} identical {run.prefix or 'top-level '}* "
                f"blocks were found, but {why}; planned node by node, which takes longer for "
                "deep models")
            run = None  # the full model does not fold: plan node by node
        return priced_at(size, False)

    at_size: dict[int, Priced] = {}
    at_both: dict[tuple[int, int], Priced] = {}

    def priced_t(size: int, t: int) -> Priced:
        """The units traced at ``size`` per micro-batch, at tensor degree ``t``."""
        if size not in at_size:
            at_size[size] = priced(size)
        if (size, t) not in at_both:
            at_both[(size, t)] = at_degree(at_size[size], spec, t)
        return at_both[(size, t)]

    pr = priced_t(b0, 1)
    if units_only:
        return pr, None
    if cuts is not None:
        degrees = tensor_degrees(spec)
        cands = (candidates(spec, max_stages=len(pr.table.names), tensor=degrees[0])
                 if len(degrees) == 1 else [])
        if len(cands) != 1:
            raise PlanError("plan_with_graph(cuts=...) needs a spec with a fixed layout "
                            f"(pipeline, data, tensor, microbatches, schedule); it has "
                            f"{len(cands)}")
        cand = cands[0]
        mbs = spec.data.batch_size // (cand.dp * cand.microbatches)
        pr = priced_t(mbs, cand.tensor)
        result = evaluate(_cut_problem(pr, spec, cand, 1.0), cuts, method="given")
        explain = [f"cuts given: stages start at units {list(cuts)}"]
    else:
        cand, result, mbs, explain = _search(lambda t: priced_t(b0, t), spec)
    if cuts is None:  # the chosen layout cut exactly (the search ranks near-optimal cuts), at
        pr = priced_t(mbs, cand.tensor)  # the real micro-batch size (the plan's shapes exact)
        result = _solve_fitting(pr, spec, cand, 1.0)[1]
    if (cuts is None and spec.cluster.costs == "measured" and spec.cluster.measure_stages
            and cand.num_stages > 1 and cand.tensor > 1):
        explain.append("cluster.measure_stages: not done under tensor parallelism (the "
                       "stages would run sharded); the cut rests on the per-node profile")
    elif (cuts is None and spec.cluster.costs == "measured" and spec.cluster.measure_stages
            and cand.num_stages > 1):
        m, args_, kwargs_, on = tracing(False)
        real = None if on == "meta" or _is_fake(m) else m
        pr, result, note = _refine_by_stages(
            pr, spec, cand, result, real, tuple(_resize(x, mbs) for x in args_),
            {k: _resize(v, mbs) for k, v in kwargs_.items()})
        explain.append(note)
    explain += unfolded
    traced, pg = pr.traced, pr.pg
    model, traced_on = tracing(pr.table.folding is not None)[0], tracing(
        pr.table.folding is not None)[3]
    if traced.pins or traced.split_after:
        explain.append(f"honoured {plural(len(traced.split_after), 'pipe_split() marker')} and "
                       f"{plural(len(set(traced.pins.values())), 'annotate() pin')}")
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        explain.append(f"BatchNorm: statistics are computed over each micro-batch of "
                       f"{plural(mbs, 'sample')}, as in GPipe, not over the whole batch; "
                       "everything else equals single-process training")
    if pr.table.folding is not None:
        plan = _assemble_folded(pr, result, cand, spec, mbs, explain)
    else:
        plan = _assemble(pr, result, cand, spec, mbs, explain)
    if spec.train.updates == "async":
        assign_servers(plan, {n: p.numel() * p.element_size()
                              for n, p in given.named_parameters(remove_duplicate=False)}, spec)
        if not plan.folded:  # priced again with the servers' real shares
            plan.predicted = predict(plan)
    # every trained parameter's shape: PowerSGD prices each matrix's low-rank factors,
    # sharding the slices; the state each rank holds (fxpipe.plans.state_bytes) reads them
    plan.param_shapes = {n: list(p.shape) for n, p in given.named_parameters(
        remove_duplicate=False) if p.requires_grad}  # tied aliases too (stages name them)
    plan.param_itemsize = next((p.element_size() for p in given.parameters()
                                if p.requires_grad), 4)
    if (spec.train.grad_compression == "powersgd" or plan.data_sharding != "none") \
            and not plan.folded:
        plan.predicted = predict(plan)
    if spec.cluster.nodes > 1:
        plan.explain.append(_placement_note(plan, spec))
    if (spec.cluster.costs == "measured" and plan.num_stages > 1
            and pr.send.method is None and torch.device(spec.cluster.device).type == "cpu"):
        cached = send_cost_path(spec.cluster.device)
        why = (f"its cache {cached} is damaged or from an older fxpipe" if cached.exists()
               else "not measured on this machine")
        plan.explain.append(f"send cost: {why}, so the default (a fixed overhead plus the "
                            "bytes at cluster.memory_GBps), which prices gloo sends low; "
                            "`fxpipe profile SPEC` measures it")
    rc_stages = [st.index for st in plan.stages if st.recompute]
    if rc_stages:
        every = len(rc_stages) == plan.num_stages
        why = ("train.activation_recompute: on" if spec.train.activation_recompute == "on" else
               f"the activations of the micro-batches in flight would not fit cluster.memory_gb"
               f"{'' if every else '; the other stages keep theirs and skip the second forward'}")
        where = ("every stage" if every else
                 f"stage{'s' if len(rc_stages) > 1 else ''} {', '.join(map(str, rc_stages))}")
        plan.explain.append(f"activation recomputation on {where}: each keeps only its inputs per "
                            "micro-batch in flight and runs its forward again in the backward "
                            f"({why})")
    if plan.recomputed:
        plan.explain.append("recomputed in each stage that reads them (cheaper than sending): "
                            + ", ".join(f"{v} ({human_bytes(bounds_bytes)}) in stages "
                                        f"{', '.join(map(str, s))}"
                                        for v, s in plan.recomputed.items()
                                        for bounds_bytes in [pg.value_info(v)[2]]))
    plan.input_kwargs = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    plan.traced_on = traced_on
    missing = [k for k in plan.input_kwargs if k not in plan.model_inputs]
    if missing:
        raise TraceError(f"keyword inputs {missing} do not appear as inputs of the traced graph "
                         f"(its inputs: {plan.model_inputs}); pass them by their forward() names")
    return plan, (None if plan.folded else pg.graph)


def planning_units(model: nn.Module, spec: Any, example_inputs: Any = None,
                   example_kwargs: dict | None = None) -> list[tuple[str, str]]:
    """The units the planner cuts between, in order: ``(name, module path)`` per unit (FX
    node names, or block names such as ``h.7`` for a model planned as blocks). A stage start
    ``i`` for :func:`plan_with_graph` ``cuts`` means "a cut right before unit ``i``"."""
    pr, _ = plan_with_graph(model, spec, example_inputs, example_kwargs, units_only=True)
    if pr.table.folding is not None:
        return [(n, n if n.startswith(pr.table.folding.run.prefix) else
                 pr.pg.graph.nodes[n]["module"]) for n in pr.table.names]
    return [(n, pr.pg.graph.nodes[n]["module"]) for n in pr.table.names]


def plan(model: nn.Module, spec: Any, example_inputs: Any = None,
         example_kwargs: dict | None = None) -> Plan:
    """Trace, price and partition ``model`` according to ``spec``.

    Args:
        model: an ordinary ``nn.Module``; it may live on the meta device (nothing is computed:
            a fake copy on ``cluster.device`` is traced, so the graph is the one the workers
            trace there).
        spec: a :class:`~fxpipe.specs.schema.ParallelSpec`, a YAML path, a bundled spec name or
            a dict.
        example_inputs: ONE micro-batch of positional inputs (tensor or tuple of tensors, dim 0
            = batch).
        example_kwargs: ONE micro-batch of keyword inputs by forward() argument name, e.g.
            ``{"input_ids": ids, "attention_mask": mask, "labels": ids}`` for a transformers
            model that computes its own loss. Default for both: batch 0 of the spec's dataset.
            Costs scale linearly with the micro-batch size the plan chooses; the final plan is
            re-traced at that size.

    Returns:
        The :class:`~fxpipe.plans.plan.Plan` (with ``predicted`` filled by the simulator).

    Raises:
        SpecError: bad spec. TraceError: the model cannot be traced, or it returns several
        values and ``model.output`` does not name the one the loss reads. PlanError: no
        partition fits (e.g. device memory too small).
    """
    return plan_with_graph(model, spec, example_inputs, example_kwargs)[0]


def plan_from_spec(spec: Any) -> tuple[Plan, "nx.DiGraph"]:
    """Build the spec's model on the meta device (no weight memory) and plan it."""
    spec = as_spec(spec)
    if spec.cluster.costs == "measured":  # real weights, to measure what is not cached yet
        model = build_model(spec)
    else:
        with torch.device("meta"):
            model = build_model(spec, load_weights=False)
    check_vocabulary(model, spec)
    batch = example_microbatch(spec)
    try:
        return plan_with_graph(model, spec, batch.args, batch.kwargs)
    except TraceError as e:
        shapes = ", ".join(f"{name}: {str(t.dtype).replace('torch.', '')}{list(t.shape)}"
                           for name, t in [*enumerate(batch.args), *batch.kwargs.items()])
        raise TraceError(
            f"{e}\n(the example inputs came from data.{spec.data.source} "
            f"{spec.data.dataset_ref if spec.data.source == 'dataset' else getattr(spec.data, spec.data.source)}"
            f": {shapes}; if "
            "they do not fit the model, fix the dataset or data.seq_len rather than the tracer)"
        ) from None
