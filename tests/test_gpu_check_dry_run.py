"""benchmarks/gpu_check.py --dry-run: the prepared GPU check runs its every part on the CPU with
tiny shapes, so the script cannot rot before a GPU runs it. Starts 2 gloo ranks (the pipeline
part); about 25 s on 2 cores."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("profile_gpt", "profile_hf_gpt2", "stages_fp32", "stages_bf16", "mfu_block",
         "pipeline_2rank", "fast_stages")


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@pytest.mark.distributed
def test_dry_run_writes_every_part(tmp_path):
    out = tmp_path / "gc"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"),
                           "--dry-run", "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((out / "gpu_check.json").read_text())
    assert res["environment"]["dry_run"] is True and res["environment"]["device"] == "cpu"
    parts = res["parts"]
    assert set(parts) == set(PARTS)
    for name in PARTS:
        assert parts[name]["ok"], (name, parts[name].get("traceback"))
    for name in ("profile_gpt", "profile_hf_gpt2"):
        p = parts[name]
        assert p["nodes"] > 10 and all(_num(p[k]) and p[k] > 0
                                       for k in ("fwd_s", "bwd_input_s", "bwd_weight_s"))
    for prec in ("fp32", "bf16"):
        p = parts[f"stages_{prec}"]
        # two plans (analytic and measured costs) of 2 stages each, every figure a number
        assert sorted((r["costs"], r["stage"]) for r in p["stages"]) == [
            ("analytic", 0), ("analytic", 1), ("measured", 0), ("measured", 1)]
        for r in p["stages"]:
            for k in ("predicted_fwd_s", "predicted_bwd_s", "predicted_compute_s",
                      "measured_fwd_s", "measured_bwd_s"):
                assert _num(r[k]) and r[k] > 0, (prec, r)
            assert r["kernel_fwd_s"] is None and r["kernel_bwd_s"] is None  # CUDA only
        assert [m["stage"] for m in p["memory"]] == [0, 1]
        for m in p["memory"]:
            assert m["allocator_peak_bytes"] is None  # a CPU has no CUDA allocator
            assert m["inflight"] >= 1
            for k in ("predicted_bytes", "param_bytes", "saved_bytes",
                      "predicted_activation_bytes"):
                assert _num(m[k]) and m[k] > 0, (prec, m)
    mfu = parts["mfu_block"]
    assert mfu["width"] == 64 and _num(mfu["mfu"]) and mfu["mfu"] > 0
    # the Megatron-LM formula and FlopCounterMode agree within the attention's share
    assert mfu["flops_counted"] == pytest.approx(mfu["flops_formula"], rel=0.1)
    pipe = parts["pipeline_2rank"]
    assert pipe["gloo"]["ran"] and pipe["gloo"]["backend"] == "gloo"
    assert pipe["gloo"]["abs_error"] < 1e-5 and _num(pipe["gloo"]["step_s"])
    assert not pipe["nccl"]["ran"] and "CUDA" in pipe["nccl"]["outcome"]
    fast = parts["fast_stages"]["variants"]
    for name in ("plain eager", "fxpipe eager"):
        v = fast[name]
        assert v["ran"] and _num(v["tokens_per_s"]) and v["tokens_per_s"] > 0, (name, v)
        assert all(math.isfinite(x) for x in v["losses"]), (name, v["losses"])
    # the same model, seed and batch: fxpipe's first loss is the plain loop's (bf16 autocast)
    assert fast["fxpipe eager"]["losses"][0] == pytest.approx(
        fast["plain eager"]["losses"][0], rel=2 ** -6)
    assert _num(fast["fxpipe eager"]["vs_plain"])
    for name in ("plain compiled", "fxpipe compiled"):  # (CPU compilation: its own tests)
        assert not fast[name]["ran"] and "dry run" in fast[name]["outcome"]
    for name in ("plain compiled fp8", "fxpipe compiled fp8"):  # no FP8 tensor cores on a CPU
        assert not fast[name]["ran"] and "this run is on cpu" in fast[name]["outcome"]
    md = (out / "gpu_check.md").read_text()
    assert "DRY RUN" in md
    for head in ("### Stage times", "### Memory per stage", "### MFU", "### 2-rank pipeline",
                 "### Fast stages"):
        assert head in md
    assert "| fp32 | analytic | 0 |" in md


def test_write_benchmarks_refuses_a_dry_run(tmp_path):
    sys.path.insert(0, str(ROOT))
    from benchmarks import gpu_check

    with pytest.raises(SystemExit):
        gpu_check.main(["--dry-run", "--out", str(tmp_path), "--only", "mfu_block",
                        "--write-benchmarks"])


@pytest.mark.parametrize("args, words", [
    (["--only", "nosuchpart"], "no part named nosuchpart"),
    (["--budget-s", "-1"], "must be a positive number"),
    (["--out", "FILE"], "is a file"),
])
def test_bad_arguments_are_refused_before_anything_runs(tmp_path, capsys, args, words):
    sys.path.insert(0, str(ROOT))
    from benchmarks import gpu_check

    assert set(gpu_check.PARTS) == set(PARTS)
    (tmp_path / "FILE").write_text("x")
    args = [str(tmp_path / a) if a == "FILE" else a for a in args]
    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--dry-run", *(["--out", str(tmp_path / "o")] if "--out" not in args
                                       else []), *args])
    assert e.value.code == 2 and words in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("gpu", ["H200", "H100-80GB", "A100-80GB", None])
def test_cuda_stage_plans_are_priced_by_the_gpu_model_of_the_device(gpu):
    """On a GPU the check's analytic plans use the GPU model a user of that GPU gets
    (``cluster.gpu``), not speeds set by hand; a GPU without a profile gets ``device: cuda``."""
    sys.path.insert(0, str(ROOT))
    from benchmarks import gpu_check
    from fxpipe.specs.gpus import PROFILES
    from fxpipe.specs.loader import load_spec

    assert set(gpu_check.GPU_PROFILES.values()) <= set(PROFILES)
    spec = load_spec(gpu_check.gpt_spec(gpu_check.DRY, "cuda", "bf16", "analytic", gpu))
    assert spec.cluster.device == "cuda" and spec.cluster.gpu == gpu
    if gpu:
        assert spec.cluster.device_tflops == PROFILES[gpu].bf16_tflops


@pytest.mark.parametrize("gpu, tflops", [("H200", 989.0), ("A100-80GB", 312.0)])
def test_mfu_peak_is_the_gpu_profiles_dense_bf16_peak(monkeypatch, gpu, tflops):
    """The MFU's peak comes from fxpipe's GPU profile of the device (one table for both)."""
    sys.path.insert(0, str(ROOT))
    import torch

    from benchmarks import gpu_check

    monkeypatch.setattr(gpu_check, "gpu_profile", lambda dev: gpu)
    peak, note = gpu_check.peak_for(torch.device("cuda", 0), None)
    assert peak == tflops * 1e12 and gpu in note
    monkeypatch.setattr(gpu_check, "gpu_profile", lambda dev: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev: "Some GPU")
    with pytest.raises(RuntimeError, match="pass --peak-tflops"):
        gpu_check.peak_for(torch.device("cuda", 0), None)
