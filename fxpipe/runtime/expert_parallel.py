"""Expert parallelism at run time: this rank's experts in its stages, whole experts for
checkpoints and state dicts.

:func:`shard_expert_stages` rewrites each stage of this rank with
:func:`fxpipe.experts.rewrite.shard_experts` over the mesh's expert group (its all-to-alls
report to the mesh's recorder, so the step's timeline shows them). :class:`ExpertShards` turns a
rank's experts back into whole weights (an all-gather over the expert group along the expert
dimension) and whole weights into this rank's experts, so checkpoints hold the plain model's
tensors under its names and load under any degree. :class:`ShardSet` puts it beside the tensor
group's :class:`~fxpipe.runtime.tensor_parallel.TensorShards` (each tensor is split by at most
one of them: tensor parallelism leaves the experts' batched weights whole).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from fxpipe.experts.rewrite import shard_experts
from fxpipe.runtime.tensor_parallel import TensorShards
from fxpipe.tensor.placement import shard


class ExpertShards(TensorShards):
    """This rank's experts: weights split on dimension 0 over the expert group (the interface
    of :class:`~fxpipe.runtime.tensor_parallel.TensorShards`)."""


def shard_expert_stages(stages: dict[int, nn.Module], mesh
                        ) -> tuple[dict[int, nn.Module], ExpertShards]:
    """This rank's stages on its experts (module doc)."""
    shards = ExpertShards(mesh.ep_group, mesh.ep_rank, mesh.expert)
    done: dict[int, nn.Parameter] = {}
    originals = {id(p): p for gm in stages.values() for p in gm.parameters()}
    out = {}
    for s, gm in stages.items():
        out[s], _ = shard_experts(gm, mesh.ep_collectives, mesh.ep_rank, mesh.expert, done)
        for p in out[s].parameters():
            if id(p) not in originals:
                shards.by_id[id(p)] = shard(0)
        shards.name_in(out[s])
    shards.origin = {id(new): originals[old] for old, new in done.items()}
    return out, shards


class ShardSet:
    """Tensor-parallel shards and experts together, as one bookkeeping with the interface of
    :class:`~fxpipe.runtime.tensor_parallel.TensorShards` (``tensor`` or ``experts`` may be
    None). :attr:`by_id` is the tensor group's (what clipping counts on every tensor rank);
    :attr:`expert_ids` the experts'."""

    def __init__(self, tensor: TensorShards | None, experts: ExpertShards | None):
        self.parts = [p for p in (tensor, experts) if p is not None]
        self.tensor, self.experts = tensor, experts
        self.by_id = tensor.by_id if tensor is not None else {}
        self.expert_ids = set(experts.by_id) if experts is not None else set()
        self.origin = {k: v for p in self.parts for k, v in p.origin.items()}

    def _part(self, key: str, local: torch.Tensor):
        return next((p for p in self.parts if p.placement(key, local) is not None), None)

    def name_in(self, module: nn.Module) -> None:
        for p in self.parts:
            p.name_in(module)

    def placement(self, key: str, local: torch.Tensor):
        part = self._part(key, local)
        return None if part is None else part.placement(key, local)

    def whole(self, key: str, local: torch.Tensor) -> torch.Tensor:
        part = self._part(key, local)
        return local if part is None else part.whole(key, local)

    def local(self, key: str, whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        part = self._part(key, like)
        return whole if part is None else part.local(key, whole, like)

    def whole_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for p in self.parts:
            state = p.whole_state(state)
        return state

    def whole_shape(self, key: str, local: torch.Tensor) -> list[int]:
        part = self._part(key, local)
        return list(local.shape) if part is None else part.whole_shape(key, local)
