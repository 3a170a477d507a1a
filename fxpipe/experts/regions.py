"""Expert regions of a traced graph: what an MoE layer computes per expert.

An MoE layer in the static (GShard) form holds its experts' weights as tensors with a leading
expert dimension ``E`` and computes every expert at once on a ``[E, C, ...]`` tensor of token
slots (``C`` the capacity): ``bmm`` with the weights, adds of per-expert biases, element-wise
activations. A **region** is such a run of per-expert ops: its *entries* are the ``[E, C, ...]``
values it reads from outside (the dispatched tokens), its *exits* the ``[E, C, ...]`` values
read outside it (what the combine reads), its *weights* the trained parameters with leading
dimension ``E`` it reads. Every op inside keeps dimension 0 as the expert and dimension 1 as the
slot, so it can run on any subset of the experts and any number of slots: what expert
parallelism needs (:mod:`fxpipe.experts.rewrite`).

:func:`find_regions` walks the graph from each ``bmm`` of an activation by a weight with a leading
expert dimension; :class:`NoExperts` says why a model has none (a model with no MoE layer, or
one written with per-expert loops and data-dependent shapes, which torch.export cannot trace
statically).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

aten = torch.ops.aten

#: ops that act on each expert's slots alone (element-wise, or batched over dimension 0)
_PER_EXPERT = {aten.bmm.default, aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor,
               aten.div.Tensor, aten.gelu.default, aten.relu.default, aten.silu.default,
               aten.sigmoid.default, aten.tanh.default, aten.neg.default, aten.clone.default,
               aten.to.dtype, aten._to_copy.default, aten.dropout.default,
               aten.contiguous.default}


class NoExperts(ValueError):
    """The graph has no expert region (the message says what was looked for)."""


@dataclass
class Region:
    """One MoE layer's per-expert computation (see the module doc).

    Attributes:
        experts: ``E``. slots: ``C`` (the capacity of one forward).
        nodes: the region's nodes, in graph order.
        entries: names of the ``[E, C, ...]`` values read from outside.
        exits: names of the region's values read outside it.
        weights: get_attr targets of the expert weights (leading dimension ``E``).
    """

    experts: int
    slots: int
    nodes: list[str]
    entries: list[str]
    exits: list[str]
    weights: list[str]


def _shape(n) -> tuple[int, ...] | None:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return tuple(int(s) for s in v.shape) if isinstance(v, torch.Tensor) else None


def _weight(gm: fx.GraphModule, n, e: int) -> bool:
    """``n`` reads a trained parameter with leading dimension ``e``."""
    if not isinstance(n, fx.Node) or n.op != "get_attr":
        return False
    try:
        p = gm.get_parameter(n.target)
    except AttributeError:
        return False
    return p.requires_grad and p.dim() >= 2 and p.shape[0] == e


def find_regions(gm: fx.GraphModule) -> list[Region]:
    """The expert regions of ``gm`` (none: an empty list)."""
    seeds = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is aten.bmm.default:
            x, w = n.args[0], n.args[1]
            sx = _shape(x)
            if sx is not None and _weight(gm, w, sx[0]) and not _weight(gm, x, sx[0]):
                seeds.append(n)
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    taken: set[str] = set()
    regions = []
    for seed in seeds:
        if seed.name in taken:
            continue
        e, c = _shape(seed)[:2]
        inside: set[str] = set()

        def fits(n: fx.Node) -> bool:
            s = _shape(n)
            return (n.op == "call_function" and n.target in _PER_EXPERT and s is not None
                    and len(s) >= 2 and s[:2] == (e, c))

        def reads_ok(n: fx.Node) -> bool:
            """Every tensor input is in the region, an expert weight, a [E, C, ...] value from
            outside (an entry) or a scalar."""
            for a in n.all_input_nodes:
                s = _shape(a)
                if a.name in inside or _weight(gm, a, e) or (s is not None and s[:2] == (e, c)):
                    continue
                if s is not None and len(s) == 0:
                    continue
                return False
            return True

        stack = [seed]
        while stack:
            n = stack.pop()
            if n.name in inside or not fits(n) or not reads_ok(n):
                continue
            inside.add(n.name)
            stack.extend(u for u in n.users if u.name not in inside)
        nodes = sorted(inside, key=order.get)
        by_name = {n.name: n for n in gm.graph.nodes}
        entries, exits, weights = [], [], []
        for name in nodes:
            n = by_name[name]
            for a in n.all_input_nodes:
                if a.name in inside:
                    continue
                if _weight(gm, a, e):
                    if a.target not in weights:
                        weights.append(a.target)
                elif _shape(a) is not None and _shape(a)[:2] == (e, c) and a.name not in entries:
                    entries.append(a.name)
            if any(u.name not in inside for u in n.users) and name not in exits:
                exits.append(name)
        if any(by_name[u].target is operator.getitem for u in exits):  # pragma: no cover
            continue
        taken |= inside
        regions.append(Region(e, c, nodes, entries, exits, weights))
    return regions


def require_regions(gm: fx.GraphModule, model_name: str) -> list[Region]:
    """:func:`find_regions`, or :class:`NoExperts` saying what was looked for."""
    regions = find_regions(gm)
    if not regions:
        raise NoExperts(
            f"{model_name} has no expert layer fxpipe can split: expert parallelism looks for "
            "experts held as weights with a leading expert dimension, multiplied with bmm on "
            "the tokens dispatched to them ([experts, capacity, features], the static GShard "
            "form of fxpipe.examples.moe:MoEGPT); a model without mixture-of-experts layers, or "
            "one that loops over its experts with data-dependent shapes, has none "
            "(parallel.expert: 1)")
    return regions
