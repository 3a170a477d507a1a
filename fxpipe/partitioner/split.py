"""Stage modules: one GraphModule per pipeline stage, built from the stage boundaries.

Takes a traced graph and its :class:`~fxpipe.partitioner.boundaries.Boundaries`; gives
:func:`build_stage_module` -> a stage ``GraphModule`` whose ``forward(*inputs)`` returns the tuple
of its ``outputs``. Parameters live in the stage that uses them (their ``get_attr`` nodes are
copied into the stage instead of being passed in as inputs, unlike
``torch.fx.passes.split_module``), and they are the *same* ``Parameter`` objects as in the
original model, under the original FQNs. :func:`split_graph` does boundaries and modules in one
call; :func:`materialize_stages` rebuilds a worker's stage modules from a saved Plan.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn

from fxpipe.errors import PlanError, SplitError
from fxpipe.partitioner.boundaries import GUARDS_FN, Boundaries, resolve_attr, stage_boundaries
from fxpipe.partitioner.blocks import resolve_folded
from fxpipe.partitioner.recompute import apply_recompute, is_clone
from fxpipe.partitioner.trace import trace
from fxpipe.plans.plan import Plan
from fxpipe.specs.loader import load_spec
from fxpipe.units import plural

__all__ = ["build_stage_module", "build_stages", "materialize_stages", "split_graph",
           "trace_for_plan"]


# --------------------------------------------------------------------------------------- helpers


# ------------------------------------------------------------------------------------ boundaries


# ---------------------------------------------------------------------------------- stage module
def _install(root: nn.Module, path: str, obj, created: set[int], persistent: bool = True) -> None:
    """Place ``obj`` at dotted ``path`` under ``root``, creating empty container modules.

    Never writes into an original (user) module: if the walk reaches one, that module was
    installed whole by a ``call_module`` and already holds ``obj`` at this path.
    """
    *prefix, leaf = path.split(".")
    mod = root
    for item in prefix:
        child = mod._modules.get(item)
        if child is None:
            child = nn.Module()
            created.add(id(child))
            mod.add_module(item, child)
        elif id(child) not in created:
            return
        mod = child
    if isinstance(obj, nn.Parameter):
        mod.register_parameter(leaf, obj)
    elif isinstance(obj, torch.Tensor):
        mod.register_buffer(leaf, obj, persistent=persistent)
    elif isinstance(obj, nn.Module):
        mod.add_module(leaf, obj)
    else:
        setattr(mod, leaf, obj)


def _persistent(gm: fx.GraphModule, target: str) -> bool:
    owner_path, _, leaf = target.rpartition(".")
    owner = gm.get_submodule(owner_path) if owner_path else gm
    return leaf not in getattr(owner, "_non_persistent_buffers_set", set())


def build_stage_module(gm: fx.GraphModule, boundaries: Boundaries, stage: int) -> fx.GraphModule:
    """Build the GraphModule of one stage.

    ``forward(*inputs)`` takes the values named by ``boundaries.stages[stage].inputs`` (positional,
    in that order; shapes/dtypes as in ``boundaries.values``) and returns a tuple (always a tuple,
    even of one) of the values named by ``outputs``. The stage's ``get_attr`` parameter, buffer and
    constant nodes are copied into the stage graph; parameters and buffers are the same objects as
    in ``gm`` (and the model it was traced from), registered under their canonical FQNs, so
    ``dict(stage_mod.named_parameters())`` is keyed by original FQNs such as ``'h.0.fc.weight'``.
    ``call_module`` submodules are shared whole under their original paths. Placeholders and
    copied nodes keep the original node names and ``meta``.

    Args:
        gm: the graph ``boundaries`` was computed from.
        boundaries: result of :func:`stage_boundaries`.
        stage: stage index ``0 .. boundaries.num_stages-1``.

    Raises:
        SplitError: ``stage`` out of range, or ``boundaries`` does not match ``gm``.
    """
    if not 0 <= stage < boundaries.num_stages:
        raise SplitError(f"stage {stage} is outside 0..{boundaries.num_stages - 1}")
    sb = boundaries.stages[stage]
    by_name = {n.name: n for n in gm.graph.nodes}
    missing = [x for x in sb.inputs + sb.nodes if x not in by_name]
    if missing:
        raise SplitError(
            f"stage {stage} names nodes not in this graph (e.g. {missing[:3]}); pass the same "
            "GraphModule that stage_boundaries() was computed from."
        )

    canonical: dict[int, str] = {}
    for c in sb.params + sb.buffers + sb.constants:
        canonical.setdefault(id(resolve_attr(gm, c)), c)

    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for name in sb.inputs:
        orig = by_name[name]
        ph = graph.placeholder(name)
        ph.meta = dict(orig.meta)
        env[orig] = ph
    attrs: dict[str, object] = {}
    modules: list[str] = []
    for name in sb.nodes:
        node = by_name[name]
        for m in node.all_input_nodes:
            if m in env:
                continue
            if m.op != "get_attr":
                raise SplitError(
                    f"stage {stage}: node {name!r} reads {m.name!r}, which is neither computed in "
                    "the stage nor among its inputs; recompute the boundaries for this graph."
                )
            obj = resolve_attr(gm, m.target)
            target = canonical.get(id(obj), m.target)
            attrs.setdefault(target, obj)
            ga = graph.get_attr(target)
            ga.meta = dict(m.meta)
            env[m] = ga
        if node.op == "call_module":
            modules.append(node.target)
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[by_name[o]] for o in sb.outputs))

    stage_mod = fx.GraphModule(nn.Module(), fx.Graph(), class_name=f"Stage{stage}")
    stage_mod.training = gm.training
    created: set[int] = set()
    for target in sorted(set(modules), key=lambda t: t.count(".")):
        _install(stage_mod, target, gm.get_submodule(target), created)
    for target, obj in sorted(attrs.items(), key=lambda kv: kv[0].count(".")):
        persistent = target not in sb.constants and _persistent(gm, target)
        _install(stage_mod, target, obj, created, persistent=persistent)
    stage_mod.graph = graph  # setter recompiles forward
    return stage_mod


def split_graph(gm: fx.GraphModule, node_stage: dict[str, int],
                num_stages: int) -> tuple[Boundaries, list[fx.GraphModule]]:
    """:func:`stage_boundaries` then :func:`build_stage_module` for every stage.

    Returns:
        ``(boundaries, [stage_module_0, ..., stage_module_{k-1}])``.

    Raises:
        SplitError: see :func:`stage_boundaries`.
    """
    b = stage_boundaries(gm, node_stage, num_stages)
    return b, [build_stage_module(gm, b, s) for s in range(num_stages)]


def example_zeros(plan: Plan, device: torch.device | str) -> tuple[tuple, dict]:
    """Zero tensors of one micro-batch of the plan's model inputs: ``(positional, keyword)``."""
    zeros = {n: torch.zeros(plan.values[n].shape, dtype=getattr(torch, plan.values[n].dtype),
                            device=device) for n in plan.model_inputs}
    args = tuple(zeros[n] for n in plan.model_inputs if n not in plan.input_kwargs)
    return args, {n: zeros[n] for n in plan.input_kwargs}


