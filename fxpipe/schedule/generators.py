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

Size: over 600 lines because it holds eight schedule generators and the helpers they share; each
generator is short."""

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
        with collector_paused():
            _CACHE[k] = make()
    return _CACHE[k]


@contextlib.contextmanager
def collector_paused():
    """The cyclic garbage collector off inside (back on after, also on an error; left alone
    when already off). Building a schedule, or planning (:func:`fxpipe.plan`), allocates
    hundreds of thousands of objects, few of them in reference cycles (freed as their last
    reference goes), and each burst of allocations would set off collections that walk the
    whole heap: in a 64-rank plan search (``bench_plan_scale``) that was about a fifth of its
    CPU time, and a tenth of a 1,536-device tensor-parallel plan's. What cycles there are
    (traced graphs) are collected once it is back on."""
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


def _v_block(name: str, p: int) -> tuple[list[int], list[int]]:
    """The building block of V-Half / V-Min on the ``2p`` V stages: the slot (unit-time step,
    F = B = W = 1) at which F and B of micro-batch 0 start on each stage; micro-batch ``i``
    repeats it ``6 i`` slots later (a rank's 6 actions per micro-batch, F, B and W of its two
    stages).

    Derived from the paper's description (Qi et al., NeurIPS 2024, section 4: a building block
    repeated at a fixed interval, its lifespan setting the memory): the F's and B's of a
    micro-batch follow each other through the V with offsets chosen so that (1) every action
    comes after what it depends on, (2) the four F/B slots of a rank are distinct modulo 6
    (the repeated blocks never collide; the two slots left are where the W's go) and (3) the
    time from a stage's F to its W, summed over a rank's two stages, is about ``6 x`` the
    memory wanted. With ``I`` a pause at the tip of the V (``(1)``-``(2)`` fail without it for
    the ``p`` named):

    * ``v-min``: offset 1 everywhere, F of stage ``s`` at ``s``, B at ``4p - 1 + I - s``
      (``I = 2`` when ``3 | p``): a rank's two lifespans add to about ``4p + 4`` slots, a third
      of 1F1B's memory;
    * ``v-half``: F 2 slots apart on the down arm, 1 on the return arm, B 2 apart on the return
      arm and 1 on the down arm (``I = 3`` when ``p`` is even): about ``6p`` slots, a half.

    Rank ``r`` (stages ``r`` and ``2p-1-r``) then has its F's at ``r, 2p-1-r`` and B's at
    ``2p+I+r, 4p+I-1-r`` (V-Min), or at ``2r, 3p-2-r`` and ``3p+I-1+2r, 6p+I-2-r`` (V-Half):
    pairwise distinct modulo 6 for every ``p`` (V-Min: each difference is odd or ``2p + I``,
    which 6 does not divide; V-Half: each is no multiple of 3, or the odd ``3p + I``). With
    the W's in the free slots (:func:`_block_schedule`) a rank's peak is exactly
    :func:`v_memory_limit` once ``m`` is a few times ``p`` (checked by :func:`_capped_v`)."""
    n = 2 * p
    if name == "v-min":
        gap = 2 if p % 3 == 0 else 0
        return list(range(n)), [4 * p - 1 + gap - s for s in range(n)]
    gap = 3 if p % 2 == 0 else 0
    f = [2 * s if s < p else p - 1 + s for s in range(n)]
    b = [6 * p + gap - 2 - s if s < p else 7 * p + gap - 3 - 2 * s for s in range(n)]
    return f, b


def _block_schedule(name: str, p: int, m: int, s2r: list[int],
                    drain: bool = True) -> tuple[Schedule, int]:
    """The per-rank orders of :func:`_v_block` repeated ``m`` times: each rank's F's and B's
    sorted by their slot, each W (first in, first out) in the rank's next slot that no F or B
    takes, the W's left over at the end. Executed as soon as dependencies allow (as the
    simulator and executor do), this is the paper's "squeezed" block schedule: ahead of the
    slots, never behind them, since the slots themselves respect every dependency. The part of
    each rank's list after its last F is then reordered by :func:`_drain_b_first` (unless
    ``drain`` is False); returned with its step length at unit costs."""
    f, b = _v_block(name, p)
    n = 2 * p
    acts: list[list[Action]] = []
    for r in range(p):
        timed = []
        for s in (r, n - 1 - r):
            fs, bs = f[s], b[s]
            for i in range(m):
                timed.append((fs + 6 * i, Action(Op.F, s, i)))
                timed.append((bs + 6 * i, Action(Op.B, s, i)))
        timed.sort(key=lambda x: x[0])
        lst: list[Action] = []
        pend: deque[Action] = deque()
        free = 0  # the first slot not yet taken
        for slot, a in timed:
            while pend and free < slot:
                lst.append(pend.popleft())
                free += 1
            lst.append(a)
            free = slot + 1
            if a.op is Op.B:
                pend.append(Action(Op.W, a.stage, a.microbatch))
        lst.extend(pend)
        acts.append(lst)
    s = Schedule(name, p, n, m, list(s2r), acts, split_backward=True)
    return _drain_b_first(s) if drain else (s, _unit_makespan(s))


def _drain_b_first(s: Schedule) -> tuple[Schedule, int]:
    """``s`` (compute-only, split backward, linear stage chain) with each rank's actions after
    its last F reordered: run in time order with unit costs, a rank there starts its next B
    (in the list's order) when it is ready, else its oldest W whose B is done, else waits for
    the B. Before that point every list keeps its order.

    The drain is where the block schedule loses time to the slots it gave the W's: a B that the
    previous rank waits for sat behind a W. No F follows, so the held micro-batches only fall
    there and the rank's peak does not change; W's only move later, B's earlier. Returns the
    schedule and its step length at unit costs (the last action's end)."""
    p, n, m = s.num_ranks, s.num_stages, s.microbatches
    F, B = Op.F, Op.B
    s2r = s.stage_to_rank
    head: list[list[Action]] = []
    tail_b: list[deque[Action]] = []
    tail_w: list[deque[Action]] = []
    for lst in s.actions:
        last = max((k for k, a in enumerate(lst) if a.op is F), default=-1)
        head.append(lst[:last + 1])
        tail_b.append(deque(a for a in lst[last + 1:] if a.op is B))
        tail_w.append(deque(a for a in lst[last + 1:] if a.op is Op.W))
    done_f = [[-1] * m for _ in range(n)]  # the slot an action ends; -1: not placed yet
    done_b = [[-1] * m for _ in range(n)]
    out: list[list[Action]] = [[] for _ in range(p)]
    pos = [0] * p
    left = sum(len(x) for x in s.actions)
    slot = 0
    # unit costs: walked slot by slot, each rank placing at most one action per slot, from
    # what ended by the slot's start (an action placed in this slot ends after it)
    while left:
        placed = False
        for r in range(p):
            if pos[r] < len(head[r]):
                a = head[r][pos[r]]
                st, i = a.stage, a.microbatch
                if a.op is F:
                    d = 0 if st == 0 else done_f[st - 1][i]
                elif a.op is B:
                    d = done_f[st][i]
                    if d >= 0 and st < n - 1:
                        d = done_b[st + 1][i]
                else:
                    d = done_b[st][i]
                if d < 0 or d > slot:
                    continue
                pos[r] += 1
            else:
                a = None
                if tail_b[r]:
                    b = tail_b[r][0]
                    st, i = b.stage, b.microbatch
                    d = done_f[st][i]
                    if d >= 0 and st < n - 1:
                        d = done_b[st + 1][i]
                    if 0 <= d <= slot:
                        a = tail_b[r].popleft()
                if a is None and tail_w[r] and done_b[tail_w[r][0].stage][
                        tail_w[r][0].microbatch] >= 0:
                    a = tail_w[r].popleft()
                if a is None:
                    continue
            if a.op is F:
                done_f[a.stage][a.microbatch] = slot + 1
            elif a.op is B:
                done_b[a.stage][a.microbatch] = slot + 1
            out[r].append(a)
            left -= 1
            placed = True
        slot += 1
        if not placed and left:  # all placed so far had ended: nothing will change
            raise ScheduleError(f"{s.name}: the action lists deadlock (p={p}, m={m})")
    return Schedule(s.name, p, n, m, list(s2r), out, split_backward=True), slot


def _held_peak(s: Schedule) -> int:
    """The most stage micro-batches (F done, W not) any rank holds, walked in list order."""
    peak = 0
    for acts in s.actions:
        held = 0
        for a in acts:
            if a.op is Op.F:
                held += 1
                if held > peak:
                    peak = held
            elif a.op is Op.W:
                held -= 1
    return peak


def _unit_makespan(s: Schedule) -> int:
    """Step length of a compute-only split-backward schedule over the linear stage chain, every
    F, B and W one time unit, each action started as soon as its rank is free and its inputs
    are done (what the simulator gives with uniform costs and free communication).

    Raises:
        ScheduleError: the lists deadlock (not for the generators' own schedules)."""
    p, n, m = s.num_ranks, s.num_stages, s.microbatches
    F, B = Op.F, Op.B
    done_f = [[-1] * m for _ in range(n)]
    done_b = [[-1] * m for _ in range(n)]
    t = [0] * p
    pos = [0] * p
    nm = n * m  # a waited-for action as an int: F (s, i) -> s m + i, B -> n m + s m + i
    waiting: dict[int, list[int]] = {}
    work = list(range(p))
    while work:
        r = work.pop()
        acts = s.actions[r]
        k, now = pos[r], t[r]
        while k < len(acts):
            a = acts[k]
            op, st, i = a.op, a.stage, a.microbatch
            if op is F:
                dep = 0 if st == 0 else done_f[st - 1][i]
                key = (st - 1) * m + i
            elif op is B:
                dep, key = done_f[st][i], st * m + i
                if dep >= 0 and st < n - 1:
                    dep, key = done_b[st + 1][i], nm + (st + 1) * m + i
            else:
                dep, key = done_b[st][i], nm + st * m + i
            if dep < 0:
                waiting.setdefault(key, []).append(r)
                break
            now = (dep if dep > now else now) + 1
            if op is F:
                done_f[st][i] = now
                key = st * m + i
            elif op is B:
                done_b[st][i] = now
                key = nm + st * m + i
            else:
                key = -1
            if key in waiting:
                work.extend(waiting.pop(key))
            k += 1
        pos[r], t[r] = k, now
    if any(pos[r] < len(s.actions[r]) for r in range(p)):
        raise ScheduleError(f"{s.name}: the action lists deadlock (p={p}, m={m})")
    return max(t)


def _capped_v(name: str, p: int, m: int) -> Schedule:
    """V-Half / V-Min: of two orders that both hold at most :func:`v_memory_limit` stage
    micro-batches per rank, the one with the shorter step at unit costs (F = B = W; the block
    schedule on a tie):

    * the building-block schedule (:func:`_block_schedule`), the paper's construction, whose
      bubble follows the published formula (BENCHMARKS.md, "v-schedules");
    * the greedy list schedule of ZB-V under the cap (:func:`_list_schedule` with ``reserve``),
      which wins at ``p = 2`` (both caps are ZB-V's ``2p`` there, the block would leave them
      unused) and for ``m`` below about ``p`` (too few micro-batches to fill a block).

    The block schedule's peak equals the cap for every ``p`` from 1 to 64 (tests); it is checked
    here all the same, and the greedy order taken should it ever exceed it. From ``m >= 3p``
    (``p > 2``) the block's step is the shorter everywhere checked (``p`` up to 64, tests), so
    the greedy order is not built there (the planner builds these schedules for every layout
    it weighs)."""
    limit = v_memory_limit(name, p)
    s2r = stage_to_rank(name, p, 2 * p)
    block, step = _block_schedule(name, p, m, s2r)
    if p > 2 and m >= 3 * p and _held_peak(block) <= limit:
        return block
    greedy = _list_schedule(name, p, m, s2r, limit, reserve=True)
    if _held_peak(block) > limit or _unit_makespan(greedy) < step:
        return greedy
    return block


def v_half(p: int, m: int) -> Schedule:
    """V-Half (Qi et al., "Pipeline Parallelism with Controllable Memory", NeurIPS 2024): ZB-V's
    placement (2 stages per rank in a V, backward split into B and W) with about half of 1F1B's
    activation memory.

    Published: peak activation memory ``(p+2)//2`` micro-batches of a 1F1B stage (1F1B: ``p``),
    bubble rate about ``p/(2m)`` (1F1B: about ``p/m``) with ``T_F = T_B = T_W``.

    Construction (:func:`_capped_v`): the paper's building block repeated every 6 slots
    (:func:`_v_block`, :func:`_block_schedule`), or the greedy list schedule of ZB-V capped at
    :func:`v_memory_limit` ``= 2 * ((p+2)//2)`` stage micro-batches per rank where that gives
    the shorter step at unit costs. Either holds at most the cap (the block exactly). With
    ``F = B = W`` the block's fill and drain add at most ``3.2p`` slots per rank to the ``6m``
    of work (``p <= 64``), against the ``3p`` that ``p/(2m)`` of ``6m`` is: the bubble stays
    below ``1.07 x p/(2m)`` for every ``m`` (below ``p/(2m)`` for ``p <= 16`` and ``m`` up to
    ``8p``), and below 1F1B's (BENCHMARKS.md, "v-schedules"). Any ``m >= 1``.

    Raises:
        ScheduleError: ``p`` or ``m`` is not a positive integer.
    """
    _check_pm(p, m)
    return _capped_v("v-half", p, m)


def v_min(p: int, m: int) -> Schedule:
    """V-Min (Qi et al., NeurIPS 2024): ZB-V's placement with about a third of 1F1B's activation
    memory.

    Published: peak activation memory ``(p+4)//3`` micro-batches of a 1F1B stage (1F1B: ``p``),
    bubble rate about ``2p/(3m)`` with ``T_F = T_B = T_W``.

    Construction: as :func:`v_half`, capped at :func:`v_memory_limit` ``= 2 * ((p+4)//3)``
    stage micro-batches per rank. With ``F = B = W`` the block's fill and drain add less than
    ``4p`` slots per rank (``p <= 64``), the ``4p`` that ``2p/(3m)`` of ``6m`` is: the bubble
    stays below ``2p/(3m)`` for every ``m``, and below 1F1B's (BENCHMARKS.md, "v-schedules").
    Any ``m >= 1``.

    Raises:
        ScheduleError: ``p`` or ``m`` is not a positive integer.
    """
    _check_pm(p, m)
    return _capped_v("v-min", p, m)


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
