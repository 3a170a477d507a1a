"""Benchmark of the pick: is the planner's cut the measured fastest cut? (issue 9, item 2)

For each model below, every **block-boundary** 2-stage cut (a stage start where the layer
changes: ``wte | wpe | h.0 | ... | ln_f | head``) and a sample of 4-stage cuts are trained with
the real runtime (:class:`fxpipe.runtime.executor.PipelineExecutor` over gloo ranks on this
machine, one thread per rank, pipeline 2 (or 4), data 1, 1F1B), and so are the cuts the planner
picks for the same layout under three cost models:

* **FLOP**: ``cluster.costs: analytic`` with ``memory_GBps`` 10^9 and ``op_overhead_us`` 0:
  time = FLOPs / ``device_tflops`` only (the cost model before issue 9: ops that do no matmul
  work are free);
* **analytic**: ``cluster.costs: analytic`` with the defaults (roofline: the longer of FLOPs /
  ``device_tflops`` and bytes / ``memory_GBps``, plus ``op_overhead_us`` per op), planned
  without any profile in the cache (so the default send cost too);
* **measured**: ``cluster.costs: measured``: the planner profiles every node of the model on
  this machine (one thread, as a worker rank runs) and what a send costs two busy gloo ranks
  (:func:`fxpipe.training.profiling.measure_send_cost`), into a cache directory of this run;
  then (``cluster.measure_stages``, the default) it times the planned cut's stages whole,
  moves the cut where they disagree with the per-node sums, and times the near ties (cuts
  within 3% of its simulated step) beside it (:mod:`fxpipe.partitioner.refine`).

Cuts are planned with :func:`fxpipe.partitioner.driver.plan_with_graph` (``cuts=[0, i]`` for a
given cut, no ``cuts`` for the pick), so every measured plan goes through the same code as a user's
plan. Measuring has two phases, each ONE process group in which every rank traces the model
once per plan (:func:`~fxpipe.partitioner.split.trace_for_plan`, ``build_stages``) and then
visits the plans in rounds whose order alternates (A B C .. C B A .., the ABBA pattern of the
other runtime benchmarks), each visit ``--warmup`` untimed steps then ``--steps`` timed ones:

* a **screen** of every cut (``--rounds`` rounds);
* a **head-to-head** run of the ``--finalists`` fastest screened boundary cuts and every pick
  (``--final-rounds`` rounds): with few cuts the alternation is fast, so load that changes over
  minutes on this shared machine touches them alike. Gaps come from this run.

A step time is the median over the timed steps of the global step window (first rank's start to
last rank's end); its noise is the interquartile range over those steps relative to the median.
Before each phase (and before the planner profiles a model) the script waits, up to
``--max-wait`` seconds, for the machine to be less than ``--max-busy`` busy.

Target (issue 9): the measured-cost pick within 3% of the measured fastest block-boundary
2-stage cut. Also reported: the FLOP and analytic picks, the rank correlation of predicted and
measured step times over all 2-stage cuts, and predicted vs measured per-stage times of the
measured pick (F and B per micro-batch: the executor's mean F / B action seconds).

Run: ``python benchmarks/bench_pick.py`` (writes the ``pick`` section of BENCHMARKS.md);
``--tiny`` for the smoke-test configuration, ``--no-write`` to only print, ``--models`` to pick
models, ``--no-4`` to skip the 4-stage runs.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `fxpipe` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks._report import BENCHMARKS_MD, markdown_table, write_section  # noqa: E402
from benchmarks._runtime_bench import RankRun, analyze, load_average, machine_note  # noqa: E402
from benchmarks.models import HeadHeavyLM, VGGLike, layer_paths  # noqa: E402

__all__ = ["NormProbe", "PickModel", "MODELS", "TINY", "block_boundaries", "stage_starts",
           "pick_worker", "CutRun", "ModelResult", "bench_model", "main"]

SECTION = "pick"
#: target of issue 9: measured-cost pick within this fraction of the fastest cut
TARGET = 0.03
MODES = ("flop", "analytic", "measured")


# --------------------------------------------------------------------------------------- models
class NormGELU(nn.Module):
    """LayerNorm + GELU: ``[B, w] -> [B, w]``; no matmul, so FLOP costs call it free."""

    def __init__(self, width: int):
        super().__init__()
        self.ln = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.ln(x))


class NormProbe(nn.Module):
    """The probe of issue 9: ``n_fc`` Linear(w, w) layers (``fc.0..``) then ``n_norm``
    LayerNorm+GELU layers (``norms.0..``): float32 ``[B, w] -> [B, w]``. Under FLOP costs the
    norms are free, so a 2-stage plan splits the Linears and piles every norm on the last stage;
    on a CPU the norms cost more than the Linears together at this width."""

    def __init__(self, width: int = 256, n_fc: int = 4, n_norm: int = 24):
        super().__init__()
        self.fc = nn.ModuleList(nn.Linear(width, width) for _ in range(n_fc))
        self.norms = nn.ModuleList(NormGELU(width) for _ in range(n_norm))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for f in self.fc:
            x = f(x)
        for n in self.norms:
            x = n(x)
        return x


@dataclass(frozen=True)
class PickModel:
    """A model of the benchmark.

    Attributes:
        name / description: for the report.
        factory: ``() -> nn.Module`` (called under ``torch.manual_seed``).
        batch: ``(n, generator) -> (input, target)`` of ``n`` samples.
        loss: a built-in loss name (``cross_entropy``, ``mse``).
        mbs / m: samples per micro-batch, micro-batches per step.
        four: also run the 4-stage sample.
    """

    name: str
    description: str
    factory: Callable[[], nn.Module]
    batch: Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    loss: str
    mbs: int
    m: int = 8
    four: bool = True


def _tokens(vocab: int, t: int):
    return lambda n, g: (torch.randint(0, vocab, (n, t), generator=g),
                         torch.randint(0, vocab, (n, t), generator=g))


def _images(c: int, h: int, classes: int):
    return lambda n, g: (torch.randn(n, c, h, h, generator=g),
                         torch.randint(0, classes, (n,), generator=g))


def _vectors(w: int):
    return lambda n, g: (torch.randn(n, w, generator=g), torch.randn(n, w, generator=g))


MODELS: dict[str, PickModel] = {
    "lm-vocab8k": PickModel(
        "lm-vocab8k", "GPT-style LM, 6 blocks x width 128, untied 8,192-token head (about 5 "
        "blocks' FLOPs), micro-batch 2 x 64 tokens", lambda: HeadHeavyLM(8192, 64, 6, 4, 128),
        _tokens(8192, 64), "cross_entropy", mbs=2),
    "vgg-cnn": PickModel(
        "vgg-cnn", "VGG-16-shaped CNN at quarter width (16..128 channels), 13 conv + 3 FC "
        "(512 wide), micro-batch 8 x 3 x 32 x 32", lambda: VGGLike(3, 10, 32, 0.25, 512),
        _images(3, 32, 10), "cross_entropy", mbs=8),
    "norm-probe": PickModel(
        "norm-probe", "4 Linear(256, 256) then 24 LayerNorm+GELU layers, micro-batch 256 x 256",
        lambda: NormProbe(256, 4, 24), _vectors(256), "mse", mbs=256),
}

TINY: dict[str, PickModel] = {
    "lm-vocab8k": PickModel("lm-vocab8k", "tiny head-heavy LM",
                             lambda: HeadHeavyLM(2000, 16, 2, 2, 32), _tokens(2000, 16),
                             "cross_entropy", mbs=2, m=2),
    "vgg-cnn": PickModel("vgg-cnn", "tiny VGG-like CNN", lambda: VGGLike(3, 10, 32, 0.0625, 64),
                         _images(3, 32, 10), "cross_entropy", mbs=2, m=2, four=False),
    "norm-probe": PickModel("norm-probe", "tiny norm probe", lambda: NormProbe(32, 4, 8),
                            _vectors(32), "mse", mbs=16, m=2),
}


def build_model(pm: PickModel, seed: int = 0) -> nn.Module:
    """``pm``'s model with seeded weights on the CPU."""
    torch.manual_seed(seed)
    return pm.factory()


