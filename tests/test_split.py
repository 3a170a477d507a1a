"""Tests for fxpipe.partitioner.split: stage boundaries and stage GraphModules."""

from __future__ import annotations

import operator
import time

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.passes.shape_prop import ShapeProp

from fxpipe.errors import PlanError, SplitError
from fxpipe.examples.cnn import SkipCNN
from fxpipe.examples.gpt import CharGPT
from fxpipe.partitioner.boundaries import compute_nodes, stage_boundaries
from fxpipe.partitioner.split import build_stage_module, split_graph
from fxpipe.plans.values import MODEL_INPUT

try:
    from tolerances import bound
except ImportError:  # tests/ collected as a package
    from tests.tolerances import bound

torch.set_num_threads(1)

#: a split graph runs the same ops on the same shapes as the whole one; only the sums of a
#: value's gradient over its consumer stages and of a tied weight's over its holders change
#: order: at most this many terms (4 stages, each adding one)
TERMS = 4


# ------------------------------------------------------------------------------------- helpers
def assert_near(got: torch.Tensor, want: torch.Tensor) -> None:
    """``got == want`` up to float32 rounding of sums of :data:`TERMS` terms reordered
    (tests/tolerances.py)."""
    scale = float(want.detach().abs().max()) if want.numel() else 0.0
    torch.testing.assert_close(got, want, rtol=0, atol=bound(scale, TERMS))


def _is_tensor_value(node: fx.Node) -> bool:
    if isinstance(node.meta.get("val"), torch.Tensor):
        return True
    tm = node.meta.get("tensor_meta")
    return tm is not None and hasattr(tm, "dtype")


def contiguous_assignment(gm: fx.GraphModule, k: int) -> dict[str, int]:
    """Assign compute nodes to k contiguous stages of about equal node count, cutting only where
    nothing but tensors crosses (a tuple and its getitems, or a Python int, stay together)."""
    names = compute_nodes(gm)
    by_name = {n.name: n for n in gm.graph.nodes}
    pos = {name: i for i, name in enumerate(names)}
    last_read = {}
    for name in names:
        users = [pos[u.name] for u in by_name[name].users if u.name in pos]
        last_read[name] = max(users, default=pos[name])
    valid = [i for i in range(len(names) - 1)
             if all(_is_tensor_value(by_name[v]) for v in names[:i + 1] if last_read[v] > i)]
    cuts: list[int] = []
    for j in range(1, k):
        target = len(names) * j // k - 1
        choices = [c for c in valid if c not in cuts and (not cuts or c > cuts[-1])]
        assert choices, "not enough valid cut points for this many stages"
        cuts.append(min(choices, key=lambda c: abs(c - target)))
    stage, out = 0, {}
    for i, name in enumerate(names):
        out[name] = stage
        if stage < len(cuts) and i == cuts[stage]:
            stage += 1
    return out


def run_chained(b, mods, args):
    """Run stage modules in sequence on a dict of produced values (autograd flows through)."""
    env = dict(zip(b.model_inputs, args))
    for sb, mod in zip(b.stages, mods):
        outs = mod(*[env[n] for n in sb.inputs])
        assert isinstance(outs, tuple) and len(outs) == len(sb.outputs)
        env.update(zip(sb.outputs, outs))
    return [env[n] for n in b.model_outputs]


def run_pipelined_backward(b, mods, args):
    """Like a pipeline runtime: every stage gets detached received values, the backward pass runs
    stage by stage in reverse, and a value's gradient is summed over all its consumer stages."""
    env = dict(zip(b.model_inputs, args))
    received, produced = [], []
    for sb, mod in zip(b.stages, mods):
        ins = []
        for n in sb.inputs:
            v = env[n]
            if b.values[n].producer != MODEL_INPUT and b.values[n].requires_grad:
                v = v.detach().requires_grad_(True)
            ins.append(v)
        outs = mod(*ins)
        env.update(zip(sb.outputs, outs))
        received.append(ins)
        produced.append(outs)
    grads = {n: torch.ones_like(env[n]) for n in b.model_outputs}
    for s in reversed(range(b.num_stages)):
        sb = b.stages[s]
        pairs = [(t, grads[n]) for n, t in zip(sb.outputs, produced[s])
                 if n in grads and t.requires_grad]
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        for n, t in zip(sb.inputs, received[s]):
            if t.requires_grad and t.grad is not None and b.values[n].producer != MODEL_INPUT:
                grads[n] = grads[n] + t.grad if n in grads else t.grad
    return [env[n] for n in b.model_outputs]


