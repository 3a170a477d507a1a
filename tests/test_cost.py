"""Cost model: FLOPs against eager FlopCounterMode and closed forms, tied weights, helpers."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn as nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from fxpipe.examples.cnn import SkipCNN
from fxpipe.examples.gpt import CharGPT
from fxpipe.partitioner.cost import (
    EXTRA_FORMULAS,
    NodeCost,
    price,
    seconds,
    transfer_seconds,
    value_bytes,
)
from fxpipe.partitioner.trace import trace

torch.set_num_threads(1)


def _unique_param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _mha_closed_form(b, t, e):
    """Self-attention with q/k/v/out projections (2 FLOPs per MAC)."""
    return 2 * b * t * e * 3 * e + 2 * b * t * e * e + 2 * (2 * b * t * t * e)


@pytest.fixture(scope="module")
def gpt_priced():
    torch.manual_seed(0)
    model = CharGPT(n_layer=2, n_embd=64, n_head=4, block_size=32)
    x = torch.randint(0, 256, (2, 32))
    tm = trace(model, (x,))
    return model, x, tm, price(tm)


def test_gpt_forward_flops_match_eager_math_sdpa(gpt_priced):
    model, x, tm, costs = gpt_priced
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        model(x)
    eager = fc.get_total_flops()
    ours = sum(c.fwd_flops for c in costs.values())
    assert eager > 0
    assert abs(ours - eager) <= 0.01 * eager
    attn = [n for n in tm.compute_nodes() if "scaled_dot_product" in str(n.target)]
    assert len(attn) == 2 and all(costs[n.name].fwd_flops > 0 for n in attn)


def test_gpt_linear_backward_split(gpt_priced):
    _, _, tm, costs = gpt_priced
    fc_node = next(n for n in tm.compute_nodes() if tm.node_params(n) == ["h.1.fc.weight",
                                                                          "h.1.fc.bias"])
    c = costs[fc_node.name]
    assert c.bwd_source == "autograd"
    assert c.bwd_flops == 2 * c.fwd_flops  # dX and dW each one matmul of the forward's size
    assert c.bwd_weight_flops == c.fwd_flops == c.bwd_input_flops
    for n in tm.compute_nodes():
        cost = costs[n.name]
        assert 0 <= cost.bwd_weight_flops <= cost.bwd_flops
        if cost.fwd_flops == 0:
            assert cost.bwd_flops == 0


def test_tied_weight_counted_once(gpt_priced):
    model, _, tm, costs = gpt_priced
    assert sum(c.param_bytes for c in costs.values()) == _unique_param_bytes(model)
    head = tm.node(tm.output_names[0])  # final linear reads the tied weight charged earlier
    assert "wte.weight" in tm.node_params(head)
    assert costs[head.name].param_bytes == 0


def test_bytes(gpt_priced):
    _, _, tm, costs = gpt_priced
    out = tm.output_names[0]
    assert costs[out].out_bytes == 2 * 32 * 256 * 4
    assert sum(c.saved_bytes for c in costs.values()) > 0
    split = next(n for n in tm.compute_nodes() if "split" in str(n.target))
    assert costs[split.name].out_bytes == 3 * 2 * 32 * 64 * 4  # tuple of q, k, v summed
    assert value_bytes((torch.zeros(2, 3), None, torch.zeros(4, dtype=torch.int64))) == 24 + 32


@pytest.mark.parametrize("tracer", ["export", "fx"])
def test_cnn_forward_and_backward_match_eager(tracer):
    torch.manual_seed(0)
    model = SkipCNN()
    x = torch.randn(4, 1, 8, 8)
    costs = price(trace(model, (x,), tracer=tracer))
    with FlopCounterMode(display=False) as fc:
        y = model(x)
    fwd = fc.get_total_flops()
    with FlopCounterMode(display=False) as fc:
        y.sum().backward()
    bwd = fc.get_total_flops()
    assert sum(c.fwd_flops for c in costs.values()) == fwd
    assert sum(c.bwd_flops for c in costs.values()) == bwd


@pytest.mark.parametrize("tracer", ["export", "fx"])
def test_transformer_encoder_layer_eval_counts_attention(tracer):
    b, t, e, f = 2, 10, 64, 128
    layer = nn.TransformerEncoderLayer(e, 4, f, dropout=0.0, batch_first=True)
    model = nn.Sequential(layer).eval()  # under fx the layer stays one leaf call_module node
    x = torch.randn(b, t, e)
    with torch.no_grad():  # the user's usual inference context: fused fast path in eager
        costs = price(trace(model, (x,), tracer=tracer))
    total = sum(c.fwd_flops for c in costs.values())
    assert total == _mha_closed_form(b, t, e) + 2 * (2 * b * t * e * f)


def test_fused_fast_path_formulas():
    b, t, e, f = 2, 10, 64, 128
    x = torch.randn(b, t, e)
    layer = nn.TransformerEncoderLayer(e, 4, f, dropout=0.0, batch_first=True).eval()
    mha = nn.MultiheadAttention(e, 4, batch_first=True).eval()
    with torch.no_grad():
        with FlopCounterMode(display=False, custom_mapping=EXTRA_FORMULAS) as fc:
            layer(x)
        assert fc.get_total_flops() == _mha_closed_form(b, t, e) + 2 * (2 * b * t * e * f)
        with FlopCounterMode(display=False, custom_mapping=EXTRA_FORMULAS) as fc:
            mha(x, x, x)
        assert fc.get_total_flops() == _mha_closed_form(b, t, e)


def test_meta_gpt2_small_prices_fast():
    # CPU time of this process: a speed bound that other load on the machine cannot break
    t0 = time.process_time()
    with torch.device("meta"):
        model = CharGPT(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    x = torch.zeros(1, 1024, dtype=torch.long, device="meta")
    costs = price(trace(model, (x,)))
    elapsed = time.process_time() - t0
    T, C, V, L = 1024, 768, 50257, 12
    expected = L * (24 * T * C * C + 4 * T * T * C) + 2 * T * C * V
    assert sum(c.fwd_flops for c in costs.values()) == expected
    assert sum(c.param_bytes for c in costs.values()) == _unique_param_bytes(model)
    assert elapsed < 30, f"trace+price of GPT-2-small on meta took {elapsed:.1f}s"


def test_time_helpers():
    assert seconds(2e12, 1.0) == pytest.approx(2.0)
    assert seconds(1e12, 2.0, efficiency=0.5) == pytest.approx(1.0)
    assert transfer_seconds(1e9, 10.0, latency_s=1e-5) == pytest.approx(0.1 + 1e-5)
    assert transfer_seconds(0, 10.0, latency_s=1.0) == 0.0
    with pytest.raises(ValueError, match="device_tflops"):
        seconds(1.0, 0.0)
    with pytest.raises(ValueError, match="GBps"):
        transfer_seconds(1, -1.0)
    with pytest.raises(ValueError, match="backward_ratio"):
        price(None, backward_ratio=-1.0)
    assert NodeCost(bwd_flops=10, bwd_weight_flops=4).bwd_input_flops == 6
