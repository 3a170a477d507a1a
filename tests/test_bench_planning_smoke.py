"""Smoke tests for the issue-9 benchmarks: ``bench_pick`` (the planner's cut vs every measured
block-boundary cut) and ``bench_plan_scale`` (planner time vs world size and depth), each
``main()`` on its tiny configuration with assertions on what it returns and writes."""

from __future__ import annotations

import functools
import math
import statistics
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import _report  # noqa: E402
from benchmarks import bench_pick as bp  # noqa: E402
from benchmarks import bench_plan_scale as bs  # noqa: E402


# --------------------------------------------------------------------------------------------
# bench_pick: pure helpers


def test_unit_layers_and_block_boundaries():
    model = bp.build_model(bp.TINY["lm-vocab8k"])
    units = [("arange", ""), ("embedding", "wte"), ("embedding_1", "wpe"), ("add", ""),
             ("layer_norm", "h.0.ln_1"), ("linear", "h.0.attn.qkv"), ("add_1", "h.0"),
             ("layer_norm_1", "h.1.ln_1"), ("add_2", ""), ("layer_norm_2", "ln_f"),
             ("linear_1", "head")]
    layers = bp.unit_layers(model, units)
    assert layers == ["wte", "wte", "wpe", "wpe", "h.0", "h.0", "h.0", "h.1", "h.1", "ln_f",
                      "head"]  # root units join the layer before (the first one at the start)
    assert bp.block_boundaries(layers) == [2, 4, 7, 9, 10]
    assert bp.cut_label([0, 4, 8], layers) == "h.0 | h.1@8"


def test_sample_cuts_are_distinct_boundary_cuts_starting_with_equal_layers():
    import random

    bounds = [2, 4, 7, 9, 10, 12]
    cuts = bp._sample_cuts(bounds, 4, 5, random.Random(0), [])
    assert len(cuts) == 5 and len({tuple(c) for c in cuts}) == 5
    layer_starts = [0] + bounds
    assert cuts[0] == [layer_starts[round(j * 7 / 4)] for j in range(4)]  # equal layers
    for c in cuts:
        assert c[0] == 0 and c == sorted(c) and set(c[1:]) <= set(bounds)
    assert bp._sample_cuts([3], 4, 5, random.Random(0), []) == []  # too few boundaries


def test_spec_modes_differ_only_in_costs():
    pm = bp.TINY["norm-probe"]
    flop, ana, meas = (bp.spec_dict(pm, m, 2) for m in bp.MODES)
    assert flop["cluster"]["memory_GBps"] == 1e9 and flop["cluster"]["op_overhead_us"] == 0
    assert "memory_GBps" not in ana["cluster"] and "costs" not in ana["cluster"]
    assert meas["cluster"]["costs"] == "measured"
    for d in (flop, ana, meas):
        assert d["parallel"] == {"pipeline": 2, "data": 1, "microbatches": pm.m,
                                 "schedule": "1f1b"}
    with pytest.raises(ValueError, match="cost mode"):
        bp.spec_dict(pm, "magic", 2)


def test_stage_starts_round_trip_given_cuts(tmp_path):
    """plan_with_graph(cuts=c) gives back c from stage_starts, folded (norm probe: a run of
    identical blocks) or not (LM)."""
    from fxpipe.partitioner.driver import plan_with_graph
    from fxpipe.specs.loader import load_spec

    with bp.cache_at(tmp_path):
        for name, cuts in (("lm-vocab8k", [[0, 4], [0, 30], [0, 12, 25, 40]]),
                           ("norm-probe", [[0, 3], [0, 6], [0, 2, 5, 9]])):
            pm = bp.TINY[name]
            model = bp.build_model(pm)
            x, _ = bp.global_batch(pm)
            ex = (x[:pm.mbs],)
            # the units, planned once per model on 2 stages as bench_model does for every
            # stage count
            pr, _ = plan_with_graph(model, load_spec(bp.spec_dict(pm, "analytic", 2)), ex,
                                    units_only=True)
            for c in cuts:
                spec = load_spec(bp.spec_dict(pm, "analytic", len(c)))
                plan, _ = plan_with_graph(model, spec, ex, cuts=c)
                assert bp.stage_starts(plan, pr) == c, (name, c)
            if name == "norm-probe":
                assert plan.folded  # the probe's norms are planned as blocks


