"""The schedule timeline picture: one row per rank, what each rank does when, idle left blank.

Takes timeline events (:class:`~fxpipe.schedule.timeline.TimelineEvent`: the simulator's, or
the measured ones of ``timeline.json``) and gives a matplotlib figure of one or more panels
stacked on **one time axis** (milliseconds from the start of each panel's step):

* a row per rank; each event a bar coloured by its kind (F, B, W, send, receive, all-reduce,
  step, optimizer: :data:`~fxpipe.reports.figures.KIND_COLORS`), idle time left blank: a
  blocking receive and the STEP that waits for the all-reduces are thin lines through the row
  (what the rank waits for); the ``comm`` lane (transfers in flight, all-reduces running behind
  the compute) is a thin bar under the row;
* each rank's bubble (idle share of the step, busy = F/B/W as in the simulator) in the right
  margin, and the panel's mean in its title.

:func:`simulated_panel` prices the plan's schedule (:func:`fxpipe.schedule.plan_price.simulate_plan`);
:func:`measured_panel` picks one step of a measured timeline (the step of median length, the
first excluded: it pays for start-up), with its rows the global ranks. SVG ids:
``<panel id>-row-<rank>`` (one per row), ``<panel id>-bubble-<rank>``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fxpipe.plans.placement import rank_coords
from fxpipe.reports.figures import KIND_COLORS, new_figure, save_figure, styled
from fxpipe.schedule.timeline import (EVENT_KINDS, TimelineEvent, event_kind, idle_fractions,
                                      split_steps, step_window)
from fxpipe.units import ms

if TYPE_CHECKING:  # annotations only
    from fxpipe.plans.plan import Plan

#: kinds whose bars mostly span a wait (a blocking receive, STEP waiting for the all-reduces):
#: drawn as a thin line through the row, so that idle time reads as blank
WAIT_KINDS = ("receive", "step")

#: legend text of the kinds
KIND_LABELS = {"F": "F (forward)", "B": "B (backward)", "W": "W (weight grads)",
               "receive": "receive (and its wait)", "step": "step (waits for all-reduces)",
               "all-reduce": "all-reduce", "optimizer": "optimizer",
               "tensor": "tensor-group collective (inside F / B / W)"}

__all__ = ["TimelinePanel", "simulated_panel", "measured_panel", "measured_steps_summary",
           "timeline_figure", "write_timeline_picture"]


@dataclass
class TimelinePanel:
    """One panel: ``events`` drawn from ``window[0]``; a row per entry of ``ranks`` (labelled by
    ``labels``); ``bubble``: rank -> idle fraction (computed from the events when None);
    ``ident``: the SVG id prefix (``timeline-simulated``)."""

    title: str
    events: list[TimelineEvent]
    ranks: list[int]
    window: tuple[float, float]
    labels: dict[int, str] = field(default_factory=dict)
    bubble: dict[int, float] | None = None
    ident: str = "timeline"

    def bubbles(self) -> dict[int, float]:
        """Rank -> idle share of the window."""
        if self.bubble is None:
            self.bubble = idle_fractions(self.events, self.ranks, self.window)
        return self.bubble

    @property
    def length_s(self) -> float:
        return self.window[1] - self.window[0]


def _microbatches(m: int) -> str:
    return f"{m} micro-batch" + ("" if m == 1 else "es")


def simulated_panel(plan: "Plan", result=None, schedule: str | None = None,
                    title: str | None = None, ident: str = "timeline-simulated") -> TimelinePanel:
    """The simulator's step of ``plan`` (or of its ``result``, a
    :class:`~fxpipe.schedule.simulate.SimResult`), one row per pipeline rank."""
    if result is None:
        from fxpipe.schedule.plan_price import simulate_plan

        result = simulate_plan(plan, schedule)
    p = len(result.idle_fraction)
    ranks = list(range(p))
    stages: dict[int, list[int]] = {}
    for e in result.events:
        if event_kind(e.name) in ("F", "B", "W"):
            s = e.name.split(" s")[-1]
            if s.isdigit():
                stages.setdefault(e.rank, [])
                if int(s) not in stages[e.rank]:
                    stages[e.rank].append(int(s))
    labels = {r: f"rank {r}" + (f"\nstage {', '.join(map(str, sorted(stages[r])))}"
                                if stages.get(r) else "") for r in ranks}
    name = schedule or plan.schedule
    bub = dict(enumerate(result.idle_fraction))
    return TimelinePanel(
        title or (f"simulated: {name}, {_microbatches(plan.microbatches)}, "
                  f"step {ms(result.step_time_s)} ms, bubble {100 * result.bubble_fraction:.1f} %"
                  " (pipeline ranks; every replica the same)"),
        list(result.events), ranks, (0.0, result.step_time_s), labels, bub, ident)


def _measured_steps(events: Iterable[Sequence]) -> list[tuple[float, list[TimelineEvent]]]:
    return [(step_window(s)[1] - step_window(s)[0], s) for s in split_steps(events)]


def measured_steps_summary(events: Iterable[Sequence], ranks: Iterable[int] | None = None
                           ) -> dict[str, float] | None:
    """Measured figures of a multi-step timeline: ``steps``, ``step_time_s`` and
    ``bubble_fraction`` (each step's mean idle share over the ranks), each the median over the
    steps, the first excluded when there are several. None when there is no step."""
    steps = _measured_steps(events)
    if not steps:
        return None
    body = steps[1:] if len(steps) > 1 else steps
    rs = sorted(set(ranks) if ranks is not None else {e.rank for _, s in steps for e in s})
    bubbles = []
    for _, evs in body:
        idle = idle_fractions(evs, rs, step_window(evs))
        bubbles.append(sum(idle.values()) / max(1, len(idle)))
    return {"steps": float(len(steps)), "step_time_s": statistics.median(d for d, _ in body),
            "bubble_fraction": statistics.median(bubbles)}


def measured_panel(events: Iterable[Sequence], plan: "Plan | None" = None,
                   step: int | None = None, title: str | None = None,
                   ident: str = "timeline-measured") -> TimelinePanel:
    """One measured step (``step``, or the step of median length with the first one excluded),
    one row per global rank (labelled with its pipeline rank and replica when ``plan`` is
    given).

    Raises:
        ValueError: no events, or ``step`` out of range.
    """
    steps = _measured_steps(events)
    if not steps:
        raise ValueError("the timeline has no events")
    if step is None:
        body = list(range(1, len(steps))) if len(steps) > 1 else [0]
        order = sorted(body, key=lambda k: steps[k][0])
        step = order[len(order) // 2]
    if not 0 <= step < len(steps):
        raise ValueError(f"step {step} is not in the timeline's {len(steps)} steps")
    evs = steps[step][1]
    ranks = sorted({e.rank for e in evs})
    if plan is not None:
        ranks = sorted(set(ranks) | set(range(plan.world_size)))
        labels = {}
        t = getattr(plan, "tensor", 1)
        for r in ranks:
            pr, d = rank_coords(r, plan.pipeline, plan.dp, plan.placement, t)
            labels[r] = f"rank {r}\npipe {pr}, replica {d}" + (f", tp {r % t}" if t > 1 else "")
    else:
        labels = {r: f"rank {r}" for r in ranks}
    window = step_window(evs)
    panel = TimelinePanel("", list(evs), ranks, window, labels, None, ident)
    bub = panel.bubbles()
    mean = sum(bub.values()) / max(1, len(bub))
    panel.title = title or (f"measured: step {step} of {len(steps)} (median length, first "
                            f"excluded), {ms(panel.length_s)} ms, bubble {100 * mean:.1f} %")
    return panel


def timeline_figure(panels: Sequence[TimelinePanel], title: str | None = None):
    """The panels stacked on one time axis (ms from each panel's start), as a ``Figure``.

    Raises:
        ValueError: no panel.
    """
    from matplotlib.patches import Patch

    if not panels:
        raise ValueError("timeline_figure needs at least one panel")
    rows = [len(p.ranks) for p in panels]
    span_ms = max(p.length_s for p in panels) * 1e3 or 1.0
    with styled():
        fig = new_figure(11.0, 1.2 + sum(0.5 * r + 0.75 for r in rows))
        axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False,
                            gridspec_kw={"height_ratios": [r + 1.2 for r in rows]})[:, 0]
        kinds_seen: set[str] = set()
        for ax, panel in zip(axes, panels):
            t0 = panel.window[0]
            row_of = {r: i for i, r in enumerate(panel.ranks)}
            bars: dict[tuple[int, str, str], list[tuple[float, float]]] = {}
            for e in panel.events:
                if e.rank not in row_of or e.end_s <= e.start_s:
                    continue
                kind = event_kind(e.name)
                bars.setdefault((e.rank, kind, e.lane), []).append(
                    ((e.start_s - t0) * 1e3, (e.end_s - e.start_s) * 1e3))
                kinds_seen.add(kind)
            for (rank, kind, lane), xr in sorted(bars.items()):
                y = row_of[rank]
                if lane == "compute" and kind in WAIT_KINDS:  # mostly waiting: a thin line,
                    ax.broken_barh(xr, (y - 0.09, 0.14), facecolors=KIND_COLORS[kind],  # so
                                   edgecolor="none")  # idle time still reads as blank
                elif lane == "comm":
                    ax.broken_barh(xr, (y + 0.26, 0.16), facecolors=KIND_COLORS[kind],
                                   edgecolor="none", alpha=0.9)
                elif lane == "tensor":  # inside the F / B bars: a strip along their bottom
                    ax.broken_barh(xr, (y + 0.08, 0.14), facecolors=KIND_COLORS[kind],
                                   edgecolor="none", zorder=3)
                else:
                    ax.broken_barh(xr, (y - 0.34, 0.56), facecolors=KIND_COLORS[kind],
                                   edgecolor="white", linewidth=0.3)
            bub = panel.bubbles()
            for r, i in row_of.items():
                t = ax.text(1.005, i, f"bubble {100 * bub.get(r, 0.0):.1f} %",
                            transform=ax.get_yaxis_transform(), va="center", ha="left",
                            fontsize=8.5)
                t.set_gid(f"{panel.ident}-bubble-{r}")
            ax.set_yticks(range(len(panel.ranks)))
            ax.set_yticklabels([panel.labels.get(r, f"rank {r}") for r in panel.ranks],
                               fontsize=8)
            for i, lab in enumerate(ax.get_yticklabels()):
                lab.set_gid(f"{panel.ident}-row-{panel.ranks[i]}")
            ax.set_ylim(len(panel.ranks) - 0.4, -0.6)
            ax.set_title(panel.title, loc="left", fontsize=9.5)
            ax.grid(axis="x", color="#dddddd", linewidth=0.6)
            ax.set_axisbelow(True)
            for side in ("top", "right"):
                ax.spines[side].set_visible(False)
        axes[-1].set_xlim(0, span_ms * 1.01)
        axes[-1].set_xlabel("milliseconds from the start of the step (same axis for every "
                            "panel)")
        handles = [Patch(facecolor=KIND_COLORS[k], label=KIND_LABELS.get(k, k)) for k in EVENT_KINDS
                   if k in kinds_seen or k in ("F", "B", "send", "receive", "all-reduce")]
        fig.legend(handles=handles, loc="upper center", ncol=min(5, len(handles)), fontsize=8,
                   frameon=False, bbox_to_anchor=(0.5, 0.0))
        if title:
            fig.suptitle(title, x=0.01, ha="left", y=1.0, va="top", fontsize=10)
        h = fig.get_figheight()
        fig.subplots_adjust(left=0.1, right=0.88, top=1 - 0.55 / h, bottom=0.62 / h,
                            hspace=0.45)
    return fig


def write_timeline_picture(panels: Sequence[TimelinePanel], out_dir: str | Path,
                           stem: str = "timeline", title: str | None = None) -> list[Path]:
    """Draw :func:`timeline_figure` and write ``<stem>.png`` / ``<stem>.svg``."""
    return save_figure(timeline_figure(panels, title), out_dir, stem)
