"""Held-out evaluation of a trained run, in one process.

After ``fxpipe run``, the launcher rebuilds the spec's model (same seed, so the same initial
weights the pipeline started from), measures its loss on ``train.eval_batches`` validation
batches, loads the final checkpoint (keyed by the original parameter FQNs) into it and measures
again. The two figures go to ``eval.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from fxpipe.training.checkpoint import load_into_model


@torch.no_grad()
def validation_loss(model: torch.nn.Module, spec, batches: int) -> float:
    """Mean loss of ``model`` over the first ``batches`` validation batches of the spec's dataset
    (each the global ``data.batch_size``)."""
    from fxpipe.data.batches import get_batch, make_batches
    from fxpipe.partitioner.trace import pick_output, trace_kwargs
    from fxpipe.execution.losses import resolve_loss

    data = make_batches(spec)
    loss_fn = resolve_loss(spec.train.loss, spec.train.ignore_index)
    model.eval()
    total = 0.0
    for k in range(batches):
        b = get_batch(data, spec, k, "val")
        out = model(*b.args, **trace_kwargs(model, b.kwargs))
        total += float(loss_fn(pick_output(out, spec.loss_output, type(model).__name__), b.target))
    return total / batches


def evaluate_run(spec, out: Path) -> dict[str, float] | None:
    """Validation loss before and after training; writes ``out/eval.json``. Returns the figures,
    or None when ``train.eval_batches`` is 0."""
    from fxpipe.specs.loader import build_model

    n = spec.train.eval_batches
    if n == 0:
        return None
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model = build_model(spec)
    before = validation_loss(model, spec, n)
    load_into_model(model, out / spec.train.checkpoint.dir)
    after = validation_loss(model, spec, n)
    result = {"val_loss_initial": before, "val_loss_final": after, "eval_batches": n}
    (out / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    return result
