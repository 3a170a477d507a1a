"""``train.lr_schedule``: linear warm-up, then a constant or cosine learning rate.

:func:`lr_factor` gives the multiplier of ``train.lr`` for optimizer step ``s`` (0-based):
``(s + 1) / warmup_steps`` during the warm-up, then ``1`` (``constant``) or
``min_lr / lr + (1 - min_lr / lr) * (1 + cos(pi * t)) / 2`` (``cosine``, ``t`` running from 0
after the warm-up to 1 at the last step). :func:`build_scheduler` wraps it in a
``torch.optim.lr_scheduler.LambdaLR``: call its ``step()`` after each ``optimizer.step()``.
"""

from __future__ import annotations

import math


def lr_factor(step: int, steps: int, warmup_steps: int = 0, decay: str = "constant",
              lr: float = 1.0, min_lr: float = 0.0) -> float:
    """Multiplier of the base learning rate ``lr`` at optimizer step ``step`` of ``steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay == "constant":
        return 1.0
    span = max(1, steps - 1 - warmup_steps)
    t = min(1.0, (step - warmup_steps) / span)
    floor = min_lr / lr
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * t))


def build_scheduler(optimizer, train):
    """A ``LambdaLR`` over ``optimizer`` following ``train.lr_schedule`` for ``train.steps``
    optimizer steps (``train``: a :class:`~fxpipe.specs.schema.TrainSpec`)."""
    import torch

    s = train.lr_schedule
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda k: lr_factor(k, train.steps, s.warmup_steps, s.decay, train.lr,
                                       s.min_lr))
