"""Context parallelism on an exported (aten) graph: which values a rank holds for its share of
the sequence, which it holds whole, and what each node needs to run on its share.

``N`` ranks split every micro-batch's sequence of ``S`` positions (:mod:`fxpipe.context.layout`:
each rank two chunks of ``S/2N``, a head and the mirrored tail, so that causal attention costs
every rank the same). :func:`analyse` walks the graph once in order and places every value:

* **split** (:class:`Seq`): the value holds this rank's positions along one dimension (``dim``;
  ``inner`` elements of that dimension per position where dimensions were merged, say
  ``[B*S*H]``);
* **whole** (None): every rank computes all of it (parameters, position ids from ``arange``,
  a causal mask, labels before they meet the logits);
* **partial** (:data:`PARTIAL`): a sum over the sequence of which each rank holds its part
  (the loss); the ranks' parts add up to the value.

Rules, by op family:

* an **embedding** or **linear** layer reading a whole value whose dimension 1 is the
  sequence (token ids, ``[B, S, ...]`` inputs) takes this rank's positions of it first (no
  communication: every rank has the micro-batch): this is where the split starts;
* **pointwise** ops (broadcasting) keep their split input's placement; a whole input with the
  full length along that dimension is indexed with this rank's positions (no communication),
  one broadcast along it is used as it is; a partial value may be added to partial values and
  scaled by whole ones;
* **views**, ``expand``, ``permute``/``transpose``, ``split``/``getitem``, ``cat`` and
  ``slice`` along other dimensions move or keep the split dimension; their shape arguments
  become the local shapes;
* **norms**, **softmax** and reductions over other dimensions keep it; a ``sum`` over the
  sequence becomes partial, a ``mean`` partial scaled by ``1/N`` (every rank holds as many
  positions);
* **attention** (``scaled_dot_product_attention``, CPU fused kernel): the queries stay split,
  the keys and values are **all-gathered** along the sequence (backward: their gradients
  reduce-scattered); ``is_causal`` becomes this rank's mask (query position >= key position);
  a mask argument is indexed by this rank's query positions. With ``ring``, a
  ``scaled_dot_product_attention`` without dropout runs as ring attention instead
  (:mod:`fxpipe.context.ring`: its keys and values stay split, passed around the group). A ``matmul``/``bmm`` whose operand
  is split along the dimension it contracts, or whose two operands would give two split
  dimensions (``q @ k^T`` written out), all-gathers the second operand likewise;
* **cross entropy** keeps its rows split; with ``mean`` reduction it becomes the sum over this
  rank's rows divided by the count over the whole micro-batch (partial);
* anything else with a split input: its split inputs are all-gathered when none of them needs
  a gradient (integer ids, masks: a label shift, a padding mask's index), else the graph is
  refused with the op and its source line (:class:`ContextError`).

The runtime rewrites a stage with it (:mod:`fxpipe.context.rewrite`), the planner prices with it
(:mod:`fxpipe.partitioner.context_costs`).

Size: over 300 lines because it is one propagation with a rule per op family sharing its state
(as :mod:`fxpipe.tensor.analysis`)."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.fx as fx
from torch.fx.operator_schemas import normalize_function

from fxpipe.tensor.analysis import (_POINTWISE_EXTRA, _REDUCTIONS, _SDPA, _SOFTMAX, _VIEWS,
                                    Unsupported, dim_groups)

aten = torch.ops.aten


@dataclass(frozen=True)
class Seq:
    """A value split along the sequence: dimension ``dim`` holds this rank's positions,
    ``inner`` consecutive elements of it per position (1 unless dimensions inside the
    sequence were merged into it)."""

    dim: int
    inner: int = 1

    def text(self) -> str:
        return f"seq:{self.dim}" + (f"x{self.inner}" if self.inner > 1 else "")

    @staticmethod
    def parse(text: str) -> "Place":
        if text == "whole":
            return None
        if text == PARTIAL:
            return PARTIAL
        dim, _, inner = text[len("seq:"):].partition("x")
        return Seq(int(dim), int(inner or 1))


#: a partial sum over the sequence (each rank holds its part)
PARTIAL = "partial"
Place = Seq | str | None


def place_text(p: Place) -> str:
    """``seq:D[xI]``, ``whole`` or ``partial``."""
    return "whole" if p is None else PARTIAL if p == PARTIAL else p.text()


class ContextError(Exception):
    """A graph context parallelism cannot split (one line: the op, where, why)."""


#: fused attention kernels context parallelism cannot split (refused by name)
OTHER_ATTENTION = {"_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
                   "_scaled_dot_product_cudnn_attention", "_flash_attention_forward",
                   "_efficient_attention_forward", "flex_attention"}
_LINEAR_OF_PARTIAL = {aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor,
                      aten.neg.default, aten.to.dtype, aten._to_copy.default, aten.clone.default,
                      aten.alias.default, aten.detach.default, aten.contiguous.default,
                      aten.to.dtype_layout, aten.to.device}
_ENTRY = {aten.embedding.default, aten.linear.default}
#: the attention ops the analysis splits (queries split, keys and values gathered or ringed)
ATTENTION_OPS = frozenset(_SDPA)
_LIKE = {aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default,
         aten.full_like.default, aten.rand_like.default, aten.randn_like.default}


@dataclass
class NodeSplit:
    """How one node runs on a rank's share of the sequence.

    Attributes:
        out: the output's placement (a tuple for a node returning several values).
        localize: input node name -> the :class:`Seq` of its whole value to take this rank's
            positions of (an index, no communication).
        gather: input node name -> the :class:`Seq` to all-gather it along (split -> whole).
        shape: the node's new shape argument (view, reshape, expand, unflatten), or None.
        causal: an attention's ``is_causal`` replaced by this rank's mask.
        scale: the output multiplied by this (a mean over the sequence: ``1/N``), or None.
        loss_count: a mean cross entropy made a sum divided by the count of counted targets
            over the micro-batch: ``"whole"`` (counted on the whole target, which every rank
            has) or ``"reduce"`` (this rank's count, all-reduced).
        ring: an attention run as ring attention (its keys and values read split).
    """

    out: Place | tuple = None
    localize: dict[str, Seq] = field(default_factory=dict)
    gather: dict[str, Seq] = field(default_factory=dict)
    shape: list | None = None
    causal: bool = False
    scale: float | None = None
    loss_count: str | None = None
    ring: bool = False


@dataclass
class ContextSplit:
    """The decisions for a graph at degree ``n`` and sequence length ``seq``."""

    n: int
    seq: int
    nodes: dict[str, NodeSplit]

    def place(self, name: str) -> Place:
        return self.nodes[name].out if name in self.nodes else None

    def gathers(self) -> list[tuple[str, str, Seq]]:
        """``(node, input, seq)`` of every all-gather."""
        return [(n, a, s) for n, ns in self.nodes.items() for a, s in ns.gather.items()]

    def rings(self) -> list[str]:
        """The attention nodes run as ring attention."""
        return [n for n, ns in self.nodes.items() if ns.ring]


# ----------------------------------------------------------------------------- helpers
def _val(n):
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _shape(n) -> list[int]:
    return [int(s) for s in _val(n).shape]


def where(node: fx.Node) -> str:
    """The node's source line (``file:line``) from its stack trace: the innermost frame
    outside torch itself (the model's line calling ``nn.Conv1d``, not torch's), or its
    name."""
    trace = node.meta.get("stack_trace") or ""
    frames = []
    for ln in trace.splitlines():
        ln = ln.strip()
        if ln.startswith("File "):  # File "x.py", line 12, in forward
            try:
                frames.append((ln.split('"')[1], ln.split("line ")[1].split(",")[0]))
            except IndexError:
                continue
    torch_dir = str(Path(torch.__file__).parent)
    mine = [f for f in frames if not f[0].startswith(torch_dir)] or frames
    return f"{mine[-1][0]}:{mine[-1][1]}" if mine else f"node {node.name}"


def _opname(node: fx.Node) -> str:
    t = node.target
    return getattr(t, "_opname", None) or getattr(t, "__name__", None) or str(t)


class _Walk:
    def __init__(self, n: int, seq: int, inputs: dict[str, Place], ring: bool = False):
        self.n, self.seq, self.inputs, self.ring = n, seq, inputs, ring
        self.nodes: dict[str, NodeSplit] = {}

    def p(self, a) -> Place:
        if not isinstance(a, fx.Node):
            return None
        out = self.nodes[a.name].out if a.name in self.nodes else None
        return None if isinstance(out, tuple) else out

    def split(self, a) -> Seq | None:
        p = self.p(a)
        return p if isinstance(p, Seq) else None

    def full_size(self, node: fx.Node, s: Seq) -> int:
        return _shape(node)[s.dim]

    def local(self, shape: list[int], s: Seq) -> list[int]:
        out = list(shape)
        out[s.dim] //= self.n
        return out


def _tensor_args(node: fx.Node) -> list[fx.Node]:
    out = []
    for a in node.all_input_nodes:
        if _val(a) is not None and a not in out:
            out.append(a)
    return out


def _needs_grad(a: fx.Node) -> bool:
    v = _val(a)
    return v is not None and (v.is_floating_point() or v.is_complex())


# ----------------------------------------------------------------------------- rules
def _entry(node: fx.Node, w: _Walk) -> NodeSplit | None:
    """An embedding / linear reading a whole ``[B, S, ...]`` value: take this rank's positions."""
    data = node.args[1] if node.target is aten.embedding.default else node.args[0]
    v = _val(data)
    least = 2 if node.target is aten.embedding.default else 3  # a linear's last dim: features
    if v is None or v.dim() < least or int(v.shape[1]) != w.seq or w.p(data) is not None:
        return None
    s = Seq(1)
    return NodeSplit(out=s, localize={data.name: s})


def _pointwise(node: fx.Node, w: _Walk) -> NodeSplit:
    out_shape = _shape(node)
    nd = len(out_shape)
    ins = _tensor_args(node)
    if any(w.p(a) == PARTIAL for a in ins):
        if node.target not in _LINEAR_OF_PARTIAL or any(w.split(a) for a in ins):
            raise Unsupported("it reads a partial sum over the sequence (a loss part) in a way "
                              "that is not linear")
        parts = [a for a in ins if w.p(a) == PARTIAL]
        if node.target in (aten.add.Tensor, aten.sub.Tensor):
            if len(parts) != len(ins):
                raise Unsupported("it adds a whole value to a partial sum over the sequence")
        elif node.target in (aten.mul.Tensor, aten.div.Tensor):
            if len(parts) != 1 or (node.target is aten.div.Tensor and node.args[0] is not parts[0]):
                raise Unsupported("it multiplies partial sums over the sequence together")
        return NodeSplit(out=PARTIAL)
    splits = {}
    for a in ins:
        s = w.split(a)
        if s is not None:
            splits[a.name] = Seq(s.dim + nd - _val(a).dim(), s.inner)
    if not splits:
        return NodeSplit()
    outs = set(splits.values())
    if len(outs) > 1:
        raise Unsupported(f"its inputs are split along different dimensions ({sorted(outs)})")
    s = outs.pop()
    if out_shape[s.dim] % w.seq:
        raise Unsupported("it broadcasts a split value along the sequence")
    ns = NodeSplit(out=s)
    for a in ins:
        if a.name in splits:
            continue
        shape = _shape(a)
        j = s.dim - (nd - len(shape))
        if j < 0 or shape[j] == 1:
            continue
        if shape[j] != out_shape[s.dim]:
            raise Unsupported(f"input {a.name} has {shape[j]} along the sequence dimension")
        ns.localize[a.name] = Seq(j, s.inner)
    return ns


def _view(node: fx.Node, w: _Walk) -> NodeSplit:
    src = node.args[0]
    p = w.p(src)
    if p is None or p == PARTIAL:
        return NodeSplit(out=p)
    a, b = _shape(src), _shape(node)
    for gi, gj in dim_groups(a, b):
        if p.dim not in gi:
            continue
        # the sequence's stride inside the flattened group (elements per position)
        stride = p.inner
        for d in gi[gi.index(p.dim) + 1:]:
            stride *= a[d]
        after = 1  # elements per step of output dimension j
        for j in reversed(gj):
            if stride % after == 0 and (after * b[j]) % (stride * w.seq) == 0:
                s = Seq(j, stride // after)
                return NodeSplit(out=s, shape=_view_shape(node, b, s, w))
            after *= b[j]
        raise Unsupported(f"the reshape {a} -> {b} splits the sequence dimension")
    raise Unsupported(f"the reshape {a} -> {b} loses the sequence dimension")


def _view_shape(node: fx.Node, b: list[int], s: Seq, w: _Walk) -> list | None:
    if node.target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
        shape = list(node.args[1])
        if shape[s.dim] != -1:
            shape[s.dim] = b[s.dim] // w.n
        return shape
    if node.target is aten.unflatten.int:
        dim = node.args[1] % len(_shape(node.args[0]))
        sizes = list(node.args[2])
        k = s.dim - dim
        if 0 <= k < len(sizes) and sizes[k] != -1:
            sizes[k] = b[s.dim] // w.n
        return sizes
    return None


def _expand(node: fx.Node, w: _Walk) -> NodeSplit:
    src = node.args[0]
    s = w.split(src)
    if s is None:
        return NodeSplit(out=w.p(src))
    b = _shape(node)
    s = Seq(s.dim + len(b) - _val(src).dim(), s.inner)
    shape = list(node.args[1])
    if shape[s.dim] != -1:
        shape[s.dim] = b[s.dim] // w.n
    return NodeSplit(out=s, shape=shape)


def _permute(node: fx.Node, w: _Walk) -> NodeSplit:
    src = node.args[0]
    s = w.split(src)
    if s is None:
        return NodeSplit(out=w.p(src))
    nd = _val(src).dim()
    if node.target is aten.permute.default:
        order = [d % nd for d in node.args[1]]
    else:
        order = list(range(nd))
        if node.target is aten.t.default:
            order = order[::-1]
        else:
            d0, d1 = node.args[1] % nd, node.args[2] % nd
            order[d0], order[d1] = order[d1], order[d0]
    return NodeSplit(out=Seq(order.index(s.dim), s.inner))


def _shrink(node: fx.Node, w: _Walk) -> NodeSplit:
    """slice / select / narrow: along another dimension, or the whole length."""
    src = node.args[0]
    s = w.split(src)
    if s is None:
        return NodeSplit(out=w.p(src))
    nd = _val(src).dim()
    dim = (node.args[1] if len(node.args) > 1 else 0) % nd
    if dim == s.dim:
        if node.target is aten.slice.Tensor:
            start = node.args[2] if len(node.args) > 2 else 0
            end = node.args[3] if len(node.args) > 3 else None
            step = node.args[4] if len(node.args) > 4 else 1
            full = _shape(src)[dim]
            if (start in (0, None) and (end is None or end >= full) and step == 1):
                return NodeSplit(out=s)
        raise Unsupported("it slices along the sequence")
    if node.target is aten.select.int and dim < s.dim:
        return NodeSplit(out=Seq(s.dim - 1, s.inner))
    return NodeSplit(out=s)


def _split(node: fx.Node, w: _Walk) -> NodeSplit:
    src = node.args[0]
    s = w.split(src)
    n_out = len(node.meta.get("val") or ())
    if s is None:
        return NodeSplit(out=tuple(w.p(src) for _ in range(n_out)))
    nd = _val(src).dim()
    dim = (node.args[2] if len(node.args) > 2 else 0) % nd if node.target is not \
        aten.unbind.int else (node.args[1] if len(node.args) > 1 else 0) % nd
    if dim == s.dim:
        raise Unsupported("it splits along the sequence")
    if node.target is aten.unbind.int and dim < s.dim:
        s = Seq(s.dim - 1, s.inner)
    return NodeSplit(out=tuple(s for _ in range(n_out)))


def _cat(node: fx.Node, w: _Walk) -> NodeSplit:
    parts = list(node.args[0])
    nd = _val(node).dim()
    dim = (node.args[1] if len(node.args) > 1 else 0) % nd
    if any(w.p(a) == PARTIAL for a in parts):
        _bad_partial()
    splits = {w.split(a) for a in parts if w.split(a) is not None}
    if not splits:
        return NodeSplit()
    if len(splits) > 1:
        raise Unsupported("its inputs are split along different dimensions")
    s = splits.pop()
    if s.dim == dim:
        raise Unsupported("it concatenates along the sequence")
    ns = NodeSplit(out=s)
    for a in parts:
        if w.p(a) is None:
            ns.localize[a.name] = s
    return ns


def _bad_partial():
    raise Unsupported("it reads a partial sum over the sequence")


def _reduction(node: fx.Node, w: _Walk) -> NodeSplit:
    src = node.args[0]
    p = w.p(src)
    if p is None:
        return NodeSplit()
    if p == PARTIAL:
        raise Unsupported("it reduces a partial sum over the sequence")
    nd = _val(src).dim()
    dims = node.args[1] if len(node.args) > 1 else None
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        dims = list(range(nd))
    dims = [d % nd for d in ([dims] if isinstance(dims, int) else dims)]
    keep = bool(node.args[2]) if len(node.args) > 2 else bool(node.kwargs.get("keepdim", False))
    if p.dim not in dims:
        shift = 0 if keep else sum(1 for d in dims if d < p.dim)
        return NodeSplit(out=Seq(p.dim - shift, p.inner))
    if node.target is aten.sum.dim_IntList:
        return NodeSplit(out=PARTIAL)
    if node.target is aten.mean.dim:
        return NodeSplit(out=PARTIAL, scale=1.0 / w.n)
    raise Unsupported("it reduces over the sequence")


def _whole_reduction(node: fx.Node, w: _Walk) -> NodeSplit:
    p = w.p(node.args[0])
    if p is None:
        return NodeSplit()
    if p == PARTIAL:
        raise Unsupported("it reduces a partial sum over the sequence")
    if node.target is aten.sum.default:
        return NodeSplit(out=PARTIAL)
    return NodeSplit(out=PARTIAL, scale=1.0 / w.n)


def _softmax(node: fx.Node, w: _Walk) -> NodeSplit:
    s = w.split(node.args[0])
    if s is None:
        return NodeSplit(out=w.p(node.args[0]))
    if node.args[1] % _val(node).dim() == s.dim:
        raise Unsupported("it normalises over the sequence")
    return NodeSplit(out=s)


def _norm(node: fx.Node, w: _Walk) -> NodeSplit:
    s = w.split(node.args[0])
    if s is None:
        return NodeSplit(out=w.p(node.args[0]))
    nd = _val(node.args[0]).dim()
    if s.dim >= nd - len(node.args[1]):
        raise Unsupported("it normalises over the sequence")
    return NodeSplit(out=s)


def _matmul(node: fx.Node, w: _Walk) -> NodeSplit:
    if node.target is aten.addmm.default:
        bias, a, b = node.args[:3]
    elif node.target is aten.linear.default:
        a, wt = node.args[:2]
        if w.p(wt) is not None:
            raise Unsupported("its weight is split along the sequence")
        s = w.split(a)
        if s is None:
            return NodeSplit(out=w.p(a) if w.p(a) != PARTIAL else _bad_partial())
        if s.dim == _val(a).dim() - 1:
            raise Unsupported("it contracts the sequence dimension")
        return NodeSplit(out=s)
    else:
        bias, (a, b) = None, node.args[:2]
    if w.p(a) == PARTIAL or w.p(b) == PARTIAL:
        _bad_partial()
    sa, sb = w.split(a), w.split(b)
    na, nb, no = _val(a).dim(), _val(b).dim(), _val(node).dim()
    if na < 2 or nb < 2:
        raise Unsupported("a matrix-vector product")
    ns = NodeSplit()
    if sa is not None and sa.dim == na - 1:  # contracts the split dimension of a
        if sb is not None and sb.dim == nb - 2:
            raise Unsupported("it contracts two values split along the sequence")
        ns.gather[a.name] = sa
        sa = None
    if sb is not None and sb.dim == nb - 2:  # probs @ v: gather v
        ns.gather[b.name] = sb
        sb = None
    if sb is not None and sb.dim == nb - 1 and sa is not None and sa.dim == na - 2:  # q @ k^T
        ns.gather[b.name] = sb
        sb = None
    out = None
    if sa is not None:
        out = Seq(sa.dim + no - na, sa.inner)
    if sb is not None:
        ob = Seq(sb.dim + no - nb, sb.inner)
        if out is not None and out != ob:
            raise Unsupported("its operands are split along different dimensions")
        out = ob
    if out is not None and out.dim < no - 2:  # a batch dimension: the other operand's too
        other, n_other = (b, nb) if sa is not None else (a, na)
        if w.split(other) is None:
            j = out.dim - (no - n_other)
            if j >= 0 and _shape(other)[j] != 1:
                ns.localize[other.name] = Seq(j, out.inner)
    if bias is not None and out is not None and w.p(bias) is None:
        shape = _shape(bias)
        j = out.dim - (no - len(shape))
        if j >= 0 and shape[j] != 1:
            ns.localize[bias.name] = Seq(j, out.inner)
    ns.out = out
    return ns


def _einsum(node: fx.Node, w: _Walk) -> NodeSplit:
    """An einsum keeps the sequence's letter where the output has it (whole operands with it
    indexed by this rank's positions); it gathers an operand whose sequence it contracts
    (``probs @ v``), and one whose sequence becomes a second output letter (``q @ k^T``)."""
    eq, ops = str(node.args[0]).replace(" ", ""), list(node.args[1])
    if "->" not in eq or "." in eq:
        raise Unsupported("an einsum without an explicit output, or with '...'")
    ins, out = eq.split("->")
    terms = ins.split(",")
    if any(w.p(a) == PARTIAL for a in ops):
        _bad_partial()
    split = {}  # operand index -> its sequence's letter
    for i, a in enumerate(ops):
        s = w.split(a)
        if s is not None:
            if s.inner != 1:
                raise Unsupported("an operand with the sequence merged into a dimension")
            split[i] = terms[i][s.dim]
    ns = NodeSplit()
    contracted = [i for i, ch in split.items() if ch not in out]
    if len(contracted) > 1 and len({split[i] for i in contracted}) < len(contracted):
        raise Unsupported("it contracts two values split along the sequence")
    kept = [i for i in split if i not in contracted]
    gathered = contracted + [i for i in kept if split[i] != split[kept[0]]] if kept else contracted
    for i in gathered:
        ns.gather[ops[i].name] = w.split(ops[i])
    kept = [i for i in kept if i not in gathered]
    if not kept:
        return ns
    letter = split[kept[0]]
    full = _shape(ops[kept[0]])[terms[kept[0]].index(letter)]
    for i, a in enumerate(ops):
        if i not in split and letter in terms[i]:
            j = terms[i].index(letter)
            if _shape(a)[j] == full:
                ns.localize[a.name] = Seq(j)
            elif _shape(a)[j] != 1:
                raise Unsupported(f"operand {a.name} has {_shape(a)[j]} along the sequence")
    ns.out = Seq(out.index(letter))
    return ns


def sdpa_args(node: fx.Node) -> dict:
    """The attention node's arguments by name (query, key, value, attn_mask, is_causal...)."""
    got = normalize_function(node.target, tuple(node.args), dict(node.kwargs),
                             normalize_to_only_use_kwargs=True)
    return dict(got.kwargs) if got is not None else {}


def _sdpa(node: fx.Node, w: _Walk) -> NodeSplit:
    args = sdpa_args(node)
    q, k, v = args["query"], args["key"], args["value"]
    sq = w.split(q)
    nouts = len(node.meta["val"]) if isinstance(node.meta.get("val"), (tuple, list)) else 0
    if sq is None:
        if w.split(k) or w.split(v):
            raise Unsupported("its keys are split along the sequence but not its queries")
        return NodeSplit(out=tuple(None for _ in range(nouts)) if nouts else None)
    nd = _val(q).dim()
    if sq.dim != nd - 2 or sq.inner != 1:
        raise Unsupported("its queries are split along a dimension that is not the sequence's")
    ns = NodeSplit(out=sq)
    for x in (k, v):
        s = w.split(x)
        if s is None:
            continue
        if s.dim != nd - 2:
            raise Unsupported("its keys or values are split along another dimension")
        ns.gather[x.name] = s
    mask = args.get("attn_mask")
    if isinstance(mask, fx.Node):
        s = w.split(mask)
        mshape = _shape(mask)
        qd = len(mshape) - 2  # the mask's query dimension
        if s is not None and s.dim == len(mshape) - 1:
            ns.gather[mask.name] = s
            if mask.name in ns.gather and _needs_grad(mask):
                raise Unsupported("its additive mask is split along the keys and needs a "
                                  "gradient")
        elif s is None and qd >= 0 and mshape[qd] != 1:
            ns.localize[mask.name] = Seq(qd)
        elif s is not None and s.dim != qd:
            raise Unsupported("its mask is split along a batch dimension")
    if args.get("is_causal"):
        ns.causal = True
    if (w.ring and node.target is aten.scaled_dot_product_attention.default
            and not args.get("dropout_p") and len(ns.gather) == 2
            and set(ns.gather) == {k.name, v.name}):  # the mask (if any): this rank's rows
        ns.gather, ns.ring = {}, True
    if nouts:  # the CPU kernel: (output, logsumexp, ...)
        ns.out = tuple(sq if i < 2 else None for i in range(nouts))
    return ns


def _embedding(node: fx.Node, w: _Walk) -> NodeSplit:
    table, ids = node.args[:2]
    if w.p(table) is not None:
        raise Unsupported("its table is split along the sequence")
    return NodeSplit(out=w.p(ids))


def _cross_entropy(node: fx.Node, w: _Walk) -> NodeSplit:
    x, target = node.args[:2]
    weight = node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")
    reduction = node.args[3] if len(node.args) > 3 else node.kwargs.get("reduction", 1)
    s = w.split(x)
    if s is None:
        if w.split(target) is not None:
            raise Unsupported("its targets are split along the sequence but not its logits")
        return NodeSplit(out=w.p(x))
    nd = _val(x).dim()
    if s.dim == 1 and nd > 1:
        raise Unsupported("its classes are split along the sequence")
    ns = NodeSplit()
    ts = Seq(s.dim - 1 if s.dim > 1 else s.dim, s.inner)  # targets lack the class dimension
    t_place = w.p(target)
    if t_place is None:
        ns.localize[target.name] = ts
    elif t_place != ts:
        raise Unsupported("its targets are split unlike its logits")
    if reduction == 0:
        ns.out = ts
    elif reduction == 2:
        ns.out = PARTIAL
    else:
        if isinstance(weight, fx.Node):
            raise Unsupported("a mean cross entropy with class weights")
        ns.out = PARTIAL
        ns.loss_count = "whole" if t_place is None else "reduce"
    return ns


def _getitem(node: fx.Node, w: _Walk) -> NodeSplit:
    src = node.args[0]
    out = w.nodes[src.name].out if src.name in w.nodes else None
    return NodeSplit(out=out[node.args[1]] if isinstance(out, tuple) else None)


def _like(node: fx.Node, w: _Walk) -> NodeSplit:
    p = w.p(node.args[0])
    return NodeSplit(out=p if isinstance(p, Seq) else None)


def _rule(node: fx.Node):
    t = node.target
    if t is operator.getitem:
        return _getitem
    if t in (aten.linear.default, aten.addmm.default, aten.mm.default, aten.bmm.default,
             aten.matmul.default):
        return _matmul
    if t in _SDPA:
        return _sdpa
    if t is aten.einsum.default:
        return _einsum
    if t is aten.embedding.default:
        return _embedding
    if t is aten.cross_entropy_loss.default:
        return _cross_entropy
    if t in _VIEWS:
        return _view
    if t is aten.expand.default:
        return _expand
    if t in (aten.permute.default, aten.transpose.int, aten.t.default):
        return _permute
    if t in (aten.slice.Tensor, aten.select.int, aten.narrow.default):
        return _shrink
    if t in (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
             aten.unbind.int):
        return _split
    if t is aten.cat.default:
        return _cat
    if t in (aten.sum.dim_IntList, aten.mean.dim) or t in _REDUCTIONS:
        return _reduction
    if t in (aten.sum.default, aten.mean.default):
        return _whole_reduction
    if t in _SOFTMAX:
        return _softmax
    if t in (aten.layer_norm.default, aten.rms_norm.default):
        return _norm
    if t in _LIKE:
        return _like
    if isinstance(t, torch._ops.OpOverload) and (torch.Tag.pointwise in t.tags
                                                 or t in _POINTWISE_EXTRA):
        return _pointwise
    return None


# ----------------------------------------------------------------------------- walk
def analyse(gm: fx.GraphModule, n: int, seq: int, inputs: dict[str, Place] | None = None,
            ring: bool = False) -> ContextSplit:
    """Place every value of ``gm`` on ``n`` ranks splitting a sequence of ``seq`` positions
    (see the module doc).

    Args:
        gm: an exported aten graph with ``meta["val"]`` (a whole model or a pipeline stage).
        n: the context-parallel degree.
        seq: the sequence length of a micro-batch.
        inputs: placeholder name -> placement of the values a stage receives from other
            stages (default: whole; model inputs are whole on every rank).
        ring: run ``scaled_dot_product_attention`` as ring attention where it can (no
            dropout, no mask split along its keys), else all-gather keys and values.

    Raises:
        ContextError: a node the split cannot run (one line: the op, its source line, why).
    """
    w = _Walk(n, seq, dict(inputs or {}), ring)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            w.nodes[node.name] = NodeSplit(out=w.inputs.get(node.name))
            continue
        if node.op != "call_function":
            w.nodes[node.name] = NodeSplit()
            continue
        name = _opname(node)
        ins = _tensor_args(node)
        placed = any(_placed(w, a) for a in node.all_input_nodes)
        try:
            if name in OTHER_ATTENTION:  # (the CPU kernel of SDPA is split, in _SDPA)
                if placed or _entry_like(node, w):
                    raise ContextError(
                        f"context parallelism cannot split the attention kernel {name} at "
                        f"{where(node)}: only scaled_dot_product_attention (and its CPU kernel) "
                        "or attention written as matmuls are split; use attn_implementation "
                        "'sdpa' or 'eager', or parallel.context: 1")
            if not placed and node.target in _ENTRY:
                ns = _entry(node, w) or NodeSplit()
            elif not placed:
                ns = NodeSplit(out=_whole_out(node))
            else:
                rule = _rule(node)
                if rule is None:
                    raise Unsupported("no context-parallel rule for it")
                ns = rule(node, w)
        except Unsupported as e:
            ns = _gathered(node, w, str(e))
        w.nodes[node.name] = ns
    _localize_early(gm, w)
    _gather_early(gm, w)
    return ContextSplit(n, seq, w.nodes)


#: ops that only rearrange or repeat a value (an attention's keys and values after
#: grouped-query ``repeat_kv``): an all-gather moves before them, on fewer bytes
_REARRANGE = {aten.expand.default, aten.unsqueeze.default, aten.view.default,
              aten.reshape.default, aten._unsafe_view.default, aten.transpose.int,
              aten.permute.default, aten.clone.default, aten.contiguous.default}


def _gather_early(gm: fx.GraphModule, w: _Walk) -> None:
    """An all-gather of a value made only by rearranging another split value for this one
    reader (grouped-query attention repeats its key/value heads before attention) gathers
    that value instead, and the rearranging runs on the whole of it: the same result for
    ``1/repeats`` of the bytes."""
    nodes = {x.name: x for x in gm.graph.nodes}
    for reader in gm.graph.nodes:
        ns = w.nodes.get(reader.name)
        if ns is None or not ns.gather:
            continue
        for name in list(ns.gather):
            chain, v = [], nodes[name]  # the rearranging nodes, from the reader up
            while (v.op == "call_function" and v.target in _REARRANGE and len(v.users) == 1
                   and isinstance(w.p(v.args[0]), Seq) and not w.nodes[v.name].localize
                   and not w.nodes[v.name].gather):
                chain.append(v)
                v = v.args[0]
            if not chain:
                continue
            del ns.gather[name]  # the reader reads the chain's end whole
            for c in chain[:-1]:
                w.nodes[c.name] = NodeSplit()
            w.nodes[chain[-1].name] = NodeSplit(gather={v.name: w.p(v)})


def _localize_early(gm: fx.GraphModule, w: _Walk) -> None:
    """A whole value every reader indexes by this rank's positions alike is computed on them
    instead, from its inputs' positions (back through pointwise ops, ``unsqueeze``,
    ``expand``, ``cat`` and embedding lookups to where it starts: an ``arange``, a parameter, a model input):
    a causal mask ``[.., S, S]`` built from position ids is then ``[.., S/N, S]`` on each rank,
    never whole, and a rotary table ``1/N`` of it."""
    for v in reversed(list(gm.graph.nodes)):
        ns = w.nodes.get(v.name)
        if v.op != "call_function" or ns is None or ns.out is not None or not v.users:
            continue
        wanted = {w.nodes[u.name].localize.get(v.name) if u.name in w.nodes else None
                  for u in v.users}
        if len(wanted) != 1 or None in wanted or any(
                w.nodes[u.name].loss_count == "whole" for u in v.users):
            continue  # (a mean loss counts its targets on the whole of them)
        s = wanted.pop()
        try:
            edges, shape = _inputs_at(v, s, w)
        except Unsupported:
            continue
        ns.out, ns.shape = s, shape
        ns.localize.update(edges)
        for u in v.users:
            del w.nodes[u.name].localize[v.name]


def _inputs_at(v: fx.Node, s: Seq, w: _Walk) -> tuple[dict[str, Seq], list | None]:
    """What ``v`` (whole) reads of each input to compute its positions ``s`` instead, and its
    new shape argument; Unsupported where it cannot."""
    t, out = v.target, _shape(v)
    nd = len(out)
    edges: dict[str, Seq] = {}

    def aligned(a: fx.Node, j: int) -> None:
        shape = _shape(a)
        if j < 0 or shape[j] == 1:
            return
        if shape[j] != out[s.dim] or w.p(a) is not None:
            raise Unsupported("not aligned")
        edges[a.name] = Seq(j, s.inner)

    if t is aten.unsqueeze.default:
        d = v.args[1] % nd
        if d == s.dim:
            raise Unsupported("the new dimension")
        aligned(v.args[0], s.dim if s.dim < d else s.dim - 1)
        return edges, None
    if t is aten.expand.default:
        src = v.args[0]
        aligned(src, s.dim - (nd - _val(src).dim()))
        shape = list(v.args[1])
        if shape[s.dim] != -1:
            shape[s.dim] = out[s.dim] // w.n
        return edges, shape
    if t is aten.embedding.default and s.dim < _val(v.args[1]).dim():
        aligned(v.args[1], s.dim)  # the rows of this rank's ids
        return edges, None
    if t is aten.cat.default:
        if (v.args[1] if len(v.args) > 1 else 0) % nd == s.dim:
            raise Unsupported("along the sequence")
        for a in v.args[0]:
            aligned(a, s.dim)
        return edges, None
    if isinstance(t, torch._ops.OpOverload) and (torch.Tag.pointwise in t.tags
                                                 or t in _POINTWISE_EXTRA):
        for a in _tensor_args(v):
            aligned(a, s.dim - (nd - _val(a).dim()))
        return edges, None
    raise Unsupported("no rule")


def _placed(w: _Walk, a: fx.Node) -> bool:
    out = w.nodes[a.name].out if a.name in w.nodes else None
    return any(x is not None for x in out) if isinstance(out, tuple) else out is not None


def _entry_like(node: fx.Node, w: _Walk) -> bool:
    return any(_val(a) is not None and _val(a).dim() >= 3 and w.seq in _shape(a)
               for a in _tensor_args(node))


def _whole_out(node: fx.Node):
    v = node.meta.get("val")
    return tuple(None for _ in v) if isinstance(v, (tuple, list)) else None


def _gathered(node: fx.Node, w: _Walk, why: str) -> NodeSplit:
    """A node with no rule for its split inputs: run whole on all-gathered inputs where none
    of them needs a gradient, else refuse (ContextError)."""
    ins = _tensor_args(node)
    if any(w.p(a) == PARTIAL for a in ins) or any(
            w.split(a) is not None and _needs_grad(a) for a in ins):
        raise ContextError(
            f"context parallelism cannot split {_opname(node)} at {where(node)}: {why}; "
            "parallel.context splits token-local layers and attention (see the README's "
            "context parallelism section), or use parallel.context: 1")
    return NodeSplit(out=_whole_out(node),
                     gather={a.name: w.split(a) for a in ins if w.split(a) is not None})


def sequence_length(gm: fx.GraphModule) -> int:
    """The sequence length of the model's inputs: dimension 1 of its first input with two or
    more dimensions (token ids ``[B, S]``).

    Raises:
        ContextError: no input has two dimensions.
    """
    for p in gm.graph.find_nodes(op="placeholder"):
        v = _val(p)
        if v is not None and v.dim() >= 2:
            return int(v.shape[1])
    raise ContextError("context parallelism splits the sequence of the model's inputs "
                       "(dimension 1 of [batch, sequence, ...]), but no input has two "
                       "dimensions")
