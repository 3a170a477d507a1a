"""Smoke test of benchmarks/bench_hf_vs_torch_pipelining.py (an HF GPT-2 trained by fxpipe with
its planned split and by torch.distributed.pipelining with an equal-layer split), on its toy
``--tiny`` shape over 2 gloo ranks, plus the equal-layer split rule in-process.

What must hold whatever the machine's load: a row per schedule, finite losses that agree between
the runtimes step by step (same initial weights, same batches, same math), positive times and
speedups, one split description and one measured stage time per stage, the section written.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

pytest.importorskip("transformers")

from benchmarks import _report  # noqa: E402
from benchmarks import bench_hf_vs_torch_pipelining as bh  # noqa: E402

try:
    from tolerances import bound  # noqa: E402
except ImportError:  # tests/ collected as a package
    from tests.tolerances import bound  # noqa: E402


def test_layer_split_is_torchtitans_rule():
    assert bh.layer_split(4, 2) == [[0, 1], [2, 3]]
    assert bh.layer_split(4, 4) == [[0], [1], [2], [3]]
    assert bh.layer_split(5, 2) == [[0, 1, 2], [3, 4]]  # the first stages take the remainder
    # torchtitan's defaults count the embedding and the head as one layer each
    assert bh.layer_split(4, 2, 1, 1) == [[0, 1], [2, 3]]
    assert bh.layer_split(4, 4, 1, 1) == [[0], [1, 2], [3], []]
    with pytest.raises(ValueError, match="cannot fill"):
        bh.layer_split(2, 4)
    assert bh.describe_layers([[0, 1], [2, 3]], 0) == "emb, h0-h1"
    assert bh.describe_layers([[0], [1, 2], [3], []], 3) == "ln_f, head, loss"


@pytest.mark.distributed
def test_hf_benchmark_tiny(tmp_path):
    md = tmp_path / "B.md"
    res = bh.main(["--tiny"], out=md)
    assert [(r.schedule, r.p) for r in res.rows] == [("gpipe", 2), ("1f1b", 2)]
    for r in res.rows:
        assert set(r.step_s) == set(bh.ARMS) and all(t > 0 for t in r.step_s.values())
        assert r.speedup > 0 and math.isfinite(r.speedup) and r.predicted_speedup > 0
        assert len(r.round_speedups) == len(r.foreign) == 2  # rounds kept
        assert r.attempts == 2 and all(0.0 <= x <= 1.0 for x in r.foreign)  # --tiny keeps all
        fx, th = r.losses["fx"], r.losses["torch"]
        assert len(fx) == len(th) == 1 + r.attempts  # 1 warm-up + 1 step per round run
        assert all(math.isfinite(x) for x in fx + th)
        assert fx[0] == pytest.approx(math.log(bh.TINY.vocab), abs=0.5)  # untrained: ~ln(V)
        # the same math on both runtimes, summed in each one's order: float32 rounding over
        # the tokens of a step (2 micro-batches of 1 x 16), growing with the steps
        tol = bound(max(abs(x) for x in fx), 2 * bh.TINY.seq, len(fx))
        assert max(r.loss_diff.values()) < tol, (r.loss_diff, tol)
        for key in ("fx", "equal"):
            assert len(r.splits[key]) == len(r.predicted_ms[key]) == r.p
        assert r.splits["fx"][-1].endswith("loss") and r.splits["equal"][0].startswith("emb")
        for arm in bh.ARMS:
            assert len(r.measured_ms[arm]) == r.p and all(x > 0 for x in r.measured_ms[arm])
    body = _report.read_section(bh.SECTION, md)
    assert body is not None
    assert "| gpipe | 2 | 2 |" in body and "| 1f1b | 2 | 2 |" in body
    assert "load average" in body and "equal-layer split" in body
    # the saved figures rewrite the same section without measuring
    saved = bh.save_result(res, "test machine", 1.0, tmp_path / "r.json")
    again = bh.main(["--report-from", str(saved)], out=tmp_path / "C.md")
    assert [r.speedup for r in again.rows] == [r.speedup for r in res.rows]
    assert "test machine" in _report.read_section(bh.SECTION, tmp_path / "C.md")
