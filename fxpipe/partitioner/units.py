"""What the trace pass traces: the model as a worker on the spec's device traces it (itself,
or a fake copy), inputs resized to a micro-batch size."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor

from fxpipe.partitioner.trace import fake_on_device


def resize(t: Any, size: int) -> Any:
    """A tensor with dim 0 resized to ``size`` (repeating or slicing); other values as they are."""
    if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] == size:
        return t
    if t.shape[0] > size:
        return t[:size]
    reps = -(-size // t.shape[0])
    return t.repeat(reps, *([1] * (t.dim() - 1)))[:size]

def is_fake(model: nn.Module) -> bool:
    return any(isinstance(t, FakeTensor) for t in [*model.parameters(), *model.buffers()])

def _model_device(model: nn.Module) -> str:
    for t in [*model.parameters(), *model.buffers()]:
        return t.device.type
    return "cpu"

def tracing_model(model: nn.Module, args: tuple, kwargs: dict, device: str
                  ) -> tuple[nn.Module, tuple, dict, str]:
    """What to trace so that the graph is the one a worker on ``device`` traces: the model
    itself when it already lives there, else a fake copy on ``device`` (:func:`fake_on_device`;
    a meta model costs no memory), or on meta when ``device`` is CUDA and this machine has none
    (the workers then check the graph and explain a difference). Returns the model, inputs and
    the device type traced on."""
    here = _model_device(model)
    if device == "cuda" and not torch.cuda.is_available():
        if here == "cuda":  # pragma: no cover - a CUDA model without CUDA cannot exist
            return model, args, kwargs, here
        meta = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        fake, fargs, fkw = fake_on_device(model, tuple(a.to("meta") for a in args), meta, "meta")
        return fake, fargs, fkw, "meta"
    if here == device:
        return model, tuple(a.to(device) for a in args), {
            k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}, device
    fake, fargs, fkw = fake_on_device(model, args, kwargs, device)
    return fake, fargs, fkw, device

def warn_again(caught: list) -> None:
    """Issue again the warnings that ``warnings.catch_warnings(record=True)`` held back."""
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
