"""Timelines as Chrome trace JSON (open in chrome://tracing or https://ui.perfetto.dev).

The simulator (:mod:`fxpipe.schedule.simulate`) and the executor produce the same event tuples
``(rank, name, start_s, end_s[, lane])``, from simulated or wall-clock seconds, so a predicted and
a measured timeline can be laid side by side. Format: the Trace Event Format's complete events
(``"ph": "X"``, ``ts``/``dur`` in microseconds); one process (``pid``) per rank, thread 0 for the
rank's own sequence of actions (compute, blocking receives, step) and thread 1 for asynchronous
communication (sends in flight, data-parallel all-reduce).

:func:`read_chrome_trace` reads such a file back; :func:`event_kind` names what an event is
(F / B / W / send / receive / all-reduce / step / optimizer), :func:`split_steps` cuts a
measured timeline of many steps into steps, and :func:`idle_fractions` gives each rank's idle
share of a window with the simulator's definition of the bubble (busy = F/B/W only).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

from fxpipe.schedule.actions import COMM_OPS, COMPUTE_OPS, Action, Op

#: lane names -> Chrome thread id inside a rank's process
LANES = {"compute": 0, "comm": 1, "tensor": 2}

#: label of the event a training loop records around its optimizer step (gradient clipping,
#: ``optimizer.step()``, the learning-rate schedule, ``zero_grad``), outside the schedule
OPTIMIZER_LABEL = "OPTIMIZER"

#: what an event is, by the head of its label (see :func:`event_kind`)
EVENT_KINDS = ("F", "B", "W", "send", "receive", "all-reduce", "step", "optimizer", "tensor",
               "other")

#: kinds that count as busy in the bubble (as in the simulator): compute only
BUSY_KINDS = ("F", "B", "W")


class TimelineEvent(NamedTuple):
    """One action on one rank.

    Attributes:
        rank: pipeline rank (Chrome ``pid``).
        name: label, see :func:`action_label` (e.g. ``"F3 s0"``).
        start_s / end_s: seconds from the start of the step (or any common origin).
        lane: ``"compute"`` (the rank's sequential actions), ``"comm"`` (asynchronous
            transfers and all-reduces that overlap with compute) or ``"tensor"`` (the tensor
            group's collectives inside a stage's F / B / W, labelled ``TP <kind> <bytes>``).
    """

    rank: int
    name: str
    start_s: float
    end_s: float
    lane: str = "compute"


def action_label(action: Action) -> str:
    """Readable label: ``F3 s0`` (forward, micro-batch 3, stage 0), ``SEND_F3 s0->1``,
    ``RECV_B3 s1<-2``, ``ALLREDUCE s0``, ``STEP``."""
    a = action
    if a.op in COMPUTE_OPS:
        return f"{a.op.value}{a.microbatch} s{a.stage}"
    if a.op in COMM_OPS:
        arrow = "->" if a.op in (Op.SEND_F, Op.SEND_B) else "<-"
        return f"{a.op.value}{a.microbatch} s{a.stage}{arrow}{a.peer}"
    if a.op is Op.ALLREDUCE:
        return f"ALLREDUCE s{a.stage}"
    return a.op.value


def _category(name: str) -> str:
    head = name.split(" ")[0].rstrip("0123456789")
    return head or "other"


def chrome_trace(
    events: Iterable[Sequence], process_name: str = "fxpipe", rank_offset: int = 0
) -> dict:
    """Trace Event Format dict ``{"traceEvents": [...], "displayTimeUnit": "ms"}``.

    Args:
        events: ``(rank, name, start_s, end_s)`` or ``(rank, name, start_s, end_s, lane)`` tuples
            (e.g. :class:`TimelineEvent`); times in seconds.
        process_name: prefix of each rank's process name (``"<process_name> rank 0"``).
        rank_offset: added to ``pid`` (to put two timelines, e.g. simulated and measured, in one
            file without clashing).

    Raises:
        ValueError: an event has an end before its start or an unknown lane.
    """
    out: list[dict] = []
    ranks: set[int] = set()
    for ev in events:
        rank, name, start, end = int(ev[0]), str(ev[1]), float(ev[2]), float(ev[3])
        lane = ev[4] if len(ev) > 4 else "compute"
        if lane not in LANES:
            raise ValueError(f"event {tuple(ev)}: unknown lane {lane!r}; use one of {list(LANES)}")
        if end < start:
            raise ValueError(
                f"event {tuple(ev)}: ends before it starts; pass (rank, name, start_s, end_s)"
            )
        ranks.add(rank)
        out.append(
            {
                "name": name,
                "cat": _category(name),
                "ph": "X",
                "ts": start * 1e6,
                "dur": (end - start) * 1e6,
                "pid": rank + rank_offset,
                "tid": LANES[lane],
            }
        )
    meta = []
    for r in sorted(ranks):
        pid = r + rank_offset
        meta.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                     "args": {"name": f"{process_name} rank {r}"}})
        meta.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
                     "args": {"sort_index": pid}})
        for lane, tid in LANES.items():
            meta.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                         "args": {"name": lane}})
    return {"traceEvents": meta + out, "displayTimeUnit": "ms"}


def write_chrome_trace(
    events: Iterable[Sequence],
    path: str | Path,
    process_name: str = "fxpipe",
    rank_offset: int = 0,
) -> Path:
    """Write ``events`` as Chrome trace JSON to ``path`` (parent folders created).

    See :func:`chrome_trace` for the arguments. Returns the path written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(events, process_name, rank_offset)))
    return path


