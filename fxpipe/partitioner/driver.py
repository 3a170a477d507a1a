"""The partitioner's driver, ``fxpipe.plan()``: from a model and a spec to a :class:`Plan`.

Takes an ``nn.Module`` (real or on the meta device), a spec and one micro-batch of example
inputs; gives a :class:`~fxpipe.plans.plan.Plan`. The steps, each in its own module: trace
(torch.export) -> cost (fake-tensor FLOPs and bytes) -> graph (networkx units) -> the cut problem
-> the exact solvers (min-bottleneck cut, memory-checked; with ``auto``, every layout of
:mod:`fxpipe.partitioner.search` priced by the simulator) -> boundaries (stage inputs and
outputs) -> Plan.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import networkx as nx
import numpy as np
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor

from fxpipe.data.batches import example_microbatch
from fxpipe.errors import PlanError, TraceError
from fxpipe.partitioner.boundaries import stage_boundaries
from fxpipe.partitioner.cost import NodeCost, price
from fxpipe.partitioner.graph import PricedGraph, build_graph
from fxpipe.partitioner.problem import CutProblem, PartitionResult, Value
from fxpipe.partitioner.profile import (SendCost, load_profile, load_send_cost, profile_graph,
                                        profile_key, save_profile)
from fxpipe.partitioner.recompute import apply_recompute, cheap_values, is_clone
from fxpipe.partitioner.search import Candidate, candidates, stage_inflight
from fxpipe.partitioner.solvers import optimal_partition
from fxpipe.partitioner.timing import NodeTimes, analytic_times, sum_times
from fxpipe.partitioner.trace import TracedModel, fake_on_device, trace
from fxpipe.plans.plan import Plan, StagePlan
from fxpipe.plans.values import needs_grad
from fxpipe.plans.placement import pair_crosses_nodes, stage_to_rank
from fxpipe.schedule.lowering import build_schedule
from fxpipe.schedule.simulate import Links, StageCosts, predict, simulate
from fxpipe.specs.loader import build_model, load_spec
from fxpipe.specs.schema import OPTIMIZER_STATE_FACTOR, ParallelSpec, stages_per_rank
from fxpipe.units import human_bytes, plural


#: Sender-side seconds per message of a CPU (gloo) send when none was measured.
CPU_SEND_OVERHEAD_S = 30e-6


def as_spec(spec: Any) -> ParallelSpec:
    """A :class:`ParallelSpec` as it is, or loaded from a YAML path, bundled name or dict."""
    return spec if isinstance(spec, ParallelSpec) else load_spec(spec)


def _boundary_bandwidths(spec: ParallelSpec, cand: Candidate, stage_to_rank: list[int]
                         ) -> list[float]:
    """Bytes/s of the link between stage j and j+1 (inter-node when any replica's pair spans
    two nodes). Stages on one rank exchange values in memory (infinite bandwidth)."""
    links, dpn = spec.cluster.links, spec.cluster.devices_per_node
    out = []
    for a, b in zip(stage_to_rank[:-1], stage_to_rank[1:]):
        if a == b:
            out.append(float("inf"))
        elif pair_crosses_nodes(a, b, cand.pipeline, cand.dp, dpn):
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
    """

    traced: TracedModel
    costs: dict[str, NodeCost]
    times: dict[str, NodeTimes]
    pg: PricedGraph
    cheap: set[str]
    send: SendCost
    batch: int


def _send_cost(spec: ParallelSpec) -> SendCost:
    """What a send costs the sending rank: measured by ``fxpipe profile`` when cached, else on
    CPU (gloo copies in the sender's thread) a fixed overhead plus the bytes at memory speed,
    and nothing on CUDA (NCCL works on the device)."""
    measured = load_send_cost(spec.cluster.device)
    if measured is not None:
        return measured
    if spec.cluster.device == "cpu":
        return SendCost(CPU_SEND_OVERHEAD_S, spec.cluster.memory_Bps)
    return SendCost(0.0, float("inf"))


