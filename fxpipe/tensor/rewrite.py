"""Apply a :class:`~fxpipe.tensor.analysis.Sharding` to a stage: this rank's parameter shards
and a graph that runs on them, with the tensor group's collectives inserted.

:func:`shard_stage` keeps the stage's calling convention (inputs and outputs replicated, in the
plan's order and shapes; a vocabulary-parallel model output stays sharded when the analysis says
so), so the executor and the schedules do not change: a stage stays a callable with F, B and W.
Parameters keep their original names; a sharded one is replaced by a new ``nn.Parameter``
holding this rank's slice (shared between the stages of one rank that tie it).
"""

from __future__ import annotations

import operator
from typing import Callable

import torch
import torch.fx as fx
import torch.nn as nn

from fxpipe.execution.rebuild import rebuilt
from fxpipe.tensor import collectives as C
from fxpipe.tensor.analysis import Edge, NodeShard, Sharding
from fxpipe.tensor.overlap import MATMULS, Site, assemble, find_sites, take
from fxpipe.tensor.placement import Placement

aten = torch.ops.aten


def local_slice(t: torch.Tensor, p: Placement, rank: int, n: int) -> torch.Tensor:
    """Rank ``rank``'s part (of ``n``) of a whole tensor placed ``p`` (a copy)."""
    if not p.sharded:
        return t.detach().clone()
    if p.blocks == 1:
        return t.detach().chunk(n, dim=p.dim)[rank].clone()
    return torch.cat([b.chunk(n, dim=p.dim)[rank] for b in t.detach().chunk(p.blocks, dim=p.dim)],
                     dim=p.dim).clone()


def whole_from(parts: list[torch.Tensor], p: Placement) -> torch.Tensor:
    """The whole tensor from every rank's part, in rank order (the inverse of
    :func:`local_slice`)."""
    if not p.sharded:
        return parts[0]
    if p.blocks == 1:
        return torch.cat(parts, dim=p.dim)
    split = [x.chunk(p.blocks, dim=p.dim) for x in parts]
    return torch.cat([split[r][k] for k in range(p.blocks) for r in range(len(parts))], dim=p.dim)


def _set(root: nn.Module, path: str, value: nn.Parameter) -> None:
    *prefix, leaf = path.split(".")
    mod = root
    for item in prefix:
        mod = getattr(mod, item)
    if leaf in mod._parameters:
        mod._parameters[leaf] = value
    else:
        setattr(mod, leaf, value)


def named(fn: Callable, name: str) -> Callable:
    """``fn`` named ``name`` (a graph node's target: what the printed graph and errors show)."""
    fn.__name__ = fn.__qualname__ = name
    return fn


class _Ops:
    """The collectives of one stage, bound to its group (graph targets are closures: a process
    group is not a graph constant)."""

    def __init__(self, group, rank: int, t: int):
        self.group, self.rank, self.t = group, rank, t
        self._cache: dict[tuple, Callable] = {}

    def get(self, key: tuple) -> Callable:
        if key not in self._cache:
            self._cache[key] = self._make(*key)
        return self._cache[key]

    def _make(self, kind: str, *args) -> Callable:
        g = self.group
        if kind == "copy_to":
            return named(lambda x: C.copy_to(x, g), "tp_copy_to")
        if kind == "reduce_from":
            return named(lambda x: C.reduce_from(x, g), "tp_all_reduce")
        if kind == "gather":
            dim, blocks, partial = args
            return named(lambda x: C.gather(x, dim, blocks, partial, g),
                          "tp_all_gather_rs" if partial else "tp_all_gather")
        if kind == "scatter":
            dim, blocks = args
            return named(lambda x: C.scatter(x, dim, blocks, g), "tp_scatter")
        if kind == "reduce_scatter":
            (dim,) = args
            return named(lambda x: C.reduce_scatter(x, dim, g), "tp_reduce_scatter")
        if kind == "overlap_state":
            return named(lambda: C.overlap_state(), "tp_overlap_state")
        if kind == "reduce_start":
            rkind, dim = args
            return named(lambda y, state, c: C.reduce_start(y, state, c, rkind, dim, g),
                          "tp_reduce_start")
        if kind == "reduce_join":
            rkind, dim = args
            return named(lambda state, *tokens: C.reduce_join(state, rkind, dim, g, *tokens),
                          "tp_reduce_join")
        if kind == "input_start":
            ikind, dim, k = args
            return named(lambda x, state: C.input_start(x, state, ikind, dim, k, g),
                          "tp_input_start")
        if kind == "input_wait":
            ikind, dim = args
            return named(lambda token, state, c: C.input_wait(token, state, c, ikind, dim, g),
                          "tp_input_wait")
        if kind == "vocab_embedding":
            start, pad = args
            return named(lambda w, ids: C.vocab_embedding(w, ids, start, pad),
                          "tp_vocab_embedding")
        if kind == "vocab_cross_entropy":
            (start,) = args

            def ce(logits, target, weight=None, reduction=1, ignore_index=-100,
                   label_smoothing=0.0):
                return C.vocab_cross_entropy(logits, target, start, ignore_index, reduction, g)
            return named(ce, "tp_vocab_cross_entropy")
        raise ValueError(kind)


