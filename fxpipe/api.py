"""``fxpipe.plan()``: the partitioner's data flow, from a model and a spec to a :class:`Plan`.

trace (torch.export) -> cost (fake-tensor FLOPs and bytes) -> graph (networkx units) ->
planner (exact min-bottleneck cut, memory-checked; with ``auto``, every layout of
:mod:`fxpipe.search` priced by the simulator) -> split (stage boundaries) -> Plan.

Also here, because they need both the partitioner and the runtime's schedule tools:
:func:`materialize_stages` (a worker rebuilds its stage modules from a Plan) and
:func:`simulate_spec` (``fxpipe simulate``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import networkx as nx
import torch
import torch.nn as nn

from fxpipe.errors import PlanError, TraceError
from fxpipe.partitioner.chain import CutProblem, PartitionResult, Value
from fxpipe.partitioner.cost import NodeCost, price
from fxpipe.partitioner.graph import PricedGraph, build_graph
from fxpipe.partitioner.planner import optimal_partition
from fxpipe.partitioner.split import build_stage_module, stage_boundaries
from fxpipe.partitioner.trace import TracedModel, trace
from fxpipe.plan_data import Plan, StagePlan
from fxpipe.runtime.schedules import SCHEDULE_NAMES
from fxpipe.runtime.simulate import predict, simulate_plan
from fxpipe.runtime.validate import ScheduleError
from fxpipe.search import Candidate, candidates, stage_inflight
from fxpipe.specs.loader import load_spec, spec_location
from fxpipe.specs.schema import ParallelSpec

#: state bytes per parameter byte: weights + gradients (+ 2 Adam moments)
STATE_FACTOR = {"adamw": 4.0, "sgd": 2.0}
def _as_spec(spec: Any) -> ParallelSpec:
    return spec if isinstance(spec, ParallelSpec) else load_spec(spec)


def _boundary_bandwidths(spec: ParallelSpec, stage_to_rank: list[int]) -> list[float]:
    """Bytes/s of the link between stage j and j+1 (replica 0: global rank = pipeline rank).
    Stages on one rank exchange values in memory (infinite bandwidth)."""
    links, dpn = spec.cluster.links, spec.cluster.devices_per_node
    out = []
    for a, b in zip(stage_to_rank[:-1], stage_to_rank[1:]):
        if a == b:
            out.append(float("inf"))
        elif a // dpn == b // dpn:
            out.append(links.intra_node_GBps * 1e9)
        else:
            out.append(links.inter_node_GBps * 1e9)
    return out


def _cut_problem(pg: PricedGraph, spec: ParallelSpec, cand: Candidate, scale: float) -> CutProblem:
    flops_per_s = spec.cluster.device_tflops * 1e12
    g = pg.graph
    units = pg.order
    compute = [(g.nodes[u]["fwd_flops"] + g.nodes[u]["bwd_flops"]) * scale / flops_per_s for u in units]
    params = [g.nodes[u]["param_bytes"] for u in units]
    saved = [g.nodes[u]["saved_bytes"] * scale for u in units]
    n = len(units)
    values = []
    for row in pg.values:
        users = tuple(u for u in row.user_positions if u < n)  # n = the loss, on the last stage
        if users:
            dtype = pg.value_info(row.name)[1]
            grad = dtype.startswith(("float", "bfloat", "complex"))
            values.append(Value(row.producer_pos, users, row.nbytes * scale, grad, row.name))
    inflight, stage_to_rank = stage_inflight(cand)
    k = cand.num_stages
    return CutProblem(
        compute, params, saved, values, k,
        bandwidth_Bps=_boundary_bandwidths(spec, stage_to_rank) if k > 1 else 1.0,
        latency_s=spec.cluster.links.latency_s,
        capacity_bytes=spec.cluster.memory_gb * 1e9,
        param_multiplier=STATE_FACTOR[spec.train.optimizer],
        inflight=inflight,
        forced_cuts=pg.forced_cuts,
        pins=pg.pins,
        unit_names=units,
    )


def _assemble(traced: TracedModel, pg: PricedGraph, costs: dict[str, NodeCost],
              result: PartitionResult, cand: Candidate, spec: ParallelSpec,
              microbatch_size: int, explain: list[str], scale: float = 1.0) -> Plan:
    """Turn a partition of units into a Plan (stage boundaries from the traced graph).

    ``scale`` (micro-batch size / traced batch size) scales FLOPs and value bytes when ranking
    candidates of another micro-batch size than the one traced; the final plan uses 1."""
    g = pg.graph
    node_stage: dict[str, int] = {}
    for pos, stage in enumerate(result.stage_of()):
        for member in g.nodes[pg.order[pos]]["members"]:
            node_stage[member] = stage
    bounds = stage_boundaries(traced.gm, node_stage, cand.num_stages)
    flops_per_s = spec.cluster.device_tflops * 1e12
    stages = []
    for j, sb in enumerate(bounds.stages):
        nodes = [n for n in sb.nodes if n in costs]
        fwd = scale * float(sum(costs[n].fwd_flops for n in nodes))
        bwd = scale * float(sum(costs[n].bwd_flops for n in nodes))
        bwd_w = scale * float(sum(costs[n].bwd_weight_flops for n in nodes))
        compute_s = result.compute_s[j]
        stages.append(StagePlan(
            index=j, nodes=list(sb.nodes), params=list(sb.params), buffers=list(sb.buffers),
            inputs=list(sb.inputs), outputs=list(sb.outputs),
            fwd_flops=fwd, bwd_flops=bwd, bwd_weight_flops=bwd_w,
            param_bytes=int(result.param_bytes[j]), activation_bytes=int(result.saved_bytes[j]),
            recv_bytes=int(result.recv_bytes[j]), send_bytes=int(result.send_bytes[j]),
            compute_time_s=compute_s, comm_time_s=result.comm_s[j],
            time_s=result.stage_costs_s[j], memory_bytes=int(result.memory_bytes[j]),
            fwd_time_s=fwd / flops_per_s, bwd_input_time_s=(bwd - bwd_w) / flops_per_s,
            bwd_weight_time_s=bwd_w / flops_per_s,
        ))
    if len(bounds.model_outputs) != 1:
        raise PlanError(
            f"the model returns {len(bounds.model_outputs)} values; fxpipe trains models that "
            "return one tensor (the loss input). Wrap the model so forward returns one tensor"
        )
    values = bounds.values
    if scale != 1.0:
        values = {k: dataclasses.replace(v, nbytes=int(v.nbytes * scale)) for k, v in values.items()}
    plan = Plan(
        model=traced.model_name or type(traced.gm).__name__,
        num_stages=cand.num_stages, pipeline=cand.pipeline, dp=cand.dp,
        microbatches=cand.microbatches, schedule=cand.schedule,
        virtual_stages=2 if cand.schedule == "zb-v" else cand.virtual_stages,
        microbatch_size=microbatch_size, stages=stages, values=values,
        model_inputs=list(bounds.model_inputs), model_output=bounds.model_outputs[0],
        shared_params=dict(bounds.shared_params), param_aliases=dict(bounds.param_aliases),
        bottleneck_stage=result.bottleneck, lower_bound_s=result.lower_bound_s,
        explain=list(explain), spec=spec.model_dump(mode="json"),
    )
    plan.predicted = predict(plan)
    return plan


def _resize_batch(inputs: tuple, size: int) -> tuple:
    """Example inputs with dim 0 resized to ``size`` (repeating or slicing)."""
    out = []
    for t in inputs:
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] == size:
            out.append(t)
        elif t.shape[0] > size:
            out.append(t[:size])
        else:
            reps = -(-size // t.shape[0])
            out.append(t.repeat(reps, *([1] * (t.dim() - 1)))[:size])
    return tuple(out)


def plan_with_graph(model: nn.Module, spec: Any, example_inputs: tuple | None = None
                    ) -> tuple[Plan, "nx.DiGraph"]:
    """:func:`plan`, also returning the priced networkx graph of planning units (for
    ``plan.dump(dir, graph)``'s DOT drawing)."""
    spec = _as_spec(spec)
    if example_inputs is None:
        example_inputs = example_microbatch(spec, 1)
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    example_inputs = tuple(example_inputs)
    b0 = next((t.shape[0] for t in example_inputs if isinstance(t, torch.Tensor) and t.dim()), 1)
    traced = trace(model, example_inputs, spec.model.tracer)
    costs = price(traced)
    pg = build_graph(traced, costs)

    ranked = []
    errors = []
    # cheap impossibilities first: more stages than units never fits, and building the schedule
    # of such a pipeline (say 100 000 stages) would take minutes
    for cand in candidates(spec, max_stages=len(pg.order)):
        mbs = spec.data.batch_size // (cand.dp * cand.microbatches)
        if mbs < 1:
            continue
        scale = mbs / b0
        try:
            problem = _cut_problem(pg, spec, cand, scale)
            result = optimal_partition(problem)
        except PlanError as e:
            errors.append(f"{cand.label()}: {e}")
            continue
        ranked.append((cand, result, mbs))
    if not ranked:
        raise PlanError("no feasible plan:\n  " + "\n  ".join(errors[:8]))

    explain = []
    if len(ranked) > 1:
        scored = []
        for cand, result, mbs in ranked:
            plan = _assemble(traced, pg, costs, result, cand, spec, mbs, [], scale=mbs / b0)
            scored.append((plan.predicted.step_time_s, cand, result, mbs))
        scored.sort(key=lambda x: (x[0], x[1].label()))
        explain.append(f"auto search: {len(scored)} feasible candidates, {len(errors)} infeasible; "
                       "ranked by simulated step time:")
        for i, (t, cand, _, _) in enumerate(scored[:5]):
            explain.append(f"  {i + 1}. {cand.label():40s} {t * 1e3:10.2f} ms/step")
        _, cand, result, mbs = scored[0]
    else:
        cand, result, mbs = ranked[0]
    if mbs != b0:  # re-trace at the real micro-batch size so the plan's shapes are exact
        example_inputs = _resize_batch(example_inputs, mbs)
        traced = trace(model, example_inputs, spec.model.tracer)
        costs = price(traced)
        pg = build_graph(traced, costs)
        result = optimal_partition(_cut_problem(pg, spec, cand, 1.0))
    if traced.pins or traced.split_after:
        explain.append(f"honoured {len(traced.split_after)} pipe_split() marker(s) and "
                       f"{len(set(traced.pins.values()))} annotate() pin(s)")
    return _assemble(traced, pg, costs, result, cand, spec, mbs, explain), pg.graph


def plan(model: nn.Module, spec: Any, example_inputs: tuple | None = None) -> Plan:
    """Trace, price and partition ``model`` according to ``spec``.

    Args:
        model: an ordinary ``nn.Module`` (may live on the meta device: nothing is computed).
        spec: a :class:`~fxpipe.specs.schema.ParallelSpec`, a YAML path, a bundled spec name or
            a dict.
        example_inputs: ONE micro-batch of inputs (tensor or tuple of tensors, dim 0 = batch).
            Default: taken from the spec's dataset. Costs scale linearly with the micro-batch
            size the plan chooses; the final plan is re-traced at that size.

    Returns:
        The :class:`~fxpipe.plan_data.Plan` (with ``predicted`` filled by the simulator).

    Raises:
        SpecError: bad spec. TraceError: the model cannot be traced. PlanError: no partition fits
        (e.g. device memory too small), or the model returns several tensors.
    """
    return plan_with_graph(model, spec, example_inputs)[0]


def _example_batch(spec: ParallelSpec) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Batch 0 of the spec's dataset as ``(inputs, target)``, checked.

    Raises:
        SpecError: the dataset cannot be built (see :func:`fxpipe.data_loading.make_batches`),
            or its ``get(0, "train")`` raises or does not return ``(inputs, target)`` tensors.
    """
    from fxpipe.data_loading import as_tuple, make_batches
    from fxpipe.errors import SpecError

    batches = make_batches(spec)
    where = spec_location(spec, "data.dataset")
    head = f"{where}: data.dataset" if where else "data.dataset"
    try:
        batch = batches.get(0, "train")
    except SpecError:
        raise
    except Exception as err:  # the user's get() failed
        raise SpecError(f"{head}: get(0, 'train') of the object that {spec.data.dataset} "
                        f"returned raised {type(err).__name__}: "
                        f"{' '.join(str(err).split())[:300]}; fix its get(step, split) method"
                        ) from err
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise SpecError(f"{head}: get(0, 'train') of the object that {spec.data.dataset} "
                        f"returned gave a {type(batch).__name__}, not a pair (inputs, target); "
                        "make get() return (inputs, target)")
    inputs = as_tuple(batch[0])
    if not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
        raise SpecError(f"{head}: get(0, 'train') returned inputs that are not tensors "
                        f"({', '.join(type(t).__name__ for t in inputs) or 'none'}); return a "
                        "tensor or a tuple of tensors, each [batch_size, ...]")
    if not isinstance(batch[1], torch.Tensor):
        raise SpecError(f"{head}: get(0, 'train') returned a {type(batch[1]).__name__} target; "
                        "return the target as a tensor [batch_size, ...]")
    return inputs, batch[1]


def example_microbatch(spec: ParallelSpec, size: int | None = None) -> tuple:
    """One micro-batch of real inputs from the spec's dataset (dim 0 = ``size``, default the
    spec's micro-batch size when the parallel sizes are fixed, else 1).

    Raises:
        SpecError: see :func:`_example_batch`.
    """
    if size is None:
        par = spec.parallel
        if isinstance(par.data, int) and isinstance(par.microbatches, int):
            size = spec.data.batch_size // (par.data * par.microbatches)
        else:
            size = 1
    inputs, _ = _example_batch(spec)
    return tuple(t[:size] for t in inputs)


def example_target(spec: ParallelSpec, size: int) -> torch.Tensor:
    """The targets of one micro-batch of ``size`` samples from the spec's dataset."""
    return _example_batch(spec)[1][:size]


def plan_from_spec(spec: Any) -> tuple[Plan, "nx.DiGraph"]:
    """Build the spec's model on the meta device (no weight memory) and plan it."""
    from fxpipe.specs.loader import build_model

    spec = _as_spec(spec)
    with torch.device("meta"):
        model = build_model(spec)
    inputs = tuple(t.to("meta") for t in example_microbatch(spec))
    try:
        return plan_with_graph(model, spec, inputs)
    except TraceError as e:
        shapes = ", ".join(f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}" for t in inputs)
        raise TraceError(
            f"{e}\n(the example inputs came from data.dataset {spec.data.dataset}: {shapes}; if "
            "they do not fit the model, fix the dataset or data.seq_len rather than the tracer)"
        ) from None


def materialize_stages(plan: Plan, model: nn.Module, stage_ids: list[int],
                       device: torch.device | str = "cpu") -> dict[int, nn.Module]:
    """Rebuild the stage modules ``stage_ids`` of ``plan`` from ``model`` (a worker's step 1).

    The model (already on ``device``) is traced again with zero inputs of the plan's micro-batch
    shapes on ``device``, so device-dependent constants land on the right device; the plan's node
    assignment is applied and the boundaries are checked against the plan.

    Returns stage index -> GraphModule (``forward(*inputs) -> tuple(outputs)``, parameters are the
    model's own Parameter objects under their original FQNs).

    Raises:
        PlanError: the traced graph no longer matches the plan (the model changed since planning).
    """
    from fxpipe.specs.loader import load_spec as _load

    spec = _load(plan.spec)
    inputs = []
    for name in plan.model_inputs:
        v = plan.values[name]
        inputs.append(torch.zeros(v.shape, dtype=getattr(torch, v.dtype), device=device))
    traced = trace(model, tuple(inputs), spec.model.tracer)
    node_stage = plan.stage_of_node()
    computed = {n.name for n in traced.compute_nodes()} - {"_guards_fn"}
    if set(node_stage) != computed:
        missing = sorted(set(node_stage) - computed)[:5]
        extra = sorted(computed - set(node_stage))[:5]
        raise PlanError(
            f"the model's graph differs from the plan (nodes only in the plan: {missing}, only in "
            f"the model: {extra}); re-create the plan with `fxpipe plan`"
        )
    bounds = stage_boundaries(traced.gm, node_stage, plan.num_stages)
    for sb, st in zip(bounds.stages, plan.stages):
        if sb.inputs != st.inputs or sb.outputs != st.outputs:
            raise PlanError(f"stage {st.index}'s inputs/outputs differ from the plan; re-plan")
    return {s: build_stage_module(traced.gm, bounds, s) for s in stage_ids}


def simulate_spec(spec: Any, out_dir: str | Path | None = None) -> str:
    """``fxpipe simulate``: plan the spec, then price every schedule on the same stages.

    Returns the side-by-side table (text). With ``out_dir``, writes ``simulated_<schedule>.json``
    (Chrome trace) for each schedule that applies.
    """
    from fxpipe.runtime.timeline import write_chrome_trace

    plan, _ = plan_from_spec(spec)
    lines = [plan.summary(), "",
             f"{'schedule':12s} {'step time':>12s} {'bubble':>8s} {'peak memory per stage':s}"]
    for name in SCHEDULE_NAMES:
        if name in ("interleaved", "zb-v") and plan.virtual_stages == 1:
            p2 = _replan_virtual(spec, name)
            if p2 is None:
                lines.append(f"{name:12s} {'n/a':>12s}   (needs a re-plan with 2 stages per rank)")
                continue
            target = p2
        else:
            target = plan
        try:
            res = simulate_plan(target, name)
        except (ScheduleError, PlanError) as e:
            lines.append(f"{name:12s} {'n/a':>12s}   ({e})")
            continue
        mem = ", ".join(f"{b / 2**20:.1f}" for b in res.peak_memory_bytes)
        lines.append(f"{name:12s} {res.step_time_s * 1e3:10.2f}ms {res.bubble_fraction:8.3f} "
                     f"[{mem}] MiB")
        if out_dir:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            write_chrome_trace(res.events, Path(out_dir) / f"simulated_{name}.json",
                               process_name=f"fxpipe simulated {name}")
    return "\n".join(lines)


def _replan_virtual(spec: Any, schedule: str) -> Plan | None:
    spec = _as_spec(spec)
    par = spec.parallel.model_copy(update={"schedule": schedule,
                                           "virtual_stages": 2 if schedule == "interleaved" else 1})
    try:
        return plan_from_spec(spec.model_copy(update={"parallel": par}))[0]
    except (PlanError, ScheduleError):
        return None
