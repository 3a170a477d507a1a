"""Smoke test of benchmarks/bench_compression.py on its ``--tiny`` model (the main job shrunk to
2 layers of width 32), 3 steps with 1 warm-up step, over 4 gloo ranks (2 stages x 2 replicas).

What must hold whatever the machine's load: every step's measured data-parallel bytes equal
the benchmark's formula for the method (so the formula and the reducers agree on this model);
fp16 sends exactly half of ``none``, PowerSGD and top-k far less once compressed, and exactly
``none``'s bytes in their warm-up step; bf16 stage messages exactly half of fp32's and equal to
the plan's cut bytes; the lossless paths' losses equal ``none``'s step for step; every
configuration trains (finite losses) and the ranks agree on every loss; the section written.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import _report  # noqa: E402
from benchmarks import bench_compression as bc  # noqa: E402


def test_expected_bytes_formulas():
    """The formulas by hand on one bucket of a 64 x 32 matrix and a 32-vector over 2 ranks."""
    bucket = [([(64, 32), (32,)], 2)]
    n = 64 * 32 + 32
    assert bc.expected_gradient_bytes(bucket, bc.Config("none")) == 4 * n
    assert bc.expected_gradient_bytes(bucket, bc.Config("fp16", "fp16")) == 2 * n
    psgd = bc.Config("powersgd", "powersgd", compression=(("rank", 4),))
    # round 1: the vector exactly + P (64 x 4); round 2: Q (32 x 4); fp32, ring over 2 = S
    assert bc.expected_gradient_bytes(bucket, psgd) == 4 * (32 + 64 * 4) + 4 * 32 * 4
    assert bc.expected_gradient_bytes(bucket, psgd, compressed=False) == 4 * n
    # rank 16: 2 x (64 + 32) x 16 >= 64 x 32, not worth compressing: one exact all-reduce
    big = bc.Config("powersgd", "powersgd", compression=(("rank", 16),))
    assert bc.expected_gradient_bytes(bucket, big) == 4 * n
    topk = bc.Config("topk", "topk", compression=(("ratio", 0.01),))
    assert bc.expected_gradient_bytes(bucket, topk) == 8 * math.ceil(0.01 * n)
    assert bc.expected_gradient_bytes([([(10,)], 4)], bc.Config("none")) == 60  # 2 x 3/4 x 40


@pytest.mark.distributed
def test_bench_compression_tiny(tmp_path):
    md = tmp_path / "B.md"
    s = bc.main(["--tiny", "--steps", "3", "--warmup", "1", "--log-every", "1",
                 "--val-batches", "1", "--out", str(md)])
    assert set(s) == {"none", "fp16", "powersgd", "topk", "bf16 messages"}
    none = s["none"]
    for name, x in s.items():
        assert x["bytes_match"], (name, x["bytes_all"])
        assert x["messages_match"], name
        assert x["agree"], f"{name}: ranks disagree on the loss"
        assert all(math.isfinite(v) for v in x["losses"]) and math.isfinite(x["val"])
        assert x["step_s"] > 0
    assert s["fp16"]["bytes_all"] == [b // 2 for b in none["bytes_all"]]
    for name in ("powersgd", "topk"):
        b = s[name]["bytes_all"]
        assert b[0] == none["bytes_all"][0], f"{name}: the warm-up step is exact"
        assert all(x < none["bytes_all"][0] / 4 for x in b[1:]), (name, b)
        assert s[name]["losses"][0] == none["losses"][0]
        assert s[name]["losses"][1:] != none["losses"][1:], f"{name}: lossy, not exact"
    f32, b16 = none["messages"], s["bf16 messages"]["messages"]
    assert f32 > 0 and b16 * 2 == f32
    assert s["bf16 messages"]["bytes_all"] == none["bytes_all"]  # all-reduce stays fp32
    body = _report.read_section(bc.SECTION, md)
    assert body and "powersgd" in body and "Loss curve" in body and "load average" in body
    assert "NO" not in body
