"""Per-block parameter gathering (``parallel.param_gather: block``) as the planner sees it.

Under ``data_sharding: full`` a stage's replicas keep only slices of its parameters. Gathered
whole once per step (``stage``), the stage holds its whole parameters and gradients through
its micro-batches; gathered block by block (``block``, FSDP / ZeRO-3 style), a stage holds its
shards and, at any moment, the one or two groups (:mod:`fxpipe.plans.param_blocks`: a block of
the model's repeated layers, else a module) it is running and prefetching.

Memory, per stage, is the runtime's peak (:mod:`fxpipe.runtime.block_gather`, the groups'
padding to a multiple of the replicas aside; :func:`~fxpipe.schedule.step_price.
block_static_bytes`): with ``P_g`` its groups of parameters no other stage uses (``P`` in
all), ``W_sh`` those it shares with another stage (held and all-reduced whole), ``k``
optimizer state bytes per parameter byte and ``n`` replicas:

* shards: ``(3 + k) / n x P`` (the master slice, the float32 gradient slices of the step and
  kept across steps, the optimizer state) and ``(2 + k) x W_sh``;
* gathered: the largest adjacent pair ``P_g + P_g+1`` (one group running, the next
  prefetched); reducing: the largest ``w P_g (1 + 1/n) + w P_g-1`` (a reduce-scatter in flight
  while the next is packed, ``w`` 1/2 under 16-bit compression);
* whole gradients: the largest group's (freed as it is reduced), or under a split backward
  (W computes every weight gradient of the stage at once) every group's, ``P``.

The cut problem (a factor per parameter byte) charges ``state_factor(..., gather="block")``
per byte and reserves :func:`gathered_bound` of every stage's device (bounds on the terms
above from the model's two largest groups, and the whole state of the parameters several
units read); the cut's stages are then held
to their exact figures (:func:`static_fixed`, what :class:`~fxpipe.schedule.step_price.
Reduction` charges the prediction).

Time: each stage's F, B and W are priced with the gathers the runtime runs per micro-batch
(:func:`~fxpipe.schedule.step_price.gather_exposure`) from the per-group rows of
:func:`with_gather_rows`: ``[bytes, F, B, W, replay]`` seconds, in the order the forward
gathers the groups. The rows are recorded in the Plan (``StagePlan.gather_groups``), so the
plan's prediction prices exactly what the search ranked.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from fxpipe.errors import PlanError
from fxpipe.partitioner.bounds import SPLIT_BACKWARD, _ring_s
from fxpipe.partitioner.cut_tables import _copied_params, unit_params
from fxpipe.partitioner.pricing import Priced, selective_at
from fxpipe.partitioner.search import Candidate
from fxpipe.plans.param_blocks import group_of, has_blocks
from fxpipe.schedule.step_price import StageStep, block_static_bytes
from fxpipe.specs.loader import spec_location
from fxpipe.specs.schema import OPTIMIZER_STATE_FACTOR, ParallelSpec, state_factor

__all__ = ["is_block", "factor", "model_has_blocks", "drop_block_candidates",
           "comm_floor", "gathered_bound", "static_fixed", "with_gather_rows"]


def is_block(cand: Candidate) -> bool:
    """Whether the candidate gathers its stages' parameters block by block."""
    return cand.gather == "block" and cand.sharding == "full" and cand.replicas > 1


def factor(spec: ParallelSpec, cand: Candidate) -> float:
    """Bytes of training state per parameter byte the cut problem charges the candidate
    (:func:`~fxpipe.specs.schema.state_factor` at its sharding and gathering)."""
    return state_factor(spec.train.optimizer, cand.sharding, cand.replicas,
                        cand.gather if is_block(cand) else "stage",
                        cand.schedule in SPLIT_BACKWARD)


def _k(spec: ParallelSpec) -> float:
    return OPTIMIZER_STATE_FACTOR.get(spec.train.optimizer, 4.0) - 2.0


def model_has_blocks(pr: Priced) -> bool:
    """Whether any trained parameter of the model lies in a block (a numbered layer list)."""
    return has_blocks([f for ns in unit_params(pr).names for f in ns])


def drop_block_candidates(pr: Priced, spec: ParallelSpec, cands: list[Candidate]
                          ) -> list[Candidate]:
    """``cands`` without those gathering block by block when the model has no blocks
    (``param_gather: auto``: they would gather it module by module; not weighed).

    Raises:
        PlanError: ``param_gather: block`` for a model with no block structure (one line)."""
    if not any(c.gather == "block" for c in cands) or model_has_blocks(pr):
        return cands
    if spec.parallel.param_gather == "block":
        where = spec_location(spec, "parallel.param_gather")
        raise PlanError(f"{where + ': ' if where else ''}parallel.param_gather: block: per-block "
                        "sharding of a model with no block structure (no parameter lies in a "
                        "numbered layer list such as h.0 or layers.0); use param_gather: stage "
                        "or auto")
    return [c for c in cands if c.gather != "block"]


