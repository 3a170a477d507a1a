"""Lower bounds on a candidate's step time, before and after its cut is solved: the layout
search skips a candidate whose bound cannot beat the best step simulated so far."""

from __future__ import annotations

import numpy as np

from fxpipe.partitioner.problem import PartitionResult
from fxpipe.partitioner.search import Candidate
from fxpipe.plans.placement import (grid_slots_per_node, ring_crosses_nodes, ring_members_per_node,
                                    stage_to_rank)
from fxpipe.specs.schema import ParallelSpec


def _ring_s(nbytes: float, n: int, spec: ParallelSpec, pipeline: int, dp: int,
            layout: str = "pipeline-inner", latency: bool = True, tensor: int = 1) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` over ``n`` ranks on the link its group uses
    (0 under async updates: parameter servers replace the all-reduce, and the bounds this
    serves stay valid). Pipeline rank 0's group decides the link: no rank's group uses a
    faster one than rank 0's under either layout, so this never exceeds a rank's own ring.
    ``latency=False`` leaves the per-hop latency out (for a bound on an average over ranks,
    some of which may hold no parameters and run no all-reduce at all)."""
    if n <= 1 or nbytes <= 0 or spec.train.updates == "async":
        return 0.0
    links = spec.cluster.links
    slots = grid_slots_per_node(spec.cluster.devices_per_node, tensor)
    crosses = ring_crosses_nodes(0, pipeline, dp, slots, layout)
    bw = (links.inter_node_GBps if crosses else links.intra_node_GBps) * 1e9
    if crosses and spec.cluster.device == "cuda":  # rails: the fastest rank's ring bounds
        k = max(ring_members_per_node(pipeline, dp, slots, layout))
        bw = min(links.intra_node_GBps, k * links.inter_node_GBps) * 1e9
    return 2 * (n - 1) / n * nbytes / bw + (2 * (n - 1) * links.latency_s if latency else 0.0)

def reduce_floor(spec: ParallelSpec, cand: Candidate) -> float:
    """At most the share of a stage's parameter bytes its all-reduce sends, under the
    candidate's reduction (:class:`~fxpipe.schedule.step_price.Reduction`): 1 for the exact
    fp32 all-reduce, 1/2 for 16-bit compression, 0 where the share depends on the cut (data
    sharding leaves out the parameters no other stage shares; PowerSGD and top-k their
    matrices' shapes): the bounds stay below the priced step."""
    if cand.sharding != "none" and cand.replicas > 1:
        return 0.0
    return {"none": 1.0, "fp16": 0.5, "bf16": 0.5}.get(spec.train.grad_compression or "none",
                                                        0.0)


#: schedules whose backward is split into B (input gradients) and W (weight gradients)
SPLIT_BACKWARD = frozenset({"zb-h1", "zb-v", "v-half", "v-min", "dualpipev"})

def cut_bound(prefix: np.ndarray, result: PartitionResult, cand: Candidate, spec: ParallelSpec,
               scale: float, slow: np.ndarray, recompute: list[str],
               again: np.ndarray | None = None,
               param_bytes: list[float] | None = None) -> float:
    """A lower bound on the simulated step time of a cut, whatever the schedule does.

    For every rank ``r`` whose lowest stage is ``s0``: nothing runs on ``r`` before micro-batch
    data has gone forward through stages ``0 .. s0-1`` (``fill``: their forwards, all on other
    ranks). After that the rank computes all its ``m`` micro-batches' work, then the all-reduce
    of the stage it finished last (at least the smallest of its stages' all-reduces; the
    others may overlap its compute). And its last backward of ``s0`` (after every F and B of
    its stages, but not necessarily after its split-off W's) is followed by the input
    gradients of stages ``s0-1 .. 0`` (``drain``). Sends and latencies only add time.
    ``recompute``: per stage, ``full`` (its forward again in B), ``selective`` (the forward
    seconds of ``again``, prefix sums over the units, again) or none. ``param_bytes``: the
    stages' parameter bytes (default the cut's; where its memory scaled some, the true
    ones)."""
    params = result.param_bytes if param_bytes is None else param_bytes
    cuts = list(result.cuts) + [prefix.shape[1] - 1]
    split = cand.schedule in SPLIT_BACKWARD
    f, b, w = [], [], []
    for j, (a, e) in enumerate(zip(cuts[:-1], cuts[1:])):
        x = (prefix[:, e] - prefix[:, a]) * scale * slow[j]
        f.append(float(x[0]))
        rerun = (x[0] if recompute[j] == "full" else
                 (again[e] - again[a]) * scale * slow[j] if recompute[j] == "selective" else 0.0)
        b.append(float(x[1] + rerun))
        w.append(float(x[2]))
    ranks = stage_to_rank(cand.schedule, cand.pipeline, cand.num_stages)
    floor = reduce_floor(spec, cand)
    work = [0.0] * cand.pipeline
    fb = [0.0] * cand.pipeline  # what must precede the rank's last B of its lowest stage
    low = [cand.num_stages] * cand.pipeline
    ars: list[list[float]] = [[] for _ in range(cand.pipeline)]
    for j, r in enumerate(ranks):
        work[r] += f[j] + b[j] + w[j]
        fb[r] += f[j] + b[j] + (0.0 if split else w[j])
        low[r] = min(low[r], j)
        ars[r].append(_ring_s(params[j] * floor, cand.replicas, spec,
                              cand.pipeline, cand.replicas, cand.layout, tensor=cand.tensor))
    fcum = np.concatenate([[0.0], np.cumsum(f)])
    bcum = np.concatenate([[0.0], np.cumsum(b)])
    best = 0.0
    for r in range(cand.pipeline):
        s0 = low[r]
        fill, drain = float(fcum[s0]), float(bcum[s0])
        best = max(best, fill + cand.microbatches * work[r] + min(ars[r]),
                   fill + cand.microbatches * fb[r] + drain, sum(ars[r]))
    return best

def _fill_drain_floor(total: float, fill_share: float, work_share: float, m: int,
                      p: int) -> float:
    """A lower bound (seconds per micro-batch unit of ``total``) on :func:`cut_bound`'s term
    of the last pipeline rank against the busiest other one, whatever the cut, for one stage
    per rank: the last rank starts after the forwards of every other stage and its last
    backward is followed by theirs (``fill_share`` of their time at least: the smallest
    (F + B) / (F + B + W) of any unit), and it runs ``m`` x its own work (``work_share`` of its
    time at least); some other rank runs ``m`` x its work, at least the others' average. With
    ``x`` the last stage's time: ``max(a (T - x) + c x, c (T - x) / (p - 1))`` with ``a =
    fill_share``, ``c = m work_share``, minimised over ``x`` in [0, T] (an end or the
    crossing: both are linear)."""
    if p < 2 or total <= 0:
        return 0.0
    a, c = fill_share, m * work_share

    def worst(x: float) -> float:
        return max(a * (total - x) + c * x, c * (total - x) / (p - 1))

    points = [0.0, total]
    den = c * p / (p - 1) - a
    if den > 0:
        points.append(min(total, max(0.0, total * (c / (p - 1) - a) / den)))
    return min(worst(x) for x in points)

def unit_shares(prefix: np.ndarray, again: np.ndarray | None, split: bool
                ) -> tuple[float, float, float]:
    """``(total, fill share, work share)`` of the units for :func:`_fill_drain_floor`: per
    micro-batch seconds of all units (``again``: when recomputing, per unit the forward
    seconds run again, added to B) and the smallest shares of F + B and of the work a rank
    holds a micro-batch for (F + B, + W unless split)."""
    f, b, w = (np.diff(prefix[i]) for i in range(3))
    if again is not None:
        b = b + again
    tot = f + b + w
    live = tot > 0
    if not live.any():
        return 0.0, 1.0, 1.0
    fb = (f + b)[live] / tot[live]
    work = fb if split else np.ones_like(fb)
    return float(tot.sum()), float(fb.min()), float(work.min())

def candidate_bound(cand: Candidate, scale: float, spec: ParallelSpec, total: float,
                     total_params: float, biggest: float, fastest: float,
                     stage_floor: float = 0.0, shares: tuple[float, float, float] | None = None
                     ) -> float:
    """A lower bound on the simulated step time of any cut of the candidate (before solving
    it): some rank computes at least the average share of the work, the costliest unit
    (``biggest``) and the slowest stage of the best compute-only cut (``stage_floor``:
    :func:`chain_bottleneck` into the candidate's stages), ``m`` times; with one stage per
    rank, each rank's all-reduce follows all its work (so the average rank's work plus its
    all-reduce, bandwidth term only: a rank without parameters runs none); with several stages
    per rank the all-reduces of stages finished early may overlap compute, so only their sum on
    one rank counts. ``shares``: :func:`unit_shares` for the last rank's fill and drain
    (:func:`_fill_drain_floor`); ``total`` then is theirs."""
    m = cand.microbatches * scale * fastest
    if shares is not None:
        total = shares[0]
    work = m * max(total / cand.pipeline, biggest, stage_floor)
    ring = _ring_s(total_params / cand.pipeline * reduce_floor(spec, cand), cand.replicas, spec,
                   cand.pipeline, cand.replicas,
                   cand.layout, latency=False, tensor=cand.tensor)
    if cand.num_stages == cand.pipeline:
        fill = (scale * fastest * _fill_drain_floor(shares[0], shares[1], shares[2],
                                                    cand.microbatches, cand.pipeline)
                if shares is not None else 0.0)
        return max(work, m * total / cand.pipeline + ring, fill)
    return max(work, ring)
