"""Planning at scale: planner time against world size (8 .. 100,000 devices) and depth (12 .. 96
layers), every ``parallel`` field ``auto`` (issue 9, item 3).

The model is GPT-3-shaped, ``fxpipe.examples.gpt.CharGPT(vocab_size=50257, block_size=2048,
n_layer=L, n_head=96, n_embd=12288)`` (175 B parameters at 96 layers), built under
``torch.device("meta")`` (no weight memory) with an int64 ``[1, 2048]`` meta input, planned by
``fxpipe.plan`` for a spec with pipeline, data, micro-batches and schedule all ``auto`` on
``nodes x 8`` CUDA devices (80 GB, 400 TFLOP/s, NVLink 450 GB/s inside a node, 50 GB/s between
nodes), AdamW, bf16. ``fxpipe.plan`` traces two blocks and plans the model as blocks.

Timed: each configuration's ``fxpipe.plan`` call end to end (the target's figure: tracing,
pricing, the auto search, the plan), split into phases by wrapping the
planner functions (restored afterwards): **trace** (fake copy of the model +
``torch.export``), **cost** (fake-tensor FLOPs and bytes), **graph** (priced unit graph and the
block folding), **search** (every candidate layout: cut, bounds, simulation), **assemble** (the
Plan and its prediction), **other** (the rest). Reported separately: the imports, the one-time
warm-up of ``torch.export`` (a first plan of a tiny model) and the build of the meta model.
Repeats (``--repeats``) are run round-robin over the configurations, so load changes on the
shared machine touch every configuration alike; the table gives the median and the range.

Targets (issue 9): the 96-layer model on 128 x 8 devices at most 10 s end to end, and at most
60 s on 100,000 devices (12,500 x 8).

Run: ``python benchmarks/bench_plan_scale.py`` (writes the ``plan-scale`` section of
BENCHMARKS.md); ``--tiny`` for the smoke-test configuration, ``--no-write`` to only print.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import re
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

import fxpipe  # noqa: E402
from benchmarks._report import BENCHMARKS_MD, markdown_table, write_section  # noqa: E402
from fxpipe.errors import PlanError  # noqa: E402
from fxpipe.examples.gpt import CharGPT  # noqa: E402
from fxpipe.specs.loader import load_spec  # noqa: E402

_IMPORT_S = time.perf_counter() - _T_START

__all__ = ["GPT3", "TINY", "Config", "Timed", "spec_dict", "timed_plan", "run", "main"]

SECTION = "plan-scale"
#: GPT-3 shape (the depth varies)
GPT3 = dict(vocab_size=50257, block_size=2048, n_head=96, n_embd=12288)
#: the smoke-test shape
TINY = dict(vocab_size=1000, block_size=64, n_head=2, n_embd=64)

#: phase -> the planner's functions (``module:name``, looked up where they are called) whose
#: time counts toward it (none nests another)
PHASES: dict[str, tuple[str, ...]] = {
    "trace": ("units:tracing_model", "units:trace"),
    "cost": ("units:price",),
    "graph": ("units:build_graph", "units:fold", "pricing:build_graph", "pricing:fold"),
    "search": ("driver:search_layouts",),
    "assemble": ("driver:assemble", "driver:assemble_folded", "driver:finish_plan"),
}
#: targets: (layers, devices, seconds)
TARGETS = [(96, 1024, 10.0), (96, 100_000, 60.0)]


@dataclass(frozen=True)
class Config:
    """One planning configuration: ``layers`` blocks, ``nodes`` x ``per_node`` devices, a global
    batch of ``batch`` sequences."""

    layers: int
    nodes: int
    batch: int
    per_node: int = 8

    @property
    def devices(self) -> int:
        return self.nodes * self.per_node


@dataclass
class Timed:
    """One timed ``fxpipe.plan`` call (seconds); ``plan`` is None and ``error`` holds the first
    line of the PlanError when nothing fits."""

    total_s: float
    phases_s: dict[str, float]
    plan: object = None
    error: str | None = None
    error_full: str | None = None
    busy_before: float | None = None  # machine busy fraction just before the call


@dataclass
class Row:
    cfg: Config
    runs: list[Timed] = field(default_factory=list)

    @property
    def median_s(self) -> float:
        return statistics.median(r.total_s for r in self.runs)

    def phase(self, p: str) -> float:
        return statistics.median(r.phases_s[p] for r in self.runs)


def spec_dict(cfg: Config, shape: dict) -> dict:
    """The spec: every parallel field auto; GPT-3 training cluster of ``cfg.nodes`` x 8."""
    return {
        "model": {"factory": "fxpipe.examples.gpt:CharGPT",
                  "args": dict(shape, n_layer=cfg.layers)},
        "data": {"batch_size": cfg.batch, "seq_len": shape["block_size"]},
        "parallel": {"pipeline": "auto", "data": "auto", "microbatches": "auto",
                     "schedule": "auto"},
        "cluster": {"nodes": cfg.nodes, "devices_per_node": cfg.per_node, "device": "cuda",
                    "memory_gb": 80, "device_tflops": 400,
                    "links": {"intra_node_GBps": 450, "inter_node_GBps": 50}},
        "train": {"optimizer": "adamw", "precision": "bf16"},
    }


@contextlib.contextmanager
def _phase_timers():
    """Wrap the driver functions of :data:`PHASES` with wall-clock timers (restored on exit)."""
    secs: dict[str, float] = defaultdict(float)
    saved = {}

    def wrap(phase, fn):
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                secs[phase] += time.perf_counter() - t0
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
        yield secs
    finally:
        for (module, name), fn in saved.items():
            setattr(module, name, fn)


def timed_plan(model: torch.nn.Module, spec, x: torch.Tensor) -> Timed:
    """``fxpipe.plan(model, spec, (x,))`` once, with phase timers; a PlanError (nothing fits)
    is recorded, not raised."""
    with _phase_timers() as secs:
        t0 = time.perf_counter()
        plan, err, full = None, None, None
        try:
            plan = fxpipe.plan(model, spec, (x,))
        except PlanError as e:
            full = str(e)
            err = full.splitlines()[0]
        total = time.perf_counter() - t0
    phases = {p: secs.get(p, 0.0) for p in PHASES}
    phases["other"] = max(0.0, total - sum(phases.values()))
    return Timed(total, phases, plan, err, full)


def _build(shape: dict, layers: int) -> tuple[torch.nn.Module, float]:
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = CharGPT(**shape, n_layer=layers)
    return model, time.perf_counter() - t0


def warm_up() -> float:
    """One plan of a tiny model (torch.export's and the planner's one-time set-up), seconds."""
    cfg = Config(2, 1, 8)
    shape = dict(TINY, block_size=16)
    with torch.device("meta"):
        model = CharGPT(**shape, n_layer=2)
    x = torch.zeros(1, 16, dtype=torch.long, device="meta")
    t0 = time.perf_counter()
    fxpipe.plan(model, load_spec(spec_dict(cfg, shape)), (x,))
    return time.perf_counter() - t0


def run(configs: list[Config], shape: dict, repeats: int, log=print, max_busy: float = 1.0,
        max_wait_s: float = 0.0) -> dict:
    """Build each depth's model once, then time every configuration ``repeats`` times,
    round-robin (first pass in order, then reversed, ...); before each call wait (at most
    ``max_wait_s``) for the machine to be less than ``max_busy`` busy."""
    from benchmarks.bench_pick import wait_quiet

    res: dict = {"import_s": _IMPORT_S, "warmup_s": warm_up(), "build_s": {}, "params": {}}
    models = {}
    for layers in sorted({c.layers for c in configs}):
        models[layers], res["build_s"][layers] = _build(shape, layers)
        res["params"][layers] = sum(p.numel() for p in models[layers].parameters())
    x = torch.zeros(1, shape["block_size"], dtype=torch.long, device="meta")
    rows = {c: Row(c) for c in configs}
    for r in range(repeats):
        order = configs if r % 2 == 0 else list(reversed(configs))
        for c in order:
            busy = wait_quiet(max_busy, max_wait_s, log) if max_wait_s > 0 else None
            t = timed_plan(models[c.layers], load_spec(spec_dict(c, shape)), x)
            t.busy_before = busy
            rows[c].runs.append(t)
            what = t.error or _layout(t.plan)
            log(f"  {c.layers} layers, {c.devices} devices, batch {c.batch}: {t.total_s:.2f} s "
                f"({what})")
    res["rows"] = [rows[c] for c in configs]
    return res


def _layout(plan) -> str:
    n = len(plan.stages)
    modes = [s.recompute_mode for s in plan.stages]
    parts = [f"{m} on {'all' if modes.count(m) == n else modes.count(m)}"
             for m in ("selective", "partial", "full") if m in modes]
    rc = f" recompute {', '.join(parts)} of {n} stages" if parts else ""
    v = f" v={plan.virtual_stages}" if plan.schedule == "interleaved" else ""
    return (f"pp={plan.pipeline} dp={plan.dp} m={plan.microbatches} {plan.schedule}{v}{rc}, "
            f"micro-batch {plan.microbatch_size}, {plan.placement}")


_SEARCH = re.compile(r"auto search: (\d+) candidate layouts?, (\d+) simulated(?: \([^)]*\))?, "
                     r"(\d+) pruned by a lower bound, (\d+) infeasible")


def _search_counts(t: Timed) -> str:
    if t.plan is None:
        return "n/a"
    m = next((_SEARCH.search(e) for e in t.plan.explain if _SEARCH.search(e)), None)
    return "/".join(m.groups()) if m else "1 (fixed)"


def checks(res: dict) -> list[tuple[str, float, float, bool]]:
    """``(target, limit_s, median_s, passed)`` for each target present in the rows."""
    out = []
    for layers, devices, limit in TARGETS:
        for row in res["rows"]:
            if row.cfg.layers != layers or row.cfg.devices != devices:
                continue
            ok = row.median_s <= limit and row.runs[0].plan is not None
            out.append((f"{layers} layers, {devices:,} devices, batch {row.cfg.batch:,}, all "
                        "auto, end to end", limit, row.median_s, ok))
    return out


def table(rows: list[Row]) -> str:
    out = []
    for r in rows:
        c, t0 = r.cfg, r.runs[0]
        lo, hi = min(x.total_s for x in r.runs), max(x.total_s for x in r.runs)
        rng = f" ({lo:.1f}-{hi:.1f})" if len(r.runs) > 1 else ""
        if t0.plan is None:
            layout, step = f"no plan fits: {t0.error}", "-"
        else:
            layout, step = _layout(t0.plan), f"{t0.plan.predicted.step_time_s:.2f}"
        out.append([f"{c.devices:,}", f"{c.nodes:,} x {c.per_node}", str(c.layers),
                    f"{c.batch:,}", f"**{r.median_s:.2f}**{rng}", f"{r.phase('trace'):.2f}",
                    f"{r.phase('cost') + r.phase('graph'):.2f}", f"{r.phase('search'):.2f}",
                    f"{r.phase('assemble') + r.phase('other'):.2f}", _search_counts(t0),
                    layout, step])
    return markdown_table(["devices", "nodes", "layers", "batch", "plan s (median, range)",
                           "trace s", "cost+graph s", "search s", "assemble+other s",
                           "candidates / simulated / pruned / infeasible", "chosen layout",
                           "predicted step s"], out)


def report(res: dict, world_rows: list[Row], depth_rows: list[Row], repeats: int,
           note: str, shape: dict) -> str:
    chk = checks(res)
    target_table = markdown_table(
        ["target", "limit s", "measured s (median)", "result"],
        [[n, f"{lim:g}", f"{v:.2f}", "PASS" if ok else "FAIL"] for n, lim, v, ok in chk])
    builds = ", ".join(f"{k} layers {v:.2f} s" for k, v in sorted(res["build_s"].items()))
    params = res["params"].get(96) or max(res["params"].values())
    failed = [r for r in world_rows + depth_rows if r.runs[0].plan is None]
    extra = []
    for r in failed[:1]:
        extra += ["", f"What the planner answers for {r.cfg.devices} devices (no layout fits; "
                  "first lines):", "", "```", *r.runs[0].error_full.splitlines()[:4], "```"]
    return "\n".join([
        "## Planning at scale: planner time vs world size and depth (all `auto`)",
        "",
        "Written by `python benchmarks/bench_plan_scale.py` (issue 9). "
        f"`CharGPT(vocab_size={shape['vocab_size']}, block_size={shape['block_size']}, "
        f"n_layer=L, n_head={shape['n_head']}, n_embd={shape['n_embd']})` "
        f"({params / 1e9:.0f} B parameters at {max(res['params'])} layers) built under "
        "`torch.device(\"meta\")`, example input int64 "
        f"`[1, {shape['block_size']}]` on meta, planned by `fxpipe.plan` with pipeline, data, "
        "micro-batches and schedule all `auto` on `nodes x 8` CUDA devices (80 GB, 400 TFLOP/s, "
        "450 GB/s NVLink in a node, 50 GB/s between nodes), AdamW, bf16, global batch of "
        "`batch` sequences of 2,048 tokens (GPT-3's 1,536 up to 8,192 devices). For 100,000 "
        "devices 1,536 cannot work: the data-parallel degree must divide both, so at most "
        "gcd(1,536, 100,000) = 32, which leaves pipelines of at least 3,125 stages for a "
        "model of about a hundred planning units. Two batches are timed there: 100,000 sequences, which every data-parallel degree of 100,000 "
        "devices divides (the largest search), and 20,000 (= 2^5 x 5^4: degrees with a factor "
        "5^5 drop out). `fxpipe.plan` traces two blocks "
        "and plans the model as blocks. Phases are timed inside each call (trace: fake copy "
        "and `torch.export`; cost + graph: pricing, unit graph, block folding; search: every "
        "candidate layout's cut, bounds and simulation). Timed calls run round-robin, "
        f"{repeats} per configuration, after a one-time warm-up.",
        "",
        f"Not in the times: imports {res['import_s']:.2f} s; one-time warm-up (a first plan of a "
        f"tiny model: torch.export set-up) {res['warmup_s']:.2f} s; building the meta model: "
        f"{builds}.",
        "",
        "### World size (96 layers)",
        "",
        table(world_rows),
        "",
        "### Depth (1,024 devices = 128 x 8)",
        "",
        table(depth_rows),
        "",
        target_table,
        *extra,
        "",
        f"{note}; {time.strftime('%Y-%m-%d')}. The machine is shared with other work, so "
        "expect +-30% between runs (the range column gives this run's spread)"
        + _busy_note(world_rows + depth_rows) + ".",
    ])


def _busy_note(rows: list[Row]) -> str:
    busy = [t.busy_before for r in rows for t in r.runs if t.busy_before is not None]
    if not busy:
        return ""
    return (f"; each call waited (up to a limit) for a quiet machine: CPU busy just before "
            f"the calls median {statistics.median(busy):.0%}, at most {max(busy):.0%}")


def configs_for(tiny: bool) -> tuple[list[Config], list[Config], dict]:
    """(world-size rows, depth rows, model shape)."""
    if tiny:
        return ([Config(16, 1, 64), Config(16, 8, 64)],
                [Config(8, 8, 64), Config(16, 8, 64)], TINY)
    return ([Config(96, 1, 1536), Config(96, 8, 1536), Config(96, 128, 1536),
             Config(96, 1024, 1536), Config(96, 12_500, 100_000), Config(96, 12_500, 20_000)],
            [Config(12, 128, 1536), Config(24, 128, 1536), Config(48, 128, 1536),
             Config(96, 128, 1536)], GPT3)


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; print the tables; write the ``plan-scale`` section unless
    ``--no-write``.

    Args:
        argv: ``--tiny``, ``--repeats N``, ``--no-write``, ``--out PATH``; None reads sys.argv.

    Returns:
        ``{"rows": [Row], "world": [Row], "depth": [Row], "checks": [...], "import_s",
        "warmup_s", "build_s", "params"}``. A FAIL does not change the exit status.
    """
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny model (smoke test)")
    ap.add_argument("--repeats", type=int, default=2, help="timed calls per configuration")
    ap.add_argument("--max-busy", type=float, default=0.3,
                    help="wait before each call until the machine is less busy than this "
                         "fraction (default 0.3)")
    ap.add_argument("--max-wait", type=float, default=120.0,
                    help="longest wait for a quiet machine per call, seconds (0: never wait)")
    ap.add_argument("--no-write", action="store_true", help="print only")
    ap.add_argument("--out", default=str(BENCHMARKS_MD), help="report file (default BENCHMARKS.md)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from benchmarks._runtime_bench import load_average

    load0 = load_average()
    world, depth, shape = configs_for(args.tiny)
    configs = list(dict.fromkeys(world + depth))  # 96 x 1024 appears in both: timed once
    res = run(configs, shape, max(1, args.repeats), max_busy=args.max_busy,
              max_wait_s=args.max_wait)
    by = {r.cfg: r for r in res["rows"]}
    res["world"], res["depth"] = [by[c] for c in world], [by[c] for c in depth]
    res["checks"] = checks(res)
    print(table(res["world"]))
    print()
    print(table(res["depth"]))
    for n, lim, v, ok in res["checks"]:
        print(f"{n}: {v:.2f} s (limit {lim:g} s) {'PASS' if ok else 'FAIL'}")
    note = (f"torch {torch.__version__}, {torch.get_num_threads()} thread, load average "
            f"(1/5/15 min) {load0} before, {load_average()} after")
    if not args.no_write:
        path = write_section(SECTION, report(res, res["world"], res["depth"],
                                             max(1, args.repeats), note, shape), args.out)
        print(f"\nwrote section '{SECTION}' of {path}")
    return res


if __name__ == "__main__":
    main()
