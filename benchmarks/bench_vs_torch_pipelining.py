"""fxpipe's executor side by side with torch.distributed.pipelining (issue 3, item 9).

Same stages, same schedule, same data: a stack of identical Linear+GELU blocks
(``benchmarks/_runtime_bench.MLPStack``) cut into ``p`` equal stages by fxpipe's splitter; every
rank holds its stage twice, as two independent copies of the same initial parameters:

* fxpipe: :class:`fxpipe.runtime.executor.PipelineExecutor` with the schedule's action list;
* torch: ``torch.distributed.pipelining.PipelineStage`` over the *same* stage module (a copy,
  unwrapped to return one tensor) with ``ScheduleGPipe`` / ``Schedule1F1B``, on its own gloo
  process group.

Both use ``m`` micro-batches, MSE loss averaged over micro-batches, and SGD stepped after every
pipeline step. Runs alternate in blocks of ``K`` steps, fxpipe first in even rounds and torch first
in odd ones (ABBA), each block started after a barrier; a block's step time is the slowest rank's
mean. Reported: median step time of each, their ratio fxpipe / torch (target <= 1.0), and the
largest difference between the two runs' losses (they train identical copies on identical data,
so the losses must agree to float rounding).

After the timed rounds, ``k`` more steps of each run under cProfile give each runtime's own
Python time per step (functions in ``fxpipe/runtime/`` vs ``torch/distributed/pipelining/``): its
bookkeeping cost, which unlike wall time hardly depends on the machine's load.

Run: ``python benchmarks/bench_vs_torch_pipelining.py`` (two to three minutes;
``--show-profile`` prints the cProfile hot spots of both runtimes per rank). Writes the ``vs-torch-pipelining`` section of BENCHMARKS.md.
"""

from __future__ import annotations

import copy
import cProfile
import io
import math
import pstats
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `fxpipe` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks._report import BENCHMARKS_MD, markdown_table, write_section  # noqa: E402
from benchmarks._runtime_bench import (  # noqa: E402
    RunSpec,
    StackConfig,
    batch,
    build_executor,
    cached_split,
    load_average,
    machine_note,
    run_group,
)

SECTION = "vs-torch-pipelining"
DEFAULT = StackConfig()  # width 1024, micro-batch 32, 4 blocks per stage
LR = 1e-3


class SingleOutput(nn.Module):
    """Wraps a fxpipe stage module (``forward(*inputs) -> tuple``) for torch.distributed.pipelining,
    which passes one tensor between stages: ``forward(x) -> the stage's only output``."""

    def __init__(self, stage: nn.Module):
        super().__init__()
        self.stage = stage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.stage(x)
        if isinstance(out, (tuple, list)):
            if len(out) != 1:
                raise ValueError(f"stage returns {len(out)} values; torch.distributed.pipelining "
                                 "stages here must return one tensor")
            out = out[0]
        return out


#: source paths whose own (not callee) Python time counts as a runtime's bookkeeping
RUNTIME_CODE = {"fx": ("fxpipe/runtime/",), "torch": ("torch/distributed/pipelining/",)}


def _profile(fn, k: int, code: tuple[str, ...], top: int = 14
             ) -> tuple[str, float, dict[str, float]]:
    """Run ``fn`` ``k`` times under cProfile with the main thread's CPU clock
    (``time.thread_time``: time the process is descheduled or blocked does not count); return
    (top functions by own time as text, CPU seconds per call spent in the runtime's own Python
    code: functions whose file path contains one of ``code``, callees excluded, and that time
    per function ``"file.py:function"``)."""
    prof = cProfile.Profile(time.thread_time)
    prof.enable()
    for _ in range(k):
        fn()
    prof.disable()
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    st.sort_stats("tottime").print_stats(top)
    per_fn: dict[str, float] = {}
    for (path, _, name), v in st.stats.items():
        if any(c in path.replace("\\", "/") for c in code):
            key = f"{Path(path).name}:{name}"
            per_fn[key] = per_fn.get(key, 0.0) + v[2] / k
    return s.getvalue(), sum(per_fn.values()), per_fn


