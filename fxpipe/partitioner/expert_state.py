"""Experts' training state under data sharding (``parallel.expert`` with
``parallel.data_sharding``): the sharding leaves the expert parameters whole (they differ
between the replicas of an expert group, so no slice of them is the same on all replicas;
their gradients are reduced over the replicas holding the same experts), so each expert byte
holds its whole state (weights, gradients, optimizer state: ``state_factor`` unsharded) where
the cut problem's multiplier charges the sharded one. The cut problem's memory sees the
experts' bytes scaled up by the difference (:func:`memory_params`); the stage's parameter
bytes reported and priced are the true ones (:func:`true_param_bytes`), its expert bytes held
whole (:func:`stage_expert_bytes`)."""

from __future__ import annotations

from fxpipe.partitioner.gathering import factor
from fxpipe.specs.schema import state_factor


def unit_expert_bytes(pr) -> list[float]:
    """Per planning unit of ``pr`` (node-level, or folded into blocks like its parameter
    bytes), the expert parameter bytes it holds (``Priced.expert_params``)."""
    pg, g = pr.pg, pr.pg.graph
    per = [float(sum(pr.expert_params.get(m, 0) for m in g.nodes[u]["members"]))
           for u in pg.order]
    fo = pr.table.folding
    if fo is None:
        return per
    block = sum(per[p] for p in fo.block_units[-1])
    return ([per[p] for p in fo.prologue] + [block] * fo.run.count
            + [per[p] for p in fo.epilogue])


def whole_state_ratio(spec, cand) -> float:
    """Under data sharding, how much more state an expert parameter byte holds than the cut
    problem's multiplier charges (experts are left whole by the sharding: they differ between
    the replicas of an expert group), less one; 0 without sharding."""
    mult = factor(spec, cand)
    whole = state_factor(spec.train.optimizer)
    return whole / mult - 1.0 if mult > 0 and whole != mult else 0.0


def memory_params(pr, spec, cand, params: list[float]) -> list[float]:
    """``params`` per unit as the cut problem's memory charges them: the experts' bytes
    scaled so that ``multiplier x bytes`` is their whole (unsharded) state."""
    r = whole_state_ratio(spec, cand) if pr.expert_params else 0.0
    if not r:
        return list(params)
    return [p + e * r for p, e in zip(params, unit_expert_bytes(pr))]


def stage_expert_bytes(pr, cuts: list[int]) -> list[float]:
    """Per stage of a cut (stage starts ``cuts``), the expert parameter bytes it holds."""
    if not pr.expert_params:
        return [0.0] * len(cuts)
    per = unit_expert_bytes(pr)
    ends = list(cuts[1:]) + [len(per)]
    return [float(sum(per[a:b])) for a, b in zip(cuts, ends)]


def true_param_bytes(pr, spec, cand, result) -> list[float]:
    """The solved cut's parameter bytes per stage without :func:`memory_params`' scaling."""
    r = whole_state_ratio(spec, cand) if pr.expert_params else 0.0
    experts = stage_expert_bytes(pr, list(result.cuts))
    return [float(p) - e * r for p, e in zip(result.param_bytes, experts)]
