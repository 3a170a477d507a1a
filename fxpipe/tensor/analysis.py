"""Tensor-parallel sharding of an exported (aten) graph: where every value lies on the tensor
group, which communication each node needs, and which nodes run replicated.

Given the placement of every parameter (:mod:`fxpipe.tensor.choose` decides them, the Plan
records them) and the degree ``t``, :func:`analyse` walks the graph once in order and decides,
node by node, how the node runs on its shards:

* **pointwise ops** (broadcasting) keep their sharded input's placement; a replicated input
  with the full length along the sharded dimension is sliced locally (no communication), one
  broadcast along it is used whole;
* **views** (``view``, ``reshape``, ``unsqueeze``, ``expand``, ``transpose``...) move the sharded
  dimension: splitting it into ``(heads, head_dim)`` shards the heads, merging ``(heads,
  head_dim)`` back shards the merged dimension; their shape arguments become the local shapes;
* ``split`` of a dimension sharded in ``k`` blocks into ``k`` pieces (a fused ``qkv``
  projection) gives each piece sharded plainly;
* **linear layers** (``linear``, GPT-2's ``addmm`` Conv1D, ``mm`` of a parameter): a weight
  sharded on its output features is column-parallel (replicated input, sharded output), one
  sharded on its input features row-parallel (sharded input, the partial products all-reduced,
  the bias added after); Megatron-LM's pair (Shoeybi et al., 2019);
* **attention** (``scaled_dot_product_attention``, ``matmul``/``bmm``) runs per head;
* **embedding** of a vocabulary-sharded table: each rank looks up the ids in its range, the
  partial rows are all-reduced; **cross entropy** on vocabulary-sharded logits runs
  vocabulary-parallel (max, sum of exponentials and the target logit all-reduced), never
  gathering the logits;
* norms and reductions over other dimensions keep the sharding;
* with **sequence parallelism** the partial sums of row-parallel layers and embeddings are
  reduce-scattered along the sequence instead (norms, dropout and residual adds then run on a
  slice of the sequence) and all-gathered before the next column-parallel layer;
* anything else runs **replicated**: its sharded inputs are all-gathered first (correct, priced,
  and named in :attr:`Sharding.replicated`).

Gradients: a replicated value always has the whole gradient on every rank. Where a replicated
value feeds an op whose output is sharded, each rank's backward gives only its part of that
gradient: the edge gets Megatron's ``f`` (identity forward, all-reduce backward); a parameter's
such edge likewise. An all-gather followed by such a use becomes all-gather forward /
reduce-scatter backward. That gives Megatron's two all-reduces forward and two backward per
transformer block (or the reduce-scatter / all-gather pairs under sequence parallelism).

Plain Python over ``torch.fx``; the runtime rewrites a stage with it
(:mod:`fxpipe.tensor.rewrite`), the planner prices with it (:mod:`fxpipe.tensor.pricing`).

Size: over 600 lines because it is one propagation over the graph with a rule per op family; split
by family, the rules would share its state."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx as fx

from fxpipe.tensor.placement import REPLICATE, Placement, local_shape, shard

aten = torch.ops.aten

#: ops that are elementwise apart from broadcasting but carry no ``pointwise`` tag
_POINTWISE_EXTRA = {aten.to.dtype, aten.to.device, aten.to.dtype_layout, aten._to_copy.default,
                    aten.contiguous.default, aten.alias.default, aten.dropout.default,
                    aten.detach.default, aten.type_as.default, aten.__and__.Tensor,
                    aten.__or__.Tensor, aten.__xor__.Tensor, aten.lift_fresh_copy.default,
                    aten.clone.default, aten.feature_dropout.default}
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default,
          aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
          aten.flatten.using_ints, aten.unflatten.int}
_SHAPE_ARG = {aten.view.default, aten.reshape.default, aten._unsafe_view.default,
              aten.expand.default}
_REDUCTIONS = {aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.amin.default,
               aten.var.correction, aten.std.correction, aten.var_mean.correction,
               aten.logsumexp.default, aten.any.dims, aten.all.dims}
_SOFTMAX = {aten._softmax.default, aten._log_softmax.default, aten.softmax.int,
            aten.log_softmax.int}
_SDPA = {aten.scaled_dot_product_attention.default,
         aten._scaled_dot_product_flash_attention_for_cpu.default}


#: the built-in losses that take logits split by vocabulary (``train.loss``)
VOCAB_PARALLEL_LOSSES = ("cross_entropy",)


class Unsupported(Exception):
    """A node has no sharded form for its inputs' placements (it then runs replicated)."""


@dataclass(frozen=True)
class Edge:
    """How a node reads one input: ``convert`` ``"none"``, ``"gather"`` (all-gather to
    replicated) or ``"slice"`` (take this rank's part of a replicated value), from ``src`` to
    ``dst``; ``partial_grad``: the node's backward gives this rank only part of the input's
    gradient, so it is all-reduced (``f``; fused into a reduce-scatter after a gather)."""

    src: Placement
    dst: Placement
    convert: str = "none"
    partial_grad: bool = False


