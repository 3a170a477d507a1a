"""Parameter-server placement for ``train.updates: async``: which server holds which parameter.

The servers are the last ``cluster.parameter_servers`` ranks (:func:`~fxpipe.plans.placement.
server_ranks`). The parameters, in pipeline order (by the first stage that uses them), are cut
into that many contiguous runs of about equal bytes, so every server holds about the same share
of the weights and optimizer state and each stage talks to few servers. A parameter used by
several stages (a tied embedding) lives on one server, which sums the gradients its stages push.
"""

from __future__ import annotations

from typing import Mapping

from fxpipe.errors import PlanError
from fxpipe.plans.placement import grid_slots_per_node, node_of, server_ranks
from fxpipe.plans.plan import Plan
from fxpipe.specs.schema import OPTIMIZER_STATE_FACTOR, ParallelSpec
from fxpipe.units import human_bytes, plural


def pipeline_params(plan: Plan) -> list[str]:
    """Canonical parameter names in pipeline order, each once."""
    seen: dict[str, None] = {}
    for st in sorted(plan.stages, key=lambda s: s.index):
        for name in st.params:
            seen.setdefault(plan.param_aliases.get(name, name), None)
    return list(seen)


def even_server_bytes(stage_param_bytes: list[float], servers: int) -> list[list[float]]:
    """``[stage][server]`` bytes when every stage's parameters are spread evenly over the
    servers: the planner's estimate for a candidate before its parameters are placed."""
    return [[b / servers] * servers for b in stage_param_bytes]


def _cuts(plan: Plan, names: list[str], sizes: list[int], servers: int) -> list[int]:
    """Byte offsets (in pipeline order) where each server after the first starts: the parameter
    boundary nearest to an equal share, or a stage boundary when one lies within a quarter of a
    share of it (then a stage's parameters stay on fewer servers)."""
    first = {}
    for st in sorted(plan.stages, key=lambda s: s.index):
        for n in st.params:
            first.setdefault(plan.param_aliases.get(n, n), st.index)
    offsets, stage_ends, at = [0], set(), 0
    for i, b in enumerate(sizes):
        at += b
        offsets.append(at)
        if i + 1 == len(names) or first[names[i + 1]] != first[names[i]]:
            stage_ends.add(at)
    total = max(1, at)
    cuts: list[int] = []
    for j in range(1, servers):
        ideal = j * total / servers
        near = [e for e in stage_ends if abs(e - ideal) <= total / (4 * servers)]
        pool = near or offsets
        cut = min(pool, key=lambda o: (abs(o - ideal), o))
        cuts.append(max(cut, cuts[-1] if cuts else 0))
    return cuts


def assign_servers(plan: Plan, param_bytes: Mapping[str, int], spec: ParallelSpec) -> None:
    """Fill ``plan.parameter_servers``, ``server_params`` and ``server_stage_bytes`` (and a
    line of ``plan.explain``) for a spec with ``train.updates: async``; nothing otherwise.

    Args:
        plan: the plan (its stages' parameters).
        param_bytes: bytes of each parameter by canonical name (missing: 0).
        spec: the validated spec (``cluster.parameter_servers``, memory, optimizer).

    Raises:
        PlanError: a server's parameters and optimizer state do not fit its device memory.
    """
    servers = spec.cluster.parameter_servers
    if spec.train.updates != "async" or not servers:
        return
    names = pipeline_params(plan)
    sizes = [int(param_bytes.get(n, 0)) for n in names]
    cuts = _cuts(plan, names, sizes, servers)
    where: dict[str, int] = {}
    before = 0
    for name, b in zip(names, sizes):
        where[name] = sum(1 for c in cuts if c <= before)
        before += b
    per_stage = []
    for st in sorted(plan.stages, key=lambda s: s.index):
        row = [0] * servers
        for name in dict.fromkeys(plan.param_aliases.get(n, n) for n in st.params):
            row[where[name]] += int(param_bytes.get(name, 0))
        per_stage.append(row)
    load = [0] * servers
    for name, b in zip(names, sizes):
        load[where[name]] += b
    factor = OPTIMIZER_STATE_FACTOR[spec.train.optimizer]
    cap = spec.cluster.memory_gb * 1e9
    heavy = max(range(servers), key=load.__getitem__)
    if load[heavy] * factor > cap:
        raise PlanError(f"parameter server {heavy} holds {human_bytes(load[heavy])} of parameters "
                        f"({human_bytes(load[heavy] * factor)} with gradients and "
                        f"{spec.train.optimizer} state), more than its "
                        f"{human_bytes(cap, True)} (cluster.memory_gb); use more "
                        "cluster.parameter_servers or devices with more memory")
    ranks = server_ranks(plan.pipeline, plan.dp, servers)
    plan.parameter_servers = ranks
    plan.server_params = where
    plan.server_stage_bytes = per_stage
    _price_links(plan)
    nodes = sorted({node_of(r, spec.cluster.devices_per_node) for r in ranks})
    shards = "; ".join(
        f"server {j}: {plural(sum(1 for w in where.values() if w == j), 'parameter')} "
        f"({human_bytes(load[j])}) of stage"
        f"{'s' if sum(1 for row in per_stage if row[j]) != 1 else ''} "
        f"{', '.join(str(s) for s, row in enumerate(per_stage) if row[j]) or 'none'}"
        for j in range(servers))
    plan.explain.append(
        f"asynchronous updates, max_staleness {spec.train.max_staleness}: parameters and "
        f"optimizer state on {plural(servers, 'parameter server')} (rank"
        f"{'s' if servers > 1 else ''} {', '.join(map(str, ranks))}, node"
        f"{'s' if len(nodes) > 1 else ''} {', '.join(map(str, nodes))}); {shards}")


def _price_links(plan: Plan) -> None:
    """``plan.server_links`` and ``plan.server_priced_s`` (see :class:`Plan`), on the links the
    prediction uses (:func:`~fxpipe.schedule.plan_price.links_from_plan`)."""
    from fxpipe.plans.placement import server_link_crosses_nodes
    from fxpipe.schedule.plan_price import links_from_plan

    links = links_from_plan(plan)
    dpn = links_dpn(plan)
    ranks = plan.stage_ranks()
    table = plan.server_stage_bytes
    servers = len(plan.parameter_servers)
    loads = [sum(row[j] for row in table) for j in range(servers)]
    plan.server_links, plan.server_priced_s = [], []
    for r in range(plan.pipeline):
        rows = [row for pos, row in enumerate(table) if ranks[pos] == r]
        plan.server_priced_s.append(sum(links.push_pull_seconds(r, row, loads, plan.dp)
                                        for row in rows))
    for j, srank in enumerate(plan.parameter_servers):
        for r in range(plan.pipeline):
            b = sum(row[j] for pos, row in enumerate(table) if ranks[pos] == r)
            if b <= 0:
                continue
            gbps = links.server_GBps.get((r, j), links.p2p_GBps)
            plan.server_links.append({
                "server": j, "pipe_rank": r, "GBps": gbps,
                "inter_node": server_link_crosses_nodes(r, srank, plan.pipeline, plan.dp, dpn,
                                                        plan.placement),
                "bytes": int(b), "seconds": b / (gbps * 1e9) + links.latency_s})


def links_dpn(plan: Plan) -> int:
    """Grid slots per node of the plan's cluster (as :func:`~fxpipe.schedule.step_price.links_of`
    gives them to :meth:`~fxpipe.schedule.simulate.Links.from_cluster`)."""
    if plan.spec is None:
        return plan.pipeline * plan.dp
    return grid_slots_per_node(plan.spec.cluster.devices_per_node, plan.tensor)
