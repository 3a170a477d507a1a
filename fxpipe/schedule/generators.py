"""Schedule generators: per-rank action lists for GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-V,
V-Half, V-Min and DualPipeV.

Every generator first builds the *compute-only* lists (F, B and, for zero-bubble schedules, W
actions; see :mod:`fxpipe.schedule.actions`), then :func:`add_communication` inserts the
point-to-point sends/receives implied by the stage graph's edges, the per-stage data-parallel
ALLREDUCE and the final STEP. :func:`build_schedule` does both by schedule name.

Notation: ``p`` pipeline ranks, ``m`` micro-batches per step, ``v`` (virtual) stages per rank,
``s`` stage index. Stages are numbered in pipeline (topological) order: a value flows from a
lower-numbered stage to a higher one. Edges are ``(producer_stage, consumer_stage)`` pairs, and
may skip stages (``(0, 2)``).

References: GPipe (Huang et al., 2019); 1F1B (PipeDream-Flush, Narayanan et al., 2021);
interleaved 1F1B (Megatron-LM, Narayanan et al., SC'21); ZB-H1 and ZB-V (Qi et al., "Zero Bubble
Pipeline Parallelism", ICLR 2024 / "Pipeline Parallelism with Controllable Memory", 2024);
V-Half and V-Min (Qi et al., "Pipeline Parallelism with Controllable Memory", NeurIPS 2024);
DualPipeV (DeepSeek-V3 technical report, 2024, DualPipe; torch.distributed.pipelining).
"""

from __future__ import annotations

import contextlib
import gc
import heapq
from collections import deque
from typing import Callable

from fxpipe.errors import ScheduleError
from fxpipe.plans.placement import stage_to_rank
from fxpipe.schedule.actions import Action, Op, Schedule
from fxpipe.specs.schema import SCHEDULES, V_SCHEDULES, stages_per_rank

# ----------------------------------------------------------------------------- helpers


def _check_pm(p: int, m: int) -> None:
    if not isinstance(p, int) or p < 1:
        raise ScheduleError(
            f"pipeline size must be a positive integer, got p={p!r}; set parallel.pipeline >= 1"
        )
    if not isinstance(m, int) or m < 1:
        raise ScheduleError(
            f"micro-batches must be a positive integer, got m={m!r}; set parallel.microbatches >= 1"
        )


def _F(s: int, i: int) -> Action:
    return Action(Op.F, s, i)


def _B(s: int, i: int) -> Action:
    return Action(Op.B, s, i)


def _W(s: int, i: int) -> Action:
    return Action(Op.W, s, i)


