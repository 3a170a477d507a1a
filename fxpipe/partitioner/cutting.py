"""The cut pass: one candidate layout's cut problem over the priced units (device memory,
links, node speeds) and the optimal cut that fits every rank's device, with activation
recomputation decided stage by stage."""

from __future__ import annotations

import dataclasses
import itertools
from typing import NamedTuple, Sequence

import numpy as np

from fxpipe.errors import PlanError
from fxpipe.partitioner.bounds import SPLIT_BACKWARD
from fxpipe.partitioner.expert_state import memory_params
from fxpipe.partitioner.partial import explicit, partial_options, scaled
from fxpipe.partitioner.gathering import factor, gathered_bound, static_fixed
from fxpipe.partitioner.pricing import Priced, selective_at, selective_levels
from fxpipe.partitioner.problem import CutProblem, PartitionResult, Value, evaluate
from fxpipe.partitioner.search import Candidate, rank_inflight, stage_inflight
from fxpipe.partitioner.solvers import optimal_partition
from fxpipe.plans.placement import grid_slots_per_node, nodes_of_stage_rank, pair_crosses_nodes
from fxpipe.specs.schema import ParallelSpec
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
        elif pair_crosses_nodes(a, b, cand.pipeline, cand.replicas, dpn, cand.layout):
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
        r, cand.pipeline, cand.replicas, slots, cand.layout)) for r in stage_to_rank]

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

def stage_inputs(pr: Priced, cuts: Sequence[int], scale: float) -> list[float]:
    """Per stage of a cut, the bytes per micro-batch of what it reads from outside: the values
    other stages make and the model inputs its units read (what a recomputing stage keeps for
    its second forward; the inputs of values a stage rebuilds are not counted), at ``scale`` x
    the traced micro-batch."""
    ends = list(cuts[1:]) + [len(pr.table.names)]
    stage_of = np.zeros(len(pr.table.names), dtype=np.int64)
    for j, (a, b) in enumerate(zip(cuts, ends)):
        stage_of[a:b] = j
    out = [0.0] * len(cuts)
    for v in pr.table.values:
        src = int(stage_of[v.producer]) if v.producer >= 0 else -1
        for j in {int(stage_of[u]) for u in v.users} - {src}:
            out[j] += v.nbytes * scale
    fo = pr.table.folding
    for name, positions in pr.pg.input_users.items():  # the model inputs a unit reads
        units = {p if fo is None else fo.folded_pos(p) for p in positions} - {None}
        nbytes = pr.pg.value_info(name)[2] * scale
        for j in {int(stage_of[u]) for u in units}:
            out[j] += nbytes
    return out

def sends_released(spec: ParallelSpec) -> bool:
    """Whether a stage's outputs that only other ranks read stop counting per micro-batch in
    flight. The runtime lets go of such an output's data once it is sent
    (:meth:`~fxpipe.runtime.stage.StageWork.sent`: B starts from its graph), so only the send
    holds it, until finished. On CUDA (NCCL) a completed send is finished at the rank's next
    send, during the step: counted as gone, assuming a send completes before the stage's next
    micro-batch's forward ends (one micro-batch's outputs in transit, not counted). On CPU
    (gloo) a send reports completion only once waited: it is finished when the consumer's
    gradient for that micro-batch arrives, before the stage's B, so there the outputs count
    per micro-batch in flight, as if held until B."""
    return spec.cluster.device == "cuda"

def output_ranks(spec: ParallelSpec, cand: Candidate) -> list[int] | None:
    """The ``stage_to_rank`` that :func:`stage_outputs` takes where sent outputs are released
    (:func:`sends_released`), else None (every output held until B)."""
    return stage_inflight(cand)[1] if sends_released(spec) else None

def stage_outputs(pr: Priced, cuts: Sequence[int], scale: float,
                  stage_to_rank: Sequence[int] | None = None) -> list[float]:
    """Per stage of a cut, the bytes per micro-batch of the values it makes that other stages
    read, at ``scale`` x the traced micro-batch: the runtime holds a stage's outputs from its
    forward until its backward (B starts from them). ``stage_to_rank`` (where sent outputs are
    released, :func:`sends_released`): only the values some stage of the producer's own rank
    reads (handed over in memory, they are that stage's input) count; those only other ranks
    read are let go once sent."""
    ends = list(cuts[1:]) + [len(pr.table.names)]
    stage_of = np.zeros(len(pr.table.names), dtype=np.int64)
    for j, (a, b) in enumerate(zip(cuts, ends)):
        stage_of[a:b] = j
    out = [0.0] * len(cuts)
    for v in pr.table.values:
        if v.producer < 0:
            continue
        src = int(stage_of[v.producer])
        readers = {int(stage_of[u]) for u in v.users} - {src}
        if readers and (stage_to_rank is None
                        or any(stage_to_rank[t] == stage_to_rank[src] for t in readers)):
            out[src] += v.nbytes * scale
    return out

