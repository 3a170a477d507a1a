"""What the loss costs the last stage: ``train.loss`` run on the model's output, forward and backward.

The executor runs the loss (a built-in ``cross_entropy`` or ``mse``, or a
``"package.module:function"``) on the last stage, after the model's last node, once per
micro-batch; it is not a node of the traced graph, so the planner adds its time to the node that
produces the model output (every solver and the simulator then see it on the last stage).
``train.loss: model`` (the model computes its loss inside the graph) adds nothing.

Two sources, as for the nodes (``cluster.costs``):

* ``analytic``: a roofline of the bytes the loss moves, in multiples of the output's bytes
  (:data:`LOSS_TRAFFIC`: cross entropy's log-softmax reads the logits and writes the
  log-probabilities, its backward reads them and writes the logits' gradient, about 4x; mean
  squared error reads output and target, and its backward both again and writes the gradient),
  over ``cluster.memory_Bps``, plus a launch per op. A custom loss is priced as reading the
  output and writing its gradient.
* ``measured``: the loss itself timed on ``cluster.device`` (:func:`~fxpipe.partitioner.profile.
  profile_loss`) on a random tensor of the output's shape and dtype, with random class indices
  in range (cross entropy), a random tensor of the output's shape (mse) or the example batch's
  target (a custom loss); cached next to the node profile, keyed by the loss name and shapes.

Times are :class:`~fxpipe.partitioner.timing.NodeTimes`: the loss's forward as ``fwd_s`` and its
backward (the gradient of the output, on the input-gradient path) as ``bwd_input_s``.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Callable

import torch

from fxpipe.errors import PlanError
from fxpipe.execution.losses import MODEL_LOSS, resolve_loss
from fxpipe.partitioner.profile import (load_loss_profile, loss_key, profile_key, profile_loss,
                                        save_loss_profile)
from fxpipe.partitioner.timing import NodeTimes, roofline
from fxpipe.partitioner.trace import TracedModel

__all__ = ["LOSS_TRAFFIC", "loss_node", "output_bytes", "analytic_loss_times", "measured_loss_times",
           "with_loss"]

_log = logging.getLogger("fxpipe.progress")

#: bytes moved by a built-in loss, in multiples of the output's bytes, and its op launches:
#: ``(forward bytes, backward bytes, forward ops, backward ops)``
LOSS_TRAFFIC: dict[str, tuple[float, float, int, int]] = {
    "cross_entropy": (2.0, 2.0, 2, 2),  # log_softmax + nll_loss, and their backwards
    "mse": (2.0, 3.0, 1, 1),
}
#: a custom loss: reads the output, writes its gradient
CUSTOM_TRAFFIC = (1.0, 1.0, 1, 1)


def loss_node(traced: TracedModel, priced: dict) -> str | None:
    """The priced node that produces the model output the loss reads (the last priced node
    when the output is not priced itself), or None when nothing is priced."""
    out = traced.output_names[0] if traced.output_names else None
    if out in priced:
        return out
    return next(reversed(priced), None) if priced else None


def _output_meta(traced: TracedModel) -> torch.Tensor | None:
    if not traced.output_names:
        return None
    v = traced.node(traced.output_names[0]).meta.get("val")
    return v if isinstance(v, torch.Tensor) else None


def output_bytes(traced: TracedModel) -> float:
    """Bytes of the model output the loss reads (one micro-batch), 0 when unknown."""
    v = _output_meta(traced)
    return float(v.numel() * v.element_size()) if v is not None else 0.0


def analytic_loss_times(loss: str, out_bytes: float, bytes_per_s: float,
                        op_overhead_s: float = 0.0) -> NodeTimes:
    """Roofline seconds of ``loss`` on an output of ``out_bytes`` bytes (see the module doc);
    zero for ``model``."""
    if loss == MODEL_LOSS:
        return NodeTimes()
    fb, bb, fo, bo = LOSS_TRAFFIC.get(loss, CUSTOM_TRAFFIC)
    return NodeTimes(fo * op_overhead_s + roofline(0.0, fb * out_bytes, 1.0, bytes_per_s),
                     bo * op_overhead_s + roofline(0.0, bb * out_bytes, 1.0, bytes_per_s), 0.0)


def _inputs(loss: str, meta: torch.Tensor, device: torch.device,
            target: Callable[[], torch.Tensor | None] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A random output like ``meta`` and a target for it (see the module doc)."""
    g = torch.Generator().manual_seed(0)
    shape, dtype = tuple(meta.shape), meta.dtype
    if dtype.is_floating_point or dtype.is_complex:
        out = torch.randn(shape, generator=g).to(dtype)
    else:
        out = torch.zeros(shape, dtype=dtype)
    if loss == "cross_entropy":
        classes = max(1, shape[-1] if shape else 1)
        y = torch.randint(0, classes, shape[:-1], generator=g)
    elif loss == "mse":
        y = torch.randn(shape, generator=g).to(dtype)
    else:
        y = target() if target is not None else None
        if not isinstance(y, torch.Tensor):
            y = torch.randn(shape, generator=g).to(dtype)
    return out.to(device), y.to(device)