def reference(model, args):
    """Eager outputs (flattened) and parameter gradients of sum(outputs)."""
    model.zero_grad(set_to_none=True)
    out = model(*args)
    outs = list(out) if isinstance(out, tuple) else [out]
    sum(o.sum() for o in outs).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return [o.detach() for o in outs], grads


def grads_of(model):
    g = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return g


class MultiIO(nn.Module):
    """Two inputs (the second read only at the end), BatchNorm buffers, an extra registered buffer,
    a tensor constant created in forward, a split into a tuple, and a tuple output."""

    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(6, 6)
        self.bn = nn.BatchNorm1d(6)
        self.l2 = nn.Linear(2, 6)
        self.l3 = nn.Linear(6, 6)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 6))

    def forward(self, x, y):
        c = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
        h = self.bn(self.l1(x)) * self.scale + c
        a, b, _ = h.split(2, dim=1)
        h = torch.tanh(self.l2(a * b)) + h
        h = F.gelu(self.l3(h))
        return h + y, h.sum()


class TiedTiny(nn.Module):
    """Embedding and head share one weight; traced with symbolic_trace (call_module nodes)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.lin = nn.Linear(8, 8)
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(torch.relu(self.lin(self.emb(idx))))


def _export(model, args):
    return torch.export.export(model, args, strict=False).module()


# ------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    model = CharGPT(n_layer=4, n_head=4, n_embd=32, block_size=16)
    args = (torch.randint(0, 256, (2, 16)),)
    return model, args, _export(model, args)


@pytest.fixture(scope="module")
def cnn():
    torch.manual_seed(1)
    model = SkipCNN()
    args = (torch.randn(2, 1, 8, 8),)
    return model, args, _export(model, args)


@pytest.fixture(scope="module")
def multi():
    torch.manual_seed(2)
    model = MultiIO()
    args = (torch.randn(5, 6), torch.randn(5, 6))
    return model, args, _export(model, args)


# --------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_gpt_stages_reproduce_output_and_gradients(gpt, k):
    model, args, gm = gpt
    ref_out, ref_grads = reference(model, args)
    b, mods = split_graph(gm, contiguous_assignment(gm, k), k)
    assert len(mods) == k and b.num_stages == k

    out = run_chained(b, mods, args)
    assert len(out) == 1 and torch.equal(out[0], ref_out[0])
    out[0].sum().backward()
    got = grads_of(model)
    assert set(got) == set(ref_grads)  # every parameter, incl. the tied head/wte weight
    for name, g in ref_grads.items():
        assert_near(got[name], g)

    out = run_pipelined_backward(b, mods, args)
    assert_near(out[0], ref_out[0])
    got = grads_of(model)
    for name, g in ref_grads.items():
        assert_near(got[name], g)


def test_gpt_parameters_keep_original_fqns_and_objects(gpt):
    model, args, gm = gpt
    b, mods = split_graph(gm, contiguous_assignment(gm, 4), 4)
    seen = set()
    for sb, mod in zip(b.stages, mods):
        params = dict(mod.named_parameters())
        assert set(params) == set(sb.params) and params, sb.index
        for fqn, p in params.items():
            assert p is model.get_parameter(fqn)  # same Parameter object, original FQN
            assert sb.state_fqns[fqn] == fqn
        seen |= set(params)
        # parameters live in the stage: never passed in as inputs
        assert all(name in b.values for name in sb.inputs)
        assert not set(sb.inputs) & {n.name for n in gm.graph.nodes if n.op == "get_attr"}
    assert seen == {n for n, _ in model.named_parameters()} - {"wte.weight"} | {"head.weight"}
    # tied weight: one canonical FQN, present in the first and last stage as the same object
    assert b.param_aliases == {"wte.weight": "head.weight"}
    assert b.shared_params == {"head.weight": [0, 3]}
    assert mods[0].get_parameter("head.weight") is mods[3].get_parameter("head.weight")
    assert "h.0.fc.weight" in b.stages[0].params or "h.0.fc.weight" in b.stages[1].params
    assert b.unused_params == []


def test_gpt_boundary_values_and_guards(gpt):
    model, args, gm = gpt
    assert any(n.target == "_guards_fn" for n in gm.graph.nodes)  # export adds it
    node_stage = contiguous_assignment(gm, 3)
    node_stage["_guards_fn"] = 0  # tolerated and dropped
    b = stage_boundaries(gm, node_stage, 3)
    assert all("_guards_fn" not in sb.nodes for sb in b.stages)
    assert b.model_inputs == ["idx"]
    idx = b.values["idx"]
    assert (idx.producer, idx.consumers, idx.shape, idx.dtype, idx.nbytes) == (
        MODEL_INPUT, [0], [2, 16], "int64", 2 * 16 * 8)
    assert b.stages[0].inputs == ["idx"]
    for s, sb in enumerate(b.stages):
        for name in sb.outputs:
            v = b.values[name]
            assert v.producer == s
            assert v.consumers or name in b.model_outputs
            for c in v.consumers:
                assert name in b.stages[c].inputs
        for name in sb.inputs:
            assert s in b.values[name].consumers
    # the residual stream crosses each cut as one float32 [2, 16, 32] activation
    cross = b.values[b.stages[1].inputs[0]]
    assert (cross.shape, cross.dtype, cross.nbytes) == ([2, 16, 32], "float32", 2 * 16 * 32 * 4)
    out = b.model_outputs[0]
    assert out in b.stages[2].outputs and b.values[out].shape == [2, 16, 256]
    order = compute_nodes(gm)
    assert sum((sb.nodes for sb in b.stages), []) == order


@pytest.mark.parametrize("k", [2, 3, 4])
def test_cnn_long_skip_goes_directly_to_last_stage(cnn, k):
    model, args, gm = cnn
    ref_out, ref_grads = reference(model, args)
    node_stage = contiguous_assignment(gm, k)
    b, mods = split_graph(gm, node_stage, k)
    cat = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.cat.default)
    assert node_stage[cat.name] == k - 1
    skip = cat.args[0][1]  # relu(stem(x)), concatenated with the body's output
    v = b.values[skip.name]
    assert v.producer == 0 and v.consumers[-1] == k - 1
    assert skip.name in b.stages[0].outputs and skip.name in b.stages[k - 1].inputs
    for mid in range(1, k - 1):  # sent directly, not relayed through the middle stages
        assert skip.name not in b.stages[mid].outputs
    assert v.shape == [2, 8, 8, 8] and v.nbytes == 2 * 8 * 8 * 8 * 4

    out = run_pipelined_backward(b, mods, args)
    assert_near(out[0], ref_out[0])
    got = grads_of(model)
    assert set(got) == set(ref_grads)
    for name, g in ref_grads.items():
        assert_near(got[name], g)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_multi_input_output_buffers_and_constants(multi, k):
    model, args, gm = multi
    # training-mode BatchNorm: outputs use batch statistics; running stats update in place
    ref_out, ref_grads = reference(model, args)
    b, mods = split_graph(gm, contiguous_assignment(gm, k), k)
    assert b.model_inputs == ["x", "y"] and len(b.model_outputs) == 2
    y = b.values["y"]
    assert y.producer == MODEL_INPUT and y.consumers == [k - 1]
    for name in b.model_outputs:
        assert name in b.stages[b.values[name].producer].outputs
    bufs = {fqn: mod.get_buffer(fqn) for sb, mod in zip(b.stages, mods) for fqn in sb.buffers}
    assert {"scale", "bn.running_mean", "bn.running_var"} <= set(bufs)
    for fqn, t in bufs.items():
        assert t is model.get_buffer(fqn)
    consts = [c for sb in b.stages for c in sb.constants]
    assert consts and all(c not in dict(gm.named_buffers()) for c in consts)
    out = run_pipelined_backward(b, mods, args)
    for o, r in zip(out, ref_out):
        assert_near(o, r)
    got = grads_of(model)
    assert set(got) == set(ref_grads)
    for name, g in ref_grads.items():
        assert_near(got[name], g)


def test_tuple_separated_from_getitem_raises(gpt):
    _, _, gm = gpt
    names = compute_nodes(gm)
    split = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.split.Tensor)
    getitems = [u for u in split.users if u.target is operator.getitem]
    cut = names.index(split.name)  # split in stage 0, its getitems in stage 1
    node_stage = {n: 0 if i <= cut else 1 for i, n in enumerate(names)}
    assert all(node_stage[g.name] == 1 for g in getitems)
    with pytest.raises(ValueError, match=rf"tuple-valued node '{split.name}'"):
        stage_boundaries(gm, node_stage, 2)
    with pytest.raises(SplitError, match="same stage"):
        split_graph(gm, node_stage, 2)


def test_bad_assignments_raise(gpt):
    _, _, gm = gpt
    good = contiguous_assignment(gm, 2)
    names = compute_nodes(gm)
    missing = dict(good)
    del missing[names[5]]
    with pytest.raises(SplitError, match="misses 1 compute node"):
        stage_boundaries(gm, missing, 2)
    with pytest.raises(SplitError, match="not compute nodes"):
        stage_boundaries(gm, {**good, "head_weight": 0}, 2)
    with pytest.raises(SplitError, match="outside 0..1"):
        stage_boundaries(gm, {**good, names[0]: 2}, 2)
    with pytest.raises(SplitError, match=r"stage\(s\) \[2\] have no nodes"):
        stage_boundaries(gm, good, 3)
    backwards = {n: 1 - s for n, s in good.items()}  # consumers before producers
    with pytest.raises(SplitError, match="later stage"):
        stage_boundaries(gm, backwards, 2)
    assert issubclass(SplitError, PlanError) and issubclass(SplitError, ValueError)


def test_symbolic_trace_needs_shape_propagation_then_matches():
    torch.manual_seed(3)
    model = SkipCNN(depth=2)
    args = (torch.randn(2, 1, 8, 8),)
    gm = fx.symbolic_trace(model)
    assert any(n.op == "call_module" for n in gm.graph.nodes)
    node_stage = {n: 0 if i < 3 else 1 for i, n in enumerate(compute_nodes(gm))}
    with pytest.raises(SplitError, match="ShapeProp"):
        stage_boundaries(gm, node_stage, 2)
    ShapeProp(gm).propagate(*args)
    ref_out, ref_grads = reference(model, args)
    for k in (2, 3):
        b, mods = split_graph(gm, contiguous_assignment(gm, k), k)
        for sb, mod in zip(b.stages, mods):
            for fqn, p in mod.named_parameters():
                assert p is model.get_parameter(fqn) and fqn in sb.params
        out = run_pipelined_backward(b, mods, args)
        assert_near(out[0], ref_out[0])
        got = grads_of(model)
        for name, g in ref_grads.items():
            assert_near(got[name], g)


def test_symbolic_trace_tied_module_maps_alias_to_canonical():
    torch.manual_seed(4)
    model = TiedTiny()
    args = (torch.randint(0, 11, (3, 5)),)
    gm = fx.symbolic_trace(model)
    ShapeProp(gm).propagate(*args)
    node_stage = {n: 0 if i < 2 else 1 for i, n in enumerate(compute_nodes(gm))}
    b, mods = split_graph(gm, node_stage, 2)
    assert b.stages[0].state_fqns["emb.weight"] == "emb.weight"
    assert b.stages[1].state_fqns["head.weight"] == "emb.weight"  # alias -> canonical
    assert b.shared_params == {"emb.weight": [0, 1]}
    assert b.param_aliases == {"head.weight": "emb.weight"}
    assert mods[1].get_parameter("head.weight") is mods[0].get_parameter("emb.weight")
    ref_out, ref_grads = reference(model, args)
    out = run_pipelined_backward(b, mods, args)
    assert_near(out[0], ref_out[0])
    got = grads_of(model)
    assert_near(got["emb.weight"], ref_grads["emb.weight"])


class _IntCross(nn.Module):
    def forward(self, x):
        y = x * 2
        n = y.size(1)
        return (y + 1).reshape(-1, n)


class _InPlace(nn.Module):
    def forward(self, x):
        y = x * 2
        y.add_(1)
        return y * 3


def test_non_tensor_and_in_place_crossings_raise():
    args = (torch.randn(2, 3),)
    gm = fx.symbolic_trace(_IntCross())
    ShapeProp(gm).propagate(*args)
    names = compute_nodes(gm)  # mul, size, add, reshape
    with pytest.raises(SplitError, match="'size'.* is not a tensor"):
        stage_boundaries(gm, {names[0]: 0, names[1]: 0, names[2]: 1, names[3]: 1}, 2)
    b, mods = split_graph(gm, {names[0]: 0, names[1]: 1, names[2]: 1, names[3]: 1}, 2)
    torch.testing.assert_close(run_chained(b, mods, args)[0], _IntCross()(*args))

    gm = fx.symbolic_trace(_InPlace())
    ShapeProp(gm).propagate(*args)
    names = compute_nodes(gm)  # mul, add_, mul_1
    with pytest.raises(SplitError, match="in place"):
        stage_boundaries(gm, {names[0]: 0, names[1]: 1, names[2]: 1}, 2)


def test_build_stage_module_rejects_foreign_graph(gpt, cnn):
    _, _, gm = gpt
    b = stage_boundaries(gm, contiguous_assignment(gm, 2), 2)
    with pytest.raises(SplitError, match="same GraphModule"):
        build_stage_module(cnn[2], b, 1)
    with pytest.raises(SplitError, match="outside"):
        build_stage_module(gm, b, 2)


def test_split_gpt_into_four_stages_is_fast(gpt):
    _, _, gm = gpt
    node_stage = contiguous_assignment(gm, 4)
    split_graph(gm, node_stage, 4)  # warm-up (imports, code caches)
    # CPU time of this process: a speed bound that other load on the machine cannot break
    t0 = time.process_time()
    split_graph(gm, node_stage, 4)
    elapsed = time.process_time() - t0
    assert elapsed < 1.0, f"split took {elapsed:.3f} s"