def _output_bounds(spec: ParallelSpec, stage_to_rank: Sequence[int], out: float,
                   anywhere: bool) -> list[float]:
    """Per stage, the bound on its outputs held until B that the solver uses: ``out`` on
    every stage, or where sent outputs are released (:func:`sends_released`) only on the
    stages that hand a value over to a stage of their own rank: where the next stage is on
    the same rank (``anywhere``: any later stage), 0 elsewhere. The last stage hands nothing
    over (no stage comes after it): 0 there."""
    k = len(stage_to_rank)
    if not sends_released(spec):
        return [out] * (k - 1) + [0.0]
    return [out if any(stage_to_rank[t] == stage_to_rank[j]
                       for t in (range(j + 1, k) if anywhere else range(j + 1, min(j + 2, k))))
            else 0.0 for j in range(k)]

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

#: what a stage does with the activations its backward reads: keep them (none), recompute
#: them selectively (the costly ops' outputs kept, :mod:`fxpipe.execution.selective`) or fully
#: (only the stage's inputs kept), or offload them to host memory and fetch them back
OFF, SELECTIVE, FULL, OFFLOAD = "", "selective", "full", "offload"

#: ``train.activation_recompute`` values that make every stage recompute
FORCED = ("on", "full", "selective")

def every_stage_forced(spec: ParallelSpec) -> bool:
    """Whether the spec makes every stage give up its activations (recompute or offload)."""
    return (spec.train.activation_recompute in FORCED
            or spec.train.activation_offload == "on")

def recompute_modes(mode: str, must: bool, selective: bool = True,
                    offload: str = "off") -> tuple[str, ...]:
    """What a candidate is tried with, in order, under ``train.activation_recompute`` =
    ``mode`` and ``train.activation_offload`` = ``offload`` (``must``: it cannot fit keeping
    its activations; ``selective``: it may fit with selective recomputation,
    :func:`fits_recomputing`)."""
    if offload == "on":
        return (OFFLOAD,)
    off = (OFFLOAD,) if offload == "auto" else ()
    if mode == "off":
        return off if must and off else (OFF, *off)
    if mode in ("on", "full"):
        return (FULL,)
    if mode == "selective":
        return (SELECTIVE,)
    sel = (SELECTIVE,) if selective else ()
    return (*sel, *off, FULL) if must else (OFF, *sel, *off, FULL)

def offload_moves(cand: Candidate) -> int:
    """Times an offloading stage's activation bytes cross the host link per micro-batch: out
    after the forward, back for B, and back again for W under a split backward (W reads its
    saved tensors again; priced as all of them, an upper bound: the weight gradients read the
    matmuls' inputs, most of the bytes)."""
    return 3 if cand.schedule in SPLIT_BACKWARD else 2

def selective_prefix(pr: Priced, ridge: float = 0.0) -> np.ndarray:
    """``(n+1,)`` prefix sums of the units' forward seconds selective recomputation runs
    again (:attr:`~fxpipe.partitioner.blocks.UnitTable.selective`), at keep threshold
    ``ridge`` (0: the device's ridge point; :func:`~fxpipe.partitioner.pricing.selective_at`)."""
    key = "selective_prefix" if not ridge else ("selective_prefix", float(ridge))
    if key not in pr.cache:
        again = [a for a, _ in selective_at(pr, ridge)] or [0.0] * len(pr.table.names)
        pr.cache[key] = np.concatenate([[0.0], np.cumsum(again)])
    return pr.cache[key]

def mode_key(flag: str, ridge: float = 0.0) -> str:
    """What :attr:`Recompute.results` keys a stage's evaluation by: its flag, and a selective
    stage's keep threshold when it is above the ridge point (``selective@<threshold>``)."""
    return f"{SELECTIVE}@{float(ridge)!r}" if flag == SELECTIVE and ridge else flag