def shard_parameters(module: nn.Module, sharding: Sharding, rank: int,
                     done: dict[int, nn.Parameter]) -> None:
    """Replace every sharded parameter of ``module`` (found by get_attr target, replaced under
    every name that holds it: a tied alias too) with this rank's slice; ``done`` maps an
    original parameter's id to its slice (tied across the stages of a rank)."""
    t = sharding.t
    placement: dict[int, Placement] = {}
    for target, p in sharding.params.items():
        if not p.sharded:
            continue
        try:
            placement[id(module.get_parameter(target))] = p
        except AttributeError:
            continue
    for name, old in list(module.named_parameters(remove_duplicate=False)):
        p = placement.get(id(old))
        if p is None:
            continue
        if id(old) not in done:
            done[id(old)] = nn.Parameter(local_slice(old, p, rank, t),
                                         requires_grad=old.requires_grad)
        _set(module, name, done[id(old)])


def shard_stage(gm: fx.GraphModule, sharding: Sharding, group, rank: int,
                done: dict[int, nn.Parameter] | None = None, overlap: int = 1
                ) -> fx.GraphModule:
    """The stage ``gm`` running on this rank's shards: parameters replaced
    (:func:`shard_parameters`), the graph rewritten node by node as ``sharding`` decides;
    with ``overlap`` > 1 the collectives of :func:`fxpipe.tensor.overlap.find_sites`'s sites
    run in that many chunks, overlapped with the matmuls.
    ``gm`` is not changed; the new module shares its unsharded parameters."""
    out = rebuilt(gm, gm.graph)  # new container modules, the same tensors
    shard_parameters(out, sharding, rank, {} if done is None else done)
    ops = _Ops(group, rank, sharding.t)
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    converted: dict[tuple, fx.Node] = {}
    sites = find_sites(gm, sharding, overlap)
    ahead: dict[str, fx.Node] = {}  # readers of an input site, emitted with its first reader
    by_name = {n.name: n for n in gm.graph.nodes}

    def read(a: fx.Node, e: Edge | None) -> fx.Node:
        base = env[a.name]
        if e is None or (e.convert == "none" and not e.partial_grad):
            return base
        key = (a.name, e)
        if key not in converted:
            if e.convert == "gather":
                fn = ops.get(("gather", e.src.dim, e.src.blocks, e.partial_grad))
            elif e.convert == "slice":
                fn = ops.get(("scatter", e.dst.dim, e.dst.blocks))
            else:
                fn = ops.get(("copy_to",))
            converted[key] = graph.call_function(fn, (base,))
        return converted[key]

    def mapped(n: fx.Node, ns: NodeShard):
        return fx.map_arg((n.args, n.kwargs), lambda a: read(a, ns.edges.get(a.name)))

    for n in gm.graph.nodes:
        ns = sharding.nodes.get(n.name)
        if n.op == "placeholder":
            env[n.name] = graph.placeholder(n.name, type_expr=n.type)
        elif n.op == "get_attr":
            env[n.name] = graph.get_attr(n.target)
        elif n.op == "output":
            args, _ = mapped(n, ns)
            graph.output(args[0])
        elif n.name in ahead:
            env[n.name] = ahead.pop(n.name)
        elif n.name in sites and sites[n.name].kind == "reduce":
            env[n.name] = _emit_reduce_site(graph, n, ns, mapped(n, ns), ops, sites[n.name],
                                            overlap)
        elif n.name in sites:
            site = sites[n.name]
            x = by_name[site.value]
            readers = [by_name[u] for u in site.matmuls]

            def args_of(u: fx.Node, piece: fx.Node):
                nsu = sharding.nodes[u.name]
                return fx.map_arg((u.args, u.kwargs), lambda a: piece if a is x
                                  else read(a, nsu.edges.get(a.name)))
            made = _emit_input_site(graph, env[x.name], readers, args_of, ops, site, overlap)
            for u, node in zip(readers, made):
                node.meta = dict(u.meta)
                ahead[u.name] = node
            env[n.name] = ahead.pop(n.name)
        else:
            env[n.name] = _emit(graph, n, ns, mapped(n, ns), ops, sharding.t)
        if n.op != "output":
            env[n.name].meta = dict(n.meta)
    graph.lint()
    return rebuilt(out, graph, class_name=type(gm).__name__)


