"""Schedule generators: per-rank action lists for GPipe, 1F1B, interleaved 1F1B, ZB-H1 and ZB-V.

Every generator first builds the *compute-only* lists (F, B and, for zero-bubble schedules, W
actions; see :mod:`fxpipe.runtime.actions`), then :func:`add_communication` inserts the
point-to-point sends/receives implied by the stage graph's edges, the per-stage data-parallel
ALLREDUCE and the final STEP. :func:`build_schedule` does both by schedule name.

Notation: ``p`` pipeline ranks, ``m`` micro-batches per step, ``v`` (virtual) stages per rank,
``s`` stage index. Stages are numbered in pipeline (topological) order: a value flows from a
lower-numbered stage to a higher one. Edges are ``(producer_stage, consumer_stage)`` pairs, and
may skip stages (``(0, 2)``).

References: GPipe (Huang et al., 2019); 1F1B (PipeDream-Flush, Narayanan et al., 2021);
interleaved 1F1B (Megatron-LM, Narayanan et al., SC'21); ZB-H1 and ZB-V (Qi et al., "Zero Bubble
Pipeline Parallelism", ICLR 2024 / "Pipeline Parallelism with Controllable Memory", 2024).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Callable

from fxpipe.runtime.actions import Action, Op, Schedule
from fxpipe.runtime.validate import ScheduleError

Edge = tuple[int, int]

#: Names accepted by :func:`build_schedule` (same spelling as the spec's ``parallel.schedule``).
SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")


# ----------------------------------------------------------------------------- helpers
def linear_edges(num_stages: int) -> set[Edge]:
    """The plain chain ``{(0, 1), (1, 2), ..., (n-2, n-1)}`` (no skip connections)."""
    return {(s, s + 1) for s in range(num_stages - 1)}


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
    return Schedule("gpipe", p, p, m, list(range(p)), acts, split_backward=False)


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
    return Schedule("1f1b", p, p, m, list(range(p)), acts, split_backward=False)


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
    s2r = [s % p for s in range(p * v)]
    return Schedule("interleaved", p, p * v, m, s2r, acts, split_backward=False)


# ----------------------------------------------------------------------------- communication
def _cross_rank(
    schedule: Schedule, edges: Iterable[Edge], what: str
) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """Validate edges; return (producers_of, consumers_of) restricted to cross-rank pairs."""
    n = schedule.num_stages
    prod: dict[int, list[int]] = {s: [] for s in range(n)}
    cons: dict[int, list[int]] = {s: [] for s in range(n)}
    for e in sorted(set(edges)):
        q, c = e
        if q < 0:  # model input: fed from data on every stage, never communicated
            continue
        if not (0 <= q < n and 0 <= c < n):
            raise ScheduleError(
                f"{what} edge {e} names a stage outside 0..{n - 1} (the schedule has {n} "
                f"stages); pass edges between existing stages"
            )
        if q >= c:
            raise ScheduleError(
                f"{what} edge {e} does not go forward: producer stage {q} must be lower than "
                f"consumer stage {c} (stages are numbered in pipeline order)"
            )
        if schedule.stage_to_rank[q] != schedule.stage_to_rank[c]:
            prod[c].append(q)
            cons[q].append(c)
    return prod, cons


def add_communication(
    schedule: Schedule,
    edges: Iterable[Edge],
    grad_edges: Iterable[Edge] | None = None,
) -> Schedule:
    """Return a new schedule with communication, all-reduce and step actions inserted.

    For each edge ``(q, c)`` whose stages sit on different ranks:
      * ``SEND_F(stage=q, mb, peer=c)`` right after ``F(q, mb)`` and ``RECV_F(stage=c, mb,
        peer=q)`` right before ``F(c, mb)``;
      * if the edge is in ``grad_edges``: ``SEND_B(stage=c, mb, peer=q)`` right after
        ``B(c, mb)`` and ``RECV_B(stage=q, mb, peer=c)`` right before ``B(q, mb)``.
    Several receives before one action are ordered by peer stage (ascending), as are sends.
    Stages on the same rank (interleaved / V placements) exchange values locally: no action.
    Edges from a negative producer (model inputs, ``MODEL_INPUT``) are ignored: every stage reads
    its inputs and targets from the data loader.

    Then ``ALLREDUCE(stage)`` after the last ``B`` of that stage on its rank (the last ``W`` when
    the backward is split), placed after the sends that follow it, and ``STEP`` at the end of
    every rank's list.

    Args:
        schedule: compute-only schedule (F/B/W actions only).
        edges: ``(producer_stage, consumer_stage)`` pairs that carry forward values.
        grad_edges: the edges whose values get gradients (floating-point values). Default: all
            ``edges``.

    Raises:
        ScheduleError: the schedule already holds non-compute actions, or an edge is malformed.
    """
    edges = set(edges)
    grad_edges = edges if grad_edges is None else set(grad_edges)
    if not grad_edges <= edges:
        raise ScheduleError(
            f"grad_edges {sorted(grad_edges - edges)} are not in edges; gradients can only flow "
            f"back along edges that carry forward values"
        )
    for r, acts in enumerate(schedule.actions):
        for a in acts:
            if a.op not in (Op.F, Op.B, Op.W):
                raise ScheduleError(
                    f"add_communication expects a compute-only schedule, but rank {r} already "
                    f"has {a}; pass the generator's output (e.g. one_f_one_b(p, m))"
                )
    prod, cons = _cross_rank(schedule, edges, "forward")
    gprod, gcons = _cross_rank(schedule, grad_edges, "gradient")
    last_op = Op.W if schedule.split_backward else Op.B
    out_actions: list[list[Action]] = []
    for acts in schedule.actions:
        lst: list[Action] = []
        last_idx: dict[int, int] = {}
        for a in acts:
            s, i = a.stage, a.microbatch
            if a.op is Op.F:
                lst += [Action(Op.RECV_F, s, i, q) for q in prod[s]]
                lst.append(a)
                lst += [Action(Op.SEND_F, s, i, c) for c in cons[s]]
            elif a.op is Op.B:
                lst += [Action(Op.RECV_B, s, i, c) for c in gcons[s]]
                lst.append(a)
                lst += [Action(Op.SEND_B, s, i, q) for q in gprod[s]]
            else:
                lst.append(a)
            if a.op is last_op:
                last_idx[s] = len(lst)  # insertion point: after a's trailing sends
        for s, pos in sorted(last_idx.items(), key=lambda kv: -kv[1]):
            lst.insert(pos, Action(Op.ALLREDUCE, s))
        stages = schedule.stages_of_rank(len(out_actions))
        lst.append(Action(Op.STEP, stages[0] if stages else -1))
        out_actions.append(lst)
    return Schedule(
        schedule.name,
        schedule.num_ranks,
        schedule.num_stages,
        schedule.microbatches,
        list(schedule.stage_to_rank),
        out_actions,
        schedule.split_backward,
    )


# ----------------------------------------------------------------------------- dispatch
def compute_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """Compute-only schedule by name (see :data:`SCHEDULE_NAMES`).

    ``v`` is the number of stages per rank: 1 for ``gpipe``, ``1f1b``, ``zb-h1``; any ``v >= 1``
    for ``interleaved``; 2 for ``zb-v`` (``v=1`` is accepted and read as 2).

    Raises:
        ScheduleError: unknown name, or parameters the schedule cannot satisfy (the message says
            which constraint and how to fix it).
    """
    gens: dict[str, Callable[[], Schedule]] = {
        "gpipe": lambda: gpipe(p, m),
        "1f1b": lambda: one_f_one_b(p, m),
        "interleaved": lambda: interleaved_1f1b(p, m, v),
        "zb-h1": lambda: zb_h1(p, m),
        "zb-v": lambda: zb_v(p, m),
    }
    key = name.lower().replace("_", "-")
    aliases = {"one-f-one-b": "1f1b", "interleaved-1f1b": "interleaved", "zbh1": "zb-h1",
               "zbv": "zb-v"}
    key = aliases.get(key, key)
    if key not in gens:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULE_NAMES)}")
    if key in ("gpipe", "1f1b", "zb-h1") and v != 1:
        raise ScheduleError(
            f"schedule {key!r} places one stage per rank, but virtual_stages={v}; set "
            f"virtual_stages: 1, or use 'interleaved' (any v) or 'zb-v' (v=2)"
        )
    if key == "zb-v" and v not in (1, 2):
        raise ScheduleError(
            f"schedule 'zb-v' places exactly 2 stages per rank (V shape), but virtual_stages={v}; "
            f"set virtual_stages: 2"
        )
    return gens[key]()


def build_schedule(
    name: str,
    num_ranks: int,
    microbatches: int,
    virtual_stages: int = 1,
    edges: Iterable[Edge] | None = None,
    grad_edges: Iterable[Edge] | None = None,
) -> Schedule:
    """Full schedule (compute + communication + ALLREDUCE + STEP) for one pipeline group.

    Args:
        name: ``gpipe``, ``1f1b``, ``interleaved``, ``zb-h1`` or ``zb-v``.
        num_ranks: pipeline ranks ``p``.
        microbatches: micro-batches per step ``m``.
        virtual_stages: stages per rank ``v`` (see :func:`compute_schedule`).
        edges: ``(producer_stage, consumer_stage)`` pairs over the ``p * v`` stages. Default: the
            linear chain :func:`linear_edges`.
        grad_edges: edges whose values get gradients; default all ``edges``.

    Raises:
        ScheduleError: bad name or parameters, or malformed edges.
    """
    sched = compute_schedule(name, num_ranks, microbatches, virtual_stages)
    if edges is None:
        edges = linear_edges(sched.num_stages)
    return add_communication(sched, edges, grad_edges)


# ----------------------------------------------------------------------------- from a Plan
def plan_edges(plan) -> tuple[dict[Edge, int], dict[Edge, int]]:
    """Stage edges of a :class:`fxpipe.plan_data.Plan` with their bytes per micro-batch.

    Returns ``(edge_bytes, grad_edge_bytes)``: ``{(producer_stage, consumer_stage): bytes}``
    summed over the values crossing that pair (model inputs excluded), and the same restricted to
    floating-point values (those whose gradients flow back, ``ValueInfo.requires_grad``).
    """
    fwd: dict[Edge, int] = {}
    grad: dict[Edge, int] = {}
    for val in plan.values.values():
        if val.producer < 0:
            continue
        for c in val.consumers:
            if c == val.producer:
                continue
            fwd[(val.producer, c)] = fwd.get((val.producer, c), 0) + int(val.nbytes)
            if val.requires_grad:
                grad[(val.producer, c)] = grad.get((val.producer, c), 0) + int(val.nbytes)
    return fwd, grad


def schedule_for_plan(plan, name: str | None = None, microbatches: int | None = None) -> Schedule:
    """Full schedule for a Plan: ``build_schedule(plan.schedule, plan.pipeline,
    plan.microbatches, plan.virtual_stages, edges, grad_edges)`` with the plan's stage edges.

    ``name`` / ``microbatches`` override the plan's (to price alternatives).

    Raises:
        ScheduleError: the plan's parameters do not suit the schedule, or ``plan.num_stages``
            differs from the schedule's stage count.
    """
    fwd, grad = plan_edges(plan)
    name = name or plan.schedule
    m = microbatches or plan.microbatches
    v = plan.virtual_stages
    sched = compute_schedule(name, plan.pipeline, m, v)
    if sched.num_stages != plan.num_stages:
        raise ScheduleError(
            f"schedule {name!r} with pipeline={plan.pipeline}, virtual_stages={v} has "
            f"{sched.num_stages} stages but the plan has {plan.num_stages}; re-plan with "
            f"{sched.num_stages} stages"
        )
    return add_communication(sched, set(fwd), set(grad))


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
    return Schedule("zb-h1", p, p, m, list(range(p)), acts, split_backward=True)


def v_placement(p: int) -> list[int]:
    """V-shape placement of ``2p`` stages: rank ``r`` holds stages ``r`` and ``2p-1-r`` (the
    first and the last stage are both on rank 0)."""
    return [s if s < p else 2 * p - 1 - s for s in range(2 * p)]


def _list_schedule(
    name: str, p: int, m: int, stage_to_rank: list[int], limit: int,
    f_s: float = 1.0, b_s: float = 1.0, w_s: float = 1.0,
) -> Schedule:
    """Greedy list scheduling with a split backward (the approach of Qi et al.'s automatic
    schedules): simulate with costs ``f_s``/``b_s``/``w_s`` over the linear stage chain; a rank
    that becomes free starts the earliest-ready action, ties broken B > F > W, then B of the
    lower stage (its gradient unblocks the previous rank) and F of the later stage; an F is
    admitted only while fewer than ``limit`` micro-batches (F done, W not) are held on the rank.
    Deterministic."""
    n = len(stage_to_rank)
    own: list[list[int]] = [[] for _ in range(p)]
    for s, r in enumerate(stage_to_rank):  # O(n), not O(n p)
        own[r].append(s)
    done: dict[tuple[Op, int, int], float] = {}
    t = [0.0] * p
    nextf, nextb = [0] * n, [0] * n
    pendw: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    held = [0] * p
    acts: list[list[Action]] = [[] for _ in range(p)]
    for _ in range(3 * n * m):
        best = None
        for r in range(p):
            cands = []
            for s in own[r]:
                i = nextb[s]
                if i < m and (Op.F, s, i) in done:
                    dep = done[(Op.F, s, i)] if s == n - 1 else done.get((Op.B, s + 1, i))
                    if dep is not None:
                        cands.append((max(t[r], dep), 0, s, Op.B, s, i))
                i = nextf[s]
                if i < m and held[r] < limit:
                    dep = 0.0 if s == 0 else done.get((Op.F, s - 1, i))
                    if dep is not None:
                        cands.append((max(t[r], dep), 1, -s, Op.F, s, i))
            if pendw[r]:
                s, i = pendw[r][0]
                cands.append((t[r], 2, -s, Op.W, s, i))
            if cands:
                c = min(cands)
                if best is None or (c[0], r) < (best[1][0], best[0]):
                    best = (r, c)
        if best is None:  # cannot happen for limit >= 2 stages per rank; guard anyway
            raise ScheduleError(
                f"{name}: the greedy order got stuck with p={p}, m={m} (in-flight limit {limit}); "
                f"use another schedule or raise the limit"
            )
        r, (start, _, _, op, s, i) = best
        t[r] = start + {Op.F: f_s, Op.B: b_s, Op.W: w_s}[op]
        done[(op, s, i)] = t[r]
        acts[r].append(Action(op, s, i))
        if op is Op.F:
            nextf[s] += 1
            held[r] += 1
        elif op is Op.B:
            nextb[s] += 1
            pendw[r].append((s, i))
        else:
            pendw[r].pop(0)
            held[r] -= 1
    return Schedule(name, p, n, m, list(stage_to_rank), acts, split_backward=True)


def zb_v(p: int, m: int) -> Schedule:
    """ZB-V (Qi et al., "Pipeline Parallelism with Controllable Memory", 2024): ``2p`` stages in
    V placement (:func:`v_placement`: rank ``r`` holds stages ``r`` and ``2p-1-r``, so the last
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
    return _list_schedule("zb-v", p, m, v_placement(p), limit=2 * p)