def cut_problem(pr: Priced, spec: ParallelSpec, cand: Candidate, scale: float,
                 share: int = 1, inflight: Sequence[float] | None = None,
                 sent: float | None = None) -> CutProblem:
    """The cut problem of one candidate layout at ``scale`` x the traced micro-batch, over the
    priced units (node-level, or blocks when the model folds); cheap values are not in it
    (each stage rebuilds them). ``share``: each stage may use 1/share of its device (a rank
    that holds several stages); ``inflight``: micro-batches in flight per stage to bound each
    stage's memory by, instead of the stage's own peak (:func:`_shared_inflight`). A
    recomputing candidate's units keep nothing (full) or their kept ops' outputs (selective)
    per micro-batch, and run their forward (full) or their recomputed nodes' (selective)
    again in the backward; each stage keeps its input per micro-batch in flight besides."""
    tb = pr.table
    values = [Value(v.producer, v.users, v.nbytes * scale, v.grad, v.name) for v in tb.values]
    peaks, stage_to_rank = stage_inflight(cand)
    inflight = list(peaks) if inflight is None else list(inflight)
    k = cand.num_stages
    capacity: float | list[float] = spec.cluster.memory_gb * 1e9 / share
    gathered = gathered_bound(pr, spec, cand)  # parameters gathered block by block
    if gathered >= capacity:
        raise PlanError(f"gathering parameters block by block, a stage holds up to "
                        f"{human_bytes(gathered, True)} of gathered blocks (and shared "
                        f"parameters' whole state), the device's {human_bytes(capacity, True)}")
    capacity -= gathered
    # each stage's outputs, held until B: the largest value (or ``sent``, a stage's outputs
    # found larger in a first cut); where sent outputs are released, only those handed over
    out_bound = max(recompute_held(values), sent or 0.0)
    outs = _output_bounds(spec, stage_to_rank, out_bound, sent is not None)
    # what each stage's capacity leaves out, said where no cut fits
    device = spec.cluster.memory_gb * 1e9
    reserved: list[list[tuple[str, float]]] = [[] for _ in range(k)]
    for j in range(k):
        if share > 1:
            reserved[j].append((f"the other stages of its rank (each stage held to 1/{share} "
                                f"of the device)", device - device / share))
        if gathered:
            reserved[j].append(("gathered blocks and shared parameters' whole state (block "
                                "by block gathering, a bound over every cut)", gathered))
        if outs[j]:
            reserved[j].append((f"outputs held until B ({_in_flight(inflight[j])} x at most "
                                f"{human_bytes(outs[j], True)}, "
                                + ("the outputs found in a first cut)" if sent is not None
                                   and sent > recompute_held(values)
                                   else "the largest value between units)"),
                                inflight[j] * outs[j]))
    if cand.recompute:  # keep each stage's input per micro-batch, run the forward again
        held = recompute_held(values)
        n, out = max(zip(inflight, outs), key=lambda x: x[0] * (held + x[1]))
        if n * (held + out) >= capacity:
            raise PlanError(held_note(capacity, n, held + out, scale * pr.batch, True))
        capacity = [capacity - n * (held + out) for n, out in zip(inflight, outs)]
        for j in range(k):
            reserved[j].append((f"stage inputs kept for recomputation "
                                f"({_in_flight(inflight[j])} x at most "
                                f"{human_bytes(held, True)}, the largest value between units)",
                                inflight[j] * held))
        if cand.recompute == OFFLOAD:  # the saved bytes cross the host link instead
            per_byte = offload_moves(cand) / spec.cluster.host_Bps
            compute = [(f + bi + bw + kept * per_byte) * scale
                       for (f, bi, bw), kept in zip(tb.times, tb.saved)]
            saved = [0.0] * len(tb.saved)
        elif cand.recompute == SELECTIVE:
            sel = selective_at(pr, cand.keep_ridge) or [(0.0, 0.0)] * len(tb.times)
            compute = [(f + again + bi + bw) * scale
                       for (f, bi, bw), (again, _) in zip(tb.times, sel)]
            saved = [kept * scale for _, kept in sel]
        else:
            compute = [(2 * f + bi + bw) * scale for f, bi, bw in tb.times]
            saved = [0.0] * len(tb.saved)
    else:
        compute = [sum(x) * scale for x in tb.times]
        saved = [s * scale for s in tb.saved]
        capacity = [capacity - n * out for n, out in zip(inflight, outs)]
    return CutProblem(
        compute, memory_params(pr, spec, cand, tb.params), saved, values, k,
        bandwidth_Bps=_boundary_bandwidths(spec, cand, stage_to_rank) if k > 1 else 1.0,
        latency_s=spec.cluster.links.latency_s,
        capacity_bytes=capacity,
        param_multiplier=factor(spec, cand),
        inflight=inflight,
        forced_cuts=tb.forced_cuts,
        pins=tb.pins,
        unit_names=tb.names,
        slowdown=slowdowns(spec, cand, stage_to_rank),
        reserved=reserved,
    )

