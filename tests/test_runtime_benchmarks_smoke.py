"""Smoke tests for the runtime benchmarks (benchmarks/bench_pipeline_bubble.py,
bench_vs_torch_pipelining.py, bench_predicted_vs_measured.py) on tiny configurations, plus
unit tests of their shared measurement code (benchmarks/_runtime_bench.py).

The multi-process tests spawn 2 gloo ranks (a few seconds each) and check what the figures must
satisfy whatever the machine's load: exact peak in-flight counts, executor = simulator in-flight
peaks, fxpipe and torch.distributed.pipelining computing the same losses, fractions in range, and
the report sections / trace files written.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import _report  # noqa: E402
from benchmarks import _runtime_bench as rb  # noqa: E402
from fxpipe.schedule.lowering import schedule_for_plan  # noqa: E402
from fxpipe.specs.schema import V_SCHEDULES  # noqa: E402

try:
    from tolerances import bound  # noqa: E402
except ImportError:  # tests/ collected as a package
    from tests.tolerances import bound  # noqa: E402

TINY = ["--width", "32", "--mbs", "4", "--blocks", "2", "--warmup", "1"]
TINY_CFG = rb.StackConfig(width=32, mbs=4, blocks_per_rank=2)


# --------------------------------------------------------------------------------------------
# shared code, in-process


def test_equal_split_gives_equal_stages():
    for n, v in ((2, 1), (4, 2)):
        b, mods, model = rb.equal_split(TINY_CFG, n, v)
        assert len(mods) == n and len(model.blocks) == n * TINY_CFG.blocks_per_rank // v
        counts = [sum(p.numel() for p in m.parameters()) for m in mods]
        assert len(set(counts)) == 1 and counts[0] > 0, counts
        # a linear chain: every stage after the first reads exactly one value of the previous
        for sb in b.stages[1:]:
            assert [b.values[x].producer for x in sb.inputs] == [sb.index - 1]
    with pytest.raises(ValueError, match="divisible"):
        rb.equal_split(rb.StackConfig(32, 4, 3), 4, 2)


def _run(rank, events, start, step, peak):
    return rb.RankRun(rb.RunSpec("gpipe", 2, 2), rank, [rank], events, [start], [step], peak)


def test_analyze_uses_the_simulator_definition():
    # step window 0..10 s (rank 1 ends last); rank 0 busy 2 + 4 = 6 s, rank 1 busy 3 + 2 = 5 s
    r0 = _run(0, [(0, "F0 s0", 0.5, 2.5, "compute"), (0, "SEND_F0 s0->1", 2.5, 3.0, "compute"),
                  (0, "B0 s0", 5.0, 9.0, "compute"), (0, "STEP", 9.0, 9.5, "compute")],
              0.0, 9.5, {0: 1})
    r1 = _run(1, [(1, "F0 s1", 3.0, 6.0, "compute"), (1, "B0 s1", 6.0, 8.0, "compute"),
                  (1, "STEP", 8.0, 9.0, "compute")], 0.0, 10.0, {1: 1})
    m = rb.analyze([r1, r0])
    assert m.windows == [(0.0, 10.0)] and m.step_s == 10.0
    assert m.idle == pytest.approx([0.4, 0.5])
    assert m.bubble == pytest.approx(0.45)
    assert m.op_mean_s[("F", 0)] == pytest.approx(2.0) and m.op_mean_s[("B", 1)] == 2.0
    assert m.op_mean_any_s["SEND_F"] == pytest.approx(0.5)
    assert m.send_mean_s == {0: pytest.approx(0.5)}  # per sending stage
    assert m.step_action_s == pytest.approx(0.5)          # smallest per-rank STEP mean
    assert m.outside_s == pytest.approx(min(0.5 + 0.0, 3.0 + 1.0))  # head + tail per rank
    assert m.peak_inflight == {0: 1, 1: 1}
    # per-step slicing keeps only that step's events
    assert len(rb.slice_step(r0, 0).events) == 4
    with pytest.raises(ValueError, match="step counts"):
        rb.analyze([r0, rb.RankRun(r1.spec, 1, [1], [], [], [], {})])


def test_calibrated_simulation_reproduces_closed_form_with_uniform_costs():
    p, m = 2, 4
    spec = rb.RunSpec("gpipe", p, m)
    b, _, _ = rb.equal_split(TINY_CFG, p)
    plan = rb.make_plan(b, spec, TINY_CFG.mbs)
    sched = schedule_for_plan(plan)
    meas = rb.Measured(idle=[0, 0], bubble=0, step_s=1,
                       op_mean_s={(op, s): c for s in range(p) for op, c in (("F", 1.0), ("B", 2.0))},
                       op_mean_any_s={}, peak_inflight={}, windows=[(0, 1)])
    sim = rb.calibrated_simulation(plan, sched, meas, latency_s=0.0)
    assert sim.bubble_fraction == pytest.approx(rb.theory_bubble(p, m))
    assert sim.step_time_s == pytest.approx((m + p - 1) * 3.0)
    assert sim.peak_inflight == [m, m]
    assert [rb.expected_peak("1f1b", 4, 8, s) for s in range(4)] == [4, 3, 2, 1]
    assert [rb.expected_peak("1f1b", 4, 2, s) for s in range(4)] == [2, 2, 2, 1]
    # measured sender-side send seconds become StageCosts.send_s per stage: GPipe p=2 with
    # F=1, B=2, stage 0's SEND_F costs c0, stage 1's SEND_B c1, zero latency: the forwards are
    # paced at 1 + c0 (rank 1 ends them at m(1 + c0) + 1), the gradients at 2 + c1, rank 0's
    # last B (2 s) closes the step: m(1 + c0) + m(2 + c1) + 3
    c0, c1 = 0.5, 0.25
    meas.send_mean_s = {0: c0, 1: c1}
    assert rb.calibrated_costs(sched, meas).send_s == [c0, c1]
    sim = rb.calibrated_simulation(plan, sched, meas, latency_s=0.0)
    assert sim.step_time_s == pytest.approx(m * (1 + c0) + m * (2 + c1) + 3)
    assert sim.busy_s == pytest.approx([3.0 * m] * p)


# --------------------------------------------------------------------------------------------
# the benchmarks, tiny, 2 gloo ranks each


@pytest.mark.distributed
def test_bubble_benchmark_tiny(tmp_path):
    from benchmarks import bench_pipeline_bubble as bb

    md = tmp_path / "B.md"
    rows = bb.main(TINY + ["--ps", "2", "--ms", "4", "--steps", "2"], out=md)
    assert [(r.spec.schedule, r.spec.p, r.spec.m) for r in rows] == [("gpipe", 2, 4), ("1f1b", 2, 4)]
    for r in rows:
        assert r.measured_peak == r.expected_peak  # executor accounting = closed form, exactly
        assert len(r.meas.idle) == 2 and all(0.0 <= x < 1.0 for x in r.meas.idle)
        assert r.theory == pytest.approx(1 / 5)
        assert r.f_s > 0 and r.b_s > 0 and r.meas.step_s > 0
        assert r.ideal_step_s == pytest.approx(5 * (r.f_s + r.b_s))
    assert [r.measured_peak for r in rows] == [[4, 4], [2, 1]]
    body = _report.read_section(bb.SECTION, md)
    assert body is not None and "| gpipe | 2 | 4 |" in body and "| 1f1b | 2 | 4 |" in body


@pytest.mark.distributed
def test_vs_torch_benchmark_tiny(tmp_path):
    from benchmarks import bench_vs_torch_pipelining as bt

    md = tmp_path / "B.md"
    rows = bt.main(TINY + ["--ps", "2", "--m", "4", "--rounds", "2", "--k", "1"], out=md)
    assert [(r.schedule, r.p) for r in rows] == [("gpipe", 2), ("1f1b", 2)]
    for r in rows:
        assert r.fx_s > 0 and r.torch_s > 0 and math.isfinite(r.ratio)
        assert len(r.pair_ratios) == 2
        # identical copies trained on identical data: both runtimes report the same losses
        assert r.steps == 4, r.steps  # 1 warm-up + 2 rounds x 1 step + 1 profiled step
        # the same micro-batches, summed in each runtime's order: float32 rounding over the
        # m x mbs = 16 samples of a step, growing with the steps (tests/tolerances.py)
        assert r.loss_diff <= bound(r.loss_scale, 4 * 4, r.steps), (r.loss_diff, r.loss_scale)
        assert r.own_python_s("fx") > 0 and r.own_python_s("torch") > 0  # profiled
    body = _report.read_section(bt.SECTION, md)
    assert body is not None and "fxpipe / torch" in body and "| 1f1b | 2 | 4 |" in body


@pytest.mark.distributed
def test_predicted_vs_measured_benchmark_tiny(tmp_path):
    from benchmarks import bench_predicted_vs_measured as bp

    rows = bp.measure(TINY_CFG, p=2, m=4, warmup=1, steps=2, out_dir=tmp_path / "traces")
    assert [r.spec.schedule for r in rows] == list(bp.SCHEDULES)
    for r in rows:
        n = r.spec.num_stages
        # two (virtual) stages per rank for interleaved and every V schedule, one otherwise
        assert n == (4 if r.spec.schedule == "interleaved" or r.spec.schedule in V_SCHEDULES else 2)
        # in-flight peaks depend only on the action order: executor and simulator agree exactly
        assert r.peak_measured == r.peak_simulated and len(r.peak_measured) == n
        assert len(r.measured) == len(r.predicted) == 2
        for a, b in zip(r.measured, r.predicted):
            assert 0.0 <= a < 1.0 and 0.0 <= b < 1.0
        assert r.send_s > 0  # gloo sends take measurable sender-side time
        assert r.latency_s > 0
        names = sorted(p.name for p in r.traces)
        assert names == sorted(f"{r.spec.schedule}-{s}.json" for s in ("both", "measured", "simulated"))
        both = json.loads((tmp_path / "traces" / f"{r.spec.schedule}-both.json").read_text())
        pids = {e["pid"] for e in both["traceEvents"] if e.get("ph") == "X"}
        assert pids == {0, 1, bp.SIM_PID_OFFSET, bp.SIM_PID_OFFSET + 1}
        names = {e["name"] for e in both["traceEvents"] if e.get("ph") == "X"}
        assert "STEP" in names and any(x.startswith("F0 ") for x in names)
    assert "zb-v" in bp.table(rows) and "predicted" in bp.table(rows)


def test_split_backward_cost_tiny():
    from benchmarks import bench_predicted_vs_measured as bp

    cost = bp.split_backward_cost(TINY_CFG, reps=3)
    assert {"full", "naive_b", "naive_w"} <= set(cost) and all(v > 0 for v in cost.values())
    line = bp.split_line(cost)
    assert f"{(cost['naive_b'] + cost['naive_w']) / cost['full']:.2f}x" in line
    assert bp.split_line(None) == ""
