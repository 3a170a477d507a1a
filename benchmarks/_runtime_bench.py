"""Shared pieces of the runtime benchmarks (not part of the fxpipe package).

* :class:`MLPStack` - ``n`` identical blocks (Linear(width, width) + GELU), float32
  ``[B, width] -> [B, width]``; cut into stages of exactly ``blocks_per_stage`` blocks each
  (:func:`equal_split`), so every pipeline stage costs the same.
* :func:`executor_worker` - runs on every rank of a spawned gloo group
  (:func:`fxpipe.runtime.local_ranks.run_ranks`): builds the plan and schedule for each :class:`RunSpec`,
  trains ``warmup`` steps with :class:`~fxpipe.runtime.executor.PipelineExecutor`, clears its
  statistics, trains ``steps`` more and returns the executor's events, step windows and peak
  in-flight counts (:class:`RankRun`).
* :func:`analyze` - turns the ranks' :class:`RankRun` of one run into measured figures
  (:class:`Measured`): the idle (bubble) fraction per rank with the simulator's definition
  (``1 - F/B/W busy seconds / step seconds``), mean per-action seconds per stage, peak in-flight
  micro-batches per stage.
* :func:`calibrated_simulation` - the simulator (:func:`fxpipe.schedule.simulate.simulate`) on the
  same action lists with per-stage F/B/W seconds and sender-side SEND seconds taken from the
  measured means.

Units: seconds, bytes. Plans are built by hand from :func:`fxpipe.partitioner.split.split_graph`
(costs left at zero: the executor does not read them), so the cut is exactly equal by block.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
#: where the runtime benchmarks write generated files (Chrome traces); output, not source
REPO_OUT = ROOT / "benchmarks" / "out"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fxpipe.specs.schema import AUTO_VIRTUAL_STAGES  # noqa: E402
from fxpipe.specs.schema import stages_per_rank as schema_stages_per_rank  # noqa: E402
from fxpipe.partitioner.boundaries import compute_nodes
from fxpipe.partitioner.split import split_graph  # noqa: E402
from fxpipe.plans.plan import Plan, StagePlan  # noqa: E402
from fxpipe.schedule.actions import Schedule  # noqa: E402
from fxpipe.schedule.lowering import schedule_for_plan  # noqa: E402
from fxpipe.schedule.simulate import Links, SimResult, StageCosts, simulate  # noqa: E402

__all__ = ["MLPStack", "StackConfig", "RunSpec", "RankRun", "Measured", "equal_split",
           "make_plan", "batch", "executor_worker", "analyze", "calibrated_simulation",
           "theory_bubble", "expected_peak", "run_group", "machine_note", "load_average",
           "step_events", "slice_step", "pingpong_latency", "calibrated_costs", "plan_links",
           "stages_per_rank", "REPO_OUT", "build_executor", "cached_split"]

_BLOCK = re.compile(r"^blocks\.(\d+)$")
_COMPUTE = re.compile(r"^(F|B|W)(\d+) s(\d+)$")
_SEND = re.compile(r"^SEND_(?:F|B)\d+ s(\d+)->\d+$")


# --------------------------------------------------------------------------------------- model
class Block(nn.Module):
    """Linear(width, width) + GELU: float32 ``[B, width] -> [B, width]``; ``2 B width^2`` FLOPs
    forward."""

    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc(x))


class MLPStack(nn.Module):
    """``n_blocks`` identical :class:`Block` s in a row: float32 ``[B, width] -> [B, width]``."""

    def __init__(self, n_blocks: int, width: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(n_blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


@dataclass(frozen=True)
class StackConfig:
    """Model size: ``width`` features, ``mbs`` samples per micro-batch, ``blocks_per_rank``
    blocks on every pipeline rank (split over its ``v`` stages), parameters seeded by ``seed``."""

    width: int = 1024
    mbs: int = 32
    blocks_per_rank: int = 4
    seed: int = 0

    @staticmethod
    def arg_parser(doc: str, blocks_help: str) -> argparse.ArgumentParser:
        """A benchmark's argument parser with the model-size options (``--width``, ``--mbs``,
        ``--blocks``) and ``--no-write``; the benchmark adds its own options."""
        d = StackConfig()
        ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
        ap.add_argument("--width", type=int, default=d.width)
        ap.add_argument("--mbs", type=int, default=d.mbs, help="samples per micro-batch")
        ap.add_argument("--blocks", type=int, default=d.blocks_per_rank, help=blocks_help)
        ap.add_argument("--no-write", action="store_true", help="do not touch BENCHMARKS.md")
        return ap

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "StackConfig":
        """The configuration parsed by :meth:`arg_parser`."""
        return cls(args.width, args.mbs, args.blocks)


@dataclass(frozen=True)
class RunSpec:
    """One benchmark run: schedule name, pipeline ranks ``p``, micro-batches ``m``, stages per
    rank ``v`` (2 for ``interleaved`` and ``zb-v``, else 1)."""

    schedule: str
    p: int
    m: int
    v: int = 1

    @property
    def num_stages(self) -> int:
        return self.p * self.v

    def label(self) -> str:
        v = f" v={self.v}" if self.schedule == "interleaved" else ""
        return f"{self.schedule}{v} p={self.p} m={self.m}"


def stages_per_rank(schedule: str, v: int = AUTO_VIRTUAL_STAGES) -> int:
    """Stages per rank (:func:`fxpipe.specs.schema.stages_per_rank`), ``interleaved`` with ``v``."""
    return schema_stages_per_rank(schedule, v)


def equal_split(cfg: StackConfig, num_stages: int, v: int = 1):
    """Build the model (``blocks_per_rank * num_stages / v`` blocks, seeded), export it with one
    micro-batch and split it into ``num_stages`` stages of equally many blocks.

    Returns:
        ``(boundaries, stage_modules, model)`` from :func:`fxpipe.partitioner.split.split_graph`.

    Raises:
        ValueError: ``blocks_per_rank`` is not divisible by ``v``.
    """
    if cfg.blocks_per_rank % v:
        raise ValueError(f"blocks_per_rank={cfg.blocks_per_rank} must be divisible by v={v} so "
                         "every stage gets equally many blocks; pick an even blocks_per_rank")
    bps = cfg.blocks_per_rank // v
    torch.manual_seed(cfg.seed)
    model = MLPStack(bps * num_stages, cfg.width)
    gm = torch.export.export(model, (torch.zeros(cfg.mbs, cfg.width),), strict=False).module()
    node_stage, stage = {}, 0
    by_name = {n.name: n for n in gm.graph.nodes}
    for name in compute_nodes(gm):
        paths = [p for p, _ in (by_name[name].meta.get("nn_module_stack") or {}).values()]
        ks = [int(mt.group(1)) for p in paths if (mt := _BLOCK.match(p))]
        if ks:
            stage = ks[0] // bps
        node_stage[name] = stage
    b, mods = split_graph(gm, node_stage, num_stages)
    return b, mods, model


def make_plan(b, spec: RunSpec, mbs: int) -> Plan:
    """A Plan from ``split_graph``'s boundaries (costs zero: the executor does not read them)."""
    stages = [StagePlan(index=sb.index, nodes=sb.nodes, params=sb.params, buffers=sb.buffers,
                        inputs=sb.inputs, outputs=sb.outputs, fwd_flops=0.0, bwd_flops=0.0,
                        bwd_weight_flops=0.0, param_bytes=0, activation_bytes=0, recv_bytes=0,
                        send_bytes=0, compute_time_s=0.0, comm_time_s=0.0, time_s=0.0,
                        memory_bytes=0) for sb in b.stages]
    return Plan(model="MLPStack", num_stages=spec.num_stages, pipeline=spec.p, dp=1,
                microbatches=spec.m, schedule=spec.schedule, virtual_stages=spec.v,
                microbatch_size=mbs, stages=stages, values=b.values, model_inputs=b.model_inputs,
                model_output=b.model_outputs[0], shared_params=b.shared_params,
                param_aliases=b.param_aliases)


