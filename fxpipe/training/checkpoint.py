"""Checkpoints with torch.distributed.checkpoint (DCP), keyed by the ORIGINAL FQNs, atomic,
validated before anything is unpickled, resumable exactly and under another plan.

A checkpoint is the folder ``ROOT/step_NNNNNN`` holding:

* the DCP shards and ``.metadata`` of one state dict: every rank's parameters and persistent
  buffers under their original names (what ``model.state_dict()`` of the unsplit model holds),
  the optimizer state flattened per parameter name (``optim.state.<fqn>.exp_avg``, ...: it
  follows its parameter to whichever rank holds it under another plan), and each rank's RNG
  state (``rng.rank<r>.torch``);
* ``train_state.json``: the step, the data position (``data_position``: global batches read,
  so a resumed run reads the next one, whatever its pipeline, data degree or accumulation),
  the learning-rate schedule's and the loss scaler's state;
* ``manifest.json``, written last: the format, the step, every key's shape and dtype, and the
  size and SHA-256 of every file.

Saving is atomic: the ranks write into ``ROOT/.step_NNNNNN.partial``; once all are done, rank 0
writes the manifest, renames the folder and then points ``ROOT/latest`` at it (written to a
temporary name and renamed). A crash mid-save leaves the previous checkpoint as ``latest``; the
partial folder is removed, with a message, by the next save or resume.

Loading (:func:`open_checkpoint`) trusts nothing before checking it: ``latest`` must name a
``step_NNNNNN`` folder inside the root, the manifest must parse and every file must have its
recorded size and hash (a truncated, corrupted or missing shard is an error naming it), and the
model's parameters must match the manifest's shapes (a checkpoint of another model is refused).
Only then is DCP's ``.metadata`` read, which is a pickle: checkpoints are code, load only those
you trust (see README, Security).

Data parallel and buffers: replicas hold identical parameters, but buffers updated in the
forward pass (BatchNorm running statistics) are not synchronised; DCP keeps one replica's copy.

Tensor parallelism (``tensor=``, a :class:`~fxpipe.runtime.tensor_parallel.TensorShards`): a
sharded parameter and its optimizer state are saved whole (gathered over the tensor group; the
group's ranks write the same key, which DCP saves once) and loaded by slicing this rank's part,
so a checkpoint holds the plain model's tensors and resumes under any tensor, pipeline or data
degree.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from fxpipe.errors import FxpipeError, first_line

__all__ = ["CHECKPOINT_FORMAT", "step_dir", "stage_state", "save_checkpoint", "open_checkpoint",
           "load_checkpoint", "load_into_model", "latest_checkpoint", "clean_partial"]

CHECKPOINT_FORMAT = 1
MANIFEST = "manifest.json"
TRAIN_STATE = "train_state.json"
_STEP_NAME = re.compile(r"^step_\d{6}$")
_PARTIAL = re.compile(r"^\.step_\d{6}\.partial$")
_OPT = "optim."
_RNG = "rng."


@contextlib.contextmanager
def _single_process_quiet():
    """Silence DCP's "assuming the intent is to save/load in a single process" warning when no
    process group exists (that IS the intent here)."""
    with warnings.catch_warnings():
        if not dist.is_initialized():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        yield


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def step_dir(root: Path, step: int) -> Path:
    """``root/step_000123``."""
    return Path(root) / f"step_{step:06d}"


def _modules(stages: nn.Module | dict[int, nn.Module]) -> list[nn.Module]:
    return list(stages.values()) if isinstance(stages, dict) else [stages]


def stage_state(stages: nn.Module | dict[int, nn.Module]) -> dict[str, torch.Tensor]:
    """This rank's parameters and persistent buffers (``module.state_dict()`` of every stage
    module; non-persistent buffers and constants excluded), keyed by original FQN, detached
    (same storage: no copy). A tensor reachable under several names inside one module is kept
    under its first name only, as ``named_parameters()`` does."""
    state: dict[str, torch.Tensor] = {}
    for module in _modules(stages):
        seen: set[int] = set()
        for name, t in module.state_dict(keep_vars=True).items():
            if id(t) in seen:
                continue
            seen.add(id(t))
            state.setdefault(name, t.detach())
    return state


def _optimizer_state(module: nn.Module, optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    if hasattr(optimizer, "whole_state"):  # sharded data parallelism: gathered (collective)
        return {_OPT + k: v for k, v in optimizer.whole_state(init=True).items()}
    flat = get_optimizer_state_dict(module, optimizer,
                                    options=StateDictOptions(flatten_optimizer_state_dict=True))
    return {_OPT + k: v for k, v in flat.items()}


def _rng_state() -> dict[str, torch.Tensor]:
    r = _rank()
    out = {f"{_RNG}rank{r}.torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out[f"{_RNG}rank{r}.cuda"] = torch.cuda.get_rng_state()
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _gather_keys(state: dict[str, Any]) -> dict[str, list]:
    mine = {k: ([list(v.shape), str(v.dtype).removeprefix("torch.")]
                if isinstance(v, torch.Tensor) else [None, type(v).__name__])
            for k, v in state.items()}
    if not dist.is_initialized():
        return mine
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    out: dict[str, list] = {}
    for d in every:
        out.update(d)
    return out


def clean_partial(root: Path) -> list[Path]:
    """Remove folders of saves that did not finish (``.step_NNNNNN.partial``); returns them."""
    root = Path(root)
    gone = []
    if root.is_dir():
        for p in sorted(root.iterdir()):
            if _PARTIAL.match(p.name) and p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
                gone.append(p)
    return gone


def save_checkpoint(stages: nn.Module | dict[int, nn.Module], root: Path, step: int, *,
                    optimizer: Any = None, train_state: dict[str, Any] | None = None,
                    tensor: Any = None) -> Path:
    """Save this rank's share atomically (collective: every rank calls it; also works in one
    process without a process group).

    Args:
        stages: this rank's stage modules (stage index -> module) or one module holding them
            (``CompiledPipeline.module``), parameters and buffers named by original FQN.
        root: checkpoint folder; the checkpoint becomes ``root/step_NNNNNN``.
        step: optimizer steps taken so far.
        optimizer: the optimizer over those parameters (saved per parameter name), or None.
        train_state: JSON-able state to resume with (rank 0's is written): the learning-rate
            schedule's, the loss scaler's...
        tensor: this rank's :class:`~fxpipe.runtime.tensor_parallel.TensorShards` under tensor
            parallelism: sharded tensors are saved whole (see the module doc); by default the
            shards ``fxpipe.compile``'s ``pipe.module`` carries.

    Returns the checkpoint folder.

    Raises:
        FxpipeError: that step already holds a checkpoint (never overwritten), or the folder
            cannot be written.
    """
    root = Path(root)
    final, partial = step_dir(root, step), root / f".step_{step:06d}.partial"
    if (final / MANIFEST).exists():
        raise FxpipeError(f"{final} already holds a checkpoint; refusing to overwrite it")
    if _rank() == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            for stale in clean_partial(root):
                print(f"fxpipe: removed {stale.name} in {root} (a save that did not finish)",
                      flush=True)
            partial.mkdir()
        except OSError as e:
            raise FxpipeError(f"cannot write the checkpoint folder {root}: {e.strerror or e}; "
                              "make it writable or choose train.checkpoint.dir") from None
    _barrier()
    tensor = _shards_of(stages, tensor)
    sharding = getattr(optimizer, "sharding", None)  # sharded data parallelism
    if sharding is not None:  # ``full`` holds slices between steps: whole ones to save
        sharding.ensure_gathered(optimizer.timeout_s)
    state: dict[str, Any] = dict(stage_state(stages))
    if optimizer is not None:
        module = stages if isinstance(stages, nn.Module) else _merged(stages)
        state.update(_optimizer_state(module, optimizer))
    if tensor is not None:
        state = tensor.whole_state(state)
    state.update(_rng_state())
    keys = _gather_keys(state)
    try:
        with _single_process_quiet():
            dcp.save(state, checkpoint_id=str(partial), no_dist=not dist.is_initialized())
    except Exception as e:  # a full disk, a rank that died mid-save (DCP's CheckpointException)
        raise FxpipeError(f"saving the checkpoint of step {step} in {root} failed: "
                          f"{first_line(e)}; the previous checkpoint stays the latest, the "
                          "unfinished folder is removed by the next save") from None
    _barrier()
    # every rank hashes the shards it wrote (on its own node's file system), rank 0 the rest
    rank = _rank()
    mine = {p.name: [p.stat().st_size, _sha256(p)] for p in sorted(partial.iterdir())
            if p.is_file() and (p.name.startswith(f"__{rank}_") or
                                (rank == 0 and not re.match(r"^__\d+_", p.name)))}
    if rank == 0:
        (partial / TRAIN_STATE).write_text(json.dumps({"step": step, **(train_state or {})}))
        mine[TRAIN_STATE] = [(partial / TRAIN_STATE).stat().st_size,
                             _sha256(partial / TRAIN_STATE)]
    files: dict[str, list] = dict(mine)
    if dist.is_initialized():
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        for d in every:
            files.update(d)
    manifest = {"format": CHECKPOINT_FORMAT, "writer": "fxpipe", "step": step, "keys": keys,
                "files": dict(sorted(files.items())),
                "world_size": dist.get_world_size() if dist.is_initialized() else 1}
    if rank == 0:
        _finish(partial, final, root, manifest)
    _barrier()
    # a node whose file system is not rank 0's (per-node folders) finishes its own folder: its
    # shards and the manifest of the whole; copy the shards into node 0's folder to load it
    if rank != 0 and int(os.environ.get("LOCAL_RANK", "-1")) == 0 \
            and not (final / MANIFEST).exists() and partial.is_dir():
        _finish(partial, final, root, manifest)
    _barrier()
    return final


def _finish(partial: Path, final: Path, root: Path, manifest: dict) -> None:
    """Write the manifest, rename the folder into place and point ``latest`` at it (written to a
    temporary name and renamed)."""
    (partial / MANIFEST).write_text(json.dumps(manifest))
    os.replace(partial, final)
    tmp = root / f".latest.{os.getpid()}.tmp"
    tmp.write_text(final.name + "\n")
    os.replace(tmp, root / "latest")


def _merged(stages: dict[int, nn.Module]) -> nn.Module:
    """One module holding the tensors of several stage modules under their names."""
    holder = nn.Module()
    for module in stages.values():
        for name, p in module.named_parameters():
            _put(holder, name, p, param=True)
    return holder


def _put(root: nn.Module, path: str, t: torch.Tensor, param: bool) -> None:
    *parents, leaf = path.split(".")
    mod = root
    for part in parents:
        if not hasattr(mod, part):
            mod.add_module(part, nn.Module())
        mod = getattr(mod, part)
    if param and isinstance(t, nn.Parameter):
        mod.register_parameter(leaf, t)
    else:
        mod.register_buffer(leaf, t)


def latest_checkpoint(root: Path) -> Path | None:
    """The folder ``root/latest`` names, checked: a ``step_NNNNNN`` folder inside ``root``, or
    None when there is no ``latest``.

    Raises:
        FxpipeError: ``latest`` names anything else.
    """
    root = Path(root)
    pointer = root / "latest"
    if not pointer.exists():
        return None
    try:
        name = pointer.read_text(errors="replace").strip()
    except OSError as e:
        raise FxpipeError(f"cannot read {pointer}: {e.strerror or e}") from None
    if not _STEP_NAME.match(name) or not (root / name).is_dir():
        raise FxpipeError(f"{pointer} names {name[:80]!r}, which is not a step_NNNNNN "
                          f"checkpoint folder in {root}; point it at one or remove it")
    return root / name


def open_checkpoint(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """Find and validate a checkpoint before anything is unpickled.

    Args:
        path: a ``step_NNNNNN`` folder, or the checkpoint root (its ``latest`` is followed).

    Returns ``(folder, manifest)``.

    Raises:
        FxpipeError: not a checkpoint fxpipe wrote (no or malformed manifest), or a file is
            missing, truncated or changed since it was written.
    """
    path = Path(path)
    if not _STEP_NAME.match(path.name):
        found = latest_checkpoint(path)
        if found is None:
            partial = [p.name for p in path.glob(".step_*.partial")] if path.is_dir() else []
            extra = (f" (only {partial[0]}, a save that did not finish)" if partial else "")
            raise FxpipeError(f"{path} holds no checkpoint{extra}: no 'latest' and not a "
                              "step_NNNNNN folder; give the run's checkpoint folder")
        path = found
    if path.is_symlink() or (path / MANIFEST).is_symlink():
        raise FxpipeError(f"{path} is a symbolic link; a checkpoint is loaded only from the "
                          "folders fxpipe wrote inside the run, never through links")
    try:
        text = (path / MANIFEST).read_text()
        if len(text) > 64 << 20:
            raise ValueError("too large")
        manifest = json.loads(text)
    except FileNotFoundError:
        raise FxpipeError(f"{path} is not a checkpoint fxpipe wrote (no {MANIFEST}); refusing "
                          "to load it: DCP checkpoints hold pickled metadata, which runs code"
                          ) from None
    except (OSError, ValueError, RecursionError) as e:
        raise FxpipeError(f"{path / MANIFEST} is not a valid manifest ({e}); the checkpoint is "
                          "damaged") from None
    if not (isinstance(manifest, dict) and manifest.get("writer") == "fxpipe"
            and manifest.get("format") == CHECKPOINT_FORMAT
            and isinstance(manifest.get("files"), dict) and isinstance(manifest.get("keys"), dict)
            and isinstance(manifest.get("step"), int)):
        raise FxpipeError(f"{path / MANIFEST} is not an fxpipe checkpoint manifest of format "
                          f"{CHECKPOINT_FORMAT}; re-create the checkpoint with `fxpipe run`")
    present = {p.name for p in path.iterdir() if p.is_file()} - {MANIFEST}
    for name, entry in manifest["files"].items():
        f = path / name
        if "/" in name or name.startswith(".."):
            raise FxpipeError(f"{path / MANIFEST} lists a file outside the checkpoint: {name!r}")
        if f.is_symlink():
            raise FxpipeError(f"checkpoint {path}: {name} is a symbolic link; a checkpoint's "
                              "files must be the ones fxpipe wrote there, never links")
        if not f.is_file():
            raise FxpipeError(f"checkpoint {path} lacks {name} (a shard is missing); it cannot "
                              "be loaded: resume from an earlier checkpoint")
        size, digest = entry
        if f.stat().st_size != size or _sha256(f) != digest:
            raise FxpipeError(f"checkpoint {path}: {name} is truncated or changed since it was "
                              f"written ({f.stat().st_size} bytes, {size} written); resume from "
                              "an earlier checkpoint")
    extra = sorted(present - set(manifest["files"]))
    if extra:
        raise FxpipeError(f"checkpoint {path} holds files its manifest does not list: {extra[:3]}"
                          "; refusing to load it")
    return path, manifest


def _saved_model_keys(manifest: dict[str, Any]) -> list[str]:
    """The model's keys (parameters and persistent buffers) a checkpoint holds."""
    return sorted(k for k in manifest["keys"] if not k.startswith((_OPT, _RNG)))


def _check_no_other_model(path: Path, manifest: dict[str, Any], held: set[str],
                          missing_here: bool = False, collective: bool = True) -> None:
    """Every model key of the checkpoint belongs to the model (on some rank: collective when a
    process group exists, one tensor all-reduce, so every rank raises alike); a checkpoint of a
    bigger model (more layers) is refused instead of loading its common part silently."""
    saved = _saved_model_keys(manifest)
    flags = torch.tensor([k in held for k in saved] + [missing_here], dtype=torch.int32)
    if collective and dist.is_available() and dist.is_initialized():
        if dist.get_backend() == "nccl":
            flags = flags.cuda()
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    flags = flags.cpu().tolist()
    extra = [k for k, h in zip(saved, flags[:-1]) if not h]
    if extra and not flags[-1]:
        raise FxpipeError(f"checkpoint {path} holds {len(extra)} parameters or buffers this "
                          f"model does not have ({', '.join(extra[:4])}"
                          f"{', ...' if len(extra) > 4 else ''}); it was saved from another "
                          "model (another model.factory or model.args): resume with the spec "
                          "it was saved under")


def _check_model(path: Path, manifest: dict[str, Any], state: dict[str, torch.Tensor]) -> None:
    keys = manifest["keys"]
    missing = [k for k in state if k not in keys]
    if missing:
        raise FxpipeError(f"checkpoint {path} lacks {missing[:5]} (parameters or persistent "
                          "buffers of this model); was it saved from another model? Re-create "
                          "it with `fxpipe run`")
    wrong = [f"{k} {keys[k][0]} vs {list(t.shape)}" for k, t in state.items()
             if list(t.shape) != keys[k][0]]
    if wrong:
        raise FxpipeError(f"checkpoint {path} was saved from another model: shapes differ "
                          f"({'; '.join(wrong[:3])})")


def _dcp_load(state: dict[str, Any], path: Path) -> None:
    try:
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    except Exception as e:  # the files passed their hashes; anything left is a bad checkpoint
        raise FxpipeError(f"cannot load checkpoint {path}: {first_line(e)}") from None


def load_checkpoint(stages: nn.Module | dict[int, nn.Module], path: str | Path, *,
                    optimizer: Any = None, rng: bool = True, tensor: Any = None
                    ) -> dict[str, Any]:
    """Load a checkpoint into this rank's modules (any plan: keys are parameter names) and
    optimizer, and restore this rank's RNG state when the checkpoint has it (the same rank of a
    run of the same size). Collective when a process group exists.

    ``tensor``: this rank's :class:`~fxpipe.runtime.tensor_parallel.TensorShards` under tensor
    parallelism (each sharded tensor is read whole and this rank's part kept).

    Returns the training state saved with it (``step`` and what the run stored).

    Raises:
        FxpipeError: see :func:`open_checkpoint`; the model or optimizer does not match.
    """
    folder, manifest = open_checkpoint(path)
    tensor = _shards_of(stages, tensor)
    sharding = getattr(optimizer, "sharding", None)  # sharded data parallelism
    if sharding is not None:
        sharding.ensure_gathered(optimizer.timeout_s)
    local = stage_state(stages)
    model_state = {k: _whole_like(tensor, k, v) for k, v in local.items()}
    _check_no_other_model(folder, manifest, set(model_state),
                          missing_here=any(k not in manifest["keys"] for k in model_state))
    _check_model(folder, manifest, model_state)
    state: dict[str, Any] = dict(model_state)
    module = stages if isinstance(stages, nn.Module) else _merged(stages)
    if optimizer is not None:
        opt = _optimizer_state(module, optimizer)
        missing = [k for k in opt if k not in manifest["keys"]]
        if missing:
            raise FxpipeError(f"checkpoint {folder} holds no optimizer state for {missing[:3]}; "
                              "was it saved with another optimizer?")
        state.update({k: _whole_like(tensor, k, v) for k, v in opt.items()
                      if k in manifest["keys"]})
    mine = {k: v for k, v in _rng_state().items() if k in manifest["keys"]} if rng else {}
    state.update({k: v.clone() for k, v in mine.items()})
    _dcp_load(state, folder)
    with torch.no_grad():
        for k, t in model_state.items():
            local[k].copy_(_local_of(tensor, k, state[k], local[k]))
    if sharding is not None:
        sharding.refresh_master()
    if optimizer is not None and hasattr(optimizer, "load_whole_state"):
        optimizer.load_whole_state({k[len(_OPT):]: _local_of(tensor, k, v, opt[k])
                                    for k, v in state.items() if k.startswith(_OPT)})
    elif optimizer is not None:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             set_optimizer_state_dict)

        set_optimizer_state_dict(module, optimizer,
                                 {k[len(_OPT):]: _local_of(tensor, k, v, opt[k])
                                  for k, v in state.items() if k.startswith(_OPT)},
                                 options=StateDictOptions(flatten_optimizer_state_dict=True))
    for k in mine:
        (torch.set_rng_state if k.endswith(".torch") else torch.cuda.set_rng_state)(state[k])
    try:
        return json.loads((folder / TRAIN_STATE).read_text())
    except (OSError, ValueError):
        return {"step": manifest["step"]}


