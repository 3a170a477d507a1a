"""Exact pipeline-stage partitioning: minimise the slowest stage, subject to memory and placement.

Given a :class:`~fxpipe.partitioner.problem.CutProblem` (units in a fixed topological order, the
values between them, per-stage memory and links), :func:`optimal_partition` finds the cut into
``k`` contiguous non-empty stages whose largest stage cost (compute + communication, seconds per
micro-batch) is the smallest possible, with every stage fitting its device memory, every pinned
unit in its stage and every forced cut honoured. The result is exact for the given order (up to
float rounding), not greedy; tests check it against brute-force enumeration.

Algorithms (chains-on-chains partitioning, Pinar & Aykanat, JPDC 2004; the same recurrence as
PipeDream's planner, Narayanan et al., SOSP 2019):

* ``dp`` (any DAG, skip connections included): ``dp[j][b] = min_a max(dp[j-1][a], cost_j(a, b))``.
  Distinct values received / sent by ``[a, b)`` are not separable in ``a`` and ``b`` once a value
  has several users, so for each end ``b`` the receive and send sums of all starts ``a`` are kept
  in difference arrays updated by O(1) events per (value, user) and read with one cumulative sum;
  each end costs O(k * b) numpy work: O(k n^2) in all, O(n) memory besides the ``k x n`` tables.
* ``chain`` (every value read only by the next unit): ``cost_j(a, b) = F_j(b) - G_j(a)`` is
  separable, so "is bottleneck <= B feasible?" is a sweep with prefix maxima (sparse-table range
  maxima when memory or forced cuts bound the start) in O(k n) numpy work, and a parametric search
  over ``B`` (bisection, snapping to attained stage costs, then a certificate one float below the
  answer) finds the exact optimum in a few dozen sweeps.

:func:`brute_force_partition` enumerates every cut set (the tests' reference). The baselines
live in :mod:`fxpipe.partitioner.baselines`.

Pure Python + numpy; no torch.

Size: over 600 lines because the exact solvers share their bounds and sweeps; the infeasibility
explanation reads their tables."""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass

import numpy as np

from fxpipe.errors import PlanError
from fxpipe.partitioner.problem import (
    CutProblem,
    PartitionResult,
    comm_seconds,
    evaluate,
    stage_memory,
)
from fxpipe.units import human_bytes, plural

__all__ = ["optimal_partition", "brute_force_partition", "Infeasible"]

_NEG = -np.inf

#: Relative slack on a bottleneck bound when pruning stage ends by prefix weights: wide enough
#: that float rounding in the prefix sums never prunes a feasible end.
PRUNE_SLACK = 1e-9
#: Absolute floor of that slack (keeps a zero bound from pruning zero-cost ends).
PRUNE_FLOOR = 1e-300
#: Relative width below which the parametric search stops bisecting values and steps one float
#: below the incumbent instead (a certificate that nothing smaller is feasible).
BISECT_RELATIVE_WIDTH = 1e-9
#: Factor on the lower bound handed to the parametric search, so that a bound attained exactly
#: (up to rounding) is still tested as feasible from below.
LOWER_BOUND_MARGIN = 1 - 1e-12


# ---------------------------------------------------------------------------------------------
# Placement constraints (pins, forced cuts) as index bounds
# ---------------------------------------------------------------------------------------------


@dataclass
class Bounds:
    """Index bounds shared by the solvers, for ``n`` units and ``k`` stages.

    ``start_min[b]``: smallest start ``a`` of a stage ending at ``b`` allowed by forced cuts.
    ``pin_lo[j]``: stage ``j`` must start at or before this (its first pinned unit; ``n`` if none).
    ``end_lo[j]`` / ``end_hi[j]``: allowed ends ``b`` of stage ``j`` (pins, non-empty stages).
    """

    n: int
    k: int
    start_min: np.ndarray
    pin_lo: np.ndarray
    end_lo: np.ndarray
    end_hi: np.ndarray