def _unit_rows(pr: Priced) -> list[list[tuple[str, str, float]]]:
    """Per unit, ``(group, parameter, bytes)`` of the trained parameters it reads, in order
    (computed once)."""
    got = pr.cache.get("gather_units")
    if got is None:
        up = unit_params(pr)
        got = pr.cache["gather_units"] = [[(group_of(f), f, float(up.nbytes.get(f, 0.0)))
                                           for f in ns] for ns in up.names]
    return got


def gathered_bound(pr: Priced, spec: ParallelSpec, cand: Candidate) -> float:
    """Bytes a block-gathering stage holds beyond ``factor x`` its parameter bytes, at most,
    whatever the cut: the model's two largest groups (and their gradients, unless the backward
    is split: then the factor counts the whole gradients) and, with several stages, the whole
    state of every parameter several units read (shared between stages it is not sharded; one
    stage holds every reader, so there it is sharded as the others are). 0 for other
    candidates."""
    if not is_block(cand):
        return 0.0
    key = "gather_bound"
    if key not in pr.cache:
        sizes: dict[str, float] = {}
        seen: set[str] = set()
        for row in _unit_rows(pr):
            for g, f, b in row:
                if f not in seen:
                    seen.add(f)
                    sizes[g] = sizes.get(g, 0.0) + b
        up = unit_params(pr)
        spread = sum(float(up.nbytes.get(f, 0.0)) for f, _ in up.spread)
        pr.cache[key] = (sum(sorted(sizes.values())[-2:]), spread)
        pr.cache[key + "s"] = list(sizes.values())
    top2, spread = pr.cache[key]
    top1 = top2 if top2 <= 0 else max(g for g in pr.cache[key + "s"])
    k, n = _k(spec), cand.replicas
    split = cand.schedule in SPLIT_BACKWARD
    wire = 0.5 if spec.train.grad_compression in ("fp16", "bf16") else 1.0
    return (top2 + wire * (top2 + top1 / n) + (0.0 if split else top1)
            + ((2.0 + k) * spread if cand.num_stages > 1 else 0.0))


def comm_floor(pr: Priced, spec: ParallelSpec, cand: Candidate) -> float:
    """A lower bound on the step time of a block-gathering candidate, whatever the cut (0 for
    others): every micro-batch, each stage gathers its unshared parameters in its forward and
    again in its backward and reduce-scatters their gradients, and a stage's F, B and W as
    priced (:func:`~fxpipe.schedule.step_price.gather_exposure`) last at least as long as
    those transfers; some rank holds at least the average share of the parameters (those
    several units read may be shared, held whole: left out), its ring no faster than pipeline
    rank 0's (:func:`~fxpipe.partitioner.bounds._ring_s`)."""
    if not is_block(cand) or spec.train.updates == "async":
        return 0.0
    up = unit_params(pr)
    spread = sum(float(up.nbytes.get(f, 0.0)) for f, _ in up.spread)
    mine = max(0.0, float(sum(pr.table.params)) - spread) / cand.pipeline
    wire = 0.5 if spec.train.grad_compression in ("fp16", "bf16") else 1.0
    # _ring_s is an all-reduce, 2 (n-1)/n x bytes / bw: a gather or reduce-scatter is half
    ring = _ring_s(mine, cand.replicas, spec, cand.pipeline, cand.replicas, cand.layout, latency=False,
                   tensor=cand.tensor) / 2.0
    return cand.microbatches * (2.0 + wire) * ring


