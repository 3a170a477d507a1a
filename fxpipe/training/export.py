"""``fxpipe export RUN_DIR OUT.pt``: a run's latest checkpoint as one plain ``state_dict``.

The model is rebuilt from the spec stored in the run's ``plan.json``, the checkpoint (validated,
see :mod:`fxpipe.training.checkpoint`) is loaded into it in one process, and
``model.state_dict()`` is written with ``torch.save``: the original ``nn.Module`` loads it with
``load_state_dict(..., strict=True)`` and needs no fxpipe.
"""

from __future__ import annotations

import os
from pathlib import Path

from fxpipe.errors import FxpipeError


def export_run(run_dir: str | Path, out_path: str | Path) -> tuple[Path, int, int]:
    """Write the latest checkpoint of the run in ``run_dir`` to ``out_path``.

    Returns ``(out_path, tensors, step)``.

    Raises:
        FxpipeError: no plan.json or checkpoint in ``run_dir``, a damaged checkpoint, or
            ``out_path`` cannot be written.
    """
    import torch

    from fxpipe.plans.plan import Plan
    from fxpipe.specs.loader import build_model, load_spec
    from fxpipe.training.checkpoint import load_into_model, open_checkpoint

    run_dir, out_path = Path(run_dir), Path(out_path)
    plan_path = run_dir / "plan.json"
    if not plan_path.is_file():
        raise FxpipeError(f"{run_dir} holds no plan.json: give the folder of a `fxpipe run`")
    plan = Plan.read(plan_path)
    spec = load_spec(plan.spec)
    folder, manifest = open_checkpoint(run_dir / spec.train.checkpoint.dir)
    model = build_model(spec, load_weights=False)
    load_into_model(model, folder)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if out_path.is_dir():
        raise FxpipeError(f"{out_path} is a folder; give a file name, e.g. model.pt")
    tmp = out_path.with_name(f".{out_path.name}.{os.getpid()}.tmp")
    try:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, tmp)
        os.replace(tmp, out_path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise FxpipeError(f"cannot write {out_path}: {e.strerror or e}") from None
    return out_path, len(state), manifest["step"]
