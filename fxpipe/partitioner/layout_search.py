"""The layout search pass: every candidate layout (pipeline x data x tensor x micro-batches x
schedule x sharding x placement) in the order of its lower bound, cut, priced, ranked; and
what the explanation says about the choice."""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import numpy as np

from fxpipe.context.analysis import ContextError, analyse, sequence_length
from fxpipe.errors import FxpipeError, PlanError
from fxpipe.partitioner.bounds import SPLIT_BACKWARD, candidate_bound, cut_bound, unit_shares
from fxpipe.partitioner.cut_price import simulate_cut
from fxpipe.partitioner.expert_state import true_param_bytes
from fxpipe.partitioner.cutting import (FULL, OFF, OFFLOAD, SELECTIVE, Recompute, cut_problem,
                                        every_stage_forced,
                                        fastest_slowdown, fits_recomputing,
                                        fits_without_recompute, held_note,
                                        recompute_held, recompute_modes, recompute_stages,
                                        selective_prefix, solve_fitting, static_share)
from fxpipe.partitioner.gathering import (comm_floor, drop_block_candidates, factor,
                                          is_block, model_has_blocks, static_fixed)
from fxpipe.partitioner.pricing import Priced, selective_levels, unit_prefix
from fxpipe.partitioner.problem import PartitionResult, evaluate
from fxpipe.partitioner.search import (DEEP_VIRTUAL_STAGES, Candidate, candidates,
                                      stage_inflight, tensor_degrees)
from fxpipe.partitioner.solvers import chain_bottleneck
from fxpipe.specs.schema import OPTIMIZER_STATE_FACTOR, ParallelSpec, state_factor
from fxpipe.tensor.choose import DegreeError
from fxpipe.units import human_bytes, plural

_progress = logging.getLogger("fxpipe.progress")


@dataclass(order=True)
class _Ranked:
    step_s: float
    label: str
    cand: Candidate = dataclasses.field(compare=False)
    result: PartitionResult = dataclasses.field(compare=False)
    mbs: int = dataclasses.field(compare=False)
    #: the candidate as its cut was solved (``cand`` says ``recompute=""`` where every stage
    #: dropped the recomputation the cut was solved with): what the exact solve re-solves
    solved: Candidate | None = dataclasses.field(default=None, compare=False)

