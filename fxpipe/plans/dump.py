"""Plan dumps: ``plan.json``, ``summary.txt``, ``partition.dot`` (+ ``partition-units.svg``).

Takes a :class:`~fxpipe.plans.plan.Plan`, the optional unit graph and a folder; writes each file
atomically (temp file + rename) and touches nothing else in the folder. The SVG is rendered by
Graphviz's ``dot`` when it is on ``PATH``; a failed render is a warning, never an error. (The
block-level partition picture, ``partition.png`` / ``partition.svg``, is drawn with or without
Graphviz by :mod:`fxpipe.reports.partition_picture`; ``fxpipe plan --out`` and ``fxpipe run``
write both.)
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import warnings
from pathlib import Path
from typing import Any

from fxpipe.errors import PlanError
from fxpipe.plans.dot import partition_dot
from fxpipe.plans.summary import summary_table

__all__ = ["dump_plan", "DUMP_FILES"]

#: The file names :func:`dump_plan` may write inside ``out_dir`` (nothing else is touched).
DUMP_FILES = ("plan.json", "summary.txt", "partition.dot", "partition-units.svg")


def _check_out_dir(out_dir: Path) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise PlanError(
            f"cannot dump the plan into {out_dir}: it is a file, not a folder; pass a folder "
            f"path (for example {out_dir}.d) or move the file away"
        )
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as e:
        raise PlanError(
            f"cannot create the dump folder {out_dir}: a part of that path is a file ({e}); "
            "pass a folder path whose parents are folders"
        ) from None
    except PermissionError as e:
        raise PlanError(
            f"cannot create the dump folder {out_dir}: permission denied ({e}); pass a "
            "writable folder"
        ) from None
    for name in DUMP_FILES:
        target = out_dir / name
        if target.is_dir():
            raise PlanError(
                f"cannot write {target}: a folder of that name exists; remove or rename it, "
                "or dump into another folder"
            )


def _tmp_name(path: Path) -> Path:
    """A fresh hidden temp name next to ``path`` (never the name of an existing file)."""
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def _write_text(path: Path, text: str) -> Path:
    """Write ``text`` atomically: exclusive-create a temp file in the same folder (the usual
    umask permissions), then rename it over ``path``."""
    tmp = _tmp_name(path)
    try:
        with open(tmp, "x", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _render_svg(dot_path: Path, svg_path: Path, timeout_s: float) -> Path | None:
    """Render ``dot_path`` with Graphviz into ``svg_path``. Returns the path, or None (and a
    warning) when rendering fails; a stale ``svg_path`` from an earlier dump is then removed."""
    exe = shutil.which("dot")
    if exe is None:
        return None
    tmp = _tmp_name(svg_path)
    tmp.touch(exist_ok=False)  # reserve the name; Graphviz writes into it
    problem = None
    try:
        proc = subprocess.run([exe, "-Tsvg", str(dot_path), "-o", str(tmp)], capture_output=True,
                              text=True, timeout=timeout_s, check=False)
        if proc.returncode != 0:
            problem = f"exit code {proc.returncode}: {proc.stderr.strip()[:500]}"
        elif tmp.stat().st_size == 0:
            problem = "it wrote an empty file"
    except subprocess.TimeoutExpired:
        problem = (f"it ran longer than {timeout_s:g} s (a very large graph?); render it yourself "
                   f"with `dot -Tsvg {dot_path} -o {svg_path}`")
    except OSError as e:
        problem = str(e)
    if problem is None:
        os.replace(tmp, svg_path)
        return svg_path
    tmp.unlink(missing_ok=True)
    svg_path.unlink(missing_ok=True)  # never leave an SVG that disagrees with partition.dot
    warnings.warn(f"Graphviz could not render {svg_path.name} ({exe}): {problem}; "
                  f"{dot_path.name} was written", RuntimeWarning, stacklevel=3)
    return None


def dump_plan(plan: "Plan", out_dir: Path | str, graph: Any = None, *, render_svg: bool = True,
              timeout_s: float = 60.0, max_svg_units: int = 5000) -> list[Path]:
    """Write the plan's dumps into ``out_dir`` (created if missing).

    Files (only these; anything else in ``out_dir`` is left untouched):
        ``plan.json``: :meth:`Plan.save` (JSON round-trip with :meth:`Plan.load`).
        ``summary.txt``: :func:`summary_table`.
        ``partition.dot``: :func:`partition_dot` (unit graph when ``graph`` is given, else the
        stage graph).
        ``partition-units.svg``: rendered by Graphviz's ``dot`` when it is on ``PATH`` and
        ``render_svg`` is True. A failed or timed-out render is a ``RuntimeWarning``, not an
        error (the other files are still written). When no SVG is rendered, a
        ``partition-units.svg``
        left by an earlier dump is removed so it never disagrees with ``partition.dot``.

    Args:
        plan: the plan to dump.
        out_dir: destination folder.
        graph: optional networkx graph of planning units (see :func:`partition_dot`).
        render_svg: set False to skip Graphviz even when it is installed.
        timeout_s: seconds allowed for the Graphviz render.
        max_svg_units: graphs with more planning units than this are not rendered (Graphviz's
            layout is super-linear; a ``RuntimeWarning`` gives the command to render by hand).

    Returns:
        Paths written, in the order plan.json, summary.txt, partition.dot[,
        partition-units.svg].

    Raises:
        PlanError: ``out_dir`` (or a parent) is a file, a target name is a folder, or the folder
            cannot be created.
    """
    out_dir = Path(out_dir)
    _check_out_dir(out_dir)
    written = [plan.save(out_dir / "plan.json")]
    written.append(_write_text(out_dir / "summary.txt", summary_table(plan) + "\n"))
    dot_path = _write_text(out_dir / "partition.dot", partition_dot(plan, graph))
    written.append(dot_path)
    svg_path = out_dir / "partition-units.svg"
    n_units = len(graph.nodes) if graph is not None else len(plan.stages)
    if render_svg and n_units > max_svg_units and shutil.which("dot") is not None:
        warnings.warn(f"{n_units} planning units exceed max_svg_units={max_svg_units}: "
                      f"{svg_path.name} not rendered; run `dot -Tsvg {dot_path} -o {svg_path}` "
                      "to render it anyway", RuntimeWarning, stacklevel=2)
        render_svg = False
    svg = _render_svg(dot_path, svg_path, timeout_s) if render_svg else None
    if svg is not None:
        written.append(svg)
    else:
        svg_path.unlink(missing_ok=True)  # a stale SVG from an earlier dump would disagree
    return written
