"""The parallel search space of ``auto`` specs: pipeline x data x micro-batches x schedule.

:func:`candidates` expands every ``auto`` field of a spec into concrete layouts (fixed fields are
kept); :func:`stage_inflight` gives each layout's peak micro-batches in flight per stage (the
planner's memory model) by simulating its schedule with uniform costs. The planner prices every
candidate and the fastest one that fits wins (Alpa/PipeDream-style inter-operator search, with
the exact stage cut inside).
"""

from __future__ import annotations

import math

import functools
from dataclasses import dataclass

from fxpipe.errors import PlanError
from fxpipe.partitioner.context_costs import context_in_node
from fxpipe.partitioner.expert_costs import expert_in_node
from fxpipe.plans.placement import stage_to_rank
from fxpipe.schedule.actions import Op
from fxpipe.schedule.generators import compute_schedule, v_memory_limit
from fxpipe.schedule.lowering import linear_edges
from fxpipe.schedule.simulate import LoweredSchedule, StageCosts, simulate
from fxpipe.specs.loader import spec_location
from fxpipe.specs.schema import (AUTO_VIRTUAL_STAGES, SCHEDULES, V_SCHEDULES, ParallelSpec,
                                 stages_per_rank)
from fxpipe.units import plural

#: schedules tried by ``schedule: auto`` (interleaved is tried with v = 2): all of them
AUTO_SCHEDULES = SCHEDULES


@dataclass(frozen=True)
class Candidate:
    """One point of the parallel search space."""

    pipeline: int
    dp: int
    microbatches: int
    schedule: str
    virtual_stages: int
    recompute: str = ""  # "", "selective" or "full" (fxpipe.partitioner.cutting)
    layout: str = "pipeline-inner"
    tensor: int = 1
    sharding: str = "none"
    gather: str = "stage"  # under sharding full: "stage" or "block" (parallel.param_gather)
    #: under selective recomputation, the keep threshold in FLOPs per output byte when it is
    #: above the device's ridge point (fxpipe.partitioner.pricing.selective_levels); 0: the
    #: ridge point
    keep_ridge: float = 0.0
    #: context-parallel degree (parallel.context): replicas per context group, which share
    #: samples; the grid has dp x context replicas
    context: int = 1

    @property
    def replicas(self) -> int:
        """Replicas of every stage on the grid: ``dp * context``."""
        return self.dp * self.context

    @property
    def num_stages(self) -> int:
        """Stages of the pipeline: ``pipeline * virtual_stages`` (2 per rank for the V
        schedules)."""
        return self.pipeline * stages_per_rank(self.schedule, self.virtual_stages)

    def label(self) -> str:
        """Short text, e.g. ``pp=2 dp=2 m=4 1f1b``."""
        v = f" v={self.virtual_stages}" if self.schedule == "interleaved" else ""
        r = {"full": " recompute", "selective": " selective",
             "offload": " offload"}.get(self.recompute or "", "")
        if self.recompute == "selective" and self.keep_ridge:
            r += f"@{self.keep_ridge:.0f}"
        lay = " data-inner" if self.layout == "data-inner" else ""
        tp = f"tp={self.tensor} " if self.tensor > 1 else ""
        tp += f"cp={self.context} " if self.context > 1 else ""
        zero = f" shard={self.sharding}" if self.sharding != "none" else ""
        zero += "/block" if self.gather == "block" else ""
        return (f"{tp}pp={self.pipeline} dp={self.dp} m={self.microbatches} {self.schedule}{v}"
                f"{r}{zero}{lay}")


