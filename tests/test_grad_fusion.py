"""Weight gradients accumulated in place (fxpipe.execution.grad_fusion): the fused copy of a
stage GraphModule gives autograd's gradients, over several accumulated backwards, and leaves the
original module alone."""

import copy

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from fxpipe.execution.grad_fusion import (fuse_weight_grads, fused_addmm, fused_embedding,
                                          fused_linear)
from fxpipe.partitioner.trace import trace

try:
    from tolerances import bound
except ImportError:  # tests/ collected as a package
    from tests.tolerances import bound

#: the fused copy and autograd add the same per-token terms in another order: float32 rounding
#: over at most 3 batches x 2 x 9 tokens (tests/tolerances.py), relative to the gradient's size
REL = bound(1.0, 3 * 2 * 9)

FUSED = {fused_linear, fused_addmm, fused_embedding}


class Mixed(nn.Module):
    """Embedding with a padding row, Linear on 3-D input, ``addmm`` of a parameter (GPT-2's
    Conv1D), a bias-free head tied to nothing, and a head tied to the embedding."""

    def __init__(self, vocab=40, width=12, tie=False):
        super().__init__()
        self.emb = nn.Embedding(vocab, width, padding_idx=3)
        self.fc = nn.Linear(width, width)
        self.w = nn.Parameter(torch.randn(width, width) * 0.3)
        self.b = nn.Parameter(torch.randn(width) * 0.1)
        self.head = nn.Linear(width, vocab, bias=False)
        if tie:
            self.head.weight = self.emb.weight

    def forward(self, ids):
        x = torch.tanh(self.fc(self.emb(ids)))
        x = torch.addmm(self.b, x.reshape(-1, x.shape[-1]), self.w).reshape(x.shape)
        return self.head(x)


def _stage(model, ids):
    return trace(model, (ids,)).gm


def _grads(gm, batches, start=None):
    for p in gm.parameters():
        p.grad = None if start is None else start[id(p)].clone()
    for ids, y in batches:
        F.cross_entropy(gm(ids).flatten(0, 1), y.flatten()).backward()
    return {n: p.grad.clone() for n, p in gm.named_parameters()}


def _batches(vocab, n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 8, (2, 9), generator=g)  # few ids: repeated rows
        ids[0, :3] = 3  # the padding row
        out.append((ids, torch.randint(0, vocab, (2, 9), generator=g)))
    return out


@pytest.mark.parametrize("tie", [False, True])
def test_fused_copy_gives_autograds_gradients(tie):
    torch.manual_seed(0)
    model = Mixed(tie=tie)
    batches = _batches(40)
    gm = _stage(model, batches[0][0])
    ref = _grads(gm, batches)
    fused, count = fuse_weight_grads(gm)
    assert count == 4  # emb, fc, addmm, head (tied or not)
    assert {n.target for n in fused.graph.nodes} & FUSED
    assert not {n.target for n in gm.graph.nodes} & FUSED, "the given module must not change"
    assert {id(p) for p in fused.parameters()} == {id(p) for p in gm.parameters()}
    got = _grads(fused, batches)
    assert set(got) == set(ref)
    for name, g in ref.items():
        err = (got[name] - g).abs().max().item() / max(g.abs().max().item(), 1e-12)
        assert err < REL, (name, err)
    emb = dict(fused.named_parameters())["emb.weight"]
    if not tie:
        assert emb.grad[3].abs().max() == 0, "no gradient into the padding row"
    # gradients already in .grad (accumulation over steps) are added to, as autograd does
    start = {id(p): torch.randn_like(p) for p in gm.parameters()}
    ref2, got2 = _grads(gm, batches, start), _grads(fused, batches, start)
    for name, g in ref2.items():
        assert torch.allclose(got2[name], g, rtol=REL, atol=REL), name


