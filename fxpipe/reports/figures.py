"""What every picture shares: matplotlib without pyplot, one palette, PNG + SVG on disk.

Figures are built as ``matplotlib.figure.Figure`` objects (no pyplot, no global backend, no
window), so the drawing functions return them for a caller (or a test) to inspect, and
:func:`save_figure` writes each as PNG and SVG, atomically. The SVG keeps its text as paths
(no fonts needed to view it) and has no date in it, so the same figure gives the same file.
Artists that a reader (or a test) looks for carry a ``gid``, which becomes the ``id`` of their
``<g>`` element in the SVG (``stage-column-0``, ``timeline-measured-row-3``, ...).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path
from typing import Any, Iterator

from fxpipe.errors import FxpipeError
from fxpipe.plans.dot import STAGE_BORDERS, STAGE_FILLS

__all__ = ["styled", "new_figure", "text_color_on", "save_figure", "svg_text", "stage_fill",
           "stage_border", "KIND_COLORS", "PICTURE_SUFFIXES"]

#: the formats every picture is written in
PICTURE_SUFFIXES = (".png", ".svg")

#: colour of each kind of timeline event (:data:`fxpipe.schedule.timeline.EVENT_KINDS`)
KIND_COLORS = {
    "F": "#4e79a7",          # forward: blue
    "B": "#59a14f",          # backward (input gradients, or all of it): green
    "W": "#a0d68f",          # weight gradients: light green
    "send": "#f28e2b",       # orange
    "receive": "#ffbe7d",    # light orange (a blocking receive spans its wait)
    "all-reduce": "#b07aa1",  # purple
    "step": "#9c755f",       # brown: waiting for the all-reduces, the executor's STEP
    "optimizer": "#e15759",  # red: clipping, optimizer.step(), schedule, zero_grad
    "tensor": "#17becf",     # teal: a tensor group's collective inside F / B / W
    "other": "#bab0ac",
}

_RC = {"svg.fonttype": "path", "svg.hashsalt": "fxpipe", "font.size": 9,
       "axes.titlesize": 10, "figure.titlesize": 11}


def _mpl():
    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError:  # pragma: no cover - matplotlib is a dependency
        raise FxpipeError("the pictures need matplotlib: pip install 'matplotlib>=3.7'") from None
    return matplotlib, Figure


@contextlib.contextmanager
def styled() -> Iterator[None]:
    """The pictures' matplotlib settings, for the code that builds a figure's artists."""
    matplotlib, _ = _mpl()
    with matplotlib.rc_context(_RC):
        yield


def new_figure(width_in: float, height_in: float, **kw: Any):
    """A fresh ``Figure`` of that size (inches), not registered with pyplot (build it inside
    :func:`styled`)."""
    _, Figure = _mpl()
    return Figure(figsize=(width_in, height_in), **kw)


def stage_fill(stage: int) -> str:
    """Light fill colour of a stage (the DOT drawing's palette)."""
    return STAGE_FILLS[stage % len(STAGE_FILLS)]


def stage_border(stage: int) -> str:
    """Strong colour of a stage, for its outline and text."""
    return STAGE_BORDERS[stage % len(STAGE_BORDERS)]


def _write_atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save_figure(fig, out_dir: str | Path, stem: str, dpi: int = 110) -> list[Path]:
    """Write ``fig`` as ``<stem>.png`` and ``<stem>.svg`` in ``out_dir`` (created), each
    atomically. Returns the two paths."""
    matplotlib, _ = _mpl()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    with matplotlib.rc_context(_RC):
        for suffix in PICTURE_SUFFIXES:
            path = out / f"{stem}{suffix}"
            fmt = suffix[1:]
            meta = {"Date": None} if fmt == "svg" else {}
            _write_atomic(path, lambda tmp: fig.savefig(tmp, format=fmt, dpi=dpi, metadata=meta,
                                                        bbox_inches="tight", facecolor="white"))
            paths.append(path)
    return paths


def svg_text(fig) -> str:
    """The SVG of ``fig`` as text (what :func:`save_figure` writes)."""
    import io

    matplotlib, _ = _mpl()
    buf = io.StringIO()
    with matplotlib.rc_context(_RC):
        fig.savefig(buf, format="svg", metadata={"Date": None}, bbox_inches="tight",
                    facecolor="white")
    return buf.getvalue()


def text_color_on(hex_color: str) -> str:
    """Black or white, whichever reads better on ``hex_color`` (relative luminance)."""
    h = hex_color.lstrip("#")
    r, g, b = (int(h[i:i + 2], 16) / 255 for i in (0, 2, 4))
    return "#111111" if 0.2126 * r + 0.7152 * g + 0.0722 * b > 0.5 else "#ffffff"
