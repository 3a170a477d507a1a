"""Timelines as Chrome trace JSON (open in chrome://tracing or https://ui.perfetto.dev).

The simulator (:mod:`fxpipe.schedule.simulate`) and the executor produce the same event tuples
``(rank, name, start_s, end_s[, lane])``, from simulated or wall-clock seconds, so a predicted and
a measured timeline can be laid side by side. Format: the Trace Event Format's complete events
(``"ph": "X"``, ``ts``/``dur`` in microseconds); one process (``pid``) per rank, thread 0 for the
rank's own sequence of actions (compute, blocking receives, step) and thread 1 for asynchronous
communication (sends in flight, data-parallel all-reduce).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

from fxpipe.schedule.actions import COMM_OPS, COMPUTE_OPS, Action, Op

#: lane names -> Chrome thread id inside a rank's process
LANES = {"compute": 0, "comm": 1}


class TimelineEvent(NamedTuple):
    """One action on one rank.

    Attributes:
        rank: pipeline rank (Chrome ``pid``).
        name: label, see :func:`action_label` (e.g. ``"F3 s0"``).
        start_s / end_s: seconds from the start of the step (or any common origin).
        lane: ``"compute"`` (the rank's sequential actions) or ``"comm"`` (asynchronous
            transfers and all-reduces that overlap with compute).
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
