"""Losses named by ``train.loss``, and the weights that make a pipeline's loss the batch's mean.

A loss takes the model output and the target of one micro-batch and returns the mean over the
targets of that micro-batch that count (integer targets other than ``train.ignore_index``; every
element of a float target). ``train.loss: model`` means the model computes it (a transformers
model given ``labels``): its output is that mean.

Micro-batches hold different numbers of counted targets once padding or masking is involved
(``-100`` labels), so averaging the micro-batch means would not be the whole batch's mean.
:func:`microbatch_weights` gives each micro-batch its share ``n_i / N`` of the counted targets of
the whole global batch (all replicas), so that the weighted sum equals single-process training
on the whole batch exactly, for the built-in losses and for the model's own.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F

from fxpipe.data.batches import Batch
from fxpipe.partitioner.loss_targets import TargetCounter

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


def batch_counter(model_inputs: list[str], input_kwargs: list[str], ignore_index: int,
                  own_loss: TargetCounter | None, model_loss_mode: bool
                  ) -> Callable[[Batch], int]:
    """Counted targets of a :class:`~fxpipe.data.batches.Batch` (one micro-batch): its target's
    (:func:`count_targets`); with the model's own loss, the targets its loss derives from the
    inputs (``own_loss``, :func:`fxpipe.partitioner.loss_targets.target_counter`), or the samples
    when the graph shows no such loss."""

    def count(b: Batch) -> int:
        if not model_loss_mode:
            return count_targets(b.target, ignore_index)
        if own_loss is None:
            return b.size
        return own_loss(b.named(model_inputs, input_kwargs))

    return count


def microbatch_weights(global_batch: Batch, replica: int, dp: int, microbatches: int,
                       count: Callable[[Batch], int]) -> list[float]:
    """Loss weights of replica ``replica``'s micro-batches: ``dp * n_i / N`` (``N`` summed over
    every micro-batch of the global batch), so that averaging the replicas' weighted sums, as
    the data-parallel all-reduce does, gives the global batch's mean. All zeros when nothing
    counts."""
    mbs = global_batch.size // (dp * microbatches)
    counts = [count(global_batch.slice(j * mbs, (j + 1) * mbs)) for j in range(dp * microbatches)]
    total = sum(counts)
    mine = counts[replica * microbatches:(replica + 1) * microbatches]
    return [dp * n / total if total else 0.0 for n in mine]
