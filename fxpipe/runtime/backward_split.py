"""Backward split into B (input gradients) and W (weight gradients) without redoing B's work in W.

Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024) run a stage's
backward in two parts: ``B`` computes the gradients of the stage's received inputs (what the
previous stage waits for) and ``W``, later, the parameter gradients. Running B as
``torch.autograd.grad(outputs, inputs)`` and W as ``torch.autograd.backward(outputs,
inputs=params)`` is exact but W walks the whole activation-gradient chain again (each layer's
weight gradient needs the activation gradient above it): B + W then cost about B + a full
backward.

Here the autograd graph of one (stage, micro-batch) is split instead:

* **B region**: the graph nodes from which an input leaf is reachable. B runs exactly these (the
  engine prunes the rest). A B node with children outside the B region is a *boundary* node: a
  pre-hook records the gradient that reaches it during B.
* **W region**: the other nodes; they lead only to parameters. A W node with a parent in the B
  region is an *entry*. W first re-enters each boundary node with its recorded gradient and asks
  only for the gradients of its entry children (for a linear layer this is the weight-gradient
  matmul ``grad^T x``), then runs the W region once from all entries (and from outputs that do not
  depend on any input) to the parameters.

An entry with several incoming edges (a parameter used both on the input path and elsewhere, e.g.
``x * s + s.sum()``) cannot be re-entered from one boundary node alone; the parameters below such
entries get their gradient from one extra call over the whole graph (exact, some B work redone).
A stage without input leaves (the first stage) has an empty B region and W is one full backward.
A compiled stage (``train.compile``, :mod:`fxpipe.execution.compiled_stage`) has one autograd
node per compiled region, whose backward computes every gradient of the region at once, the
weights' included, whichever B asks for: B keeps what such a boundary node returned on its
weight edges (a post-hook) and W starts from those gradients instead of running the region
again; so under compilation B costs the region's whole backward and W only the accumulation.
torch.distributed.pipelining's ``stage_backward_input/weight`` follows a related idea; this is an
independent implementation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node


@dataclass
class WeightWork:
    """What W needs after B (autograd graph references; released by :func:`backward_weight`).

    Attributes:
        reenter: per boundary node: (its output edges, their recorded gradients, the entry edges
            whose gradients W asks for).
        roots: entry key -> gradient added directly (outputs in the W region).
        fast_params: parameters reached through simple entries only (one W-region pass).
        slow: (outputs, gradients, parameters) for parameters below complex entries.
    """

    reenter: list[tuple[list, list[torch.Tensor], list[tuple[Node, int]]]] = field(
        default_factory=list)
    roots: dict[tuple[Node, int], torch.Tensor] = field(default_factory=dict)
    fast_params: list[torch.Tensor] = field(default_factory=list)
    slow: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]] | None = None


def _post_order(roots: list[Node]) -> list[Node]:
    """Autograd nodes reachable from ``roots``, children before parents (iterative DFS)."""
    order, seen, stack = [], set(), [(n, False) for n in roots]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                stack.append((child, False))
    return order


#: autograd nodes that compute every input's gradient in one call whichever are asked for: a
#: torch.compile region (AOTAutograd's backward); W takes their weight edges' gradients from
#: B's call instead of running the region again
_OPAQUE = ("CompiledFunctionBackward",)


def _opaque(node: Node) -> bool:
    return type(node).__name__ in _OPAQUE


def _key(t: torch.Tensor | GradientEdge) -> tuple[Node, int] | None:
    """Where the backward enters an output's graph: ``(node, input number)``, for a tensor
    or a :class:`GradientEdge` (an output whose data the stage released after sending it),
    None for a leaf tensor."""
    if isinstance(t, GradientEdge):
        return t.node, t.output_nr
    return (t.grad_fn, t.output_nr) if t.grad_fn is not None else None


def backward_input(outputs: list, grads: list[torch.Tensor | None],
                   leaves: list[torch.Tensor], params: list[torch.Tensor]
                   ) -> tuple[list[torch.Tensor | None], WeightWork]:
    """B: the gradients of ``leaves`` only; record what :func:`backward_weight` needs.

    Args:
        outputs: tensors to differentiate (stage outputs read by other stages, and the loss),
            or the :class:`GradientEdge` of an output whose data was released once sent.
        grads: gradient of each output, same shape (``None`` for a scalar loss: ones).
        leaves: received inputs (leaf tensors with ``requires_grad``) whose gradients B returns.
        params: the stage's parameters, each once (W accumulates their ``.grad``).

    Returns:
        ``(gradient of each leaf, None where the outputs do not depend on it; WeightWork)``. The
        autograd graph is kept (``retain_graph``) until W has run. ``.grad`` is not touched.
    """
    pairs = [(t, torch.ones_like(t) if g is None else g) for t, g in zip(outputs, grads)
             if isinstance(t, GradientEdge) or t.requires_grad]
    leaf_ids = {id(t) for t in leaves}
    param_ids = {id(p) for p in params}
    order = _post_order([k[0] for k in (_key(t) for t, _ in pairs) if k is not None])
    in_b: dict[Node, bool] = {}
    wparams: dict[Node, frozenset[int]] = {}  # W node -> ids of the parameters it leads to
    for node in order:  # children first
        var = getattr(node, "variable", None)  # AccumulateGrad
        if var is not None:
            in_b[node] = id(var) in leaf_ids
            wparams[node] = frozenset((id(var),)) if (id(var) in param_ids
                                                      and not in_b[node]) else frozenset()
            continue
        kids = [c for c, _ in node.next_functions if c is not None]
        in_b[node] = any(in_b[c] for c in kids)
        if not in_b[node]:
            wparams[node] = frozenset().union(*(wparams[c] for c in kids))
    # incoming edges of every W node; entries = W nodes with a B parent
    incoming: dict[Node, int] = {}
    b_parent: set[Node] = set()
    for node in order:
        for c, _ in node.next_functions:
            if c is not None and not in_b[c]:
                incoming[c] = incoming.get(c, 0) + 1
                if in_b[node]:
                    b_parent.add(c)
    complex_entries = {q for q in b_parent if incoming[q] > 1 and wparams[q]}
    slow_ids = frozenset().union(*(wparams[q] for q in complex_entries))
    boundary: dict[Node, list[tuple[Node, int]]] = {}
    for node in order:
        if in_b[node]:
            edges = [(c, nr) for c, nr in node.next_functions
                     if c is not None and not in_b[c] and c not in complex_entries
                     and wparams[c] - slow_ids]
            if edges:
                boundary[node] = edges
    captured: dict[Node, tuple] = {}
    computed: dict[Node, tuple] = {}  # what an opaque (compiled) boundary node returned
    handles = []
    for node in boundary:
        def hook(grad_outputs, node=node):
            captured[node] = tuple(grad_outputs)
        handles.append(node.register_prehook(hook))
        if _opaque(node):
            def post(grad_inputs, _grad_outputs, node=node):
                computed[node] = tuple(grad_inputs)
            handles.append(node.register_hook(post))
    try:
        need = [t for t in leaves if t.requires_grad]
        if need and pairs:
            got = torch.autograd.grad([t for t, _ in pairs], need, [g for _, g in pairs],
                                      retain_graph=True, allow_unused=True)
            by_id = {id(t): g for t, g in zip(need, got)}
            in_grads = [by_id.get(id(t)) for t in leaves]
        else:
            in_grads = [None] * len(leaves)
    finally:
        for h in handles:
            h.remove()
    work = WeightWork()
    for node, edges in boundary.items():
        got = computed.get(node)
        if got is not None:  # a compiled region computed its weight edges' gradients in B
            kept = {(c, nr): g for (c, nr), g in zip(node.next_functions, got)}
            if all(kept.get(e) is not None for e in edges):
                for e in edges:
                    work.roots[e] = kept[e] if e not in work.roots else work.roots[e] + kept[e]
                continue
        rec = captured.get(node, ())
        outs = [GradientEdge(node, k) for k, g in enumerate(rec) if g is not None]
        if outs:
            work.reenter.append((outs, [g for g in rec if g is not None], edges))
    for t, g in pairs:  # outputs that depend on no input: W starts there directly
        key = _key(t)
        if key is not None and not in_b[key[0]] and wparams[key[0]] - slow_ids:
            work.roots[key] = g if key not in work.roots else work.roots[key] + g
    work.fast_params = [p for p in params if id(p) not in slow_ids]
    if slow_ids:
        work.slow = ([t for t, _ in pairs], [g for _, g in pairs],
                     [p for p in params if id(p) in slow_ids])
    return in_grads, work


def _accumulate(params: list[torch.Tensor], got) -> None:
    for p, g in zip(params, got):
        if g is None:
            continue
        if p.grad is None:
            p.grad = g.detach().clone()
        else:
            p.grad.add_(g)


def backward_weight(work: WeightWork) -> None:
    """W: accumulate every parameter gradient into ``.grad`` from what :func:`backward_input`
    recorded; the W region runs once, boundary nodes only for their entry children."""
    roots = dict(work.roots)
    for outs, gs, edges in work.reenter:  # e.g. the weight-gradient matmul of each linear layer
        got = torch.autograd.grad(outs, [GradientEdge(q, nr) for q, nr in edges], gs,
                                  retain_graph=True, allow_unused=True)
        for key, g in zip(edges, got):
            if g is not None:
                roots[key] = g if key not in roots else roots[key] + g
    if roots and work.fast_params:
        keys = list(roots)
        got = torch.autograd.grad([GradientEdge(q, nr) for q, nr in keys],
                                  work.fast_params, [roots[k] for k in keys],
                                  retain_graph=True, allow_unused=True)
        _accumulate(work.fast_params, got)
    if work.slow is not None:
        outs, gs, ps = work.slow
        _accumulate(ps, torch.autograd.grad(outs, ps, gs, retain_graph=True, allow_unused=True))
    work.reenter.clear()
    work.roots.clear()
    work.slow = None