def _in_flight(n: float) -> str:
    """``2 micro-batches in flight``."""
    return f"{n:g} micro-batch{'' if n == 1 else 'es'} in flight"

class Recompute(NamedTuple):
    """Activation recomputation of one cut, stage by stage (:func:`recompute_stages`).

    Attributes:
        flags: per stage, its recomputation: :data:`OFF` (``""``), :data:`SELECTIVE` or
            :data:`FULL`, or :data:`OFFLOAD`.
        results: the cut evaluated under each recomputation a stage uses (its activation and
            memory bytes: :meth:`result`; with offload also without, whose activation bytes
            are what goes to the host).
        memory: per stage, the bytes its rank holds for it as planned (a recomputing stage's
            inputs kept per micro-batch in flight included); None without recomputation (the
            solver's figures are those bytes).
        held: per stage, the bytes of the inputs it keeps per micro-batch when it recomputes
            (:func:`stage_inputs`; the cut was solved with :func:`recompute_held`'s bound).
        sent: per stage, the bytes of its outputs per micro-batch, held until its backward
            (:func:`stage_outputs`: on CUDA only those handed over on its rank,
            :func:`sends_released`; solved with the same bound).
        partial: per stage, under :data:`FULL`, its partial recomputation
            (:class:`~fxpipe.partitioner.partial.StagePartial`, at ``scale``: the first
            blocks recompute, the rest keep their activations), None where the whole stage
            recomputes; None: no stage recomputes partially.
        fixed: per stage, the bytes of training state it holds beyond the cut problem's
            ``param_multiplier x`` its parameter bytes (parameters gathered block by block:
            :func:`~fxpipe.partitioner.gathering.static_fixed`; in ``memory``); None: none.
        ridges: per stage, a selective stage's keep threshold in FLOPs per output byte when
            it is above the device's ridge point (0: the ridge point; :func:`~fxpipe.
            partitioner.pricing.selective_levels`); None: every selective stage at the ridge.
        solved: the :func:`mode_key` the cut was solved under (the candidate's); "": the
            most recomputing one in ``results``.
    """

    flags: list[str]
    results: dict[str, PartitionResult]
    memory: list[float] | None
    held: list[float] | None = None
    sent: list[float] | None = None
    partial: list | None = None
    fixed: list[float] | None = None
    ridges: list[float] | None = None
    solved: str = ""

    def ridge(self, j: int) -> float:
        """Stage ``j``'s keep threshold above the ridge point under selective recomputation
        (0: the ridge point, or the stage does not recompute selectively)."""
        return self.ridges[j] if self.ridges is not None and self.flags[j] == SELECTIVE else 0.0

    def key(self, j: int) -> str:
        """What :attr:`results` holds stage ``j``'s evaluation under (:func:`mode_key`)."""
        return mode_key(self.flags[j], self.ridge(j))

    def blocks(self, j: int) -> int:
        """Blocks stage ``j`` recomputes under partial recomputation (0: none, or the whole
        stage)."""
        p = self.partial[j] if self.partial is not None else None
        return p.n if p is not None and self.flags[j] == FULL else 0

    def result(self, j: int) -> PartitionResult:
        """The cut as evaluated under stage ``j``'s recomputation."""
        return self.results[self.key(j)]

    def host_bytes(self, j: int) -> float:
        """Bytes stage ``j`` moves to host memory per micro-batch in flight (an offloading
        stage's activations; 0 otherwise)."""
        if self.flags[j] != OFFLOAD:
            return 0.0
        return float(self.results[OFF].saved_bytes[j])

    def activation_bytes(self, j: int) -> float:
        """Bytes stage ``j`` holds per micro-batch in flight: what its ops keep for the
        backward, and a recomputing stage's inputs."""
        kept = float(self.result(j).saved_bytes[j])
        if self.blocks(j):  # the head's values the tail reads, the tail's activations
            kept = self.partial[j].kept
        return (kept + (self.held[j] if self.flags[j] and self.held else 0.0)
                + (self.sent[j] if self.sent else 0.0))