def event_kind(name: str) -> str:
    """What the event labelled ``name`` is: one of :data:`EVENT_KINDS` (``"F3 s0"`` -> ``F``,
    ``"SEND_B1 s1->0"`` -> ``send``, ``"RECV_F0 s1<-0"`` -> ``receive``, ``"ALLREDUCE s0"`` ->
    ``all-reduce``, ``"STEP"`` -> ``step``, :data:`OPTIMIZER_LABEL` -> ``optimizer``,
    ``"TP all-reduce 16 kB"`` -> ``tensor``)."""
    head = str(name).split(" ")[0].rstrip("0123456789")
    if head in ("F", "B", "W"):
        return head
    if head.startswith("SEND"):
        return "send"
    if head.startswith("RECV"):
        return "receive"
    return {"ALLREDUCE": "all-reduce", "STEP": "step", OPTIMIZER_LABEL: "optimizer",
            "TP": "tensor"}.get(head, "other")


def read_chrome_trace(source: str | Path | dict) -> list[TimelineEvent]:
    """The events of a trace written by :func:`write_chrome_trace` (a path, or its dict), in
    file order: ``pid`` is the rank (``rank_offset`` 0), ``tid`` the lane, times in seconds.

    Raises:
        ValueError: not a Chrome trace (no ``traceEvents`` list), or an event lacks a field.
    """
    data = source if isinstance(source, dict) else json.loads(Path(source).read_text())
    evs = data.get("traceEvents") if isinstance(data, dict) else None
    if not isinstance(evs, list):
        raise ValueError(f"{source if not isinstance(source, dict) else 'trace'}: not a Chrome "
                         "trace (no traceEvents list)")
    lanes = {tid: lane for lane, tid in LANES.items()}
    out = []
    for ev in evs:
        if not isinstance(ev, dict) or ev.get("ph") != "X":
            continue
        try:
            start = float(ev["ts"]) / 1e6
            out.append(TimelineEvent(int(ev["pid"]), str(ev["name"]), start,
                                     start + float(ev["dur"]) / 1e6,
                                     lanes.get(int(ev.get("tid", 0)), "compute")))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"trace event {ev}: {type(e).__name__}: {e}") from None
    return out


def split_steps(events: Iterable[Sequence]) -> list[list[TimelineEvent]]:
    """Cut a timeline of several training steps into steps.

    On every rank a step ends with its ``STEP`` event; an :data:`OPTIMIZER_LABEL` event right
    after it belongs to that step too. Step ``k`` holds the ``k``-th step of every rank (steps
    that not every rank has, e.g. a last one cut short, are dropped). A timeline without
    ``STEP`` events is one step.

    Returns:
        One list of :class:`TimelineEvent` per step, in order, each sorted by (rank, start).
    """
    per_rank: dict[int, list[TimelineEvent]] = {}
    for ev in events:
        e = TimelineEvent(*ev)
        per_rank.setdefault(e.rank, []).append(e)
    if not per_rank:
        return []
    steps_of: dict[int, list[list[TimelineEvent]]] = {}
    for rank, evs in per_rank.items():
        evs.sort(key=lambda e: (e.start_s, e.end_s))
        steps: list[list[TimelineEvent]] = []
        cur: list[TimelineEvent] = []
        for e in evs:
            kind = event_kind(e.name)
            if kind == "optimizer" and steps and not cur:
                steps[-1].append(e)
                continue
            cur.append(e)
            if kind == "step":
                steps.append(cur)
                cur = []
        if cur:
            steps.append(cur)
        steps_of[rank] = steps
    n = min(len(s) for s in steps_of.values())
    return [sorted((e for r in sorted(steps_of) for e in steps_of[r][k]),
                   key=lambda e: (e.rank, e.start_s)) for k in range(n)]


def step_window(events: Iterable[Sequence]) -> tuple[float, float]:
    """``(first start, last end)`` over ``events`` (``(0, 0)`` when empty)."""
    evs = list(events)
    if not evs:
        return 0.0, 0.0
    return min(float(e[2]) for e in evs), max(float(e[3]) for e in evs)


def idle_fractions(events: Iterable[Sequence], ranks: Iterable[int] | None = None,
                   window: tuple[float, float] | None = None) -> dict[int, float]:
    """Per rank, the idle share of ``window`` (default: the events' own span): ``1 - busy /
    length`` where busy counts F/B/W seconds only (:data:`BUSY_KINDS`), the simulator's
    definition of the bubble. ``ranks``: the ranks to report (a rank with no event is idle
    throughout); default the ranks in ``events``."""
    evs = [TimelineEvent(*e) for e in events]
    start, end = window if window is not None else step_window(evs)
    length = end - start
    rs = sorted(set(ranks) if ranks is not None else {e.rank for e in evs})
    busy = {r: 0.0 for r in rs}
    for e in evs:
        if e.rank in busy and event_kind(e.name) in BUSY_KINDS:
            busy[e.rank] += max(0.0, min(e.end_s, end) - max(e.start_s, start))
    return {r: (1.0 - busy[r] / length if length > 0 else 0.0) for r in rs}
