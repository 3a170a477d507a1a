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
reading node's saved bytes grow by ``(N-1)/N`` of the whole value.
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from fxpipe.context.analysis import PARTIAL, ContextError, ContextSplit, Seq, analyse, \
    sequence_length
from fxpipe.context.layout import check
from fxpipe.errors import PlanError
from fxpipe.partitioner.cost import NodeCost
from fxpipe.partitioner.expert_costs import all_to_all_seconds
from fxpipe.partitioner.timing import NodeTimes


def context_in_node(spec) -> bool:
    """A context group's ranks fit in one node (one node, or ``context x tensor`` devices
    dividing a node's: with the replicas of a stage on adjacent ranks they stay inside it)."""
    cl, par = spec.cluster, spec.parallel
    k = par.context * (par.tensor if isinstance(par.tensor, int) else 1)
    return cl.nodes == 1 or cl.devices_per_node % k == 0


def context_link(spec) -> tuple[float, float]:
    """``(bytes per second, latency)`` of the context group's collectives (module doc)."""
    cl = spec.cluster
    gbps = cl.links.intra_node_GBps if context_in_node(spec) else cl.links.inter_node_GBps
    return gbps * 1e9, cl.links.latency_s


def context_split(gm: fx.GraphModule, n: int) -> ContextSplit:
    """The graph's placements at degree ``n``, or a one-line PlanError (the sequence does not
    split into ``2n`` chunks, an op the split cannot run)."""
    try:
        seq = sequence_length(gm)
    except ContextError as e:
        raise PlanError(f"parallel.context: {n}: {e}") from None
    why = check(seq, n)
    if why is not None:
        raise PlanError(f"parallel.context: {n}: {why}")
    try:
        split = analyse(gm, n, seq)
    except ContextError as e:
        raise PlanError(f"parallel.context: {n}: {e}") from None
    if not any(ns.gather for ns in split.nodes.values()) and not any(
            isinstance(ns.out, Seq) for ns in split.nodes.values()):
        raise PlanError(f"parallel.context: {n}: nothing in the model is split along the "
                        f"sequence of its inputs ({seq} long): no embedding or linear layer "
                        "reads [batch, sequence, ...] inputs; use parallel.context: 1")
    return split


def _fraction(out, n: int) -> float:
    outs = out if isinstance(out, tuple) else (out,)
    return 1.0 / n if any(isinstance(o, Seq) or o == PARTIAL for o in outs) else 1.0


def _nbytes(node: fx.Node) -> int:
    v = node.meta.get("val")
    return int(v.numel()) * v.element_size() if hasattr(v, "numel") else 0


def context_priced(gm: fx.GraphModule, costs: dict[str, NodeCost], split: ContextSplit,
                   link: tuple[float, float], byte_scale: float = 1.0
                   ) -> tuple[dict[str, NodeCost], dict[str, float],
                              dict[str, tuple[float, float]], list[float]]:
    """``costs`` of one rank of the context group (module doc), each node's work fraction,
    the all-gathers' (forward, input-gradient) seconds per node, and the whole bytes one
    micro-batch all-gathers forward and reduce-scatters backward."""
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
    comm: dict[str, tuple[float, float]] = {}
    moved = [0.0, 0.0]
    seen: set[tuple[str, Seq]] = set()
    for reader, value, s in split.gathers():
        if (value, s) in seen:
            continue
        seen.add((value, s))
        whole = _nbytes(nodes[value])
        grad = nodes[value].meta.get("val") is not None and nodes[value].meta["val"].is_floating_point()
        fwd = all_to_all_seconds(whole, n, link, byte_scale)
        bwd = fwd if grad else 0.0
        f, b = comm.get(reader, (0.0, 0.0))
        comm[reader] = (f + fwd, b + bwd)
        moved[0] += whole
        moved[1] += whole if grad else 0
        c = out.get(reader)
        if c is not None and grad:  # held whole for the backward
            out[reader] = dataclasses.replace(
                c, saved_bytes=c.saved_bytes + int(whole * (n - 1) / n))
    return out, frac, comm, moved


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
