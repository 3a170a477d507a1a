"""Weight gradients accumulated in place: ``linear``, ``addmm`` and ``embedding`` of a parameter.

A pipeline step runs the backward of ``m`` micro-batches, and autograd accumulates each weight
gradient into ``.grad`` as a fresh tensor: for a ``[vocab, width]`` head or embedding that is a
new ``vocab x width`` buffer per micro-batch (an embedding's is a dense zero-fill too, for the
few rows its tokens touch), then a read-add-write of ``.grad``. On a CPU with a 50k vocabulary
that traffic is a fifth of the head's backward and most of the embedding's.

:func:`fuse_weight_grads` rewrites a stage's GraphModule so that these ops compute the weight
gradient straight into ``.grad`` (``grad.addmm_(g.T, x)``, ``grad.index_add_(0, ids, g)``; the
first micro-batch of a step creates ``.grad``), which Megatron-LM calls gradient-accumulation
fusion. Input and bias gradients flow through autograd as before, so the numbers equal
autograd's up to the order of the floating-point additions.

It applies only where the result is the same as autograd's: fp32 stages without autocast (the
gradient's dtype is the parameter's), a full backward (a split B/W backward computes the weight
gradient separately), parameters that require gradients and have no gradient hooks (a hook
runs on autograd's path: a parameter with one, also one registered after the rewrite, has its
gradient handed to autograd), ``embedding`` without
``scale_grad_by_freq`` or sparse gradients, ``addmm`` with ``beta = alpha = 1``. Where
``.grad`` cannot take the result in place (another dtype, layout or a sparse ``.grad``) the
gradient is handed back to autograd instead.
"""

from __future__ import annotations

import copy

import torch
import torch.fx as fx
import torch.nn as nn

from fxpipe.execution.rebuild import rebuilt

__all__ = ["fuse_weight_grads", "fused_linear", "fused_addmm", "fused_embedding"]

_aten = torch.ops.aten


def _accumulate(p: torch.Tensor, make, add) -> torch.Tensor | None:
    """Put a weight gradient into ``p.grad``: ``make()`` (a new tensor) when there is none, else
    ``add(p.grad)`` in place. Returns None, or the gradient for autograd where ``p.grad``
    cannot take it in place."""
    if getattr(p, "_backward_hooks", None):  # a hook registered since: autograd's path runs it
        return make()
    g = p.grad
    if g is None:
        p.grad = make()
        return None
    if g.is_sparse or g.dtype != p.dtype or g.shape != p.shape or not g.is_contiguous():
        return make()
    with torch.no_grad():
        add(g)
    return None


