"""Refining a measured-cost cut with whole-stage timings (``cluster.measure_stages``).

A plan's stage times are sums of per-node times, and those sums can be off where nodes run
faster or slower back to back than one by one (see :mod:`fxpipe.partitioner.stage_timing`).
:func:`refine_cuts` checks the planned cut against the stages themselves:

1. time the cut's stages whole, and give every unit of a stage one factor for its forward and
   one for its backward, so that the stage's sums equal what was timed (:func:`calibrated`);
2. solve the cut again with those unit times; while the cut moves to one not yet timed (at most
   ``max_cuts`` cuts in all), time it and go on from its stages' times;
3. time all the cuts visited again side by side (one interleaved run, so that the machine's
   speed drifting between the rounds decides nothing), price each with its own stages' times
   and keep the fastest simulated step.

The functions here only do the arithmetic; the planner passes in how to solve a cut, simulate
a step and time stages (:func:`fxpipe.partitioner.driver.plan_with_graph`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

__all__ = ["Refinement", "calibrated", "refine_cuts"]

#: cuts timed at most in one refinement (the first included)
MAX_CUTS = 4


def calibrated(raw: np.ndarray, cuts: Sequence[int], measured: Sequence[tuple[float, float]]
               ) -> np.ndarray:
    """Unit times ``(n, 3)`` (forward, input-gradient, weight-gradient) from ``raw`` with every
    stage of ``cuts`` (stage starts) scaled to its ``measured`` ``(forward, backward)`` seconds:
    one factor for the forward and one for the backward (input- and weight-gradient alike) per
    stage. A stage whose units sum to 0 gets the measured time spread evenly over its units."""
    raw = np.asarray(raw, dtype=np.float64).reshape(-1, 3)
    out = raw.copy()
    ends = list(cuts[1:]) + [len(raw)]
    for (a, b), (f_s, b_s) in zip(zip(cuts, ends), measured):
        part = raw[a:b]
        pf, pb = part[:, 0].sum(), part[:, 1:].sum()
        out[a:b, 0] = part[:, 0] * (f_s / pf) if pf > 0 else f_s / (b - a)
        if pb > 0:
            out[a:b, 1:] = part[:, 1:] * (b_s / pb)
        else:
            out[a:b, 1], out[a:b, 2] = b_s / (b - a), 0.0
    return out


@dataclass
class Refinement:
    """What :func:`refine_cuts` found.

    Attributes:
        cuts: the stage starts chosen.
        times: ``(n, 3)`` unit times calibrated on the chosen cut's stages.
        visited: every cut timed, the planned one first.
        measured: per visited cut, ``(forward, backward)`` seconds per stage, timed side by side
            (one run; the first round's timing when only one cut was visited).
        step_s: per visited cut, the simulated step with its own stages' times.
    """

    cuts: list[int]
    times: np.ndarray
    visited: list[list[int]] = field(default_factory=list)
    measured: list[list[tuple[float, float]]] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)

    @property
    def moved(self) -> bool:
        """Whether the chosen cut differs from the planned one."""
        return self.cuts != self.visited[0]


def refine_cuts(raw: np.ndarray, first: Sequence[int],
                solve: Callable[[np.ndarray], Sequence[int]],
                step_s: Callable[[np.ndarray, Sequence[int]], float],
                measure: Callable[[list[list[int]]], list[list[tuple[float, float]]]],
                max_cuts: int = MAX_CUTS) -> Refinement:
    """Refine the cut ``first`` (see the module doc).

    Args:
        raw: ``(n, 3)`` per-unit times the cut was planned with.
        first: the planned stage starts.
        solve: unit times -> the optimal stage starts under them.
        step_s: (unit times, stage starts) -> the simulated step's seconds.
        measure: list of cuts -> per cut, ``(forward, backward)`` seconds of each stage.
    """
    visited = [list(first)]
    measured = measure([visited[0]])
    times = calibrated(raw, visited[0], measured[0])
    while len(visited) < max(1, max_cuts):
        nxt = [int(c) for c in solve(times)]
        if nxt in visited:
            break
        visited.append(nxt)
        times = calibrated(raw, nxt, measure([nxt])[0])
    if len(visited) > 1:
        measured = measure(visited)
    cal = [calibrated(raw, c, m) for c, m in zip(visited, measured)]
    steps = [float(step_s(t, c)) for t, c in zip(cal, visited)]
    best = min(range(len(visited)), key=lambda i: (steps[i], i))
    return Refinement(visited[best], cal[best], visited, [list(m) for m in measured], steps)