def global_batch(pm: PickModel, seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed batch of ``m * mbs`` samples (the same on every rank)."""
    return pm.batch(pm.m * pm.mbs, torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------------------- specs
def spec_dict(pm: PickModel, mode: str, pipeline: int) -> dict:
    """The spec of one cost mode: pipeline ``pipeline``, data 1, ``pm.m`` micro-batches, 1F1B,
    one CPU node of ``pipeline`` devices, SGD."""
    cluster: dict = {"nodes": 1, "devices_per_node": pipeline, "memory_gb": 16}
    if mode == "flop":
        cluster.update(memory_GBps=1e9, op_overhead_us=0.0)
    elif mode == "measured":
        cluster["costs"] = "measured"
    elif mode != "analytic":
        raise ValueError(f"cost mode {mode!r}: use one of {MODES}")
    return {"model": {"factory": "benchmarks.models:HeadHeavyLM"},  # not built: model passed in
            "data": {"batch_size": pm.m * pm.mbs, "seq_len": 64},
            "parallel": {"pipeline": pipeline, "data": 1, "microbatches": pm.m,
                         "schedule": "1f1b"},
            "cluster": cluster,
            "train": {"optimizer": "sgd", "lr": 1e-4, "loss": pm.loss,
                      "activation_recompute": "off"}}


@contextlib.contextmanager
def cache_at(path: str | Path):
    """``FXPIPE_CACHE_DIR`` set to ``path`` for the ``with`` block (profiles and send cost)."""
    old = os.environ.get("FXPIPE_CACHE_DIR")
    os.environ["FXPIPE_CACHE_DIR"] = str(path)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("FXPIPE_CACHE_DIR", None)
        else:
            os.environ["FXPIPE_CACHE_DIR"] = old


# --------------------------------------------------------------------------------------- cuts
def unit_layers(model: nn.Module, units: list[tuple[str, str]]) -> list[str]:
    """The layer (:func:`benchmarks.models.layer_paths`) of every planning unit; units of the
    root module join the layer before (the first layer at the start)."""
    layers = sorted(layer_paths(model), key=len, reverse=True)
    out: list[str | None] = []
    for _, path in units:
        out.append(next((lay for lay in layers if path == lay or path.startswith(lay + ".")),
                        None))
    first = next((x for x in out if x is not None), "")
    prev = first
    for i, x in enumerate(out):
        out[i] = prev = x if x is not None else prev
    return out  # type: ignore[return-value]


def block_boundaries(layers: list[str]) -> list[int]:
    """Unit positions where the layer changes (possible stage starts, 0 excluded)."""
    return [i for i in range(1, len(layers)) if layers[i] != layers[i - 1]]


def stage_starts(plan, pr) -> list[int]:
    """The stage starts (unit positions) of ``plan``, against the priced units ``pr``
    (``plan_with_graph(..., units_only=True)[0]``), folded (planned as blocks) or not."""
    tb = pr.table
    names = tb.names
    if plan.folded:
        fo, g = tb.folding, pr.pg.graph
        fd = plan.folded
        n_pro, count = len(fo.prologue), fo.run.count
        stage = []
        for u in range(n_pro):
            stage.append(fd["prologue"][pr.pg.order[fo.prologue[u]]])
        stage += list(fd["blocks"])
        k = 0
        for p_ in fo.epilogue:
            stage.append(fd["epilogue"][k])
            k += len(g.nodes[pr.pg.order[p_]]["members"])
        assert len(stage) == n_pro + count + len(fo.epilogue) == len(names)
    else:
        son = plan.stage_of_node()
        stage = [son[n] for n in names]
    starts = [0] + [i for i in range(1, len(stage)) if stage[i] != stage[i - 1]]
    if len(starts) != plan.num_stages or sorted(set(stage)) != list(range(plan.num_stages)):
        raise AssertionError(f"stages of the units are not contiguous: {stage}")
    return starts


def cut_label(cut: list[int], layers: list[str]) -> str:
    """``h.1 | ln_f``-style label: the first layer of every stage after the first (with the
    unit position when the cut is inside a layer)."""
    parts = []
    for c in cut[1:]:
        inside = layers[c] == layers[c - 1]
        parts.append(f"{layers[c]}@{c}" if inside else layers[c])
    return " | ".join(parts)


def cpu_busy(seconds: float = 1.0) -> float | None:
    """Fraction of the machine's CPU time busy over the next ``seconds`` (``/proc/stat``),
    or None where that file does not exist."""
    def sample():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        idle = v[3] + (v[4] if len(v) > 4 else 0)
        return sum(v), idle
    try:
        t0, i0 = sample()
        time.sleep(seconds)
        t1, i1 = sample()
    except OSError:
        return None
    return 1.0 - (i1 - i0) / max(1, t1 - t0)


def wait_quiet(max_busy: float, max_wait_s: float, log=print) -> float | None:
    """Wait (at most ``max_wait_s``) until the machine is less than ``max_busy`` busy (other
    engineers' jobs share it); returns the last busy fraction seen."""
    deadline = time.monotonic() + max_wait_s
    busy = cpu_busy()
    waited = False
    while busy is not None and busy > max_busy and time.monotonic() < deadline:
        if not waited:
            log(f"  machine {busy:.0%} busy: waiting up to {max_wait_s:.0f} s for < "
                f"{max_busy:.0%}")
            waited = True
        busy = cpu_busy(2.0)
    return busy


# --------------------------------------------------------------------------------------- worker
def pick_worker(rank: int, name: str, tiny: bool, plans: list[dict], warmup: int, rounds: int,
                steps: int, pin: bool = False) -> list[RankRun]:
    """On every rank: build this rank's stages of every plan, then ``rounds`` rounds over the
    plans (order reversed every other round), each visit ``warmup`` untimed + ``steps`` timed
    steps. Returns one :class:`RankRun` per plan (its timed steps of all rounds). ``pin``:
    this rank (and the gloo threads it starts) runs on core ``rank`` only, as a rank owns its
    device."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if pin and cores:  # every thread of the process: gloo's started before this ran
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(tid), {cores[rank % len(cores)]})
    from fxpipe.partitioner.split import build_stages, trace_for_plan
    from fxpipe.plans.plan import Plan
    from fxpipe.runtime.executor import PipelineExecutor
    from fxpipe.runtime.mesh import Mesh
    from fxpipe.schedule.lowering import schedule_for_plan
    from fxpipe.execution.losses import resolve_loss

    pm = (TINY if tiny else MODELS)[name]
    model = build_model(pm)
    x, y = global_batch(pm)
    loss_fn = resolve_loss(pm.loss)
    p = Plan.from_dict(plans[0]).pipeline
    mesh = Mesh(p, 1, timeout_s=120)
    exes = []
    for d in plans:
        plan = Plan.from_dict(d)
        traced = trace_for_plan(plan, model)  # resolves a plan made as blocks: first
        schedule = schedule_for_plan(plan)
        mine = schedule.stages_of_rank(mesh.pipe_rank)
        stages = build_stages(plan, traced, mine)
        params = list({id(q): q for mod in stages.values() for q in mod.parameters()}.values())
        ex = PipelineExecutor(plan, schedule, stages, mesh, loss_fn,
                              torch.optim.SGD(params, lr=1e-4), timeout_s=120)
        exes.append((plan, mine, ex))
    out = [RankRun(None, mesh.pipe_rank, mine, [], [], [], {}) for _, mine, _ in exes]
    inputs = None
    for r in range(rounds):
        order = list(range(len(exes))) if r % 2 == 0 else list(reversed(range(len(exes))))
        for i in order:
            plan, _, ex = exes[i]
            inputs = {plan.model_inputs[0]: x}
            for _ in range(warmup + (1 if r == 0 else 0)):
                ex.step(inputs, y)
            ex.reset_stats()
            for _ in range(steps):
                ex.step(inputs, y)
            run = out[i]
            run.events.extend(tuple(e) for e in ex.events)
            run.step_starts_s.extend(ex.step_starts_s)
            run.step_times_s.extend(ex.step_times_s)
            run.peak_inflight.update(ex.peak_inflight)
    return out


# --------------------------------------------------------------------------------------- results
@dataclass
class Sample:
    """One measurement phase of one cut.

    Attributes:
        steps_s: every timed step window (global: first rank's start to last rank's end),
            seconds, in time order. step_s: their median. iqr: interquartile range / median.
        round_s: median of each round's visit (for gaps paired by round).
        stage_meas: per stage ``(F, B+W, send)`` measured mean seconds per micro-batch.
    """

    steps_s: list[float]
    step_s: float
    iqr: float
    round_s: list[float]
    stage_meas: list[tuple[float, float, float]]

    @staticmethod
    def of(rank_runs: list[RankRun], rounds: int, steps: int, k: int) -> "Sample":
        meas = analyze(rank_runs)
        st = [e - s for s, e in meas.windows]
        med = statistics.median(st)
        q1, q3 = _quartiles(st)
        rs = [statistics.median(st[r * steps:(r + 1) * steps]) for r in range(rounds)]
        stage = [(meas.op_mean_s.get(("F", s), 0.0),
                  meas.op_mean_s.get(("B", s), 0.0) + meas.op_mean_s.get(("W", s), 0.0),
                  meas.send_mean_s.get(s, 0.0)) for s in range(k)]
        return Sample(st, med, (q3 - q1) / med, rs, stage)


@dataclass
class CutRun:
    """One measured cut.

    Attributes:
        cut: stage starts (unit positions). label: layers that start stages 1..
        boundary: every cut is at a layer boundary. picked_by: cost modes that picked it.
        predicted_s: the measured-cost plan's predicted step time (simulator), seconds.
        stage_pred: per stage ``(F, B+W, send)`` predicted seconds per micro-batch (measured
            costs). stage_pred_analytic: the same under analytic costs (picks only).
        screen: the screening measurement (every cut). final: the head-to-head measurement
            (finalists only, else None).
    """

    cut: list[int]
    label: str
    boundary: bool
    picked_by: list[str] = field(default_factory=list)
    predicted_s: float = float("nan")
    stage_pred: list[tuple[float, float, float]] = field(default_factory=list)
    stage_pred_analytic: list[tuple[float, float, float]] = field(default_factory=list)
    screen: Sample | None = None
    final: Sample | None = None

    @property
    def best(self) -> Sample:
        """The final measurement where there is one, else the screen."""
        return self.final if self.final is not None else self.screen


@dataclass
class StageCount:
    """All measured cuts of one model at one stage count."""

    stages: int
    cuts: list[CutRun]
    candidates: int  # block-boundary cuts measured (all of them for 2 stages)
    sampled: bool
    picks: dict[str, list[int]]
    wall_s: float = 0.0
    busy_before: list[float] = field(default_factory=list)  # CPU busy before each phase
    load: str = ""  # 1/5/15-minute load averages before and after measuring

    def of(self, cut: list[int]) -> CutRun:
        return next(c for c in self.cuts if c.cut == cut)

    def screen_fastest(self) -> CutRun:
        """The fastest block-boundary cut of the screen."""
        pool = [c for c in self.cuts if c.boundary] or self.cuts
        return min(pool, key=lambda c: c.screen.step_s)

    def finalists(self) -> list[CutRun]:
        return [c for c in self.cuts if c.final is not None]

    def fastest(self) -> CutRun:
        """The fastest block-boundary finalist of the head-to-head run (the screen's fastest
        when there was no final)."""
        pool = [c for c in self.finalists() if c.boundary]
        if not pool:
            return self.screen_fastest()
        return min(pool, key=lambda c: c.final.step_s)

    def gap(self, mode: str) -> float:
        """Head-to-head median step of ``mode``'s pick over the fastest block-boundary
        finalist's, minus 1."""
        return self.of(self.picks[mode]).best.step_s / self.fastest().best.step_s - 1.0

    def gap_interval(self, mode: str, n: int = 2000, seed: int = 0) -> tuple[float, float]:
        """95% bootstrap interval of :meth:`gap`: the steps of the pick and of the fastest cut
        resampled with replacement ``n`` times, percentiles 2.5 and 97.5 of the ratio of
        their medians minus 1."""
        a, b = self.of(self.picks[mode]).best.steps_s, self.fastest().best.steps_s
        rng = random.Random(seed)
        v = sorted(statistics.median(rng.choices(a, k=len(a)))
                   / statistics.median(rng.choices(b, k=len(b))) - 1.0 for _ in range(n))
        return v[int(0.025 * n)], v[min(n - 1, int(0.975 * n))]

    def cross_gap(self, mode: str) -> float:
        """The gap with the fastest cut chosen on one half of the head-to-head rounds and
        timed on the other (even rounds choose, odd rounds time, then the other way round;
        the mean of the two): the fastest of several noisy medians is an optimistic estimate
        of its own step (the winner's curse), so a gap to it measured on the same steps comes
        out too large by about the noise. :meth:`gap` when there are fewer than 4 rounds."""
        pool = [c for c in self.finalists() if c.boundary]
        pick = self.of(self.picks[mode])
        if not pool or pick.final is None or len(pick.final.round_s) < 4:
            return self.gap(mode)
        halves = (slice(0, None, 2), slice(1, None, 2))
        gaps = []
        for choose, time_on in (halves, halves[::-1]):
            best = min(pool, key=lambda c: statistics.median(c.final.round_s[choose]))
            gaps.append(statistics.median(pick.final.round_s[time_on])
                        / statistics.median(best.final.round_s[time_on]) - 1.0)
        return statistics.fmean(gaps)

    def paired_gap(self, mode: str) -> float:
        """The gap paired by round: median over the head-to-head rounds of (pick's visit
        median / fastest cut's visit median of the same round) - 1; load that drifts between
        rounds cancels."""
        a, b = self.of(self.picks[mode]).best.round_s, self.fastest().best.round_s
        return statistics.median(x / y for x, y in zip(a, b)) - 1.0


@dataclass
class ModelResult:
    """Everything measured for one model."""

    name: str
    description: str
    units: int
    layers: list[str]
    boundaries: list[int]
    counts: dict[int, StageCount]
    plan_s: dict[str, float]
    profile_s: float
    loss_s: float = 0.0
    profile_busy: float | None = None
    loss_name: str = ""
    loss_pred_s: float = 0.0
    m: int = 0  # micro-batches per step
    #: per stage count, the measured pick's own plan's per-stage (F, B+W, send): its stages
    #: as timed whole by ``cluster.measure_stages`` (the per-node sums in ``stage_pred``)
    pick_stage_pred: dict[int, list[tuple[float, float, float]]] = field(default_factory=dict)
    #: per stage count, the measured plan's ``cluster.measure_stages`` line
    refine_notes: dict[int, str] = field(default_factory=dict)


def _stage_times(plan) -> list[tuple[float, float, float]]:
    """(F, B, send) predicted per stage; send: the mean over the stage's forward sends and
    gradient sends (as the measured column averages its SEND_F and SEND_B actions)."""
    def send(s) -> float:
        ts = [t for t in (s.send_time_s if s.send_bytes else 0.0, s.grad_send_time_s or 0.0)
              if t > 0]
        return sum(ts) / len(ts) if ts else 0.0
    return [(s.fwd_time_s, s.bwd_input_time_s + s.bwd_weight_time_s, send(s))
            for s in plan.stages]


def _spearman(a: list[float], b: list[float]) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        for k, i in enumerate(order):
            r[i] = float(k)
        return r
    if len(a) < 3:
        return float("nan")
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    num = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    den = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return num / den if den else float("nan")


def _quartiles(v: list[float]) -> tuple[float, float]:
    if len(v) < 4:
        return min(v), max(v)
    q = statistics.quantiles(v, n=4)
    return q[0], q[2]


def _sample_cuts(boundaries: list[int], k: int, n: int, rng: random.Random,
                 layers: list[str]) -> list[list[int]]:
    """``n`` k-stage block-boundary cuts: the equal-layers cut, then distinct random ones."""
    if len(boundaries) < k - 1:
        return []
    lay_starts = [0] + boundaries  # start of each layer
    nl = len(lay_starts)
    equal = [lay_starts[round(j * nl / k)] for j in range(k)]
    out = [equal] if len(set(equal)) == k else []
    seen = {tuple(c) for c in out}
    tries = 0
    while len(out) < n and tries < 1000:
        tries += 1
        c = [0] + sorted(rng.sample(boundaries, k - 1))
        if tuple(c) not in seen:
            seen.add(tuple(c))
            out.append(c)
    return out


def _measure(pm: PickModel, tiny: bool, k: int, plans: list, rounds: int, args, log):
    """Run ``plans`` on ``k`` gloo ranks (one process group); one :class:`Sample` per plan,
    the wall seconds, and the machine's busy fraction just before."""
    from fxpipe.runtime.local_ranks import run_ranks

    busy = wait_quiet(args.max_busy, args.max_wait, log) if args.max_wait > 0 else None
    t0 = time.perf_counter()
    res = run_ranks(pick_worker, k, pm.name, tiny, [p.to_dict() for p in plans], args.warmup,
                    rounds, args.steps, args.pin, timeout_s=args.timeout, dist_timeout_s=120.0)
    wall = time.perf_counter() - t0
    samples = [Sample.of([res[r][i] for r in range(k)], rounds, args.steps, k)
               for i in range(len(plans))]
    return samples, wall, busy


def bench_model(pm: PickModel, tiny: bool, args, cache: Path, log=print) -> ModelResult:
    """Plan the picks; plan and screen every cut; measure the finalists head to head."""
    from fxpipe.partitioner.driver import plan_with_graph, planning_units
    from fxpipe.specs.loader import load_spec
    from fxpipe.training.profiling import measure_send_cost

    torch.set_num_threads(1)  # plan (and profile) as a worker rank runs
    model = build_model(pm)
    x, _ = global_batch(pm)
    ex = (x[:pm.mbs],)
    stage_counts = [2] + ([4] if pm.four and not args.no_4 else [])
    empty = cache / "empty"  # analytic planning sees no profile, no send cost
    measured_dir = cache / "measured"
    plan_s: dict[str, float] = {}
    profile_s, profile_busy, loss_pred_s = 0.0, None, 0.0
    specs = {(mode, k): load_spec(spec_dict(pm, mode, k)) for mode in MODES for k in stage_counts}
    with cache_at(empty):
        units = planning_units(model, specs[("analytic", 2)], ex)
        pr, _ = plan_with_graph(model, specs[("analytic", 2)], ex, units_only=True)
    layers = unit_layers(model, units)
    boundaries = block_boundaries(layers)
    log(f"[{pm.name}] {len(units)} units, {len(boundaries)} block boundaries")
    picks: dict[int, dict[str, list[int]]] = {k: {} for k in stage_counts}
    pick_stage: dict[int, list[tuple[float, float, float]]] = {}
    refine_notes: dict[int, str] = {}
    for mode in MODES:
        for k in stage_counts:
            first_measured = mode == "measured" and k == stage_counts[0]
            if first_measured and args.max_wait > 0:  # the profile is timed now
                profile_busy = wait_quiet(args.max_busy, args.max_wait, log)
            t0 = time.perf_counter()
            with cache_at(measured_dir if mode == "measured" else empty):
                if mode == "measured" and not (measured_dir / "profiles").exists():
                    measure_send_cost("cpu")
                plan, _ = plan_with_graph(model, specs[(mode, k)], ex)
            dt = time.perf_counter() - t0
            if first_measured:
                profile_s = dt  # the first measured plan of the model profiles it
            plan_s[f"{mode} p={k}"] = dt
            if mode == "measured" and k == 2:
                loss_pred_s = plan.stages[-1].loss_time_s
            if mode == "measured":
                pick_stage[k] = _stage_times(plan)
                refine_notes[k] = next((line for line in plan.explain
                                        if line.startswith("cluster.measure_stages")), "")
            picks[k][mode] = stage_starts(plan, pr)
            log(f"[{pm.name}] {mode} pick p={k}: {picks[k][mode]} "
                f"({cut_label(picks[k][mode], layers)}), {dt:.1f} s")
    rng = random.Random(0)
    counts: dict[int, StageCount] = {}
    bset = set(boundaries)
    for k in stage_counts:
        if k == 2:
            cands, sampled = [[0, b] for b in boundaries], False
        else:
            cands, sampled = _sample_cuts(boundaries, k, args.sample4, rng, layers), True
        allcuts = [list(c) for c in cands]
        for mode in MODES:
            if picks[k][mode] not in allcuts:
                allcuts.append(picks[k][mode])
        runs, plans = [], []
        with cache_at(measured_dir):
            for c in allcuts:
                plan, _ = plan_with_graph(model, specs[("measured", k)], ex, cuts=c)
                plans.append(plan)
                cr = CutRun(c, cut_label(c, layers), all(i in bset for i in c[1:]),
                            [mode for mode in MODES if picks[k][mode] == c])
                cr.predicted_s = plan.predicted.step_time_s
                cr.stage_pred = _stage_times(plan)
                runs.append(cr)
        with cache_at(empty):
            for cr in runs:
                if cr.picked_by:
                    pa, _ = plan_with_graph(model, specs[("analytic", k)], ex, cuts=cr.cut)
                    cr.stage_pred_analytic = _stage_times(pa)
        load_before = load_average()
        log(f"[{pm.name}] p={k}: screening {len(plans)} cuts ({args.rounds} rounds x "
            f"{args.steps} steps, {k} ranks)")
        samples, wall, busy0 = _measure(pm, tiny, k, plans, args.rounds, args, log)
        for cr, s in zip(runs, samples):
            cr.screen = s
        sc = StageCount(k, runs, len(cands), sampled, picks[k], wall)
        sc.busy_before.append(busy0)
        # head to head: the fastest screened boundary cuts and every pick
        ranked = sorted((c for c in runs if c.boundary), key=lambda c: c.screen.step_s)
        final = [c for c in runs if c in ranked[:args.finalists] or c.picked_by]
        final_rounds = args.final_rounds if k == 2 else args.final_rounds_4
        if final_rounds > 0 and len(final) > 1:
            idx = [runs.index(c) for c in final]
            log(f"[{pm.name}] p={k}: head to head, {len(final)} cuts ({final_rounds} "
                f"rounds x {args.steps} steps)")
            samples, wall, busy1 = _measure(pm, tiny, k, [plans[i] for i in idx],
                                            final_rounds, args, log)
            for i, s in zip(idx, samples):
                runs[i].final = s
            sc.wall_s += wall
            sc.busy_before.append(busy1)
        sc.load = f"{load_before} before, {load_average()} after"
        counts[k] = sc
        best = sc.fastest()
        log(f"[{pm.name}] p={k}: fastest {best.label} {best.best.step_s * 1e3:.1f} ms; "
            + ", ".join(f"{mode} {sc.of(picks[k][mode]).best.step_s * 1e3:.1f} ms "
                        f"({sc.gap(mode):+.1%})" for mode in MODES) + f"; {sc.wall_s:.0f} s")
    return ModelResult(pm.name, pm.description, len(units), layers, boundaries, counts, plan_s,
                       profile_s, loss_time_s(pm, model, ex[0]), profile_busy, pm.loss,
                       loss_pred_s, pm.m, pick_stage, refine_notes)


def loss_time_s(pm: PickModel, model: nn.Module, x: torch.Tensor, repeats: int = 15) -> float:
    """Median seconds of the loss's forward + backward on one micro-batch's output (what the
    last stage runs after the model's last node), one thread, in this process."""
    from fxpipe.execution.losses import resolve_loss

    loss_fn = resolve_loss(pm.loss)
    _, y = global_batch(pm)
    with torch.no_grad():
        out = model(x)
    times = []
    for _ in range(repeats + 3):
        o = out.detach().requires_grad_(True)
        t0 = time.perf_counter()
        loss_fn(o, y[:x.shape[0]]).backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[3:])


# --------------------------------------------------------------------------------------- report
def _ms(s: float) -> str:
    return f"{s * 1e3:.1f}"


def verdicts(results: list[ModelResult]) -> list[tuple[str, float, bool]]:
    """``(model, gap of the measured pick, within TARGET)`` for every model's 2-stage cuts."""
    out = []
    for r in results:
        g = r.counts[2].cross_gap("measured")
        out.append((r.name, g, g <= TARGET))
    return out


def summary_table(results: list[ModelResult], k: int) -> str:
    rows = []
    for r in results:
        sc = r.counts.get(k)
        if sc is None:
            continue
        best = sc.fastest()
        row = [r.name, f"{sc.candidates} of {math.comb(len(r.boundaries), k - 1)}"
               if sc.sampled else f"{sc.candidates}", f"`{sc.screen_fastest().label}`",
               f"{len(sc.finalists())}", f"`{best.label}`",
               f"{_ms(best.best.step_s)} ±{best.best.iqr / 2:.0%}"]
        for mode in MODES:
            c = sc.of(sc.picks[mode])
            row.append(f"`{c.label}` {_ms(c.best.step_s)} ({sc.gap(mode):+.1%})")
        lo, hi = sc.gap_interval("measured")
        row.append(f"{lo:+.1%} .. {hi:+.1%}")
        row.append(f"{sc.paired_gap('measured'):+.1%}")
        row.append(f"{sc.cross_gap('measured'):+.1%}")
        if k == 2:
            row.append("**PASS**" if sc.cross_gap("measured") <= TARGET else "**FAIL**")
        rows.append(row)
    header = ["model", "boundary cuts" if k == 2 else "boundary cuts sampled",
              "screen's fastest", "head to head", "fastest cut", "its step ms (±IQR/2)",
              "FLOP pick: step ms (gap)", "analytic pick", "measured pick",
              "measured pick's gap, 95% bootstrap interval", "measured pick's gap paired by round",
              "measured pick's gap, fastest chosen on other rounds"]
    if k == 2:
        header.append(f"measured pick within {TARGET:.0%}")
    return markdown_table(header, rows)


def cuts_table(r: ModelResult, k: int) -> str:
    sc = r.counts[k]
    sbest, best = sc.screen_fastest(), sc.fastest()
    rows = []
    for c in sorted(sc.cuts, key=lambda c: c.cut):
        s, f = c.screen, c.final
        rows.append([f"`{c.label}`" + ("" if c.boundary else " (inside a layer)"),
                     f"**{_ms(s.step_s)}**" if c is sbest else _ms(s.step_s), f"{s.iqr:.0%}",
                     _ms(min(s.steps_s)), f"{s.step_s / sbest.screen.step_s - 1:+.1%}",
                     "" if f is None else (f"**{_ms(f.step_s)}**" if c is best
                                           else _ms(f.step_s)),
                     "" if f is None else f"{f.iqr:.0%}",
                     "" if f is None else f"{f.step_s / best.final.step_s - 1:+.1%}"
                     if best.final is not None else "",
                     _ms(c.predicted_s), ", ".join(c.picked_by)])
    return markdown_table(["cut (stage starts)", "screen step ms", "IQR", "fastest step ms",
                           "vs screen's fastest", "head-to-head step ms", "IQR",
                           "vs fastest", "predicted step ms (measured costs)", "picked by"],
                          rows)


def stage_table(r: ModelResult, k: int = 2) -> str:
    sc = r.counts[k]
    c = sc.of(sc.picks["measured"])
    rows = []
    for s in range(k):
        pf, pb, ps = c.stage_pred[s]
        mf, mb, msend = c.best.stage_meas[s]
        af, ab, _ = c.stage_pred_analytic[s] if c.stage_pred_analytic else (0.0, 0.0, 0.0)
        tf, tb, _ = (r.pick_stage_pred[k][s] if k in r.pick_stage_pred
                     else (float("nan"),) * 3)
        rows.append([str(s), _ms(pf), _ms(mf), _ms(pb), _ms(mb), _ms(pf + pb), _ms(mf + mb),
                     f"{(pf + pb) / (mf + mb) - 1:+.0%}" if mf + mb else "n/a",
                     _ms(tf + tb), f"{(tf + tb) / (mf + mb) - 1:+.0%}" if mf + mb else "n/a",
                     _ms(af + ab), f"{ps * 1e3:.2f}", f"{msend * 1e3:.2f}"])
    return markdown_table(["stage", "F pred ms", "F meas ms", "B pred ms", "B meas ms",
                           "F+B pred ms", "F+B meas ms", "pred/meas - 1",
                           "F+B plan ms (stages timed whole)", "plan/meas - 1",
                           "F+B analytic ms", "send pred ms", "send meas ms"], rows)


def _busy(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.0%}"


def report(results: list[ModelResult], args, note: str, wall: float, cache_note: str) -> str:
    ok = verdicts(results)
    lines = [
        "## Benchmark of the pick: planned cut vs every block-boundary cut, measured (gloo, CPU)",
        "",
        "Written by `python benchmarks/bench_pick.py` (issue 9). For each model, every 2-stage "
        "cut at a layer boundary and a sample of 4-stage cuts (the equal-layers cut and "
        f"{args.sample4 - 1} random boundary cuts) are trained with fxpipe's runtime "
        "(`PipelineExecutor`, gloo, one thread per rank"
        f"{', each rank pinned to its own core' if args.pin else ''}, pipeline 2 or 4, data 1, "
        f"{'/'.join(sorted({str(r.m) for r in results}))} micro-batches, 1F1B, SGD), together "
        "with the cuts "
        "the planner picks for the same layout under three cost models: **FLOP** (`costs: "
        "analytic`, `memory_GBps: 1e9`, `op_overhead_us: 0`: FLOPs / `device_tflops` only, "
        "the pre-issue-9 model), **analytic** (`costs: analytic` with the defaults: roofline "
        "of FLOPs and bytes plus a per-op cost, no profile in the cache) and **measured** "
        "(`costs: measured`: the planner profiles every node on this machine with one thread, "
        "and what a send costs two busy gloo ranks (sender and receiver, one message per tensor); then, `cluster.measure_stages` (the default), "
        "it times the planned cut's stages whole, side by side (one thread per rank, as the "
        "two ranks share this CPU), moves the cut where they disagree with the per-node "
        "sums, and times up to 3 near ties (cuts moving one boundary that come within 3% of "
        "its simulated step) beside it, keeping the fastest). Ranks, profile and stage timing run with glibc's malloc keeping freed memory "
        "(`fxpipe.execution.host_memory`). Each cut is planned by `plan_with_graph(..., "
        "cuts=[...])`, so it runs the same code path as a planned one (the per-node sums: a "
        "given cut is not refined).",
        "",
        "Measuring, in two phases, each in one process group: a **screen** of every cut "
        f"({args.rounds} rounds of alternating order A B .. B A .., each visit {args.warmup} "
        f"warm-up + {args.steps} timed steps), then a **head-to-head** run of the "
        f"{args.finalists} fastest screened boundary cuts and every pick ({args.final_rounds} "
        f"rounds with 2 stages, {args.final_rounds_4} with 4, same pattern): the fewer cuts alternate faster, so load that changes over "
        "minutes touches them alike. A step time is the median of the global step window "
        "(first rank's start to last rank's end) over the timed steps; IQR is their "
        "interquartile range over the median (the noise); gaps are to the fastest "
        "block-boundary cut of the head-to-head run, and the paired gap is the median over its "
        "rounds of the per-round ratio. The verdict reads the last gap column: the fastest "
        "finalist chosen on the even rounds and timed against the pick on the odd ones, and "
        "the other way round (mean of the two). Choosing and timing the fastest on the same "
        "steps favours whichever finalist the noise flattered (the winner's curse), which "
        "makes every other cut look slower by about the noise: the plain gap columns carry "
        "that bias. Before each phase the script waits (up to "
        f"{args.max_wait:.0f} s) for the machine to be less than {args.max_busy:.0%} busy: it "
        "is shared with other engineers' jobs.",
        "",
        "Models:",
        "",
    ]
    for r in results:
        lines.append(f"- `{r.name}`: {r.description}; {r.units} planning units in "
                     f"{len(set(r.layers))} layers, so {len(r.boundaries)} "
                     "block-boundary 2-stage cuts.")
    lines += ["", "### 2 stages (2 ranks): every block-boundary cut", "",
              summary_table(results, 2), ""]
    fails = [n for n, g, passed in ok if not passed]
    lines.append(
        f"Target (measured-cost pick within {TARGET:.0%} of the measured fastest cut): "
        + (f"**PASS** on all {len(ok)} models." if not fails else
           f"**FAIL** on {', '.join(fails)} ({', '.join(f'{g:+.1%}' for n, g, p in ok if not p)}); "
           f"PASS on {len(ok) - len(fails)} of {len(ok)}.")
        + " The bootstrap interval shows how far this machine's step-to-step noise (IQR "
          "columns below) leaves each gap uncertain: where it straddles 3%, this run cannot "
          "tell PASS from FAIL.")
    lines.append("")
    if any(4 in r.counts for r in results):
        lines += ["### 4 stages (4 ranks on 2 cores: oversubscribed): a sample of cuts", "",
                  "Four single-thread ranks share two cores, so stages time-slice and absolute "
                  "times are inflated; the ranking is what to read. The fastest sampled cut is "
                  "an upper bound on the best 4-stage cut; no target applies.", "",
                  summary_table(results, 4), ""]
    for r in results:
        lines += [f"### `{r.name}`: every measured cut", ""]
        for k in sorted(r.counts):
            sc = r.counts[k]
            rho = _spearman([c.predicted_s for c in sc.cuts],
                            [c.screen.step_s for c in sc.cuts])
            lines += [f"{k} stages ({len(sc.cuts)} cuts, {sc.wall_s:.0f} s measuring; machine "
                      f"busy before the phases {', '.join(_busy(b) for b in sc.busy_before)}; "
                      f"load average {sc.load}; rank correlation of predicted and screened "
                      f"step time {rho:.2f}):", "", cuts_table(r, k), ""]
        pick = r.counts[2].of(r.counts[2].picks["measured"])
        lines += [f"Predicted (measured costs; analytic beside) vs measured per-stage times of "
                  f"the measured pick `{pick.label}`, ms per micro-batch (F: forward, B: "
                  "backward, each the executor's mean action time in the "
                  f"{'head-to-head' if pick.final else 'screen'} run; send pred: what one "
                  "send action costs in the plan (measured between busy ranks: the sender's "
                  "staging and the receiver's reading, charged to the sender); send meas: the "
                  "executor's SEND action alone (the sender's staging, without the receiver's "
                  "share); F+B plan: the measured-cost plan's own stage times, which "
                  "`cluster.measure_stages` took from its stages timed whole, side by side):",
                  "", stage_table(r, 2), "",
                  f"The measured-cost plan's refinement: {r.refine_notes.get(2) or 'none'}", "",
                  f"The last stage also runs the loss (`{r.loss_name}`) on the model's output: "
                  f"{r.loss_s * 1e3:.2f} ms per micro-batch forward + backward, measured here "
                  "in one process; the plan's last-stage times include it (the planner prices "
                  "the loss on the stage that produces the model output: "
                  f"{r.loss_pred_s * 1e3:.2f} ms in the measured-cost plan).", "",
                  "Planning time (s): " + ", ".join(f"{k} {v:.1f}" for k, v in r.plan_s.items())
                  + f" (the first measured plan includes profiling the model: "
                  f"{r.profile_s:.1f} s, machine {_busy(r.profile_busy)} busy before).", ""]
    lines += [cache_note, "", f"{note}; whole benchmark {wall:.0f} s, "
              f"{time.strftime('%Y-%m-%d')}. No GPU was lent to this task: CPU figures only."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[ModelResult]:
    """Run the benchmark; print the tables; write the ``pick`` section unless ``--no-write``.

    Args:
        argv: ``--tiny``, ``--models a,b``, ``--rounds N``, ``--final-rounds N``,
            ``--finalists N``, ``--steps N``, ``--warmup N``, ``--sample4 N``, ``--no-4``,
            ``--max-busy F``, ``--max-wait S``, ``--cache DIR``, ``--no-write``, ``--out PATH``;
            None reads ``sys.argv``.

    Returns:
        One :class:`ModelResult` per model. A FAIL does not change the exit status.
    """
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny models (smoke test)")
    ap.add_argument("--models", default=None, help="comma-separated model names")
    ap.add_argument("--rounds", type=int, default=4, help="screen rounds (default 4)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per visit (default 3)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per visit (default 1)")
    ap.add_argument("--finalists", type=int, default=3,
                    help="fastest screened boundary cuts measured head to head with the picks")
    ap.add_argument("--final-rounds", type=int, default=32,
                    help="rounds of the 2-stage head-to-head run (default 32; 0: none)")
    ap.add_argument("--final-rounds-4", type=int, default=12,
                    help="rounds of the 4-stage head-to-head run (default 12; 0: none)")
    ap.add_argument("--sample4", type=int, default=6, help="4-stage cuts sampled (default 6)")
    ap.add_argument("--no-4", action="store_true", help="skip the 4-stage runs")
    ap.add_argument("--timeout", type=float, default=900.0, help="per process group, seconds")
    ap.add_argument("--cache", default=None,
                    help="FXPIPE_CACHE_DIR for the profiles (default: a fresh temporary folder)")
    ap.add_argument("--max-busy", type=float, default=0.3,
                    help="wait before each process group until the machine is less busy than "
                         "this fraction (default 0.3)")
    ap.add_argument("--max-wait", type=float, default=240.0,
                    help="longest wait for a quiet machine, seconds (0: do not wait)")
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                    help="pin rank r to core r (default on; --no-pin lets the OS move them)")
    ap.add_argument("--no-write", action="store_true", help="print only")
    ap.add_argument("--out", default=str(BENCHMARKS_MD), help="report file (default BENCHMARKS.md)")
    args = ap.parse_args(argv)
    zoo = TINY if args.tiny else MODELS
    names = args.models.split(",") if args.models else list(zoo)
    load0 = load_average()
    t0 = time.perf_counter()
    tmp = None
    if args.cache is None:
        tmp = tempfile.TemporaryDirectory(prefix="fxpipe-pick-")
        cache = Path(tmp.name)
        cache_note = ("Profiles were measured afresh into a temporary cache folder by this run "
                      "(none reused).")
    else:
        cache = Path(args.cache)
        cache_note = f"Profiles cached under `{cache}` (reused when present)."
    try:
        results = [bench_model(zoo[n], args.tiny, args, cache) for n in names]
    finally:
        if tmp is not None:
            tmp.cleanup()
    wall = time.perf_counter() - t0
    print()
    print(summary_table(results, 2))
    if any(4 in r.counts for r in results):
        print()
        print(summary_table(results, 4))
    for r in results:
        print(f"\n{r.name}:")
        for k in sorted(r.counts):
            print(cuts_table(r, k))
        print(stage_table(r, 2))
    for n, g, passed in verdicts(results):
        print(f"{n}: measured pick {g:+.1%} vs fastest: {'PASS' if passed else 'FAIL'}")
    if not args.no_write:
        path = write_section(SECTION, report(results, args, machine_note(load0), wall,
                                             cache_note), args.out)
        print(f"\nwrote section '{SECTION}' of {path}")
    return results


if __name__ == "__main__":
    main()