def search_layouts(pr_at: Callable[[int], Priced], spec: ParallelSpec, prune: bool = True
            ) -> tuple[Candidate, PartitionResult, int, list[str]]:
    """The fastest candidate layout that fits, and the explanation of the ranking.

    ``pr_at(t)``: the priced units at tensor-parallel degree ``t`` (one rank's costs). Every
    degree of :func:`~fxpipe.partitioner.search.tensor_degrees` is tried; a degree the model
    cannot take (heads, vocabulary) is left out and said why.

    Candidates are visited in the order of a lower bound on their step time (every rank runs
    its share of ``m`` micro-batches, ``m x total / p``, and all-reduces its share of the
    parameters); a candidate whose bound, or whose cut's bound (:func:`cut_bound`), cannot beat
    the best simulated step so far is not simulated. Where activations do not fit, the
    candidate is tried again with activation recomputation (``train.activation_recompute``).
    The bounds are valid lower bounds and a candidate is pruned only when its bound exceeds
    the best step (ties are simulated), so ``prune=False`` (simulate every candidate that fits)
    picks the same layout and cut. The candidate returned is the one its cut was solved as
    (its ``recompute`` the mode of that solve, even where every stage dropped it after:
    :func:`~fxpipe.partitioner.cutting.recompute_stages`), so solving it again exactly solves
    the same cut problem."""
    bounds = []
    fastest = fastest_slowdown(spec)
    degrees = tensor_degrees(spec)
    mode = spec.train.activation_recompute
    offload = spec.train.activation_offload
    if offload == "auto" and spec.cluster.device == "cpu":
        offload = "off"  # host and device memory are one: offloading frees nothing there
    may_drop = mode == "auto" or offload == "auto"  # a stage may give up its activations
    left_out: list[str] = []
    unfilled: list[str] = []  # candidates whose batch leaves a micro-batch no sample
    first_error: FxpipeError | None = None
    priced: dict[int, Priced] = {}
    for t in degrees:
        try:
            pr = priced[t] = pr_at(t)
            cands = drop_block_candidates(pr, spec, candidates(
                spec, max_stages=len(pr.table.names), tensor=t))
        except (DegreeError, PlanError) as e:
            left_out.append(f"tensor {t}: {e}")
            first_error = first_error or e
            continue
        prefix = unit_prefix(pr)
        total = float(prefix[:, -1].sum())
        total_params = float(sum(pr.table.params))
        biggest = float(np.diff(prefix.sum(axis=0)).max(initial=0.0))  # the costliest unit
        cumulative = [float(x) for x in prefix.sum(axis=0)]
        # what a recomputing stage runs again, at least: the nodes selective recomputation
        # runs again where it may fit, else the forward
        again = {SELECTIVE: selective_prefix(pr), FULL: prefix[0]}
        if offload != "off":  # an offloading stage's bytes cross the host link twice at least
            again[OFFLOAD] = np.concatenate([[0.0], np.cumsum(
                2.0 * np.asarray(pr.table.saved, dtype=np.float64) / spec.cluster.host_Bps)])
        with_rc = {m: [float(x) for x in prefix.sum(axis=0) + a] for m, a in again.items()}
        floors: dict[tuple[int, str], float] = {}  # the best compute-only cut's slowest stage
        shares: dict[tuple[str, bool], tuple[float, float, float]] = {}
        for cand in cands:
            mbs = spec.data.batch_size // (cand.dp * cand.microbatches)
            if mbs < 1:
                small = (f"data.batch_size {spec.data.batch_size} does not fill data "
                         f"{cand.dp} x microbatches {cand.microbatches} (at least one sample "
                         "each); give a larger batch, fewer micro-batches, or a data degree "
                         "that leaves samples for them")
                if small not in unfilled:
                    unfilled.append(small)
                continue
            scale, k = mbs / pr.batch, cand.num_stages
            if cand.schedule in _LOW_MEMORY and mode == "auto":
                rc_only = None  # told in the loop below, if the candidate is tried at all
            else:
                rc_only = (every_stage_forced(spec) or (may_drop and not fits_without_recompute(
                    pr, spec, cand, scale)))
            # selective recomputation where some cut may fit it: at the ridge point, else
            # (``selective`` asked: no full recomputation to fall back on) at the lowest keep
            # threshold above it that may (:func:`_selective_above`; under ``auto`` a full
            # candidate's stages take those thresholds where they fit, recompute_stages)
            levels = selective_levels(pr) if mode == "selective" else []
            sel_way = None
            if mode in ("auto", "selective"):
                if fits_recomputing(pr, spec, cand, scale, SELECTIVE):
                    sel_way = SELECTIVE
                else:
                    sel_way = next(((SELECTIVE, r) for r in levels if fits_recomputing(
                        pr, spec, dataclasses.replace(cand, keep_ridge=r), scale, SELECTIVE)),
                        None)
            # the least recomputation the candidate can have (none: a lower bound either way;
            # offloading runs nothing again)
            least = OFF if not rc_only or offload == "on" else (sel_way or FULL)
            split = cand.schedule in SPLIT_BACKWARD
            floor_b = comm_floor(pr, spec, cand) if cand.gather == "block" else 0.0

            def bound(way) -> float:
                if isinstance(way, tuple) and way not in again:  # a threshold above the ridge
                    again[way] = selective_prefix(pr, way[1])
                    with_rc[way] = [float(x) for x in prefix.sum(axis=0) + again[way]]
                if (k, way) not in floors:
                    floors[(k, way)] = chain_bottleneck(with_rc[way] if way else cumulative, k)
                floor = floors[(k, way)] if k == cand.pipeline else 0.0  # one stage per rank
                if (way, split) not in shares:
                    shares[(way, split)] = unit_shares(
                        prefix, np.diff(again[way]) if way else None, split)
                return max(floor_b, candidate_bound(cand, scale, spec, total, total_params,
                                                    biggest, fastest, floor,
                                                    shares[(way, split)]))

            lbs = {way: bound(way)
                   for way in ((least, OFFLOAD) if offload != "off" else (least,))}
            lb, lb_off = lbs[least], lbs.get(OFFLOAD)  # (offloading, at least)
            if offload == "on":
                lb = lb_off
            elif lb_off is not None and rc_only:
                lb = min(lb, lb_off)
            # selective at each keep threshold above the ridge point, at least (each stage
            # recomputing at it; weighed only where it might beat the best so far)
            lb_levels = [bound((SELECTIVE, r)) if sel_way is not None else float("inf")
                         for r in levels]
            bounds.append((lb, cand.label(), cand, mbs, pr, prefix, rc_only, lb_off,
                           lb_levels))
    if not bounds:
        if len(degrees) == 1 and first_error is not None:
            raise first_error
        if len(degrees) == 1 and not left_out and unfilled:
            raise PlanError(unfilled[0])  # (every candidate's batch left some rank no sample)
        raise PlanError("no tensor-parallel degree fits the model:\n  " + "\n  ".join(
            left_out + unfilled))
    bounds.sort(key=lambda x: (x[0], x[1]))
    best: _Ranked | None = None
    ranked: list[_Ranked] = []
    failed: list[tuple[float, Candidate, float, Priced]] = []  # (bound, candidate, scale, pr)
    pruned = 0  # candidate layouts pruned by a lower bound (theirs, or every cut's of theirs)
    layouts_simulated = 0  # candidate layouts with at least one cut simulated
    host_short: list[str] = []  # offload weighed and turned down for host memory (why)
    capacity = spec.cluster.memory_gb * 1e9
    solved: dict = {}  # identical cut problems (e.g. the two placements of one grid) solve once
    fit: dict[tuple, str] = {}  # (layout key, schedule) -> how it fits device memory
    # V-Half / V-Min are tried at a layout only where ZB-V (for V-Min, also V-Half) does not
    # fit it without recomputation, and then only without it: they are ZB-V's placement with
    # fewer micro-batches in flight, so where it fits they only add bubble; with recomputation
    # on, only where those do not fit at all. One met before those waits for them (twice: V-Min
    # for V-Half, which may wait for ZB-V).
    enough = "fits only with recomputation" if every_stage_forced(spec) else "fits"
    queue, waited, skipped, deeper, block_skipped = list(bounds), Counter(), 0, 0, 0
    depth: dict[tuple, float] = {}  # (layout, stages per rank) -> interleaved's best step
    depths = {(_layout_key(b[2]), b[2].virtual_stages) for b in bounds
              if b[2].schedule == "interleaved"}  # the depths searched
    given_up: set[tuple] = set()  # (layout..., stages per rank): interleaved not tried
    i = -1
    while i + 1 < len(queue):
        i += 1
        lb, label, cand, mbs, pr, prefix, rc_only, lb_off, lb_levels = queue[i]
        _progress.info("auto search: candidate %d/%d (%s)%s", i + 1, len(bounds), label,
                       f", best so far {best.step_s * 1e3:.3g} ms/step" if best else "")
        if prune and best is not None and lb > best.step_s:
            pruned += 1
            continue
        scale = mbs / pr.batch
        fkey = (_layout_key(cand), _fit_name(cand))
        key = _layout_key(cand)
        shallower = [v for v in DEEP_VIRTUAL_STAGES if v < cand.virtual_stages][-2:]
        if cand.schedule == "interleaved" and shallower and (key, shallower[-1]) in depths:
            # deeper interleaving only where the next shallower depth was simulated and was
            # faster than the one before it (the bubble shrinks with depth, the messages grow)
            got = [depth.get((key, v)) for v in shallower]
            if got[-1] is None and key + (shallower[-1],) not in given_up \
                    and waited[label] < 2:
                waited[label] += 1
                queue.append(queue[i])
                continue
            if got[-1] is None or (len(got) == 2 and got[0] is not None and got[1] >= got[0]):
                deeper += 1
                given_up.add(key + (cand.virtual_stages,))
                continue
        if cand.schedule in _LOW_MEMORY:
            full = [fit.get((fkey[0], s)) for s in _LOW_MEMORY_VERSUS[cand.schedule]]
            if "fits" in full or enough in full:
                skipped += 1
                continue
            if None in full and waited[label] < 2:
                waited[label] += 1
                queue.append(queue[i])
                continue
            if mode == "auto" and not fits_without_recompute(pr, spec, cand, scale):
                skipped += 1
                continue
            rc_only = every_stage_forced(spec)
        if cand.gather == "block" and spec.parallel.param_gather == "auto":
            # gathering block by block only where gathering whole stages does not fit without
            # recomputation (elsewhere it only adds gathers per micro-batch); one met before
            # the whole-stage candidate of its layout waits for it (twice)
            whole = fit.get((_layout_key(_whole_gather(spec, cand)), fkey[1]))
            if whole in ("fits", enough):
                block_skipped += 1
                fit[fkey] = whole  # as gathering whole stages (v-half / v-min ask)
                continue
            if whole is None and waited[label] < 2:
                waited[label] += 1
                queue.append(queue[i])
                continue
        if static_share(pr, spec, cand) > capacity:  # cannot fit, whatever the cut
            failed.append((lb, cand, scale, pr))
            fit[fkey] = "does not fit"
            continue
        founds = []
        low = cand.schedule in _LOW_MEMORY and mode == "auto"  # tried without recomputation
        modes = (OFF,) if low else recompute_modes(
            mode, bool(rc_only), mode != "auto" or fits_recomputing(pr, spec, cand, scale,
                                                                    SELECTIVE), offload)
        for rc in modes:
            if rc == OFFLOAD and prune and best is not None and lb_off > best.step_s:
                continue  # offloading cannot beat the best so far
            if (founds and founds[0][0].recompute == OFF and rc != OFFLOAD
                    and len(founds) >= 2 and not (founds[-1][0].recompute == SELECTIVE
                                                  and _memory_shaped(pr, prefix, founds[-1],
                                                                     scale))):
                continue  # under auto a cut that fits keeping its activations is weighed
                # against the next recomputing one (selective, else full) and offload; where
                # none fits keeping them, every way against each other. A selective cut that
                # device memory shaped is weighed against the full one too (whose stages
                # take the higher keep thresholds where they fit: more balanced)
            c = dataclasses.replace(cand, recompute=rc)
            got = None
            try:
                if rc != SELECTIVE or fits_recomputing(pr, spec, c, scale, SELECTIVE):
                    got = (c, *solve_fitting(pr, spec, c, scale, solved))
                    founds.append(got)
            except PlanError as e:
                if rc == OFFLOAD and "host memory" in str(e):
                    host_short.append(str(e))
            if rc == SELECTIVE and lb_levels:  # (selective asked) at higher keep thresholds
                # where that is memory's doing
                founds += _selective_above(pr, spec, c, scale, solved, prefix, got, [
                    r for r, x in zip(selective_levels(pr), lb_levels)
                    if not (prune and best is not None and x > best.step_s)])
        if not founds:
            failed.append((lb, cand, scale, pr))
            fit[fkey] = "does not fit"
            continue
        fit[fkey] = "fits only with recomputation" if founds[0][0].recompute else "fits"
        if len(bounds) == 1 and len(founds) == 1 and not (
                may_drop and founds[0][0].recompute) and not founds[0][0].keep_ridge:
            # (else it says what the lever bought)
            cand, _, result, _ = founds[0]
            return cand, result, mbs, (
                _degree_notes(left_out) + _sharding_notes(pr, spec, cand)
                + _gather_notes(pr, spec, _Ranked(_forced_block_step(
                    pr, spec, founds[0], scale), cand.label(), cand, result, mbs), [], fit,
                    block_skipped)
                + _host_short_note(cand, host_short))
        same: set[tuple] = set()
        n_ranked, cut_pruned = len(ranked), False
        for cand, problem, result, rc in founds:
            solved_as = cand
            if cand.recompute and not any(rc.flags):  # every stage dropped it: say so
                cand = dataclasses.replace(cand, recompute=OFF)
            if (tuple(result.cuts), tuple(rc.flags), tuple(rc.ridges or ())) in same:
                continue  # the selective cut came out as the one without recomputation
            same.add((tuple(result.cuts), tuple(rc.flags), tuple(rc.ridges or ())))
            if prune and best is not None and cut_bound(
                    prefix, result, cand, spec, scale, problem.slow, rc.flags,
                    selective_prefix(pr), true_param_bytes(pr, spec, cand, result)) > best.step_s:
                cut_pruned = True
                continue
            r = _Ranked(simulate_cut(pr, prefix, problem, result, cand, spec, scale,
                                      rc).step_time_s, cand.label(), cand, result, mbs,
                         solved_as)
            if cand.schedule == "interleaved":
                k_ = (_layout_key(cand), cand.virtual_stages)
                depth[k_] = min(depth.get(k_, r.step_s), r.step_s)
            ranked.append(r)
            best = r if best is None or r < best else best
        if len(ranked) > n_ranked:
            layouts_simulated += 1
        elif cut_pruned:
            pruned += 1
    if best is None:
        raise _nothing_fits(spec, failed)
    ranked.sort()
    scaled = any(r.mbs != priced[r.cand.tensor].batch for r in ranked)
    others = len(bounds) - layouts_simulated - pruned - len(failed)
    explain = [f"auto search: {plural(len(bounds), 'candidate layout')}, {layouts_simulated} "
               "simulated" + (f" (as {len(ranked)} cuts: a layout that fits several ways of "
                              "holding its activations - keeping them, recomputing them "
                              "selectively or fully, offloading them - is cut and simulated "
                              "once per way)" if len(ranked) > layouts_simulated else "")
               + f", {pruned} pruned by a lower bound, {len(failed)} infeasible"
               + (f", {others} not tried (below)" if others > 0 else "")
               + "; ranked by simulated step time"
               + (" (each layout's micro-batch priced by scaling the traced one's costs; the "
                  "chosen layout is then traced at its own size, which gives the plan's "
                  "prediction)" if scaled else "") + ":"]
    explain += [f"  {i + 1}. {r.label:40s} {r.step_s * 1e3:10.2f} ms/step"
                for i, r in enumerate(ranked[:5])]
    explain += _degree_notes(left_out, ranked, degrees)
    if spec.parallel.sequence_parallel and best.cand.tensor == 1:
        explain.append("parallel.sequence_parallel is off in this plan: it splits the sequence "
                       "over a tensor group, and the search chose tensor 1")
    if spec.parallel.tp_overlap not in (1, "auto") and best.cand.tensor == 1:
        explain.append("parallel.tp_overlap has no effect in this plan: it overlaps the "
                       "collectives of a tensor group, and the search chose tensor 1")
    explain += _sharding_notes(priced[best.cand.tensor], spec, best.cand, ranked, failed)
    explain += _memory_schedule_notes(best.cand, fit)
    explain += _lever_notes(priced[best.cand.tensor], spec, best)
    explain += _gather_notes(priced[best.cand.tensor], spec, best, ranked, fit, block_skipped)
    explain += _host_short_note(best.cand, host_short)
    if best.cand.schedule == "interleaved":
        tried = sorted((v, t) for (k, v), t in depth.items() if k == _layout_key(best.cand))
        if len(tried) > 1:
            explain.append(f"interleaving depth {best.cand.virtual_stages} stages per rank "
                           "chosen at this layout: " + ", ".join(
                               f"{v} -> {t * 1e3:.2f} ms/step" for v, t in tried)
                           + " (a deeper one shortens the bubble and sends more messages)")
    if deeper:
        explain.append(f"interleaved: {plural(deeper, 'deeper layout')} not tried: a depth "
                       f"({', '.join(map(str, DEEP_VIRTUAL_STAGES))} stages per rank) is tried "
                       "only where the next shallower one was simulated and was faster than "
                       "the one before it (the bubble shrinks with depth, the messages grow)")
    if skipped:
        explain.append(f"v-half / v-min not tried at {skipped} candidate layouts: they are tried "
                       "only where zb-v (for v-min, also v-half) needs activation recomputation "
                       "and they do not (elsewhere they would only add bubble)")
    # the candidate as its cut was solved (the exact solve must solve the same problem: one
    # solved recomputing whose stages all dropped it need not fit keeping its activations
    # under the solver's bounds, only under the stages' exact figures)
    return best.solved or best.cand, best.result, best.mbs, explain

