"""Values that cross stage boundaries (:class:`ValueInfo`) and the rule for which get gradients.

Plain data, no torch: a dtype is its name without the ``torch.`` prefix (``"float32"``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def needs_grad(dtype: Any) -> bool:
    """Whether values of ``dtype`` carry a gradient back in the backward pass: floating-point
    and complex dtypes. Takes a dtype name (``"bfloat16"``) or a ``torch.dtype``."""
    name = str(dtype).removeprefix("torch.")
    return name.startswith(("float", "bfloat", "complex"))


#: Producer-stage marker for values that are model inputs (fed from the data loader on every
#: stage that needs them, never sent between ranks).
MODEL_INPUT = -1


@dataclass
class ValueInfo:
    """A tensor that crosses a stage boundary (an FX node's output).

    Attributes:
        name: FX node name of the producer (unique in the traced graph).
        producer: index of the stage that computes it, or ``MODEL_INPUT`` (-1) for a model input.
        consumers: indices of the stages that read it (sorted, producer excluded).
        shape: shape for ONE micro-batch, e.g. ``[4, 128, 256]``.
        dtype: torch dtype name without the ``torch.`` prefix, e.g. ``"float32"``, ``"int64"``.
        nbytes: size in bytes for one micro-batch.
    """

    name: str
    producer: int
    consumers: list[int]
    shape: list[int]
    dtype: str
    nbytes: int

    @property
    def requires_grad(self) -> bool:
        """True for floating-point values (their gradient is sent back in the backward pass)."""
        return needs_grad(self.dtype)
