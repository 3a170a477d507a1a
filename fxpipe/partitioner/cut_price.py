"""A cut's step straight from the units (no Plan built), priced by the one rule of
:mod:`fxpipe.schedule.step_price`: what the layout search ranks candidates by, and what the
assembled Plan records (its stages' times and shared bytes come from :func:`cut_steps`, so its
prediction is the search's score)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from fxpipe.execution.losses import MODEL_LOSS
from fxpipe.partitioner.cut_tables import (rebuilt_seconds, stage_params, stage_tensor_comms,
                                           unit_params)
from fxpipe.partitioner.cutting import (FULL, OFFLOAD, SELECTIVE, Recompute, offload_moves,
                                        recompute_stages, selective_prefix)
from fxpipe.partitioner.expert_state import stage_expert_bytes, true_param_bytes
from fxpipe.partitioner.gathering import is_block, with_gather_rows
from fxpipe.partitioner.pricing import Priced
from fxpipe.partitioner.problem import CutProblem, PartitionResult
from fxpipe.partitioner.profile import SendCost
from fxpipe.partitioner.search import Candidate
from fxpipe.partitioner.servers import even_server_bytes
from fxpipe.schedule.lowering import compute_schedule
from fxpipe.schedule.simulate import LoweredSchedule, SimResult
from fxpipe.schedule.step_price import Reduction, StageStep, links_of, price_step
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


@dataclass
class CutSteps:
    """One cut of a candidate as the pricing rule reads it.

    Attributes:
        stages: per stage, its :class:`~fxpipe.schedule.step_price.StageStep`.
        fwd / grad: ``{(sender, receiver): [bytes of each tensor]}`` per micro-batch, of the
            values and of their gradients (a gradient goes back from the consumer).
        recompute: the cut's activation recomputation, stage by stage.
        tensor_comms: under tensor parallelism, per stage the collectives of one micro-batch
            as the runtime runs the stage; else None.
    """

    stages: list[StageStep]
    fwd: dict[tuple[int, int], list[float]]
    grad: dict[tuple[int, int], list[float]]
    recompute: Recompute
    tensor_comms: list[list] | None = None

    def edge_bytes(self) -> tuple[dict[tuple[int, int], float], dict[tuple[int, int], float]]:
        """Bytes per micro-batch per edge, forward and gradient (keyed by (producer,
        consumer), as the simulator takes them)."""
        return ({e: sum(v) for e, v in self.fwd.items()},
                {(ps, cs): sum(v) for (cs, ps), v in self.grad.items()})


def reduction_for(spec: ParallelSpec, cand: Candidate) -> Reduction:
    """How the candidate's replicas reduce gradients (``train``, its sharding, the parameter
    servers of async updates)."""
    servers = spec.cluster.parameter_servers if spec.train.updates == "async" else 0
    return Reduction.of(spec.train, cand.replicas, cand.sharding, servers)


def cut_steps(pr: Priced, prefix: np.ndarray, problem: CutProblem, result: PartitionResult,
              cand: Candidate, spec: ParallelSpec, scale: float,
              recompute: Recompute | None = None) -> CutSteps:
    """The stages of a cut as the pricing rule reads them: F/B/W seconds from the unit prefix
    sums, the copies of the values each stage rebuilds and, under tensor parallelism, the
    collectives the runtime's per-stage analysis adds (at ``scale`` x the traced
    micro-batch and the stage's node speed; a recomputing stage's forward again in its B), the
    activation bytes it holds per micro-batch, its parameters' bytes and the bytes of those
    other stages share, its trained matrices (for PowerSGD), its send seconds; and the bytes
    crossing each edge. ``recompute``: :func:`recompute_stages` of the cut (None: worked out
    here)."""
    cuts = list(result.cuts) + [problem.n]
    k = len(cuts) - 1
    rc = recompute or recompute_stages(pr, spec, cand, result.cuts, scale)
    flags = rc.flags
    stage_of = result.stage_of()
    extra = rebuilt_seconds(pr, stage_of, k)
    tensor = stage_tensor_comms(pr, list(result.cuts),
                                None if spec.train.loss == MODEL_LOSS else spec.train.loss)
    if tensor is not None:  # the collectives the stages run beyond the units' own
        extra = [x + y for x, y in zip(extra, tensor[1])]
    per = [((prefix[:, b] - prefix[:, a]) + extra[j]) * scale * problem.slow[j]
           for j, (a, b) in enumerate(zip(cuts[:-1], cuts[1:]))]
    if SELECTIVE in flags:  # its recomputed nodes' forward again (at the stage's keep
        # threshold), and what the stage adds
        sp = [selective_prefix(pr, rc.ridge(j)) for j in range(k)]
        again = [(sp[j][b] - sp[j][a] + extra[j][0]) * scale * problem.slow[j]
                 for j, (a, b) in enumerate(zip(cuts[:-1], cuts[1:]))]
    if rc.partial is not None:  # the head's forward again (its first blocks', what they
        rebuilt = rebuilt_seconds(pr, stage_of, k)  # rebuild; their share of collectives)
        for j, p in enumerate(rc.partial):
            if p is None or flags[j] != FULL:
                continue
            a, b = cuts[j], cuts[j + 1]
            units = prefix[0, b] - prefix[0, a]
            coll = extra[j][0] - rebuilt[j][0]
            head = p.head_s + rebuilt[j][0] + (coll * p.head_s / units if units > 0 else 0.0)
            per[j] = np.array([per[j][0], head * scale * problem.slow[j] + per[j][1], per[j][2]])
    per = [np.array([x[0], x[0] + x[1], x[2]]) if r == FULL and not rc.blocks(j) else x
           if r == FULL else
           np.array([x[0], again[j] + x[1], x[2]]) if r == SELECTIVE else x
           for j, (x, r) in enumerate(zip(per, flags))]
    if OFFLOAD in flags:  # out after F, back before B (and again before W: offload_moves)
        w = offload_moves(cand) - 2
        for j, r in enumerate(flags):
            if r == OFFLOAD:
                t = rc.host_bytes(j) / spec.cluster.host_Bps * problem.slow[j]
                per[j] = per[j] + np.array([t, t, w * t])
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
    red = reduction_for(spec, cand)
    sharding = red.sharding != "none" and red.dp > 1 and not red.servers
    matrices = red.method == "powersgd" and red.dp > 1 and not red.servers
    shared, names = (stage_params(pr, stage_of, k, names=matrices) if sharding or matrices
                     else ([0.0] * k, None))
    shapes = unit_params(pr).shapes if matrices else {}
    send_s = edge_send_times(fwd, k, pr.send)
    grad_send_s = edge_send_times(grad, k, pr.send)
    params = true_param_bytes(pr, spec, cand, result)  # (the cut's memory scaled experts)
    experts = stage_expert_bytes(pr, list(result.cuts))
    stages = [StageStep(
        float(x[0]), float(x[1]), float(x[2]),
        int(rc.activation_bytes(j)),
        params[j], float(shared[j]),
        [shapes[f] for f in names[j] if f in shapes] if names is not None else [],
        send_s[j], grad_send_s[j], expert_bytes=experts[j]) for j, x in enumerate(per)]
    if is_block(cand):  # parameters gathered block by block: the rows their gathers price
        replay = [s.bwd_input_s - float((prefix[1, b] - prefix[1, a] + extra[j][1]) * scale
                                        * problem.slow[j])
                  if flags[j] in (FULL, SELECTIVE) else 0.0
                  for j, (s, a, b) in enumerate(zip(stages, cuts[:-1], cuts[1:]))]
        heads = [rc.partial[j].h if rc.blocks(j) else None for j in range(k)]
        stages = with_gather_rows(pr, stages, list(result.cuts), replay, flags, heads,
                                  [rc.ridge(j) for j in range(k)])
    return CutSteps(stages, fwd, grad, rc, tensor[0] if tensor is not None else None)


def simulate_cut(pr: Priced, prefix: np.ndarray, problem: CutProblem,
                 result: PartitionResult, cand: Candidate, spec: ParallelSpec, scale: float,
                 recompute: Recompute | None = None, steps: CutSteps | None = None
                 ) -> SimResult:
    """Simulate one step of a candidate's partition straight from the cut (no Plan built), by
    the one pricing rule (:func:`~fxpipe.schedule.step_price.price_step`) over
    :func:`cut_steps` (``steps``: made already). Under async updates the servers' shares are
    the even spread of each stage's parameters (the placement comes with the Plan)."""
    steps = steps or cut_steps(pr, prefix, problem, result, cand, spec, scale, recompute)
    fwd_bytes, grad_bytes = steps.edge_bytes()
    sched = _full_schedule(cand.schedule, cand.pipeline, cand.microbatches,
                           cand.virtual_stages, frozenset(fwd_bytes), frozenset(grad_bytes))
    red = reduction_for(spec, cand)
    links = links_of(spec.cluster, cand.pipeline, cand.replicas, cand.tensor, cand.layout,
                     red.servers)
    servers = (even_server_bytes([s.param_bytes for s in steps.stages], red.servers)
               if red.servers else None)
    return price_step(sched, steps.stages, fwd_bytes, grad_bytes, links, red, servers,
                      check=False, timeline=False)