#: how much slower than the best cut of the units' compute alone (no memory, no messages) a
#: selective cut's slowest stage may compute before the cut counts as shaped by device memory
#: (:func:`_memory_shaped`): messages and whole units move a cut by a little
MEMORY_SHAPED = 0.02

def _memory_shaped(pr: Priced, prefix: np.ndarray, found: tuple, scale: float) -> bool:
    """Whether a selective cut's slowest stage computes more than :data:`MEMORY_SHAPED` above
    the best cut of the units' compute alone at its keep threshold
    (:func:`~fxpipe.partitioner.solvers.chain_bottleneck`): device memory, not the work,
    placed its cuts."""
    cand, problem, result, _ = found
    key = ("compute floor", cand.num_stages, cand.keep_ridge)
    if key not in pr.cache:
        pr.cache[key] = chain_bottleneck(
            [float(x) for x in prefix.sum(axis=0) + selective_prefix(pr, cand.keep_ridge)],
            cand.num_stages)
    floor = pr.cache[key] * scale * float(np.max(problem.slow))
    return float(max(result.compute_s)) > (1 + MEMORY_SHAPED) * floor

def _selective_above(pr: Priced, spec: ParallelSpec, cand: Candidate, scale: float,
                     solved: dict, prefix: np.ndarray, at_ridge: tuple | None,
                     levels: list[float]) -> list[tuple]:
    """Under ``train.activation_recompute: selective`` (no full recomputation to fall back on;
    under ``auto`` a full candidate's stages take these thresholds where they fit,
    :func:`~fxpipe.partitioner.cutting.recompute_stages`, each rank the least recomputation
    it holds): selective recomputation of ``cand`` at the keep thresholds above the ridge
    point (:func:`~fxpipe.partitioner.pricing.selective_levels`: each recomputes the ops with
    the least FLOPs per byte kept that the one below keeps), lowest first, while the cut at the
    one below does not fit (``at_ridge``: the ridge point's ``(candidate, problem, result,
    recompute)``, None) or is shaped by memory (:func:`_memory_shaped`): each cut found, to be
    simulated and ranked with the candidate's others. ``levels``: the thresholds whose lower
    bound may beat the best step so far (ascending; their bounds are too)."""
    out: list[tuple] = []
    last = at_ridge
    for r in levels:
        if last is not None and not _memory_shaped(pr, prefix, last, scale):
            break
        c = dataclasses.replace(cand, keep_ridge=r)
        last = None
        if not fits_recomputing(pr, spec, c, scale, SELECTIVE):
            continue
        try:
            last = (c, *solve_fitting(pr, spec, c, scale, solved))
        except PlanError:
            continue
        out.append(last)
    return out