# ----------------------------------------------------------------------------- GPipe / 1F1B
def gpipe(p: int, m: int) -> Schedule:
    """GPipe (Huang et al., 2019): every rank runs all ``m`` forwards, then all ``m`` backwards.

    One stage per rank (stage ``r`` on rank ``r``). Bubble ``(p-1)/(m+p-1)`` of the step with
    uniform costs; ``m`` micro-batches' activations in flight on every stage. Compute-only
    (no SEND/RECV/ALLREDUCE/STEP; see :func:`add_communication`).

    Raises:
        ScheduleError: ``p`` or ``m`` is not a positive integer.
    """
    _check_pm(p, m)
    acts = [[_F(r, i) for i in range(m)] + [_B(r, i) for i in range(m)] for r in range(p)]
    return Schedule("gpipe", p, p, m, stage_to_rank("gpipe", p, p), acts, split_backward=False)


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-Flush, Narayanan et al., 2021): ``p-1-r`` warm-up forwards on rank ``r``,
    then alternate one forward / one backward, then the remaining backwards.

    Same bubble as GPipe, ``(p-1)/(m+p-1)`` with uniform costs, but at most ``p - s``
    micro-batches in flight on stage ``s``. Any ``m >= 1`` works (with ``m < p`` the warm-up is
    capped at ``m``). Compute-only.

    Raises:
        ScheduleError: ``p`` or ``m`` is not a positive integer.
    """
    _check_pm(p, m)
    acts = []
    for r in range(p):
        warm = min(p - 1 - r, m)
        lst = [_F(r, i) for i in range(warm)]
        for i in range(m - warm):
            lst += [_F(r, warm + i), _B(r, i)]
        lst += [_B(r, i) for i in range(m - warm, m)]
        acts.append(lst)
    return Schedule("1f1b", p, p, m, stage_to_rank("1f1b", p, p), acts, split_backward=False)


# ----------------------------------------------------------------------------- interleaved
def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    """Interleaved 1F1B (Megatron-LM, Narayanan et al., SC'21) with ``v`` virtual stages per rank.

    Loop placement: ``p * v`` stages, stage ``s`` on rank ``s % p`` (rank ``r`` holds stages
    ``r, r+p, r+2p, ...``). Micro-batches go through in groups of ``p``: rank ``r`` runs the
    forwards of one group on its first chunk, then the same group on its second chunk, and so on;
    backwards in the same order with the chunks reversed. Rank ``r`` starts with
    ``min(2(p-1-r) + (v-1)p, m v)`` warm-up forwards, then alternates one forward / one backward.
    The bubble shrinks to about ``(p-1)/v`` stage-times, i.e. about ``1/v`` of 1F1B's.

    Constraint: ``m % p == 0`` (the group-of-p order needs whole groups), as in Megatron-LM.

    Raises:
        ScheduleError: ``m`` is not a multiple of ``p``, or ``v < 1``.
    """
    _check_pm(p, m)
    if not isinstance(v, int) or v < 1:
        raise ScheduleError(f"interleaved 1F1B needs virtual_stages >= 1, got v={v!r}")
    if m % p:
        lo = (m // p) * p
        hint = f"{lo} or {lo + p}" if lo else f"{p}"
        raise ScheduleError(
            f"interleaved 1F1B needs microbatches divisible by pipeline size: m={m}, p={p} "
            f"(micro-batches run in groups of p through each virtual stage); use m = {hint}"
        )
    n = m * v

    def fwd(k: int) -> tuple[int, int]:  # k-th forward on a rank -> (chunk, micro-batch)
        group, within = divmod(k, p * v)
        return within // p, group * p + within % p

    def bwd(k: int) -> tuple[int, int]:
        chunk, mb = fwd(k)
        return v - 1 - chunk, mb

    acts = []
    for r in range(p):
        warm = min(2 * (p - 1 - r) + (v - 1) * p, n)
        lst = []
        for k in range(warm):
            c, i = fwd(k)
            lst.append(_F(c * p + r, i))
        for k in range(n - warm):
            c, i = fwd(warm + k)
            lst.append(_F(c * p + r, i))
            c, i = bwd(k)
            lst.append(_B(c * p + r, i))
        for k in range(n - warm, n):
            c, i = bwd(k)
            lst.append(_B(c * p + r, i))
        acts.append(lst)
    return Schedule("interleaved", p, p * v, m, stage_to_rank("interleaved", p, p * v), acts,
                    split_backward=False)


# ----------------------------------------------------------------------------- dispatch
def compute_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """Compute-only schedule by name (see :data:`fxpipe.specs.schema.SCHEDULES`); a fresh copy
    of a cached one (the planner asks for the same schedules for many cuts).

    ``v`` is the number of stages per rank: 1 for ``gpipe``, ``1f1b``, ``zb-h1``; any ``v >= 1``
    for ``interleaved``; 2 for the V schedules ``zb-v``, ``v-half``, ``v-min``, ``dualpipev``
    (``v=1`` is accepted and read as 2).

    Raises:
        ScheduleError: unknown name, or parameters the schedule cannot satisfy (the message says
            which constraint and how to fix it).
    """
    gens: dict[str, Callable[[], Schedule]] = {  # one per name in SCHEDULES
        "gpipe": lambda: gpipe(p, m),
        "1f1b": lambda: one_f_one_b(p, m),
        "interleaved": lambda: interleaved_1f1b(p, m, v),
        "zb-h1": lambda: zb_h1(p, m),
        "zb-v": lambda: zb_v(p, m),
        "v-half": lambda: v_half(p, m),
        "v-min": lambda: v_min(p, m),
        "dualpipev": lambda: dualpipev(p, m),
    }
    key = name.lower().replace("_", "-")
    aliases = {"one-f-one-b": "1f1b", "interleaved-1f1b": "interleaved", "zbh1": "zb-h1",
               "zbv": "zb-v", "vhalf": "v-half", "vmin": "v-min", "dual-pipe-v": "dualpipev"}
    key = aliases.get(key, key)
    if key not in gens:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    if key != "interleaved" and stages_per_rank(key) == 1 and v != 1:
        raise ScheduleError(
            f"schedule {key!r} places one stage per rank, but virtual_stages={v}; set "
            f"virtual_stages: 1, or use 'interleaved' (any v) or 'zb-v' (v=2)"
        )
    if key in V_SCHEDULES and v not in (1, stages_per_rank(key)):
        raise ScheduleError(
            f"schedule {key!r} places exactly 2 stages per rank (V shape), but "
            f"virtual_stages={v}; set virtual_stages: 2"
        )
    s = _cached(key, p, m, v, gens[key])
    return Schedule(s.name, s.num_ranks, s.num_stages, s.microbatches, list(s.stage_to_rank),
                    [list(a) for a in s.actions], s.split_backward)


_CACHE: dict[tuple[str, int, int, int], Schedule] = {}


def _cached(key: str, p: int, m: int, v: int, make: Callable[[], Schedule]) -> Schedule:
    """The schedule of ``(key, p, m, v)``, built once per process (at most 256 kept)."""
    k = (key, p, m, v)
    if k not in _CACHE:
        if len(_CACHE) >= 256:
            _CACHE.pop(next(iter(_CACHE)))
        with _collector_paused():
            _CACHE[k] = make()
    return _CACHE[k]


@contextlib.contextmanager
def _collector_paused():
    """The cyclic garbage collector off while a schedule is built (back on after, also on an
    error; left alone when already off). A schedule of hundreds of micro-batches allocates
    hundreds of thousands of actions, none of them in a reference cycle, and each burst of
    allocations would set off collections that walk the whole heap: in a 64-rank plan search
    (``bench_plan_scale``) that was about a fifth of its CPU time."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()



# ----------------------------------------------------------------------------- zero bubble
def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024), one stage per rank.

    The backward is split (``split_backward=True``): B computes input gradients (what the
    previous stage waits for), W the weight gradients (nobody waits for it). Rank ``r`` runs the
    1F1B order of F and B, and places W of micro-batch ``k - r`` right after its ``k``-th B
    (``k >= r``), the ``r`` W's left over at the end: later ranks delay more W's, which fill the
    cool-down bubble. With the same costs on every stage, ``T_W <= T_F``, ``T_W <= T_B`` and
    ``m >= p``, each rank idles ``(p-1)(T_F + T_B - T_W)`` seconds per step, a third of 1F1B's
    ``(p-1)(T_F + T_B + T_W)`` when F = B = W; at most
    ``p`` micro-batches (F done, W not) in flight on every stage (1F1B's peak). Any ``m >= 1``.

    Raises:
        ScheduleError: ``p`` or ``m`` is not a positive integer.
    """
    base = one_f_one_b(p, m)
    acts = []
    for r in range(p):
        lst: list[Action] = []
        nb = nw = 0
        for a in base.actions[r]:
            lst.append(a)
            if a.op is Op.B:
                nb += 1
                if nb > r:
                    lst.append(_W(r, nw))
                    nw += 1
        lst += [_W(r, i) for i in range(nw, m)]
        acts.append(lst)
    return Schedule("zb-h1", p, p, m, stage_to_rank("zb-h1", p, p), acts, split_backward=True)


def _list_schedule(
    name: str, p: int, m: int, stage_to_rank: list[int], limit: int,
    f_s: float = 1.0, b_s: float = 1.0, w_s: float = 1.0, reserve: bool = False,
) -> Schedule:
    """Greedy list scheduling with a split backward (the approach of Qi et al.'s automatic
    schedules): simulate with costs ``f_s``/``b_s``/``w_s`` over the linear stage chain; a rank
    that becomes free starts the earliest-ready action, ties broken B > F > W, then B of the
    lower stage (its gradient unblocks the previous rank) and F of the later stage; an F is
    admitted only while fewer than ``limit`` micro-batches (F done, W not) are held on the rank.
    With ``reserve`` (the V-shape memory-capped schedules, :func:`v_half` / :func:`v_min`) a
    micro-batch entering a rank (F of the rank's lowest stage) reserves a slot for each of the
    rank's stages at once and is admitted only while the reservations fit in ``limit``; F of the
    rank's other stages needs no admission (its slot is reserved), each W frees one. The oldest
    unfinished micro-batch can then always go on (a rank it has not reached yet holds no younger
    one), so the order never gets stuck for ``limit >=`` stages per rank, where the plain count
    can fill a rank with first-arm forwards whose return arm has no room. Deterministic."""
    n = len(stage_to_rank)
    own: list[list[int]] = [[] for _ in range(p)]
    for s, r in enumerate(stage_to_rank):  # O(n), not O(n p)
        own[r].append(s)
    F, B, W = Op.F, Op.B, Op.W
    # finish times of F / B of (stage, micro-batch): done_f[s][i], done_b[s][i]; None: not yet
    # (lists, not a dict keyed by (Op, s, i): hashing an Enum member runs Python code)
    done_f: list[list[float | None]] = [[None] * m for _ in range(n)]
    done_b: list[list[float | None]] = [[None] * m for _ in range(n)]
    t = [0.0] * p
    nextf, nextb = [0] * n, [0] * n
    pendw: list[deque[tuple[int, int]]] = [deque() for _ in range(p)]
    held = [0] * p
    acts: list[list[Action]] = [[] for _ in range(p)]
    last = n - 1
    placed = all(0 <= q < p for q in stage_to_rank)  # no rank index that aliases another

    def rank_best(r: int):
        """The action rank ``r`` would start next: ``(start, prio, key, op, s, i)``, the least
        candidate (ties broken as the docstring says), or None. Depends only on rank ``r``'s
        own state and on the finish times of its stages' neighbours, so it changes only when
        one of those does (see the loop)."""
        tr = t[r]
        best = None
        admit = held[r] < limit
        if reserve:
            admit = held[r] + len(own[r]) <= limit
        for s in own[r]:
            i = nextb[s]
            if i < m:
                dep = done_f[s][i]
                if dep is not None:
                    if s != last:
                        dep = done_b[s + 1][i]
                    if dep is not None:
                        c = (dep if dep > tr else tr, 0, s, B, s, i)  # max(t[r], dep)
                        if best is None or c < best:
                            best = c
            i = nextf[s]
            if i < m and (admit or (reserve and s != own[r][0] and held[r] < limit)):
                dep = 0.0 if s == 0 else done_f[s - 1][i]
                if dep is not None:
                    c = (dep if dep > tr else tr, 1, -s, F, s, i)
                    if best is None or c < best:
                        best = c
        w = pendw[r]
        if w:
            s, i = w[0]
            c = (tr, 2, -s, W, s, i)
            if best is None or c < best:
                best = c
        return best

    # Each rank's next action is cached; after an action of stage s on rank r only ranks r,
    # rank(s-1) and rank(s+1) can change theirs (F of s unblocks F of s+1 and, on the last
    # stage, B of s; B of s unblocks B of s-1), so the order is the same as re-examining every
    # rank each time (the earliest start, ties to the lower rank), in O(actions) rank updates.
    # a heap of (start, rank, version): the smallest entry whose version is the rank's current
    # one is the minimum over ranks of (start, rank) (stale entries are dropped when popped)
    best_of = [rank_best(r) for r in range(p)]
    version = [0] * p
    heap = [(b[0], r, 0) for r, b in enumerate(best_of) if b is not None]
    heapq.heapify(heap)
    heappop, heappush = heapq.heappop, heapq.heappush
    for _ in range(3 * n * m):
        best = None
        while heap:
            _, r, ver = heappop(heap)
            if ver == version[r]:
                best = best_of[r]
                if best is not None:
                    break
        if best is None:  # cannot happen for limit >= 2 stages per rank; guard anyway
            raise ScheduleError(
                f"{name}: the greedy order got stuck with p={p}, m={m} (in-flight limit {limit}); "
                f"use another schedule or raise the limit"
            )
        start, _, _, op, s, i = best
        if op is F:
            t[r] = end = start + f_s
            done_f[s][i] = end
            nextf[s] += 1
            held[r] += 1
        elif op is B:
            t[r] = end = start + b_s
            done_b[s][i] = end
            nextb[s] += 1
            pendw[r].append((s, i))
        else:
            t[r] = start + w_s
            pendw[r].popleft()
            held[r] -= 1
        acts[r].append(Action(op, s, i))
        if placed:
            # only a neighbour that waits for exactly this action can start another one: the
            # next F of stage s+1 (after F of s), the next B of stage s-1 (after B of s); a
            # rank whose inputs did not change keeps its cached action (recomputing it would
            # give the same one, and the heap the same minimum)
            b = best_of[r] = rank_best(r)
            version[r] += 1
            if b is not None:
                heappush(heap, (b[0], r, version[r]))
            q = -1
            if op is F:
                if s < last and nextf[s + 1] == i:
                    q = stage_to_rank[s + 1]
            elif op is B:
                if s > 0 and nextb[s - 1] == i:
                    q = stage_to_rank[s - 1]
            if q >= 0 and q != r:
                b = best_of[q] = rank_best(q)
                version[q] += 1
                if b is not None:
                    heappush(heap, (b[0], q, version[q]))
            continue
        touched = {r}
        if s > 0:
            touched.add(stage_to_rank[s - 1])
        if s < last:
            touched.add(stage_to_rank[s + 1])
        for q in touched:
            b = best_of[q] = rank_best(q)
            version[q] += 1
            if b is not None:
                heappush(heap, (b[0], q, version[q]))
    return Schedule(name, p, n, m, list(stage_to_rank), acts, split_backward=True)


def zb_v(p: int, m: int) -> Schedule:
    """ZB-V (Qi et al., "Pipeline Parallelism with Controllable Memory", 2024): ``2p`` stages in
    V placement (:func:`~fxpipe.plans.placement.stage_to_rank`: rank ``r`` holds stages ``r`` and ``2p-1-r``, so the last
    stage, which computes the loss, sits on rank 0 next to the first), backward split into B
    and W (``split_backward=True``).

    The order comes from greedy list scheduling with unit costs F = B = W (see
    :func:`_list_schedule`): B first, then F, W filling the gaps, at most ``2p`` stage
    micro-batches (F done, W not) held per rank, i.e. the activation memory of 1F1B's first
    rank when a rank's two stages together equal one 1F1B stage. With uniform costs and
    ``m >= 2p`` the idle time per rank is within 2 stage-passes of the ``p-1`` lower bound (rank
    ``p-1`` cannot start before ``p-1`` forwards), against 1F1B's ``6(p-1)`` for the same work.
    Any ``m >= 1``. Stages on the same rank hand values over locally.

    Raises:
        ScheduleError: ``p`` or ``m`` is not a positive integer.
    """
    _check_pm(p, m)
    return _list_schedule("zb-v", p, m, stage_to_rank("zb-v", p, 2 * p), limit=2 * p)


# ----------------------------------------------------------------------------- controllable memory
def v_memory_limit(name: str, p: int) -> int:
    """Stage micro-batches (F done, W not) a rank may hold under the V schedule ``name``: the
    published activation memory of Qi et al. ("Pipeline Parallelism with Controllable Memory",
    NeurIPS 2024, V-shape building blocks), in micro-batches of a 1F1B stage, times 2 (a rank's
    V stage is half a 1F1B stage): ``zb-v`` ``p`` (1F1B's), ``v-half`` ``(p+2)//2``, ``v-min``
    ``(p+4)//3``; ``dualpipev`` ``2p + 1`` stage micro-batches (DeepSeek-V3's "PP+1" with
    PP = 2p stages), which its phases give rather than a cap."""
    if name == "v-half":
        return 2 * ((p + 2) // 2)
    if name == "v-min":
        return 2 * ((p + 4) // 3)
    if name == "dualpipev":
        return 2 * p + 1
    return 2 * p


def v_half(p: int, m: int) -> Schedule:
    """V-Half (Qi et al., "Pipeline Parallelism with Controllable Memory", NeurIPS 2024): ZB-V's
    placement (2 stages per rank in a V, backward split into B and W) with about half of 1F1B's
    activation memory.

    Published: peak activation memory ``(p+2)//2`` micro-batches of a 1F1B stage (1F1B: ``p``),
    bubble rate about ``p/(2m)`` (1F1B: about ``p/m``) with ``T_F = T_B = T_W``.

    Construction (fxpipe's, not the paper's hand-made building block): the greedy list
    scheduler of ZB-V (:func:`_list_schedule`, unit costs, B > F > W, W filling gaps) with the
    rank's held stage micro-batches capped at :func:`v_memory_limit` ``= 2 * ((p+2)//2)``; a
    forward of the rank's first (down-arm) stage is admitted only while it leaves a slot for the
    return arm, so the order never gets stuck. The cap bounds the rank's peak exactly; the bubble
    is what the greedy order gives (BENCHMARKS.md, "Controllable-memory schedules": measured
    against the formula). Any ``m >= 1``.

    Raises:
        ScheduleError: ``p`` or ``m`` is not a positive integer.
    """
    _check_pm(p, m)
    return _list_schedule("v-half", p, m, stage_to_rank("v-half", p, 2 * p),
                          limit=v_memory_limit("v-half", p), reserve=True)


def v_min(p: int, m: int) -> Schedule:
    """V-Min (Qi et al., NeurIPS 2024): ZB-V's placement with about a third of 1F1B's activation
    memory.

    Published: peak activation memory ``(p+4)//3`` micro-batches of a 1F1B stage (1F1B: ``p``),
    bubble rate about ``2p/(3m)`` with ``T_F = T_B = T_W``.

    Construction: as :func:`v_half`, capped at :func:`v_memory_limit` ``= 2 * ((p+4)//3)`` stage
    micro-batches per rank. The greedy order pays more bubble than the paper's building block
    at this cap (measured in BENCHMARKS.md); the memory bound is exact. Any ``m >= 1``.

    Raises:
        ScheduleError: ``p`` or ``m`` is not a positive integer.
    """
    _check_pm(p, m)
    return _list_schedule("v-min", p, m, stage_to_rank("v-min", p, 2 * p),
                          limit=v_memory_limit("v-min", p), reserve=True)


def dualpipev(p: int, m: int) -> Schedule:
    """DualPipeV (DeepSeek-V3's DualPipe cut to a V: DeepSeek-AI, 2024; torch 2.13's
    ``ScheduleDualPipeV``): ZB-V's placement (rank ``r`` holds stages ``r`` and ``2p-1-r``: one
    copy of the parameters), backward split into B and W.

    Rank ``r``'s order, in eight phases (chunk 0 = stage ``r``, chunk 1 = stage ``2p-1-r``; each
    chunk runs its micro-batches in order; a "deferred" B queues its W, which a later "W" pops
    in FIFO order; an undeferred B is followed by its W at once):

    1. ``2(p-1-r)`` forwards of chunk 0;
    2. ``r+1`` times: F chunk 0, F chunk 1;
    3. ``p-1-r`` times: B chunk 1 (deferred), W, F chunk 1;
    4. ``m - 2p + r + 1`` times: F chunk 0 + B chunk 1, then F chunk 1 + B chunk 0 (the
       overlapped pairs of DualPipe; on rank ``p-1`` the first pair runs unpaired);
    5. ``p-1-r`` times: B chunk 1, then F chunk 1 + B chunk 0;
    6. ``r+1`` times: B chunk 1, B chunk 0 (deferred from the middle of the phase on);
    7. ``p-1-r`` times: W, B chunk 0 (deferred);
    8. the remaining W's.

    An overlapped "F + B" pair is two consecutive actions (F first) in this IR: on one CPU
    nothing overlaps, so the simulator and executor run them one after the other.

    Published (DeepSeek-V3 / DualPipe): bubble ``(PP/2-1)(F&B + B - 3W)`` and activation memory
    ``PP+1`` micro-batches of a stage, with PP = 2p stages: ``(p-1)(F&B + B - 3W)`` seconds per
    rank and ``2p+1`` stage micro-batches (1F1B: ``2p``), where ``F&B`` is an overlapped pair's
    time. Without overlap (``F&B = F + B``) and ``F = B = W`` the formula gives 0; the
    simulator gives the ``p-1`` stage-passes of fill that no schedule avoids (BENCHMARKS.md).

    Constraint: ``m >= 2p - 1`` (phase 4 of rank 0 runs ``m - 2p + 1`` times).

    Raises:
        ScheduleError: ``p`` or ``m`` is not a positive integer, or ``m < 2p - 1``.
    """
    _check_pm(p, m)
    if m < 2 * p - 1:
        raise ScheduleError(
            f"dualpipev needs microbatches >= 2 x pipeline - 1 = {2 * p - 1}, got m={m} with "
            f"p={p} (rank 0 warms up with 2(p-1) forwards of its first stage); set "
            f"parallel.microbatches >= {2 * p - 1}, or use 'zb-v'"
        )
    acts: list[list[Action]] = []
    for r in range(p):
        chunk = (r, 2 * p - 1 - r)
        nf, nb = [0, 0], [0, 0]
        deferred: deque[Action] = deque()
        lst: list[Action] = []

        def fwd(c: int) -> None:
            lst.append(_F(chunk[c], nf[c]))
            nf[c] += 1

        def bwd(c: int, defer: bool) -> None:
            s, i = chunk[c], nb[c]
            nb[c] += 1
            lst.append(_B(s, i))
            (deferred.append if defer else lst.append)(_W(s, i))

        def weight() -> None:
            lst.append(deferred.popleft())

        for _ in range(2 * (p - 1 - r)):                     # 1
            fwd(0)
        for _ in range(r + 1):                               # 2
            fwd(0)
            fwd(1)
        for _ in range(p - 1 - r):                           # 3
            bwd(1, True)
            weight()
            fwd(1)
        for _ in range(m - 2 * p + r + 1):                   # 4
            fwd(0)
            bwd(1, False)
            fwd(1)
            bwd(0, False)
        for _ in range(p - 1 - r):                           # 5
            bwd(1, False)
            fwd(1)
            bwd(0, False)
        half, defer = (r + 1) // 2, False                    # 6
        for k in range(r + 1):
            if k == half and r % 2 == 1:
                defer = True
            bwd(1, defer)
            if k == half and r % 2 == 0:
                defer = True
            bwd(0, defer)
        for _ in range(p - 1 - r):                           # 7
            weight()
            bwd(0, True)
        while deferred:                                      # 8
            weight()
        if nf != [m, m] or nb != [m, m]:  # the phase counts add up for every m >= 2p - 1
            raise ScheduleError(f"dualpipev: rank {r} ran {nf} forwards / {nb} backwards of "
                                f"its chunks, not {m} each (p={p}, m={m})")
        acts.append(lst)
    return Schedule("dualpipev", p, 2 * p, m, stage_to_rank("dualpipev", p, 2 * p), acts,
                    split_backward=True)
