"""Smoke tests of the tensor-parallel and data-sharding benchmarks (``--tiny``): each writes its
BENCHMARKS.md section, and what it measures equals what the plan predicts (collective counts and
bytes, the state each rank holds and sends), so the published tables cannot drift from the
code."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import bench_data_sharding, bench_tensor_parallel  # noqa: E402

pytestmark = pytest.mark.distributed


def test_tensor_parallel_benchmark_tiny(tmp_path):
    out = tmp_path / "B.md"
    res = bench_tensor_parallel.main(["--tiny", "--out", str(out)])
    assert "<!-- tensor-parallel -->" in out.read_text()
    for r in res["bytes"]:
        assert r["measured_n"] == r["predicted_n"], r
        assert r["measured"] == r["predicted"], r
    assert all(r["auto_s"] is not None and r["auto_s"] > 0 for r in res["picks"]), res["picks"]
    assert [r["layout"] for r in res["cpu"]] == ["tp=1 dp=2", "tp=2 dp=1"]


def test_data_sharding_benchmark_tiny(tmp_path):
    out = tmp_path / "B.md"
    res = bench_data_sharding.main(["--tiny", "--out", str(out)])
    assert "<!-- data-sharding -->" in out.read_text()
    levels = {r["level"] for r in res["held"]}
    assert levels == set(bench_data_sharding.LEVELS)
    for r in res["held"]:
        assert r["held"] == r["held_pred"], r
        if r["level"] != "none":
            assert r["peak"] == r["peak_pred"] and r["sent"] == r["sent_pred"], r
    held = {lv: max(r["held"] for r in res["held"] if r["level"] == lv) for lv in levels}
    assert held["optimizer"] < held["none"] and held["full"] < held["gradients"] < held["none"]
    # the auto search never does worse than the unsharded search: it includes it
    by = {(r["tensor"], r["sharding"]): r for r in res["picks"]}
    for t in ("1", "auto"):
        assert by[(t, "auto")]["step_s"] <= by[(t, "none")]["step_s"] * (1 + 1e-9), by
