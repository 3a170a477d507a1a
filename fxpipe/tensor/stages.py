"""A Plan's stage as its tensor group runs it: the placements of the stage's parameters (by the
names its graph reads them under), the inputs it receives, the logits a vocabulary-parallel loss
reads after it, and :func:`plan_stage_sharding`, the decisions the runtime applies and the
planner counts the collectives of."""

from __future__ import annotations

import torch.fx as fx

from fxpipe.plans.plan import Plan
from fxpipe.tensor.analysis import Sharding, stage_sharding
from fxpipe.tensor.placement import Placement

#: the built-in losses that take logits split by vocabulary
VOCAB_PARALLEL_LOSSES = ("cross_entropy",)


def stage_placements(plan: Plan, gm: fx.GraphModule) -> dict[str, Placement]:
    """get_attr target -> placement of the stage's sharded parameters (the plan names them by
    their canonical FQN; a stage may read a tied one under an alias)."""
    out = {}
    for n in gm.graph.nodes:
        if n.op != "get_attr":
            continue
        text = plan.tensor_params.get(plan.param_aliases.get(n.target, n.target))
        if text is not None:
            out[n.target] = Placement.from_json(text)
    return out


def received_inputs(plan: Plan, s: int) -> set[str]:
    """The inputs stage ``s`` receives from other stages (they get gradients)."""
    return {v for v in plan.stages[s].inputs if v not in plan.model_inputs}


def stage_logits(plan: Plan, s: int, gm: fx.GraphModule) -> fx.Node | None:
    """The node of stage ``s``'s graph that makes the model output, when the stage returns
    it (the loss reads it after the stage), else None."""
    sp = plan.stages[s]
    if plan.model_output not in sp.outputs:
        return None
    output = next(iter(gm.graph.find_nodes(op="output")))
    outs = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    return outs[sp.outputs.index(plan.model_output)]


def plan_stage_sharding(plan: Plan, s: int, gm: fx.GraphModule, loss_name: str | None
                        ) -> tuple[Sharding, fx.Node | None]:
    """Stage ``s`` (graph ``gm``) at the plan's tensor degree; ``loss_name``: the loss the
    executor computes after the last stage (``train.loss``), or None (the model's own, or a
    function given by hand: the logits are then gathered). Returns the sharding and the logits
    node a vocabulary-parallel loss reads (None when none does)."""
    logits = stage_logits(plan, s, gm) if loss_name in VOCAB_PARALLEL_LOSSES else None
    sharding = stage_sharding(gm, stage_placements(plan, gm), plan.tensor,
                              sequence_parallel=plan.sequence_parallel,
                              received=received_inputs(plan, s), logits=logits)
    return sharding, logits
