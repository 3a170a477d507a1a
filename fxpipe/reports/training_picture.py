"""The training picture: is it learning, and how fast.

Takes a run's ``losses.csv`` (``step, loss, step_time_s, <unit>_per_s``, one row per optimizer
step) and, when there is one, its ``eval.json`` (held-out loss of the initial and the final
model); gives a two-panel matplotlib figure: the training loss against the step with the
held-out loss as two marked points (at step 0: the initial weights, and after the last step:
the trained ones), and the throughput (``tokens/s`` or ``samples/s``) against the step with
its median. Artist ids: ``train-loss``, ``heldout-loss``, ``throughput``.
"""

from __future__ import annotations

import csv
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from fxpipe.errors import FxpipeError
from fxpipe.reports.figures import new_figure, save_figure, styled

__all__ = ["TrainingLog", "read_training_log", "training_figure", "write_training_picture"]


@dataclass
class TrainingLog:
    """A run's logged figures: per row ``steps``, ``losses``, ``step_times_s``,
    ``throughput`` (``unit`` per second), and ``heldout``: ``(step, loss)`` points."""

    steps: list[int]
    losses: list[float]
    step_times_s: list[float]
    throughput: list[float]
    unit: str = "samples"
    heldout: list[tuple[int, float]] = field(default_factory=list)


def read_training_log(run_dir: str | Path) -> TrainingLog:
    """Read ``losses.csv`` (and ``eval.json`` when present) of a run folder.

    Raises:
        FxpipeError: no ``losses.csv``, or a row that is not numbers.
    """
    run = Path(run_dir)
    path = run / "losses.csv"
    if not path.exists():
        raise FxpipeError(f"{path}: no such file; a run writes it after its first step")
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        fields = reader.fieldnames or []
        rate = next((f for f in fields if f.endswith("_per_s")), None)
        log = TrainingLog([], [], [], [], rate[:-len("_per_s")] if rate else "samples")
        for i, row in enumerate(reader, start=2):
            try:
                log.steps.append(int(row["step"]))
                log.losses.append(float(row["loss"]))
                log.step_times_s.append(float(row.get("step_time_s") or "nan"))
                log.throughput.append(float(row[rate]) if rate else float("nan"))
            except (KeyError, TypeError, ValueError) as e:
                raise FxpipeError(f"{path}:{i}: not a row of numbers ({e}); expected columns "
                                  "step, loss, step_time_s, <unit>_per_s") from None
    ev = run / "eval.json"
    if ev.exists():
        try:
            figures = json.loads(ev.read_text())
        except json.JSONDecodeError:
            figures = {}
        last = (log.steps[-1] + 1) if log.steps else 0
        if "val_loss_initial" in figures:
            log.heldout.append((0, float(figures["val_loss_initial"])))
        if "val_loss_final" in figures:
            log.heldout.append((last, float(figures["val_loss_final"])))
    return log


def training_figure(log: TrainingLog, title: str | None = None):
    """Loss (and held-out loss) and throughput against the step, as a ``Figure``."""
    from matplotlib.ticker import MaxNLocator

    with styled():
        fig = new_figure(9.0, 5.6)
        ax_loss, ax_rate = fig.subplots(2, 1, sharex=True,
                                        gridspec_kw={"height_ratios": [3, 2]})
        (line,) = ax_loss.plot(log.steps, log.losses, color="#4e79a7", linewidth=1.4,
                               marker="o" if len(log.steps) <= 40 else None, markersize=3,
                               label="training loss (mean of the step's batch)")
        line.set_gid("train-loss")
        if log.heldout:
            xs, ys = zip(*log.heldout)
            (held,) = ax_loss.plot(xs, ys, linestyle="--", marker="D", markersize=6,
                                   color="#e15759", label="held-out loss (initial, final)")
            held.set_gid("heldout-loss")
            for x, y in log.heldout:
                ax_loss.annotate(f"{y:.3f}", (x, y), textcoords="offset points", xytext=(6, 6),
                                 fontsize=8, color="#e15759")
        ax_loss.set_ylabel("loss")
        ax_loss.legend(fontsize=8, frameon=False)
        ax_loss.grid(color="#e5e5e5", linewidth=0.6)
        (rate,) = ax_rate.plot(log.steps, log.throughput, color="#59a14f", linewidth=1.2,
                               marker="o" if len(log.steps) <= 40 else None, markersize=3,
                               label=f"{log.unit}/s")
        rate.set_gid("throughput")
        finite = [v for v in log.throughput if v == v]
        if finite:
            med = statistics.median(finite)
            ax_rate.axhline(med, color="#59a14f", linestyle=":", linewidth=1)
            ax_rate.annotate(f"median {med:,.0f} {log.unit}/s", (1.0, med),
                             xycoords=("axes fraction", "data"), xytext=(-4, 4),
                             textcoords="offset points", ha="right", fontsize=8,
                             color="#2f6b2a")
        ax_rate.set_ylabel(f"{log.unit} / s")
        ax_rate.set_xlabel("optimizer step")
        ax_rate.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax_rate.set_ylim(bottom=0)
        ax_rate.grid(color="#e5e5e5", linewidth=0.6)
        for ax in (ax_loss, ax_rate):
            for side in ("top", "right"):
                ax.spines[side].set_visible(False)
        fig.suptitle(title or f"training: {len(log.steps)} steps", x=0.01, ha="left",
                     fontsize=10)
        fig.subplots_adjust(hspace=0.12, top=0.92)
    return fig


def write_training_picture(run_dir: str | Path, out_dir: str | Path | None = None,
                           title: str | None = None, stem: str = "training") -> list[Path]:
    """Read the run's log and write ``training.png`` / ``training.svg`` (into ``run_dir``
    unless ``out_dir``)."""
    return save_figure(training_figure(read_training_log(run_dir), title),
                       out_dir or run_dir, stem)
