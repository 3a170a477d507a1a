"""Which targets count in a model's own loss, read from its graph.

A model that computes its own loss (a transformers model given ``labels``) averages a
cross-entropy over the targets it derives from its inputs: a causal LM shifts its labels by one
position, a masked LM or T5 uses them as they are, and ``ignore_index`` (``-100``) marks targets
that do not count. To weight each micro-batch by the targets that count (so that the pipeline's
loss is the whole batch's mean), fxpipe replays exactly that derivation: the graph's one
``cross_entropy`` (or ``nll_loss``) node with mean reduction, and the cone of nodes that build its
target from the model inputs (shift, pad, view), copied into a small GraphModule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

__all__ = ["TargetCounter", "target_counter"]

aten = torch.ops.aten
#: loss ops whose ``(input, target, weight, reduction, ignore_index)`` arguments are read
_CE_OPS = {aten.cross_entropy_loss.default: 4, aten.nll_loss_forward.default: 4,
           aten.nll_loss.default: 4, aten.nll_loss_nd.default: 4}
_MEAN = 1  # torch's Reduction::Mean


@dataclass
class TargetCounter:
    """Counts the targets of one micro-batch that the model's loss averages over.

    Attributes:
        module: inputs -> the loss's target tensor (the replayed cone).
        inputs: the model-input names ``module`` takes, in order.
        ignore_index: the loss's ignored target value.
    """

    module: fx.GraphModule
    inputs: list[str]
    ignore_index: int

    def __call__(self, named: dict[str, torch.Tensor]) -> int:
        """Counted targets given the micro-batch's model inputs by name."""
        with torch.no_grad():
            target = self.module(*[named[n] for n in self.inputs])
        return int((target != self.ignore_index).sum())


def target_counter(gm: fx.GraphModule) -> TargetCounter | None:
    """The :class:`TargetCounter` of ``gm``'s loss, or None when the graph does not hold exactly
    one mean-reduced cross-entropy whose target comes from the model inputs alone (then every
    sample counts the same)."""
    losses = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _CE_OPS]
    if len(losses) != 1:
        return None
    node = losses[0]
    args = list(node.args)
    schema_args = node.target._schema.arguments
    values = {a.name: (args[i] if i < len(args) else node.kwargs.get(a.name, a.default_value))
              for i, a in enumerate(schema_args)}
    if values.get("reduction", _MEAN) != _MEAN or not isinstance(values.get("target"), fx.Node):
        return None
    ignore = int(values.get("ignore_index", -100))
    cone: list[fx.Node] = []
    inputs: list[fx.Node] = []
    stack, seen = [values["target"]], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            inputs.append(n)
        elif n.op == "call_function":
            cone.append(n)
            stack.extend(n.all_input_nodes)
        else:  # parameters, buffers, modules: not a function of the inputs alone
            return None
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs.sort(key=order.__getitem__)
    for ph in inputs:
        env[ph] = g.placeholder(ph.name)
    for n in sorted(cone, key=order.__getitem__):
        env[n] = g.node_copy(n, lambda a: env[a])
    g.output(env[values["target"]])
    return TargetCounter(fx.GraphModule(torch.nn.Module(), g), [p.name for p in inputs], ignore)
