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
from fxpipe.partitioner.trace import trace
from fxpipe.plans.plan import Plan
from fxpipe.specs.loader import load_spec

__all__ = ["build_stage_module", "materialize_stages", "split_graph"]


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


def materialize_stages(plan: Plan, model: nn.Module, stage_ids: list[int],
                       device: torch.device | str = "cpu") -> dict[int, nn.Module]:
    """Rebuild the stage modules ``stage_ids`` of ``plan`` from ``model`` (a worker's step 1).

    The model (already on ``device``) is traced again with zero inputs of the plan's micro-batch
    shapes on ``device``, so device-dependent constants land on the right device; the plan's node
    assignment is applied and the boundaries are checked against the plan.

    Returns stage index -> GraphModule (``forward(*inputs) -> tuple(outputs)``, parameters are the
    model's own Parameter objects under their original FQNs).

    Raises:
        PlanError: the traced graph no longer matches the plan (the model changed since planning).
    """
    spec = load_spec(plan.spec)
    inputs = []
    for name in plan.model_inputs:
        v = plan.values[name]
        inputs.append(torch.zeros(v.shape, dtype=getattr(torch, v.dtype), device=device))
    traced = trace(model, tuple(inputs), spec.model.tracer)
    node_stage = plan.stage_of_node()
    computed = {n.name for n in traced.compute_nodes()} - {GUARDS_FN}
    if set(node_stage) != computed:
        missing = sorted(set(node_stage) - computed)[:5]
        extra = sorted(computed - set(node_stage))[:5]
        raise PlanError(
            f"the model's graph differs from the plan (nodes only in the plan: {missing}, only in "
            f"the model: {extra}); re-create the plan with `fxpipe plan`"
        )
    bounds = stage_boundaries(traced.gm, node_stage, plan.num_stages)
    for sb, st in zip(bounds.stages, plan.stages):
        if sb.inputs != st.inputs or sb.outputs != st.outputs:
            raise PlanError(f"stage {st.index}'s inputs/outputs differ from the plan; re-plan")
    return {s: build_stage_module(traced.gm, bounds, s) for s in stage_ids}
