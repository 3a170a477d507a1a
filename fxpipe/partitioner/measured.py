"""``cluster.measure_stages``: the planned cut's stages timed whole and the cut moved where
they disagree with the per-node sums (:mod:`fxpipe.partitioner.refine` decides)."""

from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np
import torch
import torch.nn as nn

from fxpipe.execution.compiled_stage import compiled_rewrite, resolve_compile
from fxpipe.execution.grad_fusion import fuse_weight_grads
from fxpipe.partitioner.assemble import folded_record
from fxpipe.partitioner.blocks import resolve_folded
from fxpipe.partitioner.cut_price import simulate_cut
from fxpipe.partitioner.cutting import cut_problem
from fxpipe.partitioner.pricing import Priced, tensor_inputs, unit_prefix
from fxpipe.partitioner.problem import CutProblem, PartitionResult, evaluate
from fxpipe.partitioner.profile import profile_key
from fxpipe.partitioner.refine import MAX_CUTS, MAX_RIVALS, NEAR, refine_cuts
from fxpipe.partitioner.search import Candidate
from fxpipe.partitioner.solvers import optimal_partition
from fxpipe.partitioner.stage_timing import (StageTimes, side_by_side_groups, stage_times_key,
                                             time_stages)
from fxpipe.partitioner.timing import NodeTimes, sum_times
from fxpipe.partitioner.trace import TracedModel, trace
from fxpipe.plans.placement import global_rank, grid_slots_per_node, node_of, stage_to_rank
from fxpipe.schedule.lowering import compute_schedule
from fxpipe.specs.schema import ParallelSpec
from fxpipe.units import plural

_progress = logging.getLogger("fxpipe.progress")


#: ``cluster.measure_stages`` is skipped when timing the stages would take longer than this
#: (estimated from the profile: one whole forward and backward per round and cut)
REFINE_BUDGET_S = 60.0

#: rounds of the timing that decides between the visited cuts and their near ties, all side by
#: side: they are often within a few percent of each other, and a median of 7 rounds moves by
#: about that much on a shared CPU; more rounds than the timings that only steer the search
DECIDING_ROUNDS = {"min_rounds": 15, "max_rounds": 61, "min_time_s": 2.0}

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
    ``times``; the loss is added back, and node by node (what :func:`assemble` sums) each
    unit's members are scaled to its new times."""
    t = np.asarray(times, dtype=np.float64).reshape(-1, 3).copy()
    lu = _loss_unit(pr)
    if lu is not None:
        t[lu] += _loss_row(pr)
    rows = [tuple(float(x) for x in r) for r in t]
    # the forward seconds selective recomputation runs again scale with the unit's forward
    sel = [(again * (new[0] / old[0] if old[0] > 0 else 1.0), kept)
           for (again, kept), new, old in zip(pr.table.selective, rows, pr.table.times)]
    table = dataclasses.replace(pr.table, times=rows, selective=sel)
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
        return resolve_folded(folded_record(pr, stage_of), full)
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
    nodes = [node_of(global_rank(r, 0, cand.pipeline, cand.replicas, cand.layout),
                     grid_slots_per_node(cl.devices_per_node, cand.tensor))
             for r in range(cand.pipeline)]
    if len(set(nodes)) == len(nodes):
        return None
    return stage_to_rank(cand.schedule, cand.pipeline, cand.num_stages), nodes

def refine_by_stages(pr: Priced, spec: ParallelSpec, cand: Candidate, result: PartitionResult,
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
    # train.compile: the stages are timed compiled, as the ranks will run them (compiled in
    # the untimed warm-up rounds)
    compiled = resolve_compile(spec.train.compile, spec.train.cuda_graphs,
                               torch.device(cl.device))
    fuse = fuse and not compiled.on
    rewrite = (compiled_rewrite(compiled) if compiled.on
               else fuse_weight_grads if fuse else None)

    last: dict = {}

    def problem_of(times: np.ndarray) -> tuple[Priced, CutProblem]:
        key = np.asarray(times, dtype=np.float64).tobytes()
        if last.get("key") != key:  # the near-tie scan prices many cuts under one calibration
            p2 = _with_unit_times(pr, times)
            last.update(key=key, built=(p2, cut_problem(p2, spec, cand, 1.0)))
        return last["built"]

    def solve(times: np.ndarray) -> list[int]:
        return list(optimal_partition(problem_of(times)[1]).cuts)

    def step_s(times: np.ndarray, cuts) -> float:
        p2, prob = problem_of(times)
        res = evaluate(prob, list(cuts), method="given")
        if res.violations:  # memory, a pin or a pipe_split() marker: not a cut to take
            return math.inf
        return simulate_cut(p2, unit_prefix(p2), prob, res, cand, spec, 1.0).step_time_s

    beside = _ranks_beside(spec, cand)
    ranks, nodes = beside if beside is not None else (None, None)
    groups = side_by_side_groups(ranks, nodes) if ranks is not None else None
    store = StageTimes(stage_times_key(profile_key(pr.traced, cl.device, spec.train.precision),
                                       list(pr.table.names),
                                       f"fuse={fuse};compile={compiled.on}"
                                       f"{';graphs' if compiled.cuda_graphs else ''};"
                                       f"beside={groups};"
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
            timer["inputs"] = dict(zip(full.input_names, tensor_inputs(args, kwargs)))
        full = timer["full"]
        assigns = [_node_stages(pr, c, full) for c in cut_list]
        return time_stages(full.gm, assigns, cand.num_stages, timer["inputs"], cl.device,
                           rewrite=rewrite, ranks=ranks,
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
    res2 = evaluate(cut_problem(pr2, spec, cand, 1.0), list(ref.cuts), method="given")
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