def recompute_stages(pr: Priced, spec: ParallelSpec, cand: Candidate, cuts: Sequence[int],
                      scale: float) -> Recompute:
    """How each stage of a cut recomputes its activations. None in a candidate without
    recomputation; the candidate's (selective or full) on every stage when
    ``train.activation_recompute`` names it; with ``auto`` a stage recomputes less where its
    rank's device still holds all the rank's stages: the cut was solved with every stage
    recomputing as the candidate does, and stages drop it rank by rank, the one saving the
    most time first (to none; then, a full candidate's stages still full, to selective at the
    ridge point and then at each higher keep threshold of :func:`~fxpipe.partitioner.pricing.
    selective_levels`, which recompute more ops). A candidate recomputing selectively above
    the ridge point (``cand.keep_ridge``) lowers its stages alike, to none (under ``auto``) and
    to the lower thresholds (also under ``selective``: still selective recomputation)."""
    k = cand.num_stages
    mode = cand.recompute or OFF
    level = cand.keep_ridge if mode == SELECTIVE else 0.0
    top = mode_key(mode, level)

    def at(m: str, ridge: float = 0.0) -> PartitionResult:
        return evaluate(cut_problem(pr, spec, dataclasses.replace(
            cand, recompute=m, keep_ridge=ridge), scale), list(cuts), method="given")

    results = {top: at(mode, level)}
    inflight, _ = stage_inflight(cand)
    sent = stage_outputs(pr, cuts, scale, output_ranks(spec, cand))
    mine = results[top]
    fixed = static_fixed(pr, spec, cand, cuts, mine.param_bytes)  # gathered block by block
    add = fixed or [0.0] * k
    if not mode:
        return Recompute([OFF] * k, results, [float(mine.memory_bytes[j]) + inflight[j] * sent[j]
                                              + add[j] for j in range(k)], None, sent,
                         fixed=fixed)
    if mode == OFFLOAD:  # what goes to the host: the activations kept without it
        results[OFF] = at(OFF)
    held = stage_inputs(pr, cuts, scale)
    static = [float(mine.memory_bytes[j]) - inflight[j] * float(mine.saved_bytes[j]) + add[j]
              for j in range(k)]
    memory = [float(mine.memory_bytes[j]) + inflight[j] * (held[j] + sent[j]) + add[j]
              for j in range(k)]
    chosen = spec.train.activation_offload if mode == OFFLOAD else spec.train.activation_recompute
    layers = spec.train.recompute_layers if mode == FULL else None
    if chosen != "auto" and not level:
        partial = None
        if layers is not None:  # train.recompute_layers: the first N blocks of each stage
            partial = [scaled(p, scale) for p in explicit(pr, cuts, layers)]
            for j, p in enumerate(partial):
                if p is not None:
                    memory[j] = static[j] + inflight[j] * (p.kept + held[j] + sent[j])
        return Recompute([mode] * k, results, memory, held, sent, partial, fixed=fixed,
                         solved=top)
    device = spec.cluster.memory_gb * 1e9
    flags, ridges, keys = [mode] * k, [level] * k, [top] * k
    per_mb = [float(mine.saved_bytes[j]) + held[j] + sent[j] for j in range(k)]
    if mode == FULL:  # none, selective at the ridge point, then at each higher threshold
        lowers = [(OFF, 0.0), (SELECTIVE, 0.0)] + [(SELECTIVE, r) for r in selective_levels(pr)]
    elif level:  # a higher threshold: none (auto), the ridge point, the thresholds below
        lowers = ([(OFF, 0.0)] if chosen == "auto" else []) + [(SELECTIVE, 0.0)] + [
            (SELECTIVE, r) for r in selective_levels(pr) if r < level]
    else:
        lowers = [(OFF, 0.0)]
    for lower, ridge in lowers:
        if top not in keys:
            break  # every stage recomputes less already
        key = mode_key(lower, ridge)
        if ridge and key not in results and not _some_stage_holds(
                pr, cand, cuts, scale, ridge, [keys[j] == top for j in range(k)], static,
                per_mb, held, sent, device):
            continue  # no stage's rank holds what it keeps there: not evaluated
        res = results[key] = results[key] if key in results else at(lower, ridge)
        for st, tops in rank_inflight(cand):
            for j in sorted(st, key=lambda j: (res.compute_s[j] - mine.compute_s[j], j)):
                if keys[j] != top:
                    continue
                was = per_mb[j]
                per_mb[j] = float(res.saved_bytes[j]) + (held[j] if lower else 0.0) + sent[j]
                if _rank_peak(st, tops, static, per_mb) <= device:
                    flags[j], ridges[j], keys[j] = lower, ridge, key
                    memory[j] = static[j] + inflight[j] * per_mb[j]
                else:
                    per_mb[j] = was
    if len(lowers) > 1 and top in keys:  # a rank holding several stages, one still at the
        # candidate's: its stages' ways weighed together (lowering one to the ridge point may
        # leave its others none to lower to, where all at a higher threshold would fit)
        _weigh_rank_together(cand, top, results, inflight, flags, ridges, keys, per_mb,
                             memory, static, held, sent, device)
    partial = (_weigh_partial(pr, cand, cuts, scale, flags, static, per_mb, memory, held,
                              sent, device, layers, ridges) if mode == FULL else None)
    ridges = [r if f == SELECTIVE else 0.0 for f, r in zip(flags, ridges)]
    keep = ({mode_key(f, r) for f, r in zip(flags, ridges)} | {top}
            | ({OFF} if OFFLOAD in flags else set()))
    return Recompute(flags, {m: r for m, r in results.items() if m in keep}, memory, held, sent,
                     partial, fixed=fixed, ridges=ridges if any(ridges) else None, solved=top)