@dataclass(frozen=True)
class Comm:
    """One collective over the tensor group for one micro-batch: ``kind`` ``all_reduce`` /
    ``all_gather`` / ``reduce_scatter``, ``nbytes`` of the whole tensor, ``phase`` ``fwd`` or
    ``bwd`` (the input-gradient pass)."""

    kind: str
    nbytes: int
    phase: str


@dataclass
class NodeShard:
    """How one node runs on its shards.

    Attributes:
        out: placement of the output (a tuple for ops returning several tensors).
        impl: ``same`` (the op itself on local tensors, shape arguments made local), ``row``
            (row-parallel: the op without bias, the sum reduced, the bias added),
            ``vocab_embedding``, ``vocab_cross_entropy``, ``contract`` (a matmul over a sharded
            contraction dimension, then all-reduced) or ``replicated`` (inputs gathered).
        edges: input node name -> :class:`Edge`.
        reduce: for ``row`` / ``vocab_embedding`` / ``contract``: ``("all_reduce", None)`` or
            ``("reduce_scatter", dim)`` (sequence parallelism).
        local: argument index -> its value on one rank (shapes, split sizes).
        compute: the fraction of the op's work one rank does (``1/t`` sharded, 1 replicated).
        comm: the collectives this node and its input edges run per micro-batch.
        why: for ``replicated``, why no sharded form applied.
    """

    out: Placement | tuple
    impl: str = "same"
    edges: dict[str, Edge] = field(default_factory=dict)
    reduce: tuple[str, int | None] | None = None
    local: dict[int, object] = field(default_factory=dict)
    compute: float = 1.0
    comm: list[Comm] = field(default_factory=list)
    why: str | None = None


@dataclass
class Sharding:
    """The result of :func:`analyse` over one graph at degree ``t``.

    Attributes:
        t: the tensor-parallel degree. sequence_parallel: reduce-scatter / all-gather along the
            sequence instead of all-reduce.
        nodes: node name -> :class:`NodeShard` (placeholders and parameters included).
        params: get_attr target -> placement (as given).
        replicated: ``(node name, op, why)`` of the sharded-input nodes that run replicated.
    """

    t: int
    sequence_parallel: bool
    nodes: dict[str, NodeShard]
    params: dict[str, Placement]
    replicated: list[tuple[str, str, str]]

    def placement(self, name: str) -> Placement:
        out = self.nodes[name].out
        return out if isinstance(out, Placement) else REPLICATE

    def comms(self) -> list[tuple[str, Comm]]:
        """Every collective per micro-batch, with the node that runs it."""
        return [(n, c) for n, ns in self.nodes.items() for c in ns.comm]


# ----------------------------------------------------------------------------- helpers
def _val(n) -> torch.Tensor | None:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _shape(n) -> list[int]:
    return [int(s) for s in _val(n).shape]


def _nbytes(n) -> int:
    v = _val(n)
    return 0 if v is None else int(v.numel()) * v.element_size()


def _norm(d: int, nd: int) -> int:
    return d + nd if d < 0 else d


def _tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """Input nodes whose value is a tensor, in argument order, each once."""
    out: list[fx.Node] = []
    for a in node.all_input_nodes:
        if _val(a) is not None and a not in out:
            out.append(a)
    return out