def test_cross_gap_chooses_the_fastest_on_other_rounds():
    """Two equally fast cuts whose noise flatters each on alternate rounds: choosing and timing
    the fastest on the same rounds makes the pick look slower; the cross-fitted gap does not."""
    def sample(rounds):
        return bp.Sample(list(rounds), statistics.median(rounds), 0.0, list(rounds), [])

    pick = bp.CutRun([0, 1], "p", True, ["measured"], screen=sample([1.0]),
                     final=sample([1.0, 1.1, 1.0, 1.1, 1.0, 1.1]))
    other = bp.CutRun([0, 2], "o", True, [], screen=sample([1.0]),
                      final=sample([1.1, 0.9, 1.1, 0.9, 1.1, 0.9]))
    sc = bp.StageCount(2, [pick, other], 2, False, {"measured": [0, 1]})
    assert sc.gap("measured") > 0.0  # median 1.05 vs 1.0: the winner's curse
    # even rounds choose the pick (1.0 < 1.1), odd rounds time it against itself: 0; odd
    # rounds choose `other` (0.9), even rounds time the pick 1.0 vs other's 1.1: -9%
    assert math.isclose(sc.cross_gap("measured"), (0.0 + (1.0 / 1.1 - 1)) / 2)


def test_gaps_use_the_head_to_head_run_and_spearman():
    def sample(med, rounds):
        return bp.Sample([med] * 4, med, 0.0, rounds, [])

    a = bp.CutRun([0, 1], "a", True, ["measured"], screen=sample(0.9, [0.9]),
                  final=sample(1.1, [1.1, 2.2, 1.1]))
    b = bp.CutRun([0, 2], "b", True, [], screen=sample(1.0, [1.0]),
                  final=sample(1.0, [1.0, 2.0, 1.0]))
    c = bp.CutRun([0, 3], "c", True, [], screen=sample(1.2, [1.2]))  # not a finalist
    sc = bp.StageCount(2, [a, b, c], 3, False, {"measured": [0, 1]})
    assert sc.screen_fastest() is a and sc.fastest() is b and sc.finalists() == [a, b]
    assert math.isclose(sc.gap("measured"), 0.1)
    assert math.isclose(sc.paired_gap("measured"), 0.1)
    assert math.isclose(sc.cross_gap("measured"), 0.1)  # fewer than 4 rounds: the plain gap
    lo, hi = sc.gap_interval("measured")  # constant steps: no spread
    assert math.isclose(lo, 0.1) and math.isclose(hi, 0.1)
    assert math.isclose(bp._spearman([1, 2, 3, 4], [10, 20, 30, 40]), 1.0)
    assert math.isclose(bp._spearman([1, 2, 3, 4], [4, 3, 2, 1]), -1.0)


# --------------------------------------------------------------------------------------------
# bench_pick: the whole benchmark, tiny


@pytest.mark.distributed
def test_bench_pick_tiny(tmp_path, monkeypatch):
    from fxpipe.training import profiling

    monkeypatch.setenv("FXPIPE_CACHE_DIR", str(tmp_path / "user-cache"))  # must stay unused
    # the send cost is still measured for real between 2 busy gloo ranks and cached with the
    # profile, at 2 sizes x 4 messages x 2 rounds instead of 7 x 16 x 7 (about 15 s of CPU on
    # 2 cores); tests/test_send_cost.py checks the measurement itself
    monkeypatch.setattr(profiling, "measure_send_cost", functools.partial(
        profiling.measure_send_cost, sizes=[1 << 12, 1 << 20], iters=4, rounds=2))
    out = tmp_path / "BENCHMARKS.md"
    # --warmup 0: the first round still runs one untimed step per cut (bench_pick's rule), the
    # second round none
    results = bp.main(["--tiny", "--models", "norm-probe", "--rounds", "2",
                       "--final-rounds", "2", "--final-rounds-4", "2", "--finalists", "2",
                       "--steps", "1", "--warmup", "0",
                       "--sample4", "2", "--max-wait", "0",
                       "--cache", str(tmp_path / "cache"), "--out", str(out)])
    assert [r.name for r in results] == ["norm-probe"]  # planned as blocks (folded)
    for r in results:
        assert sorted(r.counts) == [2, 4]
        two = r.counts[2]
        boundary = [c.cut for c in two.cuts if c.boundary]
        assert sorted(boundary) == [[0, b] for b in r.boundaries]  # every boundary cut ran
        for mode in bp.MODES:
            assert two.picks[mode] in [c.cut for c in two.cuts]
            assert math.isfinite(two.gap(mode)) and math.isfinite(two.paired_gap(mode))
            lo, hi = two.gap_interval(mode)
            assert lo <= hi
        for sc in r.counts.values():
            fin = sc.finalists()
            assert sc.fastest().final.step_s == min(c.final.step_s for c in fin if c.boundary)
            for mode in bp.MODES:  # every pick ran head to head
                assert sc.of(sc.picks[mode]).final is not None
            for c in sc.cuts:
                for smp in (c.screen, c.final):
                    if smp is None:
                        continue
                    assert len(smp.steps_s) == 2 and smp.step_s > 0 and len(smp.round_s) == 2
                    assert len(smp.stage_meas) == sc.stages
                    assert all(f > 0 and b > 0 for f, b, _ in smp.stage_meas)  # F and B ran
                assert len(c.stage_pred) == sc.stages and c.predicted_s > 0
            pick = sc.of(sc.picks["measured"])
            assert len(pick.stage_pred_analytic) == sc.stages
        assert r.profile_s > 0 and r.loss_s > 0 and r.loss_pred_s > 0  # the plan prices it
        # the measured plans' stages were timed whole (cluster.measure_stages)
        assert all(r.refine_notes[k].startswith("cluster.measure_stages") for k in (2, 4))
        assert [len(r.pick_stage_pred[k]) for k in (2, 4)] == [2, 4]
    assert not (tmp_path / "user-cache").exists()  # profiles went to --cache only
    assert any((tmp_path / "cache" / "measured" / "profiles").glob("*.json"))
    text = _report.read_section("pick", out)
    assert text is not None
    assert "| norm-probe |" in text and "### 4 stages" in text
    assert "the plan's last-stage times include it" in text
    assert "The measured-cost plan's refinement: cluster.measure_stages" in text
    assert ("PASS" in text or "FAIL" in text) and "measured pick" in text
    assert [n for n, _, _ in bp.verdicts(results)] == ["norm-probe"]


