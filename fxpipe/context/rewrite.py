"""A pipeline stage rewritten to run on this rank's share of the sequence
(:mod:`fxpipe.context.analysis` decides, this applies).

Per node: whole inputs indexed by this rank's positions (:func:`~fxpipe.context.collectives.
localize`), split inputs all-gathered (:func:`~fxpipe.context.collectives.gather`), shape
arguments made local, an attention's ``is_causal`` replaced by this rank's mask, a mean over
the sequence scaled by ``1/N``, a mean cross entropy made this rank's share of it
(:func:`loss_share`), an attention the analysis chose to run as ring attention replaced by
:func:`fxpipe.context.ring.ring_attention`. The stage keeps its inputs and outputs (received values arrive split as
the plan's analysis placed them, and leave so), so the executor and every schedule run it
unchanged.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from fxpipe.context import collectives
from fxpipe.context.analysis import ContextSplit, Seq, sdpa_args
from fxpipe.context.layout import causal_mask, positions
from fxpipe.context.ring import ring_attention
from fxpipe.tensor.rewrite import named

aten = torch.ops.aten


def cp_localize(x: torch.Tensor, dim: int, inner: int, seq: int, rank: int, n: int
                ) -> torch.Tensor:
    """This rank's positions of a whole value (graph node of a rewritten stage)."""
    return collectives.localize(x, dim, inner, seq, positions(rank, n, seq, x.device))


def cp_causal_mask(q: torch.Tensor, rank: int, n: int, seq: int) -> torch.Tensor:
    """This rank's causal mask ``[S/n, S]`` on the queries' device, additive in their dtype
    (0 or -inf: the CPU flash kernel takes no boolean mask): a fused kernel's ``is_causal``
    when it is not ``scaled_dot_product_attention`` itself."""
    keep = causal_mask(rank, n, seq, q.device)
    return torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill(
        ~keep, float("-inf"))


def cp_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rank: int, n: int,
                        seq: int, dropout_p: float = 0.0, scale: float | None = None,
                        enable_gqa: bool = False) -> torch.Tensor:
    """Causal attention of this rank's queries (its head chunk, then its tail chunk) against
    the whole keys and values: each chunk reads the keys up to its own end, the last block
    masked lower-right (``torch.nn.attention.bias.causal_lower_right``: no mask is
    materialised, and a flash kernel skips the masked half), so every rank does the same
    work (:mod:`fxpipe.context.layout`)."""
    from torch.nn.attention.bias import causal_lower_right

    h = seq // (2 * n)
    outs = []
    for i, chunk in enumerate((rank, 2 * n - 1 - rank)):
        end = (chunk + 1) * h
        qc = q.narrow(-2, i * h, h)
        outs.append(F.scaled_dot_product_attention(
            qc, k.narrow(-2, 0, end), v.narrow(-2, 0, end),
            attn_mask=causal_lower_right(h, end), dropout_p=dropout_p, scale=scale,
            enable_gqa=enable_gqa))
    return torch.cat(outs, dim=-2)


def loss_share(logits: torch.Tensor, target: torch.Tensor, counted_on: torch.Tensor,
               ignore_index: int, label_smoothing: float, group) -> torch.Tensor:
    """This rank's part of a mean cross entropy: the sum over its rows divided by the number of
    counted targets over the micro-batch (``counted_on``: the whole target, or with ``group``
    this rank's targets, whose count is all-reduced)."""
    total = F.cross_entropy(logits, target, ignore_index=ignore_index, reduction="sum",
                            label_smoothing=label_smoothing)
    count = (counted_on != ignore_index).sum()
    if group is not None:
        count = collectives.global_count(count, group)
    return total / count.to(total.dtype)


