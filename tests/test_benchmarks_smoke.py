"""Smoke tests for the partitioner benchmarks: each benchmark's main() on a tiny configuration,
with assertions on the numbers it returns, plus the BENCHMARKS.md section writer."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import _report  # noqa: E402
from benchmarks import bench_balance as bb  # noqa: E402
from benchmarks.models import TINY, build, layer_paths  # noqa: E402

# --------------------------------------------------------------------------------------------
# _report


def test_write_section_creates_replaces_and_keeps_other_sections(tmp_path):
    md = tmp_path / "sub" / "BENCH.md"
    _report.write_section("balance", "first body", md)
    text = md.read_text()
    assert text.startswith("# ")
    assert "<!-- balance -->\nfirst body\n<!-- /balance -->" in text

    _report.write_section("plan-speed", "speed body", md)
    _report.write_section("balance", "| a |\n| b |", md)
    text = md.read_text()
    assert text.count("<!-- balance -->") == 1 and "first body" not in text
    assert _report.read_section("balance", md) == "| a |\n| b |"
    assert _report.read_section("plan-speed", md) == "speed body"
    assert text.index("<!-- balance -->") < text.index("<!-- plan-speed -->")  # order kept
    assert _report.read_section("missing", md) is None
    assert _report.read_section("balance", tmp_path / "nope.md") is None
    assert list(md.parent.glob(".benchmarks-*")) == []  # no temporary file left behind


def test_write_section_leaves_hand_written_text_alone(tmp_path):
    md = tmp_path / "B.md"
    md.write_text("# Mine\n\nintro\n\n<!-- balance -->\nold\n<!-- /balance -->\n\ntail notes\n")
    _report.write_section("balance", "new", md)
    assert md.read_text() == "# Mine\n\nintro\n\n<!-- balance -->\nnew\n<!-- /balance -->\n\ntail notes\n"


@pytest.mark.parametrize("name", ["", "two words", "x-->"])
def test_write_section_rejects_bad_names(tmp_path, name):
    with pytest.raises(ValueError, match="section name"):
        _report.write_section(name, "body", tmp_path / "B.md")


def test_write_section_rejects_body_with_its_markers(tmp_path):
    with pytest.raises(ValueError, match="its own markers"):
        _report.write_section("balance", "x\n<!-- /balance -->\n", tmp_path / "B.md")


# --------------------------------------------------------------------------------------------
# models and layers


def test_layer_starts_follow_the_models_layers():
    model, x = build(TINY["lm-vocab32k"])
    traced = bb.trace(model, x)
    pg = bb.build_graph(traced, bb.price(traced))
    layers = layer_paths(model)
    assert layers == ["wte", "wpe", "h.0", "h.1", "h.2", "ln_f", "head"]
    starts, names = bb.layer_starts(pg, layers)
    assert names == layers
    assert starts[0] == 0 and all(a < b for a, b in zip(starts, starts[1:]))
    # the head layer holds the vocabulary matmul: the largest-FLOP unit of the model
    g = pg.graph
    flops = [g.nodes[u]["fwd_flops"] for u in pg.order]
    assert max(range(len(flops)), key=flops.__getitem__) >= starts[-1]


def test_benchmark_models_have_the_advertised_imbalance():
    """Head-heavy LM: head dominates FLOPs; VGG: convs hold the FLOPs, FC layers the parameters;
    U-Net: the first encoder level's output is read by the last decoder level (a long skip)."""
    facts = {}
    for name, bm in TINY.items():
        model, x = build(bm)
        traced = bb.trace(model, x)
        pg = bb.build_graph(traced, bb.price(traced))
        facts[name] = (bb._model_facts(pg, layer_paths(model)), pg)
    assert facts["lm-vocab32k"][0]["top_flops"][0] == "head"
    assert facts["vgg16"][0]["top_params"][0].startswith("classifier.")
    assert facts["vgg16"][0]["top_flops"][0].startswith("features.")
    pg = facts["unet"][1]
    span = max(max(r.user_positions) - r.producer_pos for r in pg.values)
    assert span > len(pg.order) // 2