def index_bounds(n: int, k: int, forced: np.ndarray, pin_units: np.ndarray, pin_stages: np.ndarray) -> Bounds:
    marker = np.full(n + 1, -1, dtype=np.int64)
    if forced.size:
        marker[forced + 2] = forced  # a stage ending at b > f+1 must start after f
    start_min = np.maximum.accumulate(marker) + 1
    pin_lo = np.full(k, n, dtype=np.int64)
    pin_hi = np.full(k, -1, dtype=np.int64)
    for u, s in zip(pin_units.tolist(), pin_stages.tolist()):
        pin_lo[s] = min(pin_lo[s], u)
        pin_hi[s] = max(pin_hi[s], u)
    j = np.arange(k)
    end_lo = np.maximum(j + 1, pin_hi + 1)
    end_hi = n - (k - 1 - j)
    return Bounds(n, k, start_min, pin_lo, end_lo, end_hi)


def _check_structure(problem: CutProblem) -> None:
    """Raise PlanError, naming the conflict and the fix, when stage count, pins and forced cuts
    cannot all hold (memory aside). Passing this check means some partition satisfies them."""
    n, k = problem.n, problem.num_stages
    if k > n:
        raise PlanError(
            f"cannot cut {plural(n, 'unit')} into {plural(k, 'stage')}: every stage needs at least "
            f"one unit; use at most {plural(n, 'pipeline stage')} or price the model at a finer "
            "granularity"
        )
    forced = problem.forced
    if forced.size > k - 1:
        raise PlanError(
            f"{forced.size} forced cuts (pipe_split) make at least {forced.size + 1} stages but only {k} "
            f"were requested; use at least {forced.size + 1} pipeline stages or remove forced cuts"
        )

    def n_forced(lo: int, hi: int) -> int:  # forced cuts after units lo..hi-1
        return int(np.searchsorted(forced, hi, "left") - np.searchsorted(forced, lo, "left"))

    pu, ps = problem.pin_units.tolist(), problem.pin_stages.tolist()
    if not pu:
        return
    u0, s0 = pu[0], ps[0]
    if s0 > u0:
        raise PlanError(
            f"{problem.unit_label(u0)} is pinned to stage {s0} but only {u0} units come before it, too few "
            f"to fill stages 0..{s0 - 1}; pin it to stage {u0} or earlier"
        )
    if n_forced(0, u0) > s0:
        raise PlanError(
            f"{problem.unit_label(u0)} is pinned to stage {s0} but {n_forced(0, u0)} forced cuts come before "
            f"it, which puts it in stage {n_forced(0, u0)} or later; move the pin or the forced cuts"
        )
    for (u, s), (v, t) in zip(zip(pu, ps), zip(pu[1:], ps[1:])):
        if t < s:
            raise PlanError(
                f"{problem.unit_label(v)} is pinned to stage {t} but comes after {problem.unit_label(u)} "
                f"pinned to stage {s}; stages follow the unit order, so fix one of the two pins"
            )
        if t - s > v - u:
            raise PlanError(
                f"{problem.unit_label(u)} (stage {s}) and {problem.unit_label(v)} (stage {t}) are {v - u} "
                f"units apart, too few for the {t - s - 1} stages between them; fix one of the pins"
            )
        f = n_forced(u, v)
        if f > t - s:
            raise PlanError(
                f"{f} forced cuts lie between {problem.unit_label(u)} (pinned to stage {s}) and "
                f"{problem.unit_label(v)} (pinned to stage {t}), more than the {t - s} stage boundaries "
                f"between them; remove forced cuts or change the pins"
            )
    ul, sl = pu[-1], ps[-1]
    if k - 1 - sl > n - 1 - ul:
        raise PlanError(
            f"{problem.unit_label(ul)} is pinned to stage {sl} but only {n - 1 - ul} units follow it, too "
            f"few for stages {sl + 1}..{k - 1}; pin it to a later stage or use fewer stages"
        )
    if n_forced(ul, n) > k - 1 - sl:
        raise PlanError(
            f"{problem.unit_label(ul)} is pinned to stage {sl} but {n_forced(ul, n)} forced cuts follow it, "
            f"more than the {k - 1 - sl} later stages; move the pin or remove forced cuts"
        )


# ---------------------------------------------------------------------------------------------
# General DP (any DAG)
# ---------------------------------------------------------------------------------------------


def _group(e: np.ndarray, *cols: np.ndarray, n: int) -> tuple[np.ndarray, list[np.ndarray]]:
    order = np.argsort(e, kind="stable")
    ptr = np.searchsorted(e[order], np.arange(n + 2))
    return ptr, [c[order] for c in cols]


