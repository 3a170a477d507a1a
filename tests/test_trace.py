"""Tracing: both tracers, parameter names, pipe_split, annotate, meta device, helpful errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fxpipe.errors import TraceError
from fxpipe.examples.cnn import SkipCNN
from fxpipe.examples.gpt import CharGPT
from fxpipe.partitioner.annotations import annotate, is_pipe_split
from fxpipe.partitioner.trace import TracedModel, module_path_of, trace

try:
    from shared_models import SplitGPT
except ImportError:  # run from the repo root as a package
    from tests.shared_models import SplitGPT

torch.set_num_threads(1)
TRACERS = ["export", "fx"]


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow
            return self.lin(x)
        return x


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.gate = Gate()

    def forward(self, x):
        return self.gate(self.inp(x))


def _idx(b=2, t=8, device="cpu"):
    return torch.randint(0, 256, (b, t), device=device)


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    return CharGPT(n_layer=2, n_embd=32, n_head=4, block_size=16)


@pytest.mark.parametrize("tracer", TRACERS)
def test_gpt_trace_matches_eager_and_names(gpt, tracer):
    x = _idx()
    tm = trace(gpt, (x,), tracer=tracer)
    assert isinstance(tm, TracedModel) and tm.tracer == tracer
    assert tm.input_names == ["idx"]
    assert len(tm.output_names) == 1
    with torch.no_grad():
        torch.testing.assert_close(tm.gm(x), gpt(x))
    # tied weights: head.weight is an alias of the canonical (first-registered) wte.weight
    assert tm.param_aliases == {"head.weight": "wte.weight"}
    canonical = {n for n, _ in gpt.named_parameters()}
    assert set(tm.param_fqns.values()) <= canonical
    # every parameter is reached by some node
    used = {f for n in tm.compute_nodes() for f in tm.node_params(n)}
    assert used == canonical
    assert not any(str(n.target).startswith("_guards_fn") for n in tm.gm.graph.nodes)
    for n in tm.compute_nodes():
        assert "val" in n.meta, n.name
    out = tm.node(tm.output_names[0])
    assert tuple(out.meta["val"].shape) == (2, 8, 256)


def test_export_keeps_module_paths(gpt):
    tm = trace(gpt, (_idx(),))
    paths = {module_path_of(n) for n in tm.compute_nodes()}
    assert {"h.0.attn", "h.1.fc", "head"} <= paths


@pytest.mark.parametrize("tracer", TRACERS)
def test_pipe_split_survives_tracing(tracer):
    torch.manual_seed(0)
    m = SplitGPT(n_layer=2, n_embd=32, n_head=4, block_size=16)
    x = _idx()
    eager = m(x)  # eager: pipe_split is a no-op
    tm = trace(m, (x,), tracer=tracer)
    assert len(tm.split_after) == 1
    assert not any(is_pipe_split(n) for n in tm.gm.graph.nodes)
    node = tm.node(tm.split_after[0])
    # the boundary sits after block 0's last op (the residual add), before block 1
    assert module_path_of(node) == "h.0"
    later = [module_path_of(n) for n in tm.compute_nodes()]
    names = [n.name for n in tm.compute_nodes()]
    cut = names.index(node.name)
    assert all(not p.startswith("h.1") for p in later[: cut + 1])
    assert any(p.startswith("h.1") for p in later[cut + 1:])
    with torch.no_grad():
        torch.testing.assert_close(tm.gm(x), eager)


@pytest.mark.parametrize("tracer", TRACERS)
def test_annotate_pins_innermost_wins(tracer):
    m = CharGPT(n_layer=2, n_embd=32, n_head=4, block_size=16)
    annotate(m.h[1], stage=2)
    assert annotate(m.h[1].attn, stage=1) is m.h[1].attn
    tm = trace(m, (_idx(),), tracer=tracer)
    assert tm.pins, "annotate() pinned nothing"
    for n in tm.compute_nodes():
        path = module_path_of(n)
        if path.startswith("h.1.attn"):
            assert tm.pins[n.name] == 1, n.name
        elif path.startswith("h.1"):
            assert tm.pins[n.name] == 2, n.name
        else:
            assert n.name not in tm.pins, n.name


def test_annotate_validates():
    with pytest.raises(ValueError, match="stage must be >= 0"):
        annotate(nn.Linear(2, 2), stage=-1)
    with pytest.raises(TypeError, match="int"):
        annotate(nn.Linear(2, 2), stage=1.5)
    with pytest.raises(TypeError, match="nn.Module"):
        annotate("h.0", stage=0)


@pytest.mark.parametrize("tracer", TRACERS)
def test_meta_device_model(tracer):
    with torch.device("meta"):
        m = CharGPT(n_layer=2, n_embd=64, n_head=4, block_size=32)
    tm = trace(m, (_idx(2, 32, "meta"),), tracer=tracer)
    assert all(p.is_meta for p in tm.gm.parameters())
    assert tuple(tm.node(tm.output_names[0]).meta["val"].shape) == (2, 32, 256)


def test_skipcnn_both_tracers_agree():
    torch.manual_seed(0)
    m = SkipCNN()
    x = torch.randn(3, 1, 8, 8)
    with torch.no_grad():
        ref = m(x)
        for tracer in TRACERS:
            tm = trace(m, (x,), tracer=tracer)
            torch.testing.assert_close(tm.gm(x), ref)


def test_raw_nn_transformer_exports():
    torch.manual_seed(0)
    model = nn.Transformer(d_model=32, nhead=4, num_encoder_layers=2, num_decoder_layers=2,
                           dim_feedforward=64, dropout=0.0, batch_first=True)
    src, tgt = torch.randn(2, 5, 32), torch.randn(2, 6, 32)
    tm = trace(model, (src, tgt))
    assert tm.input_names == ["src", "tgt"]
    paths = {module_path_of(n) for n in tm.compute_nodes()}
    assert any(p.startswith("encoder.layers.1") for p in paths)  # traced through, not a leaf
    with torch.no_grad():
        torch.testing.assert_close(tm.gm(src, tgt), model(src, tgt))


def test_fx_leaf_modules():
    m = CharGPT(n_layer=2, n_embd=32, n_head=4, block_size=16)
    tm = trace(m, (_idx(),), tracer="fx", leaf_modules=["h.0"])
    mods = [n.target for n in tm.gm.graph.nodes if n.op == "call_module"]
    assert "h.0" in mods and "h.1" not in mods
    assert "h.0.attn.qkv.weight" in tm.node_params(tm.node("h_0"))
    with pytest.raises(TraceError, match="not submodules"):
        trace(m, (_idx(),), tracer="fx", leaf_modules=["nope"])


def test_data_dependent_control_flow_fx_is_explained():
    with pytest.raises(TraceError) as ei:
        trace(Gated(), (torch.randn(2, 4),), tracer="fx")
    msg = str(ei.value)
    assert "data-dependent control flow" in msg
    assert "'gate'" in msg  # the failing submodule
    assert "x.sum() > 0" in msg  # the failing source line
    assert "tracer='export'" in msg and "torch.cond" in msg  # what to do
    assert "cannot be used as inputs to control flow" in msg  # the original error


def test_data_dependent_control_flow_export_is_explained():
    with pytest.raises(TraceError) as ei:
        trace(Gated(), (torch.randn(2, 4),))
    msg = str(ei.value)
    assert "data-dependent control flow" in msg and "torch.cond" in msg and "'gate'" in msg


def test_wrong_example_shape_is_explained():
    with pytest.raises(TraceError, match="example inputs do not fit") as ei:
        trace(Gated(), (torch.randn(2, 5),))
    assert "ONE micro-batch" in str(ei.value)


def test_bad_arguments():
    with pytest.raises(TraceError, match="tracer='jit' is not known"):
        trace(Gated(), (torch.randn(2, 4),), tracer="jit")
    with pytest.raises(TraceError, match=r"wrap a single tensor as \(x,\)"):
        trace(Gated(), torch.randn(2, 4))
    with pytest.raises(TraceError, match="must be a torch.nn.Module"):
        trace(lambda x: x, (torch.randn(2, 4),))
    with pytest.raises(TraceError, match="takes 1 inputs"):
        trace(nn.Linear(4, 4), (torch.randn(2, 4), torch.randn(2, 4)), tracer="fx")


def test_pipe_split_is_a_node_under_plain_torch_tracers():
    m = SplitGPT(n_layer=2, n_embd=32, n_head=4, block_size=16)
    gm = torch.fx.symbolic_trace(m)
    assert sum(is_pipe_split(n) for n in gm.graph.nodes) == 1
    ep = torch.export.export(m, (_idx(),), strict=False)
    assert sum(is_pipe_split(n) for n in ep.module().graph.nodes) == 1


class _WritesFresh(torch.nn.Module):
    """An in-place write of a fresh value (transformers' MoE routing does this), and one
    through a view (which must stay in place)."""

    def forward(self, x):
        y = x * 2
        y.add_(1)
        z = x + 1
        z.view(-1)[::2].mul_(3.0)
        return y * 3 + z


def test_in_place_writes_of_fresh_values_are_traced_out_of_place():
    from fxpipe.partitioner.boundaries import stage_boundaries
    from fxpipe.partitioner.trace import trace

    x = torch.randn(2, 4)
    traced = trace(_WritesFresh(), (x,), "export")
    calls = [n for n in traced.gm.graph.nodes if n.op == "call_function"]
    mutable = [str(n.target) for n in calls if getattr(n.target, "_schema", None) is not None
               and n.target._schema.is_mutable]
    assert mutable == ["aten.mul_.Tensor"]  # the write through a view stays
    torch.testing.assert_close(traced.gm(x)[0] if isinstance(traced.gm(x), tuple)
                               else traced.gm(x), _WritesFresh()(x))
    # a cut between the value and the (former) in-place op is a valid split now
    names = [n.name for n in calls]
    cut = names.index(next(n.name for n in calls if str(n.target) == "aten.add.Tensor"))
    stage_boundaries(traced.gm, {n: (0 if i < cut else 1) for i, n in enumerate(names)}, 2)