def _emit(graph: fx.Graph, n: fx.Node, ns: NodeShard, mapped, ops: _Ops, t: int) -> fx.Node:
    args, kwargs = mapped
    args = list(args)
    for i, v in ns.local.items():
        args[i] = v
    if ns.impl == "row":
        if n.target is aten.linear.default:
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            y = graph.call_function(aten.linear.default, (args[0], args[1]))
        elif n.target is aten.addmm.default:
            bias = args[0]
            y = graph.call_function(aten.mm.default, (args[1], args[2]))
        else:
            bias = None
            y = graph.call_function(aten.mm.default, (args[0], args[1]))
        y = _reduce(graph, y, ns, ops)
        return graph.call_function(aten.add.Tensor, (y, bias)) if bias is not None else y
    if ns.impl == "contract":
        y = graph.call_function(n.target, tuple(args), kwargs)
        return _reduce(graph, y, ns, ops)
    if ns.impl == "vocab_embedding":
        w = n.args[0]
        rows = int(w.meta["val"].shape[0]) // t if "val" in w.meta else None
        pad = args[2] if len(args) > 2 else kwargs.get("padding_idx", -1)
        fn = ops.get(("vocab_embedding", ops.rank * rows, int(pad)))
        y = graph.call_function(fn, (args[0], args[1]))
        return _reduce(graph, y, ns, ops)
    if ns.impl == "vocab_cross_entropy":
        classes = int(n.args[0].meta["val"].shape[1]) // t
        fn = ops.get(("vocab_cross_entropy", ops.rank * classes))
        return graph.call_function(fn, tuple(args), kwargs)
    return graph.call_function(n.target, tuple(args), kwargs)


def _reduce(graph: fx.Graph, y: fx.Node, ns: NodeShard, ops: _Ops) -> fx.Node:
    kind, dim = ns.reduce
    fn = ops.get(("reduce_from",)) if kind == "all_reduce" else ops.get(("reduce_scatter", dim))
    return graph.call_function(fn, (y,))


def _emit_reduce_site(graph: fx.Graph, n: fx.Node, ns: NodeShard, mapped, ops: _Ops,
                      site: Site, k: int) -> fx.Node:
    """A row-parallel matmul in ``k`` chunks, each chunk's reduction started as soon as its
    product is there (:mod:`fxpipe.tensor.overlap`)."""
    args, kwargs = mapped
    kind, dim = ns.reduce
    i = MATMULS[n.target]
    x = args[i]
    if n.target is aten.linear.default:
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
    else:
        bias = args[0] if n.target is aten.addmm.default else None
    w = args[1] if n.target is aten.linear.default else args[i + 1]
    op = aten.linear.default if n.target is aten.linear.default else aten.mm.default
    blocks = ops.t if kind == "reduce_scatter" else 1
    state = graph.call_function(ops.get(("overlap_state",)), ())
    start = ops.get(("reduce_start", kind, dim))
    tokens = []
    for c in range(k):
        piece = graph.call_function(take, (x, site.dim, blocks, k, c))
        y = graph.call_function(op, (piece, w))
        tokens.append(graph.call_function(start, (y, state, c)))
    joined = graph.call_function(ops.get(("reduce_join", kind, dim)), (state, *tokens))
    parts = [graph.call_function(operator.getitem, (joined, c)) for c in range(k)]
    y = graph.call_function(assemble, (parts, site.dim, 1))
    return graph.call_function(aten.add.Tensor, (y, bias)) if bias is not None else y


def _emit_input_site(graph: fx.Graph, x: fx.Node, readers: list[fx.Node], args_of,
                     ops: _Ops, site: Site, k: int) -> list[fx.Node]:
    """The column-parallel ``readers`` of ``x`` in ``k`` chunks: every chunk's all-gather
    started first, each chunk's matmuls waiting for their own; backward, each chunk's
    input-gradient collective started as soon as it is computed. Returns the readers' outputs."""
    state = graph.call_function(ops.get(("overlap_state",)), ())
    tokens = graph.call_function(ops.get(("input_start", site.collective, site.dim, k)),
                                 (x, state))
    wait = ops.get(("input_wait", site.collective, site.dim))
    outs: list[list[fx.Node]] = [[] for _ in readers]
    for c in range(k):
        token = graph.call_function(operator.getitem, (tokens, c))
        piece = graph.call_function(wait, (token, state, c))
        for j, u in enumerate(readers):
            args, kwargs = args_of(u, piece)
            outs[j].append(graph.call_function(u.target, tuple(args), kwargs))
    blocks = 1 if site.collective == "copy_to" else ops.t
    return [graph.call_function(assemble, (parts, site.dim, blocks)) for parts in outs]
