"""The assemble pass: a cut of the priced units -> a complete :class:`~fxpipe.plans.plan.Plan`
(stage boundaries, times, memory, tensor-parallel fields, the prediction), node by node or as
repeated blocks."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.nn as nn

from fxpipe.context.analysis import ATTENTION_OPS, Seq
from fxpipe.errors import TraceError
from fxpipe.partitioner.blocks import KEEP
from fxpipe.partitioner.boundaries import GUARDS_FN, stage_boundaries
from fxpipe.partitioner.bounds import SPLIT_BACKWARD
from fxpipe.partitioner.cut_price import cut_steps
from fxpipe.partitioner.cutting import (FULL, OFF, OFFLOAD, SELECTIVE, Recompute, cut_problem,
                                        slowdowns)
from fxpipe.partitioner.pricing import Priced, spec_ridge, unit_prefix
from fxpipe.partitioner.problem import PartitionResult
from fxpipe.partitioner.profile import send_cost_path
from fxpipe.partitioner.recompute import apply_recompute, is_clone
from fxpipe.partitioner.search import Candidate
from fxpipe.partitioner.servers import assign_servers
from fxpipe.partitioner.tensor_costs import expand_blocks
from fxpipe.plans.placement import (global_rank, grid_slots_per_node, node_of, pair_crosses_nodes,
                                    ring_crosses_nodes, stage_to_rank)
from fxpipe.plans.param_blocks import block_of
from fxpipe.plans.plan import Plan, StagePlan
from fxpipe.schedule.plan_price import predict
from fxpipe.schedule.step_price import StageStep
from fxpipe.specs.schema import ParallelSpec, stages_per_rank
from fxpipe.units import human_bytes, plural


def _slowest(stages: list[StagePlan], result: PartitionResult) -> int:
    """The bottleneck stage as planned: the solver's, unless some stages dropped
    recomputation after the solve (:func:`recompute_stages`) and another is now slower."""
    times = [st.time_s for st in stages]
    return result.bottleneck if times[result.bottleneck] >= max(times) else times.index(max(times))

def _lower_bound(result: PartitionResult, rc: Recompute) -> float:
    """Total compute per micro-batch over the stages (no cut can beat it), with the stages'
    recomputation as planned (the solver's figure counts every stage recomputing as the
    candidate does; :func:`recompute_stages` may have lowered some stages' since)."""
    mode = rc.solved or next(m for m in (FULL, SELECTIVE, OFFLOAD, OFF) if m in rc.results)
    solved = rc.results[mode]
    if all(rc.key(j) == mode for j in range(len(rc.flags))):
        return result.lower_bound_s
    was = float(sum(solved.compute_s))
    now = float(sum(rc.result(j).compute_s[j] for j in range(len(rc.flags))))
    return result.lower_bound_s * now / was if was > 0 else result.lower_bound_s

def assemble(pr: Priced, result: PartitionResult, cand: Candidate, spec: ParallelSpec,
             microbatch_size: int, explain: list[str], scale: float = 1.0) -> Plan:
    """Turn a partition of units into a Plan (stage boundaries from the traced graph), its
    stages' times, shared bytes and sends as :func:`~fxpipe.partitioner.cut_price.cut_steps`
    prices the cut (what the layout search ranked it by); the prediction is made once the plan
    is complete (:func:`fxpipe.partitioner.driver.finish_plan`).

    ``scale`` (micro-batch size / traced batch size) scales times and value bytes for a
    micro-batch size other than the traced one (the chosen plan is traced at its own: 1).
    Rewrites ``traced.gm`` so that each stage rebuilds the ``cheap`` values it reads
    (:func:`~fxpipe.partitioner.recompute.apply_recompute`)."""
    traced, pg, costs, cheap = pr.traced, pr.pg, pr.costs, pr.cheap
    g = pg.graph
    # priced before the graph is rewritten (the copies of rebuilt values are priced from the
    # cones of the graph as traced)
    steps = cut_steps(pr, unit_prefix(pr), cut_problem(pr, spec, cand, scale), result, cand,
                      spec, scale)
    node_stage: dict[str, int] = {}
    for pos, stage in enumerate(result.stage_of()):
        for member in g.nodes[pg.order[pos]]["members"]:
            node_stage[member] = stage
    recomputed: dict[str, list[int]] = {}
    if cheap:
        for name in sorted(cheap):
            s = node_stage.get(name)
            readers = {node_stage[u.name] for u in traced.node(name).users
                       if node_stage.get(u.name, s) != s}
            if s is not None and readers:
                recomputed[name] = sorted(readers)
        node_stage = apply_recompute(traced.gm, recomputed, node_stage)
        costs = dict(costs)
        for n in node_stage:
            if is_clone(n):
                costs[n] = costs[n.rsplit("__r", 1)[0]]
    bounds = stage_boundaries(traced.gm, node_stage, cand.num_stages)
    slow = slowdowns(spec, cand, stage_to_rank(cand.schedule, cand.pipeline, cand.num_stages))
    rc = steps.recompute
    stages = []
    for j, sb in enumerate(bounds.stages):
        nodes = [n for n in sb.nodes if n in costs]
        fwd = scale * float(sum(costs[n].fwd_flops for n in nodes))
        bwd = scale * float(sum(costs[n].bwd_flops for n in nodes))
        bwd_w = scale * float(sum(costs[n].bwd_weight_flops for n in nodes))
        loss_s = (pr.loss.total_s * scale * slow[j] if pr.loss.total_s > 0
                  and j == cand.num_stages - 1 else 0.0)
        stages.append(_stage_plan(j, steps.stages[j], result, rc, pr.ridge, loss_s,
                                  nodes=list(sb.nodes), params=list(sb.params),
                                  buffers=list(sb.buffers), inputs=list(sb.inputs),
                                  outputs=list(sb.outputs), fwd_flops=fwd, bwd_flops=bwd,
                                  bwd_weight_flops=bwd_w))
    values = {k: dataclasses.replace(v, nbytes=0 if k in cheap else int(v.nbytes * scale))
              for k, v in bounds.values.items()}
    plan = Plan(
        model=traced.model_name or type(traced.gm).__name__,
        num_stages=cand.num_stages, pipeline=cand.pipeline, dp=cand.dp, context=cand.context,
        microbatches=cand.microbatches, schedule=cand.schedule,
        virtual_stages=stages_per_rank(cand.schedule, cand.virtual_stages),
        microbatch_size=microbatch_size, stages=stages, values=values,
        model_inputs=list(bounds.model_inputs), model_output=bounds.model_outputs[0],
        shared_params=dict(bounds.shared_params), param_aliases=dict(bounds.param_aliases),
        bottleneck_stage=_slowest(stages, result),
        lower_bound_s=_lower_bound(result, rc),
        explain=list(explain), spec=spec, recomputed=recomputed,
        placement=cand.layout, data_sharding=cand.sharding,
    )
    _set_tensor(plan, pr, steps.tensor_comms)
    _set_experts(plan, pr, spec)
    _set_context(plan, pr, spec)
    plan.explain += _selective_keeps_nothing(rc, pr.ridge)
    return plan


def _stage_plan(j: int, step: StageStep, result: PartitionResult, rc: Recompute, ridge: float,
                loss_s: float, **fields) -> StagePlan:
    """Stage ``j`` of a cut: its times, shared bytes, activation bytes and sends as ``step``
    priced them, its parameter and message bytes from the solved cut, its peak bytes and
    recomputation (off, selective at ``ridge`` or at the stage's higher keep threshold, full)
    from ``rc``."""
    recompute = rc.flags[j]
    memory = rc.memory[j] if rc.memory is not None else rc.result(j).memory_bytes[j]
    compute = step.fwd_s + step.bwd_input_s + step.bwd_weight_s
    return StagePlan(
        index=j, **fields,
        param_bytes=round(step.param_bytes), activation_bytes=int(step.activation_bytes),
        recv_bytes=int(result.recv_bytes[j]), send_bytes=int(result.send_bytes[j]),
        compute_time_s=compute, comm_time_s=result.comm_s[j],
        time_s=compute + result.comm_s[j], memory_bytes=int(memory),
        fwd_time_s=step.fwd_s, bwd_input_time_s=step.bwd_input_s,
        bwd_weight_time_s=step.bwd_weight_s, send_time_s=step.send_s,
        grad_send_time_s=step.grad_send_s, recompute=recompute in (SELECTIVE, FULL),
        keep_ridge=(rc.ridge(j) or ridge) if recompute == SELECTIVE else None,
        recompute_blocks=rc.blocks(j),
        offload_bytes=int(rc.host_bytes(j)), loss_time_s=float(loss_s),
        shared_bytes=int(step.shared_bytes), tied_bytes=int(step.tied_bytes),
        expert_bytes=int(step.expert_bytes),
        param_gather="block" if step.gather_rows else "stage",
        gather_groups=[[float(x) for x in r] for r in step.gather_rows])

def _selective_keeps_nothing(rc: Recompute, ridge: float) -> list[str]:
    """Stages recomputing selectively whose ops keep nothing (none reaches the ridge point):
    they recompute their whole forward, as full recomputation does."""
    idx = [j for j, f in enumerate(rc.flags)  # (at the ridge point: above it, its own note)
           if f == SELECTIVE and not rc.ridge(j) and float(rc.result(j).saved_bytes[j]) == 0.0]
    if not idx:
        return []
    return [f"selective recomputation keeps no op's outputs on stage"
            f"{'s' if len(idx) > 1 else ''} {', '.join(map(str, idx))}: no matmul-like op there "
            f"reaches the ridge point ({ridge:.3g} FLOP per byte of output), so "
            f"{'each' if len(idx) > 1 else 'it'} runs its "
            "whole forward again, as full recomputation does"]

def recompute_notes(plan: Plan, asked: str) -> list[str]:
    """What the plan's stages recompute and why (``asked``: ``train.activation_recompute``)."""
    out = []
    modes = [st.recompute_mode for st in plan.stages]
    ridge = spec_ridge(plan.spec) if plan.spec is not None else None
    # one line per keep threshold of the selective stages: the ridge point's first
    thresholds = sorted({st.keep_ridge for st in plan.stages if st.recompute_mode == "selective"},
                        key=lambda t: (ridge is None or not _above(t, ridge), t))
    groups = [("full", None, "each keeps only its inputs per micro-batch in flight and "
               "runs its forward again in the backward")]
    for t in thresholds:
        above = ridge is not None and _above(t, ridge)
        groups.append(("selective", t, "each keeps its inputs and the outputs of its matmul-like "
                       "ops whose FLOPs per output byte reach "
                       + (f"{t:.3g} FLOP per byte of output ({t / ridge:.3g}x the device's "
                          f"ridge point, {ridge:.3g})" if above else
                          f"the device's ridge point ({t:.3g} FLOP per byte of output)")
                       + " per micro-batch in flight, and runs its other ops (element-wise, "
                       "norms, softmax, " + ("matmuls below that threshold, such as an "
                                             "unfused attention's scores" if above else
                                             "low-intensity matmuls")
                       + ") again in the backward"))
    groups.append(("partial", None, "each recomputes its first blocks "
                   f"({_partial_blocks(plan)}): keeps its inputs, the values its later "
                   "blocks read from them and its later blocks' activations per micro-batch "
                   "in flight, and runs its first blocks' forward again in the backward"
                   if "partial" in modes else ""))
    for mode, t, what in groups:
        idx = [j for j, m in enumerate(modes) if m == mode
               and (t is None or plan.stages[j].keep_ridge == t)]
        if not idx:
            continue
        every = len(idx) == plan.num_stages
        why = (f"train.activation_recompute: {asked}" if asked != "auto" else
               "the activations of the micro-batches in flight would not fit cluster.memory_gb"
               + ("" if every else "; the other stages recompute less"))
        if t is not None and ridge is not None and _above(t, ridge):
            why += ("; what the ops reaching the ridge point keep would not fit "
                    "cluster.memory_gb on the rank, so the ops with the least FLOPs per byte "
                    "kept are recomputed too")
        where = ("every stage" if every and len(idx) > 1 else
                 f"stage{'s' if len(idx) > 1 else ''} {', '.join(map(str, idx))}")
        if len(idx) == 1 and what.startswith("each "):  # one stage: "it", not "each"
            what = "it " + what[len("each "):]
        name = {"full": "activation recomputation", "selective": "selective recomputation",
                "partial": "partial recomputation"}[mode]
        if mode == "partial" and asked == "auto" and plan.spec.train.recompute_layers is None:
            why = ("the activations of the micro-batches in flight would not fit "
                   "cluster.memory_gb; the fewest first blocks that fit, the rest kept")
        elif mode == "partial":
            why = (f"train.recompute_layers: {plan.spec.train.recompute_layers}; stages with "
                   "that many blocks or fewer recompute whole")
        out.append(f"{name} on {where}: {what} ({why})")
    return out + _unused_layers_note(plan, asked)

def _unused_layers_note(plan: Plan, asked: str) -> list[str]:
    """Where ``train.recompute_layers`` is set but no stage recomputes partially, why it went
    unused: no stage recomputes fully, or every stage that does has that many blocks or fewer
    (it recomputes whole), or (under ``auto``) recomputing only its first blocks would not
    fit or would not run less again."""
    n = plan.spec.train.recompute_layers if plan.spec is not None else None
    modes = [st.recompute_mode for st in plan.stages]
    if n is None or "partial" in modes:
        return []
    head = f"train.recompute_layers: {n} unused: "
    full = [j for j, m in enumerate(modes) if m == "full"]
    if not full:
        if any(m == "selective" for m in modes):
            return [head + "the stages that recompute do so selectively, and recompute_layers "
                    "counts the blocks of stages that recompute fully"]
        why = ("the activations of the micro-batches in flight fit cluster.memory_gb"
               if asked == "auto" else f"train.activation_recompute: {asked}")
        return [head + f"no stage recomputes ({why})"]
    counts = {j: _stage_blocks(plan, j) for j in full}
    small = [j for j in full if counts[j] <= n]
    out = []
    if small:
        most = max(counts[j] for j in small)
        where = ("every stage" if len(small) == plan.num_stages else
                 "every stage that recomputes fully" if len(small) == len(full) else
                 f"stage{'s' if len(small) > 1 else ''} {', '.join(map(str, small))}")
        one = len(small) == 1 or where.startswith("every")
        out.append(f"{where} {'has' if one else 'have'} {n} "
                   f"block{'s' if n != 1 else ''} or fewer (the most: {most}), so "
                   f"{'it recomputes' if len(small) == 1 else 'each recomputes'} whole")
    rest = [j for j in full if counts[j] > n]
    if rest:
        out.append(f"stage{'s' if len(rest) > 1 else ''} {', '.join(map(str, rest))} "
                   f"recompute{'s' if len(rest) == 1 else ''} whole: recomputing only the "
                   f"first {n} blocks would not fit cluster.memory_gb or would not run less "
                   "forward again")
    return [head + "; ".join(out)]

def _above(threshold: float, ridge: float) -> bool:
    """Whether a stage's keep threshold is above the device's ridge point (not the ridge
    itself, as recorded: the same float, or within its printing)."""
    return threshold > ridge * (1 + 1e-9)

def _partial_blocks(plan: Plan) -> str:
    """``N of M blocks`` per partially recomputing stage (M: the stage's blocks)."""
    out = []
    for j, st in enumerate(plan.stages):
        if st.recompute_mode == "partial":
            out.append(f"stage {j}: {st.recompute_blocks} of {_stage_blocks(plan, j)}")
    text = ", ".join(out[:4]) + (" ..." if len(out) > 4 else "")
    if not plan.folded and sum(_stage_blocks(plan, j) for j in range(plan.num_stages)) > len(
            {b for st in plan.stages for b in map(block_of, st.params) if b is not None}):
        text += " blocks; a block split by a cut counts on both of its stages"
    return text

def _stage_blocks(plan: Plan, j: int) -> int:
    """How many blocks stage ``j`` holds (by its parameters' module paths; a plan made of
    folded blocks: by its record)."""
    if plan.folded:
        return sum(1 for s in plan.folded["blocks"] if s == j)
    return len({b for b in map(block_of, plan.stages[j].params) if b is not None})

def offload_notes(plan: Plan) -> list[str]:
    """Which stages offload their activations to host memory, what crosses the host link and
    why (``train.activation_offload``)."""
    idx = [j for j, st in enumerate(plan.stages) if st.offload_bytes]
    if not idx:
        t = plan.spec.train if plan.spec is not None else None
        if t is not None and t.activation_offload == "auto" and t.activation_recompute in (
                "on", "full", "selective"):
            return [f"train.activation_offload: auto unused: train.activation_recompute: "
                    f"{t.activation_recompute} has every stage recompute its activations, so "
                    "offloading them was not weighed (activation_recompute: auto weighs "
                    "offloading against recomputing, stage by stage)"]
        return []
    cl, asked = plan.spec.cluster, plan.spec.train.activation_offload
    every = len(idx) == plan.num_stages
    where = "every stage" if every else f"stage{'s' if len(idx) > 1 else ''} " + ", ".join(
        map(str, idx))
    per = ", ".join(f"{human_bytes(plan.stages[j].offload_bytes, True)}"
                    + ("" if len(idx) == 1 else f" (stage {j})") for j in idx[:4])
    moves = "out after F, back before B and again before W" if plan.schedule in SPLIT_BACKWARD \
        else "out after F, back before B"
    why = ("train.activation_offload: on" if asked == "on" else
           "the activations of the micro-batches in flight would not fit cluster.memory_gb"
           + (" and train.activation_recompute is off"
              if plan.spec.train.activation_recompute == "off"
              else ", and moving them was faster than recomputing them"))
    return [f"activation offload on {where}: per micro-batch {per}{' ...' if len(idx) > 4 else ''}"
            f" of saved activations cross the host link at {cl.host_Bps / 1e9:.3g} GB/s "
            f"({moves}; priced in the stage's times) and wait in host memory "
            f"(cluster.host_memory_gb {cl.host_memory_gb:g} per node, "
            f"{human_bytes(cl.host_bytes_per_device or 0, True)} per device) ({why})"]

def _set_experts(plan: Plan, pr: Priced, spec: ParallelSpec) -> None:
    """The plan's expert-parallel degree and what it says (:mod:`fxpipe.experts`)."""
    n = spec.parallel.expert
    if n <= 1 or pr.expert_bytes is None:
        return
    plan.expert = n
    fo = pr.table.folding  # priced on two of the repeated blocks: every block's
    scale = fo.run.count / 2 if fo is not None else 1.0
    fwd, bwd = (b * scale for b in pr.expert_bytes)
    plan.expert_bytes = [fwd, bwd]
    groups = plan.dp // n
    plan.explain.append(
        f"expert parallelism {n}: each MoE layer's experts split over groups of {n} "
        f"data-parallel replicas ({groups} group{'s' if groups > 1 else ''} per pipeline "
        f"stage); per micro-batch one replica's stages send the tokens to their experts and "
        f"back by all-to-all, {human_bytes(fwd, True)} forward and {human_bytes(bwd, True)} "
        f"backward of whole tensors (fp32 as traced; each rank sends ({n}-1)/{n} of its "
        "stage's share; dropless experts, if any, priced at balanced routing), added to the "
        f"stages' compute time; the experts' weights, gradients and optimizer state cost 1/{n} on each rank; "
        "under tensor parallelism the experts run whole on each tensor rank")


def _set_context(plan: Plan, pr: Priced, spec: ParallelSpec) -> None:
    """The plan's context-parallel fields and what it says (:mod:`fxpipe.context`)."""
    n, split = plan.context, pr.context_split
    if n <= 1 or split is None:
        return
    fo = pr.table.folding  # priced on two of the repeated blocks: every block's
    scale = fo.run.count / 2 if fo is not None else 1.0
    fwd, bwd = (b * scale for b in pr.context_bytes)
    plan.context_bytes = [fwd, bwd]
    ring = bool(split.rings())
    plan.context_attention = "ring" if ring else "all-gather"
    if spec.parallel.context_attention == "ring":
        attn = [x.name for x in pr.traced.gm.graph.nodes if x.target in ATTENTION_OPS]
        if len(split.rings()) < len(attn) or not attn:
            plan.explain.append(
                f"context_attention: ring: {len(split.rings())} of {len(attn)} attention layers "
                "run as ring attention; the others all-gather their keys and values (ring needs "
                "scaled_dot_product_attention without dropout, with any mask split only by "
                "its query rows; attention written as matmuls is all-gathered)")
    for name, v in plan.values.items():  # what a rank sends of a split value
        if isinstance(split.place(name), Seq):
            plan.values[name] = dataclasses.replace(v, nbytes=v.nbytes // n)
    gathers = sorted({value for _, value, _ in split.gathers()})
    h = split.seq // (2 * n)
    if ring:
        how = (f"attention runs as ring attention: each rank passes its keys and values to the "
               f"next while a block computes, per micro-batch one replica's stages send "
               f"{human_bytes(fwd, True)} forward and {human_bytes(bwd, True)} backward (the "
               "blocks again and their gradients); exposed where a message outlasts its "
               "block; only each rank's own keys and values are kept for the backward")
    else:
        how = (f"per micro-batch one replica's stages all-gather {human_bytes(fwd, True)} of "
               f"keys and values along the sequence forward and reduce-scatter "
               f"{human_bytes(bwd, True)} of their gradients backward (whole tensors as traced; "
               f"each rank receives ({n}-1)/{n}), added to the attention layers' time, not "
               "overlapped; the gathered keys and values are held whole until the backward")
    plan.explain.append(
        f"context parallelism {n}: each micro-batch's {split.seq}-token sequences split over "
        f"{n} ranks (two chunks of {h} tokens each, a head and the mirrored tail, so causal "
        f"attention costs every rank the same); {how}; activations and the work of every "
        f"token-local layer cost 1/{n} per rank; the ranks of a context group are replicas "
        f"that share samples: gradients averaged over {plan.replicas} replicas"
        + (f"; gathered: {', '.join(gathers[:4])}{' ...' if len(gathers) > 4 else ''}"
           if gathers else ""))


def _set_tensor(plan: Plan, pr: Priced, comms: list[list] | None) -> None:
    """The plan's tensor-parallel fields from the priced units' sharding, and what it says:
    how many parameters are split how, what stays whole, and the collectives per micro-batch
    (``comms``: per stage, as the cut was priced)."""
    tp = pr.tensor
    if tp is None:
        return
    plan.tensor, plan.sequence_parallel, plan.tp_overlap = tp.t, tp.sequence_parallel, tp.overlap
    text = tp.placements_text()
    fo = pr.table.folding
    if fo is not None:  # names of the reduced trace -> every block of the full model
        text = {fo.run.full_name(k): v for k, v in text.items()}
        text = expand_blocks(text, fo.run.prefix, fo.run.start, fo.run.count)
    plan.tensor_params = dict(sorted(text.items()))
    plan.tensor_replicated = tp.replicated()
    for st, mine in zip(plan.stages, comms or []):
        st.tensor_collectives = len(mine)
        st.tensor_bytes = [float(sum(c.nbytes for c in mine if c.phase == "fwd")),
                           float(sum(c.nbytes for c in mine if c.phase == "bwd"))]
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
    plan.explain += overlap_notes(tp)


def overlap_notes(tp) -> list[str]:
    """What ``parallel.tp_overlap`` did in this plan (nothing to say at 1 unless ``auto``
    chose it)."""
    k, comm = tp.overlap, sum(f + b for f, b in tp.comm_s.values())
    if tp.asked == "auto" and k == 1:
        return ["parallel.tp_overlap auto: 1 (no overlap); running the tensor-parallel "
                "collectives in 2, 4 or 8 chunks beside their matmuls would cost more launches, "
                "copies and per-message latency than it hides here"]
    if k == 1:
        return []
    head = f"parallel.tp_overlap {k}" + (" (auto)" if tp.asked == "auto" else "")
    if not tp.sites:
        return [f"{head} has no effect: no tensor-parallel matmul here has a token dimension "
                f"divisible by {k} (per rank under sequence parallelism); they run whole"]
    saved = sum(f + b for f, b in tp.hidden_s.values())
    what = (f"saving {saved * 1e3:.3g} ms of the {comm * 1e3:.3g} ms of tensor-parallel "
            "communication per micro-batch" if saved >= 0 else
            f"costing {-saved * 1e3:.3g} ms per micro-batch more than running them whole (of "
            f"{comm * 1e3:.3g} ms of tensor-parallel communication; the chunks' launches, copies "
            "and per-message latency outweigh what they hide: use 1 or auto)")
    return [f"{head}: the collectives of {len(tp.sites)} matmul sites run in {k} chunks beside "
            f"their matmuls (async tensor parallelism), {what}; the others (embedding, loss, "
            f"matmuls without a token dimension divisible by {k}) run whole"]

def folded_record(pr: Priced, stage_of: list[int]) -> dict:
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

def assemble_folded(pr: Priced, result: PartitionResult, cand: Candidate, spec: ParallelSpec,
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
    record = folded_record(pr, stage_of)
    prefix = unit_prefix(pr)
    cuts = list(result.cuts) + [len(tb.names)]
    fl = np.concatenate([np.zeros((3, 1)), np.cumsum(np.asarray(tb.flops, dtype=np.float64).T
                                                      .reshape(3, -1), axis=1)], axis=1)
    slow = slowdowns(spec, cand, stage_to_rank(cand.schedule, cand.pipeline, cand.num_stages))
    problem = cut_problem(pr, spec, cand, 1.0)
    steps = cut_steps(pr, prefix, problem, result, cand, spec, 1.0)
    rc = steps.recompute
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
        ff, bf, wf = (fl[:, b] - fl[:, a])
        loss_s = pr.loss.total_s * slow[j] if j == cand.num_stages - 1 else 0.0
        stages.append(_stage_plan(j, steps.stages[j], result, rc, pr.ridge, loss_s, nodes=[],
                                  params=list(dict.fromkeys(params)),
                                  buffers=list(dict.fromkeys(buffers)), inputs=[], outputs=[],
                                  fwd_flops=float(ff), bwd_flops=float(bf),
                                  bwd_weight_flops=float(wf)))
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
        dp=cand.dp, context=cand.context, microbatches=cand.microbatches,
        schedule=cand.schedule,
        virtual_stages=stages_per_rank(cand.schedule, cand.virtual_stages),
        microbatch_size=mbs, stages=stages, values=values,
        model_inputs=list(one.model_inputs), model_output=one.model_outputs[0],
        shared_params={k: v for k, v in users.items() if len(v) > 1},
        param_aliases={run.full_name(a): run.full_name(c) for a, c in one.param_aliases.items()},
        bottleneck_stage=_slowest(stages, result),
        lower_bound_s=_lower_bound(result, rc), explain=explain, spec=spec,
        folded=record, placement=cand.layout, data_sharding=cand.sharding,
    )
    _set_tensor(plan, pr, steps.tensor_comms)
    _set_experts(plan, pr, spec)
    _set_context(plan, pr, spec)
    plan.explain += _selective_keeps_nothing(rc, pr.ridge)
    # a plan of blocks names no values between its stages until a worker resolves it: the
    # bytes on each stage edge are recorded (what Plan.edge_bytes gives for it)
    fwd, grad = steps.edge_bytes()
    plan.folded["edges"] = [[a, b, int(n), int(grad.get((a, b), 0))]
                            for (a, b), n in sorted(fwd.items())]
    return plan

def placement_note(plan: Plan, spec: ParallelSpec) -> str:
    """Which groups the chosen layout keeps inside a node, and which cross nodes."""
    dpn = grid_slots_per_node(spec.cluster.devices_per_node, plan.tensor)
    p, d = plan.pipeline, plan.replicas
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


def model_notes(pr: Priced, model: nn.Module, mbs: int) -> list[str]:
    """What the plan's explanation says about the model itself: the user's markers and pins it
    honoured, BatchNorm's statistics over micro-batches."""
    traced, out = pr.traced, []
    if traced.pins or traced.split_after:
        out.append(f"honoured {plural(len(traced.split_after), 'pipe_split() marker')} and "
                   f"{plural(len(set(traced.pins.values())), 'annotate() pin')}")
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        out.append(f"BatchNorm: statistics are computed over each micro-batch of "
                   f"{plural(mbs, 'sample')}, as in GPipe, not over the whole batch; "
                   "everything else equals single-process training")
    return out


def finish_plan(plan: Plan, pr: Priced, spec: ParallelSpec, model: nn.Module, kwargs: dict,
                traced_on: str) -> None:
    """Complete an assembled plan: the parameter servers of async updates, every trained
    parameter's shape, the prediction (once, by the one pricing rule), the explanation's
    notes, and what
    the workers need to call the model.

    Raises:
        TraceError: a keyword input is not an input of the traced graph.
    """
    if spec.train.updates == "async":
        assign_servers(plan, {n: p.numel() * p.element_size()
                              for n, p in model.named_parameters(remove_duplicate=False)}, spec)
    # every trained parameter's shape: PowerSGD prices each matrix's low-rank factors,
    # sharding the slices; the state each rank holds (fxpipe.plans.state_bytes) reads them
    plan.param_shapes = {n: list(p.shape) for n, p in model.named_parameters(
        remove_duplicate=False) if p.requires_grad}  # tied aliases too (stages name them)
    plan.param_itemsize = next((p.element_size() for p in model.parameters()
                                if p.requires_grad), 4)
    plan.predicted = predict(plan)
    if spec.cluster.nodes > 1:
        plan.explain.append(placement_note(plan, spec))
    if (spec.cluster.costs == "measured" and plan.num_stages > 1
            and pr.send.method is None and torch.device(spec.cluster.device).type == "cpu"):
        cached = send_cost_path(spec.cluster.device)
        why = (f"its cache {cached} is damaged or from an older fxpipe" if cached.exists()
               else "not measured on this machine")
        plan.explain.append(f"send cost: {why}, so the default (a fixed overhead plus the "
                            "bytes at cluster.memory_GBps), which prices gloo sends low; "
                            "`fxpipe profile SPEC` measures it")
    plan.explain += recompute_notes(plan, spec.train.activation_recompute)
    plan.explain += offload_notes(plan)
    if plan.recomputed:
        plan.explain.append("recomputed in each stage that reads them (cheaper than sending): "
                            + ", ".join(f"{v} ({human_bytes(nbytes)}) in stages "
                                        f"{', '.join(map(str, s))}"
                                        for v, s in plan.recomputed.items()
                                        for nbytes in [pr.pg.value_info(v)[2]]))
    plan.input_kwargs = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    plan.traced_on = traced_on
    missing = [k for k in plan.input_kwargs if k not in plan.model_inputs]
    if missing:
        raise TraceError(f"keyword inputs {missing} do not appear as inputs of the traced graph "
                         f"(its inputs: {plan.model_inputs}); pass them by their forward() names")