def batch(cfg: StackConfig, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed random batch ``(x, y)`` of ``m * mbs`` samples (same on every rank)."""
    g = torch.Generator().manual_seed(1234 + cfg.seed)
    n = m * cfg.mbs
    return torch.randn(n, cfg.width, generator=g), torch.randn(n, cfg.width, generator=g)


def theory_bubble(p: int, m: int) -> float:
    """GPipe / 1F1B bubble with uniform stage costs: ``(p-1)/(m+p-1)`` (Huang et al., 2019)."""
    return (p - 1) / (m + p - 1)


def expected_peak(schedule: str, p: int, m: int, stage: int) -> int:
    """Peak micro-batches in flight on ``stage``: GPipe ``m``; 1F1B ``min(p - stage, m)``."""
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(p - stage, m)
    raise ValueError(f"no closed form for schedule {schedule!r}; use gpipe or 1f1b")


def load_average() -> str:
    """The 1/5/15-minute load averages as ``"a, b, c"`` (``"n/a"`` where unsupported)."""
    try:
        return ", ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:  # pragma: no cover - not on every platform
        return "n/a"


def machine_note(load_before: str | None = None) -> str:
    """CPU count, torch version and load average (before / now), for the reports: the figures
    depend on them."""
    load = (f"load average (1/5/15 min) {load_before} before, {load_average()} after"
            if load_before else f"load average (1/5/15 min) {load_average()}")
    return (f"{os.cpu_count()} CPU cores, {load}; torch {torch.__version__}, gloo, one thread "
            "per rank")


# --------------------------------------------------------------------------------------- worker
@dataclass
class RankRun:
    """What one rank measured for one :class:`RunSpec` (after warm-up).

    Attributes:
        spec: the run. rank: pipeline rank. stages: stages this rank holds.
        events: the executor's ``(rank, label, start_s, end_s, lane)`` tuples, measured steps only.
        step_starts_s / step_times_s: start (same clock as events) and wall seconds of each step.
        peak_inflight: stage -> peak micro-batches with activations held (measured steps).
        losses: loss of each measured step.
        latency_s: one-way point-to-point seconds between pipeline ranks 0 and 1 measured by
            :func:`pingpong_latency` just before the run (``None`` when not measured).
    """

    spec: RunSpec
    rank: int
    stages: list[int]
    events: list[tuple]
    step_starts_s: list[float]
    step_times_s: list[float]
    peak_inflight: dict[int, int]
    losses: list[float] = field(default_factory=list)
    latency_s: float | None = None


def cached_split(cfg: StackConfig, spec: RunSpec, split_cache: dict):
    """:func:`equal_split` for ``spec``'s stage count, memoised in ``split_cache``."""
    key = (spec.num_stages, spec.v)
    if key not in split_cache:
        split_cache[key] = equal_split(cfg, spec.num_stages, spec.v)
    return split_cache[key]


def build_executor(cfg: StackConfig, spec: RunSpec, mesh, split_cache: dict, lr: float = 1e-4,
                   timeout_s: float = 120.0, modules: dict | None = None):
    """(plan, schedule, executor) for this rank, SGD with learning rate ``lr``.

    ``split_cache`` keeps one split per stage count; ``modules`` (stage -> module) replaces the
    cached stage modules (e.g. fresh copies). Every rank must call this in the same order (the
    executor's constructor creates process groups when parameters are shared)."""
    from fxpipe.runtime.executor import PipelineExecutor

    b, mods, _ = cached_split(cfg, spec, split_cache)
    mods = modules if modules is not None else mods
    plan = make_plan(b, spec, cfg.mbs)
    schedule = schedule_for_plan(plan)
    local = {s: mods[s] for s in schedule.stages_of_rank(mesh.pipe_rank)}
    params = list({id(p): p for mod in local.values() for p in mod.parameters()}.values())
    ex = PipelineExecutor(plan, schedule, local, mesh, F.mse_loss,
                          torch.optim.SGD(params, lr=lr), timeout_s)
    return plan, schedule, ex


def pingpong_latency(rank: int, nbytes: int, rounds: int = 20) -> float | None:
    """One-way seconds of a ``nbytes`` gloo message between ranks 0 and 1 of the default group:
    the median of ``rounds`` round trips (isend / irecv, as the executor does), halved. Collective
    over the default group (every rank calls it; ranks other than 0 and 1 only join the
    barriers). Returns the latency on ranks 0 and 1, ``None`` elsewhere (or on one rank)."""
    import torch.distributed as dist

    if dist.get_world_size() < 2:
        return None
    dist.barrier()
    out = None
    if rank in (0, 1):
        peer = 1 - rank
        buf = torch.zeros(max(1, nbytes // 4))
        times = []
        for i in range(rounds + 2):
            t0 = time.perf_counter()
            if rank == 0:
                dist.isend(buf, peer, tag=900_000 + i).wait()
                dist.irecv(buf, peer, tag=900_000 + i).wait()
            else:
                dist.irecv(buf, peer, tag=900_000 + i).wait()
                dist.isend(buf, peer, tag=900_000 + i).wait()
            times.append(time.perf_counter() - t0)
        out = statistics.median(times[2:]) / 2
    dist.barrier()
    return out


def executor_worker(rank: int, cfg: StackConfig, specs: list[RunSpec], warmup: int,
                    steps: int, pingpong: bool = False) -> list[RankRun]:
    """Run every spec (same ``p`` for all) on this rank; see the module docstring. With
    ``pingpong``, measure :func:`pingpong_latency` (one activation's bytes) before each run."""
    from fxpipe.runtime.mesh import Mesh

    p = specs[0].p
    mesh = Mesh(p, 1)
    cache: dict = {}
    out = []
    for spec in specs:
        plan, schedule, ex = build_executor(cfg, spec, mesh, cache)
        x, y = batch(cfg, spec.m)
        inputs = {plan.model_inputs[0]: x}
        for _ in range(warmup):
            ex.step(inputs, y)
        lat = pingpong_latency(rank, cfg.mbs * cfg.width * 4) if pingpong else None
        ex.reset_stats()
        losses = [ex.step(inputs, y) for _ in range(steps)]
        out.append(RankRun(spec, mesh.pipe_rank, schedule.stages_of_rank(mesh.pipe_rank),
                           [tuple(e) for e in ex.events], list(ex.step_starts_s),
                           list(ex.step_times_s), dict(ex.peak_inflight), losses, lat))
    return out


def run_group(worker, world: int, *args, timeout_s: float = 240.0):
    """:func:`fxpipe.runtime.local_ranks.run_ranks`: spawn ``world`` gloo ranks with a hard
    deadline; returns the results by rank."""
    from fxpipe.runtime.local_ranks import run_ranks

    return run_ranks(worker, world, *args, timeout_s=timeout_s, dist_timeout_s=60.0)


# --------------------------------------------------------------------------------------- analysis
@dataclass
class Measured:
    """Measured figures of one run (all ranks).

    Attributes:
        idle: per pipeline rank, ``1 - busy / step`` summed over the measured steps, where busy is
            the rank's F/B/W seconds and step the global step window (earliest start to latest
            end over ranks) - the simulator's definition.
        bubble: mean of ``idle``.
        step_s: median global step window, seconds.
        op_mean_s: ``(op, stage) -> mean seconds`` of the F/B/W actions.
        op_mean_any_s: ``label kind -> mean seconds`` of the non-compute actions (``SEND_F``,
            ``RECV_F``, ``SEND_B``, ``RECV_B``, ``ALLREDUCE``, ``STEP``), over all ranks.
        send_mean_s: ``stage -> mean seconds`` of the stage's ``SEND_F`` and ``SEND_B`` actions
            (the time they occupy the sending rank's thread; stages that send nothing absent).
        step_action_s: the smallest per-rank mean ``STEP`` seconds (optimizer step plus the wait
            for outstanding sends; the smallest is closest to the optimizer work alone).
        outside_s: the smallest per-rank mean of the step time outside the action list (before
            the first action: splitting the batch; after the last: the all-reduce of the loss).
        latency_s: the ping-pong one-way latency measured before the run (``None`` if not).
        peak_inflight: stage -> peak micro-batches in flight (the executor's accounting).
        windows: ``(start_s, end_s)`` of each measured step.
    """

    idle: list[float]
    bubble: float
    step_s: float
    op_mean_s: dict[tuple[str, int], float]
    op_mean_any_s: dict[str, float]
    peak_inflight: dict[int, int]
    windows: list[tuple[float, float]]
    step_action_s: float = 0.0
    outside_s: float = 0.0
    latency_s: float | None = None
    send_mean_s: dict[int, float] = field(default_factory=dict)


def _kind(label: str) -> str:
    head = label.split(" ")[0]
    return head.rstrip("0123456789")


def slice_step(run: RankRun, k: int) -> RankRun:
    """``run`` restricted to its measured step ``k`` (events inside that rank's step window)."""
    s0 = run.step_starts_s[k]
    s1 = s0 + run.step_times_s[k]
    evs = [ev for ev in run.events if ev[2] >= s0 - 1e-9 and ev[3] <= s1 + 1e-9]
    return RankRun(run.spec, run.rank, run.stages, evs, [s0], [run.step_times_s[k]],
                   run.peak_inflight, run.losses[k:k + 1], run.latency_s)


def analyze(runs: list[RankRun], only_step: int | None = None) -> Measured:
    """Measured figures from the :class:`RankRun` of every rank of one run (all measured steps,
    or only step ``only_step``).

    Raises:
        ValueError: the ranks measured different numbers of steps.
    """
    runs = sorted(runs, key=lambda r: r.rank)
    if only_step is not None:
        runs = [slice_step(r, only_step) for r in runs]
    n = {len(r.step_starts_s) for r in runs}
    if len(n) != 1 or 0 in n:
        raise ValueError(f"ranks measured different (or zero) step counts {sorted(n)}")
    steps = n.pop()
    windows = []
    for k in range(steps):
        start = min(r.step_starts_s[k] for r in runs)
        end = max(r.step_starts_s[k] + r.step_times_s[k] for r in runs)
        windows.append((start, end))
    total = sum(e - s for s, e in windows)
    idle, sums, counts, step_means, outside = [], {}, {}, [], []
    send_sums: dict[int, float] = {}
    send_counts: dict[int, int] = {}
    for r in runs:
        busy = 0.0
        st = [ev[3] - ev[2] for ev in r.events if ev[1] == "STEP"]
        if st:
            step_means.append(sum(st) / len(st))
        extra = []
        for k in range(steps):
            s0, s1 = r.step_starts_s[k], r.step_starts_s[k] + r.step_times_s[k]
            inside = [ev for ev in r.events if ev[2] >= s0 - 1e-9 and ev[3] <= s1 + 1e-9]
            if inside:
                extra.append((min(ev[2] for ev in inside) - s0) + (s1 - max(ev[3] for ev in inside)))
        if extra:
            outside.append(sum(extra) / len(extra))
        for ev in r.events:
            label, d = ev[1], ev[3] - ev[2]
            mt = _COMPUTE.match(label)
            key = (mt.group(1), int(mt.group(3))) if mt else (_kind(label), -1)
            sums[key] = sums.get(key, 0.0) + d
            counts[key] = counts.get(key, 0) + 1
            if (ms := _SEND.match(label)) is not None:
                sender = int(ms.group(1))
                send_sums[sender] = send_sums.get(sender, 0.0) + d
                send_counts[sender] = send_counts.get(sender, 0) + 1
            if mt:
                busy += d
        idle.append(1.0 - busy / total)
    op_mean = {k: sums[k] / counts[k] for k in sums if k[1] >= 0}
    other = {k[0]: sums[k] / counts[k] for k in sums if k[1] < 0}
    peak: dict[int, int] = {}
    for r in runs:
        peak.update(r.peak_inflight)
    return Measured(idle, sum(idle) / len(idle), statistics.median(e - s for s, e in windows),
                    op_mean, other, dict(sorted(peak.items())), windows,
                    min(step_means) if step_means else 0.0, min(outside) if outside else 0.0,
                    next((r.latency_s for r in runs if r.latency_s is not None), None),
                    {s: send_sums[s] / send_counts[s] for s in sorted(send_sums)})


def calibrated_costs(schedule: Schedule, meas: Measured) -> StageCosts:
    """StageCosts from a measurement: per-stage F/B/W seconds = the measured means
    (:attr:`Measured.op_mean_s`; W = 0 unless the backward is split), per-stage ``send_s`` = the
    measured mean sender-side seconds of the stage's SEND_F / SEND_B actions
    (:attr:`Measured.send_mean_s`; on CPU gloo stages the bytes in the sender's thread, 0 for a
    stage that sends nothing), ``step_s`` = :attr:`Measured.step_action_s` +
    :attr:`Measured.outside_s` (the optimizer step and the step's work outside the action list,
    e.g. the loss all-reduce)."""
    n = schedule.num_stages
    split = schedule.split_backward
    f = [meas.op_mean_s.get(("F", s), 0.0) for s in range(n)]
    b = [meas.op_mean_s.get(("B", s), 0.0) for s in range(n)]
    w = [meas.op_mean_s.get(("W", s), 0.0) if split else 0.0 for s in range(n)]
    send = [meas.send_mean_s.get(s, 0.0) for s in range(n)]
    return StageCosts(f, b, w, step_s=meas.step_action_s + meas.outside_s, send_s=send)


def plan_links(plan: Plan, meas: Measured, latency_s: float | None = None):
    """``(edge_bytes, grad_edge_bytes, Links)`` for simulating ``plan``: the plan's edges and an
    infinite-bandwidth link of latency ``latency_s`` (default :attr:`Measured.latency_s`, the
    ping-pong of one activation, so it already includes the bytes; 0 when absent)."""
    lat = latency_s if latency_s is not None else (meas.latency_s or 0.0)
    fwd, grad = plan.edge_bytes()
    return fwd, grad, Links(p2p_GBps=1e9, latency_s=lat)


def calibrated_simulation(plan: Plan, schedule: Schedule, meas: Measured,
                          latency_s: float | None = None) -> SimResult:
    """Simulate ``schedule`` (the executor's own action lists) with :func:`calibrated_costs`
    and :func:`plan_links`.

    Raises:
        ScheduleError: the schedule is invalid (from the simulator's validator).
    """
    fwd, grad, links = plan_links(plan, meas, latency_s)
    return simulate(schedule, calibrated_costs(schedule, meas), fwd, links, grad_edge_bytes=grad)


def step_events(runs: list[RankRun], meas: Measured, k: int) -> list[tuple]:
    """The events of measured step ``k`` on every rank (each rank's own step window), shifted
    so that the step's global window (:attr:`Measured.windows`) starts at 0 s."""
    s0 = meas.windows[k][0]
    out = []
    for r in runs:
        for ev in slice_step(r, k).events:
            out.append((ev[0], ev[1], ev[2] - s0, ev[3] - s0,
                        ev[4] if len(ev) > 4 else "compute"))
    return out
