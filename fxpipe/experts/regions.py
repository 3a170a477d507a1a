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

The **dropless** form (transformers 5's Mixtral, Qwen2-MoE, ...: every token's choices kept, no
capacity) sorts the ``R`` (token, choice) rows by expert and runs each expert's rows through a
grouped matmul (``grouped_mm(rows, weight, offsets)``, ``offsets`` the cumulative rows per
expert; the weight a parameter with leading dimension ``E``, possibly transposed in its last
two dimensions). Its region is the row-wise ops between the sorted rows and the last grouped
matmul's output (gates, activations, element-wise products: each row on its own), with the
shared ``offsets``; how many rows each expert gets depends on the routing, so its all-to-alls
exchange the counts first (:mod:`fxpipe.experts.all_to_all`).

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
        experts: ``E``. slots: ``C`` (the capacity of one forward; the dropless form: ``R``,
            the rows of one forward).
        kind: ``capacity`` (``[E, C, ...]`` slots) or ``dropless`` (rows sorted by expert).
        offsets: the dropless form's offsets node (cumulative rows per expert), else None.
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
    kind: str = "capacity"
    offsets: str | None = None


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


#: row-wise ops a dropless region may hold besides its grouped matmuls
_PER_ROW = {aten.silu.default, aten.gelu.default, aten.relu.default, aten.sigmoid.default,
            aten.tanh.default, aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor,
            aten.div.Tensor, aten.to.dtype, aten._to_copy.default, aten.clone.default,
            aten.contiguous.default, aten.chunk.default, aten.split.Tensor,
            aten._assert_tensor_metadata.default, operator.getitem}


def _grouped_mm(n: fx.Node) -> bool:
    return n.op == "call_function" and "grouped_mm" in str(n.target) \
        and "backward" not in str(n.target) and len(n.args) >= 3


def _weight_view(gm: fx.GraphModule, n, e: int) -> str | None:
    """The get_attr target of the expert weight ``n`` reads (itself, or a transpose of its
    last two dimensions), else None."""
    while isinstance(n, fx.Node) and n.op == "call_function" and n.target in (
            aten.transpose.int, aten.t.default):
        dims = [d % 3 for d in n.args[1:3]] if n.target is aten.transpose.int else [1, 2]
        if 0 in dims:
            return None
        n = n.args[0]
    return n.target if _weight(gm, n, e) else None


def _boundary(nodes: list[fx.Node], inside: set[str], weight_of, skip: set[str] = frozenset(),
              entry_ok=lambda a: True) -> tuple[list[str], list[str], list[str]]:
    """A region's entries (the values it reads from outside that ``entry_ok`` takes, ``skip``
    and weights aside), exits (its values read outside) and weights (``weight_of(node)``: the
    get_attr target of an expert weight the node reads, else None), in graph order."""
    entries, exits, weights = [], [], []
    for n in nodes:
        for a in n.all_input_nodes:
            if a.name in inside or a.name in skip:
                continue
            w = weight_of(a)
            if w is not None:
                if w not in weights:
                    weights.append(w)
            elif entry_ok(a) and a.name not in entries:
                entries.append(a.name)
        if any(u.name not in inside for u in n.users) and n.name not in exits:
            exits.append(n.name)
    return entries, exits, weights


def _dropless_regions(gm: fx.GraphModule, order: dict[str, int],
                      by_name: dict[str, fx.Node]) -> list[Region]:
    """The dropless regions (module doc): grouped matmuls sharing offsets, and the row-wise ops
    between them."""
    out = []
    by_offsets: dict[str, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if _grouped_mm(n) and isinstance(n.args[2], fx.Node):
            sx = _shape(n.args[0])
            so = _shape(n.args[2])
            if sx is None or so is None or len(so) != 1:
                continue
            if _weight_view(gm, n.args[1], so[0]) is not None:
                by_offsets.setdefault(n.args[2].name, []).append(n)
    for offs, mms in by_offsets.items():
        e = _shape(mms[0].args[2])[0]
        rows = _shape(mms[0].args[0])[0]
        weight_nodes: set[str] = set()
        for m in mms:  # the weight and its views
            w = m.args[1]
            while w.op != "get_attr":
                weight_nodes.add(w.name)
                w = w.args[0]
        inside = {m.name for m in mms}
        # the row-wise ops from the first grouped matmul's output to the last one's input
        last = max(mms, key=lambda m: order[m.name])
        stack = [u for m in mms if m is not last for u in m.users]
        while stack:
            n = stack.pop()
            if n.name in inside or order[n.name] > order[last.name]:
                continue
            s = _shape(n)
            rowwise = n.target in _PER_ROW and (
                s is None and n.target in (aten.chunk.default, aten.split.Tensor)
                or n.target is operator.getitem or (s is not None and s[:1] == (rows,))
                or n.target is aten._assert_tensor_metadata.default)
            if not rowwise:
                break
            inside.add(n.name)
            stack.extend(n.users)
        else:
            nodes = [by_name[x] for x in sorted(inside, key=order.get)]

            def weight_of(a: fx.Node) -> str | None:
                if a.name in weight_nodes:
                    return _weight_view(gm, a, e)
                return a.target if _weight(gm, a, e) else None
            entries, exits, weights = _boundary(nodes, inside, weight_of, {offs})
            ok = all(_shape(by_name[x]) is not None and _shape(by_name[x])[:1] == (rows,)
                     for x in entries + exits)
            if ok and entries and exits:
                out.append(Region(e, rows, [n.name for n in nodes], entries, exits, weights,
                                  "dropless", offs))
    return out


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
    by_name = {n.name: n for n in gm.graph.nodes}
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
        nodes = [by_name[x] for x in sorted(inside, key=order.get)]
        entries, exits, weights = _boundary(
            nodes, inside, lambda a: a.target if _weight(gm, a, e) else None,
            entry_ok=lambda a: _shape(a) is not None and _shape(a)[:2] == (e, c))
        taken |= inside
        regions.append(Region(e, c, [n.name for n in nodes], entries, exits, weights))
    return regions + _dropless_regions(gm, order, by_name)


def require_regions(gm: fx.GraphModule, model_name: str) -> list[Region]:
    """:func:`find_regions`, or :class:`NoExperts` saying what was looked for."""
    regions = find_regions(gm)
    if not regions:
        raise NoExperts(
            f"{model_name} has no expert layer fxpipe can split: expert parallelism looks for "
            "experts held as weights with a leading expert dimension, multiplied with bmm on "
            "the tokens dispatched to them ([experts, capacity, features], the static GShard "
            "form of fxpipe.examples.moe:MoEGPT) or with a grouped matmul on rows sorted by "
            "expert (transformers' Mixtral, Qwen2-MoE); a model without mixture-of-experts "
            "layers, or one that loops over its experts with data-dependent shapes, has none "
            "(parallel.expert: 1)")
    return regions