def dim_groups(a: list[int], b: list[int]) -> list[tuple[list[int], list[int]]]:
    """Dimensions of shapes ``a`` and ``b`` (same number of elements) grouped so that each group
    of ``a`` holds the same elements as the matching group of ``b`` (a reshape's map)."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(a) and j < len(b):
        gi, gj, pa, pb = [i], [j], a[i], b[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                if i >= len(a):
                    raise Unsupported(f"shapes {a} and {b} do not hold the same elements")
                gi.append(i)
                pa *= a[i]
                i += 1
            else:
                if j >= len(b):
                    raise Unsupported(f"shapes {a} and {b} do not hold the same elements")
                gj.append(j)
                pb *= b[j]
                j += 1
        groups.append((gi, gj))
    if groups:
        groups[-1][0].extend(range(i, len(a)))
        groups[-1][1].extend(range(j, len(b)))
    elif a or b:
        groups.append((list(range(len(a))), list(range(len(b)))))
    return groups


def map_view(a: list[int], b: list[int], p: Placement, t: int) -> Placement:
    """Where a reshape of shape ``a`` (placed ``p``) to ``b`` puts the sharded dimension.

    Raises:
        Unsupported: the sharded dimension is not the outermost of what it merges with, or the
            dimension it becomes is not divisible by ``t`` (say, 12 heads on 8 ranks).
    """
    if not p.sharded:
        return REPLICATE
    for gi, gj in dim_groups(a, b):
        if p.dim not in gi:
            continue
        outer = [d for d in gi if a[d] > 1]
        if not outer or outer[0] != p.dim:
            raise Unsupported(f"the reshape {a} -> {b} merges the sharded dimension {p.dim} "
                              "into an outer one")
        outs = [d for d in gj if b[d] > 1]
        if not outs:
            raise Unsupported(f"the reshape {a} -> {b} removes the sharded dimension")
        o = outs[0]
        if p.blocks > 1 and (len(outs) > 1 or len(outer) > 1):
            raise Unsupported(f"the reshape {a} -> {b} splits a dimension sharded in "
                              f"{p.blocks} blocks")
        if b[o] % (t * p.blocks):
            raise Divisibility(f"dimension {o} of the reshape {a} -> {b} has {b[o]}, which "
                               f"does not split over tensor {t}", b[o], a, b)
        return shard(o, p.blocks)
    raise Unsupported(f"the reshape {a} -> {b} loses the sharded dimension")


class Divisibility(Unsupported):
    """A dimension the sharding must split is not divisible by the degree (its size and the
    reshape's shapes kept, so that a caller can name heads or hidden sizes)."""

    def __init__(self, message: str, size: int, a: list[int] | None = None,
                 b: list[int] | None = None):
        super().__init__(message)
        self.size, self.a, self.b = size, a, b


# ----------------------------------------------------------------------------- rules
@dataclass
class _Ctx:
    t: int
    sp: bool
    place: dict[str, Placement | tuple]
    param_of: dict[str, str]  # get_attr node name -> target
    params: dict[str, Placement]

    def p(self, n) -> Placement:
        v = self.place.get(n.name, REPLICATE) if isinstance(n, fx.Node) else REPLICATE
        return v if isinstance(v, Placement) else REPLICATE

    def weight(self, n) -> Placement:
        if isinstance(n, fx.Node) and n.name in self.param_of:
            return self.params.get(self.param_of[n.name], REPLICATE)
        return self.p(n)


def _seq_dim(nd: int) -> int:
    """The sequence dimension sequence parallelism shards: 1 of ``[batch, seq, ...]``, 0 of a
    2-D ``[tokens, features]``."""
    return 1 if nd >= 3 else 0


def _edges_to(node: fx.Node, ctx: _Ctx, want: dict[fx.Node, Placement]) -> dict[str, Edge]:
    """Edges bringing every tensor input of ``node`` to ``want`` (default: as it is)."""
    out = {}
    for a in _tensor_inputs(node):
        src = ctx.p(a)
        dst = want.get(a, src)
        if src == dst:
            out[a.name] = Edge(src, dst)
        elif not src.sharded:
            out[a.name] = Edge(src, dst, "slice")
        elif not dst.sharded:
            out[a.name] = Edge(src, dst, "gather")
        else:
            raise Unsupported(f"input {a.name} is {src}, the op needs {dst}")
    return out


def _pointwise(node: fx.Node, ctx: _Ctx) -> NodeShard:
    out_nd = _val(node).dim()
    ins = _tensor_inputs(node)
    target = None
    for a in ins:
        p = ctx.p(a)
        if p.sharded:
            d = p.dim + out_nd - _val(a).dim()
            cand = shard(d, p.blocks)
            if target is None:
                target = cand
            elif cand != target:
                raise Unsupported(f"inputs sharded on different dimensions ({target}, {cand})")
    if target is None:
        return NodeShard(REPLICATE, edges=_edges_to(node, ctx, {}))
    want = {}
    for a in ins:
        nd = _val(a).dim()
        aligned = target.dim - (out_nd - nd)
        if aligned < 0 or _shape(a)[aligned] == 1:
            want[a] = REPLICATE  # broadcast along the sharded dimension: used whole
        else:
            if _shape(a)[aligned] % (ctx.t * target.blocks):
                raise Divisibility(f"{a.name} has {_shape(a)[aligned]} along the sharded "
                                   "dimension", _shape(a)[aligned])
            want[a] = shard(aligned, target.blocks)
    return NodeShard(target, edges=_edges_to(node, ctx, want), compute=1 / ctx.t)


def _whole(node: fx.Node, ctx: _Ctx) -> NodeShard:
    """A node on replicated inputs: replicated, every input read as it is."""
    return NodeShard(REPLICATE, edges=_edges_to(node, ctx, {}))


def _view(node: fx.Node, ctx: _Ctx) -> NodeShard:
    x = node.args[0]
    p = ctx.p(x)
    out = map_view(_shape(x), _shape(node), p, ctx.t)
    ns = NodeShard(out, edges=_edges_to(node, ctx, {}))
    if out.sharded:
        ls = local_shape(_shape(node), out, ctx.t)
        if node.target in _SHAPE_ARG:
            ns.local[1] = ls
        elif node.target is aten.unflatten.int:
            d = _norm(node.args[1], _val(x).dim())
            ns.local[2] = ls[d:d + len(node.args[2])]
    return ns


def _expand(node: fx.Node, ctx: _Ctx) -> NodeShard:
    x, p = node.args[0], ctx.p(node.args[0])
    if not p.sharded:
        return _whole(node, ctx)
    out = shard(p.dim + _val(node).dim() - _val(x).dim(), p.blocks)
    return NodeShard(out, edges=_edges_to(node, ctx, {}),
                     local={1: local_shape(_shape(node), out, ctx.t)})


def _permute_like(node: fx.Node, ctx: _Ctx) -> NodeShard:
    x, p = node.args[0], ctx.p(node.args[0])
    if not p.sharded:
        return _whole(node, ctx)
    nd = _val(x).dim()
    if node.target is aten.permute.default:
        dims = [_norm(d, nd) for d in node.args[1]]
        d = dims.index(p.dim)
    elif node.target is aten.t.default:
        d = 1 - p.dim if nd == 2 else p.dim
    else:  # transpose.int
        a, b = _norm(node.args[1], nd), _norm(node.args[2], nd)
        d = b if p.dim == a else a if p.dim == b else p.dim
    return NodeShard(shard(d, p.blocks), edges=_edges_to(node, ctx, {}))


def _slice_like(node: fx.Node, ctx: _Ctx) -> NodeShard:
    x, p = node.args[0], ctx.p(node.args[0])
    if not p.sharded:
        return _whole(node, ctx)
    nd = _val(x).dim()
    dim = _norm(node.args[1] if len(node.args) > 1 else 0, nd)
    if dim == p.dim:
        raise Unsupported("slices the sharded dimension")
    if node.target is aten.select.int:
        return NodeShard(shard(p.dim - (dim < p.dim), p.blocks), edges=_edges_to(node, ctx, {}))
    return NodeShard(p, edges=_edges_to(node, ctx, {}))


def _split(node: fx.Node, ctx: _Ctx) -> NodeShard:
    x = node.args[0]
    p = ctx.p(x)
    vals = node.meta["val"]
    n = len(vals)
    if not p.sharded:
        return NodeShard(tuple(REPLICATE for _ in vals), edges=_edges_to(node, ctx, {}))
    nd = _val(x).dim()
    if node.target is aten.unbind.int:
        dim = _norm(node.args[1] if len(node.args) > 1 else 0, nd)
        if dim == p.dim:
            raise Unsupported("unbinds the sharded dimension")
        q = shard(p.dim - (dim < p.dim), p.blocks)
        return NodeShard(tuple(q for _ in vals), edges=_edges_to(node, ctx, {}))
    dim = _norm(node.args[2] if len(node.args) > 2 else 0, nd)
    if dim != p.dim:
        return NodeShard(tuple(p for _ in vals), edges=_edges_to(node, ctx, {}))
    sizes = [int(v.shape[dim]) for v in vals]
    if p.blocks != n or len(set(sizes)) != 1:
        raise Unsupported(f"splits the sharded dimension into {sizes} (sharded in "
                          f"{p.blocks} block{'s' if p.blocks > 1 else ''})")
    if sizes[0] % ctx.t:
        raise Divisibility(f"splits into pieces of {sizes[0]}, which do not split over tensor "
                           f"{ctx.t}", sizes[0])
    local = sizes[0] // ctx.t
    arg = local if node.target is aten.split.Tensor else [local] * n
    return NodeShard(tuple(shard(dim) for _ in vals), edges=_edges_to(node, ctx, {}),
                     local={1: arg})


def _cat(node: fx.Node, ctx: _Ctx) -> NodeShard:
    tensors = node.args[0]
    nd = _val(node).dim()
    dim = _norm(node.args[1] if len(node.args) > 1 else 0, nd)
    ps = [ctx.p(a) for a in tensors]
    sharded = {q for q in ps if q.sharded}
    if not sharded:
        return NodeShard(REPLICATE, edges=_edges_to(node, ctx, {}))
    if len(sharded) > 1:
        raise Unsupported("inputs sharded differently")
    (q,) = sharded
    if q.dim == dim:
        raise Unsupported("concatenates along the sharded dimension")
    return NodeShard(q, edges=_edges_to(node, ctx, {a: q for a in tensors}), compute=1 / ctx.t)


def _reduction(node: fx.Node, ctx: _Ctx) -> NodeShard:
    x = node.args[0]
    p = ctx.p(x)
    if not p.sharded:
        return NodeShard(REPLICATE if isinstance(node.meta["val"], torch.Tensor)
                         else tuple(REPLICATE for _ in node.meta["val"]),
                         edges=_edges_to(node, ctx, {}))
    nd = _val(x).dim()
    dims = node.args[1] if len(node.args) > 1 else None
    if dims is None or dims == []:
        raise Unsupported("reduces every dimension")
    dims = [_norm(d, nd) for d in ([dims] if isinstance(dims, int) else dims)]
    if p.dim in dims:
        raise Unsupported("reduces the sharded dimension")
    keep = bool(node.kwargs.get("keepdim", node.args[2] if len(node.args) > 2 else False))
    q = shard(p.dim if keep else p.dim - sum(d < p.dim for d in dims), p.blocks)
    out = q if isinstance(node.meta["val"], torch.Tensor) else tuple(q for _ in node.meta["val"])
    return NodeShard(out, edges=_edges_to(node, ctx, {}), compute=1 / ctx.t)


def _softmax(node: fx.Node, ctx: _Ctx) -> NodeShard:
    x = node.args[0]
    p = ctx.p(x)
    if p.sharded and _norm(node.args[1], _val(x).dim()) == p.dim:
        raise Unsupported("softmax over the sharded dimension")
    return NodeShard(p, edges=_edges_to(node, ctx, {}), compute=1 / ctx.t if p.sharded else 1)


def _norm_layer(node: fx.Node, ctx: _Ctx) -> NodeShard:
    x = node.args[0]
    p = ctx.p(x)
    normalized = len(node.args[1])
    if p.sharded and p.dim >= _val(x).dim() - normalized:
        raise Unsupported("normalises over the sharded dimension")
    vals = node.meta["val"]
    out = p if isinstance(vals, torch.Tensor) else tuple(p for _ in vals)
    want = {a: REPLICATE for a in _tensor_inputs(node) if a is not x}
    return NodeShard(out, edges=_edges_to(node, ctx, want), compute=1 / ctx.t if p.sharded else 1)


def _reduce_for(ctx: _Ctx, nd: int) -> tuple[tuple[str, int | None], Placement]:
    """A partial sum's reduction and the placement it gives: all-reduce to replicated, or
    reduce-scatter along the sequence under sequence parallelism."""
    if ctx.sp:
        d = _seq_dim(nd)
        return ("reduce_scatter", d), shard(d)
    return ("all_reduce", None), REPLICATE


def _linear(node: fx.Node, ctx: _Ctx) -> NodeShard:
    """``linear(x, W[out, in], b)``, ``addmm(b, x, W[in, out])``, ``mm(x, W[in, out])``."""
    if node.target is aten.linear.default:
        x, w = node.args[0], node.args[1]
        b = node.args[2] if len(node.args) > 2 else None
        out_dim, in_dim = 0, 1
    elif node.target is aten.addmm.default:
        b, x, w = node.args[0], node.args[1], node.args[2]
        out_dim, in_dim = 1, 0
    else:
        x, w = node.args[0], node.args[1]
        b, out_dim, in_dim = None, 1, 0
    wp = ctx.weight(w)
    nd = _val(node).dim()
    xp = ctx.p(x)
    if wp.sharded and wp.dim == out_dim:  # column-parallel
        want = {x: REPLICATE, w: wp}
        if isinstance(b, fx.Node):
            bp = ctx.weight(b)
            if bp != shard(0, wp.blocks):
                raise Unsupported(f"the bias is {bp} but the weight {wp}")
            want[b] = bp
        return NodeShard(shard(nd - 1, wp.blocks), edges=_edges_to(node, ctx, want),
                         compute=1 / ctx.t)
    if wp.sharded and wp.dim == in_dim:  # row-parallel
        if wp.blocks > 1:
            raise Unsupported("a row-parallel weight sharded in blocks")
        want = {x: shard(_val(x).dim() - 1), w: wp}
        if isinstance(b, fx.Node):
            want[b] = REPLICATE
        reduce, out = _reduce_for(ctx, nd)
        ns = NodeShard(out, impl="row", edges=_edges_to(node, ctx, want), reduce=reduce,
                       compute=1 / ctx.t)
        if ctx.sp and isinstance(b, fx.Node):  # the bias is added to a slice of the sequence
            e = ns.edges[b.name]
            ns.edges[b.name] = Edge(e.src, e.dst, e.convert, True)
        return ns
    if xp.sharded and xp.dim < _val(x).dim() - 1:  # rows of a replicated layer
        return NodeShard(xp, edges=_edges_to(node, ctx, {}), compute=1 / ctx.t)
    if xp.sharded:
        raise Unsupported("a replicated layer reads a feature-sharded input")
    return NodeShard(REPLICATE, edges=_edges_to(node, ctx, {}))


def _matmul(node: fx.Node, ctx: _Ctx) -> NodeShard:
    """``matmul`` / ``bmm`` / ``mm`` of two activations: ``A[..., M, K] @ B[..., K, N]``."""
    a, b = node.args[0], node.args[1]
    pa, pb = ctx.p(a), ctx.p(b)
    if not pa.sharded and not pb.sharded:
        return NodeShard(REPLICATE, edges=_edges_to(node, ctx, {}))
    na, nb, no = _val(a).dim(), _val(b).dim(), _val(node).dim()

    def role(p: Placement, nd: int, side: str) -> tuple[str, int]:
        if p.dim == nd - 1:
            return ("K", -1) if side == "a" else ("N", no - 1)
        if p.dim == nd - 2:
            return ("M", no - 2) if side == "a" else ("K", -1)
        return ("batch", p.dim + no - nd)

    ra = role(pa, na, "a") if pa.sharded else None
    rb = role(pb, nb, "b") if pb.sharded else None
    if ra and rb and ra[0] == "K" and rb[0] == "K":
        return NodeShard(REPLICATE, impl="contract", edges=_edges_to(node, ctx, {}),
                         reduce=("all_reduce", None), compute=1 / ctx.t)
    roles = [r for r in (ra, rb) if r]
    if any(r[0] == "K" for r in roles):
        raise Unsupported("one side sharded on the contraction dimension")
    dims = {r[1] for r in roles}
    if len(dims) > 1:
        raise Unsupported("the two sides are sharded on different dimensions")
    d = dims.pop()
    want = {}
    for x, p, nd in ((a, pa, na), (b, pb, nb)):
        if p.sharded:
            continue
        if d < no - 2:  # a batch dimension: slice the other side there unless broadcast
            al = d - (no - nd)
            want[x] = (REPLICATE if al < 0 or _shape(x)[al] == 1
                       else shard(al, (pa if pa.sharded else pb).blocks))
    blocks = (pa if pa.sharded else pb).blocks
    return NodeShard(shard(d, blocks), edges=_edges_to(node, ctx, want), compute=1 / ctx.t)


def _sdpa(node: fx.Node, ctx: _Ctx) -> NodeShard:
    q, k, v = node.args[:3]
    ps = {ctx.p(x) for x in (q, k, v)}
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    if not any(p.sharded for p in ps):
        return NodeShard(_sdpa_out(node, REPLICATE), edges=_edges_to(node, ctx, {}))
    if any(p.sharded and p.dim != 1 for p in ps):
        raise Unsupported("attention sharded on another dimension than the heads")
    want = {x: shard(1) for x in (q, k, v)}
    for x in (q, k, v):
        if _shape(x)[1] % ctx.t:
            raise Divisibility(f"{_shape(x)[1]} heads do not split over tensor {ctx.t}",
                               _shape(x)[1])
    if isinstance(mask, fx.Node) and _val(mask) is not None:
        ms = _shape(mask)
        mnd = len(ms)
        hd = 1 - (4 - mnd)  # the mask broadcasts against [B, H, T, S]
        want[mask] = REPLICATE if hd < 0 or ms[hd] == 1 else shard(hd)
    return NodeShard(_sdpa_out(node, shard(1)), edges=_edges_to(node, ctx, want),
                     compute=1 / ctx.t)


def _sdpa_out(node: fx.Node, p: Placement):
    vals = node.meta["val"]
    if isinstance(vals, torch.Tensor):
        return p
    return tuple(p if isinstance(v, torch.Tensor) and v.dim() >= 2 else REPLICATE for v in vals)


def _embedding(node: fx.Node, ctx: _Ctx) -> NodeShard:
    w, idx = node.args[0], node.args[1]
    wp = ctx.weight(w)
    nd = _val(node).dim()
    if wp.sharded and wp.dim == 0:
        reduce, out = _reduce_for(ctx, nd)
        return NodeShard(out, impl="vocab_embedding",
                         edges=_edges_to(node, ctx, {w: wp, idx: REPLICATE}), reduce=reduce,
                         compute=1 / ctx.t)
    if wp.sharded:
        raise Unsupported("an embedding sharded on its features")
    ip = ctx.p(idx)
    if ip.sharded:
        return NodeShard(ip, edges=_edges_to(node, ctx, {}), compute=1 / ctx.t)
    return NodeShard(REPLICATE, edges=_edges_to(node, ctx, {}))


def _cross_entropy(node: fx.Node, ctx: _Ctx) -> NodeShard:
    logits = node.args[0]
    p = ctx.p(logits)
    if not p.sharded:
        return NodeShard(REPLICATE, edges=_edges_to(node, ctx, {}))
    weight = node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")
    smoothing = node.args[5] if len(node.args) > 5 else node.kwargs.get("label_smoothing", 0.0)
    if p.dim != 1 or p.blocks != 1 or _val(logits).dim() != 2 or weight is not None or smoothing:
        raise Unsupported("cross entropy with class weights, label smoothing or logits other "
                          "than [rows, classes]")
    return NodeShard(REPLICATE, impl="vocab_cross_entropy",
                     edges=_edges_to(node, ctx, {a: REPLICATE for a in _tensor_inputs(node)
                                                 if a is not logits}), compute=1 / ctx.t)


def _getitem(node: fx.Node, ctx: _Ctx) -> NodeShard:
    src = node.args[0]
    out = ctx.place.get(src.name, REPLICATE)
    p = out[node.args[1]] if isinstance(out, tuple) else REPLICATE
    return NodeShard(p)


def rule_for(node: fx.Node) -> Callable[[fx.Node, _Ctx], NodeShard] | None:
    """The sharding rule of a call_function node, or None (it runs replicated)."""
    t = node.target
    if t is operator.getitem:
        return _getitem
    if t in (aten.linear.default, aten.addmm.default):
        return _linear
    if t in (aten.mm.default,):
        return _linear if _is_param_matmul(node) else _matmul
    if t in (aten.bmm.default, aten.matmul.default):
        return _matmul
    if t in _SDPA:
        return _sdpa
    if t is aten.embedding.default:
        return _embedding
    if t is aten.cross_entropy_loss.default:
        return _cross_entropy
    if t in _VIEWS:
        return _view
    if t is aten.expand.default:
        return _expand
    if t in (aten.permute.default, aten.transpose.int, aten.t.default):
        return _permute_like
    if t in (aten.slice.Tensor, aten.select.int, aten.narrow.default):
        return _slice_like
    if t in (aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int):
        return _split
    if t is aten.cat.default:
        return _cat
    if t in _REDUCTIONS:
        return _reduction
    if t in _SOFTMAX:
        return _softmax
    if t in (aten.layer_norm.default, aten.native_layer_norm.default, aten.rms_norm.default):
        return _norm_layer
    if isinstance(t, torch._ops.OpOverload) and (torch.Tag.pointwise in t.tags
                                                 or t in _POINTWISE_EXTRA):
        return _pointwise
    return None


def _is_param_matmul(node: fx.Node) -> bool:
    w = node.args[1]
    return isinstance(w, fx.Node) and w.op == "get_attr"


# ----------------------------------------------------------------------------- walk
def grad_values(gm: fx.GraphModule, params_requiring_grad: set[str],
                grad_inputs: set[str] | None = None) -> set[str]:
    """Names of the nodes whose value needs a gradient: trainable parameters, float inputs
    (``grad_inputs`` when given: the stage inputs received from other stages) and float values
    computed from them."""
    out: set[str] = set()
    for n in gm.graph.nodes:
        v = _val(n)
        floating = v is not None and v.is_floating_point()
        if n.op == "get_attr":
            if n.target in params_requiring_grad:
                out.add(n.name)
        elif n.op == "placeholder":
            if floating and (grad_inputs is None or n.name in grad_inputs):
                out.add(n.name)
        elif n.op == "call_function":
            vals = n.meta.get("val")
            anyfloat = floating or (isinstance(vals, (tuple, list)) and any(
                isinstance(x, torch.Tensor) and x.is_floating_point() for x in vals))
            if anyfloat and any(a.name in out for a in n.all_input_nodes):
                out.add(n.name)
    return out


def analyse(gm: fx.GraphModule, params: dict[str, Placement], t: int, *,
            sequence_parallel: bool = False, grads: set[str] | None = None,
            sharded_outputs: Callable[[fx.Node], bool] | None = None) -> Sharding:
    """Decide how every node of ``gm`` runs on ``t`` ranks (see the module doc).

    Args:
        gm: an exported aten graph with ``meta["val"]`` on its nodes (a whole model or a stage).
        params: get_attr target -> placement of each sharded parameter (others replicated).
        t: the tensor-parallel degree.
        sequence_parallel: reduce-scatter / all-gather along the sequence.
        grads: names of the nodes whose value needs a gradient (:func:`grad_values`; default:
            every float value).
        sharded_outputs: ``f(output value node) -> True`` where that graph output may leave
            sharded (the logits a vocabulary-parallel loss reads); others are all-gathered.
    """
    param_of = {n.name: n.target for n in gm.graph.nodes if n.op == "get_attr"}
    ctx = _Ctx(t, sequence_parallel, {}, param_of, dict(params))
    if grads is None:
        grads = {n.name for n in gm.graph.nodes if _val(n) is not None
                 and _val(n).is_floating_point()}
    nodes: dict[str, NodeShard] = {}
    replicated: list[tuple[str, str, str]] = []
    seen: set[tuple[str, Edge]] = set()  # a value converted once serves all its readers
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            ns = NodeShard(params.get(n.target, REPLICATE))
        elif n.op == "placeholder":
            ns = NodeShard(REPLICATE)
        elif n.op == "output":
            ns = _output(n, ctx, sharded_outputs)
        elif n.op == "call_function":
            rule = rule_for(n)
            ns = None
            if rule is not None:
                try:
                    ns = rule(n, ctx)
                except Unsupported as e:
                    why = str(e)
                else:
                    why = None
            else:
                why = "no tensor-parallel rule"
            if ns is None:
                ns = _replicated(n, ctx)
                if any(ctx.p(a).sharded for a in _tensor_inputs(n)):
                    replicated.append((n.name, str(n.target), why))
                    ns.why = why
        else:
            ns = NodeShard(REPLICATE, edges=_edges_to(n, ctx, {}))
        _partial_grads(n, ns, grads)
        ns.comm = _comms(n, ns, ctx, grads, seen)
        nodes[n.name] = ns
        ctx.place[n.name] = ns.out
    return Sharding(t, sequence_parallel, nodes, dict(params), replicated)


def stage_sharding(gm: fx.GraphModule, params: dict[str, Placement], t: int, *,
                   sequence_parallel: bool, received: set[str],
                   logits: fx.Node | None = None) -> Sharding:
    """How a pipeline stage runs on ``t`` ranks, as the runtime runs it: its inputs arrive
    whole, its outputs leave whole except ``logits`` (the model output a vocabulary-parallel
    loss reads after the stage; its collectives are added to that node), gradients flow into
    its trained parameters and its ``received`` inputs (values from other stages)."""
    trainable = {n for n, q in gm.named_parameters(remove_duplicate=False) if q.requires_grad}
    grads = grad_values(gm, trainable, received)
    sharding = analyse(gm, params, t, sequence_parallel=sequence_parallel, grads=grads,
                       sharded_outputs=lambda a: a is logits)
    if logits is not None:
        p = sharding.placement(logits.name)
        v = logits.meta["val"]
        if p.sharded and p.dim == v.dim() - 1:
            sharding.nodes[logits.name].comm += vocab_loss_comms(v.numel() // int(v.shape[-1]))
    return sharding


def _replicated(n: fx.Node, ctx: _Ctx) -> NodeShard:
    vals = n.meta.get("val")
    out = tuple(REPLICATE for _ in vals) if isinstance(vals, (tuple, list)) else REPLICATE
    return NodeShard(out, impl="replicated",
                     edges=_edges_to(n, ctx, {a: REPLICATE for a in _tensor_inputs(n)}))


def _output(n: fx.Node, ctx: _Ctx, sharded_outputs) -> NodeShard:
    want = {}
    for a in _tensor_inputs(n):
        keep = sharded_outputs is not None and sharded_outputs(a)
        want[a] = ctx.p(a) if keep else REPLICATE
    return NodeShard(REPLICATE, edges=_edges_to(n, ctx, want))


def _partial_grads(n: fx.Node, ns: NodeShard, grads: set[str]) -> None:
    """Mark the replicated inputs, used whole by a node whose output is sharded, whose gradient
    each rank gets only part of (see the module doc)."""
    outs = ns.out if isinstance(ns.out, tuple) else (ns.out,)
    if not any(isinstance(p, Placement) and p.sharded for p in outs) or n.op == "output":
        return
    for name, e in list(ns.edges.items()):
        if e.convert in ("none", "gather") and not e.dst.sharded and name in grads:
            ns.edges[name] = Edge(e.src, e.dst, e.convert, True)


def _comms(n: fx.Node, ns: NodeShard, ctx: _Ctx, grads: set[str],
           seen: set[tuple[str, Edge]]) -> list[Comm]:
    out: list[Comm] = []
    if ctx.t <= 1:
        return out
    by_name = {a.name: a for a in n.all_input_nodes}
    for name, e in ns.edges.items():
        if (name, e) in seen:
            continue
        seen.add((name, e))
        size = _nbytes(by_name[name]) if name in by_name else 0
        if e.convert == "gather":
            out.append(Comm("all_gather", size, "fwd"))
            if e.partial_grad:
                out.append(Comm("reduce_scatter", size, "bwd"))
        elif e.convert == "slice" and name in grads:
            out.append(Comm("all_gather", size, "bwd"))
        elif e.partial_grad:
            out.append(Comm("all_reduce", size, "bwd"))
    if ns.reduce is not None:
        size = _nbytes(n)
        if ns.reduce[0] == "all_reduce":
            out.append(Comm("all_reduce", size, "fwd"))
        else:
            out.append(Comm("reduce_scatter", size, "fwd"))
            if n.name in grads:
                out.append(Comm("all_gather", size, "bwd"))
    if ns.impl == "vocab_cross_entropy":
        rows = _val(n.args[0]).numel() // max(1, _shape(n.args[0])[1])
        out += vocab_loss_comms(rows)
    return out


def vocab_loss_comms(rows: int) -> list[Comm]:
    """The collectives of a vocabulary-parallel cross entropy over ``rows`` tokens: the max,
    then the sum of exponentials with the target's logit (float32)."""
    return [Comm("all_reduce", 4 * rows, "fwd"), Comm("all_reduce", 8 * rows, "fwd")]