def _lever_notes(pr: Priced, spec: ParallelSpec, best: _Ranked) -> list[str]:
    """Where ``auto`` chose selective recomputation or activation offload on some stages, what
    the same cut would cost with those stages recomputing fully (simulated alike), and where
    stages recompute partially, what recomputing them whole would: what the lever bought."""
    if not best.cand.recompute:
        return []
    scale = best.mbs / pr.batch
    cuts = list(best.result.cuts)
    rc = recompute_stages(pr, spec, best.cand, cuts, scale)
    out = []
    for lever, setting, name, why in (
            (SELECTIVE, spec.train.activation_recompute, "selective recomputation",
             "full runs every op's forward again, selective only the ops cheaper to recompute "
             "than to keep"),
            (OFFLOAD, spec.train.activation_offload, "activation offload",
             "offload moves the saved activations over the host link instead of running the "
             "forward again")):
        n = rc.flags.count(lever)
        if not n or setting != "auto":
            continue
        problem = cut_problem(pr, spec, best.cand, scale)
        results = dict(rc.results)
        if FULL not in results:
            results[FULL] = evaluate(cut_problem(pr, spec, dataclasses.replace(
                best.cand, recompute=FULL), scale), cuts, method="given")
        as_full = Recompute([FULL if f == lever else f for f in rc.flags], results, rc.memory,
                            rc.held, rc.sent, ridges=rc.ridges)
        prefix = unit_prefix(pr)
        mine = simulate_cut(pr, prefix, problem, best.result, best.cand, spec, scale, rc)
        full = simulate_cut(pr, prefix, problem, best.result, best.cand, spec, scale, as_full)
        k = len(rc.flags)
        where = "every stage" if n == k else f"{n} of {k} stages"
        out.append(f"{name} chosen on {where}: {mine.step_time_s * 1e3:.2f} ms/step; the same "
                   f"cut recomputing fully there would take {full.step_time_s * 1e3:.2f} ms/step "
                   f"({(full.step_time_s / mine.step_time_s - 1) * 100:+.1f}%: {why})")
    out += _above_ridge_note(pr, spec, best, rc)
    n = sum(1 for j in range(len(rc.flags)) if rc.blocks(j))
    if n and (spec.train.activation_recompute == "auto" or spec.train.recompute_layers):
        problem = cut_problem(pr, spec, best.cand, scale)
        prefix = unit_prefix(pr)
        mine = simulate_cut(pr, prefix, problem, best.result, best.cand, spec, scale, rc)
        whole = simulate_cut(pr, prefix, problem, best.result, best.cand, spec, scale,
                             rc._replace(partial=None))
        k = len(rc.flags)
        where = "every stage" if n == k else f"{n} of {k} stages"
        out.append(f"partial recomputation chosen on {where}: {mine.step_time_s * 1e3:.2f} "
                   f"ms/step; the same cut recomputing those stages whole would take "
                   f"{whole.step_time_s * 1e3:.2f} ms/step "
                   f"({(whole.step_time_s / mine.step_time_s - 1) * 100:+.1f}%: only their first "
                   "blocks run their forward again, the later blocks keep their activations)")
    return out

