"""Mixed precision for the pipeline executor: autocast dtypes and a dynamic loss scaler.

``train.precision`` is ``fp32`` (no autocast), ``bf16`` or ``fp16``: the forward pass and the
loss run under ``torch.autocast(device_type, dtype)`` while parameters, gradients and optimizer
state stay fp32 ("master weights"; Micikevicius et al., "Mixed Precision Training", ICLR 2018).
fp16's narrow exponent range lets small gradients underflow, so fp16 also scales the loss by a
factor ``S`` before the backward pass and divides the gradients by ``S`` before they are
all-reduced and applied (dynamic loss scaling, the semantics of ``torch.amp.GradScaler``): a step
whose gradients hold an inf or NaN on ANY rank is skipped on EVERY rank and ``S`` is halved;
after ``growth_interval`` clean steps in a row ``S`` doubles. bf16 has fp32's exponent range and
needs no scaling. Under ``bf16`` / ``fp16`` the fp32 values sent between stages (activations
forward, their gradients backward) travel in that 16-bit dtype (:func:`message_dtype`).
"""

from __future__ import annotations

import datetime
from typing import Iterable

import torch
import torch.distributed as dist

from fxpipe.errors import RuntimeFailure

class LossScaler:
    """Dynamic loss scale for fp16 training (``torch.amp.GradScaler`` semantics and defaults).

    The executor multiplies each micro-batch loss by :attr:`scale` before the backward pass,
    calls :meth:`unscale_` on each gradient before its data-parallel all-reduce, asks
    :func:`found_nonfinite` (one world-wide all-reduce) whether any rank saw an inf/NaN, skips the
    optimizer step if so, and then calls :meth:`update`.

    Args:
        init_scale: first scale ``S`` (a power of two keeps scaling and unscaling exact).
        growth_factor: ``S`` is multiplied by this after ``growth_interval`` clean steps in a row.
        backoff_factor: ``S`` is multiplied by this after a step with non-finite gradients.
        growth_interval: clean steps between growths.

    Raises:
        RuntimeFailure: a non-positive scale, a growth factor <= 1, a backoff factor outside
            (0, 1) or a growth interval < 1.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000):
        if not (init_scale > 0 and growth_factor > 1 and 0 < backoff_factor < 1
                and growth_interval >= 1):
            raise RuntimeFailure(
                f"LossScaler(init_scale={init_scale}, growth_factor={growth_factor}, "
                f"backoff_factor={backoff_factor}, growth_interval={growth_interval}) is invalid; "
                "use init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1, "
                "growth_interval >= 1 (defaults: 65536, 2, 0.5, 2000)")
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.clean_steps = 0  # clean steps since the last growth or backoff
        self.skipped = 0      # steps skipped so far

    def unscale_(self, grads: Iterable[torch.Tensor | None]) -> None:
        """Divide each gradient by :attr:`scale` in place (``None`` entries are ignored)."""
        inv = 1.0 / self.scale
        for g in grads:
            if g is not None:
                g.mul_(inv)

    def update(self, found_inf: bool) -> None:
        """Adjust the scale after a step: back off (and count a skip) on inf/NaN, else grow
        after ``growth_interval`` clean steps in a row."""
        if found_inf:
            self.scale *= self.backoff_factor
            self.clean_steps = 0
            self.skipped += 1
        else:
            self.clean_steps += 1
            if self.clean_steps >= self.growth_interval:
                self.scale *= self.growth_factor
                self.clean_steps = 0

    def state_dict(self) -> dict:
        """Scale, factors and counters (plain floats/ints) for checkpoints."""
        return dict(scale=self.scale, growth_factor=self.growth_factor,
                    backoff_factor=self.backoff_factor, growth_interval=self.growth_interval,
                    clean_steps=self.clean_steps, skipped=self.skipped)

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.scale = float(state["scale"])
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped = int(state["skipped"])


def found_nonfinite(grads: Iterable[torch.Tensor | None], device: torch.device,
                    world_size: int, timeout_s: float = 300.0) -> bool:
    """Whether any gradient on ANY rank holds an inf or NaN.

    Checks this rank's ``grads`` and, when ``world_size > 1``, all-reduces the flag (MAX) over the
    default process group, so every rank takes the same skip decision. Collective: every rank
    must call it once per step.

    Raises:
        RuntimeFailure: the all-reduce did not complete within ``timeout_s`` seconds (a peer
            died or fell behind).
    """
    bad = any(g is not None and not bool(torch.isfinite(g).all()) for g in grads)
    if world_size <= 1:
        return bad
    flag = torch.tensor([1.0 if bad else 0.0], device=device)
    try:
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True)
        work.wait(datetime.timedelta(seconds=timeout_s))
    except Exception as e:  # gloo/NCCL raise RuntimeError / DistBackendError
        raise RuntimeFailure(
            f"the fp16 loss-scaler's inf/NaN check (an all-reduce over all {world_size} ranks) "
            f"failed or timed out after {timeout_s:g} s: {e}. Check the other ranks' logs; raise "
            "train.timeout_s if a peer is only slow") from None
    return bool(flag.item() > 0)
