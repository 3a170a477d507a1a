"""The CUDA cost model (:mod:`fxpipe.partitioner.gpu_model`), the ``cluster.gpu`` profiles
(:mod:`fxpipe.specs.gpus`) and the published-runs benchmark's smoke test."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import fxpipe  # noqa: E402
from fxpipe.partitioner import gpu_model as gm  # noqa: E402
from fxpipe.partitioner.cost import NodeCost  # noqa: E402
from fxpipe.plans.placement import ring_members_per_node  # noqa: E402
from fxpipe.schedule.simulate import Links  # noqa: E402
from fxpipe.specs.gpus import PROFILES  # noqa: E402
from fxpipe.specs.schema import ClusterSpec  # noqa: E402

A100 = PROFILES["A100-80GB"]


def _rates(name="A100-80GB", precision="bf16", attention="flash"):
    p = PROFILES[name]
    return gm.gpu_rates(p, p.bf16_tflops, p.hbm_GBps, precision, 6e-6, attention)


def _square(n: int) -> tuple[float, float]:
    """FLOPs and traced (fp32) bytes of an n x n x n GEMM."""
    return 2.0 * n ** 3, 3 * n * n * 4.0


def test_matmul_efficiency_grows_with_size_and_saturates_below_peak():
    r = _rates()
    peak = A100.bf16_tflops * 1e12
    effs = [gm.matmul_efficiency(*_square(n), r, peak) for n in (256, 512, 1024, 2048, 8192)]
    assert effs == sorted(effs)
    assert effs[0] < 0.1 and effs[-1] <= A100.matmul_efficiency
    assert effs[-1] > 0.95 * A100.matmul_efficiency


def test_thin_matmul_is_slower_per_flop_than_a_square_one():
    r = _rates()
    peak = A100.bf16_tflops * 1e12
    m = n = 8192
    k = 16  # the same FLOPs as a square-ish GEMM, but a thin inner dimension
    thin = gm.matmul_efficiency(2.0 * m * n * k, 4.0 * (m * k + k * n + m * n), r, peak)
    side = round((m * n * k) ** (1 / 3))
    square = gm.matmul_efficiency(*_square(side), r, peak)
    assert thin < 0.5 * square  # memory-bound: it moves its output at HBM speed


def test_memory_bound_ops_run_at_achievable_hbm_and_16_bit_halves_bytes():
    c = NodeCost(in_bytes=400_000_000, out_bytes=400_000_000, input_grad=True)
    t32 = gm.gpu_times({"x": c}, _rates(precision="fp32"))["x"]
    t16 = gm.gpu_times({"x": c}, _rates(precision="bf16"))["x"]
    bw = A100.hbm_GBps * 1e9 * A100.hbm_efficiency
    assert t32.fwd_s == pytest.approx(6e-6 + 8e8 / bw)
    assert t16.fwd_s == pytest.approx(6e-6 + 4e8 / bw)


def test_flash_attention_beats_the_math_path_and_skips_the_masked_half():
    flops = 4.0 * 8 * 16 * 2048 * 2048 * 128  # b=8, h=16, s=2048, d=128
    scores = 8 * 16 * 2048 * 2048
    nbytes = 4 * 8 * 2048 * 2048 * 4.0
    flash, math_ = _rates(attention="flash"), _rates(attention="math")
    f_causal = gm.attention_seconds(flops, nbytes, scores, True, False, flash)
    f_full = gm.attention_seconds(flops, nbytes, scores, False, False, flash)
    m = gm.attention_seconds(flops, nbytes, scores, True, False, math_)
    assert f_causal < f_full < m
    assert f_full == pytest.approx(flops / (A100.bf16_tflops * 1e12 * A100.flash_efficiency)
                                   + A100.matmul_fixed_us * 1e-6, rel=0.05)


def test_bus_bandwidth_saturates_with_message_size():
    sizes = [2 ** k for k in range(10, 34, 2)]
    bws = [gm.bus_bandwidth(s, 200.0, 4e6) for s in sizes]
    assert bws == sorted(bws) and bws[-1] < 200.0 and bws[-1] > 199.0
    assert gm.bus_bandwidth(4e6, 200.0, 4e6) == pytest.approx(100.0)


def test_all_reduce_costs_a_reduce_scatter_plus_an_all_gather():
    for n in (2, 8, 64):
        ar = gm.collective_seconds("all_reduce", 1e8, n, 200.0, 4e6, 5e-6)
        rs = gm.collective_seconds("reduce_scatter", 1e8, n, 200.0, 4e6, 5e-6)
        ag = gm.collective_seconds("all_gather", 1e8, n, 200.0, 4e6, 5e-6)
        assert ar == pytest.approx(rs + ag)
    assert gm.collective_seconds("all_reduce", 1e8, 1, 200.0) == 0.0
    with pytest.raises(ValueError, match="unknown collective"):
        gm.collective_seconds("broadcast", 1e8, 4, 200.0)


def test_rings_across_nodes_use_one_nic_per_member():
    # 4 nodes of 8, pipeline 1, data 32: 8 members per node -> 8 NICs, capped by NVLink
    assert ring_members_per_node(1, 32, 8) == (1 * 8,)
    assert gm.ring_bus_GBps(8, True, 205.0, 22.5) == 180.0
    assert gm.ring_bus_GBps(1, True, 205.0, 22.5) == 22.5
    assert gm.ring_bus_GBps(8, False, 205.0, 22.5) == 205.0
    links = Links.from_cluster(1, 32, 4, 8, 205.0, 22.5, 5e-6, rails=True)
    assert links.dp_rank_GBps[0] == 180.0
    plain = Links.from_cluster(1, 32, 4, 8, 205.0, 22.5, 5e-6)
    assert plain.dp_rank_GBps[0] == 22.5  # CPU nodes: one link per node, as before


def test_cluster_gpu_fills_defaults_that_hand_values_override():
    c = ClusterSpec(gpu="H100-80GB", nodes=2, devices_per_node=8,
                    links={"inter_node_GBps": 12.5}, memory_gb=40)
    h = PROFILES["H100-80GB"]
    assert c.device == "cuda" and c.device_tflops == h.bf16_tflops
    assert c.memory_GBps == h.hbm_GBps and c.memory_gb == 40
    assert c.links.intra_node_GBps == h.nvlink_busbw_GBps and c.links.inter_node_GBps == 12.5
    assert ClusterSpec(gpu="H200").memory_gb == 141.0


def test_cluster_gpu_rejects_unknown_names_and_cpu():
    with pytest.raises(ValueError, match="A100-80GB, H100-80GB, H200"):
        ClusterSpec(gpu="V100")
    with pytest.raises(ValueError, match="needs device: cuda"):
        ClusterSpec(gpu="A100-80GB", device="cpu")
    with pytest.raises(ValueError):
        ClusterSpec(device="cuda", attention="fast")


def test_load_spec_points_at_an_unknown_gpu(tmp_path):
    from fxpipe.errors import SpecError

    p = tmp_path / "s.yaml"
    p.write_text("model: {factory: 'fxpipe.examples.gpt:CharGPT'}\n"
                 "cluster: {gpu: A100}\n")
    with pytest.raises(SpecError, match="A100-80GB"):
        fxpipe.load_spec(p)


def _plan(cluster: dict, precision="fp32"):
    from fxpipe.examples.gpt import CharGPT

    model = CharGPT(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
    spec = {"model": {"factory": "fxpipe.examples.gpt:CharGPT",
                      "args": {"vocab_size": 64, "block_size": 16, "n_layer": 2, "n_head": 4,
                               "n_embd": 32}},
            "data": {"batch_size": 8, "seq_len": 16},
            "parallel": {"pipeline": 2, "data": 1, "microbatches": 4},
            "cluster": {"devices_per_node": 2, **cluster},
            "train": {"precision": precision}}
    return fxpipe.plan(model, spec, (torch.zeros(1, 16, dtype=torch.long),))


def test_gpu_specs_plan_with_the_gpu_model_and_keep_the_profile_in_the_plan():
    from fxpipe.partitioner.timing import analytic_times

    gpu = _plan({"gpu": "A100-80GB"}, "bf16")
    assert gpu.spec.cluster.gpu == "A100-80GB"
    assert gpu.spec.cluster.device_tflops == A100.bf16_tflops
    # a tiny model on a GPU is launch-bound: at least one launch per op and pass
    assert gpu.predicted.step_time_s > 4 * 6e-6
    again = fxpipe.Plan.from_dict(gpu.to_dict())
    assert again.spec == gpu.spec
    # the CPU roofline is untouched: 0 FLOPs and 0 bytes cost the launch alone
    t = analytic_times({"n": NodeCost()}, 1e12, 1e9, 4e-6)["n"]
    assert t.fwd_s == 4e-6 and t.bwd_input_s == 0.0


def test_bench_published_runs_tiny(tmp_path):
    from benchmarks import bench_published_runs as bpr

    out = tmp_path / "B.md"
    rows = bpr.main(["--tiny", "--out", str(out)])
    assert len(rows) == 1 and rows[0]["pred_s"] > 0 and rows[0]["plan_s"] < 60
    text = out.read_text()
    assert "<!-- published-runs -->" in text and "predicted / published" in text
    # every real run is planned at its own layout and its published step is positive
    for run in bpr.RUNS:
        spec = fxpipe.load_spec(bpr.spec_of(run))
        assert spec.parallel.tensor * spec.parallel.pipeline * spec.parallel.data == run.gpus
        assert run.published_step_s() > 0


def test_bench_published_levers_tiny(tmp_path):
    """The published-levers benchmark (issue 36) plans its smoke runs with the levers asked
    (selective recomputation under interleaving and sequence parallelism; per-block gathering
    of fully sharded parameters), and every published run's spec is its paper's layout."""
    pytest.importorskip("transformers")
    from benchmarks import bench_published_levers as bpl

    out = tmp_path / "B.md"
    rows = bpl.main(["--tiny", "--out", str(out)])
    assert [r["name"] for r in rows] == [r.name for r in bpl.TINY_RUNS]
    for r in rows:
        assert r["pub"]["step"] > 0 and r["auto"]["step"] > 0, r
    gpt, llama = rows
    assert gpt["pub"]["chosen"].startswith("selective") and "v=2" in gpt["pub"]["chosen"]
    assert "gather block" in llama["pub"]["chosen"]
    assert "<!-- published-levers -->" in out.read_text()
    for run in bpl.RUNS:
        spec = fxpipe.load_spec(bpl.spec_of(run))
        assert spec.parallel.tensor * spec.parallel.pipeline * spec.parallel.data == run.gpus
        assert spec.parallel.data * spec.parallel.microbatches * run.microbatch_size == run.batch
        assert run.published_s > 0
