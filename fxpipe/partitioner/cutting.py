"""The cut pass: one candidate layout's cut problem over the priced units (device memory,
links, node speeds) and the optimal cut that fits every rank's device, with activation
recomputation decided stage by stage."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import numpy as np

from fxpipe.errors import PlanError
from fxpipe.partitioner.pricing import Priced
from fxpipe.partitioner.problem import CutProblem, PartitionResult, Value, evaluate
from fxpipe.partitioner.search import Candidate, rank_inflight, stage_inflight
from fxpipe.partitioner.solvers import optimal_partition
from fxpipe.plans.placement import grid_slots_per_node, nodes_of_stage_rank, pair_crosses_nodes
from fxpipe.specs.schema import ParallelSpec, state_factor
from fxpipe.units import human_bytes


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

def slowdowns(spec: ParallelSpec, cand: Candidate, stage_to_rank: list[int]) -> list[float]:
    """Per stage, how much slower than ``device_tflops`` its devices compute
    (``cluster.node_tflops``; the slowest replica of the stage counts), 1 without per-node
    speeds."""
    cl = spec.cluster
    if not cl.node_tflops:
        return [1.0] * len(stage_to_rank)
    slots = grid_slots_per_node(cl.devices_per_node, cand.tensor)
    return [max(cl.device_tflops / cl.node_tflops[nd] for nd in nodes_of_stage_rank(
        r, cand.pipeline, cand.dp, slots, cand.layout)) for r in stage_to_rank]

def fastest_slowdown(spec: ParallelSpec) -> float:
    """The smallest per-stage slowdown any layout can give (:func:`slowdowns`): 1 without
    per-node speeds, else the fastest node's ``device_tflops / node_tflops``."""
    cl = spec.cluster
    if not cl.node_tflops:
        return 1.0
    return min(1.0, min(cl.device_tflops / t for t in cl.node_tflops))

def recompute_held(values: list[Value]) -> float:
    """Bytes a recomputing stage keeps per micro-batch in flight: its input, at most the
    largest value between units (the planner's memory model of recomputation)."""
    return max((v.nbytes for v in values), default=0.0)

def held_note(capacity: float, inflight: float, held: float, mbs: float, whole: bool) -> str:
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

def cut_problem(pr: Priced, spec: ParallelSpec, cand: Candidate, scale: float,
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
        held = recompute_held(values)
        if max(inflight) * held >= capacity:
            raise PlanError(held_note(capacity, max(inflight), held, scale * pr.batch, True))
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
        slowdown=slowdowns(spec, cand, stage_to_rank),
    )

class Recompute(NamedTuple):
    """Activation recomputation of one cut, stage by stage (:func:`recompute_stages`).

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

def recompute_stages(pr: Priced, spec: ParallelSpec, cand: Candidate, cuts: Sequence[int],
                      scale: float) -> Recompute:
    """Which stages of a cut recompute their activations. None in a candidate without
    recomputation and every stage with ``train.activation_recompute: on``; with ``auto`` a
    stage keeps its activations (and skips the second forward) where its rank's device still
    holds all the rank's stages: the cut was solved with every stage recomputing, and stages
    drop it rank by rank, the one saving the most time first."""
    k = cand.num_stages
    if not cand.recompute:
        return Recompute([False] * k, None, None)
    inflight, s2r = stage_inflight(cand)
    rc_problem = cut_problem(pr, spec, cand, scale)
    with_rc = evaluate(rc_problem, list(cuts), method="given")
    held = recompute_held(rc_problem.values)
    memory = [float(with_rc.memory_bytes[j]) + inflight[j] * held for j in range(k)]
    if spec.train.activation_recompute == "on":
        return Recompute([True] * k, None, memory)
    plain = evaluate(cut_problem(pr, spec, dataclasses.replace(cand, recompute=False), scale),
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
    return Recompute(flags, None if all(flags) else plain, memory)

def _rank_peak(stages: Sequence[int], tops: Sequence[Sequence[int]], static: Sequence[float],
               per_mb: Sequence[float]) -> float:
    """Peak bytes of a rank holding ``stages``: their static bytes and, at the worst moment
    (``tops``: :func:`~fxpipe.partitioner.search.rank_inflight`), the micro-batches in flight
    on each times its bytes per micro-batch."""
    return (sum(static[j] for j in stages)
            + max(sum(n * per_mb[j] for n, j in zip(top, stages)) for top in tops))

def _stage_bytes(spec: ParallelSpec, cand: Candidate, result: PartitionResult,
                 rc: Recompute) -> tuple[list[float], list[float]]:
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
                 rc: Recompute) -> str | None:
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

def solve_fitting(pr: Priced, spec: ParallelSpec, cand: Candidate, scale: float,
                   solved: dict | None = None
                   ) -> tuple[CutProblem, PartitionResult, Recompute]:
    """The candidate's optimal cut and its recomputation, such that every rank's device holds
    all of its stages: the solver bounds each stage by the device; where a rank holds several
    (interleaved, the V schedules) and they do not fit together at the rank's peak, the cut is
    solved again with each stage bounded by its share of the device (the device / stages per
    rank), first with the rank's peak in flight shared by its stages (:func:`_shared_inflight`),
    then, if that cut does not fit either, with each stage's own peak.

    Raises:
        PlanError: no cut fits.
    """
    def solve(problem: CutProblem) -> tuple[CutProblem, PartitionResult, Recompute]:
        result = (_solve_cached(problem, solved) if solved is not None
                  else optimal_partition(problem))
        return problem, result, recompute_stages(pr, spec, cand, result.cuts, scale)

    first = solve(cut_problem(pr, spec, cand, scale))
    over = _rank_memory(spec, cand, first[1], first[2])
    if over is None:
        return first
    share = cand.num_stages // cand.pipeline
    shared = _shared_inflight(cand)
    tries = [shared, None] if shared != [float(x) for x in stage_inflight(cand)[0]] else [None]
    why: str | None = None
    for inflight in tries:
        try:
            again = solve(cut_problem(pr, spec, cand, scale, share, inflight))
        except PlanError as e:
            why = why or f"{over}; with each stage held to 1/{share} of the device: {e}"
            continue
        still = _rank_memory(spec, cand, again[1], again[2])
        if still is None:
            return again
        why = why or still
    raise PlanError(why)

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

def fits_without_recompute(pr: Priced, spec: ParallelSpec, cand: Candidate,
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

def static_share(pr: Priced, spec: ParallelSpec, cand: Candidate) -> float:
    """Bytes of parameters, gradients and optimizer state the fullest rank of the candidate
    holds at least: every parameter is on some rank, so some rank holds the average share."""
    return (sum(pr.table.params) * state_factor(spec.train.optimizer, cand.sharding, cand.dp)
            / cand.pipeline)