def _node_times(traced: TracedModel, costs: dict[str, NodeCost], spec: ParallelSpec,
                profile_model: nn.Module | None, inputs: list) -> dict[str, NodeTimes]:
    """Seconds per node: the roofline, or with ``cluster.costs: measured`` the cached profile
    (measured now on ``profile_model``, a model with real weights, when none is cached).

    Raises:
        PlanError: measured costs are asked for, none are cached and the model has no real
            weights to measure.
    """
    cl = spec.cluster
    if cl.costs == "analytic":
        return analytic_times(costs, cl.device_tflops * 1e12, cl.memory_Bps, cl.op_overhead_s)
    key = profile_key(traced, cl.device)
    times = load_profile(key)
    if times is None:
        if profile_model is None:
            raise PlanError(
                "cluster.costs is 'measured' but this model's costs have not been measured on "
                f"{cl.device}; run `fxpipe profile SPEC` first, or plan a model with real "
                "weights (not on the meta device)")
        real = trace(profile_model, traced_args(traced, inputs)[0], spec.model.tracer,
                     example_kwargs=traced_args(traced, inputs)[1], output=spec.loss_output)
        times = profile_graph(real, inputs, cl.device)
        save_profile(key, times, {"model": traced.model_name, "device": cl.device})
    missing = [n for n in costs if n not in times]
    if missing:
        raise PlanError(f"the measured costs do not cover nodes {missing[:5]}; re-run "
                        "`fxpipe profile SPEC`")
    return times


def traced_args(traced: TracedModel, inputs: list) -> tuple[tuple, dict]:
    """Split placeholder values (graph order) back into positional and keyword inputs."""
    kw = traced.input_kwargs
    named = dict(zip(traced.input_names, inputs))
    return (tuple(v for n, v in named.items() if n not in kw), {n: named[n] for n in kw})