def _shards_of(stages: Any, tensor: Any) -> Any:
    """The tensor-parallel shards' bookkeeping: ``tensor`` when given, else what
    ``fxpipe.compile``'s module carries (``pipe.module.fxpipe_tensor_shards``), so that
    ``save_checkpoint(pipe.module, ...)`` saves whole tensors without being told."""
    if tensor is not None:
        return tensor
    return getattr(stages, "fxpipe_tensor_shards", None) if isinstance(stages, nn.Module) else None


def _whole_like(tensor: Any, key: str, local: Any) -> Any:
    """A buffer to read ``key`` into: the whole tensor's shape under tensor parallelism."""
    if not isinstance(local, torch.Tensor):
        return local
    if tensor is None:
        return local.detach().clone()
    return torch.empty(tensor.whole_shape(key, local), dtype=local.dtype, device=local.device)


def _local_of(tensor: Any, key: str, whole: Any, local: Any) -> Any:
    """This rank's part of a tensor read whole (itself without tensor parallelism)."""
    if tensor is None or not isinstance(whole, torch.Tensor):
        return whole
    return tensor.local(key, whole, local)


def load_into_model(model: nn.Module, path: str | Path) -> list[str]:
    """Load a checkpoint written by :func:`save_checkpoint` into a whole (unsplit) model, in one
    process: parameters and persistent buffers (the keys of ``model.state_dict()``). Tied
    (aliased) parameters or buffers are filled through whichever alias the checkpoint holds.

    Args:
        model: the plain model (same architecture the checkpoint was saved from).
        path: a ``step_NNNNNN`` folder, or the checkpoint root (its ``latest`` is followed).

    Returns the loaded keys (sorted).

    Raises:
        FxpipeError: not a checkpoint fxpipe wrote, damaged (see :func:`open_checkpoint`), or
            saved from another model (a parameter or persistent buffer missing or of another
            shape).
    """
    folder, manifest = open_checkpoint(path)
    saved = manifest["keys"]
    named = model.state_dict(keep_vars=True)  # params + persistent buffers, aliases included
    by_tensor: dict[int, str] = {}
    for name, t in named.items():
        if name in saved:
            by_tensor.setdefault(id(t), name)
    missing = [n for n, t in named.items() if id(t) not in by_tensor]
    if missing:
        raise FxpipeError(f"checkpoint {folder} lacks {missing[:5]} (parameters or persistent "
                          "buffers of this model); was it saved from another model? Re-create "
                          "it with `fxpipe run`")
    state = {name: named[name].detach().clone() for name in by_tensor.values()}
    _check_model(folder, manifest, state)
    _check_no_other_model(folder, manifest, set(named), collective=False)
    _dcp_load(state, folder)
    with torch.no_grad():
        for name, t in state.items():
            named[name].copy_(t)
    return sorted(state)
