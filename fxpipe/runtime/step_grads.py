"""This rank's gradients through one training step, around its gradient reducer
(:mod:`fxpipe.runtime.grad_reducer`): fp16 loss scaling and gradients kept from earlier steps.

* Loss scaling (:class:`~fxpipe.runtime.precision.LossScaler`): a parameter's gradient is
  unscaled once every local stage using it ran its last backward, before its reduction starts
  (so the reducers see true gradients); after the reduction one world-wide flag says whether
  any rank saw an inf/NaN (then the step is skipped everywhere and the scale backs off).
* Accumulation (``optimizer=None``: gradients stay in ``.grad`` over several steps): the
  gradients earlier steps left are set aside while a step's reduction runs and added back
  after it, for the parameters whose reduction must see this step's gradients only: tied
  ones (their all-reduce sums every holder's copy, so a reduced gradient would count once per
  holder), and every parameter under loss scaling (unscaled once) or a compression (16-bit
  payloads carry this step's gradients only).
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn

from fxpipe.runtime.precision import LossScaler, found_nonfinite


class StepGrads:
    """The step-level bookkeeping of this rank's parameters' gradients.

    Args:
        stage_params: local stage -> its trained parameters (a parameter of several local
            stages is unscaled once all of them are done).
        loss_scaler: the scaler, or None (no unscaling, no inf/NaN check).
        shared: ids of the tied parameters (set aside when accumulating).
        exact: False under a lossy gradient compression (every gradient is set aside).
    """

    def __init__(self, stage_params: dict[int, list[nn.Parameter]],
                 loss_scaler: LossScaler | None, shared: Iterable[int], exact: bool = True):
        self.loss_scaler = loss_scaler
        #: parameter id -> (the parameter, the local stages using it)
        self.users: dict[int, tuple[nn.Parameter, set[int]]] = {}
        for s, ps in stage_params.items():
            for p in ps:
                self.users.setdefault(id(p), (p, set()))[1].add(s)
        self._done: set[int] = set()
        self._unscaled: set[int] = set()
        shared = set(shared)
        exact_sum = loss_scaler is None and exact
        # an expert's gradient (parallel.expert) is summed over fewer replicas than it is
        # divided by: what earlier calls left is set aside, not reduced again
        self._aside_ids = [pid for pid in self.users if not exact_sum or pid in shared
                           or getattr(self.users[pid][0], "fxpipe_expert", False)]
        self._aside: dict[int, torch.Tensor] = {}

    def begin(self) -> None:
        """A step starts: no stage done; the gradients to keep out of it are set aside."""
        self._done.clear()
        self._unscaled.clear()
        self._aside = {}
        for pid in self._aside_ids:
            p = self.users[pid][0]
            if p.grad is not None:
                self._aside[pid] = p.grad
                p.grad = None

    def is_done(self, stage: int) -> bool:
        return stage in self._done

    def stage_done(self, stage: int) -> None:
        """``stage`` ran its last backward: unscale the gradients of the parameters whose
        every local user is now done (loss scaling)."""
        self._done.add(stage)
        if self.loss_scaler is not None:
            ready = [p for pid, (p, users) in self.users.items()
                     if pid not in self._unscaled and users <= self._done]
            self._unscaled.update(id(p) for p in ready)
            self.loss_scaler.unscale_(p.grad for p in ready)

    def skip_step(self, pending: list[torch.Tensor], device: torch.device, world_size: int,
                  timeout_s: float) -> bool:
        """After the reduction: whether any rank's gradients (``.grad`` and the reducer's
        ``pending`` ones) hold an inf/NaN (one world all-reduce; the scaler is updated);
        False without loss scaling.

        Raises:
            RuntimeFailure: the flag's all-reduce failed or timed out.
        """
        if self.loss_scaler is None:
            return False
        grads = [p.grad for p, _ in self.users.values()] + list(pending)
        skip = found_nonfinite(grads, device, world_size, timeout_s)
        self.loss_scaler.update(skip)
        return skip

    def restore(self, drop_this_step: bool) -> None:
        """Add the gradients set aside by :meth:`begin` to this step's; with
        ``drop_this_step`` (an fp16 step with inf/NaN gradients) keep only the set-aside ones,
        so the skipped step contributes nothing to an accumulation."""
        if drop_this_step:
            for pid, (p, _) in self.users.items():
                p.grad = self._aside.get(pid)
        else:
            for pid, g in self._aside.items():
                p = self.users[pid][0]
                if p.grad is not None:
                    g.add_(p.grad)
                p.grad = g
        self._aside = {}

    def end(self) -> None:
        """The step is over."""
        self._done.clear()
        self._unscaled.clear()
