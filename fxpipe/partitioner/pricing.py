"""The price pass: a traced model -> :class:`Priced` (per-node FLOPs, bytes and seconds, the
networkx units, the values cheaper to rebuild than to send, the send cost), at tensor-parallel
degree 1 or, through :func:`at_degree`, one rank's share at another degree."""

from __future__ import annotations

import dataclasses
import logging
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from fxpipe.data.batches import example_microbatch
from fxpipe.errors import PlanError
from fxpipe.execution.losses import MODEL_LOSS
from fxpipe.execution.selective import ridge_of
from fxpipe.partitioner.blocks import UnitTable, fold, fold_rows, saver_positions
from fxpipe.partitioner.cost import NodeCost
from fxpipe.partitioner.expert_costs import with_all_to_alls
from fxpipe.partitioner.gpu_model import GpuRates, gpu_rates, gpu_times
from fxpipe.partitioner.gpu_model import profile as gpu_profile
from fxpipe.partitioner.graph import PricedGraph, build_graph
from fxpipe.partitioner.loss_cost import (analytic_loss_times, loss_node, measured_loss_times,
                                          output_bytes, with_loss)
from fxpipe.partitioner.problem import Value
from fxpipe.partitioner.profile import (SendCost, cache_dir, load_profile, load_send_cost,
                                        profile_graph, profile_key, save_profile)
from fxpipe.partitioner.recompute import cheap_values
from fxpipe.partitioner.tensor_costs import (TensorPricing, best_overlap, scaled_costs,
                                             tensor_pricing, with_comm)
from fxpipe.partitioner.timing import NodeTimes, analytic_times, sum_times
from fxpipe.partitioner.trace import TracedModel, trace
from fxpipe.plans.param_blocks import block_of
from fxpipe.plans.values import needs_grad
from fxpipe.specs.schema import ParallelSpec

_progress = logging.getLogger("fxpipe.progress")


#: Sender-side seconds per message of a CPU (gloo) send when none was measured.
CPU_SEND_OVERHEAD_S = 30e-6

