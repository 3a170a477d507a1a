"""Planner speed: the exact partitioner alone on large synthetic problems (no torch).

Issue 2's target: a synthetic 100,000-unit chain into 16 stages in at most 1 s. Also timed: the
same chain with per-stage memory limits (1F1B in-flight activations) and two nodes (a slow
inter-node boundary), and a 2,000-unit DAG with skip connections into 8 stages (general O(k n^2)
dynamic program; target: a few seconds, taken as 3 s).

Each case is solved ``--repeats`` times; the median solve time is reported (problem construction
timed separately). For context the table also gives the optimum against the lower bound
(total compute / stages) and the two baselines (equal layers, parameter balancing) priced by the
same cost function, and a cross-check runs the chain search and the general DP on the same
2,000-unit chain (they must agree).

Run ``python benchmarks/bench_planner_speed.py``; it prints the figures and rewrites the
``planner-speed`` section of BENCHMARKS.md (``--no-write`` to skip, ``--out`` for another file).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `fxpipe` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from benchmarks._report import BENCHMARKS_MD, markdown_table, write_section
from fxpipe.specs.schema import (DEFAULT_INTER_NODE_GBPS, DEFAULT_INTRA_NODE_GBPS,  # noqa: E402
                                 DEFAULT_LATENCY_S, OPTIMIZER_STATE_FACTOR)
from fxpipe.partitioner.baselines import equal_layers_partition, param_balanced_partition
from fxpipe.partitioner.problem import CutProblem, Value, inflight_1f1b, node_boundary_bandwidths
from fxpipe.partitioner.solvers import optimal_partition

SECTION = "planner-speed"
LINK_BPS = DEFAULT_INTER_NODE_GBPS * 1e9  # InfiniBand NDR, per direction
NVLINK_BPS = DEFAULT_INTRA_NODE_GBPS * 1e9  # NVLink 4, per direction
LATENCY_S = DEFAULT_LATENCY_S


def _units(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.random.Generator]:
    """Random per-unit compute (0.5..1.5 ms), parameter bytes (0..4 MB), saved bytes (0..2 MB)."""
    rng = np.random.default_rng(seed)
    t = rng.uniform(0.5e-3, 1.5e-3, n)
    p = rng.integers(0, 4_000_000, n).astype(np.float64)
    s = rng.integers(0, 2_000_000, n).astype(np.float64)
    return t, p, s, rng


def _memory_cap(p: np.ndarray, s: np.ndarray, k: int, slack: float) -> float:
    """``slack`` x the average 1F1B stage memory (params x 4 + k in flight on stage 0)."""
    return slack * (OPTIMIZER_STATE_FACTOR["adamw"] * p.sum() + k * s.sum()) / k


def chain_case(n: int, k: int, memory: bool, seed: int = 0) -> Callable[[], CutProblem]:
    t, p, s, rng = _units(n, seed)
    bb = rng.integers(100_000, 4_000_000, n - 1).astype(np.float64)
    if not memory:
        return lambda: CutProblem.chain(t, p, s, bb, k, LINK_BPS, latency_s=LATENCY_S)
    bw = node_boundary_bandwidths(k, k // 2, NVLINK_BPS, LINK_BPS)
    cap = _memory_cap(p, s, k, 1.1)
    return lambda: CutProblem.chain(
        t, p, s, bb, k, bw, latency_s=LATENCY_S, capacity_bytes=cap, inflight=inflight_1f1b(k)
    )


def skewed_chain_case(n: int, k: int, seed: int = 5) -> Callable[[], CutProblem]:
    """Heavy-tailed chain: log-normal compute with 20 hot units 2000x heavier, log-normal boundary
    activations (median 1.2 MB, long tail), 10 GB/s links."""
    rng = np.random.default_rng(seed)
    t = rng.lognormal(-7.0, 1.5, n)
    t[rng.integers(0, n, 20)] *= 2000
    p = rng.integers(0, 4_000_000, n).astype(np.float64)
    s = rng.integers(0, 2_000_000, n).astype(np.float64)
    bb = rng.lognormal(14.0, 2.0, n - 1)
    return lambda: CutProblem.chain(t, p, s, bb, k, 10e9, latency_s=LATENCY_S)


def dag_values(n: int, rng: np.random.Generator) -> list[Value]:
    """Every unit feeds the next; 30% also feed one unit up to 200 ahead (a skip); every 50th unit
    makes a value that every 37th later unit reads (a long broadcast, like an attention mask); a
    model input is read by every 10th unit."""
    vals = []
    for i in range(n - 1):
        users = {i + 1}
        if i + 2 < n and rng.random() < 0.3:
            users.add(int(rng.integers(i + 2, min(n - 1, i + 200) + 1)))
        vals.append(Value(i, tuple(sorted(users)), float(rng.integers(100_000, 4_000_000))))
    for i in range(0, n - 50, 50):
        vals.append(Value(i, tuple(range(i + 1, n, 37)), 1e6))
    vals.append(Value(-1, tuple(range(0, n, 10)), 1e5, grad=False))
    return vals


def dag_case(n: int, k: int, memory: bool, seed: int = 1) -> Callable[[], CutProblem]:
    t, p, s, rng = _units(n, seed)
    vals = dag_values(n, rng)
    if not memory:
        return lambda: CutProblem(t, p, s, vals, k, LINK_BPS, latency_s=LATENCY_S)
    bw = node_boundary_bandwidths(k, k // 2, NVLINK_BPS, LINK_BPS)
    cap = _memory_cap(p, s, k, 1.1)
    return lambda: CutProblem(
        t, p, s, vals, k, bw, latency_s=LATENCY_S, capacity_bytes=cap, inflight=inflight_1f1b(k)
    )


CASES = [
    # name, description, builder, target seconds (or None)
    ("chain-100k", "100,000-unit chain -> 16 stages, 50 GB/s links, no memory limit",
     lambda: chain_case(100_000, 16, False), 1.0),
    ("chain-100k-mem", "same chain, 2 nodes x 8 stages (450 / 50 GB/s), 1F1B memory limit",
     lambda: chain_case(100_000, 16, True), 1.0),
    ("chain-100k-skewed", "100,000-unit heavy-tailed chain (20 hot units, long-tailed activations) "
     "-> 16 stages, 10 GB/s links", lambda: skewed_chain_case(100_000, 16), 1.0),
    ("dag-2k", "2,000-unit DAG with skips -> 8 stages, 50 GB/s links, no memory limit",
     lambda: dag_case(2_000, 8, False), 3.0),
    ("dag-2k-mem", "same DAG, 2 nodes x 4 stages (450 / 50 GB/s), 1F1B memory limit",
     lambda: dag_case(2_000, 8, True), 3.0),
]


def run_case(builder: Callable[[], CutProblem], repeats: int) -> dict:
    """Time construction and solve; return figures (seconds, milliseconds per micro-batch)."""
    build_s, solve_s = [], []
    result = problem = None
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        problem = builder()
        t1 = time.perf_counter()
        result = optimal_partition(problem)
        t2 = time.perf_counter()
        build_s.append(t1 - t0)
        solve_s.append(t2 - t1)
    eq = equal_layers_partition(problem)
    pb = param_balanced_partition(problem)
    return dict(
        n=problem.n, k=problem.num_stages, method=result.method,
        build_s=statistics.median(build_s), solve_s=statistics.median(solve_s),
        solve_all=solve_s, bottleneck_ms=result.bottleneck_s * 1e3,
        lower_bound_ms=result.lower_bound_s * 1e3,
        equal_ms=eq.bottleneck_s * 1e3, equal_fits=eq.feasible,
        param_ms=pb.bottleneck_s * 1e3, param_fits=pb.feasible,
        peak_mem_frac=(max(m / c for m, c in zip(result.memory_bytes, result.capacity_bytes))
                       if result.capacity_bytes else None),
    )


def cross_check(n: int = 2_000, k: int = 16) -> tuple[float, float, float, float]:
    """Chain search vs general DP on the same chain (with memory limits): (chain s, dp s, chain
    bottleneck, dp bottleneck)."""
    problem = chain_case(n, k, True, seed=7)()
    t0 = time.perf_counter()
    a = optimal_partition(problem, method="chain")
    t1 = time.perf_counter()
    b = optimal_partition(problem, method="dp")
    t2 = time.perf_counter()
    if abs(a.bottleneck_s - b.bottleneck_s) > 1e-12 * b.bottleneck_s:
        raise SystemExit(f"cross-check failed: chain {a.bottleneck_s} != dp {b.bottleneck_s}")
    return t1 - t0, t2 - t1, a.bottleneck_s, b.bottleneck_s


def _fmt_base(ms: float, fits: bool, ours: float) -> str:
    return f"{ms:.3f} ({ms / ours:.3f}x){'' if fits else ' OOM'}"


def report(rows: list[tuple[str, str, float | None, dict]], check: tuple, repeats: int) -> str:
    table = []
    for name, desc, target, r in rows:
        verdict = "" if target is None else ("PASS" if r["solve_s"] <= target else "FAIL")
        table.append([
            f"`{name}`", f"{r['n']:,}", str(r["k"]), r["method"], f"{r['build_s']:.3f}",
            f"**{r['solve_s']:.3f}**", "-" if target is None else f"{target:g}", verdict,
            f"{r['bottleneck_ms']:.3f}", f"{r['bottleneck_ms'] / r['lower_bound_ms']:.4f}",
            _fmt_base(r["equal_ms"], r["equal_fits"], r["bottleneck_ms"]),
            _fmt_base(r["param_ms"], r["param_fits"], r["bottleneck_ms"]),
        ])
    header = ["case", "units", "stages", "method", "build s", "solve s (median)", "target s", "",
              "bottleneck ms", "/ lower bound", "equal-layers ms", "param-balanced ms"]
    lines = [
        "## Planner speed: the exact partitioner alone",
        "",
        "Written by `python benchmarks/bench_planner_speed.py` (pure numpy, no torch). Synthetic "
        "units: compute 0.5-1.5 ms, parameters 0-4 MB, saved activations 0-2 MB, values between "
        f"units 0.1-4 MB (except the skewed case), {LATENCY_S * 1e6:g} us per message, gradients sent back. Memory-limited "
        "cases: AdamW state (4x parameters), 1F1B in flight (p - j micro-batches on stage j), "
        "capacity 1.1x what the first stage of an even split needs (k micro-batches in flight).",
        "",
    ]
    lines += [f"- `{name}`: {desc}" for name, desc, _, _ in rows]
    lines += [
        "",
        markdown_table(header, table),
        "",
        "`build s`: constructing the `CutProblem` (validation, prefix sums, value table). "
        "`solve s`: `optimal_partition` (exact: `chain` = parametric search with O(k n) sweeps, "
        "`dp` = O(k n^2) dynamic program), including the final `evaluate`. Baselines in parentheses "
        "are their bottleneck / ours; OOM marks a baseline split that does not fit device memory.",
        "",
        f"Cross-check: on a 2,000-unit chain into 16 stages with memory limits, the chain search "
        f"({check[0]:.3f} s) and the general DP ({check[1]:.3f} s) return the same bottleneck "
        f"({check[2] * 1e3:.6f} ms vs {check[3] * 1e3:.6f} ms).",
        "",
        f"Medians of {repeats} runs; numpy {np.__version__}, Python {platform.python_version()}, "
        f"{os.cpu_count()} CPU core(s), {datetime.date.today().isoformat()}; shared machine, "
        "so expect +-30% between runs.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="solves per case (median reported)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    ap.add_argument("--out", type=Path, default=BENCHMARKS_MD, help="report file (default BENCHMARKS.md)")
    args = ap.parse_args(argv)

    rows = []
    for name, desc, make, target in CASES:
        r = run_case(make(), max(1, args.repeats))
        rows.append((name, desc, target, r))
        runs = ", ".join(f"{x:.3f}" for x in r["solve_all"])
        print(f"{name:16s} n={r['n']:>7,} k={r['k']:>2} {r['method']:5s} build {r['build_s']:.3f} s  "
              f"solve {r['solve_s']:.3f} s [{runs}]  bottleneck {r['bottleneck_ms']:.3f} ms "
              f"(lower bound {r['lower_bound_ms']:.3f})  equal {r['equal_ms']:.3f}  param {r['param_ms']:.3f}")
    check = cross_check()
    print(f"cross-check chain vs dp on 2,000 units: {check[0]:.3f} s vs {check[1]:.3f} s, "
          f"bottleneck {check[2]:.9g} == {check[3]:.9g}")
    text = report(rows, check, max(1, args.repeats))
    if not args.no_write:
        path = write_section(SECTION, text, args.out)
        print(f"wrote section '{SECTION}' of {path}")
    failed = [name for name, _, target, r in rows if target is not None and r["solve_s"] > target]
    if failed:
        print(f"over target: {', '.join(failed)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
