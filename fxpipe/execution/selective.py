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

from contextlib import contextmanager
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from fxpipe.execution.op_flops import has_flops, op_flops

__all__ = ["keeps_op", "out_bytes", "ridge_of", "rule_bytes", "selective_contexts"]


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


def rule_bytes(out: Any) -> int:
    """The output bytes the rule divides by: :func:`out_bytes`, except that a floating-point
    output narrowed by autocast (bf16 / fp16 under ``torch.autocast`` for its device) counts
    at float32 width, as the planner, which traces the model in float32, priced it; so a
    stage keeps at run time exactly the ops its plan kept (a matmul whose FLOPs per fp32
    byte are just under the ridge is over it in bf16 bytes)."""
    total = 0
    for t in pytree.tree_leaves(out):
        if not isinstance(t, torch.Tensor):
            continue
        size = t.element_size()
        if t.is_floating_point() and size < 4 and torch.is_autocast_enabled(t.device.type):
            size = 4
        total += int(t.numel()) * size
    return total


def keeps_op(func, args: tuple, kwargs: dict, out: Any, ridge: float) -> bool:
    """Whether selective recomputation keeps the outputs of ``func(*args, **kwargs) -> out``:
    its FLOPs reach ``ridge`` per byte of output (:func:`rule_bytes`; the module doc)."""
    if not has_flops(func):
        return False
    nbytes = rule_bytes(out)
    return nbytes > 0 and op_flops(func, args, kwargs or {}, out) >= ridge * nbytes


def _written(func, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors ``func`` writes in place (its schema's mutable arguments)."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.is_mutable:
        return []
    out = []
    for i, a in enumerate(schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        v = args[i] if i < len(args) else kwargs.get(a.name)
        out.extend(t for t in pytree.tree_leaves(v) if isinstance(t, torch.Tensor))
    return out


class _CopyBeforeWrite(TorchDispatchMode):
    """Runs above torch's caching mode in the first forward: before an op writes in place into
    a kept output (``nn.ReLU(inplace=True)`` after a linear layer, or a write through a view of
    it), the kept entry is replaced by a copy of its value as the op produced it, so the
    recomputation reads that value (torch's mode would otherwise refuse the mutated entry in
    the backward). The bytes kept are the same; the copy is made only where a write happens."""

    def __init__(self, storage) -> None:
        super().__init__()
        self.storage = storage

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        written = {t.untyped_storage().data_ptr() for t in _written(func, args, kwargs)
                   if t.device.type != "meta"}
        if written:
            hit = [w for entries in self.storage.values()
                   for entry in (entries.values() if isinstance(entries, dict) else entries)
                   for w in pytree.tree_leaves(entry)
                   if isinstance(getattr(w, "val", None), torch.Tensor)
                   and w.val.untyped_storage().data_ptr() in written]
            with _disable_current_modes():  # the copy is no op of the model's: not cached
                for w in hit:
                    w.val = w.val.clone()
                    w.version = w.val._version
        return func(*args, **kwargs)


def selective_contexts(ridge: float):
    """The (forward, recompute) context pair of torch's selective checkpointing with the rule
    of :func:`keeps_op` at ``ridge``: the forward caches the kept ops' outputs (copied first
    where a later op writes into them in place), the recompute returns them and runs every
    other op again. A fresh pair per micro-batch (they share its cache)."""
    def policy(ctx, func, *args, **kwargs):
        if keeps_op(func, args, kwargs, ctx.op_output, ridge):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    caching, cached = create_selective_checkpoint_contexts(policy)

    @contextmanager
    def forward():
        with caching, _CopyBeforeWrite(caching.storage):
            yield

    return forward(), cached
