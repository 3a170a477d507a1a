"""In-place ops on fresh intermediate values, made out of place before the graph is cut.

An in-place op (``x.div_(s)``, ``t.index_put_(...)``) writes a value another node computed; if a
cut put the two in different stages, the producer's stage (and any reader there) would not see
the write, so :mod:`fxpipe.partitioner.boundaries` refuses such a split. transformers' MoE
routing does this (``top_k_weights /= top_k_weights.sum(...)``; an ``index_put_`` into an
``empty_like``). Where the written value is a fresh tensor (its producer returns no alias of an
input: not a view, not a parameter or a model input) and nothing views it, writing a new value
instead is the same computation: :func:`out_of_place` swaps each such node for its functional
overload (``aten.div_.Tensor`` -> ``aten.div.Tensor``) and has the nodes after it read the new
value. The planner and the runtime trace through the same function, so both see the same graph.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx


def _returns_alias(n: fx.Node) -> bool:
    """``n`` returns a view of (an alias into) one of its inputs (an element of a tuple: if
    the op that made the tuple does)."""
    if n.op == "call_function" and n.target is operator.getitem and n.args \
            and isinstance(n.args[0], fx.Node):
        return _returns_alias(n.args[0])
    schema = getattr(n.target, "_schema", None)
    if schema is None:
        return n.op == "call_function"  # unknown: assume it may alias
    return any(r.alias_info is not None for r in schema.returns)


def _functional(target):
    """The out-of-place overload of an in-place aten overload (None when there is none)."""
    packet = getattr(target, "overloadpacket", None)
    name = getattr(packet, "__name__", "")
    if not name.endswith("_") or name.startswith("_"):
        return None
    plain = getattr(torch.ops.aten, name[:-1], None)
    overload = getattr(plain, target._overloadname, None) if plain is not None else None
    schema = getattr(overload, "_schema", None)
    return overload if schema is not None and not schema.is_mutable else None


def out_of_place(gm: fx.GraphModule) -> int:
    """Rewrite ``gm`` in place (module doc); returns how many nodes changed."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    changed = 0
    for n in list(gm.graph.nodes):
        schema = getattr(n.target, "_schema", None)
        if n.op != "call_function" or schema is None or not schema.is_mutable:
            continue
        if not schema.arguments or schema.arguments[0].alias_info is None \
                or not schema.arguments[0].alias_info.is_write:
            continue
        written = n.args[0] if n.args else None
        functional = _functional(n.target)
        if functional is None or not isinstance(written, fx.Node) \
                or written.op != "call_function" or _returns_alias(written):
            continue
        if any(u is not n and u.op == "call_function" and _returns_alias(u)
               for u in written.users):
            continue  # something views the value: it would see the write
        n.target = functional
        for u in list(written.users):
            if u is not n and order[u] > order[n]:
                u.replace_input_with(written, n)
        changed += 1
    if changed:
        gm.graph.lint()
        gm.recompile()
    return changed
