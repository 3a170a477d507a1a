"""``train.log: [csv, tensorboard]``: TensorBoard event files under ``RUN/tensorboard/``, written
by rank 0 (``torch.utils.tensorboard``; the optional ``tensorboard`` package).

Scalars, by optimizer step: ``train/loss``, ``train/step_time_s``, ``train/<unit>_per_s``
(tokens or samples), ``train/lr``, ``train/grad_norm`` (with ``train.grad_clip``); at the end
of training, per step of the measured timeline, ``pipeline/stage<s>_compute_s`` (the stage's
F + B + W seconds) and ``pipeline/bubble`` (the ranks' mean idle share, the simulator's
definition); ``eval/loss`` (the held-out loss of the initial and the final model, written by
the launcher after training).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Sequence

from fxpipe.errors import SpecError

#: the event files' folder inside a run folder
FOLDER = "tensorboard"


def require_tensorboard(where: str = "train.log"):
    """torch's ``SummaryWriter`` class.

    Raises:
        SpecError: the ``tensorboard`` package is missing (one line: how to install it).
    """
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise SpecError(f"{where}: tensorboard needs the 'tensorboard' package: pip install "
                        "'fxpipe[tensorboard]' (or drop tensorboard from train.log)") from None
    return SummaryWriter


def open_writer(out: Path, where: str = "train.log"):
    """A ``SummaryWriter`` on ``out/tensorboard`` (see :func:`require_tensorboard`)."""
    return require_tensorboard(where)(log_dir=str(Path(out) / FOLDER))


class TensorBoardLog:
    """Rank 0's metrics as TensorBoard scalars (see the module doc)."""

    def __init__(self, out: Path, unit: str):
        self.writer = open_writer(out)
        self.unit = unit

    def step(self, step: int, loss: float, dt: float, rate: float, lr: float | None,
             norm: float | None) -> None:
        """One optimizer step's figures."""
        w = self.writer
        w.add_scalar("train/loss", loss, step)
        w.add_scalar("train/step_time_s", dt, step)
        w.add_scalar(f"train/{self.unit}_per_s", rate, step)
        if lr is not None:
            w.add_scalar("train/lr", lr, step)
        if norm is not None:
            w.add_scalar("train/grad_norm", norm, step)

    def timeline(self, events: Iterable[Sequence], first_step: int) -> None:
        """Per measured step: each stage's compute seconds and the bubble."""
        from fxpipe.schedule.timeline import (event_kind, idle_fractions, split_steps,
                                              step_window)

        for i, evs in enumerate(split_steps(events)):
            per_stage: dict[int, float] = {}
            for e in evs:
                if event_kind(e.name) in ("F", "B", "W"):
                    s = e.name.split(" s")[-1]
                    if s.isdigit():
                        per_stage[int(s)] = per_stage.get(int(s), 0.0) + e.end_s - e.start_s
            for s, secs in sorted(per_stage.items()):
                self.writer.add_scalar(f"pipeline/stage{s}_compute_s", secs, first_step + i)
            idle = idle_fractions(evs, window=step_window(evs))
            if idle:
                self.writer.add_scalar("pipeline/bubble", sum(idle.values()) / len(idle),
                                       first_step + i)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


def write_held_out(out: Path, figures: dict, steps: int) -> None:
    """``eval/loss`` at step 0 (initial model) and at ``steps`` (final), from the launcher's
    held-out evaluation."""
    writer = open_writer(out)
    writer.add_scalar("eval/loss", float(figures["val_loss_initial"]), 0)
    writer.add_scalar("eval/loss", float(figures["val_loss_final"]), steps)
    writer.flush()
    writer.close()
