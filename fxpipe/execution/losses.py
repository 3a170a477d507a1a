"""Losses named by ``train.loss``: what the last stage's output is scored with, by the runtime
and by the profiler that prices it.

A loss takes the model output and the target of one micro-batch and returns the mean over the
targets of that micro-batch that count (integer targets other than ``train.ignore_index``; every
element of a float target). ``train.loss: model`` means the model computes it (a transformers
model given ``labels``): its output is that mean.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

#: ``train.loss`` value for a model that computes its own loss
MODEL_LOSS = "model"


def cross_entropy(output: torch.Tensor, target: torch.Tensor,
                  ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of logits ``[..., classes]`` (float) against int64 targets ``[...]``
    (language-model logits ``[B, T, V]`` with targets ``[B, T]``, or classifier ``[B, C]``/``[B]``),
    over the targets that are not ``ignore_index``."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1),
                           ignore_index=ignore_index)


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error, shapes equal."""
    return F.mse_loss(output, target)


def model_loss(output: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
    """The model's own loss: its output already is the micro-batch's mean loss."""
    return output


BUILTIN: dict[str, LossFn] = {"cross_entropy": cross_entropy, "mse": mse, MODEL_LOSS: model_loss}


def resolve_loss(name: str, ignore_index: int = -100) -> LossFn:
    """A built-in loss name (``cross_entropy``, ``mse``, ``model``) or
    ``"package.module:function"``.

    Raises:
        SpecError: the name is neither.
    """
    if name == "cross_entropy":
        return functools.partial(cross_entropy, ignore_index=ignore_index)
    if name in BUILTIN:
        return BUILTIN[name]
    from fxpipe.specs.loader import resolve_callable

    return resolve_callable(name, "train.loss")


def count_targets(target: torch.Tensor, ignore_index: int = -100) -> int:
    """How many targets count toward the mean: integer targets other than ``ignore_index``,
    every element of a float target."""
    if target.is_floating_point() or target.is_complex():
        return target.numel()
    return int((target != ignore_index).sum())
