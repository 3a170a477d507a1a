"""The partitioner's driver, ``fxpipe.plan()``: from a model and a spec to a :class:`Plan`.

Takes an ``nn.Module`` (real or on the meta device), a spec and one micro-batch of example
inputs; gives a :class:`~fxpipe.plans.plan.Plan`. The steps, each in its own module: trace
(torch.export) -> cost (fake-tensor FLOPs and bytes) -> graph (networkx units) -> the cut problem
-> the exact solvers (min-bottleneck cut, memory-checked; with ``auto``, every layout of
:mod:`fxpipe.partitioner.search` priced by the simulator) -> boundaries (stage inputs and
outputs) -> Plan.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Any

import networkx as nx
import torch
import torch.nn as nn

from fxpipe.data.batches import check_vocabulary, example_microbatch
from fxpipe.errors import PlanError, SpecError, TraceError
from fxpipe.partitioner.assemble import assemble, assemble_folded, placement_note
from fxpipe.partitioner.blocks import check_run, find_block_run, fold, reduced
from fxpipe.partitioner.cost import price
from fxpipe.partitioner.cutting import cut_problem, solve_fitting
from fxpipe.partitioner.graph import build_graph
from fxpipe.partitioner.layout_search import search_layouts
from fxpipe.partitioner.loss_cost import loss_node
from fxpipe.partitioner.measured import refine_by_stages
from fxpipe.partitioner.pricing import (Priced, at_degree, node_seconds, rebuilt_values,
                                        send_cost_of, tensor_inputs)
from fxpipe.partitioner.problem import evaluate
from fxpipe.partitioner.profile import send_cost_path
from fxpipe.partitioner.search import candidates, tensor_degrees
from fxpipe.partitioner.servers import assign_servers
from fxpipe.partitioner.trace import trace
from fxpipe.partitioner.units import is_fake, resize, tracing_model, warn_again
from fxpipe.plans.plan import Plan
from fxpipe.schedule.simulate import predict
from fxpipe.specs.loader import build_model, load_spec, spec_location
from fxpipe.specs.schema import ParallelSpec, compression_rank_problems
from fxpipe.units import human_bytes, plural

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
    cuda = spec.cluster.device == "cuda" and torch.cuda.is_available()
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if cuda else []):
        return _plan_with_graph(model, spec, example_inputs, example_kwargs, cuts, units_only)

def _plan_with_graph(model: nn.Module, spec: ParallelSpec, example_inputs: Any,
                     example_kwargs: dict | None, cuts: list[int] | None, units_only: bool
                     ) -> tuple[Plan, "nx.DiGraph"]:
    _check_compression_rank(model, spec)
    if example_inputs is None and example_kwargs is None:
        batch = example_microbatch(spec, 1)
        args, kwargs = batch.args, batch.kwargs
    else:
        if isinstance(example_inputs, torch.Tensor):
            example_inputs = (example_inputs,)
        args, kwargs = tuple(example_inputs or ()), dict(example_kwargs or {})
    tensors = [t for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor) and t.dim()]
    b0 = int(tensors[0].shape[0]) if tensors else 1
    par = spec.parallel
    if "auto" not in (par.data, par.microbatches) and \
            spec.data.batch_size % (par.data * par.microbatches) == 0:
        # the micro-batch size is fixed: trace once, at it, rather than at the example's size
        # for the search and again at the micro-batch's for the plan
        b0 = spec.data.batch_size // (par.data * par.microbatches)
    run = find_block_run(model)
    given = model
    key = spec.loss_output
    tracers: dict[bool, tuple] = {}  # short (blocks folded) or full -> (model, args, kwargs, on)

    def tracing(short: bool) -> tuple:
        """The model to trace (a fake copy on the device, of the shortened model when folding:
        copying 96 blocks' tensors costs seconds, two of them nothing)."""
        if short not in tracers:
            with reduced(given, run) if short else contextlib.nullcontext():
                m, a, kw, on = tracing_model(given, tuple(args), dict(kwargs),
                                             spec.cluster.device)
            tracers[short] = (m, tuple(a), kw, on)
        return tracers[short]

    def priced_at(size: int, short: bool) -> Priced:
        m, args_, kwargs_, on = tracing(short)
        real = None if on == "meta" or is_fake(m) else m
        a = tuple(resize(x, size) for x in args_)
        kw = {k: resize(v, size) for k, v in kwargs_.items()}
        same = m is given and short  # shortening a model traced as it is: swap its blocks
        with reduced(m, run) if same else contextlib.nullcontext():
            _progress.info("tracing %s%s at micro-batch %d", type(m).__name__,
                           " (two of its repeated blocks)" if short else "", size)
            traced = trace(m, a, spec.model.tracer, example_kwargs=kw, output=key)
            _progress.info("pricing %d nodes", len(traced.gm.graph.nodes))
            costs = price(traced)
            times, loss = node_seconds(traced, costs, spec, real, tensor_inputs(a, kw))
        with warnings.catch_warnings(record=True) as held:
            warnings.simplefilter("always")
            pg = build_graph(traced, costs)
        pr = Priced(traced, costs, times, pg, rebuilt_values(pg, spec), send_cost_of(spec), size,
                    loss=loss, loss_at=loss_node(traced, costs) if loss.total_s > 0 else None)
        if short:
            pr.table = fold(pg, run, pr.table.times, pr.cheap)
            held_back[:] = held  # said only where the fold stands (see priced)
        else:
            warn_again(held)
        return pr

    # the two-block trace's warnings are about the model only where the fold stands (a
    # pipe_split() after block 1 is "after the last computation" of two blocks); else the full
    # trace is planned and warns for itself
    held_back: list = []
    unfolded: list[str] = []  # why a run of identical blocks was not planned as blocks
    checked: list[bool] = []  # the full model ran once and repeats as the fold assumes

    def priced(size: int) -> Priced:
        nonlocal run
        if run is not None:
            pr = priced_at(size, True)
            why = None if pr.table is not None else (
                "the graph between them does not repeat block by block (a block's value read "
                "by a later block, the parent's nodes between blocks that differ or hold "
                "parameters, or pipe_split()/annotate() in the run)")
            if why is None and not checked:
                _progress.info("checking that the model's %d blocks repeat", run.count)
                why = check_run(given, run, tuple(resize(x, 1) for x in args),
                                {k: resize(v, 1) for k, v in kwargs.items()})
                checked.append(why is None)
            if why is None:
                warn_again(held_back)
                return pr
            unfolded.append(
                f"not planned as blocks: {run.count} identical {run.prefix or 'top-level '}* "
                f"blocks were found, but {why}; planned node by node, which takes longer for "
                "deep models")
            run = None  # the full model does not fold: plan node by node
        return priced_at(size, False)

    at_size: dict[int, Priced] = {}
    at_both: dict[tuple[int, int], Priced] = {}

    def priced_t(size: int, t: int) -> Priced:
        """The units traced at ``size`` per micro-batch, at tensor degree ``t``."""
        if size not in at_size:
            at_size[size] = priced(size)
        if (size, t) not in at_both:
            at_both[(size, t)] = at_degree(at_size[size], spec, t)
        return at_both[(size, t)]

    pr = priced_t(b0, 1)
    if units_only:
        return pr, None
    if cuts is not None:
        degrees = tensor_degrees(spec)
        cands = (candidates(spec, max_stages=len(pr.table.names), tensor=degrees[0])
                 if len(degrees) == 1 else [])
        if len(cands) != 1:
            raise PlanError("plan_with_graph(cuts=...) needs a spec with a fixed layout "
                            f"(pipeline, data, tensor, microbatches, schedule); it has "
                            f"{len(cands)}")
        cand = cands[0]
        mbs = spec.data.batch_size // (cand.dp * cand.microbatches)
        pr = priced_t(mbs, cand.tensor)
        result = evaluate(cut_problem(pr, spec, cand, 1.0), cuts, method="given")
        explain = [f"cuts given: stages start at units {list(cuts)}"]
    else:
        cand, result, mbs, explain = search_layouts(lambda t: priced_t(b0, t), spec)
    if cuts is None:  # the chosen layout cut exactly (the search ranks near-optimal cuts), at
        pr = priced_t(mbs, cand.tensor)  # the real micro-batch size (the plan's shapes exact)
        result = solve_fitting(pr, spec, cand, 1.0)[1]
    if (cuts is None and spec.cluster.costs == "measured" and spec.cluster.measure_stages
            and cand.num_stages > 1 and cand.tensor > 1):
        explain.append("cluster.measure_stages: not done under tensor parallelism (the "
                       "stages would run sharded); the cut rests on the per-node profile")
    elif (cuts is None and spec.cluster.costs == "measured" and spec.cluster.measure_stages
            and cand.num_stages > 1):
        m, args_, kwargs_, on = tracing(False)
        real = None if on == "meta" or is_fake(m) else m
        pr, result, note = refine_by_stages(
            pr, spec, cand, result, real, tuple(resize(x, mbs) for x in args_),
            {k: resize(v, mbs) for k, v in kwargs_.items()})
        explain.append(note)
    explain += unfolded
    traced, pg = pr.traced, pr.pg
    model, traced_on = tracing(pr.table.folding is not None)[0], tracing(
        pr.table.folding is not None)[3]
    if traced.pins or traced.split_after:
        explain.append(f"honoured {plural(len(traced.split_after), 'pipe_split() marker')} and "
                       f"{plural(len(set(traced.pins.values())), 'annotate() pin')}")
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        explain.append(f"BatchNorm: statistics are computed over each micro-batch of "
                       f"{plural(mbs, 'sample')}, as in GPipe, not over the whole batch; "
                       "everything else equals single-process training")
    if pr.table.folding is not None:
        plan = assemble_folded(pr, result, cand, spec, mbs, explain)
    else:
        plan = assemble(pr, result, cand, spec, mbs, explain)
    if spec.train.updates == "async":
        assign_servers(plan, {n: p.numel() * p.element_size()
                              for n, p in given.named_parameters(remove_duplicate=False)}, spec)
        if not plan.folded:  # priced again with the servers' real shares
            plan.predicted = predict(plan)
    # every trained parameter's shape: PowerSGD prices each matrix's low-rank factors,
    # sharding the slices; the state each rank holds (fxpipe.plans.state_bytes) reads them
    plan.param_shapes = {n: list(p.shape) for n, p in given.named_parameters(
        remove_duplicate=False) if p.requires_grad}  # tied aliases too (stages name them)
    plan.param_itemsize = next((p.element_size() for p in given.parameters()
                                if p.requires_grad), 4)
    if (spec.train.grad_compression == "powersgd" or plan.data_sharding != "none") \
            and not plan.folded:
        plan.predicted = predict(plan)
    if spec.cluster.nodes > 1:
        plan.explain.append(placement_note(plan, spec))
    if (spec.cluster.costs == "measured" and plan.num_stages > 1
            and pr.send.method is None and torch.device(spec.cluster.device).type == "cpu"):
        cached = send_cost_path(spec.cluster.device)
        why = (f"its cache {cached} is damaged or from an older fxpipe" if cached.exists()
               else "not measured on this machine")
        plan.explain.append(f"send cost: {why}, so the default (a fixed overhead plus the "
                            "bytes at cluster.memory_GBps), which prices gloo sends low; "
                            "`fxpipe profile SPEC` measures it")
    rc_stages = [st.index for st in plan.stages if st.recompute]
    if rc_stages:
        every = len(rc_stages) == plan.num_stages
        why = ("train.activation_recompute: on" if spec.train.activation_recompute == "on" else
               f"the activations of the micro-batches in flight would not fit cluster.memory_gb"
               f"{'' if every else '; the other stages keep theirs and skip the second forward'}")
        where = ("every stage" if every else
                 f"stage{'s' if len(rc_stages) > 1 else ''} {', '.join(map(str, rc_stages))}")
        plan.explain.append(f"activation recomputation on {where}: each keeps only its inputs per "
                            "micro-batch in flight and runs its forward again in the backward "
                            f"({why})")
    if plan.recomputed:
        plan.explain.append("recomputed in each stage that reads them (cheaper than sending): "
                            + ", ".join(f"{v} ({human_bytes(bounds_bytes)}) in stages "
                                        f"{', '.join(map(str, s))}"
                                        for v, s in plan.recomputed.items()
                                        for bounds_bytes in [pg.value_info(v)[2]]))
    plan.input_kwargs = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    plan.traced_on = traced_on
    missing = [k for k in plan.input_kwargs if k not in plan.model_inputs]
    if missing:
        raise TraceError(f"keyword inputs {missing} do not appear as inputs of the traced graph "
                         f"(its inputs: {plan.model_inputs}); pass them by their forward() names")
    return plan, (None if plan.folded else pg.graph)

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
