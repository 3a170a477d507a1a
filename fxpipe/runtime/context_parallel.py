"""Context parallelism at run time: this rank's share of every sequence in its stages, the loss
on split outputs, and the plan's values as this rank sends and receives them.

:func:`split_sequences` places every value of the model's graph once
(:func:`fxpipe.context.analysis.analyse`, the planner's rule, on the whole graph: a value
computed on the rank's positions or gathered early is decided looking past the stage that
makes it), rewrites each stage of this rank onto its positions by those decisions
(:func:`fxpipe.context.rewrite.rewrite_stage`; a value crossing a cut leaves and arrives as
they place it), and returns the loss the executor then computes:

* a model that computes its own loss (``train.loss: model``) leaves a partial sum (each rank's
  part of the mean): it is multiplied by the degree, because the gradients of the context
  group's ranks are averaged with the data-parallel replicas' (and ``1/N`` of ``N`` parts
  times ``N`` is the whole);
* the built-in ``cross_entropy`` on split logits: this rank's rows summed, divided by the
  count of counted targets over the whole micro-batch (every rank has the target), times the
  degree;
* any other loss reads the logits whole (:func:`fxpipe.context.collectives.whole_output`).

Parameters are whole on every rank of a context group, so state dicts and checkpoints are
those of data parallelism (the plain model's names; any degree resumes them).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from fxpipe.context.analysis import PARTIAL, ContextError, Seq, analyse, sequence_length
from fxpipe.context.collectives import localize, whole_output
from fxpipe.context.layout import positions
from fxpipe.context.rewrite import rewrite_stage
from fxpipe.errors import RuntimeFailure
from fxpipe.plans.plan import Plan


def split_sequences(plan: Plan, gm: fx.GraphModule, stages: dict[int, nn.Module], mesh,
                    loss: Callable, loss_name: str | None, model_loss: bool,
                    ignore_index: int = -100
                    ) -> tuple[dict[int, nn.Module], Callable, Plan]:
    """This rank's stages on its share of the sequence (see the module doc).

    Args:
        plan: the Plan (``context``).
        gm: the model's whole traced graph (the one the stages were cut from).
        stages: stage index -> GraphModule of this rank.
        mesh: the rank's mesh (``cp_rank``, ``cp_collectives``).
        loss: the loss the executor would compute; loss_name: ``train.loss`` when it is the
            spec's built-in one (None: a function given by hand); model_loss: the model
            computes its own.

    Returns:
        ``(stages, loss, plan with the values' shapes as this rank holds them)``.
    """
    n, rank, group = plan.context, mesh.cp_rank, mesh.cp_collectives
    seq = sequence_length(gm)
    ring = plan.context_attention == "ring"
    try:
        whole = analyse(gm, n, seq, ring=ring)
        out = {}
        for s, stage in stages.items():
            if not isinstance(stage, fx.GraphModule):
                raise RuntimeFailure(f"stage {s} is not a graph module; context parallelism "
                                     "rewrites the traced stage graphs")
            missing = [x.name for x in stage.graph.nodes
                       if x.op == "call_function" and x.name not in whole.nodes]
            if missing:
                raise RuntimeFailure(f"stage {s}'s nodes {missing[:3]} are not in the model's "
                                     "graph; context parallelism decides on the whole graph")
            out[s] = rewrite_stage(stage, whole, rank, group)
    except ContextError as e:
        raise RuntimeFailure(str(e)) from None
    values = {}
    for name, v in plan.values.items():
        p = whole.place(name)
        if isinstance(p, Seq):
            shape = list(v.shape)
            shape[p.dim] //= n
            v = dataclasses.replace(v, shape=shape, nbytes=v.nbytes // n)
        values[name] = v
    local = dataclasses.replace(plan, values=values)
    return out, _loss(whole.place(plan.model_output), loss, loss_name, model_loss, n, seq, rank,
                      group, ignore_index), local


def _loss(p, loss: Callable, loss_name: str | None, model_loss: bool, n: int, seq: int,
          rank: int, group, ignore_index: int) -> Callable:
    if model_loss:
        if p == PARTIAL:
            def share_of_model_loss(output, target=None):
                return loss(output, target) * n
            return share_of_model_loss
        if p is None:
            return loss
        raise RuntimeFailure("the model's loss is split along the sequence (one value per "
                             "token?); context parallelism needs a scalar loss")
    if p is None:
        return loss
    if p == PARTIAL:
        raise RuntimeFailure("the model output is a sum over the sequence, which the loss "
                             "cannot read on one rank; use parallel.context: 1")
    if loss_name == "cross_entropy":
        def cross_entropy_share(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            mine = localize(target, p.dim, p.inner, seq, positions(rank, n, seq))
            total = F.cross_entropy(output.reshape(-1, output.shape[-1]), mine.reshape(-1),
                                    ignore_index=ignore_index, reduction="sum")
            count = (target != ignore_index).sum().to(total.dtype)
            return total / count * n
        return cross_entropy_share

    def on_whole_output(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return loss(whole_output(output, p.dim, p.inner, n, seq, rank, group), target)
    return on_whole_output