def rebuilt_values(pg: PricedGraph, spec: ParallelSpec) -> set[str]:
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
        ridge: the device's FLOPs per byte at which selective recomputation keeps an op's
            outputs (:func:`spec_ridge`); 0 keeps every matmul-like op's.
        expert_comm: under expert parallelism, node -> the (forward, input-gradient) seconds of
            its all-to-alls (:mod:`fxpipe.partitioner.expert_costs`).
        expert_bytes: under expert parallelism, the bytes of the ``[E, C, ...]`` tensors one
            micro-batch all-to-alls forward and backward (over the traced graph; None without).
        expert_params: under expert parallelism, node -> the expert parameter bytes charged
            to it (this rank's share; :mod:`fxpipe.partitioner.expert_state`).
        context_split: under context parallelism, the placements of the traced graph's values
            (:class:`fxpipe.context.analysis.ContextSplit`); context_bytes: the whole bytes
            one micro-batch all-gathers forward and reduce-scatters backward (None without).
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
    ridge: float = 0.0
    expert_bytes: list[float] | None = None
    expert_comm: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    context_split: Any = None
    context_bytes: list[float] | None = None
    expert_params: dict[str, int] = dataclasses.field(default_factory=dict)
    #: what is derived once from these figures (:mod:`fxpipe.partitioner.cut_tables`); not
    #: copied by ``dataclasses.replace``, whose copy derives its own
    cache: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def degree(self) -> int:
        """The tensor-parallel degree these costs are for."""
        return self.tensor.t if self.tensor is not None else 1

    def __post_init__(self) -> None:
        if self.table is None:
            self.table = _node_table(self)

def spec_ridge(spec: ParallelSpec) -> float:
    """FLOPs per byte at which selective recomputation keeps an op's outputs on the spec's
    devices: ``device_tflops`` over ``memory_GBps`` (:mod:`fxpipe.execution.selective`)."""
    return ridge_of(spec.cluster.device_tflops * 1e12, spec.cluster.memory_Bps)

def selective_units(pr: "Priced", units: list[list[str]], ridge: float | None = None
                    ) -> list[tuple[float, float]]:
    """Per unit (its member nodes), under selective recomputation at ``ridge`` (None: the
    device's, ``pr.ridge``): the seconds of its forward that run again (the nodes none of
    whose ops are kept) and the bytes it keeps per micro-batch."""
    ridge = pr.ridge if ridge is None else ridge
    out = []
    for members in units:
        again = kept = 0.0
        for n in members:
            c = pr.costs.get(n)
            if c is None:
                continue
            b, rerun = c.selective(ridge)
            kept += b
            if rerun and n in pr.times:
                again += pr.times[n].fwd_s
        out.append((again, kept))
    return out

#: most keep thresholds above the ridge point the planner weighs for selective recomputation
#: (:func:`selective_levels`)
MAX_SELECTIVE_LEVELS = 3

def selective_levels(pr: "Priced") -> list[float]:
    """Keep thresholds above the ridge point (FLOPs per output byte) at which selective
    recomputation keeps fewer ops, for stages whose rank does not hold what it keeps at the
    ridge: the matmul-like ops kept at the ridge, ordered by FLOPs per output byte (the FLOPs
    recomputing them costs per byte it frees), give a threshold between each two consecutive
    distinct values ``a < b``, each recomputing the ops with the least FLOPs per byte saved
    first (an unfused attention's scores, FLOPs per byte = the head dimension, before its
    probabilities-times-values, = the sequence length, before the linear layers, = their input
    width). The threshold is ``sqrt(2a x b)``, between ``2a`` and ``b``, where ``b > 2a``
    (else the two values count as one: a threshold between values closer than 2x would buy
    little memory for a cut evaluation); the run applies the rule to the bytes the plan
    priced (:func:`~fxpipe.execution.selective.rule_bytes`: autocast's narrowed outputs at
    float32 width), so each op falls on the same side of it in the plan and in the run. The
    lowest :data:`MAX_SELECTIVE_LEVELS` only: each costs a cut evaluation where it
    is weighed, and higher ones recompute linear layers, where recomputing whole blocks
    (partial recomputation) is weighed too. None keeps nothing (that is full
    recomputation)."""
    if "selective_levels" not in pr.cache:
        seen: set[float] = set()
        for members in (pr.pg.graph.nodes[u]["members"] for u in pr.pg.order):
            for n in members:
                c = pr.costs.get(n)
                for f, b in (c.ops if c is not None else ()):
                    if b > 0 and f >= pr.ridge * b:
                        seen.add(f / b)
        values = sorted(seen)
        pr.cache["selective_levels"] = [
            float(np.sqrt(2 * a * b)) for a, b in zip(values, values[1:])
            if b > 2 * a][:MAX_SELECTIVE_LEVELS]
    return pr.cache["selective_levels"]

def selective_at(pr: "Priced", ridge: float = 0.0) -> list[tuple[float, float]]:
    """The units' :attr:`~fxpipe.partitioner.blocks.UnitTable.selective` figures at keep
    threshold ``ridge`` (0: the device's ridge point, the table's own): per unit, the forward
    seconds it runs again and the bytes it keeps per micro-batch, folded like the table when
    it is, and scaled to the table's forward seconds where those were measured."""
    if not ridge or ridge == pr.ridge:
        return pr.table.selective
    key = ("selective_at", float(ridge))
    if key not in pr.cache:
        g = pr.pg.graph
        units = [g.nodes[u]["members"] for u in pr.pg.order]
        rows = selective_units(pr, units, ridge)
        fwd = [(sum_times(pr.times, m).fwd_s,) for m in units]
        fo = pr.table.folding
        if fo is not None:
            rows, fwd = fold_rows(fo, rows), fold_rows(fo, fwd)
        pr.cache[key] = [(again * (t[0] / f[0] if f[0] > 0 else 1.0), kept)
                         for (again, kept), f, t in zip(rows, fwd, pr.table.times)]
    return pr.cache[key]

def _node_table(pr: "Priced") -> UnitTable:
    """The node-level units of the priced graph (one per FX node, getitems merged)."""
    pg, g = pr.pg, pr.pg.graph
    times = []
    for u in pg.order:
        t = sum_times(pr.times, g.nodes[u]["members"])
        times.append((t.fwd_s, t.bwd_input_s, t.bwd_weight_s))
    n = len(pg.order)
    values, saver, saved_at = [], saver_positions(pg, pr.costs), []
    for row in pg.values:
        users = tuple(u for u in row.user_positions if u < n)  # n = the loss, on the last stage
        if users and row.name not in pr.cheap:
            grad = needs_grad(pg.value_info(row.name)[1])
            values.append(Value(row.producer_pos, users, row.nbytes, grad, row.name))
            saved_at.append(saver.get(row.name, -1))
    return UnitTable(
        list(pg.order), times,
        [(g.nodes[u]["fwd_flops"], g.nodes[u]["bwd_flops"], g.nodes[u]["bwd_weight_flops"])
         for u in pg.order],
        [g.nodes[u]["param_bytes"] for u in pg.order],
        [g.nodes[u]["saved_bytes"] for u in pg.order], values, list(pg.forced_cuts),
        dict(pg.pins), selective=selective_units(pr, [g.nodes[u]["members"] for u in pg.order]),
        blocks=[block_of(g.nodes[u].get("module") or "") for u in pg.order],
        value_saved_at=saved_at)

def send_cost_of(spec: ParallelSpec) -> SendCost:
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
            "byte_scale": 0.5 if spec.train.precision in ("bf16", "fp16", "fp8") else 1.0}

