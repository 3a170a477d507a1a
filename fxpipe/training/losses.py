"""The weights that make a pipeline's loss the batch's mean (the losses themselves:
:mod:`fxpipe.execution.losses`).

Micro-batches hold different numbers of counted targets once padding or masking is involved
(``-100`` labels), so averaging the micro-batch means would not be the whole batch's mean.
:func:`microbatch_weights` gives each micro-batch its share ``n_i / N`` of the counted targets of
the whole global batch (all replicas), so that the weighted sum equals single-process training
on the whole batch exactly, for the built-in losses and for the model's own.
"""

from __future__ import annotations

from typing import Callable

from fxpipe.data.batches import Batch
from fxpipe.execution.losses import count_targets
from fxpipe.partitioner.loss_targets import TargetCounter

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