#: most combinations of its stages' ways :func:`_weigh_rank_together` weighs on one rank
#: (beyond, each way on all its stages): 5 ways on 5 stages
MAX_RANK_COMBINATIONS = 5 ** 5

def _weigh_rank_together(cand: Candidate, top: str, results: dict[str, PartitionResult],
                         inflight: Sequence[float], flags: list[str], ridges: list[float],
                         keys: list[str], per_mb: list[float], memory: list[float],
                         static: list[float], held: list[float], sent: list[float],
                         device: float) -> None:
    """On each rank holding several stages of which one still recomputes as the candidate
    does (``top``) after the stage-by-stage lowering of :func:`recompute_stages`: every
    combination of the ways evaluated (``results``) for its stages that the rank holds at its
    peak, the one whose slowest stage computes least per micro-batch (what the cut was solved
    for: the pipeline runs at its slowest stage's pace), then whose stages compute least in
    total, where that is less than now (a rank of more stages than
    :data:`MAX_RANK_COMBINATIONS` allows: each way on all of them). Updates ``flags``, ``ridges``, ``keys``, ``per_mb`` and ``memory`` in
    place."""
    ways = [(k.split("@")[0], float(k.split("@")[1]) if "@" in k else 0.0, k)
            for k in results]
    for st, tops in rank_inflight(cand):
        if len(st) < 2 or all(keys[j] != top for j in st):
            continue

        def cost(assign) -> tuple[float, float]:
            secs = [float(results[w[2]].compute_s[j]) for j, w in zip(st, assign)]
            return max(secs), sum(secs)

        def bytes_of(j: int, w) -> float:
            return float(results[w[2]].saved_bytes[j]) + (held[j] if w[0] else 0.0) + sent[j]

        now = [next(w for w in ways if w[2] == keys[j]) for j in st]
        best, best_cost = None, cost(now)
        combos = (itertools.product(ways, repeat=len(st))
                  if len(ways) ** len(st) <= MAX_RANK_COMBINATIONS
                  else ((w,) * len(st) for w in ways))  # (deep ranks: one way for all)
        for assign in combos:
            c = cost(assign)
            if c >= best_cost:
                continue
            trial = list(per_mb)
            for j, w in zip(st, assign):
                trial[j] = bytes_of(j, w)
            if _rank_peak(st, tops, static, trial) <= device:
                best, best_cost = assign, c
        if best is None:
            continue
        for j, (flag, ridge, key) in zip(st, best):
            flags[j], ridges[j], keys[j] = flag, ridge, key
            per_mb[j] = bytes_of(j, (flag, ridge, key))
            memory[j] = static[j] + inflight[j] * per_mb[j]

