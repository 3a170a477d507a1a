"""Activation recomputation of one (stage, micro-batch): the forward keeps only what the
backward needs to run it again, and the backward runs it again once, before B.

:func:`forward_keeping_inputs` runs the stage's forward with autograd keeping nothing (its
saved tensors are dropped as they are packed) and, under selective recomputation, with torch's
selective-checkpoint caching mode holding the outputs of the ops the rule of
:mod:`fxpipe.execution.selective` keeps. What stays per micro-batch: the stage's inputs, the
kept outputs, and the random-number state. :func:`replay` runs the forward again with autograd
on, in the same random-number state (dropout masks repeat), the kept ops returning their
cached outputs, on copies of the buffers (running statistics are updated once); the stage's
backward (whole, or B then W) then runs on that graph like a stage that never recomputed. ``torch.utils.checkpoint(use_reentrant=False)`` would recompute on
every backward pass that reaches a saved tensor: once in B and again in each of W's passes.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from fxpipe.execution.selective import selective_contexts

__all__ = ["Replay", "buffers_copied", "cuda_devices", "forward_keeping_inputs", "replay"]


@dataclass
class Replay:
    """What a recomputing micro-batch keeps for its second forward.

    Attributes:
        args: the stage's inputs.
        cpu_rng / cuda_rng: the random-number states the first forward started from (CUDA:
            device index -> state).
        cached: under selective recomputation, the recompute mode holding the kept outputs;
            None under full recomputation.
    """

    args: list[Any]
    cpu_rng: torch.Tensor
    cuda_rng: dict[int, torch.Tensor]
    cached: Any = None


def _drop(_t: torch.Tensor) -> None:
    return None


def _never(_x: Any) -> torch.Tensor:  # pragma: no cover - the first forward's graph is dropped
    raise RuntimeError("the first forward of a recomputing stage kept no activations")


def cuda_devices(args: list[Any], module: nn.Module) -> list[int]:
    """CUDA device indices of ``args``' tensors and ``module``'s parameters (whose random
    states a forward may use)."""
    devs = {t.device.index or 0 for t in pytree.tree_leaves(args)
            if isinstance(t, torch.Tensor) and t.is_cuda}
    devs |= {p.device.index or 0 for p in module.parameters() if p.is_cuda}
    return sorted(devs)


def forward_keeping_inputs(module: nn.Module, args: list[Any], ridge: float | None
                           ) -> tuple[Any, Replay]:
    """``module(*args)`` with autograd keeping nothing, its outputs detached; ``ridge``: keep
    the outputs of the ops selective recomputation keeps at this ridge (None: keep none, full
    recomputation)."""
    cuda = {d: torch.cuda.get_rng_state(d) for d in cuda_devices(args, module)}
    rep = Replay(list(args), torch.get_rng_state(), cuda)
    caching = nullcontext()
    if ridge is not None:
        caching, rep.cached = selective_contexts(ridge)
    with torch.autograd.graph.saved_tensors_hooks(_drop, _never), caching:
        out = module(*args)
    out = pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out)
    return out, rep


@contextmanager
def buffers_copied(module: nn.Module) -> Iterator[None]:
    """Run with copies of ``module``'s buffers in their place: what the run writes there (a
    BatchNorm's running statistics) is dropped afterwards."""
    held = [(m._buffers, k, b) for m in module.modules() for k, b in m._buffers.items()
            if b is not None]
    try:
        for bufs, k, b in held:
            bufs[k] = b.detach().clone()
        yield
    finally:
        for bufs, k, b in held:
            bufs[k] = b


def replay(module: nn.Module, rep: Replay) -> Any:
    """The forward of :func:`forward_keeping_inputs` again, with autograd on, from the same
    random-number state (the caller's state is left as it was). It runs on copies of the
    module's buffers: what it writes there (a BatchNorm's running statistics, which the first
    forward updated already) is dropped, so buffers are updated once per micro-batch."""
    with torch.random.fork_rng(devices=list(rep.cuda_rng)):
        torch.set_rng_state(rep.cpu_rng)
        for d, state in rep.cuda_rng.items():
            torch.cuda.set_rng_state(state, d)
        with buffers_copied(module), torch.enable_grad(), (
                rep.cached if rep.cached is not None else nullcontext()):
            return module(*rep.args)