def node_seconds(traced: TracedModel, costs: dict[str, NodeCost], spec: ParallelSpec,
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
    auto = spec.parallel.tp_overlap == "auto"
    tp = tensor_pricing(traced.gm, t, sequence_parallel=spec.parallel.sequence_parallel,
                        overlap=1 if auto else spec.parallel.tp_overlap,
                        chunk_op_s=cl.op_overhead_s + (_gpu_rates(spec).matmul_fixed_s
                                                       if cl.device == "cuda" else 0.0),
                        memory_Bps=cl.memory_Bps,
                        output_loss=None if spec.train.loss == MODEL_LOSS else spec.train.loss,
                        trainable=trainable, intra_node_GBps=cl.links.intra_node_GBps,
                        latency_s=cl.links.latency_s, strict=spec.parallel.tensor != "auto",
                        **_collective_curve(spec))
    costs = scaled_costs(pr.costs, tp)
    loss = (pr.loss.scaled(tp.fraction.get(pr.loss_at, 1.0)) if pr.loss_at is not None
            else pr.loss)
    if cl.costs == "analytic":
        alone = with_all_to_alls(with_loss(_analytic_times(costs, spec), pr.loss_at, loss),
                                 pr.expert_comm)
    else:
        alone = {n: x.scaled(tp.fraction.get(n, 1.0)) for n, x in pr.times.items()}
    if auto:  # the chunk count that saves most (1: none)
        tp = dataclasses.replace(best_overlap(alone, tp, traced.gm), asked="auto")
    times = with_comm(alone, tp)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the degree-1 graph said what there is to say
        pg = build_graph(traced, costs)
    out = Priced(traced, costs, times, pg, pr.cheap, pr.send, pr.batch, loss=loss,
                 loss_at=pr.loss_at, tensor=tp, ridge=pr.ridge, expert_bytes=pr.expert_bytes,
                 expert_comm=pr.expert_comm, expert_params=pr.expert_params)
    if pr.table.folding is not None:
        folded = fold(pg, pr.table.folding.run, out.table.times, pr.cheap,
                      out.table.selective, costs)
        if folded is None:  # pragma: no cover - the degree-1 graph folded
            raise PlanError("the model's blocks fold at tensor degree 1 but not at "
                            f"{t}; plan it with parallel.tensor: 1")
        out.table = folded
    # values cross a cut whole (a stage's outputs are gathered: the runtime sends whole
    # tensors), so they keep the degree-1 bytes; only the work and memory inside are shared
    out.table = dataclasses.replace(out.table, values=list(pr.table.values),
                                    value_saved_at=list(pr.table.value_saved_at))
    return out

def tensor_inputs(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensor inputs in call order: what a trace's ``input_names`` name."""
    return [v for v in [*args, *kwargs.values()] if isinstance(v, torch.Tensor)]

def traced_args(traced: TracedModel, inputs: list) -> tuple[tuple, dict]:
    """Split placeholder values (graph order) back into positional and keyword inputs."""
    kw = traced.input_kwargs
    named = dict(zip(traced.input_names, inputs))
    return (tuple(v for n, v in named.items() if n not in kw), {n: named[n] for n in kw})

def unit_prefix(pr: Priced) -> np.ndarray:
    """``(3, n+1)`` prefix sums of the units' forward, input-gradient, weight-gradient seconds."""
    arr = np.asarray(pr.table.times, dtype=np.float64).T.reshape(3, -1)
    return np.concatenate([np.zeros((3, 1)), np.cumsum(arr, axis=1)], axis=1)
