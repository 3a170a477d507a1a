"""Communication lowering: a compute-only schedule plus the stage graph's edges becomes the full
per-rank action list (sends, receives, the per-stage data-parallel ALLREDUCE and the STEP).

Takes a :class:`~fxpipe.schedule.actions.Schedule` from :mod:`fxpipe.schedule.generators` and the
``(producer_stage, consumer_stage)`` edges (from a Plan: :func:`schedule_for_plan`); gives the
schedule that the simulator prices and the executor runs.
"""

from __future__ import annotations

from collections.abc import Iterable

from fxpipe.errors import ScheduleError
from fxpipe.schedule.actions import Action, Op, Schedule
from fxpipe.schedule.generators import compute_schedule

Edge = tuple[int, int]


def linear_edges(num_stages: int) -> set[Edge]:
    """The plain chain ``{(0, 1), (1, 2), ..., (n-2, n-1)}`` (no skip connections)."""
    return {(s, s + 1) for s in range(num_stages - 1)}


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


def communication_peers(
    schedule: Schedule,
    edges: Iterable[Edge],
    grad_edges: Iterable[Edge] | None = None,
) -> tuple[dict[int, list[int]], dict[int, list[int]], dict[int, list[int]], dict[int, list[int]]]:
    """The peers :func:`add_communication` inserts messages with, after its checks (the same
    errors, in the same order): ``(producers, consumers, grad_producers, grad_consumers)``,
    each ``{stage: [stage on another rank, ascending]}`` over ``edges`` / ``grad_edges``. F of
    stage ``s`` receives from ``producers[s]`` and sends to ``consumers[s]``; B of ``s``
    receives gradients from ``grad_consumers[s]`` and sends them back to
    ``grad_producers[s]``.

    Raises:
        ScheduleError: as :func:`add_communication`.
    """
    edges = set(edges)
    grad_edges = edges if grad_edges is None else set(grad_edges)
    if not grad_edges <= edges:
        raise ScheduleError(
            f"grad_edges {sorted(grad_edges - edges)} are not in edges; gradients can only flow "
            f"back along edges that carry forward values"
        )
    compute = (Op.F, Op.B, Op.W)
    for r, acts in enumerate(schedule.actions):
        for a in acts:
            if a.op not in compute:
                raise ScheduleError(
                    f"add_communication expects a compute-only schedule, but rank {r} already "
                    f"has {a}; pass the generator's output (e.g. one_f_one_b(p, m))"
                )
    prod, cons = _cross_rank(schedule, edges, "forward")
    gprod, gcons = _cross_rank(schedule, grad_edges, "gradient")
    return prod, cons, gprod, gcons


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
    prod, cons, gprod, gcons = communication_peers(schedule, edges, grad_edges)
    F, B = Op.F, Op.B
    RECV_F, SEND_F, RECV_B, SEND_B = Op.RECV_F, Op.SEND_F, Op.RECV_B, Op.SEND_B
    last_op = Op.W if schedule.split_backward else Op.B
    out_actions: list[list[Action]] = []
    for acts in schedule.actions:
        lst: list[Action] = []
        put = lst.append
        last_idx: dict[int, int] = {}
        for a in acts:
            op = a.op
            if op is F:
                s, i = a.stage, a.microbatch
                for q in prod[s]:
                    put(Action(RECV_F, s, i, q))
                put(a)
                for c in cons[s]:
                    put(Action(SEND_F, s, i, c))
            elif op is B:
                s, i = a.stage, a.microbatch
                for c in gcons[s]:
                    put(Action(RECV_B, s, i, c))
                put(a)
                for q in gprod[s]:
                    put(Action(SEND_B, s, i, q))
            else:
                put(a)
            if op is last_op:
                last_idx[a.stage] = len(lst)  # insertion point: after a's trailing sends
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
        name: one of :data:`fxpipe.specs.schema.SCHEDULES`.
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


def schedule_for_plan(plan, name: str | None = None, microbatches: int | None = None) -> Schedule:
    """Full schedule for a Plan: ``build_schedule(plan.schedule, plan.pipeline,
    plan.microbatches, plan.virtual_stages, edges, grad_edges)`` with the plan's stage edges
    (:meth:`~fxpipe.plans.plan.Plan.edge_bytes`).

    ``name`` / ``microbatches`` override the plan's (to price alternatives).

    Raises:
        ScheduleError: the plan's parameters do not suit the schedule, or ``plan.num_stages``
            differs from the schedule's stage count.
    """
    fwd, grad = plan.edge_bytes()
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
