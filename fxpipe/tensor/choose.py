"""Which parameters to shard at a tensor-parallel degree, found on the traced graph.

Walking the graph in order (:func:`choose`):

* a **linear layer** whose input arrives sharded on its features is **row-parallel** (its
  weight split on the input features);
* one whose input is replicated is tried as **column-parallel** (weight split on the output
  features, in ``k`` blocks when its output is split into ``k`` equal pieces, a fused ``qkv``):
  the sharded values it makes are followed forward through the rules of
  :mod:`fxpipe.tensor.analysis` until every one is consumed by a row-parallel layer, a
  vocabulary-parallel cross entropy or a loss that takes sharded logits; if something on the way
  would have to gather them (a norm over the features, an op without a rule), the layer stays
  replicated, with the reason;
* a **token embedding** (a table longer than it is wide, looked up with ids from a model input)
  is split by vocabulary, and so is the output head tied to it, when that head's logits reach
  such a loss.

A degree the model cannot take raises :class:`DegreeError` with the numbers: attention heads
(or key/value heads of grouped-query attention) that do not divide, and, when the degree was
asked for (``strict``), a vocabulary that does not (Megatron-LM pads it to a multiple; without
``strict``, the auto search, the table and its head stay whole, said in ``replicated``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx as fx

from fxpipe.errors import PlanError
from fxpipe.tensor.analysis import (Divisibility, Unsupported, _Ctx, _replicated, _shape,
                                    _tensor_inputs, _val, rule_for)
from fxpipe.tensor.placement import REPLICATE, Placement, shard

aten = torch.ops.aten
_LINEARS = (aten.linear.default, aten.addmm.default, aten.mm.default)


class DegreeError(PlanError):
    """The model cannot be split at this tensor-parallel degree (the message has the numbers)."""


@dataclass
class TensorChoice:
    """Parameter placements at one degree.

    Attributes:
        params: get_attr target -> placement of every sharded parameter.
        replicated: ``(weight target, why)`` of the linear layers and embeddings left whole.
    """

    params: dict[str, Placement]
    replicated: list[tuple[str, str]] = field(default_factory=list)


def linear_weight(n: fx.Node) -> tuple[fx.Node, fx.Node | None, int, int] | None:
    """``(weight, bias, output-feature dim, input-feature dim)`` of a linear layer node whose
    weight is a parameter (``linear``, ``addmm`` Conv1D, ``mm``), else None."""
    if n.op != "call_function" or n.target not in _LINEARS:
        return None
    if n.target is aten.linear.default:
        w = n.args[1]
        b = n.args[2] if len(n.args) > 2 else None
        dims = (0, 1)
    elif n.target is aten.addmm.default:
        w, b, dims = n.args[2], n.args[0], (1, 0)
    else:
        w, b, dims = n.args[1], None, (1, 0)
    if not (isinstance(w, fx.Node) and w.op == "get_attr" and _val(w) is not None
            and _val(w).dim() == 2):
        return None
    b = b if isinstance(b, fx.Node) and b.op == "get_attr" else None
    return w, b, dims[0], dims[1]


def _from_inputs(gm: fx.GraphModule) -> set[str]:
    """Nodes computed from a graph input (placeholder)."""
    out: set[str] = set()
    for n in gm.graph.nodes:
        if n.op == "placeholder" or any(a.name in out for a in n.all_input_nodes):
            out.add(n.name)
    return out


class _Walk:
    def __init__(self, gm: fx.GraphModule, t: int, sp: bool,
                 sharded_output: Callable[[fx.Node], bool] | None, strict: bool = True):
        self.gm, self.t, self.strict = gm, t, strict
        self.order = list(gm.graph.nodes)
        self.index = {n.name: i for i, n in enumerate(self.order)}
        param_of = {n.name: n.target for n in self.order if n.op == "get_attr"}
        self.ctx = _Ctx(t, sp, {}, param_of, {})
        self.sharded_output = sharded_output or (lambda n: False)
        self.replicated: list[tuple[str, str]] = []
        self.inputs = _from_inputs(gm)

    # ------------------------------------------------------------------ forward lookahead
    def reaches_a_closing_use(self, start: fx.Node, trial: dict[str, Placement]) -> Unsupported | None:
        """Follow the sharded values ``start`` makes under ``trial`` parameter placements (and
        row-parallel layers met on the way) until all are consumed; the reason it fails, or
        None."""
        ctx = _Ctx(self.t, self.ctx.sp, dict(self.ctx.place), self.ctx.param_of,
                   {**self.ctx.params, **trial})
        live: set[str] = set()
        pending: set[str] = set()
        for n in self.order[self.index[start.name]:]:
            if n is not start and n.name not in pending:
                continue
            pending.discard(n.name)
            if n.op == "output":
                bad = [a.name for a in _tensor_inputs(n) if a.name in live
                       and not self.sharded_output(a)]
                if bad:
                    return Unsupported(f"its sharded result reaches the model output {bad[0]}")
                continue
            lw = linear_weight(n)
            if n is not start and lw is not None:
                w = lw[0]
                x = n.args[0] if n.target is not aten.addmm.default else n.args[1]
                xp = ctx.p(x)
                if w.target not in ctx.params and xp.sharded and xp.dim == _val(x).dim() - 1:
                    ctx.params[w.target] = shard(lw[3])  # row-parallel
            rule = rule_for(n) if n.op == "call_function" else None
            if rule is None:
                return Unsupported(f"{n.target} ({n.name}) has no tensor-parallel rule")
            try:
                ns = rule(n, ctx)
            except Unsupported as e:
                e.node = n
                return e
            ctx.place[n.name] = ns.out
            outs = ns.out if isinstance(ns.out, tuple) else (ns.out,)
            closes = ns.impl in ("row", "contract", "vocab_cross_entropy")  # the sum is reduced
            if not closes and any(isinstance(p, Placement) and p.sharded for p in outs):
                live.add(n.name)
                pending.update(u.name for u in n.users)
            if not pending:
                return None
        return None

    # ------------------------------------------------------------------ decisions
    def decide_linear(self, n: fx.Node, lw) -> None:
        w, b, out_dim, in_dim = lw
        ctx, t = self.ctx, self.t
        x = n.args[0] if n.target is not aten.addmm.default else n.args[1]
        xp = ctx.p(x)
        if xp.sharded and xp.dim == _val(x).dim() - 1:
            ctx.params[w.target] = shard(in_dim)
            return
        out_features = _shape(w)[out_dim]
        if out_features % t:
            self.replicated.append((w.target, f"{out_features} output features do not split "
                                              f"over tensor {t}"))
            return
        blocks, why = 1, None
        while True:
            trial = {w.target: shard(out_dim, blocks)}
            if b is not None:
                trial[b.target] = shard(0, blocks)
            why = self.reaches_a_closing_use(n, trial)
            k = _split_pieces(why)
            if why is None or blocks != 1 or k is None or out_features % (k * t):
                break
            blocks = k  # a fused projection: shard each of its k pieces
        if why is None:
            ctx.params.update(trial)
            return
        if isinstance(why, Divisibility) and why.a is not None:
            raise DegreeError(
                f"tensor {t}: the output of {w.target} ({out_features} features) splits into "
                f"{why.size} attention heads (a reshape {why.a} -> {why.b}), and {why.size} "
                f"heads do not split over {t} ranks; choose a tensor degree that divides "
                f"{why.size}")
        if isinstance(why, Divisibility):
            raise DegreeError(f"tensor {t}: {w.target}: {why}; choose a tensor degree that "
                              f"divides {why.size}")
        self.replicated.append((w.target, str(why)))

    def decide_embedding(self, n: fx.Node) -> None:
        w, ids = n.args[0], n.args[1]
        rows, cols = _shape(w)
        if rows <= cols or ids.name not in self.inputs:
            return  # a position or type table: replicated
        t = self.t
        if rows % t:
            why = (f"the vocabulary of {w.target} has {rows} tokens, which do not split over "
                   f"{t} ranks")
            if self.strict:
                raise DegreeError(f"tensor {t}: {why}; choose a tensor degree that divides "
                                  f"{rows}, or pad the vocabulary to a multiple of {t} (e.g. "
                                  f"{-(-rows // (64 * t)) * 64 * t})")
            self.replicated.append((w.target, why))
            return
        trial = {w.target: shard(0)}
        for user in w.users:  # a head tied to the table must accept the split too
            lw = linear_weight(user)
            if user is n or lw is None:
                continue
            if lw[2] != 0:
                self.replicated.append((w.target, f"tied to {user.name}, which reads it "
                                                  "transposed"))
                return
            if lw[1] is not None:
                trial[lw[1].target] = shard(0)
            why = self.reaches_a_closing_use(user, trial)
            if why is not None:
                self.replicated.append((w.target, f"the tied head {user.name}: {why}"))
                return
        self.ctx.params.update(trial)

    def run(self) -> TensorChoice:
        ctx = self.ctx
        for n in self.order:
            if n.op == "get_attr":
                ctx.place[n.name] = ctx.params.get(n.target, REPLICATE)
                continue
            if n.op != "call_function":
                ctx.place[n.name] = REPLICATE
                continue
            lw = linear_weight(n)
            if lw is not None and lw[0].target not in ctx.params:
                self.decide_linear(n, lw)
            elif (n.target is aten.embedding.default and isinstance(n.args[0], fx.Node)
                  and n.args[0].op == "get_attr" and n.args[0].target not in ctx.params):
                self.decide_embedding(n)
            for a in n.all_input_nodes:  # parameters decided just now
                if a.op == "get_attr":
                    ctx.place[a.name] = ctx.params.get(a.target, REPLICATE)
            rule = rule_for(n)
            try:
                ns = rule(n, ctx) if rule is not None else _replicated(n, ctx)
            except Unsupported:
                ns = _replicated(n, ctx)
            ctx.place[n.name] = ns.out
        return TensorChoice({k: v for k, v in ctx.params.items() if v.sharded},
                            self.replicated)


def _split_pieces(why: Unsupported | None) -> int | None:
    """When the lookahead stopped at a ``split`` of the sharded dimension into equal pieces:
    how many."""
    node = getattr(why, "node", None)
    if node is None or node.target not in (aten.split.Tensor, aten.split_with_sizes.default):
        return None
    sizes = {int(v.shape[node.args[2] if len(node.args) > 2 else 0]) for v in node.meta["val"]}
    return len(node.meta["val"]) if len(sizes) == 1 else None


def choose(gm: fx.GraphModule, t: int, *, sequence_parallel: bool = False,
           sharded_output: Callable[[fx.Node], bool] | None = None,
           strict: bool = True) -> TensorChoice:
    """The parameter placements of ``gm`` at tensor degree ``t`` (see the module doc).

    Args:
        gm: the traced graph (``meta["val"]`` on its nodes).
        t: the degree (1: nothing sharded).
        sequence_parallel: plan for reduce-scatter / all-gather along the sequence.
        sharded_output: ``f(output value node) -> True`` for a graph output that may leave
            sharded (logits that the executor's vocabulary-parallel loss reads).
        strict: a vocabulary that does not divide is an error (else it stays whole).

    Raises:
        DegreeError: heads or the vocabulary do not divide by ``t``.
    """
    if t <= 1:
        return TensorChoice({})
    return _Walk(gm, t, sequence_parallel, sharded_output, strict).run()