class _LinearFn(torch.autograd.Function):
    """``linear(x, weight, bias)`` with the weight gradient accumulated in place."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.param, ctx.has_bias = weight, bias is not None
        return _aten.linear.default(x, weight, bias)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        gx = g.matmul(weight) if ctx.needs_input_grad[0] else None
        g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        gw = None
        if ctx.needs_input_grad[1]:
            gw = _accumulate(ctx.param, lambda: g2.t().mm(x2),
                             lambda acc: acc.addmm_(g2.t(), x2))
        gb = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb


class _AddmmFn(torch.autograd.Function):
    """``addmm(bias, x, weight)`` (``bias + x @ weight``, e.g. GPT-2's ``Conv1D``) with the
    weight gradient accumulated in place."""

    @staticmethod
    def forward(ctx, bias, x, weight):
        ctx.save_for_backward(x, weight)
        ctx.param, ctx.bias_shape = weight, bias.shape
        return _aten.addmm.default(bias, x, weight)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        gb = g.sum_to_size(ctx.bias_shape) if ctx.needs_input_grad[0] else None
        gx = g.mm(weight.t()) if ctx.needs_input_grad[1] else None
        gw = None
        if ctx.needs_input_grad[2]:
            gw = _accumulate(ctx.param, lambda: x.t().mm(g), lambda acc: acc.addmm_(x.t(), g))
        return gb, gx, gw


class _EmbeddingFn(torch.autograd.Function):
    """``embedding(weight, ids, padding_idx)`` with the weight gradient added in place to the
    rows the ids name (none to ``padding_idx``'s row), instead of a dense zero-filled buffer per
    micro-batch."""

    @staticmethod
    def forward(ctx, weight, ids, padding_idx):
        ctx.save_for_backward(ids)
        ctx.param, ctx.padding_idx = weight, padding_idx
        return _aten.embedding.default(weight, ids, padding_idx)

    @staticmethod
    def backward(ctx, g):
        (ids,) = ctx.saved_tensors
        flat, rows = ids.reshape(-1), g.reshape(-1, g.shape[-1])
        if ctx.padding_idx >= 0:
            keep = flat != ctx.padding_idx
            flat, rows = flat[keep], rows[keep]
        p = ctx.param

        def make():
            return torch.zeros_like(p).index_add_(0, flat, rows)

        gw = _accumulate(p, make, lambda acc: acc.index_add_(0, flat, rows))
        return gw, None, None


def fused_linear(x, weight, bias=None):
    """Drop-in for ``aten.linear.default`` (see the module doc)."""
    return _LinearFn.apply(x, weight, bias)


def fused_addmm(bias, x, weight):
    """Drop-in for ``aten.addmm.default`` with ``beta = alpha = 1``."""
    return _AddmmFn.apply(bias, x, weight)


def fused_embedding(weight, ids, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    """Drop-in for ``aten.embedding.default`` without ``scale_grad_by_freq`` / ``sparse``."""
    if scale_grad_by_freq or sparse:
        return _aten.embedding.default(weight, ids, padding_idx, scale_grad_by_freq, sparse)
    return _EmbeddingFn.apply(weight, ids, padding_idx)


def _trained_param(gm: fx.GraphModule, node) -> bool:
    """``node`` is a ``get_attr`` of a parameter that requires gradients."""
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return False
    try:
        obj = gm.get_parameter(str(node.target))
    except AttributeError:  # a buffer or a constant
        return False
    if not (obj.requires_grad and obj.dtype.is_floating_point):
        return False
    # a gradient hook (register_hook, register_post_accumulate_grad_hook) runs on autograd's
    # path only: such a parameter keeps it
    return not (getattr(obj, "_backward_hooks", None)
                or getattr(obj, "_post_accumulate_grad_hooks", None))


def _rewrite(gm: fx.GraphModule, n: fx.Node):
    """The fused function for node ``n``, or None where it does not apply."""
    a = n.args
    if n.target is _aten.linear.default and len(a) >= 2 and not n.kwargs:
        return fused_linear if _trained_param(gm, a[1]) else None
    if n.target is _aten.addmm.default and len(a) == 3 and not n.kwargs:
        return fused_addmm if _trained_param(gm, a[2]) else None
    if n.target is _aten.embedding.default and len(a) >= 2 and not n.kwargs:
        flags = list(a[3:5])
        if any(flags):
            return None
        return fused_embedding if _trained_param(gm, a[0]) else None
    return None


def fuse_weight_grads(module: nn.Module) -> tuple[nn.Module, int]:
    """A copy of ``module`` (a stage GraphModule sharing its parameters, buffers and
    submodules; anything else is returned as it is) whose ``linear`` / ``addmm`` /
    ``embedding`` nodes of trained parameters accumulate their weight gradients into ``.grad``
    directly, and how many nodes were rewritten (0: ``module`` itself is returned).

    ``module`` is left unchanged, so it can still run a split B/W backward or under autocast
    elsewhere; use the copy only for a full backward in the parameters' dtype.
    """
    if not isinstance(module, fx.GraphModule):
        return module, 0
    fns = {n.name: _rewrite(module, n) for n in module.graph.nodes if n.op == "call_function"}
    if not any(fns.values()):
        return module, 0
    graph = fx.Graph()
    graph._codegen = copy.deepcopy(module.graph._codegen)  # the same calling convention
    out = graph.graph_copy(module.graph, {})
    graph.output(out)
    count = 0
    for n in graph.nodes:
        fn = fns.get(n.name)
        if fn is not None and n.op == "call_function":
            n.target = fn
            count += 1
    fused = rebuilt(module, graph, class_name=type(module).__name__)
    fused.meta = dict(getattr(module, "meta", {}))
    return fused, count