def _some_stage_holds(pr: Priced, cand: Candidate, cuts: Sequence[int], scale: float,
                      ridge: float, open_: list[bool], static: list[float], per_mb: list[float],
                      held: list[float], sent: list[float], device: float) -> bool:
    """Whether some stage still to lower (``open_``) would fit its rank recomputing
    selectively at keep threshold ``ridge``, the others as they are: its units' kept bytes
    (:func:`~fxpipe.partitioner.pricing.selective_at`, what the cut's evaluation sums) and
    its inputs and outputs per micro-batch in flight."""
    kept = np.concatenate([[0.0], np.cumsum([b for _, b in selective_at(pr, ridge)])]) * scale
    ends = list(cuts[1:]) + [len(pr.table.names)]
    for st, tops in rank_inflight(cand):
        for j in st:
            if not open_[j]:
                continue
            trial = list(per_mb)
            trial[j] = float(kept[ends[j]] - kept[cuts[j]]) + held[j] + sent[j]
            if _rank_peak(st, tops, static, trial) <= device * (1 + 1e-9):
                return True
    return False

def _weigh_partial(pr: Priced, cand: Candidate, cuts: Sequence[int], scale: float,
                   flags: list[str], static: list[float], per_mb: list[float],
                   memory: list[float], held: list[float], sent: list[float], device: float,
                   layers: int | None, ridges: Sequence[float] | None = None) -> list | None:
    """Partial recomputation (:mod:`fxpipe.partitioner.partial`) where ``auto`` left a stage
    recomputing: each full stage (then each selective one) takes the fewest first blocks to
    recompute with which its rank still holds its stages (``layers``: exactly that many, from
    ``train.recompute_layers``), where that runs less forward again than the stage does now
    (a full stage: its whole forward; a selective one: its recomputed ops). Updates ``flags``
    (a selective stage going partial becomes full), ``per_mb`` and ``memory`` in place
    (``ridges``: per stage, a selective stage's keep threshold, 0 at the ridge point);
    returns per stage its :class:`~fxpipe.partitioner.partial.StagePartial` or None (None
    when no stage takes one)."""
    if not pr.table.blocks or not any(f in (FULL, SELECTIVE) for f in flags):
        return None
    ends = list(cuts[1:]) + [len(pr.table.names)]
    ridges = ridges or [0.0] * len(flags)
    fwd = np.concatenate([[0.0], np.cumsum([t[0] for t in pr.table.times])])
    inflight = stage_inflight(cand)[0]
    out: list = [None] * len(flags)
    for st, tops in rank_inflight(cand):
        for j in sorted(st, key=lambda j: (flags[j] != FULL, j)):
            if flags[j] not in (FULL, SELECTIVE):
                continue
            a, b = cuts[j], ends[j]
            again = selective_prefix(pr, ridges[j]) if flags[j] == SELECTIVE else fwd
            now = again[b] - again[a]
            was = per_mb[j]
            for p in partial_options(pr, a, b, layers):
                if p.head_s >= now:
                    break
                if layers is not None and p.n != layers:
                    continue
                per_mb[j] = p.kept * scale + held[j] + sent[j]
                if _rank_peak(st, tops, static, per_mb) <= device:
                    out[j], flags[j] = scaled(p, scale), FULL
                    memory[j] = static[j] + inflight[j] * per_mb[j]
                    break
                per_mb[j] = was
    return out if any(p is not None for p in out) else None

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
    mult = factor(spec, cand)
    static = [mult * float(b) + (rc.fixed[j] if rc.fixed else 0.0)
              for j, b in enumerate(result.param_bytes)]
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
        need = _rank_peak(mine, tops, static, per_mb)
        if need > device:
            what = (f"stages {', '.join(map(str, mine))}, which need" if len(mine) > 1
                    else f"stage {mine[0]}, which needs")
            outs = ("the outputs handed over on the rank" if sends_released(spec)
                    else "its outputs")
            return (f"rank {r} holds {what} {human_bytes(need, True)} at the peak ({outs} "
                    f"held until B included) but the device has {human_bytes(device, True)}")
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
    sent = max(first[2].sent or [0.0])
    if over is not None and sent > recompute_held(first[0].values):  # several outputs a stage
        try:
            first = solve(cut_problem(pr, spec, cand, scale, sent=sent))
            over = _rank_memory(spec, cand, first[1], first[2])
        except PlanError:
            pass
    if over is None:
        _check_host_memory(spec, cand, first[2])
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
            _check_host_memory(spec, cand, again[2])
            return again
        why = why or still
    raise PlanError(why)

