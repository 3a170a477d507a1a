"""Eval-mode copies of stage graphs: dropout off, BatchNorm on its running statistics.

A graph traced by ``torch.export`` fixes the module's mode at trace time: ``aten.dropout(x, p,
True)``, ``aten.batch_norm(..., training=True, ...)`` and the ``num_batches_tracked += 1`` of
a BatchNorm are in the graph as constants, so ``module.eval()`` on a stage module changes
nothing. :func:`eval_copy` makes a second GraphModule over the same parameters and buffers
whose graph has those flags switched to eval (what ``model.eval()`` does in eager PyTorch);
``torch.fx`` graphs keep dropout / BatchNorm modules as ``call_module`` nodes, which follow
``.eval()`` of the (shared) submodule, and their functional forms are switched here too.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from fxpipe.execution.rebuild import rebuilt

_aten = torch.ops.aten
#: ops whose third argument (``train``) switches the random mask on
_DROPOUTS = {_aten.dropout.default, _aten.feature_dropout.default, _aten.alpha_dropout.default,
             _aten.feature_alpha_dropout.default, _aten.native_dropout.default}
#: functional dropouts (torch.fx graphs): ``training`` is the third argument
_F_DROPOUTS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout,
               F.feature_alpha_dropout}


def _set_arg(node: fx.Node, index: int, name: str, value) -> bool:
    """Set argument ``index`` (or keyword ``name``) of ``node``; True when it changed."""
    if len(node.args) > index:
        if node.args[index] == value:
            return False
        args = list(node.args)
        args[index] = value
        node.args = tuple(args)
        return True
    if node.kwargs.get(name, not value) == value:
        return False
    node.kwargs = {**node.kwargs, name: value}
    return True


def to_eval(graph: fx.Graph) -> int:
    """Switch the training-only operations of ``graph`` to eval mode, in place: dropouts
    become the identity (``train=False``), BatchNorm with running statistics normalises with
    them (``training=False``) and no longer counts batches. Returns the number of nodes
    changed."""
    changed = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        t = node.target
        if t in _DROPOUTS:
            changed += _set_arg(node, 2, "train", False)
        elif t in _F_DROPOUTS:
            changed += _set_arg(node, 2, "training", False)
        elif t is _aten.batch_norm.default or t is F.batch_norm:
            stats = node.args[3] if t is _aten.batch_norm.default else node.args[1]
            if stats is not None:  # without running statistics eval mode uses the batch's too
                changed += _set_arg(node, 5, "training", False)
        elif t is _aten.add_.Tensor and not node.users:
            dst = node.args[0]
            if (isinstance(dst, fx.Node) and dst.op == "get_attr"
                    and str(dst.target).endswith("num_batches_tracked")):
                graph.erase_node(node)
                changed += 1
    return changed


def eval_copy(module: fx.GraphModule) -> fx.GraphModule:
    """A GraphModule running ``module``'s graph in eval mode (:func:`to_eval`) over the same
    parameter, buffer and submodule objects (nothing is copied but the graph)."""
    graph = fx.Graph()
    out = graph.graph_copy(module.graph, {})
    graph.output(out)
    to_eval(graph)
    graph.lint()
    copy = rebuilt(module, graph, class_name=f"{type(module).__name__}Eval")
    copy.eval()
    return copy