def _solve_dp(problem: CutProblem, bd: Bounds) -> list[int] | None:
    """Exact O(k n^2) DP for any value structure. Returns stage starts, or None if infeasible."""
    n, k = problem.n, problem.num_stages
    T, P, A = problem.T, problem.P, problem.A
    vt = problem.table
    w = 1.0 + vt.grad
    wb = w * vt.nbytes
    counts = np.diff(vt.user_ptr)
    owner = np.repeat(np.arange(len(vt)), counts)

    # Receive events: when unit u (a user of v) joins the stage ([a, u+1)), v becomes received for
    # starts a in (max(producer, previous user of v), u]: +w*bytes on that range of a.
    first = np.zeros(vt.users.shape[0], dtype=bool)
    first[vt.user_ptr[:-1][counts > 0]] = True
    prev = np.where(first, vt.producer[owner], np.concatenate([[0], vt.users[:-1]]))
    r_end = np.concatenate([vt.users + 1, vt.users + 1])
    r_pos = np.concatenate([prev + 1, vt.users + 1])
    r_wb = np.concatenate([wb[owner], -wb[owner]])
    r_w = np.concatenate([w[owner], -w[owner]])
    r_ptr, (r_pos, r_wb, r_w) = _group(r_end, r_pos, r_wb, r_w, n=n)
    # Send events: v is sent by [a, b) iff a <= producer < b <= last user. Stored at position
    # producer (summed over a <= producer by a suffix sum); active for ends producer+1..last user.
    last = vt.users[vt.user_ptr[1:] - 1] if len(vt) else np.zeros(0, dtype=np.int64)
    s_end = np.concatenate([vt.producer + 1, last + 1])
    s_pos = np.concatenate([vt.producer, vt.producer])
    s_wb = np.concatenate([wb, -wb])
    s_w = np.concatenate([w, -w])
    s_ptr, (s_pos, s_wb, s_w) = _group(s_end, s_pos, s_wb, s_w, n=n)

    DR = np.zeros((2, n + 2))
    DS = np.zeros((2, n + 2))
    lat = float(problem.latency_s)
    mult = float(problem.param_multiplier)
    inv_in = problem.inv_bw_in[:, None]
    inv_out = problem.inv_bw_out[:, None]
    slow = problem.slow[:, None]
    inflight = problem.inflight_arr[:, None]
    cap = None if problem.cap is None else problem.cap[:, None]
    rows = np.arange(k)
    # row j may end at b only inside [end_lo[j], end_hi[j]]; row 0 may only start at 0
    dp = np.full((k, n + 1), np.inf)
    arg = np.zeros((k, n + 1), dtype=np.int64)
    prev_rows = np.full((k, n + 1), np.inf)
    prev_rows[0, 0] = 0.0
    pin_lo = bd.pin_lo[:, None]

    for e in range(1, n + 1):
        for D, ptr, pos, vb, vw in ((DR, r_ptr, r_pos, r_wb, r_w), (DS, s_ptr, s_pos, s_wb, s_w)):
            lo, hi = ptr[e], ptr[e + 1]
            if hi > lo:
                np.add.at(D[0], pos[lo:hi], vb[lo:hi])
                np.add.at(D[1], pos[lo:hi], vw[lo:hi])
        a0 = int(bd.start_min[e])
        active = (bd.end_lo <= e) & (e <= bd.end_hi)
        if a0 >= e or not active.any():
            continue
        R = np.cumsum(DR[:, :e], axis=1)[:, a0:]
        S = np.cumsum(DS[:, e - 1 :: -1], axis=1)[:, ::-1][:, a0:]  # suffix sums over a
        comm = comm_seconds(R[0], R[1], S[0], S[1], inv_in, inv_out, lat)  # (k, e - a0)
        cost = slow * (T[e] - T[a0:e]) + comm
        if cap is not None:
            mem = stage_memory(mult, P[e] - P[a0:e], inflight, A[e] - A[a0:e])
            cost[mem > cap] = np.inf
        cand = np.maximum(prev_rows[:, a0:e], cost)
        cand[np.arange(a0, e)[None, :] > pin_lo] = np.inf
        idx = np.argmin(cand, axis=1)
        best = cand[rows, idx]
        best[~active] = np.inf
        dp[:, e] = best
        arg[:, e] = idx + a0
        if e < n:
            prev_rows[1:, e] = best[:-1]

    if not math.isfinite(dp[k - 1, n]):
        return None
    cuts = [0] * k
    b = n
    for j in range(k - 1, 0, -1):
        b = int(arg[j, b])
        cuts[j] = b
    return cuts