def host_peaks(cand: Candidate, rc: Recompute) -> list[float]:
    """Per rank, the host bytes its offloading stages hold at the rank's peak (micro-batches
    in flight times each stage's offloaded bytes per micro-batch)."""
    per_mb = [rc.host_bytes(j) for j in range(len(rc.flags))]
    return [_rank_peak(st, tops, [0.0] * len(per_mb), per_mb) for st, tops in rank_inflight(cand)]

def _check_host_memory(spec: ParallelSpec, cand: Candidate, rc: Recompute) -> None:
    """Raise PlanError where a rank's offloaded activations overflow its share of the node's
    host memory (``cluster.host_memory_gb`` / devices per node)."""
    if OFFLOAD not in rc.flags:
        return
    share = spec.cluster.host_bytes_per_device
    need = host_peaks(cand, rc)
    worst = int(np.argmax(need))
    if share is None or need[worst] > share:
        raise PlanError(
            f"activation offload: rank {worst} holds {human_bytes(need[worst], True)} of "
            f"activations in host memory at its peak, but its share of the node's host memory "
            f"is {human_bytes(share or 0.0, True)} (cluster.host_memory_gb / devices per node)")

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
    the activations of its micro-batches in flight on the device, recomputing nothing
    (:func:`fits_recomputing`). False means the candidate must recompute (no solve needed to
    know)."""
    return fits_recomputing(pr, spec, cand, scale, OFF)

def fits_recomputing(pr: Priced, spec: ParallelSpec, cand: Candidate, scale: float,
                     mode: str) -> bool:
    """Whether some cut could hold every stage's parameters, gradients, optimizer state and
    what it keeps per micro-batch in flight on the device, every stage recomputing as
    ``mode`` says (:data:`OFF`: its activations; :data:`SELECTIVE`: its kept ops' outputs at
    ``cand.keep_ridge`` and its input; :data:`FULL`: its input): the greedy cover (each stage as long as the device
    holds it) is optimal for this question, and ignoring that a rank may hold several stages
    only makes it say yes more often. False: no cut fits (no solve needed to know)."""
    tb = pr.table
    mult = factor(spec, cand)
    inflight, _ = stage_inflight(cand)
    cap = spec.cluster.memory_gb * 1e9 - gathered_bound(pr, spec, cand)
    level = cand.keep_ridge if mode == SELECTIVE else 0.0  # (a threshold above the ridge)
    key = ("fits", mode, level) if level else ("fits", mode)
    if key not in pr.cache:  # prefix sums of parameters and of bytes kept per micro-batch
        if mode == OFF:
            per = np.asarray(tb.saved, dtype=np.float64)
        elif mode == SELECTIVE and tb.selective:
            per = np.asarray([b for _, b in selective_at(pr, level)], dtype=np.float64)
        else:
            per = np.zeros(len(tb.params))
        pr.cache[key] = (np.concatenate([[0.0], np.cumsum(np.asarray(tb.params,
                                                                     dtype=np.float64))]),
                         np.concatenate([[0.0], np.cumsum(per)]),
                         recompute_held(tb.values))
    P, cum, held = pr.cache[key]
    # each stage's outputs held until B (not where sent ones are released: the handed-over
    # ones left out says yes more often; not on the last stage, which hands nothing over, as
    # the cut problem) and, recomputing, its input
    out = held * scale * (0 if sends_released(spec) else 1)
    held = held * scale * (0 if mode == OFF else 1)
    A = cum * scale
    n, pos = len(tb.params), 0
    memo: dict[int, np.ndarray] = {}
    for j in range(cand.num_stages):
        k = int(inflight[j])
        if k not in memo:
            memo[k] = mult * P + k * A  # non-decreasing in the end
        d = memo[k]
        keep = held + (out if j < cand.num_stages - 1 else 0.0)
        end = int(np.searchsorted(d, d[pos] + cap - k * keep, "right")) - 1
        if end <= pos:
            return False
        pos = end
        if pos >= n:
            return True
    return False

def static_share(pr: Priced, spec: ParallelSpec, cand: Candidate) -> float:
    """Bytes of parameters, gradients and optimizer state the fullest rank of the candidate
    holds at least: every parameter is on some rank, so some rank holds the average share."""
    return sum(pr.table.params) * factor(spec, cand) / cand.pipeline