def _stage_groups(pr: Priced, cuts: Sequence[int]
                  ) -> tuple[list[list[tuple[str, float, list[int]]]], list[float]]:
    """Per stage of the cut (stage starts ``cuts``): its groups in the order its forward first
    reads them, ``(group, bytes of its unshared parameters, units it runs while the group is
    the last one gathered)``, and the bytes of its parameters other stages read too."""
    rows = _unit_rows(pr)
    n = len(rows)
    ends = list(cuts[1:]) + [n]
    k = len(cuts)
    stage_of = np.zeros(n, dtype=np.int64)
    for j, (a, b) in enumerate(zip(cuts, ends)):
        stage_of[a:b] = j
    readers: dict[str, set[int]] = {}
    for u, row in enumerate(rows):
        for _, f, _ in row:
            readers.setdefault(f, set()).add(int(stage_of[u]))
    for s, names in enumerate(_copied_params(pr, [int(x) for x in stage_of], k)):
        for f in names:
            readers.setdefault(f, set()).add(s)
    out, shared = [], []
    for j, (a, b) in enumerate(zip(cuts, ends)):
        groups: dict[str, list] = {}
        counted: set[str] = set()
        sh = 0.0
        current: str | None = None
        waiting: list[int] = []  # units before the stage's first group: run with it
        for u in range(a, b):
            first = None
            for g, f, nb in rows[u]:
                if f in counted:
                    continue
                counted.add(f)
                if len(readers.get(f, ())) > 1:
                    sh += nb
                    continue
                if g not in groups:
                    groups[g] = [g, 0.0, []]
                groups[g][1] += nb
                first = first or g
            if first is not None and first != current and not groups[first][2]:
                current = first
            if current is None:
                waiting.append(u)
            else:
                groups[current][2].extend(waiting + [u])
                waiting = []
        if waiting and groups:
            next(iter(groups.values()))[2].extend(waiting)
        out.append([tuple(x) for x in groups.values()])
        shared.append(sh)
    return out, shared


def static_fixed(pr: Priced, spec: ParallelSpec, cand: Candidate, cuts: Sequence[int],
                 param_bytes: Sequence[float]) -> list[float] | None:
    """Per stage of the cut, the bytes of training state it holds beyond ``factor x
    param_bytes`` (the cut problem's figure): the exact figure of the module doc less that;
    None for a candidate that does not gather block by block."""
    if not is_block(cand):
        return None
    groups, shared = _stage_groups(pr, cuts)
    split = cand.schedule in SPLIT_BACKWARD
    wire = 0.5 if spec.train.grad_compression in ("fp16", "bf16") else 1.0
    mult = factor(spec, cand)
    return [block_static_bytes([b for _, b, _ in gs], sh, cand.replicas, _k(spec), wire, split)
            - mult * float(param_bytes[j]) for j, (gs, sh) in enumerate(zip(groups, shared))]


def with_gather_rows(pr: Priced, stages: list[StageStep], cuts: Sequence[int],
                     replay: Sequence[float], modes: Sequence[str],
                     heads: Sequence[int | None] | None = None,
                     ridges: Sequence[float] | None = None) -> list[StageStep]:
    """``stages`` (a block-gathering candidate's, as :func:`~fxpipe.partitioner.cut_price.
    cut_steps` priced them) with their gather rows: per group ``[bytes, F, B, W, replay]``
    seconds, the stage's F, B (less its replayed forward, ``replay``), W and replayed forward
    split over its groups as its units' own seconds are (a unit counts with the group last
    gathered when it runs; units before the first group with the first). ``modes``: per stage
    its recomputation (``full``, ``selective`` replay its forward, gathering every group once
    more; else none); ``heads``: per stage recomputing partially, the unit its kept tail
    starts at (only the units before it replay, and only their groups gather again);
    ``ridges``: per stage, a selective stage's keep threshold (0: the ridge point)."""
    groups, whole = _stage_groups(pr, cuts)
    tb = pr.table
    times = np.asarray(tb.times, dtype=np.float64).reshape(-1, 3)
    sels: dict[float, np.ndarray] = {}
    out = []
    heads = heads or [None] * len(stages)
    ridges = ridges or [0.0] * len(stages)
    for st, gs, again, mode, head, ridge, sh in zip(stages, groups, replay, modes, heads, ridges,
                                                    whole):
        rc = mode in ("full", "selective")
        totals = np.array([st.fwd_s, st.bwd_input_s - again, st.bwd_weight_s, again])
        if mode == "selective" and ridge not in sels:
            sel = selective_at(pr, ridge)
            sels[ridge] = (np.asarray([a for a, _ in sel], dtype=np.float64) if sel
                           else times[:, 0])
        rerun = sels[ridge] if mode == "selective" else times[:, 0]
        per = np.array([[times[units, 0].sum(), times[units, 1].sum(), times[units, 2].sum(),
                         rerun[[u for u in units if head is None or u < head]].sum() if rc
                         else 0.0] for _, _, units in gs], dtype=np.float64).reshape(-1, 4)
        secs = per
        if len(per):
            sums = per.sum(axis=0)
            share = np.where(sums > 0, per / np.where(sums > 0, sums, 1.0), 1.0 / len(per))
            secs = share * totals
        rows = [[float(b), *map(float, x)] for (_, b, _), x in zip(gs, secs)]
        # the shared parameters it holds whole that another stage's bytes count (a tied
        # embedding's later copy): :func:`static_fixed` holds them on every stage using them
        out.append(dataclasses.replace(st, gather_rows=rows, gather_replay=rc,
                                       tied_bytes=max(0.0, sh - float(st.shared_bytes))))
    return out
