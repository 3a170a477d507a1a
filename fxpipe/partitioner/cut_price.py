"""A cut's step price straight from the units (no Plan built): what the layout search ranks
candidates by."""

from __future__ import annotations

import functools

import numpy as np

from fxpipe.partitioner.cutting import Recompute, recompute_stages
from fxpipe.partitioner.pricing import Priced
from fxpipe.partitioner.problem import CutProblem, PartitionResult
from fxpipe.partitioner.profile import SendCost
from fxpipe.partitioner.search import Candidate
from fxpipe.partitioner.servers import even_server_bytes
from fxpipe.plans.placement import grid_slots_per_node
from fxpipe.schedule.lowering import compute_schedule
from fxpipe.schedule.simulate import Links, LoweredSchedule, SimResult, StageCosts, simulate
from fxpipe.specs.gpus import link_curve
from fxpipe.specs.schema import ParallelSpec


def edge_send_times(messages: dict[tuple[int, int], list[float]], num_stages: int,
                    send: SendCost) -> list[float]:
    """Per stage, what one of its SEND actions costs: the mean over the edges it sends on
    (``{(sender, receiver): [bytes of each tensor]}``) of the send costs of the edge's tensors,
    summed (the runtime sends each tensor as its own message); 0 for a stage that sends none."""
    out: list[list[float]] = [[] for _ in range(num_stages)]
    for (s, _), sizes in messages.items():
        out[s].append(sum(send.seconds(b) for b in sizes))
    return [sum(x) / len(x) if x else 0.0 for x in out]

@functools.lru_cache(maxsize=4)
def _full_schedule(name: str, p: int, m: int, v: int, edges: frozenset, grad_edges: frozenset):
    """``build_schedule`` for the search, as a :class:`LoweredSchedule` (the simulator's
    compiled form of it, without building its communication actions: it prices exactly the
    same), kept for the few most recent layouts: both placements of a grid and cuts with the
    same stage edges share it (the simulator only reads it; a schedule of hundreds of
    micro-batches takes seconds to build)."""
    return LoweredSchedule(compute_schedule(name, p, m, v), set(edges), set(grad_edges))

def simulate_cut(pr: Priced, prefix: np.ndarray, problem: CutProblem,
                  result: PartitionResult, cand: Candidate, spec: ParallelSpec,
                  scale: float,
                  recompute: Recompute | None = None
                  ) -> SimResult:
    """Simulate one step of a candidate's partition straight from the cut (no Plan built):
    per-stage F/B/W from the unit prefix sums, edge bytes from the values crossing the cuts.
    ``recompute``: :func:`recompute_stages` of the cut (None: worked out here)."""
    cuts = list(result.cuts) + [problem.n]
    recompute, plain, _ = recompute or recompute_stages(pr, spec, cand, result.cuts, scale)
    per = [(prefix[:, b] - prefix[:, a]) * scale * problem.slow[j]
           for j, (a, b) in enumerate(zip(cuts[:-1], cuts[1:]))]
    per = [np.array([x[0], x[0] + x[1], x[2]]) if rc else x for x, rc in zip(per, recompute)]
    stage_of = result.stage_of()
    fwd: dict[tuple[int, int], list[float]] = {}
    grad: dict[tuple[int, int], list[float]] = {}  # keyed by (sender of the gradient, receiver)
    for v in problem.values:
        if v.producer < 0:
            continue
        ps = stage_of[v.producer]
        for cs in sorted({stage_of[u] for u in v.users} - {ps}):
            fwd.setdefault((ps, cs), []).append(v.nbytes)
            if v.grad:
                grad.setdefault((cs, ps), []).append(v.nbytes)
    factor = float(problem.param_multiplier)
    costs = StageCosts([float(x[0]) for x in per], [float(x[1]) for x in per],
                       [float(x[2]) for x in per],
                       activation_bytes=[int((result if rc or plain is None else plain)
                                             .saved_bytes[j]) for j, rc in enumerate(recompute)],
                       static_bytes=[int(b * factor) for b in result.param_bytes],
                       send_s=edge_send_times(fwd, len(per), pr.send),
                       grad_send_s=edge_send_times(grad, len(per), pr.send))
    fwd_bytes = {e: sum(v) for e, v in fwd.items()}
    grad_bytes = {(ps, cs): sum(v) for (cs, ps), v in grad.items()}
    sched = _full_schedule(cand.schedule, cand.pipeline, cand.microbatches,
                           cand.virtual_stages, frozenset(fwd_bytes), frozenset(grad_bytes))
    cl = spec.cluster
    servers = cl.parameter_servers if spec.train.updates == "async" else 0
    links = Links.from_cluster(cand.pipeline, cand.dp, cl.nodes,
                               grid_slots_per_node(cl.devices_per_node, cand.tensor),
                               cl.links.intra_node_GBps, cl.links.inter_node_GBps,
                               cl.links.latency_s, cand.layout, servers,
                               **link_curve(cl.device, cl.gpu))
    return simulate(sched, costs, fwd_bytes, links, dp=cand.dp, allreduce_bytes=list(
        result.param_bytes), grad_edge_bytes=grad_bytes, check=False, timeline=False,
        server_bytes=even_server_bytes(list(result.param_bytes), servers) if servers else None)
