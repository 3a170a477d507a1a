"""Smoke test of benchmarks/bench_v_schedules.py (issue 28): the tiny run writes its section,
the V-Half / V-Min caps are met exactly per rank, DualPipeV holds 2p + 1 V stages."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import bench_v_schedules as bv  # noqa: E402


def test_bench_v_schedules_tiny(tmp_path):
    out = tmp_path / "BENCHMARKS.md"
    rows = bv.main(["--tiny", "--out", str(out)])
    assert len(rows) == 2 * len(bv.SCHEDULES)
    text = out.read_text()
    assert "<!-- v-schedules -->" in text and "| v-min | 4 | 8 |" in text
    for r in rows:
        assert r.peak == bv.published_memory(r.name, r.p), (r.name, r.p, r.rank_peaks)
        assert 0.0 < r.bubble < 1.0
    one = {r.p: r for r in rows if r.name == "1f1b"}
    half = {r.p: r for r in rows if r.name == "v-half"}
    assert half[4].bubble < one[4].bubble and half[4].peak < one[4].peak