def rewrite_stage(gm: fx.GraphModule, split: ContextSplit, rank: int, group) -> fx.GraphModule:
    """``gm`` rewritten in place for rank ``rank`` of the context group ``group`` (module
    doc); returns it."""
    g, n, seq = gm.graph, split.n, split.seq
    made: dict = {}
    # graph targets bound to the group (a process group is not a graph constant)
    gather = named(lambda x, dim, inner: collectives.gather(x, dim, inner, n, seq, group),
                   "cp_gather")
    share = named(lambda x, t, counted, ignore, smoothing: loss_share(
        x, t, counted, ignore, smoothing, group), "cp_loss_share")
    ring = named(lambda q, k, v, mask, scale, causal: ring_attention(
        q, k, v, mask, rank, n, seq, scale, causal, group), "cp_ring_attention")

    def converted(node: fx.Node, a: fx.Node, how: str, s: Seq) -> fx.Node:
        key = (how, a.name, s)
        if key not in made:
            with g.inserting_before(node):
                if how == "localize":
                    made[key] = g.call_function(cp_localize, (a, s.dim, s.inner, seq, rank, n))
                else:
                    made[key] = g.call_function(gather, (a, s.dim, s.inner))
        return made[key]

    for node in list(g.nodes):
        ns = split.nodes.get(node.name)
        if ns is None or node.op != "call_function":
            continue
        swap: dict[fx.Node, fx.Node] = {}
        for how, edges in (("localize", ns.localize), ("gather", ns.gather)):
            for name, s in edges.items():
                a = next(x for x in node.all_input_nodes if x.name == name)
                swap[a] = converted(node, a, how, s)
        whole_target = None
        if ns.loss_count == "whole":
            whole_target = node.args[1]
        if swap:
            node.args = fx.node.map_arg(node.args, lambda x: swap.get(x, x))
            node.kwargs = fx.node.map_arg(node.kwargs, lambda x: swap.get(x, x))
        if ns.shape is not None:
            args = list(node.args)
            args[2 if node.target is aten.unflatten.int else 1] = ns.shape
            node.args = tuple(args)
        if ns.ring:
            kw = sdpa_args(node)
            node.target = ring
            node.args = (kw["query"], kw["key"], kw["value"], kw.get("attn_mask"),
                         kw.get("scale"), bool(kw.get("is_causal")))
            node.kwargs = {}
        elif ns.causal and node.target is aten.scaled_dot_product_attention.default:
            kw = sdpa_args(node)
            node.target = cp_causal_attention
            node.args = (kw["query"], kw["key"], kw["value"], rank, n, seq)
            node.kwargs = {"dropout_p": kw.get("dropout_p", 0.0), "scale": kw.get("scale"),
                           "enable_gqa": kw.get("enable_gqa", False)}
        elif ns.causal:
            kw = sdpa_args(node)
            if "mask" not in made:  # one mask for the stage's attention layers
                with g.inserting_before(node):
                    made["mask"] = g.call_function(cp_causal_mask, (kw["query"], rank, n, seq))
            kw["attn_mask"] = made["mask"]
            kw["is_causal"] = False
            node.args, node.kwargs = (), kw
        if ns.loss_count is not None:
            args = list(node.args) + [None] * (6 - len(node.args))
            ignore = args[4] if args[4] is not None else node.kwargs.get("ignore_index", -100)
            smoothing = args[5] if args[5] is not None else node.kwargs.get(
                "label_smoothing", 0.0)
            local_target = args[1]
            with g.inserting_after(node):
                fn = loss_share if ns.loss_count == "whole" else share
                extra = (None,) if ns.loss_count == "whole" else ()
                out = g.call_function(fn, (
                    args[0], local_target, whole_target if whole_target is not None
                    else local_target, ignore, smoothing, *extra))
            node.replace_all_uses_with(out)
            g.erase_node(node)
            continue
        if ns.scale is not None:
            with g.inserting_after(node):
                scaled = g.call_function(aten.mul.Tensor, (node, ns.scale))
            node.replace_all_uses_with(scaled, delete_user_cb=lambda u: u is not scaled)
    g.lint()
    gm.recompile()
    return gm
