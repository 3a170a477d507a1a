"""The dtypes ``train.precision`` gives: what a stage computes in under autocast and what a value
travels in between stages (the runtime, and the profiler that measures what it runs)."""

from __future__ import annotations

import torch

from fxpipe.errors import RuntimeFailure

#: spec ``train.precision`` -> autocast dtype (``None``: plain fp32, no autocast)
PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16,
                                             "fp16": torch.float16,
                                             "fp8": torch.bfloat16}  # (+ float8 matmuls)


def message_dtype(dtype: torch.dtype, precision: str) -> torch.dtype:
    """The dtype a value of plan dtype ``dtype`` travels in between stages under ``precision``:
    an fp32 activation (or its gradient) in the autocast dtype under ``bf16`` / ``fp16`` (half
    the bytes; the receiver casts it back to fp32, so its stage computes as planned), every other
    value (``fp32`` precision, integer and bool tensors, fp64, values already in 16 bits) as it
    is. An fp32 value beyond fp16's range becomes inf on the way, which the loss scaler's
    inf/NaN check then sees (the step is skipped, not silently wrong)."""
    amp = autocast_dtype(precision)
    return amp if amp is not None and dtype == torch.float32 else dtype


def autocast_dtype(precision: str) -> torch.dtype | None:
    """``"fp32"`` -> ``None``, ``"bf16"`` and ``"fp8"`` (bf16 around the float8 matmuls of
    :mod:`fxpipe.execution.fp8`) -> ``torch.bfloat16``, ``"fp16"`` -> ``torch.float16``.

    Raises:
        RuntimeFailure: unknown precision (the message lists the accepted names).
    """
    if precision not in PRECISIONS:
        raise RuntimeFailure(
            f"precision {precision!r} is unknown; set train.precision to one of "
            f"{', '.join(PRECISIONS)} (bf16 needs no loss scaling; fp16 uses dynamic loss scaling)")
    return PRECISIONS[precision]
