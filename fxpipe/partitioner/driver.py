"""The partitioner's driver, ``fxpipe.plan()``: from a model and a spec to a :class:`Plan`.

Takes an ``nn.Module`` (real or on the meta device), a spec and one micro-batch of example
inputs; gives a :class:`~fxpipe.plans.plan.Plan`. It only chains the passes, each its own
module with a typed result:

* trace and price (:mod:`~fxpipe.partitioner.units`, :mod:`~fxpipe.partitioner.pricing`):
  :class:`~fxpipe.partitioner.pricing.Priced` units at a micro-batch size and tensor degree;
* layout search (:mod:`~fxpipe.partitioner.layout_search`, over the candidates of
  :mod:`~fxpipe.partitioner.search`, pruned by :mod:`~fxpipe.partitioner.bounds`): the
  fastest :class:`~fxpipe.partitioner.search.Candidate` that fits, each priced by the one rule
  (:mod:`~fxpipe.partitioner.cut_price` -> :mod:`fxpipe.schedule.step_price`);
* cut (:mod:`~fxpipe.partitioner.cutting`; :mod:`~fxpipe.partitioner.measured` with timed
  stages): the chosen layout's :class:`~fxpipe.partitioner.problem.PartitionResult`;
* assemble (:mod:`~fxpipe.partitioner.assemble`): the complete Plan, predicted once.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import networkx as nx
import torch
import torch.nn as nn

from fxpipe.data.batches import check_vocabulary, example_microbatch
from fxpipe.errors import PlanError, SpecError, TraceError
from fxpipe.partitioner.assemble import assemble, assemble_folded, finish_plan, model_notes
from fxpipe.partitioner.cutting import cut_problem, recompute_modes, solve_fitting
from fxpipe.partitioner.degree_search import plan_degrees, searches_degrees
from fxpipe.partitioner.layout_search import search_layouts
from fxpipe.partitioner.measured import refine_by_stages
from fxpipe.partitioner.partial import check_has_blocks
from fxpipe.partitioner.pricing import Priced
from fxpipe.partitioner.problem import PartitionResult, evaluate
from fxpipe.partitioner.search import Candidate, candidates, tensor_degrees
from fxpipe.partitioner.units import PricedUnits, is_fake, resize
from fxpipe.plans.plan import Plan
from fxpipe.schedule.generators import collector_paused
from fxpipe.specs.loader import build_model, load_spec, spec_location
from fxpipe.specs.schema import ParallelSpec, compression_rank_problems

#: the planner's phases (tracing, pricing, profiling, the auto search), at INFO: silent unless a
#: caller listens (``fxpipe.reports.progress.planning_progress`` shows them on a terminal)
_progress = logging.getLogger("fxpipe.progress")

def as_spec(spec: Any) -> ParallelSpec:
    """A :class:`ParallelSpec` as it is, or loaded from a YAML path, bundled name or dict."""
    return spec if isinstance(spec, ParallelSpec) else load_spec(spec)

def _check_compression_rank(model: nn.Module, spec: ParallelSpec) -> None:
    """``train.compression.rank`` against the model's matrix parameters (PowerSGD).

    Raises:
        SpecError: ``FILE:LINE: train.compression.rank: ...`` naming the smallest matrix."""
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad}
    problems = compression_rank_problems(spec, shapes)
    if problems:
        lines = []
        for path, text in problems:
            dotted = ".".join(path)
            where = spec_location(spec, dotted)
            lines.append(f"{where}: {dotted}: {text}" if where else f"{dotted}: {text}")
        raise SpecError("\n".join(lines))


def plan_with_graph(model: nn.Module, spec: Any, example_inputs: Any = None,
                    example_kwargs: dict | None = None, *, cuts: list[int] | None = None,
                    units_only: bool = False) -> tuple[Plan, "nx.DiGraph"]:
    """:func:`plan`, also returning the priced networkx graph of planning units (for
    ``plan.dump(dir, graph)``'s DOT drawing; None for a plan made as blocks).

    ``cuts`` (a fixed layout only): plan exactly these stage starts (unit positions, see
    :func:`planning_units`) instead of the optimal ones, e.g. to measure other cuts.
    ``units_only``: return ``(unit table, None)`` without planning (see
    :func:`planning_units`). The global random number generators are as before afterwards
    (profiling draws random targets and runs dropout)."""
    spec = as_spec(spec)
    if searches_degrees(spec) and cuts is None and not units_only:
        return plan_degrees(spec, lambda one: plan_with_graph(
            model, one, example_inputs, example_kwargs))
    cuda = spec.cluster.device == "cuda" and torch.cuda.is_available()
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if cuda else []), \
            collector_paused():  # millions of short-lived objects, few of them in cycles
        return _plan_with_graph(model, spec, example_inputs, example_kwargs, cuts, units_only)


def _example_inputs(spec: ParallelSpec, example_inputs: Any, example_kwargs: dict | None
                    ) -> tuple[tuple, dict, int]:
    """One micro-batch of example inputs (batch 0 of the spec's dataset when none are given)
    and the micro-batch size to trace at: the spec's when data and micro-batches are fixed
    (traced once, at it), else the example's."""
    if example_inputs is None and example_kwargs is None:
        batch = example_microbatch(spec, 1)
        args, kwargs = batch.args, batch.kwargs
    else:
        if isinstance(example_inputs, torch.Tensor):
            example_inputs = (example_inputs,)
        args, kwargs = tuple(example_inputs or ()), dict(example_kwargs or {})
    tensors = [t for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor) and t.dim()]
    size = int(tensors[0].shape[0]) if tensors else 1
    par = spec.parallel
    if "auto" not in (par.data, par.microbatches) and \
            spec.data.batch_size % (par.data * par.microbatches) == 0:
        size = spec.data.batch_size // (par.data * par.microbatches)
    return args, kwargs, size


def _given_cuts(units: PricedUnits, spec: ParallelSpec, size: int, cuts: list[int]
                ) -> tuple[Candidate, PartitionResult, int, list[str]]:
    """The layout of a fixed spec cut at the stage starts ``cuts``."""
    degrees = tensor_degrees(spec)
    pr = units.at(size)
    cands = (candidates(spec, max_stages=len(pr.table.names), tensor=degrees[0])
             if len(degrees) == 1 else [])
    if len(cands) != 1:
        raise PlanError("plan_with_graph(cuts=...) needs a spec with a fixed layout "
                        f"(pipeline, data, tensor, microbatches, schedule); it has "
                        f"{len(cands)}")
    cand = cands[0]
    mbs = spec.data.batch_size // (cand.dp * cand.microbatches)
    pr = units.at(mbs, cand.tensor)
    result = evaluate(cut_problem(pr, spec, cand, 1.0), cuts, method="given")
    return cand, result, mbs, [f"cuts given: stages start at units {list(cuts)}"]


def _measured_cut(units: PricedUnits, pr: Priced, spec: ParallelSpec, cand: Candidate,
                  result: PartitionResult, mbs: int, explain: list[str]
                  ) -> tuple[Priced, PartitionResult]:
    """``cluster.measure_stages``: the cut checked against its stages timed whole."""
    cl = spec.cluster
    if cl.costs != "measured" or not cl.measure_stages or cand.num_stages <= 1:
        return pr, result
    if cand.tensor > 1:
        explain.append("cluster.measure_stages: not done under tensor parallelism (the "
                       "stages would run sharded); the cut rests on the per-node profile")
        return pr, result
    m, args_, kwargs_, on = units.tracing(False)
    real = None if on == "meta" or is_fake(m) else m
    pr, result, note = refine_by_stages(pr, spec, cand, result, real,
                                        tuple(resize(x, mbs) for x in args_),
                                        {k: resize(v, mbs) for k, v in kwargs_.items()})
    explain.append(note)
    return pr, result


def _solve_chosen(pr: Priced, spec: ParallelSpec, cand: Candidate, explain: list[str]
                  ) -> tuple[Candidate, PartitionResult]:
    """The chosen layout cut exactly (:func:`solve_fitting`) as the search solved it. Where
    that refuses (the layout priced again at its own micro-batch size may need a little more
    memory than the search's scaled figures), the candidate with each more recomputing way
    ``train.activation_recompute`` / ``activation_offload`` allow (:func:`recompute_modes`),
    in their order, said in ``explain``; none fitting, the first refusal.

    Raises:
        PlanError: no way fits."""
    try:
        return cand, solve_fitting(pr, spec, cand, 1.0)[1]
    except PlanError as e:
        refused = e
    train = spec.train
    offload = "off" if train.activation_offload == "auto" and spec.cluster.device == "cpu" \
        else train.activation_offload
    ways = recompute_modes(train.activation_recompute, True, True, offload)
    later = ways[ways.index(cand.recompute) + 1:] if cand.recompute in ways else ways
    for way in later:
        again = dataclasses.replace(cand, recompute=way, keep_ridge=0.0)
        try:
            result = solve_fitting(pr, spec, again, 1.0)[1]
        except PlanError:
            continue
        explain.append(f"cut exactly at micro-batch size {pr.batch}: {cand.label()} does not "
                       f"fit ({refused}); planned as {again.label()}")
        return again, result
    raise refused


def _plan_with_graph(model: nn.Module, spec: ParallelSpec, example_inputs: Any,
                     example_kwargs: dict | None, cuts: list[int] | None, units_only: bool
                     ) -> tuple[Plan, "nx.DiGraph"]:
    """The passes: trace and price (:class:`PricedUnits`) -> layout search (or the given
    cuts) -> the chosen layout cut exactly at its micro-batch size (and checked against timed
    stages) -> assemble -> finish (predicted once)."""
    _check_compression_rank(model, spec)
    args, kwargs, size = _example_inputs(spec, example_inputs, example_kwargs)
    units = PricedUnits(model, args, kwargs, spec)
    pr = units.at(size)
    check_has_blocks(pr, spec.train.recompute_layers,
                     spec_location(spec, "train.recompute_layers"))
    if units_only:
        return pr, None
    if cuts is not None:
        cand, result, mbs, explain = _given_cuts(units, spec, size, cuts)
        pr = units.at(mbs, cand.tensor)
    else:
        cand, result, mbs, explain = search_layouts(lambda t: units.at(size, t), spec)
        # the chosen layout cut exactly (the search ranks near-optimal cuts), at the real
        # micro-batch size (the plan's shapes exact)
        pr = units.at(mbs, cand.tensor)
        cand, result = _solve_chosen(pr, spec, cand, explain)
        pr, result = _measured_cut(units, pr, spec, cand, result, mbs, explain)
    explain += units.notes
    folded = pr.table.folding is not None
    traced_model, _, _, traced_on = units.tracing(folded)
    explain += model_notes(pr, traced_model, mbs)
    plan = (assemble_folded if folded else assemble)(pr, result, cand, spec, mbs, explain)
    finish_plan(plan, pr, spec, model, kwargs, traced_on)
    return plan, (None if plan.folded else pr.pg.graph)


def planning_units(model: nn.Module, spec: Any, example_inputs: Any = None,
                   example_kwargs: dict | None = None) -> list[tuple[str, str]]:
    """The units the planner cuts between, in order: ``(name, module path)`` per unit (FX
    node names, or block names such as ``h.7`` for a model planned as blocks). A stage start
    ``i`` for :func:`plan_with_graph` ``cuts`` means "a cut right before unit ``i``"."""
    pr, _ = plan_with_graph(model, spec, example_inputs, example_kwargs, units_only=True)
    if pr.table.folding is not None:
        return [(n, n if n.startswith(pr.table.folding.run.prefix) else
                 pr.pg.graph.nodes[n]["module"]) for n in pr.table.names]
    return [(n, pr.pg.graph.nodes[n]["module"]) for n in pr.table.names]

def plan(model: nn.Module, spec: Any, example_inputs: Any = None,
         example_kwargs: dict | None = None) -> Plan:
    """Trace, price and partition ``model`` according to ``spec``.

    Args:
        model: an ordinary ``nn.Module``; it may live on the meta device (nothing is computed:
            a fake copy on ``cluster.device`` is traced, so the graph is the one the workers
            trace there).
        spec: a :class:`~fxpipe.specs.schema.ParallelSpec`, a YAML path, a bundled spec name or
            a dict.
        example_inputs: ONE micro-batch of positional inputs (tensor or tuple of tensors, dim 0
            = batch).
        example_kwargs: ONE micro-batch of keyword inputs by forward() argument name, e.g.
            ``{"input_ids": ids, "attention_mask": mask, "labels": ids}`` for a transformers
            model that computes its own loss. Default for both: batch 0 of the spec's dataset.
            Costs scale linearly with the micro-batch size the plan chooses; the final plan is
            re-traced at that size.

    Returns:
        The :class:`~fxpipe.plans.plan.Plan` (with ``predicted`` filled by the simulator).

    Raises:
        SpecError: bad spec. TraceError: the model cannot be traced, or it returns several
        values and ``model.output`` does not name the one the loss reads. PlanError: no
        partition fits (e.g. device memory too small).
    """
    return plan_with_graph(model, spec, example_inputs, example_kwargs)[0]

def plan_from_spec(spec: Any) -> tuple[Plan, "nx.DiGraph"]:
    """Build the spec's model on the meta device (no weight memory) and plan it."""
    spec = as_spec(spec)
    if spec.cluster.costs == "measured":  # real weights, to measure what is not cached yet
        model = build_model(spec)
    else:
        with torch.device("meta"):
            model = build_model(spec, load_weights=False)
    check_vocabulary(model, spec)
    batch = example_microbatch(spec)
    try:
        return plan_with_graph(model, spec, batch.args, batch.kwargs)
    except TraceError as e:
        shapes = ", ".join(f"{name}: {str(t.dtype).replace('torch.', '')}{list(t.shape)}"
                           for name, t in [*enumerate(batch.args), *batch.kwargs.items()])
        raise TraceError(
            f"{e}\n(the example inputs came from data.{spec.data.source} "
            f"{spec.data.dataset_ref if spec.data.source == 'dataset' else getattr(spec.data, spec.data.source)}"
            f": {shapes}; if "
            "they do not fit the model, fix the dataset or data.seq_len rather than the tracer)"
        ) from None
