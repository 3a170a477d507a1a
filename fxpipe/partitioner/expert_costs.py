"""Planning units priced under expert parallelism (``parallel.expert: N``).

Each rank of an expert group holds ``1/N`` of every MoE layer's experts
(:mod:`fxpipe.experts`): the expert weights (and their gradients and optimizer state) cost
``1/N`` of their bytes on it, charged to the region nodes that read them first. Its compute and
activations stay: it runs ``E/N`` experts on the slots of ``N`` ranks' tokens (``[E/N, N C,
...]``), as many FLOPs and bytes as ``E`` experts on its own. Each region entry is dispatched
and each exit combined by an all-to-all, forward and (the inverse) backward: a rank sends
``(N-1)/N`` of the ``[E, C, ...]`` tensor, priced ``(N-1)/N x bytes / bandwidth + (N-1)
latencies`` on the link the group uses (inside a node where ``N x tensor`` ranks divide a
node's devices: the layout search then keeps a stage's replicas on adjacent ranks; else the
inter-node link). Added to the
region's first node (dispatch) and last node (combine): their forward and input-gradient
seconds. The dropless form's rows (:mod:`fxpipe.experts.regions`) are priced at balanced
routing (each rank's rows spread evenly over the experts, so ``(N-1)/N`` of them leave it); how
many a step really sends follows the router.
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from fxpipe.errors import PlanError
from fxpipe.experts.regions import NoExperts, Region, require_regions
from fxpipe.partitioner.cost import NodeCost
from fxpipe.partitioner.timing import NodeTimes
from fxpipe.plans.placement import replicas_fit_node


def expert_in_node(spec) -> bool:
    """An expert group's ranks fit in one node (:func:`fxpipe.plans.placement.
    replicas_fit_node`; the layout search then keeps a stage's replicas on adjacent ranks)."""
    cl, par = spec.cluster, spec.parallel
    return replicas_fit_node(cl.nodes, cl.devices_per_node, par.expert,
                             par.tensor if isinstance(par.tensor, int) else 1)


def group_link(spec, inside: bool) -> tuple[float, float]:
    """``(bytes per second, latency)`` of a group of replicas' collectives: the intra-node
    link where the group lies ``inside`` a node, else the inter-node one."""
    cl = spec.cluster
    gbps = cl.links.intra_node_GBps if inside else cl.links.inter_node_GBps
    return gbps * 1e9, cl.links.latency_s


def expert_link(spec) -> tuple[float, float]:
    """``(bytes per second, latency)`` of the expert group's all-to-alls (module doc)."""
    return group_link(spec, expert_in_node(spec))


def all_to_all_seconds(nbytes: float, n: int, link: tuple[float, float],
                       byte_scale: float = 1.0) -> float:
    """One all-to-all of a ``nbytes`` tensor over ``n`` ranks (module doc)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    bps, latency = link
    return (n - 1) / n * nbytes * byte_scale / bps + (n - 1) * latency


def expert_regions(gm: fx.GraphModule, n: int, model_name: str) -> list[Region]:
    """The regions expert parallelism of degree ``n`` splits, or a one-line PlanError."""
    try:
        regions = require_regions(gm, model_name)
    except NoExperts as e:
        raise PlanError(f"parallel.expert: {n}: {e}") from None
    for r in regions:
        if r.experts % n:
            raise PlanError(f"parallel.expert: {n}: {model_name}'s MoE layer has {r.experts} "
                            f"experts, which do not split over {n} ranks; use an expert degree "
                            f"that divides {r.experts}")
    return regions


def expert_priced(gm: fx.GraphModule, costs: dict[str, NodeCost], regions: list[Region],
                  n: int, link: tuple[float, float], byte_scale: float = 1.0
                  ) -> tuple[dict[str, NodeCost], dict[str, tuple[float, float]], list[float],
                             dict[str, int]]:
    """``costs`` of one rank of an expert group of ``n`` (module doc), the all-to-alls'
    (forward, input-gradient) seconds per node, the bytes of the ``[E, C, ...]`` tensors
    one micro-batch all-to-alls (forward, backward), and the expert parameter bytes charged
    to each node (this rank's ``1/n``)."""
    costs = dict(costs)
    held: dict[str, int] = {}
    comm: dict[str, tuple[float, float]] = {}
    moved = [0.0, 0.0]
    readers: dict[str, list[str]] = {}
    size: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            readers.setdefault(node.target, []).extend(u.name for u in node.users)
        v = node.meta.get("val")
        size[node.name] = int(v.numel()) * v.element_size() if hasattr(v, "numel") else 0
    for r in regions:  # the nodes charged with the expert weights (their first readers)
        for name in {*r.nodes, *(u for w in r.weights for u in readers.get(w, []))}:
            c = costs.get(name)
            if c is not None and c.param_bytes:
                costs[name] = dataclasses.replace(c, param_bytes=c.param_bytes // n)
                held[name] = c.param_bytes // n
        ends = [(r.nodes[0], e) for e in r.entries] + [(r.nodes[-1], x) for x in r.exits]
        for at, value in ends:
            sec = all_to_all_seconds(size[value], n, link, byte_scale)
            f, b = comm.get(at, (0.0, 0.0))
            comm[at] = (f + sec, b + sec)
            moved[0] += size[value]
            moved[1] += size[value]
    return costs, comm, moved, held


def with_all_to_alls(times: dict[str, NodeTimes], comm: dict[str, tuple[float, float]]
                     ) -> dict[str, NodeTimes]:
    """``times`` plus the all-to-alls' seconds (:func:`expert_priced`)."""
    out = dict(times)
    for name, (f, b) in comm.items():
        t = out.get(name, NodeTimes())
        out[name] = NodeTimes(t.fwd_s + f, t.bwd_input_s + b, t.bwd_weight_s)
    return out
