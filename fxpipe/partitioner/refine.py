"""Refining a measured-cost cut with whole-stage timings (``cluster.measure_stages``).

A plan's stage times are sums of per-node times, and those sums can be off where nodes run
faster or slower back to back than one by one (see :mod:`fxpipe.partitioner.stage_timing`).
:func:`refine_cuts` checks the planned cut against the stages themselves:

1. time the cut's stages whole, and give every unit of a stage one factor for its forward and
   one for its backward, so that the stage's sums equal what was timed (:func:`calibrated`);
2. solve the cut again with those unit times; while the cut moves to one not yet timed (at most
   ``max_cuts`` cuts in all), time it and go on from its stages' times;
3. add the near ties (:func:`near_cuts`): cuts that move one stage boundary of the cut reached
   and whose simulated step under the last calibration is within ``NEAR`` of its step. The
   calibration is one factor per stage, so between such cuts it decides nothing: on a
   vocabulary-head LM two cuts a block apart were predicted 0.2% apart and ran 5% apart in one
   run of the pick benchmark and equal in another. Up to ``MAX_RIVALS`` of them, spread as far
   apart as the tie allows, are timed too;
4. time all the cuts visited again side by side (one interleaved run, so that the machine's
   speed drifting between the rounds decides nothing), price each with its own stages' times
   and keep the fastest simulated step.

The functions here only do the arithmetic; the planner passes in how to solve a cut, simulate
a step and time stages (:func:`fxpipe.partitioner.driver.plan_with_graph`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

__all__ = ["Refinement", "calibrated", "near_cuts", "refine_cuts"]

#: cuts the solver visits at most in one refinement (the first included)
MAX_CUTS = 4
#: near ties timed besides them at most
MAX_RIVALS = 3
#: a cut whose simulated step is within this share of the chosen one's is a near tie
NEAR = 0.03
#: positions tried per stage boundary and direction at most (a wider range is strided)
_SCAN = 128


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


def near_cuts(times: np.ndarray, cuts: Sequence[int],
              step_s: Callable[[np.ndarray, Sequence[int]], float], near: float = NEAR,
              limit: int = MAX_RIVALS) -> list[list[int]]:
    """Up to ``limit`` cuts that move one stage boundary of ``cuts`` (stage starts) and whose
    simulated step (``step_s`` under the unit times ``times``; ``inf`` for a cut that breaks a
    constraint) is at most ``(1 + near)`` times that of ``cuts``.

    Each boundary is moved outwards, one position at a time (strided where its range is wide),
    until the step passes ``(1 + 2 near)`` times the cut's or the next boundary is reached. Of
    the cuts found, the ones kept are spread out: each next one is the farthest, in the unit
    times moved across boundaries, from the cut and the ones kept before it; a cut that moves
    less than 1% of a mean stage's time is no rival."""
    times = np.asarray(times, dtype=np.float64).reshape(-1, 3)
    n, k = len(times), len(cuts)
    if limit <= 0 or k < 2:
        return []
    prefix = np.concatenate([[0.0], np.cumsum(times.sum(axis=1))])
    base = float(step_s(times, list(cuts)))
    if not np.isfinite(base) or base <= 0:
        return []
    found: list[list[int]] = []
    for j in range(1, k):
        lo, hi = cuts[j - 1] + 1, (cuts[j + 1] if j + 1 < k else n) - 1
        stride = max(1, (hi - lo + 1) // _SCAN)
        for d in (-1, 1):
            p = cuts[j] + d * stride
            while lo <= p <= hi:
                c = list(cuts)
                c[j] = p
                s = float(step_s(times, c))
                if s <= base * (1 + near):
                    found.append(c)
                elif s > base * (1 + 2 * near):
                    break
                p += d * stride

    def apart(a: Sequence[int], b: Sequence[int]) -> float:
        return float(sum(abs(prefix[x] - prefix[y]) for x, y in zip(a, b)))

    least = 0.01 * prefix[-1] / k
    kept: list[list[int]] = []
    while found and len(kept) < limit:
        far = [min(apart(c, o) for o in [list(cuts)] + kept) for c in found]
        i = max(range(len(found)), key=lambda q: (far[q], -q))
        if far[i] < least:
            break
        kept.append(found.pop(i))
    return kept


@dataclass
class Refinement:
    """What :func:`refine_cuts` found.

    Attributes:
        cuts: the stage starts chosen.
        times: ``(n, 3)`` unit times calibrated on the chosen cut's stages.
        visited: every cut timed, the planned one first, the near ties last.
        rivals: how many of ``visited`` are near ties (:func:`near_cuts`).
        measured: per visited cut, ``(forward, backward)`` seconds per stage, timed side by side
            (one run; the first round's timing when only one cut was visited).
        step_s: per visited cut, the simulated step with its own stages' times.
    """

    cuts: list[int]
    times: np.ndarray
    visited: list[list[int]] = field(default_factory=list)
    measured: list[list[tuple[float, float]]] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    rivals: int = 0

    @property
    def moved(self) -> bool:
        """Whether the chosen cut differs from the planned one."""
        return self.cuts != self.visited[0]


def refine_cuts(raw: np.ndarray, first: Sequence[int],
                solve: Callable[[np.ndarray], Sequence[int]],
                step_s: Callable[[np.ndarray, Sequence[int]], float],
                measure: Callable[[list[list[int]]], list[list[tuple[float, float]]]],
                max_cuts: int = MAX_CUTS, max_rivals: int = MAX_RIVALS) -> Refinement:
    """Refine the cut ``first`` (see the module doc).

    Args:
        raw: ``(n, 3)`` per-unit times the cut was planned with.
        first: the planned stage starts.
        solve: unit times -> the optimal stage starts under them.
        step_s: (unit times, stage starts) -> the simulated step's seconds.
        measure: list of cuts -> per cut, ``(forward, backward)`` seconds of each stage.
        max_cuts / max_rivals: cuts the solver may visit / near ties timed besides them.
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
    rivals = [c for c in near_cuts(times, visited[-1], step_s, limit=max_rivals)
              if c not in visited]
    visited += rivals
    if len(visited) > 1:
        measured = measure(visited)
    cal = [calibrated(raw, c, m) for c, m in zip(visited, measured)]
    steps = [float(step_s(t, c)) for t, c in zip(cal, visited)]
    best = min(range(len(visited)), key=lambda i: (steps[i], i))
    return Refinement(visited[best], cal[best], visited, [list(m) for m in measured], steps,
                      len(rivals))
