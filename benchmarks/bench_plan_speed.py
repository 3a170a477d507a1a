"""Plan-speed benchmark: trace + cost + graph + plan of a GPT-2-small-sized model into 4 stages.

The model is ``fxpipe.examples.gpt.CharGPT(vocab_size=50257, block_size=1024, n_layer=12,
n_head=12, n_embd=768)`` (GPT-2 small's shape, 124 M parameters) built under
``torch.device("meta")`` (no weight memory), with an int64 ``[1, 1024]`` meta input, planned by the
real API, :func:`fxpipe.partitioner.driver.plan_with_graph`, for a spec with pipeline 4, data 1, 4 micro-batches,
1F1B, one node of 4 devices.

Phases are timed inside that one call by wrapping the functions ``fxpipe.partitioner.driver`` calls (restored
afterwards): **trace** (``torch.export``), **cost** (fake-tensor FLOPs/bytes), **graph** (networkx
priced graph), **plan** (cut problem + exact partition), **assemble** (stage boundaries, Plan,
simulated prediction); **other** is the rest of the call (spec handling, candidate set).

Target (issue 2): trace + cost + plan at most 5 s on this machine. The first call in a fresh
process (imports excluded, export's one-time set-up included) is what ``fxpipe plan`` pays, so
the target is judged on it; warm repeats are reported beside it. Because the shared machines are
noisy, the report also gives the plan time as a multiple of one eager forward of a small reference
model measured in the same process (less dependent on the machine and its load).

Run: ``python benchmarks/bench_plan_speed.py`` (writes the ``plan-speed`` section of
BENCHMARKS.md); ``--tiny`` for the smoke-test configuration, ``--no-write`` to only print.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `fxpipe` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_T_START = time.perf_counter()
import torch  # noqa: E402

import fxpipe.partitioner.driver as driver  # noqa: E402
from benchmarks._report import BENCHMARKS_MD, markdown_table, write_section  # noqa: E402
from fxpipe.examples.gpt import CharGPT  # noqa: E402
from fxpipe.specs.loader import load_spec  # noqa: E402

_IMPORT_S = time.perf_counter() - _T_START

__all__ = ["GPT2_SMALL", "TINY", "SpeedResult", "timed_plan", "reference_forward_s", "main"]

SECTION = "plan-speed"
#: target of issue 2: trace + cost + plan of GPT-2 small to 4 stages, seconds
TARGET_S = 5.0
#: GPT-2-small shape
GPT2_SMALL = dict(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)
#: smoke-test shape
TINY = dict(vocab_size=1000, block_size=64, n_layer=2, n_head=2, n_embd=64)
#: reference model for the machine-independent ratio: CharGPT's defaults, batch 8 x 128, eager
REFERENCE = dict(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=128)

#: phase -> the planner's functions (``module:name``, looked up where they are called) whose
#: time counts toward it
PHASES: dict[str, tuple[str, ...]] = {
    "trace": ("units:trace",),
    "cost": ("units:price",),
    "graph": ("units:build_graph",),
    "plan": ("driver:search_layouts", "driver:solve_fitting"),
    "assemble": ("driver:assemble", "driver:finish_plan"),
}


def spec_dict(args: dict, stages: int = 4) -> dict:
    """The benchmark's spec: pipeline ``stages``, data 1, 4 micro-batches of 1 sample, 1F1B,
    one node of ``stages`` devices, sequences of ``args['block_size']`` tokens."""
    return {
        "model": {"factory": "fxpipe.examples.gpt:CharGPT", "args": dict(args)},
        "data": {"batch_size": 4, "seq_len": args["block_size"]},
        "parallel": {"pipeline": stages, "data": 1, "microbatches": 4, "schedule": "1f1b"},
        "cluster": {"nodes": 1, "devices_per_node": stages, "memory_gb": 80},
    }


@dataclass
class SpeedResult:
    """One timed ``plan_with_graph`` call.

    Attributes:
        total_s: wall time of the whole call, seconds.
        phases_s: phase -> seconds (see :data:`PHASES`); ``other`` = total - the rest.
        calls: phase -> number of wrapped calls that ran.
        plan: the Plan it produced.
    """

    total_s: float
    phases_s: dict[str, float]
    calls: dict[str, int] = field(default_factory=dict)
    plan: object = None


@contextlib.contextmanager
def _phase_timers():
    """Wrap the fxpipe.partitioner.driver functions of :data:`PHASES` with wall-clock timers; yields the
    ``(seconds, calls)`` dicts and restores the originals on exit."""
    secs: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    saved = {}

    def wrap(phase, fn):
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                secs[phase] += time.perf_counter() - t0
                calls[phase] += 1
        return timed

    for phase, names in PHASES.items():
        for ref in names:
            mod, name = ref.split(":")
            module = importlib.import_module(f"fxpipe.partitioner.{mod}")
            fn = getattr(module, name, None)
            if callable(fn):
                saved[(module, name)] = fn
                setattr(module, name, wrap(phase, fn))
    try:
        yield secs, calls
    finally:
        for (module, name), fn in saved.items():
            setattr(module, name, fn)


def timed_plan(model: torch.nn.Module, spec, example_inputs: tuple) -> SpeedResult:
    """Run :func:`fxpipe.partitioner.driver.plan_with_graph` once with per-phase timers.

    Returns:
        A :class:`SpeedResult` (seconds). Raises whatever the API raises (SpecError,
        TraceError, PlanError).
    """
    with _phase_timers() as (secs, calls):
        t0 = time.perf_counter()
        plan, _ = driver.plan_with_graph(model, spec, example_inputs)
        total = time.perf_counter() - t0
    phases = {p: secs.get(p, 0.0) for p in PHASES}
    phases["other"] = max(0.0, total - sum(phases.values()))
    return SpeedResult(total, phases, dict(calls), plan)


def reference_forward_s(args: dict = REFERENCE, batch: int = 8, repeats: int = 7) -> float:
    """Fastest wall time (seconds) of ``repeats`` eager CPU forwards of ``CharGPT(**args)`` on an
    int64 ``[batch, block_size]`` input under ``no_grad`` (after one warm-up call). The minimum,
    not the median: on a shared machine, other processes only ever add time."""
    torch.manual_seed(0)
    m = CharGPT(**args).eval()
    x = torch.randint(0, args["vocab_size"], (batch, args["block_size"]))
    times = []
    with torch.no_grad():
        m(x)
        for _ in range(repeats):
            t0 = time.perf_counter()
            m(x)
            times.append(time.perf_counter() - t0)
    return min(times)


def run(args: dict, repeats: int, ref_args: dict, ref_batch: int) -> dict:
    """Time the first call and ``repeats`` warm calls; measure the reference forward."""
    spec = load_spec(spec_dict(args))
    with torch.device("meta"):
        model = CharGPT(**args)
    x = torch.zeros(1, args["block_size"], dtype=torch.long, device="meta")
    first = timed_plan(model, spec, (x,))
    warm = [timed_plan(model, spec, (x,)) for _ in range(repeats)]
    ref = reference_forward_s(ref_args, ref_batch)
    return {"first": first, "warm": warm, "reference_s": ref, "import_s": _IMPORT_S,
            "params": sum(p.numel() for p in model.parameters()), "args": args}


def _median(rs: list[SpeedResult], key: str | None = None) -> float:
    if not rs:
        return float("nan")
    return statistics.median(r.total_s if key is None else r.phases_s[key] for r in rs)


def format_tables(res: dict) -> tuple[str, str, list[tuple[str, float, float, bool]]]:
    """(phase table, target table, [(target, limit, measured, passed)])."""
    first, warm = res["first"], res["warm"]
    rows = []
    for p in list(PHASES) + ["other"]:
        rows.append([p, f"{first.phases_s[p]:.3f}", f"{_median(warm, p):.3f}",
                     f"{first.phases_s[p] / first.total_s:.0%}"])
    rows.append(["**total**", f"**{first.total_s:.3f}**", f"**{_median(warm):.3f}**", "100%"])
    phase_table = markdown_table(["phase", "first call s", f"warm median s (n={len(warm)})",
                                  "share (first)"], rows)
    tpc = first.total_s - first.phases_s["assemble"] - first.phases_s["other"]
    checks = [
        ("trace + cost + graph + plan, first call", TARGET_S, tpc, tpc <= TARGET_S),
        ("whole plan_with_graph call, first call", TARGET_S, first.total_s,
         first.total_s <= TARGET_S),
    ]
    target_table = markdown_table(
        ["target", "limit s", "measured s", "result"],
        [[name, f"{lim:g}", f"{v:.3f}", "PASS" if ok else "FAIL"] for name, lim, v, ok in checks])
    return phase_table, target_table, checks


def report(res: dict, phase_table: str, target_table: str) -> str:
    """The Markdown body of the ``plan-speed`` section."""
    first, plan = res["first"], res["first"].plan
    a = res["args"]
    ref_ms = res["reference_s"] * 1e3
    ra = REFERENCE
    units = getattr(plan, "num_stages", "?")
    nodes = sum(len(s.nodes) for s in plan.stages) if plan is not None else 0
    return "\n".join([
        "## Plan speed: GPT-2-small-sized model to 4 stages",
        "",
        "Written by `python benchmarks/bench_plan_speed.py`. `CharGPT(vocab_size="
        f"{a['vocab_size']}, block_size={a['block_size']}, n_layer={a['n_layer']}, "
        f"n_head={a['n_head']}, n_embd={a['n_embd']})` ({res['params'] / 1e6:.0f} M parameters) "
        "built under `torch.device(\"meta\")`, example input int64 `[1, "
        f"{a['block_size']}]` on meta, planned by `fxpipe.partitioner.driver.plan_with_graph` for pipeline 4, "
        "data 1, 4 micro-batches, 1F1B, one node of 4 devices. Phases are timed inside the same "
        "call. The first call includes torch.export's one-time warm-up (module imports, "
        f"{res['import_s']:.2f} s, are excluded); warm calls repeat the plan in the same process.",
        "",
        phase_table,
        "",
        target_table,
        "",
        f"Less machine-dependent view: the fastest eager CPU forward of a small reference "
        f"(`CharGPT(vocab {ra['vocab_size']}, {ra['n_layer']} layers x {ra['n_embd']})`, batch "
        f"8 x {ra['block_size']}) took {ref_ms:.1f} ms here, so the first plan call cost "
        f"{first.total_s / res['reference_s']:.0f} reference forwards (warm: "
        f"{_median(res['warm']) / res['reference_s']:.0f}).",
        "",
        f"The plan: {units} stages, {nodes} FX nodes; bottleneck stage {plan.bottleneck_stage}; "
        f"lower bound {plan.lower_bound_s * 1e3:.1f} ms per micro-batch at the spec's default "
        "device speed. The other speed target of issue 2 (the planner alone on a 100,000-node "
        "chain) is in the `planner-speed` section.",
        "",
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
        f"{time.strftime('%Y-%m-%d')}; shared 2-core machine, so expect +-30% between runs.",
    ])


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; print the tables; write the ``plan-speed`` section unless
    ``--no-write``.

    Args:
        argv: ``--tiny``, ``--repeats N``, ``--no-write``, ``--out PATH``; None reads
            ``sys.argv``.

    Returns:
        ``{"first": SpeedResult, "warm": [SpeedResult], "reference_s": float, "import_s": float,
        "params": int, "args": dict, "checks": [(target, limit_s, measured_s, passed)]}``.
        Exit status is not changed by a FAIL (the numbers are the product; CI runs the smoke
        test).
    """
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny model (smoke test)")
    ap.add_argument("--repeats", type=int, default=2, help="warm calls after the first (default 2)")
    ap.add_argument("--no-write", action="store_true", help="print only")
    ap.add_argument("--out", default=str(BENCHMARKS_MD), help="report file (default BENCHMARKS.md)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model_args = TINY if args.tiny else GPT2_SMALL
    ref_args = dict(REFERENCE, block_size=32) if args.tiny else REFERENCE
    res = run(model_args, max(0, args.repeats), ref_args, 2 if args.tiny else 8)
    phase_table, target_table, checks = format_tables(res)
    res["checks"] = checks
    print(phase_table)
    print()
    print(target_table)
    print(f"\nreference forward {res['reference_s'] * 1e3:.2f} ms; first plan = "
          f"{res['first'].total_s / res['reference_s']:.0f} reference forwards")
    if not args.no_write:
        path = write_section(SECTION, report(res, phase_table, target_table), args.out)
        print(f"\nwrote section '{SECTION}' of {path}")
    return res


if __name__ == "__main__":
    main()
