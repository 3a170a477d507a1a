"""``train.precision: fp8`` (issue 37): a stage's weight matmuls through torchao's float8.

On CPU in torchao's emulation (the same casts to ``float8_e4m3fn`` and scales, the matmul in
fp32): the rewrite finds every ``linear`` / ``addmm`` of a weight whose dimensions are
multiples of 16, keeps the parameters (names, objects, gradients), and a rewritten linear is
within the bound float8 rounding explains of the fp32 one: each operand entry moves by at most
``u = 2^-4`` of itself (e4m3's 3 mantissa bits), or half a subnormal step of its scaled range
(``2^-10`` of ``amax / 448``), so ``|y8 - y| <= (|x| + dx) @ (|w| + dw)^T - |x| @ |w|^T``
entry by entry. The bundled GPT rewritten trains (its loss falls as fp32's does). On the
cluster side: fp8 on a CPU cluster, on an A100 and on a CPU device are one line each, and the
GPU model prices the weight matmuls at the FP8 peak.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpipe
from fxpipe.errors import SpecError
from fxpipe.execution.fp8 import fp8_problem, fp8_stage

try:
    from shared_models import VOCAB, tiny_gpt
except ImportError:  # tests/ collected as a package
    from tests.shared_models import VOCAB, tiny_gpt

torchao = pytest.importorskip("torchao")
U = 2.0 ** -4  # e4m3: 3 mantissa bits, unit roundoff
E4M3_MAX = 448.0


def _config(scaling: str):
    from fxpipe.execution.fp8 import float8_config

    return float8_config(scaling, emulate=True)


class _Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 48, bias=False)
        self.c = nn.Linear(48, 10)  # 10 outputs: not a multiple of 16, stays as it is

    def forward(self, x):
        return self.c(self.b(torch.relu(self.a(x))))


def _exported(model: nn.Module, x: torch.Tensor):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.export.export(model, (x,)).module()


def _moved(t: torch.Tensor) -> torch.Tensor:
    """How far float8 scaling may move each entry of ``t`` (module doc)."""
    return torch.maximum(U * t.abs(), t.abs().max() / E4M3_MAX * 2.0 ** -10)


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_a_rewritten_linear_is_within_float8_rounding(scaling):
    torch.manual_seed(0)
    model = _Mlp()
    x = torch.randn(4, 8, 32)
    gm = _exported(model, x)
    fp8 = copy.deepcopy(gm)
    assert fp8_stage(fp8, _config(scaling)) == 2  # a and b; c's 10 outputs stay
    assert [n for n, _ in fp8.named_parameters()] == [n for n, _ in gm.named_parameters()]
    # the first layer alone: the elementwise bound
    w, b = gm.a.weight.detach(), gm.a.bias.detach()
    exact = x @ w.T + b
    got_nodes = [n for n in fp8.graph.nodes if n.op == "call_function"
                 and getattr(n.target, "__name__", "") == "float8_linear"]
    first = got_nodes[0].target
    y8 = first(x, gm.a.weight, gm.a.bias).detach()
    mag = x.abs() @ w.abs().T
    worst = (x.abs() + _moved(x)) @ (w.abs() + _moved(w)).T - mag
    assert bool(((y8 - exact).abs() <= worst + 1e-6 * mag.max()).all())
    assert float((y8 - exact).abs().max()) > 0  # it did round (not a pass-through)
    # the whole graph: forward and the parameters' gradients
    out8, out = fp8(x), gm(x)
    assert out8.shape == out.shape
    out8.square().sum().backward()
    assert all(p.grad is not None for p in fp8.parameters())


def test_the_bundled_gpt_trains_in_float8():
    torch.manual_seed(0)
    x = torch.randint(0, VOCAB, (8, 16))
    y = torch.randint(0, VOCAB, (8, 16))
    ref = tiny_gpt()
    gm = _exported(tiny_gpt(), x)
    n = fp8_stage(gm, _config("tensorwise"))
    weights = [p for name, p in gm.named_parameters() if p.dim() == 2 and "wpe" not in name]
    assert n >= len(weights) - 1  # every block's matmuls and the head (tied to wte)

    def train(model) -> list[float]:
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        losses = []
        for _ in range(8):
            loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
        return losses
    eight, full = train(gm), train(ref)
    assert eight[-1] < eight[0] - 0.1  # it learns
    # within float8's relative rounding of fp32 over the run (a few u)
    assert all(abs(a - b) <= 4 * U * b for a, b in zip(eight, full)), (eight, full)


def test_fp8_where_there_are_no_fp8_tensor_cores_is_one_line():
    assert "this run is on cpu" in fp8_problem(torch.device("cpu"))
    spec = {"model": {"factory": "shared_models:tiny_gpt"},
            "data": {"batch_size": 8, "seq_len": 16},
            "parallel": {"pipeline": 2, "data": 1, "microbatches": 2},
            "cluster": {"devices_per_node": 2},
            "train": {"precision": "fp8"}}
    with pytest.raises(SpecError, match="fp8 runs the matmuls on FP8 tensor cores") as e:
        fxpipe.load_spec(spec)
    assert "\n" not in str(e.value).strip()
    spec["cluster"] = {"devices_per_node": 2, "device": "cuda", "gpu": "A100-80GB"}
    with pytest.raises(SpecError, match="A100-80GB has none"):
        fxpipe.load_spec(spec)
    spec["cluster"]["gpu"] = "H100-80GB"
    assert fxpipe.load_spec(spec).train.precision == "fp8"


def test_the_gpu_model_prices_weight_matmuls_at_the_fp8_peak():
    from fxpipe.partitioner.cost import NodeCost
    from fxpipe.partitioner.gpu_model import gpu_rates, gpu_times
    from fxpipe.specs.gpus import PROFILES

    h100 = PROFILES["H100-80GB"]
    big = 2 * 8192 * 8192 * 8192.0
    linear = NodeCost(fwd_flops=big, bwd_flops=2 * big, bwd_weight_flops=big, out_bytes=1e6,
                      param_bytes=1e6, saved_bytes=0, buffer_bytes=0, bwd_source="ratio",
                      in_bytes=1e6, input_grad=True, weight_grad=True, fp8_shape=(8192, 8192))
    scores = NodeCost(fwd_flops=big, bwd_flops=2 * big, bwd_weight_flops=0, out_bytes=1e6,
                      param_bytes=0, saved_bytes=0, buffer_bytes=0, bwd_source="ratio",
                      in_bytes=1e6, input_grad=True, weight_grad=False)
    costs = {"linear": linear, "bmm": scores}
    rates = gpu_rates(h100, 989.0, 3350.0, "bf16", 0.0)
    fixed = rates.matmul_fixed_s  # a GEMM's ramp-up and tail, either way
    bf = gpu_times(costs, rates)
    f8 = gpu_times(costs, gpu_rates(h100, 989.0, 3350.0, "fp8", 0.0))
    ratio = (h100.fp8_tflops * h100.fp8_matmul_efficiency) / (h100.bf16_tflops
                                                                * h100.matmul_efficiency)
    assert f8["linear"].fwd_s - fixed == pytest.approx((bf["linear"].fwd_s - fixed) / ratio,
                                                       rel=1e-6)
    assert f8["bmm"].fwd_s == pytest.approx(bf["bmm"].fwd_s)  # no weight: bf16
    with pytest.raises(ValueError, match="no"):
        gpu_rates(PROFILES["A100-80GB"], 312.0, 2039.0, "fp8", 0.0)


def test_the_planner_prices_in_fp8_exactly_the_nodes_the_rewrite_takes():
    """The same predicate both ways: a 10-wide output stays bf16 in the run and in the price;
    under tensor parallelism the shard's shape is priced (the same rule applied to it)."""
    from fxpipe.partitioner.cost import price
    from fxpipe.partitioner.gpu_model import gpu_rates, gpu_times
    from fxpipe.partitioner.tensor_costs import scaled_costs, tensor_pricing
    from fxpipe.partitioner.trace import trace
    from fxpipe.specs.gpus import PROFILES

    model, x = _Mlp(), torch.randn(4, 8, 32)
    traced = trace(model, (x,), "export")
    costs = price(traced)
    rewritten = copy.deepcopy(traced.gm)
    fp8_stage(rewritten, _config("tensorwise"))
    taken = {n.name for n in rewritten.graph.nodes if "float8" in str(n.target)}
    h100 = PROFILES["H100-80GB"]
    bf = gpu_times(costs, gpu_rates(h100, 989.0, 3350.0, "bf16", 0.0))
    f8 = gpu_times(costs, gpu_rates(h100, 989.0, 3350.0, "fp8", 0.0))
    faster = {n for n in costs if f8[n].fwd_s < bf[n].fwd_s}
    assert faster == taken and len(taken) == 2, (faster, taken)
    trainable = {n.target for n in traced.gm.graph.nodes if n.op == "get_attr"}
    tp = tensor_pricing(traced.gm, 2, sequence_parallel=False, output_loss=None,
                        trainable=trainable, intra_node_GBps=450.0, latency_s=1e-6)
    shards = scaled_costs(costs, tp)
    split = {n: shards[n].fp8_shape for n in taken}
    f8t = gpu_times(shards, gpu_rates(h100, 989.0, 3350.0, "fp8", 0.0))
    bft = gpu_times(shards, gpu_rates(h100, 989.0, 3350.0, "bf16", 0.0))
    for n, shape in split.items():  # a's [64, 32] -> [32, 32]; b's [48, 64] -> [48, 32]
        assert (f8t[n].fwd_s < bft[n].fwd_s) == all(s % 16 == 0 for s in shape), (n, shape)
    assert any(s != costs[n].fp8_shape for n, s in split.items())


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize("overlap", [1, 2])
def test_under_tensor_parallelism_the_priced_fp8_matmuls_are_the_converted_ones(name, overlap):
    """GPT-2's row-parallel Conv1D becomes ``mm`` + bias after its reduction: converted and
    priced alike; with overlapped collectives every chunk's matmul is converted."""
    pytest.importorskip("transformers")
    from fxpipe.execution.fp8 import fp8_shape_ok
    from fxpipe.partitioner.cost import price
    from fxpipe.partitioner.tensor_costs import scaled_costs, tensor_pricing
    from fxpipe.tensor.rewrite import shard_stage

    try:
        import test_tensor_parallel as tp
    except ImportError:  # tests/ collected as a package
        from tests import test_tensor_parallel as tp
    traced, _ = tp._trace_of(name)
    _, sharding = tp._traced(name, 2)
    trainable = {n.target for n in traced.gm.graph.nodes if n.op == "get_attr"}
    pricing = tensor_pricing(traced.gm, 2, sequence_parallel=False, overlap=overlap,
                             output_loss=None, trainable=trainable, intra_node_GBps=450.0,
                             latency_s=1e-6)
    shards = scaled_costs(price(traced), pricing)
    priced = sum(1 for c in shards.values() if c.fp8_shape and fp8_shape_ok(c.fp8_shape))
    chunked = {m for s in pricing.sites.values() for m in s.matmuls}
    gm = shard_stage(traced.gm, sharding, None, 0, overlap=overlap)
    converted = fp8_stage(gm, _config("tensorwise"))
    chunks = sum(overlap - 1 for n, c in shards.items()
                 if n in chunked and c.fp8_shape and fp8_shape_ok(c.fp8_shape))
    assert priced > 0 and converted == priced + chunks, (priced, chunks, converted)
