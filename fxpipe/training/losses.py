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


def shifts_labels(model: torch.nn.Module) -> bool:
    """Whether the model's own loss predicts token ``t+1`` from position ``t`` (transformers causal
    language models: the first label of each row never counts)."""
    fn = getattr(model, "loss_function", None)
    return getattr(fn, "__name__", "") == "ForCausalLMLoss"


def count_targets(target: torch.Tensor, ignore_index: int = -100, shift: bool = False) -> int:
    """How many targets count toward the mean: integer targets other than ``ignore_index``
    (without each row's first one when ``shift``), every element of a float target."""
    if target.is_floating_point() or target.is_complex():
        return target.numel()
    if shift:
        target = target[..., 1:]
    return int((target != ignore_index).sum())


def batch_counter(model_loss_mode: bool, ignore_index: int, shift: bool
                  ) -> Callable[[Batch], int]:
    """Counted targets of a :class:`~fxpipe.data.batches.Batch`: its target's, or with the model's
    own loss its ``labels``' (samples when it has none)."""

    def count(b: Batch) -> int:
        if model_loss_mode:
            labels = b.kwargs.get("labels")
            return b.size if labels is None else count_targets(labels, ignore_index, shift)
        return count_targets(b.target, ignore_index)

    return count


def microbatch_weights(global_batch: Batch, replica: int, dp: int, microbatches: int,
                       count: Callable[[Batch], int]) -> list[float]:
    """Loss weights of replica ``replica``'s micro-batches: ``dp * n_i / N`` (``N`` counted over
    the whole global batch), so that averaging the replicas' weighted sums, as the data-parallel
    all-reduce does, gives the global batch's mean. All zeros when nothing counts."""
    total = count(global_batch)
    per_replica = global_batch.size // dp
    mbs = per_replica // microbatches
    lo = replica * per_replica
    counts = [count(global_batch.slice(lo + i * mbs, lo + (i + 1) * mbs))
              for i in range(microbatches)]
    return [dp * n / total if total else 0.0 for n in counts]
