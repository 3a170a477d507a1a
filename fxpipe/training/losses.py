"""Loss functions named by ``train.loss`` in a spec.

A loss takes the model output and the target for one micro-batch and returns a scalar (the mean
over the micro-batch), so the pipeline's micro-batch mean equals the full-batch mean.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of logits ``[..., classes]`` (float) against int64 targets ``[...]``
    (language-model logits ``[B, T, V]`` with targets ``[B, T]``, or classifier ``[B, C]``/``[B]``)."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error, shapes equal."""
    return F.mse_loss(output, target)


BUILTIN: dict[str, LossFn] = {"cross_entropy": cross_entropy, "mse": mse}


def resolve_loss(name: str) -> LossFn:
    """A built-in loss name (``cross_entropy``, ``mse``) or ``"package.module:function"``.

    Raises:
        SpecError: the name is neither.
    """
    if name in BUILTIN:
        return BUILTIN[name]
    from fxpipe.specs.loader import resolve_callable

    return resolve_callable(name, "train.loss")