def _above_ridge_note(pr: Priced, spec: ParallelSpec, best: _Ranked, rc: Recompute
                      ) -> list[str]:
    """Where stages recompute selectively above the ridge point, what the higher keep
    threshold bought: the bytes a stage keeps there and at the ridge point, and what the same
    cut would cost with those stages recomputing fully (simulated alike)."""
    above = [j for j in range(len(rc.flags)) if rc.ridge(j)]
    if not above:
        return []
    scale = best.mbs / pr.batch
    cuts = list(best.result.cuts)

    def at(mode: str) -> PartitionResult:
        return evaluate(cut_problem(pr, spec, dataclasses.replace(
            best.cand, recompute=mode, keep_ridge=0.0), scale), cuts, method="given")

    results = dict(rc.results)
    for mode in (FULL, SELECTIVE):
        if mode not in results:
            results[mode] = at(mode)
    as_full = rc._replace(flags=[FULL if rc.ridge(j) else f for j, f in enumerate(rc.flags)],
                          results=results)
    problem = cut_problem(pr, spec, best.cand, scale)
    prefix = unit_prefix(pr)
    mine = simulate_cut(pr, prefix, problem, best.result, best.cand, spec, scale, rc)
    full = simulate_cut(pr, prefix, problem, best.result, best.cand, spec, scale, as_full)
    j = max(above, key=lambda j: (float(results[SELECTIVE].saved_bytes[j])
                                  - float(rc.result(j).saved_bytes[j]), -j))
    k = len(rc.flags)
    where = ("every stage" if len(above) == k else f"{len(above)} of {k} stages"
             if len(above) > 3 else f"stage{'s' if len(above) > 1 else ''} "
             + ", ".join(map(str, above)))
    levels = sorted({rc.ridge(i) for i in above})
    return [f"selective recomputation above the ridge point ({pr.ridge:.3g} FLOP per byte of "
            f"output) on {where}: keeping only the ops that reach "
            + " / ".join(f"{t:.3g}" for t in levels) + " FLOP per byte (recomputing the ones "
            f"with the least FLOPs per byte kept too), stage {j} keeps "
            f"{human_bytes(float(rc.result(j).saved_bytes[j]), True)} per micro-batch where the "
            f"ridge point's rule keeps {human_bytes(float(results[SELECTIVE].saved_bytes[j]), True)}"
            f", which its rank's device does not hold; {mine.step_time_s * 1e3:.2f} ms/step, "
            f"the same cut recomputing those stages fully would take "
            f"{full.step_time_s * 1e3:.2f} ms/step "
            f"({(full.step_time_s / mine.step_time_s - 1) * 100:+.1f}%)"]

#: schedules that trade bubble for activation memory, and the ones they are weighed against
_LOW_MEMORY = ("v-half", "v-min")

_FULL_MEMORY = ("zb-v", "1f1b", "zb-h1", "dualpipev", "interleaved", "gpipe")

#: a layout tries V-Half / V-Min only where none of these fits it without recomputation (the
#: same placement with more micro-batches in flight: less bubble)
_LOW_MEMORY_VERSUS = {"v-half": ("zb-v",), "v-min": ("zb-v", "v-half")}

def _fit_name(cand: Candidate) -> str:
    """The schedule as the search records how it fits a layout (interleaved deeper than 2
    stages per rank by its depth)."""
    v = cand.virtual_stages
    return f"interleaved v={v}" if cand.schedule == "interleaved" and v > 2 else cand.schedule

def _layout_key(cand: Candidate) -> tuple:
    """A candidate's layout without its schedule (and recomputation)."""
    return (cand.pipeline, cand.dp, cand.microbatches, cand.tensor, cand.sharding, cand.layout,
            cand.gather)

def _whole_gather(spec: ParallelSpec, cand: Candidate) -> Candidate:
    """The candidate gathering whole stages that a block-gathering one is weighed against:
    ``full`` when the spec fixes it, else ``optimizer`` (which holds as much during a step as
    ``full`` gathering whole stages, less the master slice, and moves the same bytes)."""
    level = "full" if spec.parallel.data_sharding == "full" else "optimizer"
    return dataclasses.replace(cand, sharding=level, gather="stage", recompute=OFF)

