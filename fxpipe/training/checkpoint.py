"""Checkpoints with torch.distributed.checkpoint (DCP), keyed by the ORIGINAL FQNs.

Every rank saves the parameters AND persistent buffers (e.g. BatchNorm's ``running_mean``,
``running_var``, ``num_batches_tracked``) of its stages: exactly what ``model.state_dict()`` of
the unsplit model holds, under the same names. Non-persistent buffers and traced constants are
not saved (the model rebuilds them). Keys held by several ranks (data-parallel replicas, tied
weights on two stages) are written once by DCP's de-duplicating planner. A checkpoint taken from a
pipelined run therefore loads straight into the plain single-process model
(:func:`load_into_model`). Each save goes into its own ``step_NNNNNN`` folder and an existing
checkpoint is never overwritten.

Data parallel and buffers: gradients are all-reduced, so replicas hold identical parameters, but
buffers updated in the forward pass from the local micro-batches (BatchNorm running statistics)
are NOT synchronised and can differ between replicas; DCP keeps ONE replica's copy of such a key.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from fxpipe.errors import FxpipeError


@contextlib.contextmanager
def _single_process_quiet():
    """Silence DCP's "assuming the intent is to save/load in a single process" warning when no
    process group exists (that IS the intent here)."""
    with warnings.catch_warnings():
        if not dist.is_initialized():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        yield


def step_dir(root: Path, step: int) -> Path:
    """``root/step_000123``."""
    return Path(root) / f"step_{step:06d}"


def stage_state(stages: dict[int, nn.Module]) -> dict[str, torch.Tensor]:
    """What :func:`save_checkpoint` writes for this rank: every stage module's parameters and
    persistent buffers (``module.state_dict()``; non-persistent buffers and constants excluded),
    keyed by original FQN, detached (same storage: no copy). A tensor reachable under several
    names inside one stage module is kept under its first name only, as
    ``named_parameters()`` does."""
    state: dict[str, torch.Tensor] = {}
    for module in stages.values():
        seen: set[int] = set()
        for name, t in module.state_dict(keep_vars=True).items():
            if id(t) in seen:
                continue
            seen.add(id(t))
            state.setdefault(name, t.detach())
    return state


def save_checkpoint(stages: dict[int, nn.Module], root: Path, step: int) -> Path:
    """Save this rank's stage parameters and persistent buffers (collective: every rank must
    call it; also works in one process without a process group).

    Args:
        stages: stage index -> stage module (parameters and buffers named by original FQN, as
            built by :func:`fxpipe.partitioner.split.build_stage_module`).
        root: checkpoint folder; the checkpoint goes into ``root/step_NNNNNN``.
        step: optimizer steps taken so far.

    With data parallel, replicas' BatchNorm statistics (any buffer the forward pass updates) can
    differ; the checkpoint keeps one replica's copy of each such key.

    Returns the checkpoint folder. Raises FxpipeError if that folder already holds a checkpoint.
    """
    path = step_dir(root, step)
    if (path / ".metadata").exists():
        raise FxpipeError(f"{path} already holds a checkpoint; refusing to overwrite it")
    with _single_process_quiet():
        dcp.save(stage_state(stages), checkpoint_id=str(path), no_dist=not dist.is_initialized())
    if not dist.is_initialized() or dist.get_rank() == 0:
        (Path(root) / "latest").write_text(path.name + "\n")
    return path


def load_into_model(model: nn.Module, path: str | Path) -> list[str]:
    """Load a checkpoint written by :func:`save_checkpoint` into a whole (unsplit) model, in one
    process: parameters and persistent buffers (the keys of ``model.state_dict()``). Tied
    (aliased) parameters or buffers are filled through whichever alias the checkpoint holds.

    Args:
        model: the plain model (same architecture the checkpoint was saved from).
        path: a ``step_NNNNNN`` folder, or the checkpoint root (its ``latest`` file is followed).

    Returns the loaded keys (sorted). Raises FxpipeError if the folder is not a checkpoint or a
    model parameter or persistent buffer is missing from it.
    """
    path = Path(path)
    if (path / "latest").exists():
        path = path / (path / "latest").read_text().strip()
    if not (path / ".metadata").exists():
        raise FxpipeError(f"{path} is not a checkpoint folder (no .metadata)")
    saved = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    named = model.state_dict(keep_vars=True)  # params + persistent buffers, aliases included
    by_tensor: dict[int, str] = {}
    for name, t in named.items():
        if name in saved:
            by_tensor.setdefault(id(t), name)
    missing = [n for n, t in named.items() if id(t) not in by_tensor]
    if missing:
        raise FxpipeError(f"checkpoint {path} lacks {missing[:5]} (parameters or persistent "
                          "buffers of this model); was it saved from another model, or by an "
                          "older fxpipe that saved no buffers? Re-create it with `fxpipe run`")
    state = {name: named[name].detach().clone() for name in by_tensor.values()}
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    with torch.no_grad():
        for name, t in state.items():
            named[name].copy_(t)
    return sorted(state)
