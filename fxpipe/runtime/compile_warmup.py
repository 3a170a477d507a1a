"""Compiled stages are compiled at the start of the first step, one replica per host first.

A compiled stage (``train.compile``, :mod:`fxpipe.execution.compiled_stage`) compiles on its
first call. Inside the first step that would hold its pipeline peers waiting on a receive
for as long as inductor takes (minutes for a large stage, against ``train.timeout_s``), and
every data-parallel replica of the stage would compile the same graphs at the same time. So
before the first step's schedule runs, each rank runs its compiled stages' forward and
backward once on the step's first micro-batch (model inputs as given, received values as
zeros of their plan shape and dtype, leaves requiring gradients as the received ones do), in
waves: the first replica of each stage position on a host compiles (inductor stores the code
in its FX-graph cache on disk), a barrier, then the host's other replicas, whose compilation
finds the cache filled. Tensor-parallel ranks of a replica run together (their collectives
run in the warm-up too).

Nothing of the warm-up stays: the backward is ``torch.autograd.grad`` to one input (no
``.grad`` written, no gradient hook fired), the random-number state and the buffers (a
BatchNorm's running statistics) are as before it.
"""

from __future__ import annotations

import socket
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils import _pytree as pytree

from fxpipe.runtime.recompute import cuda_devices, buffers_copied

__all__ = ["warm_up"]


def _run_once(module: nn.Module, args: list[Any], autocast: Callable, retain: bool) -> None:
    with torch.random.fork_rng(devices=cuda_devices(args, module)), buffers_copied(module):
        with torch.enable_grad(), autocast():
            out = module(*args)
        outs = [t for t in pytree.tree_leaves(out)
                if isinstance(t, torch.Tensor) and t.requires_grad]
        wrt = [t for t in args if isinstance(t, torch.Tensor) and t.requires_grad] or [
            p for p in module.parameters() if p.requires_grad][:1]
        if outs and wrt:
            torch.autograd.grad(outs, wrt, [torch.zeros_like(t) for t in outs],
                                allow_unused=True, retain_graph=retain)


def _compile_error(e: BaseException) -> bool:
    """An error of torch.compile's (Dynamo, AOTAutograd, inductor, a backend compiler), not
    of the stage's own computation or of a peer."""
    from torch._dynamo.exc import BackendCompilerFailed, TorchDynamoException

    return isinstance(e, (BackendCompilerFailed, TorchDynamoException))


def _first_on_host(mesh) -> bool:
    """This rank is the first of its stage position's replicas (``mesh.dp_ranks``) on its
    host (collective: every rank calls it)."""
    hosts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    mine = [r for r in mesh.dp_ranks if hosts[r] == hosts[mesh.rank]]
    return mesh.rank == min(mine)


def warm_up(modules: dict[int, nn.Module], args_of: Callable[[int], list[Any]],
            autocast: Callable, mesh, waves: bool = True, retain: bool = False,
            failed: Callable[[int, BaseException], None] | None = None) -> None:
    """Compile ``modules`` (stage -> compiled module of this rank) before the first step:
    ``args_of(stage)`` gives a micro-batch's inputs. With ``waves`` and ``mesh.dp > 1`` it is
    collective (every rank calls it, compiled stages or not); ``waves=False`` (parameter
    servers, which run no stage, share the world): each rank alone. ``retain``: the stages'
    backward runs split (B keeps the graph for W), so the warm-up keeps it too: the backward
    is compiled as it will run (no buffers donated). ``failed(stage, error)``: called where a
    stage's compilation raised (``train.compile: auto``: the stage then runs eagerly); None:
    the error propagates."""
    def run() -> None:
        for s, m in modules.items():
            try:
                _run_once(m, args_of(s), autocast, retain)
            except Exception as e:  # noqa: BLE001 - inductor's or Dynamo's, said as it is
                if failed is None or not _compile_error(e):
                    raise
                failed(s, e)
    if waves and mesh.dp > 1 and dist.is_available() and dist.is_initialized():
        first = _first_on_host(mesh)
        if first:
            run()
        dist.barrier()  # the host's first replicas have filled inductor's cache
        if not first:
            run()
    else:
        run()
