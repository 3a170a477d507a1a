"""Checkpoints with torch.distributed.checkpoint (DCP), keyed by the ORIGINAL parameter FQNs.

Every rank saves the parameters of its stages; keys held by several ranks (data-parallel replicas,
tied weights on two stages) are written once by DCP's de-duplicating planner. A checkpoint taken
from a pipelined run therefore loads straight into the plain single-process model
(:func:`load_into_model`). Each save goes into its own ``step_NNNNNN`` folder and an existing
checkpoint is never overwritten.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from fxpipe.errors import FxpipeError


def step_dir(root: Path, step: int) -> Path:
    """``root/step_000123``."""
    return Path(root) / f"step_{step:06d}"


def save_checkpoint(stages: dict[int, nn.Module], root: Path, step: int) -> Path:
    """Save this rank's stage parameters (collective: every rank must call it).

    Args:
        stages: stage index -> stage module (parameters named by original FQN).
        root: checkpoint folder; the checkpoint goes into ``root/step_NNNNNN``.
        step: optimizer steps taken so far.

    Returns the checkpoint folder. Raises FxpipeError if that folder already holds a checkpoint.
    """
    path = step_dir(root, step)
    if (path / ".metadata").exists():
        raise FxpipeError(f"{path} already holds a checkpoint; refusing to overwrite it")
    state = {}
    for module in stages.values():
        for name, p in module.named_parameters():
            state[name] = p.detach()
    dcp.save(state, checkpoint_id=str(path))
    if not dist.is_initialized() or dist.get_rank() == 0:
        (Path(root) / "latest").write_text(path.name + "\n")
    return path


def load_into_model(model: nn.Module, path: str | Path) -> list[str]:
    """Load a checkpoint written by :func:`save_checkpoint` into a whole (unsplit) model, in one
    process. Tied parameters are filled through whichever alias the checkpoint holds.

    Returns the loaded keys. Raises FxpipeError if the folder is not a checkpoint or a model
    parameter is missing from it.
    """
    path = Path(path)
    if (path / "latest").exists():
        path = path / (path / "latest").read_text().strip()
    if not (path / ".metadata").exists():
        raise FxpipeError(f"{path} is not a checkpoint folder (no .metadata)")
    saved = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    named = dict(model.named_parameters(remove_duplicate=False))
    by_tensor: dict[int, str] = {}
    for name, p in named.items():
        if name in saved:
            by_tensor.setdefault(id(p), name)
    missing = [n for n, p in named.items() if id(p) not in by_tensor]
    if missing:
        raise FxpipeError(f"checkpoint {path} lacks parameters {missing[:5]}; was it saved from "
                          "another model?")
    state = {name: named[name].detach().clone() for name in by_tensor.values()}
    dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    with torch.no_grad():
        for name, t in state.items():
            named[name].copy_(t)
    return sorted(state)