def _cut_problem(pr: Priced, spec: ParallelSpec, cand: Candidate, scale: float) -> CutProblem:
    """The cut problem of one candidate layout at ``scale`` x the traced micro-batch; values
    in ``pr.cheap`` cross cuts for free (each stage rebuilds them)."""
    pg = pr.pg
    g = pg.graph
    units = pg.order
    compute = [sum_times(pr.times, g.nodes[u]["members"]).total_s * scale for u in units]
    params = [g.nodes[u]["param_bytes"] for u in units]
    saved = [g.nodes[u]["saved_bytes"] * scale for u in units]
    n = len(units)
    values = []
    for row in pg.values:
        users = tuple(u for u in row.user_positions if u < n)  # n = the loss, on the last stage
        if users and row.name not in pr.cheap:
            grad = needs_grad(pg.value_info(row.name)[1])
            values.append(Value(row.producer_pos, users, row.nbytes * scale, grad, row.name))
    inflight, stage_to_rank = stage_inflight(cand)
    k = cand.num_stages
    return CutProblem(
        compute, params, saved, values, k,
        bandwidth_Bps=_boundary_bandwidths(spec, cand, stage_to_rank) if k > 1 else 1.0,
        latency_s=spec.cluster.links.latency_s,
        capacity_bytes=spec.cluster.memory_gb * 1e9,
        param_multiplier=OPTIMIZER_STATE_FACTOR[spec.train.optimizer],
        inflight=inflight,
        forced_cuts=pg.forced_cuts,
        pins=pg.pins,
        unit_names=units,
    )


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
    stages = []
    for j, sb in enumerate(bounds.stages):
        nodes = [n for n in sb.nodes if n in costs]
        fwd = scale * float(sum(costs[n].fwd_flops for n in nodes))
        bwd = scale * float(sum(costs[n].bwd_flops for n in nodes))
        bwd_w = scale * float(sum(costs[n].bwd_weight_flops for n in nodes))
        tj = sum_times(times, nodes).scaled(scale)
        sends = [scale * bounds.values[o].nbytes for o in sb.outputs
                 for _ in bounds.values[o].consumers]
        stages.append(StagePlan(
            index=j, nodes=list(sb.nodes), params=list(sb.params), buffers=list(sb.buffers),
            inputs=list(sb.inputs), outputs=list(sb.outputs),
            fwd_flops=fwd, bwd_flops=bwd, bwd_weight_flops=bwd_w,
            param_bytes=int(result.param_bytes[j]), activation_bytes=int(result.saved_bytes[j]),
            recv_bytes=int(result.recv_bytes[j]), send_bytes=int(result.send_bytes[j]),
            compute_time_s=tj.total_s, comm_time_s=result.comm_s[j],
            time_s=tj.total_s + result.comm_s[j], memory_bytes=int(result.memory_bytes[j]),
            fwd_time_s=tj.fwd_s, bwd_input_time_s=tj.bwd_input_s,
            bwd_weight_time_s=tj.bwd_weight_s,
            send_time_s=sum(pr.send.seconds(b) for b in sends) / max(1, len(sends)),
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
        bottleneck_stage=result.bottleneck, lower_bound_s=result.lower_bound_s,
        explain=list(explain), spec=spec.model_dump(mode="json"), recomputed=recomputed,
    )
    plan.predicted = predict(plan)
    return plan


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
    g = pr.pg.graph
    rows = [sum_times(pr.times, g.nodes[u]["members"]) for u in pr.pg.order]
    arr = np.array([[r.fwd_s, r.bwd_input_s, r.bwd_weight_s] for r in rows]).T.reshape(3, -1)
    return np.concatenate([np.zeros((3, 1)), np.cumsum(arr, axis=1)], axis=1)


def _simulated_step(pr: Priced, prefix: np.ndarray, problem: CutProblem,
                    result: PartitionResult, cand: Candidate, spec: ParallelSpec,
                    scale: float) -> float:
    """Simulated step time of a candidate's partition, straight from the cut (no Plan built):
    per-stage F/B/W from the unit prefix sums, edge bytes from the values crossing the cuts."""
    cuts = list(result.cuts) + [problem.n]
    per = [(prefix[:, b] - prefix[:, a]) * scale for a, b in zip(cuts[:-1], cuts[1:])]
    stage_of = result.stage_of()
    fwd: dict[tuple[int, int], float] = {}
    grad: dict[tuple[int, int], float] = {}
    for v in problem.values:
        if v.producer < 0:
            continue
        ps = stage_of[v.producer]
        for cs in sorted({stage_of[u] for u in v.users} - {ps}):
            fwd[(ps, cs)] = fwd.get((ps, cs), 0.0) + v.nbytes
            if v.grad:
                grad[(ps, cs)] = grad.get((ps, cs), 0.0) + v.nbytes
    costs = StageCosts([float(x[0]) for x in per], [float(x[1]) for x in per],
                       [float(x[2]) for x in per],
                       send_s=[pr.send.seconds(result.send_bytes[j]) for j in range(len(per))])
    sched = build_schedule(cand.schedule, cand.pipeline, cand.microbatches, cand.virtual_stages,
                           set(fwd), set(grad))
    cl = spec.cluster
    links = Links.from_cluster(cand.pipeline, cand.dp, cl.nodes, cl.devices_per_node,
                               cl.links.intra_node_GBps, cl.links.inter_node_GBps,
                               cl.links.latency_s)
    return simulate(sched, costs, fwd, links, dp=cand.dp, allreduce_bytes=list(
        result.param_bytes), grad_edge_bytes=grad, check=False).step_time_s


def _search(pr: Priced, spec: ParallelSpec) -> tuple[Candidate, PartitionResult, int, list[str]]:
    """The fastest candidate layout that fits, and the explanation of the ranking.

    Candidates are visited in the order of a lower bound on their step time (every rank must
    run its share of ``m`` micro-batches: ``m x total / p``); a candidate whose bound, or whose
    cut's bound (``m x`` its slowest rank's work), cannot beat the best simulated step so far is
    not simulated, and once the cheapest bound left cannot, the search stops."""
    prefix = _unit_prefix(pr)
    total = float(prefix[:, -1].sum())
    n_units = len(pr.pg.order)
    bounds = []
    for cand in candidates(spec, max_stages=n_units):
        mbs = spec.data.batch_size // (cand.dp * cand.microbatches)
        if mbs >= 1:
            lb = cand.microbatches * total * mbs / pr.batch / cand.pipeline
            bounds.append((lb, cand.label(), cand, mbs))
    bounds.sort(key=lambda x: (x[0], x[1]))
    best: _Ranked | None = None
    ranked: list[_Ranked] = []
    errors: list[str] = []
    pruned = 0
    for lb, label, cand, mbs in bounds:
        if best is not None and lb >= best.step_s:
            pruned += 1
            continue
        scale = mbs / pr.batch
        try:
            problem = _cut_problem(pr, spec, cand, scale)
            result = optimal_partition(problem)
        except PlanError as e:
            errors.append(f"{label}: {e}")
            continue
        ranks = stage_to_rank(cand.schedule, cand.pipeline, cand.num_stages)
        per_rank = [0.0] * cand.pipeline
        for j, c in enumerate(result.stage_costs_s):
            per_rank[ranks[j]] += c
        if best is not None and cand.microbatches * max(per_rank) >= best.step_s:
            pruned += 1
            continue
        if len(bounds) == 1:
            return cand, result, mbs, []
        r = _Ranked(_simulated_step(pr, prefix, problem, result, cand, spec, scale), label,
                    cand, result, mbs)
        ranked.append(r)
        best = r if best is None or r < best else best
    if best is None:
        raise PlanError("no feasible plan:\n  " + "\n  ".join(errors[:8]))
    ranked.sort()
    explain = [f"auto search: {len(bounds)} candidates, {len(ranked)} simulated, {pruned} "
               f"pruned by a lower bound, {len(errors)} infeasible; ranked by simulated step "
               "time:"]
    explain += [f"  {i + 1}. {r.label:40s} {r.step_s * 1e3:10.2f} ms/step"
                for i, r in enumerate(ranked[:5])]
    return best.cand, best.result, best.mbs, explain


def plan_with_graph(model: nn.Module, spec: Any, example_inputs: Any = None,
                    example_kwargs: dict | None = None) -> tuple[Plan, "nx.DiGraph"]:
    """:func:`plan`, also returning the priced networkx graph of planning units (for
    ``plan.dump(dir, graph)``'s DOT drawing)."""
    spec = as_spec(spec)
    if example_inputs is None and example_kwargs is None:
        batch = example_microbatch(spec, 1)
        args, kwargs = batch.args, batch.kwargs
    else:
        if isinstance(example_inputs, torch.Tensor):
            example_inputs = (example_inputs,)
        args, kwargs = tuple(example_inputs or ()), dict(example_kwargs or {})
    tensors = [t for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor) and t.dim()]
    b0 = int(tensors[0].shape[0]) if tensors else 1
    model, args, kwargs, traced_on = tracing_model(model, args, kwargs, spec.cluster.device)
    args = tuple(args)
    key = spec.loss_output

    def traced_at(size: int) -> TracedModel:
        return trace(model, tuple(_resize(a, size) for a in args), spec.model.tracer,
                     example_kwargs={k: _resize(v, size) for k, v in kwargs.items()}, output=key)

    real = None if traced_on == "meta" or _is_fake(model) else model

    def priced_at(size: int) -> Priced:
        traced = traced_at(size)
        costs = price(traced)
        inputs = [*(_resize(a, size) for a in args), *(_resize(v, size) for k, v in
                                                       kwargs.items() if isinstance(v, torch.Tensor))]
        times = _node_times(traced, costs, spec, real, inputs)
        pg = build_graph(traced, costs)
        return Priced(traced, costs, times, pg, _cheap_values(pg, spec), _send_cost(spec), size)

    pr = priced_at(b0)
    cand, result, mbs, explain = _search(pr, spec)
    if mbs != b0:  # re-trace at the real micro-batch size so the plan's shapes are exact
        pr = priced_at(mbs)
        result = optimal_partition(_cut_problem(pr, spec, cand, 1.0))
    traced, pg = pr.traced, pr.pg
    if traced.pins or traced.split_after:
        explain.append(f"honoured {plural(len(traced.split_after), 'pipe_split() marker')} and "
                       f"{plural(len(set(traced.pins.values())), 'annotate() pin')}")
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        explain.append(f"BatchNorm: statistics are computed over each micro-batch of "
                       f"{plural(mbs, 'sample')}, as in GPipe, not over the whole batch; "
                       "everything else equals single-process training")
    plan = _assemble(pr, result, cand, spec, mbs, explain)
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
    return plan, pg.graph


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
    batch = example_microbatch(spec)
    try:
        return plan_with_graph(model, spec, batch.args, batch.kwargs)
    except TraceError as e:
        shapes = ", ".join(f"{name}: {str(t.dtype).replace('torch.', '')}{list(t.shape)}"
                           for name, t in [*enumerate(batch.args), *batch.kwargs.items()])
        raise TraceError(
            f"{e}\n(the example inputs came from data.dataset {spec.data.dataset}: {shapes}; if "
            "they do not fit the model, fix the dataset or data.seq_len rather than the tracer)"
        ) from None
