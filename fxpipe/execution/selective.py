"""Selective activation recomputation: which ops a recomputing stage keeps for its backward.

One rule, read by the planner's pricing (:mod:`fxpipe.partitioner.cost`, on fake tensors) and
by the runtime's policy (:mod:`fxpipe.runtime.recompute`, through
``torch.utils.checkpoint.create_selective_checkpoint_contexts``): an op's outputs are **kept**
when recomputing them would cost more time than moving their bytes once, i.e. when its FLOPs
per output byte reach the device's ridge point (``device FLOP/s / memory bytes/s``, the
``ridge`` of :func:`ridge_of`); every other op is recomputed in the backward. Element-wise ops,
norms, softmax, dropout and views (0 FLOPs) are always recomputed; linear layers (FLOPs per byte
~ their input width) are kept; an unfused attention core (scores ``q @ k^T``: FLOPs per byte ~
the head dimension) is recomputed on a device whose ridge is above it (an A100: 312 TFLOP/s
over 2 TB/s, ~150 FLOP/byte, against 64-128), the selection of Korthikanti et al., "Reducing
Activation Recomputation in Large Transformer Models" (MLSys 2023), reached from the costs
rather than from module names; a fused attention kernel (FLOPs per byte ~ the sequence
length) is kept. The decision depends on the op, its shapes and the ridge only, so every rank
and the planner agree on it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from fxpipe.execution.op_flops import has_flops, op_flops

__all__ = ["keeps_op", "out_bytes", "ridge_of", "selective_contexts"]


def ridge_of(device_flops: float, memory_Bps: float) -> float:  # noqa: N803
    """FLOPs per byte at which recomputing an op's outputs costs as long as moving them once:
    ``device_flops / memory_Bps`` (both per second, > 0)."""
    if not (device_flops > 0 and memory_Bps > 0):
        raise ValueError(f"device_flops={device_flops!r} and memory_Bps={memory_Bps!r} must be "
                         "> 0 (FLOP/s and bytes/s of one device)")
    return float(device_flops) / float(memory_Bps)


def out_bytes(out: Any) -> int:
    """Bytes of the tensors in an op's output (a tuple's summed)."""
    return sum(int(t.numel()) * t.element_size() for t in pytree.tree_leaves(out)
               if isinstance(t, torch.Tensor))


def keeps_op(func, args: tuple, kwargs: dict, out: Any, ridge: float) -> bool:
    """Whether selective recomputation keeps the outputs of ``func(*args, **kwargs) -> out``:
    its FLOPs reach ``ridge`` per byte of output (the module doc)."""
    if not has_flops(func):
        return False
    nbytes = out_bytes(out)
    return nbytes > 0 and op_flops(func, args, kwargs or {}, out) >= ridge * nbytes


def selective_contexts(ridge: float):
    """The (forward, recompute) dispatch-mode pair of torch's selective checkpointing with the
    rule of :func:`keeps_op` at ``ridge``: the forward caches the kept ops' outputs, the
    recompute returns them and runs every other op again. A fresh pair per micro-batch (they
    share its cache)."""
    def policy(ctx, func, *args, **kwargs):
        if keeps_op(func, args, kwargs, ctx.op_output, ridge):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)