#: the interleaved schedule's stages per rank the search weighs (``virtual_stages: auto``)
DEEP_VIRTUAL_STAGES = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def _virtual_stages(par, schedule: str, pp: int, max_stages: int | None) -> list[int]:
    """Stages per rank to try for ``schedule`` at pipeline ``pp``: the V schedules' and the
    others' own (1 here); interleaved: the spec's ``virtual_stages``, or under ``auto`` (the
    count or the schedule) :data:`DEEP_VIRTUAL_STAGES` up to the model's units per rank (at
    least 2: too many stages is then said for 2)."""
    if schedule != "interleaved":
        return [1]
    if par.virtual_stages != "auto" and (par.schedule != "auto" or par.virtual_stages > 1):
        return [par.virtual_stages]
    most = max(2, (max_stages or 2 * pp) // pp)
    return [v for v in DEEP_VIRTUAL_STAGES if v <= most]


def _divisors(n: int) -> list[int]:
    """Divisors of ``n`` in ascending order (O(sqrt n))."""
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


def _too_many_stages(spec: ParallelSpec, n_units: int, num_stages: int, pipeline: int,
                     per_rank: int) -> PlanError:
    where = spec_location(spec, "parallel.pipeline")
    head = f"{where}: " if where else ""
    layout = (f" (parallel.pipeline={pipeline} x {per_rank} stages per rank)" if per_rank > 1
              else "")
    fix = (f"use at most {plural(n_units, 'pipeline stage')} (parallel.pipeline <= {n_units})"
           if per_rank == 1 else
           f"use at most {plural(n_units, 'stage')} in all (parallel.pipeline x stages per rank "
           f"<= {n_units})")
    return PlanError(
        f"{head}cannot cut {plural(n_units, 'unit')} into {plural(num_stages, 'stage')}"
        f"{layout}: every stage needs at least one planning unit of the model; {fix}"
    )


def _batch_leaves_too_many_stages(spec: ParallelSpec, world: int, n_units: int,
                                  fits: list[int]) -> PlanError:
    """Every data-parallel degree that divides both the world size and the batch (``fits``)
    leaves pipelines longer than the model has units: say so, and which batch sizes would
    do."""
    batch = spec.data.batch_size
    need = next(d for d in _divisors(world) if world // d <= n_units)
    where = spec_location(spec, "data.batch_size")
    return PlanError(
        f"{where + ': ' if where else ''}data.batch_size {batch} on {world} devices: the "
        f"data-parallel degree must divide both, and the ones that do "
        f"({', '.join(map(str, fits))}) leave pipelines of at least "
        f"{plural(world // max(fits), 'stage')}, but the model has only "
        f"{plural(n_units, 'planning unit')} to cut; make data.batch_size a multiple of "
        f"{need} (then {world // need} pipeline stages x {need} replicas can work, e.g. "
        f"data.batch_size {need * max(1, -(-batch // need))}), or use fewer devices")


def tensor_degrees(spec: ParallelSpec) -> list[int]:
    """The tensor-parallel degrees to plan: ``parallel.tensor``, or with ``auto`` every divisor
    of the devices of a node that divides the training devices (a tensor group stays in a
    node); 1 under asynchronous updates."""
    t = spec.parallel.tensor
    if t != "auto":
        return [int(t)]
    if spec.train.updates == "async":
        return [1]
    return [d for d in _divisors(spec.cluster.devices_per_node)
            if spec.cluster.trainers % d == 0]


def _sharding_levels(spec: ParallelSpec, dp: int) -> tuple[str, ...]:
    """``parallel.data_sharding`` as given, or with ``auto`` none and ``optimizer`` (the levels
    above it hold the same while a step runs and move the same bytes: see
    :mod:`fxpipe.runtime.data_sharding`) where there are replicas to shard over."""
    level = spec.parallel.data_sharding
    if level != "auto":
        return (level,)
    return ("none", "optimizer") if dp > 1 and spec.train.updates == "sync" else ("none",)


def _levels_and_gathers(spec: ParallelSpec, dp: int) -> list[tuple[str, str]]:
    """The ``(data_sharding, param_gather)`` pairs a layout of ``dp`` replicas is tried with:
    :func:`_sharding_levels` gathering whole stages, and, where ``parallel.param_gather`` is
    ``block`` or ``auto`` and ``full`` can shard (several replicas, sync updates), ``full``
    gathering block by block (``block``: only that; the search drops these for a model without
    blocks, :func:`fxpipe.partitioner.gathering.drop_block_candidates`)."""
    gather = spec.parallel.param_gather
    level = spec.parallel.data_sharding
    block = (dp > 1 and spec.train.updates == "sync" and level in ("full", "auto")
             and gather in ("block", "auto"))
    if gather == "block":
        return [("full", "block")] if block else []
    out = [(z, "stage") for z in _sharding_levels(spec, dp)]
    return out + [("full", "block")] if block else out


def candidates(spec: ParallelSpec, max_stages: int | None = None,
               tensor: int = 1) -> list[Candidate]:
    """The search space for the spec: every ``auto`` field expanded, fixed fields kept.

    pipeline x data = world size; micro-batch counts: every divisor of the per-replica batch (up to
    micro-batches of one sample); schedules from :data:`AUTO_SCHEDULES` whose constraints hold;
    on several nodes, both layouts of the grid (:data:`fxpipe.plans.placement.LAYOUTS`: which
    traffic stays inside a node). No schedule is built here: the constraints are arithmetic.

    Args:
        spec: the validated spec.
        max_stages: the number of planning units of the model, if known: candidates with more
            (virtual) stages than that are dropped BEFORE their schedule is built (a schedule of
            100 000 stages would take minutes to build and simulate, and no such cut exists).
        tensor: the tensor-parallel degree: the grid has the training devices over it.

    Raises:
        PlanError: no candidate is left; when every one had more stages than ``max_stages``,
            the message says "cannot cut N units into K stages" and how many stages fit.
        ScheduleError: fixed (not ``auto``) schedule and micro-batches that the schedule rejects.
    """
    par = spec.parallel
    context = par.context
    # the parameter servers do not train; a context group takes one grid position
    world = spec.cluster.trainers // (tensor * context)
    pps = _divisors(world) if par.pipeline == "auto" else [par.pipeline]
    spread = spec.cluster.nodes > 1  # only then does the layout decide which link a group uses
    # context and expert groups (consecutive replicas) exchange in every attention / MoE
    # layer: where they fit a node, only the layout that keeps them there (data-inner:
    # replicas on adjacent ranks), which their pricing assumes
    cp_inside = (context > 1 and context_in_node(spec)) or (
        par.expert not in (1, "auto") and expert_in_node(spec))
    out = []
    too_many: tuple[int, int, int] | None = None  # (stages, pipeline, stages per rank), smallest
    for pp in pps:
        dp = world // pp if par.data == "auto" else par.data
        if pp * dp != world or (dp == 1 and spec.train.updates == "async"):
            continue  # (async updates need several replicas)
        if dp % par.expert:
            continue  # an expert group is parallel.expert replicas
        per_replica = spec.data.batch_size // dp
        if spec.data.batch_size % dp:
            continue
        if par.microbatches == "auto":  # every split of the replica's batch, down to 1 sample
            ms = _divisors(per_replica)
        else:
            ms = [par.microbatches]
        scheds = AUTO_SCHEDULES if par.schedule == "auto" else (par.schedule,)
        for m in ms:
            for s in scheds:
                if pp == 1 and stages_per_rank(s, AUTO_VIRTUAL_STAGES) > 1:
                    continue
                for v in _virtual_stages(par, s, pp, max_stages):
                    per_rank = stages_per_rank(s, v)
                    if max_stages is not None and pp * per_rank > max_stages:
                        if too_many is None or pp * per_rank < too_many[0]:
                            too_many = (pp * per_rank, pp, per_rank)
                        continue
                    # the arithmetic rules of the generators
                    if (s == "interleaved" and m % pp) or (s == "dualpipev" and m < 2 * pp - 1):
                        if par.schedule != "auto" and par.microbatches != "auto":
                            compute_schedule(s, pp, m, v)  # raises, explaining the rule
                        continue
                    for z, gather in _levels_and_gathers(spec, dp * context):
                        if gather == "block" and par.expert != 1:
                            continue  # experts stay whole under sharding: gathered whole
                        if not (spread and pp > 1 and cp_inside):
                            out.append(Candidate(pp, dp, m, s, v, tensor=tensor, sharding=z,
                                                 gather=gather, context=context))
                        if spread and pp > 1 and dp * context > 1:  # the other way too
                            out.append(Candidate(pp, dp, m, s, v, layout="data-inner",
                                                 tensor=tensor, sharding=z, gather=gather,
                                                 context=context))
    if not out and too_many is not None and max_stages is not None:
        fits = [d for d in _divisors(world) if spec.data.batch_size % d == 0]  # 1 always
        if par.pipeline == "auto" and par.data == "auto" and world // max(fits) > max_stages:
            raise _batch_leaves_too_many_stages(spec, world, max_stages, fits)
        raise _too_many_stages(spec, max_stages, *too_many)
    if not out and (par.pipeline != "auto" or par.data != "auto"):
        fixed = [f"{k} {v}" for k, v in (("pipeline", par.pipeline), ("data", par.data))
                 if v != "auto"]
        product = math.prod(v for v in (par.pipeline, par.data) if v != "auto") * tensor
        both = len(fixed) == 2
        if (product != world * tensor) if both else (world * tensor % product != 0):
            raise PlanError(
                f"{' x '.join(fixed)} x tensor {tensor} = {product} ranks, which "
                f"{'is not' if both else 'does not divide'} the {world * tensor} devices; "
                f"choose degrees whose product {'is' if both else 'divides'} them")
    if not out and par.expert > 1:
        raise PlanError(f"parallel.expert: {par.expert} splits the experts over that many "
                        f"data-parallel replicas, and no layout of {world * tensor} devices "
                        f"(tensor {tensor}) has a data-parallel degree divisible by it; give "
                        "more devices or a smaller expert degree")
    if not out and par.param_gather == "block":
        where = spec_location(spec, "parallel.param_gather")
        raise PlanError(f"{where + ': ' if where else ''}parallel.param_gather: block needs "
                        "data_sharding: full over more than one replica, and every layout here "
                        "has one replica per stage; give parallel.data 2 or more, or "
                        "param_gather: stage")
    if not out:
        raise PlanError(
            f"no pipeline x data x micro-batch x schedule combination fits {world} devices and "
            f"batch_size {spec.data.batch_size}; make the batch size divisible by the data-parallel "
            "degree and give micro-batches that suit the schedule"
        )
    return out


#: schedules up to this many compute actions are simulated for their exact in-flight peaks;
#: larger ones take closed forms or bounds
_SIMULATE_ACTIONS = 4_000


def stage_inflight(cand: Candidate) -> tuple[list[int], list[int]]:
    """Peak micro-batches in flight per stage for the candidate's schedule and the schedule's
    stage -> rank placement (cached per schedule, pipeline, micro-batches, stages per rank)."""
    peaks, ranks = _stage_inflight(cand.schedule, cand.pipeline, cand.microbatches,
                                   cand.virtual_stages, cand.num_stages)
    return list(peaks), list(ranks)


@functools.lru_cache(maxsize=4096)
def _stage_inflight(schedule: str, p: int, m: int, v: int, k: int
                    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return _inflight(schedule, p, m, v), tuple(stage_to_rank(schedule, p, k))



def rank_inflight(cand: Candidate) -> list[tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]]:
    """Per pipeline rank: its stages (ascending) and the in-flight counts of those stages that
    can be the rank's peak, one tuple per moment (none dominated by another). A rank's bytes of
    activations peak at ``max over the tuples of sum(n_j x activation_bytes[j])``: for a rank
    that holds two V stages this is less than the sum of each stage's own peak (they do not
    peak together; V-Half at p = 4: 6 micro-batch-stages, not 7). Read off the schedule's
    action lists (what a rank holds depends only on the order of its own actions); where the
    schedule is too large to build (:func:`stage_inflight` bounds it), the stages' own peaks."""
    return list(_rank_states(cand.schedule, cand.pipeline, cand.microbatches,
                             cand.virtual_stages))


@functools.lru_cache(maxsize=4096)
def _rank_states(schedule: str, p: int, m: int, v: int
                 ) -> tuple[tuple[tuple[int, ...], tuple[tuple[int, ...], ...]], ...]:
    peaks = _inflight(schedule, p, m, v)
    k = len(peaks)
    s2r = stage_to_rank(schedule, p, k)
    mine: list[list[int]] = [[] for _ in range(p)]
    for s, r in enumerate(s2r):
        mine[r].append(s)
    if k == p or m < 1:
        return tuple((tuple(st), (tuple(peaks[j] for j in st),)) for st in mine)
    vee = schedule in V_SCHEDULES
    cap = 4 * p if vee else 4 * p * max(1, v)
    m_sim = min(m, cap - cap % p if schedule == "interleaved" else cap)
    if schedule == "interleaved":
        m_sim = max(p, m_sim - m_sim % p)
    if k * m_sim * 3 > _SIMULATE_ACTIONS:
        return tuple((tuple(st), (tuple(peaks[j] for j in st),)) for st in mine)
    sched = compute_schedule(schedule, p, m_sim, v)
    release = Op.W if sched.split_backward else Op.B
    out = []
    for r, st in enumerate(mine):
        pos = {s: i for i, s in enumerate(st)}
        now = [0] * len(st)
        seen: set[tuple[int, ...]] = set()
        for a in sched.actions[r]:
            if a.op is Op.F and a.stage in pos:
                now[pos[a.stage]] += 1
                seen.add(tuple(min(x, m) for x in now))
            elif a.op is release and a.stage in pos:
                now[pos[a.stage]] -= 1
        top = [x for x in seen if not any(y != x and all(b >= a for a, b in zip(x, y))
                                          for y in seen)]
        out.append((tuple(st), tuple(sorted(top, reverse=True)) or (tuple(peaks[j] for j in st),)))
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def _inflight(schedule: str, p: int, m: int, v: int) -> tuple[int, ...]:
    """Closed forms for GPipe (``m``), 1F1B (``p - s``, at most ``m``) and ZB-H1 (``p``, at most
    ``m``); interleaved and the V schedules (ZB-V, V-Half, V-Min, DualPipeV) simulated with
    uniform costs (their peaks stop growing once ``m`` passes a few times ``p``, so ``m`` is
    capped there), or bounded when even that is too large to simulate: ``2p`` per stage
    (interleaved), and for a V schedule the cap on the rank's held stage micro-batches
    (:func:`~fxpipe.schedule.generators.v_memory_limit`), which bounds each of its stages."""
    if schedule == "gpipe":
        return (m,) * p
    if schedule == "1f1b":
        return tuple(max(1, min(p - s, m)) for s in range(p))
    if schedule == "zb-h1":
        return (max(1, min(p, m)),) * p
    k = p * stages_per_rank(schedule, v)
    vee = schedule in V_SCHEDULES
    cap = 4 * p if vee else 4 * p * max(1, v)
    m_sim = min(m, cap - cap % p if schedule == "interleaved" else cap)
    if schedule == "interleaved":
        m_sim = max(p, m_sim - m_sim % p)
    if k * m_sim * 3 > _SIMULATE_ACTIONS:
        bound = v_memory_limit(schedule, p) if vee else 2 * p
        return tuple(max(1, min(m, bound)) for _ in range(k))
    sched = compute_schedule(schedule, p, m_sim, v)
    full = LoweredSchedule(sched, linear_edges(k))  # add_communication's, for the simulator
    res = simulate(full, StageCosts([1.0] * k, [1.0] * k, [1.0] * k), check=False,
                   timeline=False)
    return tuple(max(1, min(x, m)) for x in res.peak_inflight)