# --------------------------------------------------------------------------------------------
# bench_balance


def test_bench_balance_tiny(tmp_path):
    out = tmp_path / "BENCHMARKS.md"
    rows = bb.main(["--tiny", "--out", str(out)])
    assert len(rows) == len(TINY) * 2 * 2  # models x link speeds x stage counts (2, 4)
    for r in rows:
        rel = 1 + 1e-9
        assert r.ours_s <= r.param_s * rel and r.ours_s <= r.equal_s * rel
        assert r.ours_s <= r.ours_layers_s * rel
        assert r.ours_layers_s <= r.param_s * rel and r.ours_layers_s <= r.equal_s * rel
        # no bottleneck beats total/k or the heaviest single unit
        assert r.ours_s >= r.lower_bound_s * (1 - 1e-9)
        assert r.ours_s >= r.largest_unit_s * (1 - 1e-9)
        assert r.param_ratio >= 1 - 1e-9 and r.equal_ratio >= 1 - 1e-9
        ours = r.results["ours"]
        assert len(ours.cuts) == r.stages and not ours.violations
        assert math.isclose(ours.bottleneck_s, max(ours.stage_costs_s))
    # the head-heavy LM: balancing parameters is visibly worse than the exact plan with 2 stages
    lm2 = [r for r in rows if r.model == "lm-vocab32k" and r.stages == 2]
    assert all(r.param_ratio > 1.05 for r in lm2)
    text = _report.read_section("balance", out)
    assert text is not None
    for name in TINY:
        assert f"| {name} | 2 |" in text and f"| {name} | 4 |" in text
    assert "Geometric mean" in text


def test_bench_balance_catches_a_planner_worse_than_a_baseline(monkeypatch):
    """The benchmark's optimality check can fail: feed it a deliberately bad 'planner'."""
    model, x = build(TINY["vgg16"])
    traced = bb.trace(model, x)
    pg = bb.build_graph(traced, bb.price(traced))

    def worst(problem):  # everything but the last unit on stage 0
        n, k = problem.n, problem.num_stages
        return bb.evaluate(problem, [0] + list(range(n - k + 1, n)), method="bad")

    monkeypatch.setattr(bb, "optimal_partition", worst)
    with pytest.raises(AssertionError, match="not optimal"):
        bb.compare(pg, layer_paths(model), 2, bb.Cluster(), "vgg16")


# --------------------------------------------------------------------------------------------
# bench_plan_speed


def test_bench_plan_speed_tiny(tmp_path):
    import fxpipe.partitioner.driver as driver
    from benchmarks import bench_plan_speed as ps

    originals = {n: getattr(driver, n) for names in ps.PHASES.values() for n in names
                 if hasattr(driver, n)}
    out = tmp_path / "BENCHMARKS.md"
    res = ps.main(["--tiny", "--repeats", "1", "--out", str(out)])
    first = res["first"]
    assert first.total_s > 0
    for phase in ("trace", "cost", "graph", "plan"):
        assert first.phases_s[phase] > 0, phase
        assert first.calls.get(phase, 0) >= 1, phase
    assert all(v >= 0 for v in first.phases_s.values())
    assert math.isclose(sum(first.phases_s.values()), first.total_s, rel_tol=1e-6)
    assert first.plan.num_stages == 4
    assert len(res["warm"]) == 1 and res["reference_s"] > 0
    assert len(res["checks"]) == 2
    for name, limit, measured, passed in res["checks"]:
        assert limit == ps.TARGET_S and passed == (measured <= limit)
    # the phase timers were removed again
    assert all(getattr(driver, n) is f for n, f in originals.items())
    text = _report.read_section("plan-speed", out)
    assert text is not None and ("PASS" in text or "FAIL" in text)
    assert "| trace |" in text and "| cost |" in text