@pytest.mark.filterwarnings("ignore:grad and param do not obey")
def test_grad_that_cannot_take_it_in_place_goes_through_autograd():
    torch.manual_seed(1)
    model = Mixed()
    batches = _batches(40, n=2)
    gm = _stage(model, batches[0][0])
    fused, _ = fuse_weight_grads(gm)
    ref = _grads(gm, batches)
    for p in fused.parameters():  # a transposed (non-contiguous) .grad of the right shape
        p.grad = torch.zeros(tuple(reversed(p.shape))).t() if p.dim() == 2 else None
    for ids, y in batches:
        F.cross_entropy(fused(ids).flatten(0, 1), y.flatten()).backward()
    for name, p in fused.named_parameters():
        assert torch.allclose(p.grad, ref[name], rtol=REL, atol=REL), name


def test_what_is_not_fused():
    torch.manual_seed(2)
    model = Mixed()
    model.fc.weight.requires_grad_(False)  # frozen: autograd gives it no gradient at all
    ids = torch.randint(0, 40, (2, 5))
    gm = _stage(model, ids)
    fused, count = fuse_weight_grads(gm)
    assert count == 3
    fused(ids).sum().backward()
    assert dict(fused.named_parameters())["fc.weight"].grad is None

    class FreqEmb(nn.Module):
        def __init__(self):
            super().__init__()
            self.e = nn.Embedding(10, 4, scale_grad_by_freq=True)

        def forward(self, i):
            return self.e(i)

    # a parameter with a gradient hook keeps autograd's path, so the hook still runs
    model3 = Mixed()
    seen = []
    model3.head.weight.register_hook(lambda g: seen.append("hook"))
    model3.fc.weight.register_post_accumulate_grad_hook(lambda p: seen.append("post"))
    gm3 = _stage(model3, ids)
    fused3, count3 = fuse_weight_grads(gm3)
    assert count3 == 2  # emb and the addmm only
    fused3(ids).sum().backward()
    assert sorted(seen) == ["hook", "post"]

    # a hook registered after the rewrite: the gradient goes through autograd, the hook sees it
    model4 = Mixed()
    gm4 = _stage(model4, ids)
    fused4, _ = fuse_weight_grads(gm4)
    got = []
    model4.head.weight.register_hook(lambda g: got.append(g.clone()) or g * 0.5)
    ref4 = copy.deepcopy(model4)
    ref_seen = []
    ref4.head.weight.register_hook(lambda g: ref_seen.append(1) or g * 0.5)
    for _ in range(2):
        fused4(ids).sum().backward()
        ref4(ids).sum().backward()
    assert len(got) == 2 and all(g is not None for g in got) and len(ref_seen) == 2
    assert torch.allclose(model4.head.weight.grad, ref4.head.weight.grad, rtol=REL, atol=REL)

    gm2 = _stage(FreqEmb(), torch.randint(0, 10, (3,)))
    assert fuse_weight_grads(gm2) == (gm2, 0)
    plain = nn.Linear(3, 3)
    assert fuse_weight_grads(plain) == (plain, 0), "only GraphModules are rewritten"


def test_fused_copy_keeps_a_stage_modules_calling_convention():
    """A stage module as build_stage_module makes it (positional inputs, tuple out)."""
    torch.manual_seed(3)
    lin = nn.Linear(4, 6)
    g = fx.Graph()
    x = g.placeholder("x")
    w = g.get_attr("lin.weight")
    b = g.get_attr("lin.bias")
    y = g.call_function(torch.ops.aten.linear.default, (x, w, b))
    g.output((y,))
    root = nn.Module()
    root.lin = lin
    gm = fx.GraphModule(root, g)
    fused, count = fuse_weight_grads(gm)
    assert count == 1
    inp = torch.randn(5, 4, requires_grad=True)
    out = fused(inp)
    assert isinstance(out, tuple) and len(out) == 1
    out[0].sum().backward()
    ref_inp = inp.detach().clone().requires_grad_()
    ref = copy.deepcopy(lin)
    ref(ref_inp).sum().backward()
    assert torch.allclose(inp.grad, ref_inp.grad, rtol=REL, atol=REL)
    assert torch.allclose(lin.weight.grad, ref.weight.grad, rtol=REL, atol=REL)
    assert torch.allclose(lin.bias.grad, ref.bias.grad, rtol=REL, atol=REL)
