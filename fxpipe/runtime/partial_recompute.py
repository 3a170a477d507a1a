"""Partial activation recomputation (``train.recompute_layers``, ``StagePlan.recompute_blocks``):
a stage recomputes its first N blocks and keeps the activations of the rest.

The stage's graph is split in two at one point of its node order (:func:`split_head`): the
*head* is the stage's nodes before the first node of its block N+1 (its first N blocks, what
precedes them on the stage: an embedding, values the stage rebuilds, and the nodes between
block N and block N+1); where the stage has no block N+1, the head runs through the last node
of its last block. The *tail* is the rest (later blocks, and what follows the last block: a
final norm, the head of the model), run as usual. A node's block is its module path's
(:func:`fxpipe.plans.param_blocks.block_of`, from ``meta['nn_module_stack']``); nodes outside
every block (collectives a tensor-parallel rewrite added, a parent's residual add) go where
they stand in the order.

Per micro-batch (:class:`Partial`): the first forward runs the head keeping nothing
(:func:`~fxpipe.runtime.recompute.forward_keeping_inputs`: the stage's inputs and the
random-number state stay), then the tail on the head's outputs made autograd leaves (detached,
floating ones requiring gradients): what stays is the stage's inputs, the head's outputs the
tail reads or the stage returns, and the tail's saved activations. B runs the tail's backward
first (to the head's outputs and the inputs the tail reads), then the head's forward again
(:func:`~fxpipe.runtime.recompute.replay`, once, in the first forward's random-number state)
and its backward from the head outputs' gradients; under a split backward both halves are
split (:mod:`fxpipe.runtime.backward_split`) and W runs both. Both halves are GraphModules over
the stage module: they hold its Parameter objects under the same names, so state dicts,
optimizers and checkpoints see the stage unchanged. Exact: the same ops on the same values
(only the sums of a received input's gradient over the two halves are added in another order).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn

from fxpipe.errors import RuntimeFailure
from fxpipe.execution.rebuild import rebuilt
from fxpipe.plans.param_blocks import block_of
from fxpipe.runtime.backward_split import WeightWork, backward_input, backward_weight
from fxpipe.runtime.recompute import Replay, forward_keeping_inputs, replay

__all__ = ["Partial", "PartialReplay", "backward_weights", "node_block", "split_head"]

_COMPUTE = ("call_function", "call_method", "call_module")


def node_block(node: fx.Node) -> str | None:
    """The block a graph node lies in (its innermost module path's), or None."""
    if node.op == "call_module":
        return block_of(str(node.target))
    path = ""
    for v in (node.meta.get("nn_module_stack") or {}).values():
        path = v[0] if isinstance(v, tuple) else str(v)
    return block_of(path) if path else None


def _head_end(nodes: list[fx.Node], n: int) -> tuple[int, int]:
    """``(position in nodes where the tail starts, blocks on the stage)`` for ``n`` blocks."""
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, node in enumerate(nodes):
        b = node_block(node)
        if b is not None:
            first.setdefault(b, i)
            last[b] = i
    order = list(first)
    if len(order) > n:
        return first[order[n]], len(order)
    return (max(last.values()) + 1 if last else 0), len(order)


def split_head(gm: nn.Module, n: int, stage: int = 0) -> tuple[fx.GraphModule, fx.GraphModule,
                                                               int]:
    """The head (first ``n`` blocks) and tail of stage graph ``gm`` (see the module doc):
    ``head(*inputs) -> tuple(head outputs)``, ``tail(*inputs, *head outputs) -> gm's
    outputs``; and how many of the head's outputs there are.

    Raises:
        RuntimeFailure: ``gm`` is not a graph module, or its graph holds no block.
    """
    if not isinstance(gm, fx.GraphModule):
        raise RuntimeFailure(f"stage {stage}: partial recomputation (recompute_blocks={n}) "
                             "splits the stage's traced graph, but the stage module is a "
                             f"{type(gm).__name__}; build the stage modules from the plan")
    graph = gm.graph
    placeholders = [x for x in graph.nodes if x.op == "placeholder"]
    compute = [x for x in graph.nodes if x.op in _COMPUTE]
    output = next(iter(graph.find_nodes(op="output")))
    end, blocks = _head_end(compute, n)
    if blocks == 0:
        raise RuntimeFailure(f"stage {stage}: partial recomputation (recompute_blocks={n}) "
                             "needs the stage's blocks (nodes of a module list's layers), but "
                             "its graph has none; set recompute_blocks 0 (the whole stage)")
    head_nodes = set(compute[:end])
    tail_nodes = compute[end:]
    later = set(tail_nodes) | {output}
    outs = []  # head values the tail or the stage's output reads, in graph order
    for x in compute[:end]:
        if any(u in later for u in x.users):
            outs.append(x)

    def copy(nodes, extra: list[fx.Node], ret) -> fx.Graph:
        g, env = fx.Graph(), {}
        for p in placeholders + extra:
            env[p] = g.placeholder(p.name)
            env[p].meta = dict(p.meta)
        for x in nodes:
            for a in x.all_input_nodes:
                if a not in env and a.op == "get_attr":
                    env[a] = g.node_copy(a)
            env[x] = g.node_copy(x, env.__getitem__)
        g.output(fx.graph.map_arg(ret, env.__getitem__))
        return g

    head = copy([x for x in compute if x in head_nodes], [], tuple(outs))
    tail = copy(tail_nodes, outs, output.args[0])
    return (rebuilt(gm, head, f"{type(gm).__name__}Head"),
            rebuilt(gm, tail, f"{type(gm).__name__}Tail"), len(outs))


@dataclass
class PartialReplay:
    """What a partially recomputing micro-batch keeps for its backward: the head's
    :class:`~fxpipe.runtime.recompute.Replay` (inputs, random-number state) and the head's
    outputs as the tail read them (autograd leaves; other values as they were)."""

    head: Replay
    leaves: list[Any]


def _leaf(t: Any) -> Any:
    if isinstance(t, torch.Tensor) and t.dtype.is_floating_point:
        return t.detach().requires_grad_()
    return t


def _add(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    return b if a is None else a if b is None else a + b


class Partial:
    """One stage run with its first ``n`` blocks recomputed (see the module doc)."""

    def __init__(self, module: nn.Module, n: int, stage: int = 0):
        self.head, self.tail, self.n_out = split_head(module, n, stage)

    def forward(self, args: list[Any]) -> tuple[Any, PartialReplay]:
        """First forward of one micro-batch: the stage's outputs (the tail's graph kept; a
        value the head makes is returned as the tail's leaf) and what its backward needs."""
        h, rep = forward_keeping_inputs(self.head, args, None)
        leaves = [_leaf(t) for t in h]
        return self.tail(*args, *leaves), PartialReplay(rep, leaves)

    def backward(self, rep: PartialReplay, tensors: list[torch.Tensor], grads: list,
                 inputs: list[torch.Tensor], params: list[torch.Tensor], split: bool,
                 autocast: Callable[[], AbstractContextManager] = nullcontext
                 ) -> tuple[list[torch.Tensor | None], list[WeightWork] | None]:
        """B of one micro-batch from the stage's ``tensors`` (outputs, the loss) and their
        ``grads``: the gradients of ``inputs`` (the received leaves; under a whole backward
        their ``.grad`` is accumulated, as a stage's backward does, and read back), and under
        a split backward what W runs (both halves' work). ``autocast``: the forward's
        autocast context (the head runs again under it)."""
        hl = [t for t in rep.leaves if isinstance(t, torch.Tensor) and t.requires_grad]
        if split:
            got, w_tail = backward_input(tensors, grads, list(inputs) + hl, params)
            tail_in, h_grads = got[:len(inputs)], got[len(inputs):]
        else:
            if tensors:
                torch.autograd.backward(tensors, grads)
            h_grads = [t.grad for t in hl]
        with autocast():
            again = replay(self.head, rep.head)
        again = again if isinstance(again, (tuple, list)) else (again,)
        pairs = [(a, g) for a, t, g in zip([a for a, t in zip(again, rep.leaves)
                                            if isinstance(t, torch.Tensor) and t.requires_grad],
                                           hl, h_grads)
                 if g is not None and isinstance(a, torch.Tensor) and a.requires_grad]
        rep.leaves = []
        if not split:
            if pairs:
                torch.autograd.backward([a for a, _ in pairs], [g for _, g in pairs])
            return [t.grad for t in inputs], None
        head_in, w_head = backward_input([a for a, _ in pairs], [g for _, g in pairs],
                                         list(inputs), params)
        return [_add(a, b) for a, b in zip(tail_in, head_in)], [w_tail, w_head]


def backward_weights(work: list[WeightWork]) -> None:
    """W of a partially recomputing micro-batch: both halves' weight gradients."""
    for w in work:
        backward_weight(w)