def _gather_notes(pr: Priced, spec: ParallelSpec, best: _Ranked, ranked: list[_Ranked],
                  fit: dict[tuple, str], skipped: int) -> list[str]:
    """What ``parallel.param_gather: block`` bought the chosen layout: the training state its
    fullest stage holds gathering block by block against gathering whole stages, how the
    layout fares gathering whole stages (does not fit, fits only recomputing: the fastest such
    candidate simulated) and, where block gathering was weighed and not chosen, why."""
    cand = best.cand
    if not is_block(cand):
        if skipped and spec.parallel.param_gather == "auto":
            return [f"param_gather: block not tried at {plural(skipped, 'candidate layout')}: "
                    "gathering parameters block by block is tried only where gathering whole "
                    "stages needs recomputation or does not fit (elsewhere it only adds the "
                    "gathers of every micro-batch)"]
        return []
    cuts = list(best.result.cuts)
    mult = factor(spec, cand)
    fixed = static_fixed(pr, spec, cand, cuts, best.result.param_bytes) or []
    held = max(mult * float(p) + x for p, x in zip(best.result.param_bytes, fixed))
    whole_cand = _whole_gather(spec, cand)
    whole = max(float(p) for p in best.result.param_bytes) * state_factor(
        spec.train.optimizer, "full", cand.replicas)
    line = (f"param_gather: block (parameters gathered block by block over {cand.replicas} replicas, "
            f"the next block's all-gather overlapping the current one's compute, gradients "
            f"reduce-scattered per block): the fullest stage holds "
            f"{human_bytes(held, True)} of parameters, gradients and optimizer state instead of "
            f"{human_bytes(whole, True)} gathering whole stages")
    state = fit.get((_layout_key(whole_cand), _fit_name(cand)))
    other = next((r for r in ranked if r.cand.gather != "block"), None)
    if state is not None:
        line += f"; gathering whole stages, {whole_cand.label()} {state}"
    if other is not None:
        line += (f"; the fastest layout gathering whole stages the search simulated, "
                 f"{other.label}, is {other.step_s * 1e3:.2f} ms/step "
                 f"({(other.step_s / best.step_s - 1) * 100:+.1f}%)")
    elif spec.parallel.param_gather == "block":
        j = max(range(len(fixed)), key=lambda i: mult * float(best.result.param_bytes[i])
                + fixed[i])
        line += _forced_block_note(pr, spec, best, held, whole, (
            mult * float(best.result.param_bytes[j]), fixed[j]))
    return [line]

def _forced_block_note(pr: Priced, spec: ParallelSpec, best: _Ranked, held: float,
                       whole: float, parts: tuple[float, float]) -> str:
    """Where the spec forces ``param_gather: block`` (the search weighed nothing else), how
    the chosen layout fares gathering whole stages instead: the same layout and recomputation
    cut and simulated that way, and whether forcing block made the plan worse (more training
    state on the fullest stage, a slower step). ``parts``: the fullest stage's shards and what
    it holds beyond them (the gathered blocks, the parameters stages share, held whole)."""
    cand = best.cand
    alt = dataclasses.replace(cand, sharding=_whole_gather(spec, cand).sharding, gather="stage")
    scale = best.mbs / pr.batch
    try:
        problem, result, rc = solve_fitting(pr, spec, alt, scale)
    except PlanError:
        return (f"; gathering whole stages, {alt.label()} does not fit device memory, so "
                "param_gather: block is what lets this layout fit")
    step = simulate_cut(pr, unit_prefix(pr), problem, result, alt, spec, scale, rc).step_time_s
    slower = best.step_s > step * (1 + 1e-9)
    more = held > whole
    if not slower and not more:
        return (f"; gathering whole stages, {alt.label()} takes {step * 1e3:.2f} ms/step "
                f"({(step / best.step_s - 1) * 100:+.1f}%)")
    worse = []
    if more:
        worse.append(f"its fullest stage holds {human_bytes(held - whole, True)} more (at "
                     f"{cand.replicas} replicas its shards, {human_bytes(parts[0], True)}, and the "
                     f"gathered blocks and parameters shared by stages, held whole, "
                     f"{human_bytes(parts[1], True)}, outweigh the whole stage's state)")
    if slower:
        worse.append(f"its step takes {best.step_s * 1e3:.2f} ms against "
                     f"{step * 1e3:.2f} ms gathering whole stages ({alt.label()}, "
                     f"{(best.step_s / step - 1) * 100:+.1f}%: the gathers of every "
                     "micro-batch)")
    return ("; param_gather: block, as the spec asks, makes this plan worse than gathering "
            "whole stages: " + " and ".join(worse) + "; param_gather: stage (or auto, which "
            "weighs both) avoids that")

def _forced_block_step(pr: Priced, spec: ParallelSpec, found: tuple, scale: float) -> float:
    """The simulated step of a cut the search took without simulating it (the only way of
    the only candidate), where :func:`_forced_block_note` weighs it: a spec forcing
    ``param_gather: block``; else NaN (not needed)."""
    cand, problem, result, rc = found
    if not (is_block(cand) and spec.parallel.param_gather == "block"):
        return float("nan")
    return simulate_cut(pr, unit_prefix(pr), problem, result, cand, spec, scale,
                        rc).step_time_s

def _host_short_note(cand: Candidate, why: list[str]) -> list[str]:
    """Where ``train.activation_offload: auto`` weighed offloading and turned it down because
    the offloaded activations would not fit host memory (``why``: the first such reason), and
    the plan offloads nothing, say so."""
    if not why or cand.recompute == OFFLOAD:
        return []
    return [f"activation offload (train.activation_offload: auto) weighed and turned down for "
            f"host memory: {why[0].removeprefix('activation offload: ')}; the plan "
            + ("recomputes instead" if cand.recompute else "keeps its activations")
            + " (more cluster.host_memory_gb would let it offload)"]