def compare_worker(rank: int, cfg: StackConfig, p: int, schedules: list[str], m: int,
                   rounds: int, k: int, warmup: int, profile: bool) -> list[dict]:
    """On each rank: for each schedule, alternate timed blocks of fxpipe and torch steps.

    Returns per schedule ``{"schedule", "fx": [s per step per block], "torch": [...],
    "fx_losses", "torch_losses" (last rank only, else []), "profile": {"fx": (text, own Python
    seconds per step), "torch": (...)}}`` (``profile`` empty unless ``profile``).
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from fxpipe.runtime.mesh import Mesh

    classes = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
    mesh = Mesh(p, 1)
    tgroup = dist.new_group(list(range(p)))  # torch's traffic on its own gloo group
    cache: dict = {}
    out = []
    for name in schedules:
        spec = RunSpec(name, p, m)
        _, init_mods, _ = cached_split(cfg, spec, cache)
        fx_mods = {s: copy.deepcopy(mod) for s, mod in enumerate(init_mods)}
        plan, schedule, ex = build_executor(cfg, spec, mesh, cache, lr=LR, modules=fx_mods)
        t_mod = SingleOutput(copy.deepcopy(init_mods[rank]))
        t_stage = PipelineStage(t_mod, rank, p, torch.device("cpu"), group=tgroup)
        t_sched = classes[name](t_stage, m, loss_fn=F.mse_loss)
        t_opt = torch.optim.SGD(t_mod.parameters(), lr=LR)
        x, y = batch(cfg, m)
        inputs = {plan.model_inputs[0]: x}
        fx_losses, t_losses = [], []

        def fx_step():
            fx_losses.append(ex.step(inputs, y))

        def torch_step():
            losses: list = []
            if rank == 0:
                t_sched.step(x)
            elif rank == p - 1:
                t_sched.step(target=y, losses=losses)
            else:
                t_sched.step()
            t_opt.step()
            t_opt.zero_grad(set_to_none=True)
            if losses:
                t_losses.append(float(torch.stack([v.detach() for v in losses]).mean()))

        for _ in range(warmup):
            fx_step()
        for _ in range(warmup):
            torch_step()
        times = {"fx": [], "torch": []}
        for r in range(rounds):
            order = (("fx", fx_step), ("torch", torch_step))
            for label, fn in (order if r % 2 == 0 else order[::-1]):
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(k):
                    fn()
                times[label].append((time.perf_counter() - t0) / k)
            ex.reset_stats()  # keep the event list short; its cost per action stays measured
        prof = {}
        if profile:  # after the timed rounds: cProfile slows both runtimes
            dist.barrier()
            prof["fx"] = _profile(fx_step, k, RUNTIME_CODE["fx"])
            dist.barrier()
            prof["torch"] = _profile(torch_step, k, RUNTIME_CODE["torch"])
        out.append(dict(schedule=name, fx=times["fx"], torch=times["torch"],
                        fx_losses=fx_losses if rank == p - 1 else [],
                        torch_losses=t_losses, profile=prof))
    dist.barrier()
    return out


@dataclass
class CompareRow:
    """Result of one (schedule, p) comparison.

    Attributes:
        schedule / p / m: the run.
        fx_s / torch_s: median seconds per step (per block: the slowest rank's mean).
        ratio: ``fx_s / torch_s``.
        pair_ratios: fxpipe / torch per round (adjacent blocks).
        loss_diff: largest |fxpipe loss - torch loss| over the steps both ran.
        steps: steps compared.
        loss_scale: largest |fxpipe loss| over those steps (what the difference compares to).
        profile: rank -> {"fx": (text, s), "torch": (text, s)} (when profiled).
    """

    schedule: str
    p: int
    m: int
    fx_s: float
    torch_s: float
    pair_ratios: list[float]
    loss_diff: float
    steps: int
    profile: dict
    loss_scale: float = float("nan")

    @property
    def ratio(self) -> float:
        return self.fx_s / self.torch_s

    def own_python_s(self, side: str) -> float | None:
        """Median over ranks of the runtime's own Python seconds per step (``side``: "fx" or
        "torch"); None when not profiled."""
        vals = [pr[side][1] for pr in self.profile.values() if pr]
        return statistics.median(vals) if vals else None


def measure(cfg: StackConfig = DEFAULT, ps=(2, 4), schedules=("gpipe", "1f1b"), m: int = 8,
            rounds: int = 6, k: int = 4, warmup: int = 2, profile: bool = True,
            timeout_s: float = 300.0) -> list[CompareRow]:
    """Run the comparison on one spawned gloo group per ``p``; one row per (p, schedule).

    Raises:
        AssertionError: a rank failed or the deadline passed.
    """
    rows = []
    for p in ps:
        res = run_group(compare_worker, p, cfg, p, list(schedules), m, rounds, k, warmup,
                        profile, timeout_s=timeout_s)
        for i, name in enumerate(schedules):
            per_rank = [res[r][i] for r in range(p)]
            fx = [max(pr["fx"][j] for pr in per_rank) for j in range(rounds)]
            th = [max(pr["torch"][j] for pr in per_rank) for j in range(rounds)]
            last = per_rank[p - 1]
            n = min(len(last["fx_losses"]), len(last["torch_losses"]))
            diff = max((abs(a - b) for a, b in zip(last["fx_losses"][:n], last["torch_losses"][:n])),
                       default=float("nan"))
            rows.append(CompareRow(name, p, m, statistics.median(fx), statistics.median(th),
                                   [a / b for a, b in zip(fx, th)], diff, n,
                                   {r: per_rank[r]["profile"] for r in range(p)},
                                   max((abs(x) for x in last["fx_losses"][:n]),
                                       default=float("nan"))))
    return rows


def table(rows: list[CompareRow]) -> str:
    """Markdown table of ``rows``."""
    header = ["schedule", "ranks", "m", "fxpipe ms/step", "torch ms/step", "fxpipe / torch",
              "per-round ratios (min-max)", "own Python CPU ms/step fxpipe / torch",
              "max loss diff"]
    body = []
    for r in rows:
        fx_py, t_py = r.own_python_s("fx"), r.own_python_s("torch")
        py = "n/a" if fx_py is None else f"{fx_py * 1e3:.2f} / {t_py * 1e3:.2f}"
        body.append([r.schedule, r.p, r.m, f"{r.fx_s * 1e3:.1f}", f"{r.torch_s * 1e3:.1f}",
                     f"**{r.ratio:.2f}**", f"{min(r.pair_ratios):.2f}-{max(r.pair_ratios):.2f}",
                     py, f"{r.loss_diff:.1e}"])
    return markdown_table(header, body)


def report(rows: list[CompareRow], cfg: StackConfig, rounds: int, k: int, note: str,
           wall_s: float, findings: str = "") -> str:
    """The BENCHMARKS.md section body."""
    met = [r for r in rows if r.ratio <= 1.0]
    lines = [
        "## Side by side with torch.distributed.pipelining (GPipe, 1F1B; gloo, CPU)",
        "",
        "Written by `python benchmarks/bench_vs_torch_pipelining.py`. Model: "
        f"{cfg.blocks_per_rank} identical Linear({cfg.width}, {cfg.width}) + GELU blocks per "
        f"stage, micro-batch {cfg.mbs} x {cfg.width} fp32, MSE loss averaged over the "
        "micro-batches, SGD after every step. Both runtimes run the same stage module (fxpipe's "
        "split of the exported model; two copies of the same initial parameters) with the same "
        "schedule on the same ranks: fxpipe's `PipelineExecutor` and torch's `PipelineStage` + "
        "`ScheduleGPipe` / `Schedule1F1B` (own gloo group). Timed in alternating blocks of "
        f"{k} steps (ABBA order, barrier before each block), {rounds} blocks each; a block's "
        "step time is the slowest rank's mean, the table gives the medians. The loss column "
        "compares the losses the two runtimes report step by step while training identical "
        "copies: it checks that both compute the same thing. *Own Python CPU ms/step*: after "
        f"the timed rounds, {k} more steps of each under cProfile with the thread's CPU clock; "
        "the CPU seconds spent in the runtime's own Python functions (`fxpipe/runtime/` vs `torch/distributed/pipelining/`, "
        "callees such as autograd and gloo excluded), median over ranks: the per-action "
        "bookkeeping cost, which depends little on the machine's load (cProfile's own overhead "
        "inflates both sides alike).",
        "",
        f"Machine: {note}. Total wall time {wall_s:.0f} s.",
        "",
        table(rows),
        "",
        f"Target fxpipe / torch <= 1.0: met in {len(met)} of {len(rows)} rows. fxpipe's step "
        "also includes an all-reduce of the step's loss over all ranks (it returns the loss on "
        "every rank), which torch's schedule does not do.",
    ]
    lines += ["", _noise_and_profile(rows)]
    if findings:
        lines += ["", findings]
    return "\n".join(lines)


def _noise_and_profile(rows: list[CompareRow]) -> str:
    """Data-driven notes: the spread of the per-round ratios, and where each runtime's own
    Python time goes (from the cProfile steps)."""
    gm = math.exp(sum(math.log(r.ratio) for r in rows) / len(rows))
    lo = min(min(r.pair_ratios) for r in rows)
    hi = max(max(r.pair_ratios) for r in rows)
    text = (f"Geometric mean of the ratios: {gm:.2f}. Adjacent fxpipe and torch blocks differ "
            f"by {lo:.2f}x to {hi:.2f}x from one round to the next on this shared machine, so a "
            "single row's distance from 1.0 of that order is noise, not a property of either "
            "runtime.")
    fx = [r.own_python_s("fx") for r in rows]
    th = [r.own_python_s("torch") for r in rows]
    if all(x is not None for x in fx + th):
        agg: dict[str, list[float]] = {}
        for r in rows:
            for pr in r.profile.values():
                for name, sec in pr["fx"][2].items():
                    agg.setdefault(name, []).append(sec)
        top = sorted(((statistics.median(v), n) for n, v in agg.items()), reverse=True)[:5]
        text += (f" The per-step work of the runtimes themselves (own Python CPU) is "
                 f"{statistics.median(fx) * 1e3:.1f} ms for fxpipe and "
                 f"{statistics.median(th) * 1e3:.1f} ms for torch (medians over rows), "
                 f"{max(x / r.fx_s for x, r in zip(fx, rows)) * 100:.1f}% of a step at most; "
                 "fxpipe's largest shares (ms per step, median over ranks and "
                 "rows, cProfile-inflated): "
                 + ", ".join(f"`{n}` {sec * 1e3:.2f}" for sec, n in top) + ".")
    return text


def main(argv: list[str] | None = None, out: Path | None = BENCHMARKS_MD) -> list[CompareRow]:
    """CLI entry: measure, print the table (and profiles), write the section to ``out``
    (``None``: do not write). Returns the rows."""
    ap = StackConfig.arg_parser(__doc__, "blocks per stage")
    ap.add_argument("--ps", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--m", type=int, default=8, help="micro-batches per step")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--k", type=int, default=4, help="steps per timed block")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--no-profile", action="store_true",
                    help="skip the cProfile steps (no own-Python column)")
    ap.add_argument("--show-profile", action="store_true",
                    help="print the cProfile hot spots of every rank")
    ap.add_argument("--findings", type=Path, default=None,
                    help="Markdown file appended to the section (profiling notes)")
    args = ap.parse_args(argv)
    cfg = StackConfig.from_args(args)
    load0 = load_average()
    t0 = time.perf_counter()
    rows = measure(cfg, tuple(args.ps), m=args.m, rounds=args.rounds, k=args.k,
                   warmup=args.warmup, profile=not args.no_profile)
    wall = time.perf_counter() - t0
    print(table(rows))
    if args.show_profile:
        for r in rows:
            for rank, prof in r.profile.items():
                for side in ("fx", "torch"):
                    if prof:
                        print(f"\n===== {r.schedule} p={r.p} rank {rank} {side} =====\n"
                              f"{prof[side][0]}")
    if out is not None and not args.no_write:
        findings = args.findings.read_text() if args.findings else ""
        write_section(SECTION, report(rows, cfg, args.rounds, args.k, machine_note(load0), wall,
                                      findings), out)
        print(f"wrote section '{SECTION}' of {out}")
    return rows


if __name__ == "__main__":
    main()
