"""Tensor parallelism at run time: this rank's shards of its stages, the loss on sharded
logits, whole tensors for checkpoints and state dicts, and a Plan's stage as its tensor group
runs it (:func:`plan_stage_sharding`: the decisions the runtime applies).

:func:`shard_stages` applies the Plan's parameter placements (``plan.tensor_params``) to each
stage module of this rank: :func:`fxpipe.tensor.analysis.analyse` decides how every node of the
stage runs on its shards and :func:`fxpipe.tensor.rewrite.shard_stage` rewrites it (the stages
keep their inputs and outputs, so the executor and every schedule run them unchanged). When the
last stage's logits stay split by vocabulary, the returned loss is the vocabulary-parallel
cross entropy (nothing gathers the logits). :class:`TensorShards` turns a rank's shards back
into whole tensors (an all-gather over the tensor group) and whole tensors into shards, so that
checkpoints hold whole tensors under the model's names (they load under any degree) and
``state_dict()`` gives what the plain model has.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.fx as fx
import torch.nn as nn

from fxpipe.errors import RuntimeFailure
from fxpipe.plans.plan import Plan
from fxpipe.tensor import collectives
from fxpipe.tensor.analysis import VOCAB_PARALLEL_LOSSES, Sharding, stage_sharding
from fxpipe.tensor.placement import Placement
from fxpipe.tensor.rewrite import local_slice, shard_stage, whole_from

class TensorShards:
    """The sharded parameters of this rank, by every name they go by (tied aliases and the
    model's first name included), with their placements; gathers and slices over the tensor
    group.

    Attributes:
        placements: parameter name -> placement (sharded ones only; :meth:`name_in` adds the
            names a module gives them).
        by_id: id of a shard parameter -> its placement.
        origin: id of a shard parameter -> the whole parameter it came from.
    """

    def __init__(self, group, rank: int, t: int):
        self.group, self.rank, self.t = group, rank, t
        self.placements: dict[str, Placement] = {}
        self.by_id: dict[int, Placement] = {}
        self.origin: dict[int, nn.Parameter] = {}

    def name_in(self, module: nn.Module) -> None:
        """Learn the names ``module`` gives the shard parameters (all of them, aliases too)."""
        for name, p in module.named_parameters(remove_duplicate=False):
            if id(p) in self.by_id:
                self.placements[name] = self.by_id[id(p)]

    def placement(self, key: str, local: torch.Tensor) -> Placement | None:
        """The placement of state key ``key`` (a parameter name, or an optimizer state entry
        ``optim.state.<name>.<field>`` of the parameter's shape), or None (whole)."""
        name = key
        if key.startswith("optim.state."):
            rest = key[len("optim.state."):]
            name = next((n for n in self.placements if rest.startswith(n + ".")), None)
        p = self.placements.get(name) if name is not None else None
        if p is None or local.dim() <= p.dim:
            return None
        return p

    def whole(self, key: str, local: torch.Tensor) -> torch.Tensor:
        """The whole tensor of ``key`` from every rank's shard (collective over the tensor
        group: all its ranks call it with the same keys in the same order)."""
        p = self.placement(key, local)
        if p is None:
            return local
        import torch.distributed as dist

        parts = [torch.empty_like(local) for _ in range(self.t)]
        dist.all_gather(parts, local.detach().contiguous(), group=self.group)
        return whole_from(parts, p)

    def local(self, key: str, whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a whole tensor of ``key`` (``like``: the local tensor)."""
        p = self.placement(key, like)
        if p is None or list(whole.shape) == list(like.shape):
            return whole
        return local_slice(whole, p, self.rank, self.t)

    def whole_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state`` with every sharded entry whole (collective; keys in sorted order)."""
        out = dict(state)
        for k in sorted(state):
            v = state[k]
            if isinstance(v, torch.Tensor):
                out[k] = self.whole(k, v)
        return out

    def whole_shape(self, key: str, local: torch.Tensor) -> list[int]:
        """The whole shape of ``key``."""
        p = self.placement(key, local)
        shape = list(local.shape)
        if p is not None:
            shape[p.dim] *= self.t
        return shape


def shard_stages(plan: Plan, stages: dict[int, nn.Module], mesh, loss_name: str | None,
                 ignore_index: int = -100
                 ) -> tuple[dict[int, nn.Module], TensorShards, Callable | None]:
    """This rank's shards of its stage modules (see the module doc).

    Args:
        plan: the Plan (``tensor``, ``tensor_params``, ``sequence_parallel``).
        stages: stage index -> GraphModule of this rank (as ``build_stages`` makes them).
        mesh: the rank's mesh (``tp_group``, ``tp_rank``, ``tensor``; the stages' collectives
            run over ``tp_collectives``, reporting their timing to the mesh's recorder).
        loss_name: ``train.loss`` when the executor computes the spec's built-in loss, else
            None (the model output is then gathered for the given loss function).
        ignore_index: targets that do not count (the vocabulary-parallel cross entropy's).

    Returns:
        ``(stage modules, the shards' bookkeeping, the loss to use instead of the spec's or
        None)``.

    Raises:
        RuntimeFailure: a stage is not a graph module.
    """
    t, rank, group = plan.tensor, mesh.tp_rank, mesh.tp_collectives
    shards = TensorShards(mesh.tp_group, rank, t)
    done: dict[int, nn.Parameter] = {}
    originals = {id(p): p for gm in stages.values() for p in gm.parameters()}
    out: dict[int, nn.Module] = {}
    loss = None
    for s, gm in stages.items():
        if not isinstance(gm, fx.GraphModule):
            raise RuntimeFailure(f"stage {s} is not a graph module; tensor parallelism rewrites "
                                 "the traced stage graphs")
        sharding, logits = plan_stage_sharding(plan, s, gm, loss_name)
        if logits is not None:
            p = sharding.placement(logits.name)
            nd = logits.meta["val"].dim()
            if p.sharded and p.dim == nd - 1:
                classes = int(logits.meta["val"].shape[-1]) // t
                loss = _vocab_loss(rank * classes, ignore_index, group)
        out[s] = shard_stage(gm, sharding, group, rank, done, overlap=plan.tp_overlap)
        for name, param in out[s].named_parameters(remove_duplicate=False):
            if id(param) not in originals:  # a shard
                shards.by_id[id(param)] = Placement.from_json(
                    plan.tensor_params[plan.param_aliases.get(name, name)])
        shards.name_in(out[s])
    shards.origin = {id(new): originals[old] for old, new in done.items()}
    return out, shards, loss


def _vocab_loss(start: int, ignore_index: int, group) -> Callable:
    """The spec's cross entropy on logits ``[..., classes / t]`` split by vocabulary."""
    def vocab_parallel_cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return collectives.vocab_cross_entropy(output.reshape(-1, output.shape[-1]),
                                               target.reshape(-1), start, ignore_index, "mean",
                                               group)
    return vocab_parallel_cross_entropy


# -------------------------------------------------------- a Plan's stage as its group runs it
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