def _memory_schedule_notes(best: Candidate, fit: dict[tuple, str]) -> list[str]:
    """Where the search picked a memory-capped V schedule (V-Half, V-Min) without
    recomputation, why: the schedules that hold more activations at the same layout and how
    they fared against the device memory (only those the search tried)."""
    if best.schedule not in _LOW_MEMORY or best.recompute:
        return []
    key = _layout_key(best)
    others = [f"{s} {fit[(key, s)]}" for s in _FULL_MEMORY if (key, s) in fit
              and fit[(key, s)] != "fits"]
    if not others:
        return []
    return [f"memory: {best.schedule} keeps {'half' if best.schedule == 'v-half' else 'a third'}"
            f" of 1F1B's activations in flight and fits device memory without activation "
            f"recomputation at pp={best.pipeline} dp={best.dp} m={best.microbatches}, where "
            + ", ".join(others) + " (chosen by step time among what fits)"]

def _sharding_notes(pr: Priced, spec: ParallelSpec, cand: Candidate,
                    ranked: list[_Ranked] | None = None, failed: list | None = None
                    ) -> list[str]:
    """What ``parallel.data_sharding`` bought the chosen layout: the training state per rank
    with and without it and, when the search weighed both, the fastest unsharded layout it
    simulated (those it pruned have step-time bounds above the chosen step)."""
    if cand.sharding == "none":
        return []
    if cand.replicas == 1:
        return [f"data sharding {cand.sharding} with one replica per stage (parallel.data: 1): "
                "nothing to split, each rank holds its stages' whole training state (as with "
                "data_sharding: none)"]
    opt = spec.train.optimizer
    total = sum(pr.table.params) / cand.pipeline
    with_, without = total * factor(spec, cand), total * state_factor(opt)
    line = (f"data sharding {cand.sharding}{' (gathered block by block)' if is_block(cand) else ''}"
            f" over {cand.replicas} replicas: parameters, gradients and "
            f"optimizer state {human_bytes(with_, True)} per rank on average"
            f"{' (and the gathered blocks)' if is_block(cand) else ''} instead of "
            f"{human_bytes(without, True)}")
    if with_ >= without * (1 - 1e-9) and not is_block(cand):
        line += _no_saving(spec, cand, with_ > without * (1 + 1e-9))
    if spec.parallel.data_sharding == "auto" and spec.parallel.param_gather == "block":
        return [line + "; data_sharding: auto settles on full because parallel.param_gather: "
                "block gathers the slices only full sharding makes, so no unsharded layout "
                "was weighed (param_gather: auto weighs them)"]
    if ranked is not None and spec.parallel.data_sharding == "auto":
        best = ranked[0] if ranked else None
        plain = next((r for r in ranked if r.cand.sharding == "none"), None)
        if plain is not None and best is not None:
            line += (f"; the fastest unsharded layout the search simulated, {plain.label}, "
                     "is "
                     f"{plain.step_s * 1e3:.2f} ms/step ({(plain.step_s / best.step_s - 1) * 100:+.1f}%"
                     f"{', recomputing' if plain.cand.recompute and not cand.recompute else ''})")
        elif any(c.sharding == "none" for _, c, _, _ in failed or []):
            line += "; no unsharded layout fits device memory"
        else:
            line += "; the unsharded layouts were pruned by their step-time bounds"
    return [line]

def _no_saving(spec: ParallelSpec, cand: Candidate, more: bool) -> str:
    """Why sharding ``cand``'s training state saves nothing per rank (``more``: it costs
    more): gathering whole stages keeps the weights and gradients whole through the step, and
    the slices it adds take back what splitting the optimizer state saves at so few replicas;
    from how many replicas on it saves, and what saves at these."""
    k = OPTIMIZER_STATE_FACTOR.get(spec.train.optimizer, 4.0) - 2.0
    slices = 2.0 if cand.sharding == "full" else 1.0  # full's master slice, the grad slice
    need = int(np.floor((k + slices) / k)) + 1 if k > 0 else None  # n > (k + slices) / k
    where = (f"it saves from {need} replicas on with {spec.train.optimizer}" if need else
             f"{spec.train.optimizer} keeps no optimizer state to split, so it never saves")
    block = ("; param_gather: block gathers the weights block by block instead, holding only "
             "slices through the step" if cand.sharding == "full" and not is_block(cand)
             and spec.train.updates == "sync" else "")
    return (f" ({'more' if more else 'no saving'} at {cand.replicas} replicas: gathering whole stages "
            f"keeps every rank's weights and gradients whole through the step, and "
            f"{cand.sharding} sharding's "
            + ("gradient and float32 master slices take" if cand.sharding == "full" else
               "gradient slice takes")
            + f" back what splitting the optimizer state saves; {where}{block})")

def _host_memory_short(spec: ParallelSpec, lines: list[str]) -> PlanError:
    """No candidate fits because the activations it offloads overflow host memory (device
    memory holds the rest): say so, and the levers that touch host memory."""
    share = spec.cluster.host_bytes_per_device or 0.0
    other = ("train.activation_offload: auto (offloads only where the activations fit host "
             "memory and recomputes or keeps them elsewhere)"
             if spec.train.activation_offload == "on" else
             "train.activation_offload: off (recomputes or keeps them instead)")
    return PlanError(
        "no feasible plan (the offloaded activations do not fit host memory; device memory "
        "is not what is short):\n  " + "\n  ".join(lines)
        + f"\nwhat would fit: more host memory for the offloaded activations "
        f"(cluster.host_memory_gb "
        f"{spec.cluster.host_memory_gb:g} per node, {human_bytes(share, True)} per device), "
        f"or {other}")

def _lever_advice(spec: ParallelSpec, failed: list) -> str:
    """The memory levers the spec leaves unused that would apply where nothing fits:
    activation offload (host memory given, off, on a device with its own memory) and
    gathering parameters block by block (sync replicas, a model with blocks, block
    gathering not tried)."""
    out = ""
    t, par = spec.train, spec.parallel
    if (t.activation_offload == "off" and spec.cluster.host_memory_gb is not None
            and spec.cluster.device != "cpu"):
        out += ("; activation offload (train.activation_offload: auto) moves the saved "
                "activations to host memory (cluster.host_memory_gb "
                f"{spec.cluster.host_memory_gb:g} per node) instead of holding them on the device")
    pr = failed[0][3] if failed else None
    if (t.updates == "sync" and any(c.dp > 1 for _, c, _, _ in failed)
            and not any(is_block(c) for _, c, _, _ in failed)
            and pr is not None and model_has_blocks(pr)):
        if par.data_sharding in ("full", "auto"):
            out += ("; parallel.param_gather: block (with data_sharding: full) gathers a "
                    "stage's parameters one block at a time instead of holding them whole "
                    "through the step")
        else:
            out += (f"; parallel.data_sharding: full with param_gather: block (or auto) shards "
                    f"the parameters over the replicas and gathers a stage's one block at a "
                    f"time (data_sharding: {par.data_sharding} keeps every rank's parameters "
                    "and gradients whole)")
    return out

