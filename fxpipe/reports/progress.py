"""Live progress: a bar for training, a spinner for long planning; plain lines off a terminal.

* :class:`TrainingProgress` (rank 0 of ``fxpipe run``): on a terminal a tqdm bar with the
  step, loss, throughput, elapsed and time left, and the usual log line every ``log_every``
  steps printed above it; elsewhere (a CI log, a pipe, a file) only those plain lines, each
  with the time left, so logs stay readable. ``FXPIPE_PROGRESS=bar|lines`` forces one (the
  launcher sets it for its workers from its own stdout: a worker's stdout is the launcher's).
* :func:`planning_progress`: while planning (tracing, pricing, profiling, the auto search),
  the partitioner reports its phases on the ``fxpipe.progress`` logger (INFO; silent unless
  someone listens); on a terminal this shows them on stderr as one spinner line with the
  elapsed time, erased when planning ends. Off a terminal it prints nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from typing import IO, Iterator

__all__ = ["TrainingProgress", "planning_progress", "progress_mode", "PROGRESS_ENV",
           "PROGRESS_LOGGER", "eta_text"]

#: environment variable that forces the training display: ``bar`` or ``lines``
PROGRESS_ENV = "FXPIPE_PROGRESS"
#: the logger the planner reports its phases on
PROGRESS_LOGGER = "fxpipe.progress"


def progress_mode(stream: IO | None = None) -> str:
    """``"bar"`` when ``stream`` (default stdout) is a terminal, else ``"lines"``;
    :data:`PROGRESS_ENV` overrides."""
    forced = os.environ.get(PROGRESS_ENV, "").strip().lower()
    if forced in ("bar", "lines"):
        return forced
    stream = stream or sys.stdout
    try:
        return "bar" if stream.isatty() else "lines"
    except (AttributeError, ValueError):
        return "lines"


def _size(stream: IO) -> tuple[int, int]:
    """``(columns, lines)`` of the terminal behind ``stream``; 100 x 24 where it reports none
    (a pseudo-terminal of size 0, whose 0 lines would make tqdm hide its bar)."""
    try:
        cols, rows = os.get_terminal_size(stream.fileno())
    except (OSError, ValueError, AttributeError):
        cols, rows = 0, 0
    if cols < 20:
        cols = int(os.environ.get("COLUMNS", "0") or 0) or 100
    return cols, rows if rows >= 5 else 24


def _columns(stream: IO) -> int:
    return _size(stream)[0]


def eta_text(seconds: float) -> str:
    """``"45s"``, ``"3m05s"``, ``"1h02m"``."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


class TrainingProgress:
    """Progress of a training loop of ``total`` steps (see the module docstring).

    Args:
        total: steps the loop runs.
        unit: what the throughput counts (``tokens``, ``samples``).
        log_every: print the log line every this many steps (and at the last one).
        mode: ``"bar"`` or ``"lines"``; default :func:`progress_mode`.
        stream: where to write (default stdout).
        start: the first step (a resumed run); the pace counts the steps from there.
    """

    def __init__(self, total: int, unit: str = "samples", log_every: int = 10,
                 mode: str | None = None, stream: IO | None = None, start: int = 0):
        self.total = int(total)
        self.start = int(start)
        self.unit = unit
        self.log_every = max(1, int(log_every))
        self.stream = stream or sys.stdout
        self.mode = mode or progress_mode(self.stream)
        self.t0 = time.perf_counter()
        self.done = self.start
        self._bar = None
        if self.mode == "bar":
            try:
                from tqdm import tqdm
            except ImportError:  # pragma: no cover - tqdm is a dependency
                self.mode = "lines"
            else:
                self._bar = tqdm(total=self.total, initial=self.start, unit="step",
                                 file=self.stream, ncols=_size(self.stream)[0],
                                 nrows=_size(self.stream)[1],
                                 leave=True, desc="training",
                                 bar_format="{desc} {n_fmt}/{total_fmt} {bar} "
                                            "[{elapsed}<{remaining}]{postfix}")

    def eta_s(self) -> float:
        """Seconds left at the mean pace so far."""
        ran = self.done - self.start
        if ran <= 0:
            return float("nan")
        return (time.perf_counter() - self.t0) / ran * (self.total - self.done)

    def update(self, step: int, loss: float, rate: float, step_s: float,
               extra: str = "") -> str | None:
        """Record step ``step`` (0-based) done: its loss, throughput (``unit``/s), seconds;
        ``extra``: more text for the log line (lr, grad norm). Returns the log line when one
        was printed."""
        self.done = step + 1
        line = None
        if step % self.log_every == 0 or step == self.total - 1:
            line = (f"step {step:5d}/{self.total}  loss {loss:.4f}  {rate:9.0f} {self.unit}/s  "
                    f"{step_s * 1e3:7.1f} ms/step{extra}")
            if self.done < self.total:
                line += f"  eta {eta_text(self.eta_s())}"
        if self._bar is not None:
            self._bar.set_postfix_str(f"loss {loss:.4f}, {rate:,.0f} {self.unit}/s",
                                      refresh=False)
            self._bar.update(1)
            if line is not None:
                self._bar.write(line, file=self.stream)
        elif line is not None:
            print(line, file=self.stream, flush=True)
        return line

    def close(self) -> None:
        """Finish the bar (a no-op for plain lines)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class _Spinner(logging.Handler):
    """Shows the latest phase on one terminal line, redrawn by a thread."""

    FRAMES = "|/-\\"

    def __init__(self, stream: IO, what: str):
        super().__init__(logging.INFO)
        self.stream, self.what = stream, what
        self.msg = "starting"
        self.t0 = time.perf_counter()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._spin, daemon=True)
        self._width = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.msg = record.getMessage()

    def _draw(self, frame: str) -> None:
        text = f"{frame} {self.what}: {self.msg} ({time.perf_counter() - self.t0:.0f} s)"
        text = text[:_columns(self.stream) - 1]
        with self._lock:
            self.stream.write("\r" + text.ljust(self._width))
            self.stream.flush()
            self._width = len(text)

    def _spin(self) -> None:
        k = 0
        while not self._stop.wait(0.12):
            self._draw(self.FRAMES[k % len(self.FRAMES)])
            k += 1

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)
        with self._lock:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()


@contextlib.contextmanager
def planning_progress(what: str = "planning", stream: IO | None = None,
                      force: bool = False) -> Iterator[None]:
    """Show the planner's phases (the :data:`PROGRESS_LOGGER` messages) as a spinner line on
    ``stream`` (default stderr) while the block runs, when it is a terminal (or ``force``)."""
    stream = stream or sys.stderr
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        tty = False
    if not (tty or force):
        yield
        return
    logger = logging.getLogger(PROGRESS_LOGGER)
    spinner = _Spinner(stream, what)
    level, propagate = logger.level, logger.propagate
    logger.addHandler(spinner)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    spinner.start()
    try:
        yield
    finally:
        spinner.stop()
        logger.removeHandler(spinner)
        logger.setLevel(level)
        logger.propagate = propagate