# --------------------------------------------------------------------------------------------
# bench_plan_scale


def test_bench_plan_scale_tiny(tmp_path):
    import fxpipe.partitioner.driver as driver

    originals = {n: getattr(driver, n) for names in bs.PHASES.values() for n in names
                 if hasattr(driver, n)}
    out = tmp_path / "BENCHMARKS.md"
    res = bs.main(["--tiny", "--repeats", "1", "--max-wait", "0", "--out", str(out)])
    assert all(getattr(driver, n) is f for n, f in originals.items())  # timers removed
    world, depth = res["world"], res["depth"]
    assert [r.cfg.devices for r in world] == [8, 64]
    assert [r.cfg.layers for r in depth] == [8, 16]
    assert world[1] is depth[1]  # the shared configuration is timed once
    for r in world + depth:
        assert len(r.runs) == 1
        t = r.runs[0]
        assert t.plan is not None and t.error is None
        assert t.plan.dp * t.plan.pipeline == r.cfg.devices
        assert t.plan.predicted.step_time_s > 0
        assert math.isclose(sum(t.phases_s.values()), t.total_s, rel_tol=1e-6)
        assert t.phases_s["trace"] > 0 and t.phases_s["search"] > 0
    assert res["warmup_s"] > 0 and all(v > 0 for v in res["build_s"].values())
    assert res["checks"] == []  # the targets are for the full-size model
    text = _report.read_section("plan-scale", out)
    assert text is not None and "### World size" in text and "### Depth" in text


def test_plan_scale_checks_and_failed_plan(tmp_path):
    """Targets are judged on the median, and a configuration where nothing fits is a FAIL
    with the planner's answer recorded."""
    big = bs.Config(96, 128, 1536)
    rows = [bs.Row(big, [bs.Timed(9.0, {}, object()), bs.Timed(12.0, {}, object()),
                         bs.Timed(9.5, {}, object())]),
            bs.Row(bs.Config(96, 12_500, 100_000), [bs.Timed(5.0, {}, None, "no plan")])]
    chk = bs.checks({"rows": rows})
    assert [(lim, v, ok) for _, lim, v, ok in chk] == [(10.0, 9.5, True), (60.0, 5.0, False)]
    shape = dict(bs.TINY, block_size=16)
    model = torch.nn.Module()
    with torch.device("meta"):
        from fxpipe.examples.gpt import CharGPT
        model = CharGPT(**shape, n_layer=2)
    spec = bs.spec_dict(bs.Config(2, 1, 8), shape)
    spec["cluster"]["memory_gb"] = 1e-6  # nothing fits
    from fxpipe.specs.loader import load_spec

    t = bs.timed_plan(model, load_spec(spec), torch.zeros(1, 16, dtype=torch.long,
                                                          device="meta"))
    assert t.plan is None and t.error.startswith("no feasible plan")