def _graph_difference(plan: Plan, traced, device: torch.device | str) -> str:
    """Why a worker's graph differs from the plan's, and what fixes it."""
    node_stage = plan.stage_of_node()
    computed = [n for n in traced.compute_nodes() if n.name != GUARDS_FN]
    names = {n.name for n in computed}
    only_plan = sorted(n for n in node_stage if n not in names and not is_clone(n))
    only_here = [n for n in computed if n.name not in node_stage]
    dev = torch.device(device).type
    cause = (f"the plan was traced on {plan.traced_on} and this worker traces on {dev}, where "
             f"some kernels trace differently ({plural(len(only_plan), 'node')} only in the "
             f"plan, {len(only_here)} only here)" if plan.traced_on != dev else
             "the model or the input shapes changed since planning")
    fix = (f"create the plan where {dev} is available (fxpipe run plans on the launching "
           "machine, so launch it there), or use attention that traces the same everywhere "
           "(model.config.attn_implementation: eager)" if plan.traced_on != dev else
           "re-create the plan with `fxpipe plan` from the same model, spec and data")
    return (f"the model's graph differs from the plan: {cause} (nodes only in the plan: "
            f"{only_plan[:5]}, only here: {[n.name for n in only_here][:5]}); {fix}")


def trace_for_plan(plan: Plan, model: nn.Module, device: torch.device | str = "cpu"):
    """Trace ``model`` (already on ``device``) as the plan was traced, on zero inputs of the
    plan's micro-batch shapes (positional and keyword as planned, the same output kept), and
    apply the plan's recomputed values. Device-dependent constants land on ``device``.

    Returns the :class:`~fxpipe.partitioner.trace.TracedModel` whose graph holds exactly the
    plan's nodes.

    Raises:
        PlanError: the traced graph does not match the plan; the message names the cause (the
            model changed, or the plan was traced on another device type) and the fix.
    """
    spec = load_spec(plan.spec)
    args, kwargs = example_zeros(plan, device)
    traced = trace(model, args, spec.model.tracer, example_kwargs=kwargs, output=spec.loss_output)
    if plan.folded:
        resolve_in_place(plan, traced)
        return traced
    base = {n: s for n, s in plan.stage_of_node().items() if not is_clone(n)}
    computed = {n.name for n in traced.compute_nodes()} - {GUARDS_FN}
    if set(base) != computed:
        raise PlanError(_graph_difference(plan, traced, device))
    try:
        apply_recompute(traced.gm, plan.recomputed, base)
    except KeyError as e:
        raise PlanError(f"the plan rebuilds {e} in later stages, which this model's graph "
                        "cannot; re-create the plan with `fxpipe plan`") from None
    return traced


