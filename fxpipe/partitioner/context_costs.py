"""Planning units priced under context parallelism (``parallel.context: N``).

Each rank of a context group holds ``1/N`` of every sequence (:mod:`fxpipe.context`): a node
whose output is split (or a partial sum over the sequence) does ``1/N`` of the work, moves and
saves ``1/N`` of the bytes, and sends ``1/N`` across a cut; a node computed whole (position
ids, rotary tables, a mask) costs every rank all of it. Attention's FLOPs are ``1/N`` too: the
head-and-tail layout gives every rank the same share of the causal work.

What the split adds, per all-gather of a split value along the sequence (attention's keys and
values; ids a label shift reads): forward an all-gather, backward a reduce-scatter of its
gradient (none for integer ids), each ``(N-1)/N x whole bytes / bandwidth + (N-1) latencies``
on the link the group uses (inside a node where ``N x tensor`` ranks fit one: the search then
keeps only the layout that puts a stage's replicas on adjacent ranks, ``data-inner``; else
the inter-node link), added to the reading
node's forward and input-gradient seconds, not overlapped with compute. The gathered value is
held whole until the backward (autograd saves the keys and values attention read): the
reading node's saved bytes grow by ``(N-1)/N`` of the whole value. Under
``parallel.context_attention: ring`` an attention runs as ring attention instead
(:mod:`fxpipe.context.ring`): its messages overlap the blocks' compute and only the rank's own
keys and values are kept (:func:`context_comm`).
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from fxpipe.context.analysis import (PARTIAL, ContextError, ContextSplit, Seq, analyse,
                                    sdpa_args, sequence_length)
from fxpipe.context.layout import check
from fxpipe.errors import PlanError
from fxpipe.partitioner.cost import NodeCost
from fxpipe.partitioner.expert_costs import all_to_all_seconds, group_link
from fxpipe.partitioner.timing import NodeTimes
from fxpipe.plans.placement import replicas_fit_node


def context_in_node(spec) -> bool:
    """A context group's ranks fit in one node (:func:`fxpipe.plans.placement.
    replicas_fit_node`)."""
    cl, par = spec.cluster, spec.parallel
    return replicas_fit_node(cl.nodes, cl.devices_per_node, par.context,
                             par.tensor if isinstance(par.tensor, int) else 1)


def context_link(spec) -> tuple[float, float]:
    """``(bytes per second, latency)`` of the context group's collectives (module doc)."""
    return group_link(spec, context_in_node(spec))


def context_split(gm: fx.GraphModule, n: int, ring: bool = False) -> ContextSplit:
    """The graph's placements at degree ``n``, or a one-line PlanError (the sequence does not
    split into ``2n`` chunks, an op the split cannot run)."""
    try:
        seq = sequence_length(gm)
    except ContextError as e:
        raise PlanError(f"parallel.context: {n}: {e}") from None
    try:
        split = analyse(gm, n, seq, ring=ring)
    except ContextError as e:
        raise PlanError(f"parallel.context: {n}: {e}") from None
    if not any(ns.gather or ns.ring for ns in split.nodes.values()) and not any(
            isinstance(ns.out, Seq) for ns in split.nodes.values()):
        raise PlanError(f"parallel.context: {n}: nothing in the model is split along the "
                        f"sequence of its inputs (dimension 1, {seq} long): no embedding or "
                        "linear layer reads [batch, sequence, ...] inputs; use "
                        "parallel.context: 1")
    why = check(seq, n)
    if why is not None:
        raise PlanError(f"parallel.context: {n}: {why}")
    return split


def _fraction(out, n: int) -> float:
    outs = out if isinstance(out, tuple) else (out,)
    return 1.0 / n if any(isinstance(o, Seq) or o == PARTIAL for o in outs) else 1.0


def _nbytes(node: fx.Node) -> int:
    v = node.meta.get("val")
    return int(v.numel()) * v.element_size() if hasattr(v, "numel") else 0


def context_priced(gm: fx.GraphModule, costs: dict[str, NodeCost], split: ContextSplit
                   ) -> tuple[dict[str, NodeCost], dict[str, float]]:
    """``costs`` of one rank of the context group (module doc) and each node's work
    fraction."""
    n = split.n
    nodes = {x.name: x for x in gm.graph.nodes}
    frac = {name: _fraction(ns.out, n) for name, ns in split.nodes.items()}
    out = {}
    for name, c in costs.items():
        f = frac.get(name, 1.0)
        out[name] = dataclasses.replace(
            c, fwd_flops=c.fwd_flops * f, bwd_flops=c.bwd_flops * f,
            bwd_weight_flops=c.bwd_weight_flops * f, out_bytes=int(c.out_bytes * f),
            in_bytes=int(c.in_bytes * f), saved_bytes=int(c.saved_bytes * f),
            attn_scores=int(c.attn_scores * f), ops=tuple((fl * f, b * f) for fl, b in c.ops))
    for reader, value, _ in _gathers(split):
        c = out.get(reader)
        if c is not None and _floating(nodes[value]):  # held whole for the backward
            out[reader] = dataclasses.replace(
                c, saved_bytes=c.saved_bytes + int(_nbytes(nodes[value]) * (n - 1) / n))
    return out, frac


def _gathers(split: ContextSplit) -> list[tuple[str, str, Seq]]:
    """Each all-gather once per value and placement (a stage gathers a value once for all its
    readers)."""
    seen, out = set(), []
    for reader, value, s in split.gathers():
        if (value, s) not in seen:
            seen.add((value, s))
            out.append((reader, value, s))
    return out


def _floating(node: fx.Node) -> bool:
    v = node.meta.get("val")
    return v is not None and hasattr(v, "is_floating_point") and v.is_floating_point()


def context_comm(gm: fx.GraphModule, split: ContextSplit, times: dict[str, NodeTimes],
                 link: tuple[float, float], byte_scale: float = 1.0
                 ) -> tuple[dict[str, tuple[float, float]], list[float]]:
    """The context group's communication per node, exposed ``(forward, input-gradient)``
    seconds, and the bytes of one micro-batch (``times``: the rank's node times).

    * an all-gather: ``(N-1)/N x whole / bandwidth + (N-1) latencies`` forward, the
      reduce-scatter of its gradient as much backward (none for integer values), not
      overlapped; bytes: the whole tensors gathered forward and reduce-scattered backward;
    * a ring attention: ``N-1`` steps each sending the rank's keys and values (``1/N`` of the
      whole) while a block computes (``1/N`` of the node's time): exposed
      ``(N-1) x max(0, message - block)`` forward; backward the blocks again and their
      gradients (fp32) one step behind, exposed ``(N-1) x max(0, message - block)`` plus the
      last hand-back; bytes: what a rank sends, ``(N-1)/N`` of the whole forward,
      ``(2N-1)/N`` backward.
    """
    n = split.n
    bps, lat = link
    nodes = {x.name: x for x in gm.graph.nodes}
    comm: dict[str, tuple[float, float]] = {}
    moved = [0.0, 0.0]

    def add(at: str, f: float, b: float) -> None:
        f0, b0 = comm.get(at, (0.0, 0.0))
        comm[at] = (f0 + f, b0 + b)

    for reader, value, _ in _gathers(split):
        whole = _nbytes(nodes[value])
        grad = _floating(nodes[value])
        sec = all_to_all_seconds(whole, n, link, byte_scale)
        add(reader, sec, sec if grad else 0.0)
        moved[0] += whole
        moved[1] += whole if grad else 0
    for name in split.rings():
        args = sdpa_args(nodes[name])
        whole = _nbytes(args["key"]) + _nbytes(args["value"])
        t = times.get(name, NodeTimes())
        kv = whole / n * byte_scale / bps + lat
        grads = whole / n / bps + lat  # fp32 accumulators
        fwd = (n - 1) * max(0.0, kv - t.fwd_s / n)
        bwd = (n - 1) * max(0.0, max(kv, grads) - t.bwd_input_s / n) + grads
        add(name, fwd, bwd)
        moved[0] += whole * (n - 1) / n
        moved[1] += whole * (2 * n - 1) / n
    return comm, moved


def scaled_loss(times: dict[str, NodeTimes], node: str | None, loss: NodeTimes, f: float
                ) -> tuple[dict[str, NodeTimes], NodeTimes]:
    """``times`` with the loss at ``node`` (added whole by the pricer) cut to ``f`` of it (the
    rank's share of the logits), and that share."""
    if node is None or f == 1.0 or loss.total_s <= 0:
        return times, loss
    t = times.get(node, NodeTimes())
    share = loss.scaled(f)
    out = dict(times)
    out[node] = NodeTimes(t.fwd_s - loss.fwd_s + share.fwd_s,
                          t.bwd_input_s - loss.bwd_input_s + share.bwd_input_s,
                          t.bwd_weight_s - loss.bwd_weight_s + share.bwd_weight_s)
    return out, share