# ---------------------------------------------------------------------------------------------
# Separable solver: cost_j(a, b) = F_j[b] - G_j[a]  (chains, memory, parameter counts)
# ---------------------------------------------------------------------------------------------


def _f2k(x: float) -> int:
    """Order-preserving map from float64 to int (adjacent floats -> adjacent ints)."""
    i = int(np.float64(x).view(np.int64))
    return i if i >= 0 else -(i + (1 << 63))


class SeparableSweep:
    """Minimise ``max_j F[j][b_j] - G[j][a_j]`` over partitions (stage j = [a_j, b_j)).

    ``F``/``G``: per stage float64 ``(n+1,)`` arrays with ``F[j][b] >= G[j][a]`` for ``a < b``.
    ``start_lo``: per stage int ``(n+1,)`` smallest allowed start for each end (memory and forced
    cuts), or None when only the stage count and pins bound the start.
    ``base``: optional nondecreasing ``(n+1,)`` array with ``base[b] - base[a] <= cost_j(a, b)``
    for every stage (the compute prefix sums for the time objective). A sweep at bound ``B`` then
    only visits ends ``b`` with ``base[b] <= (j+1) B`` and ``base[n] - base[b] <= (k-1-j) B``: a band
    around ``(j+1) n / k`` that is narrow near the optimum.

    The feasibility sweep at bound ``B`` keeps, per stage, the ends ``b`` reachable with all
    stages so far costing ``<= B``: ``reach_j(b) = max{G_j[a] : a in window(b), reach_{j-1}(a)}``
    compared with ``F_j[b] - B`` (prefix maxima, or sparse-table range maxima when the start is
    bounded below). A stage cost is compared as ``F[b] - max G <= B``, the same float expression
    :meth:`trace` reports, so the search's answer is an attained bottleneck.
    """

    def __init__(
        self,
        bd: Bounds,
        F: list[np.ndarray],
        G: list[np.ndarray],
        start_lo: list[np.ndarray | None],
        base: np.ndarray | None = None,
    ):
        n, k = bd.n, bd.k
        self.n, self.k, self.F, self.G, self.base = n, k, F, G, base
        b = np.arange(n + 1)
        self.valid: list[np.ndarray] = []
        self.lo: list[np.ndarray | None] = []
        self.hi: list[np.ndarray] = []
        for j in range(k):
            valid = (b >= bd.end_lo[j]) & (b <= bd.end_hi[j])
            hi = np.clip(np.minimum(b - 1, bd.pin_lo[j]), 0, None)
            lo = start_lo[j]
            if j == 0:
                if lo is not None:
                    valid &= lo == 0
                lo = None
            elif lo is not None:
                valid &= lo <= hi
            self.valid.append(valid)
            self.hi.append(hi)
            self.lo.append(lo)
        self.end_lo, self.end_hi = bd.end_lo, bd.end_hi

    def _bands(self, B: float) -> tuple[np.ndarray, np.ndarray]:
        k, n = self.k, self.n
        lo = self.end_lo.copy()
        hi = self.end_hi.copy()
        if self.base is not None and math.isfinite(B):
            W = self.base
            Bm = B * (1 + PRUNE_SLACK) + PRUNE_FLOOR  # conservative: never prunes a feasible end
            j = np.arange(k)
            hi = np.minimum(hi, np.searchsorted(W, (j + 1) * Bm, "right") - 1)
            lo = np.maximum(lo, np.searchsorted(W, W[n] - (k - 1 - j) * Bm, "left"))
        return lo, hi

    @staticmethod
    def _range_max(Gm: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """``max(Gm[lo[i] : hi[i] + 1])`` for every i (-inf where empty), via a sparse table."""
        length = hi - lo + 1
        ok = length >= 1
        out = np.full(lo.shape[0], _NEG)
        if not ok.any():
            return out
        lo, hi, length = lo[ok], hi[ok], length[ok]
        lev = np.frexp(length.astype(np.float64))[1].astype(np.int64) - 1  # floor(log2(length))
        m = Gm.shape[0]
        tab = [Gm]
        for L in range(1, int(lev.max()) + 1):
            h = 1 << (L - 1)
            prev = tab[-1]
            cur = prev.copy()
            np.maximum(prev[: m - h], prev[h:], out=cur[: m - h])
            tab.append(cur)
        flat = np.concatenate(tab)
        out[ok] = np.maximum(flat[lev * m + lo], flat[lev * m + hi - (1 << lev) + 1])
        return out

    def feasible(self, B: float) -> list[tuple[int, np.ndarray]] | None:
        """Per stage ``(offset, reach)``: ``reach[i]`` is True when stages 0..j can end at
        ``offset + i`` with every cost ``<= B``; None when the whole partition cannot."""
        n, k = self.n, self.k
        inf = math.isinf(B)
        blo, bhi = self._bands(B)
        s, e = int(blo[0]), int(bhi[0])
        if e < s:
            return None
        reach = self.valid[0][s : e + 1] & ((self.F[0][s : e + 1] - self.G[0][0]) <= B)
        out = [(s, reach)]
        if k == 1:
            return out if (s <= n <= e and reach[n - s]) else None
        for j in range(1, k):
            o, r = out[-1]
            nz = np.flatnonzero(r)
            if nz.size == 0:
                return None
            o, r = o + int(nz[0]), r[nz[0] : nz[-1] + 1]
            out[-1] = (o, r)
            L = r.shape[0]
            Gm = np.where(r, self.G[j][o : o + L], _NEG)
            if j == k - 1:
                if not self.valid[j][n]:
                    return None
                lo = o if self.lo[j] is None else max(o, int(self.lo[j][n]))
                hi = min(int(self.hi[j][n]), o + L - 1)
                if hi < lo:
                    return None
                M = Gm[lo - o : hi - o + 1].max()
                if not (M > _NEG if inf else (self.F[j][n] - M) <= B):
                    return None
                out.append((n, np.ones(1, dtype=bool)))
                break
            s, e = max(int(blo[j]), o + 1), int(bhi[j])
            if e < s:
                return None
            hi = np.minimum(self.hi[j][s : e + 1], o + L - 1) - o
            if self.lo[j] is None:
                pm = np.maximum.accumulate(Gm)
                M = np.where(hi >= 0, pm[np.clip(hi, 0, None)], _NEG)
            else:
                lo = np.maximum(self.lo[j][s : e + 1], o) - o
                M = self._range_max(Gm, lo, hi)
            reach = self.valid[j][s : e + 1] & ((M > _NEG) if inf else ((self.F[j][s : e + 1] - M) <= B))
            out.append((s, reach))
        return out

    def trace(self, reach: list[tuple[int, np.ndarray]]) -> tuple[list[int], float]:
        """Cuts of a partition witnessed by ``reach`` and its bottleneck (max of F - G)."""
        k = self.k
        cuts = [0] * k
        b = self.n
        worst = -math.inf
        for j in range(k - 1, 0, -1):
            o, r = reach[j - 1]
            lo = o if self.lo[j] is None else max(o, int(self.lo[j][b]))
            hi = min(int(self.hi[j][b]), o + r.shape[0] - 1)
            seg = np.where(r[lo - o : hi - o + 1], self.G[j][lo : hi + 1], _NEG)
            a = lo + int(np.argmax(seg))
            worst = max(worst, float(self.F[j][b] - self.G[j][a]))
            cuts[j] = a
            b = a
        worst = max(worst, float(self.F[0][b] - self.G[0][0]))
        return cuts, worst

    def solve(self, lower_bound: float = 0.0, tolerance: float = 0.0) -> list[int] | None:
        """Exact minimiser by parametric search. ``lower_bound``: a value no partition beats.
        ``tolerance`` > 0: stop once the bracket is that narrow relative to the best found (a
        cut whose bottleneck is within it of the optimum, for ranking many candidates)."""
        r = self.feasible(math.inf)
        if r is None:
            return None
        best, hi = self.trace(r)
        lo = min(float(lower_bound), hi)
        r = self.feasible(lo)
        if r is not None:
            return self.trace(r)[0]
        # invariant: feasible(hi) (hi is an attained bottleneck), not feasible(lo)
        while _f2k(hi) - _f2k(lo) > 1 and hi - lo > tolerance * abs(hi):
            if hi - lo > BISECT_RELATIVE_WIDTH * abs(hi):
                mid = lo + (hi - lo) / 2
            else:  # narrow: try one float below the incumbent (a certificate), else bisect bits
                below = float(np.nextafter(hi, -np.inf))
                r = self.feasible(below)
                if r is None:
                    break
                best, hi = self.trace(r)
                if _f2k(hi) - _f2k(lo) <= 1:
                    break
                kl, kh = _f2k(lo), _f2k(hi)
                km = (kl + kh) // 2
                mid = float(np.int64(km if km >= 0 else -km - (1 << 63)).view(np.float64))
            r = self.feasible(mid)
            if r is None:
                lo = mid
            else:
                best, hi = self.trace(r)
        return best


def _memory_start_lo(problem: CutProblem, j: int) -> np.ndarray:
    """Smallest start a with memory_j(a, b) <= capacity_j, for every end b (int64 ``(n+1,)``);
    uses the exact :func:`stage_memory` formula that :func:`evaluate` uses."""
    P, A, n = problem.P, problem.A, problem.n
    mult, inf, cap = float(problem.param_multiplier), float(problem.inflight_arr[j]), float(problem.cap[j])
    d = stage_memory(mult, P, inf, A)
    b = np.arange(n + 1)
    lo = np.clip(np.searchsorted(d, d - cap, "left"), 0, b)

    def mem(a):
        return stage_memory(mult, P[b] - P[a], inf, A[b] - A[a])

    while True:
        bad = mem(lo) > cap
        if not bad.any():
            break
        lo = lo + bad
    while True:
        can = (lo > 0) & (mem(np.maximum(lo - 1, 0)) <= cap)
        if not can.any():
            break
        lo = lo - can
    return lo


def _start_lo(problem: CutProblem, bd: Bounds, use_memory: bool) -> list[np.ndarray | None]:
    k = problem.num_stages
    forced = problem.forced.size > 0
    out: list[np.ndarray | None] = []
    cache: dict[tuple[float, float], np.ndarray] = {}
    for j in range(k):
        lo = bd.start_min if forced else None
        if use_memory and problem.cap is not None:
            key = (float(problem.inflight_arr[j]), float(problem.cap[j]))
            if key not in cache:
                cache[key] = _memory_start_lo(problem, j)
            m = cache[key]
            lo = m if lo is None else np.maximum(lo, m)
        out.append(lo)
    return out


def _solve_chain(problem: CutProblem, bd: Bounds, tolerance: float = 0.0) -> list[int] | None:
    """Exact parametric search for chains (every value read only by the next unit); with
    ``tolerance``, a cut within it of the optimum (see :meth:`SeparableSweep.solve`)."""
    k, T = problem.num_stages, problem.T
    wb, wc, _ = problem.boundary_comm()
    lat = float(problem.latency_s)
    F, G = [], []
    cache: dict[tuple[float, float, float], tuple[np.ndarray, np.ndarray]] = {}
    for j in range(k):
        s = float(problem.slow[j])
        key = (float(problem.inv_bw_in[j]), float(problem.inv_bw_out[j]), s)
        if key not in cache:
            recv = comm_seconds(wb, wc, 0.0, 0.0, key[0], 0.0, lat)
            send = comm_seconds(0.0, 0.0, wb, wc, 0.0, key[1], lat)
            cache[key] = (s * T + send, s * T - recv)
        F.append(cache[key][0])
        G.append(cache[key][1])
    fastest = float(problem.slow.min())  # prune by the cheapest compute any stage can have
    solver = SeparableSweep(bd, F, G, _start_lo(problem, bd, use_memory=True), base=T * fastest)
    t = np.diff(T)
    lb = max(problem.lower_bound_s, float(t.max()) * fastest) * LOWER_BOUND_MARGIN
    if tolerance > 0:  # the compute-only cut's bottleneck: a tighter start, no more work
        lb = max(lb, chain_bottleneck([float(x) for x in T * fastest], k))
    return solver.solve(lb, tolerance)


def chain_bottleneck(prefix: list[float], k: int, iterations: int = 48) -> float:
    """A lower bound on the slowest of ``k`` contiguous non-empty stages of the units whose
    cumulative costs are ``prefix`` (``prefix[0] = 0``): the best cut of these costs alone (no
    memory, no communication, no pins: each only makes the real cut slower), found by
    bisection with the greedy test of chains-on-chains partitioning (Pinar & Aykanat); the
    bound returned is one the greedy test refutes, so never above the optimum."""
    n = len(prefix) - 1
    if n == 0:
        return 0.0
    biggest = max(prefix[i + 1] - prefix[i] for i in range(n))
    if k >= n:
        return biggest

    def fits(b: float) -> bool:
        pos, parts = 0, 0
        while pos < n:
            nxt = bisect.bisect_right(prefix, prefix[pos] + b, pos) - 1
            if nxt <= pos:
                return False
            pos, parts = nxt, parts + 1
            if parts > k:
                return False
        return True

    lo = max(prefix[-1] / k, biggest) * (1 - 1e-12)  # float sums may round
    hi = prefix[-1]
    if fits(lo):
        return lo
    for _ in range(iterations):
        mid = (lo + hi) / 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return lo


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------


class Infeasible(PlanError):
    """No partition fits (raised by :func:`optimal_partition` with ``explain=False``: the
    message is short; call again with ``explain=True`` for the stage, the bytes and the fix)."""


def optimal_partition(problem: CutProblem, method: str = "auto",
                      explain: bool = True, tolerance: float = 0.0) -> PartitionResult:
    """Exact min-max (bottleneck) partition of the units into ``problem.num_stages`` stages.

    Args:
        problem: the cut problem (units, values, links, memory, pins, forced cuts).
        method: ``"auto"`` (``chain`` when every value is read only by the next unit, else
            ``dp``), ``"dp"`` (any DAG, O(k n^2) time, O(k n) memory) or ``"chain"`` (chains only,
            O(k n) per sweep times a few dozen sweeps).
        explain: build the full explanation of an infeasible problem (costly: it searches the
            split that needs the least memory); False raises :class:`Infeasible` at once.
        tolerance: 0 (exact); > 0: a cut whose bottleneck is within this relative distance of
            the optimum (the chain method stops its search there; the auto search ranks many
            candidates this way and cuts the chosen one exactly).

    Returns:
        :class:`PartitionResult` from :func:`evaluate` on the optimal cuts (``violations`` empty).

    Raises:
        PlanError: no partition exists (more stages than units; pins and forced cuts that
            conflict; no split fits device memory, with the stage, the bytes needed and the fix).
    """
    if method not in ("auto", "dp", "chain"):
        raise PlanError(f"unknown planner method {method!r}; use 'auto', 'dp' or 'chain'")
    _check_structure(problem)
    bd = index_bounds(problem.n, problem.num_stages, problem.forced, problem.pin_units, problem.pin_stages)
    if method == "auto":
        method = "chain" if problem.is_chain else "dp"
    if method == "chain" and not problem.is_chain:
        raise PlanError(
            "method='chain' needs every value to be read only by the next unit, but this problem has "
            "skip connections or multi-user values; use method='dp' (or 'auto')"
        )
    cuts = _solve_chain(problem, bd, tolerance) if method == "chain" else _solve_dp(problem, bd)
    if cuts is None:
        if not explain:
            raise Infeasible(f"no split into {problem.num_stages} stages fits device memory")
        raise _infeasible(problem, bd)
    result = evaluate(problem, cuts, method=method)
    if result.violations:  # the solvers and evaluate share formulas; this would be a bug
        raise PlanError(f"internal planner error, plan violates {result.violations}; please report it")
    return result


def _infeasible(problem: CutProblem, bd: Bounds) -> PlanError:
    """Explain why no partition exists (after :func:`_check_structure` passed)."""
    n, k = problem.n, problem.num_stages
    if problem.cap is None:
        return PlanError(
            f"no partition of {n} units into {k} stages satisfies the pins and forced cuts; "
            f"check fxpipe.annotate() stages and pipe_split() positions"
        )
    # The split needing the least memory (relative to each stage's capacity) still does not fit.
    mult = float(problem.param_multiplier)
    F = [stage_memory(mult, problem.P, float(problem.inflight_arr[j]), problem.A) / float(problem.cap[j]) for j in range(k)]
    solver = SeparableSweep(bd, F, F, _start_lo(problem, bd, use_memory=False))
    cuts = solver.solve(0.0)
    if cuts is None:
        return PlanError(
            f"no partition of {n} units into {k} stages satisfies the pins and forced cuts; "
            f"check fxpipe.annotate() stages and pipe_split() positions"
        )
    res = evaluate(problem, cuts)
    ratio = np.asarray(res.memory_bytes) / np.asarray(problem.cap)
    j = int(np.argmax(ratio))
    a, b = res.stage_ranges[j]
    what = problem.unit_label(a) + " alone" if b - a == 1 else f"units {a}..{b - 1}"
    m = float(problem.inflight_arr[j])
    return PlanError(
        f"no split of {plural(n, 'unit')} into {plural(k, 'stage')} fits device memory: even "
        f"the split that needs the least memory puts {human_bytes(res.memory_bytes[j], decimal=True)} on stage "
        f"{j} ({what}: {human_bytes(res.param_bytes[j], decimal=True)} of parameters x {mult:g} for weights, "
        f"gradients and optimizer state, plus {m:g} micro-batch{'' if m == 1 else 'es'} in flight "
        f"x {human_bytes(res.saved_bytes[j], decimal=True)} of activations) but the device has "
        f"{human_bytes(problem.cap[j], decimal=True)}{_reserved_note(problem, j)}; "
        + _memory_fixes(problem, res, j)
    )


def _reserved_note(problem: CutProblem, j: int) -> str:
    """`` for it (the device's 900 kB less 33 kB of ..., ...)``: what stage ``j``'s capacity
    leaves out (:attr:`~fxpipe.partitioner.problem.CutProblem.reserved`); "" when nothing."""
    terms = problem.reserved_at(j)
    if not terms:
        return ""
    whole = float(problem.cap[j]) + sum(b for _, b in terms)
    return (f" for it (the device's {human_bytes(whole, decimal=True)} less "
            + ", ".join(f"{human_bytes(b, decimal=True)} of {what}" for what, b in terms) + ")")


def _memory_fixes(problem: CutProblem, res: PartitionResult, j: int) -> str:
    """The fixes that apply to stage ``j`` not fitting its memory, as one phrase.

    The planner does not know the schedule's name, only the micro-batches in flight per stage:
    the same number > 1 on every stage is GPipe-like (all ``m`` forwards before any backward),
    so only then is a schedule with fewer in flight (1F1B) suggested. Smaller micro-batches help
    only when activations count; more stages only when the stage holds more than one unit.
    """
    inflight = np.asarray(problem.inflight_arr, dtype=float)
    a, b = res.stage_ranges[j]
    params_alone = float(problem.param_multiplier) * res.param_bytes[j]
    fixes = []
    if b - a > 1:  # a single unit cannot be split further
        fixes.append("more pipeline stages")
    note = ""
    if params_alone < float(problem.cap[j]) and res.saved_bytes[j] > 0:
        if inflight.size and np.all(inflight == inflight[0]) and inflight[0] > 1:
            fixes.append("a schedule that keeps fewer micro-batches in flight (1F1B rather than "
                         "GPipe)")
            fixes.append("a smaller data.batch_size")
        else:
            fixes.append("smaller micro-batches (more micro-batches per step, or a smaller "
                         "data.batch_size)")
        fixes.append("activation recomputation (train.activation_recompute: auto, selective or "
                     "full), which keeps less than the activations")
    elif params_alone >= float(problem.cap[j]):
        note = (f" (the parameters alone, with gradients and optimizer state, need "
                f"{human_bytes(params_alone, decimal=True)})")
    fixes.append("a device with more memory")
    head = ", ".join(fixes[:-1])
    return "use " + (f"{head}, or {fixes[-1]}" if head else fixes[-1]) + note


def brute_force_partition(problem: CutProblem, max_candidates: int = 1_000_000) -> PartitionResult:
    """Optimal partition by enumerating every cut set (for tests and tiny problems).

    Prices each of the C(n-1, k-1) cut sets with :func:`evaluate` and keeps the feasible one with
    the smallest bottleneck (first found on ties).

    Raises:
        PlanError: no cut set satisfies the constraints, or there are more than
            ``max_candidates`` cut sets (use :func:`optimal_partition`).
    """
    n, k = problem.n, problem.num_stages
    if k > n:
        raise PlanError(f"cannot cut {n} units into {k} stages; use at most {n} stages")
    if math.comb(n - 1, k - 1) > max_candidates:
        raise PlanError(
            f"{math.comb(n - 1, k - 1)} cut sets are too many to enumerate; use optimal_partition()"
        )
    best: PartitionResult | None = None
    for rest in itertools.combinations(range(1, n), k - 1):
        r = evaluate(problem, (0, *rest), method="brute_force")
        if r.violations:
            continue
        if best is None or r.bottleneck_s < best.bottleneck_s:
            best = r
    if best is None:
        raise PlanError(f"no partition of {n} units into {k} stages satisfies memory, pins and forced cuts")
    return best