def _degree_notes(left_out: list[str], ranked: list[_Ranked] | None = None,
                  degrees: list[int] | None = None) -> list[str]:
    """Why the chosen tensor degree: the degrees left out and, with several tried, the best
    layout of another degree and how much slower it is."""
    out = [f"left out {line}" for line in left_out]
    if not ranked or not degrees or len(degrees) < 2:
        return out
    best = ranked[0]
    other = next((r for r in ranked if r.cand.tensor != best.cand.tensor), None)
    if other is not None:
        out.append(f"tensor {best.cand.tensor} chosen: the best layout at another tensor degree "
                   f"({other.label}) is {other.step_s * 1e3:.2f} ms/step, "
                   f"{(other.step_s / best.step_s - 1) * 100:+.1f}% (tensor degrees tried: "
                   f"{', '.join(map(str, degrees))})")
    else:
        out.append(f"tensor {best.cand.tensor} chosen: no layout of another degree was "
                   f"simulated (fits or bounds; tensor degrees tried: "
                   f"{', '.join(map(str, degrees))})")
    return out

def _has_sequence(pr: Priced) -> bool:
    """The model reads ``[batch, sequence, ...]`` inputs through an embedding or a linear
    layer and has attention to split (what context parallelism splits)."""
    try:
        split = analyse(pr.traced.gm, 2, sequence_length(pr.traced.gm))
    except ContextError:
        return False
    return any(ns.gather or ns.ring for ns in split.nodes.values())


def _nothing_fits(spec: ParallelSpec, failed: list) -> PlanError:
    """Why no candidate fits, and what would: the explanation of the candidates that came
    closest, and the levers (more pipeline stages, recomputation, smaller micro-batches)."""
    lines = []
    for lb, cand, scale, pr in failed[:3]:
        c = dataclasses.replace(cand, recompute=recompute_modes(
            spec.train.activation_recompute, True, True, spec.train.activation_offload)[-1])
        try:
            solve_fitting(pr, spec, c, scale)
        except PlanError as e:
            text = str(e)
            if c.recompute and "but the device has" in text and \
                    "kept for recomputation" not in text:  # its capacity less the inputs
                held = recompute_held(cut_problem(pr, spec, dataclasses.replace(
                    c, recompute=OFF), scale).values)
                note = held_note(spec.cluster.memory_gb * 1e9, max(stage_inflight(c)[0]),
                                  held, scale * pr.batch, False)
                text += f" ({note})"
            lines.append(f"{c.label()}: {text}")
    if not any(w in line for line in lines for w in ("memory", "device has", "device's")):
        # a pin, a pipe_split() marker or the number of units: memory is not what failed
        return PlanError("no feasible plan:\n  " + "\n  ".join(lines))
    if lines and all("host memory" in line for line in lines):
        return _host_memory_short(spec, lines)
    pr = failed[0][3] if failed else None
    least = min((factor(spec, c) for _, c, _, _ in failed),
                default=state_factor(spec.train.optimizer))
    need = sum(pr.table.params) * least if pr else 0.0
    cap = spec.cluster.memory_gb * 1e9
    stages = int(np.ceil(need / cap))
    tried = max((c.pipeline for _, c, _, _ in failed), default=0)
    fix = (f"parameters, gradients and optimizer state alone need {human_bytes(need, True)}: at "
           f"least {plural(stages, 'pipeline stage')} of {human_bytes(cap, True)} devices")
    if tried >= stages:  # that many did not do: units cannot be split, and activations count
        fix = (f"parameters, gradients and optimizer state alone need {human_bytes(need, True)} "
               f"({plural(stages, 'device')} of {human_bytes(cap, True)} at the very least), "
               f"but {plural(tried, 'pipeline stage')} did not fit (a stage holds whole "
               f"planning units, and activations too): more than {tried} pipeline stages")
    if spec.train.activation_recompute == "off":
        fix += "; allow activation recomputation (train.activation_recompute: auto)"
    if any("host memory" in line for line in lines):
        fix = ("more host memory for the offloaded activations (cluster.host_memory_gb), or "
               "train.activation_offload: auto or off; " + fix)
    if spec.train.activation_recompute == "selective":
        for _, cand, scale, pr_ in failed[:3]:
            full = dataclasses.replace(cand, recompute=FULL)
            try:
                solve_fitting(pr_, spec, full, scale)
            except PlanError:
                continue
            fix = (f"full activation recomputation fits {cand.label()} (selective keeps the "
                   "matmul-like ops' outputs; train.activation_recompute: full keeps only each "
                   "stage's inputs, auto recomputes selectively where that fits and fully "
                   "elsewhere); " + fix)
            break
    fix += _lever_advice(spec, failed)
    if spec.parallel.context == 1 and spec.cluster.trainers > 1 and pr is not None and \
            _has_sequence(pr):
        fix += ("; context parallelism (parallel.context: 2 or more, or auto) splits every "
                "activation along the sequence over that many ranks")
    if spec.parallel.tensor == 1 and spec.cluster.devices_per_node > 1:
        fix += ("; tensor parallelism (parallel.tensor: auto, or a divisor of "
                f"cluster.devices_per_node={spec.cluster.devices_per_node}) splits every "
                "layer's parameters over the devices of a node")
    return PlanError("no feasible plan (nothing fits device memory):\n  " + "\n  ".join(lines)
                     + f"\nwhat would fit: {fix}; smaller micro-batches (more of them: "
                     "parallel.microbatches) shrink the activations held per micro-batch; or "
                     "devices with more memory (cluster.memory_gb)")