def resolve_in_place(plan: Plan, traced) -> None:
    """Resolve a plan made of repeated blocks (``plan.folded``) against the full graph of the
    model: every node gets its stage, the cheap values are rebuilt per stage, and the stages'
    nodes, inputs, outputs and the values between them are filled in (``plan.folded`` is
    emptied). Every rank resolves the same way, so they agree.

    Raises:
        PlanError: the graph does not have the planned structure.
    """
    node_stage = resolve_folded(plan.folded, traced)
    recomputed: dict[str, list[int]] = {}
    for name in plan.folded.get("cheap", []):
        if name not in node_stage:
            continue
        s = node_stage[name]
        readers = {node_stage[u.name] for u in traced.node(name).users
                   if node_stage.get(u.name, s) != s}
        if readers:
            recomputed[name] = sorted(readers)
    node_stage = apply_recompute(traced.gm, recomputed, node_stage)
    bounds = stage_boundaries(traced.gm, node_stage, plan.num_stages)
    for st, sb in zip(plan.stages, bounds.stages):
        st.nodes, st.params, st.buffers = list(sb.nodes), list(sb.params), list(sb.buffers)
        st.inputs, st.outputs = list(sb.inputs), list(sb.outputs)
    plan.values = dict(bounds.values)
    plan.model_inputs, plan.model_output = list(bounds.model_inputs), bounds.model_outputs[0]
    plan.shared_params, plan.param_aliases = dict(bounds.shared_params), dict(bounds.param_aliases)
    plan.recomputed, plan.folded = recomputed, {}


def build_stages(plan: Plan, traced, stage_ids: list[int]) -> dict[int, nn.Module]:
    """The stage modules ``stage_ids`` of ``plan`` from a graph :func:`trace_for_plan` made.

    Raises:
        PlanError: a stage's inputs or outputs differ from the plan's.
    """
    bounds = stage_boundaries(traced.gm, plan.stage_of_node(), plan.num_stages)
    for sb, st in zip(bounds.stages, plan.stages):
        if sb.inputs != st.inputs or sb.outputs != st.outputs:
            raise PlanError(f"stage {st.index}'s inputs/outputs differ from the plan "
                            f"({sb.inputs} -> {sb.outputs} here, {st.inputs} -> {st.outputs} "
                            "planned); re-create the plan with `fxpipe plan`")
    return {s: build_stage_module(traced.gm, bounds, s) for s in stage_ids}


def materialize_stages(plan: Plan, model: nn.Module, stage_ids: list[int],
                       device: torch.device | str = "cpu") -> dict[int, nn.Module]:
    """Rebuild the stage modules ``stage_ids`` of ``plan`` from ``model`` (a worker's step 1):
    :func:`trace_for_plan` then :func:`build_stages`.

    Returns stage index -> GraphModule (``forward(*inputs) -> tuple(outputs)``, parameters are the
    model's own Parameter objects under their original FQNs).

    Raises:
        PlanError: see :func:`trace_for_plan` and :func:`build_stages`.
    """
    return build_stages(plan, trace_for_plan(plan, model, device), stage_ids)