def measured_loss_times(traced: TracedModel, loss: str, device: str, *, ignore_index: int = -100,
                        target: Callable[[], torch.Tensor | None] | None = None,
                        warmup: int = 3, repeats: int = 15, precision: str = "fp32") -> NodeTimes:
    """``loss`` timed on ``device`` on an output like ``traced``'s (cached; see the module doc).

    Args:
        target: a custom loss's target (the example batch's), called only when it is measured.
        precision: ``train.precision`` (bf16 / fp16: timed under autocast, as the last stage
            runs the loss).
    """
    meta = _output_meta(traced)
    if loss == MODEL_LOSS or meta is None:
        return NodeTimes()
    dev = torch.device(device)
    out, y = _inputs(loss, meta, dev, target)
    fn = resolve_loss(loss, ignore_index)
    key = loss_key(profile_key(traced, device, precision), f"{loss}#{_code_fingerprint(fn)}", out, y)
    times = load_loss_profile(key)
    if times is None:
        _log.info("profiling the loss %s (cluster.costs: measured)", loss)
        try:
            times = profile_loss(fn, out, y, dev, warmup=warmup, repeats=repeats,
                                 precision=precision)
        except Exception as e:  # noqa: BLE001 - the user's loss, any failure
            raise PlanError(
                f"train.loss {loss!r} cannot take the model output {tuple(out.shape)} "
                f"{str(out.dtype).replace('torch.', '')} and the target {tuple(y.shape)} "
                f"{str(y.dtype).replace('torch.', '')}: {type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}; pick a loss that fits the model "
                "(built in: cross_entropy, mse), fix the dataset's targets or set model.output "
                "to the output the loss reads") from None
        save_loss_profile(key, times, {"model": traced.model_name, "device": device,
                                       "loss": loss, "output": list(out.shape),
                                       "target": list(y.shape)})
    return times


def _code_fingerprint(fn) -> str:
    """A short hash of a loss function's code (a changed custom loss is measured again)."""
    f = getattr(fn, "func", fn)  # functools.partial
    code = getattr(f, "__code__", None)
    h = hashlib.sha256()
    if code is not None:
        h.update(code.co_code)
        h.update(repr(code.co_consts).encode())
        h.update(repr(getattr(fn, "keywords", None)).encode())
    else:
        h.update(repr(f).encode())
    return h.hexdigest()[:12]


def with_loss(times: dict[str, NodeTimes], node: str | None, loss: NodeTimes
              ) -> dict[str, NodeTimes]:
    """``times`` with ``loss`` added to ``node``'s (a copy; ``times`` itself is unchanged)."""
    if node is None or loss.total_s <= 0:
        return times
    t = times.get(node, NodeTimes())
    out = dict(times)
    out[node] = NodeTimes(t.fwd_s + loss.fwd_s, t.bwd_input_s + loss.bwd_input_s,
                          t.bwd_weight_s + loss.bwd_weight_s)
    return out
