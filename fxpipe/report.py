"""Human-readable views of a :class:`~fxpipe.plan_data.Plan`: a text table and file dumps.

* :func:`summary_table` -- fixed-width plain-text table, one row per stage, plus footer lines
  (bottleneck, lower bound, world size, schedule, prediction, tied parameters, explanations).
  It is what ``fxpipe plan`` prints and what ``summary.txt`` holds.
* :func:`partition_dot` -- Graphviz DOT text of the partition. With the planner's networkx graph,
  every planning unit is a node filled with its stage's colour, units are clustered per stage and
  cut edges are labelled with the bytes they move per micro-batch. Without it, a stage-level graph
  is drawn from ``plan.values`` (skip connections included).
* :func:`dump_plan` -- writes ``plan.json``, ``summary.txt``, ``partition.dot`` and, when
  Graphviz's ``dot`` executable is on ``PATH``, ``partition.svg``.

The DOT text is written by hand (no pydot / Graphviz Python binding needed); Graphviz itself is
optional and only used to render the SVG. Units: seconds in the plan, shown as milliseconds;
bytes shown with binary prefixes (KiB = 1024 B); FLOPs shown with SI prefixes (G = 10^9).
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

from fxpipe.errors import PlanError
from fxpipe.plan_data import MODEL_INPUT, Plan

__all__ = [
    "human_bytes",
    "human_flops",
    "stage_ranks",
    "summary_table",
    "partition_dot",
    "dump_plan",
    "DUMP_FILES",
]

#: The file names :func:`dump_plan` may write inside ``out_dir`` (nothing else is touched).
DUMP_FILES = ("plan.json", "summary.txt", "partition.dot", "partition.svg")

# Pastel fills, one per stage (cycled), and a stronger border colour of the same hue.
_FILLS = (
    "#a6cee3", "#b2df8a", "#fdbf6f", "#cab2d6", "#fb9a99", "#ffff99",
    "#8dd3c7", "#bebada", "#80b1d3", "#fccde5", "#d9d9d9", "#ccebc5",
)
_BORDERS = (
    "#1f78b4", "#33a02c", "#ff7f00", "#6a3d9a", "#e31a1c", "#b15928",
    "#1b9e77", "#7570b3", "#386cb0", "#e7298a", "#666666", "#4daf4a",
)
_UNASSIGNED_FILL = "#f0f0f0"  # units in no stage (model inputs, unused parameters)
_CUT_COLOR = "#d62728"


# ---------------------------------------------------------------------------- formatting helpers
def human_bytes(n: float) -> str:
    """Format a byte count with binary prefixes: ``0 B``, ``512 B``, ``1.5 KiB``, ``3.0 GiB``.

    Args:
        n: bytes (int or float, >= 0; negative values are formatted with a minus sign).
    """
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    if n < 1024:
        return f"{sign}{int(round(n))} B"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        n /= 1024.0
        if n < 1024 or unit == "PiB":
            return f"{sign}{n:.1f} {unit}"
    raise AssertionError("unreachable")


def human_flops(n: float) -> str:
    """Format a FLOP count with SI prefixes (10^3 steps): ``0``, ``950``, ``12.3 M``, ``1.23 G``."""
    n = float(n)
    if n == 0:
        return "0"
    for scale, unit in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.3g}"


def _plural(n: int, word: str) -> str:
    """``"1 stage"``, ``"2 stages"``, ``"0 stages"``."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _ms(seconds: float) -> str:
    """Seconds -> milliseconds text with about 4 significant digits, fixed decimals per range."""
    ms = seconds * 1e3
    if ms == 0:
        return "0"
    if abs(ms) >= 100:
        return f"{ms:.1f}"
    if abs(ms) >= 0.01:
        return f"{ms:.3f}"
    return f"{ms:.2e}"


# ---------------------------------------------------------------------------- placement
def stage_ranks(plan: Plan) -> list[int]:
    """Pipeline rank (index inside a pipeline group) that holds each (virtual) stage.

    Placement: with one stage per rank, stage ``s`` is on rank ``s``. With ``v`` virtual stages per
    rank the default is the loop placement of interleaved 1F1B (Narayanan et al., "Efficient
    Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", 2021): rank
    ``s % p``. Schedule ``zb-v`` uses the V-shape placement of Zero Bubble Pipeline Parallelism
    (Qi et al., 2024): rank ``r`` holds stages ``r`` and ``2p-1-r`` (chunks alternate direction,
    so with more than two chunks the pattern zig-zags).

    Returns:
        list of length ``len(plan.stages)``, ranks in ``0 .. plan.pipeline-1``.
    """
    p = max(1, int(plan.pipeline))
    ranks = []
    for stage in plan.stages:
        s = stage.index
        chunk, pos = divmod(s, p)
        if plan.schedule == "zb-v" and chunk % 2 == 1:
            ranks.append(p - 1 - pos)
        else:
            ranks.append(pos)
    return ranks


def _bottleneck(plan: Plan) -> int:
    """Position in ``plan.stages`` of the bottleneck stage (plan's choice; argmax as fallback)."""
    for pos, st in enumerate(plan.stages):
        if st.index == plan.bottleneck_stage:
            return pos
    if not plan.stages:
        return -1
    return max(range(len(plan.stages)), key=lambda i: plan.stages[i].time_s)


# ---------------------------------------------------------------------------- summary table
def summary_table(plan: Plan) -> str:
    """Readable fixed-width table of the plan's stages, followed by footer lines.

    Columns (one row per stage): stage index, pipeline rank holding it (see :func:`stage_ranks`),
    number of FX nodes, parameters (FQN count / bytes), forward and backward FLOPs per
    micro-batch, bytes received and sent per micro-batch (forward direction), compute, comm and
    total (``time_s``) milliseconds per micro-batch, predicted peak memory, and ``*`` in the
    ``slowest`` column on the bottleneck stage. Footer: bottleneck and its time, lower bound
    (``plan.lower_bound_s``) and the ratio bottleneck / lower bound, ``pipeline x dp = world
    size``, micro-batches, schedule,
    the simulator's prediction when ``plan.predicted`` is set, tied parameters and the stages that
    hold them, and ``plan.explain``.

    Args:
        plan: any :class:`Plan` (an empty stage list gives a table with no rows).

    Returns:
        Plain text (no colour codes, no trailing newline), safe to write to ``summary.txt``.
    """
    ranks = stage_ranks(plan)
    bpos = _bottleneck(plan)
    headers = [
        "stage", "rank", "nodes", "params", "fwd FLOPs", "bwd FLOPs",
        "recv/mb", "send/mb", "compute ms", "comm ms", "total ms", "memory", "slowest",
    ]
    rows: list[list[str]] = []
    for pos, st in enumerate(plan.stages):
        rows.append([
            str(st.index),
            str(ranks[pos]),
            str(len(st.nodes)),
            f"{len(st.params)} / {human_bytes(st.param_bytes)}",
            human_flops(st.fwd_flops),
            human_flops(st.bwd_flops),
            human_bytes(st.recv_bytes),
            human_bytes(st.send_bytes),
            _ms(st.compute_time_s),
            _ms(st.comm_time_s),
            _ms(st.time_s),
            human_bytes(st.memory_bytes),
            "*" if pos == bpos else "",
        ])
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    left = {0, 1, 2, 3}  # left-aligned columns: stage/rank/nodes/params read better that way

    def fmt(cells: list[str]) -> str:
        out = [c.ljust(w) if i in left or i == len(cells) - 1 else c.rjust(w)
               for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(out).rstrip()

    v = plan.virtual_stages
    title = (f"fxpipe plan: {plan.model}  |  {_plural(plan.num_stages, 'stage')} on "
             f"{_plural(plan.pipeline, 'pipeline rank')}" + (f" x {v} virtual" if v > 1 else "")
             + f"  |  schedule {plan.schedule}")
    lines = [title, fmt(headers), fmt(["-" * w for w in widths])]
    lines += [fmt(r) for r in rows]
    lines.append("")

    if bpos >= 0:
        b = plan.stages[bpos]
        lines.append(f"bottleneck:   stage {b.index} (rank {ranks[bpos]}), {_ms(b.time_s)} ms per "
                     f"micro-batch (compute {_ms(b.compute_time_s)} + comm {_ms(b.comm_time_s)})")
        if plan.lower_bound_s > 0:
            ratio = b.time_s / plan.lower_bound_s
            lines.append(f"lower bound:  {_ms(plan.lower_bound_s)} ms (total compute / "
                         f"{_plural(plan.num_stages, 'stage')}); bottleneck / lower bound = "
                         f"{ratio:.3f}x")
        else:
            lines.append(f"lower bound:  {_ms(plan.lower_bound_s)} ms (not computed); "
                         "bottleneck / lower bound = n/a")
    if v > 1 and plan.stages:
        per_rank = [0.0] * max(1, plan.pipeline)
        for pos, st in enumerate(plan.stages):
            per_rank[ranks[pos]] += st.time_s
        lines.append("per rank:     " + ", ".join(
            f"rank {r} {_ms(t)} ms" for r, t in enumerate(per_rank)))
    lines.append(f"parallelism:  pipeline {plan.pipeline} x dp {plan.dp} = world size "
                 f"{plan.world_size}")
    lines.append(f"micro-batches: {plan.microbatches} per step per replica, "
                 f"{_plural(plan.microbatch_size, 'sample')} each")
    lines.append(f"schedule:     {plan.schedule}" + (f" ({v} virtual stages per rank)" if v > 1
                                                      else ""))
    pred = plan.predicted
    if pred is not None:
        lines.append(f"predicted:    step {_ms(pred.step_time_s)} ms, bubble "
                     f"{100.0 * pred.bubble_fraction:.1f} %")
        if pred.peak_memory_bytes:
            peak = max(range(len(pred.peak_memory_bytes)), key=lambda i: pred.peak_memory_bytes[i])
            per = ", ".join(human_bytes(m) for m in pred.peak_memory_bytes)
            lines.append(f"peak memory:  {human_bytes(pred.peak_memory_bytes[peak])} "
                         f"(stage {peak}); per stage: {per}")
        if pred.peak_inflight:
            lines.append("in flight:    micro-batches held per stage: "
                         + ", ".join(str(k) for k in pred.peak_inflight))
    if plan.shared_params:
        aliases: dict[str, list[str]] = {}
        for alias, canon in sorted(plan.param_aliases.items()):
            aliases.setdefault(canon, []).append(alias)
        lines.append("shared (tied) parameters, gradients summed across their stages:")
        for fqn, stages in sorted(plan.shared_params.items()):
            extra = f" (alias {', '.join(aliases[fqn])})" if fqn in aliases else ""
            lines.append(f"  {fqn}{extra}: stages {', '.join(str(s) for s in stages)}")
    if plan.explain:
        lines.append("explain:")
        lines += [f"  {e}" for e in plan.explain]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- DOT
def _q(text: Any) -> str:
    """Quote ``text`` as a DOT string: backslashes and double quotes escaped, newlines as ``\\n``
    (Graphviz's centred line break)."""
    s = str(text).replace("\\", "\\\\").replace('"', '\\"')
    s = s.replace("\r\n", "\n").replace("\r", "\n").replace("\n", "\\n")
    return f'"{s}"'


def _attrs(**kw: Any) -> str:
    """``[k1="v1", k2="v2"]`` with every value quoted (keys are fixed identifiers)."""
    return "[" + ", ".join(f"{k}={_q(v)}" for k, v in kw.items() if v is not None) + "]"


def _stage_fill(stage: int) -> str:
    return _FILLS[stage % len(_FILLS)]


def _stage_border(stage: int) -> str:
    return _BORDERS[stage % len(_BORDERS)]


def _unit_stage(unit: Any, data: dict[str, Any], node_stage: dict[str, int]) -> int | None:
    """Stage of a planning unit: by its own name, else the most common stage of its members."""
    if str(unit) in node_stage:
        return node_stage[str(unit)]
    members = data.get("members") or ()
    if isinstance(members, str):
        members = (members,)
    found = Counter(node_stage[m] for m in members if m in node_stage)
    if not found:
        return None
    return min(found, key=lambda s: (-found[s], s))


def _edge_bytes(data: dict[str, Any], plan: Plan) -> int | None:
    b = data.get("bytes")
    if b is None:
        value = data.get("value")
        if isinstance(value, str) and value in plan.values:
            b = plan.values[value].nbytes
    return None if b is None else int(b)


def _header(plan: Plan, what: str) -> list[str]:
    title = (f"{plan.model}: {what}, {_plural(plan.num_stages, 'stage')}, schedule {plan.schedule}, "
             f"pipeline {plan.pipeline} x dp {plan.dp}")
    font = "Helvetica"
    graph_attrs = _attrs(rankdir="TB", label=title, labelloc="t", fontname=font)
    node_attrs = _attrs(shape="box", style="filled,rounded", fontname=font, fontsize="10")
    edge_attrs = _attrs(fontname=font, fontsize="9", color="#888888")
    return [
        "digraph fxpipe_partition {",
        f"  graph {graph_attrs};",
        f"  node {node_attrs};",
        f"  edge {edge_attrs};",
    ]


def _stage_caption(plan: Plan, pos: int, ranks: list[int], bpos: int) -> str:
    st = plan.stages[pos]
    cap = f"stage {st.index} (rank {ranks[pos]}): {_ms(st.time_s)} ms"
    return cap + ("  [bottleneck]" if pos == bpos else "")


def partition_dot(plan: Plan, graph: Any = None, max_members: int = 12) -> str:
    """Graphviz DOT text of the partition.

    With ``graph`` (the planner's ``networkx.DiGraph`` of planning units; node attributes
    ``members`` (FX node names) and optionally ``fwd_flops`` (FLOPs) and ``param_bytes`` (bytes);
    edge attributes ``bytes`` (per micro-batch) and ``value`` (FX name of the value carried)):
    one DOT node per unit (ids ``u0, u1, ...`` in the graph's node order; label = unit name plus
    its costs), filled with its stage's colour and placed in ``subgraph cluster_<stage>`` labelled
    with the stage's time; units in no stage (model inputs, unused parameters) are grey and outside
    the clusters. Edges whose endpoints are in different stages (cut edges) are red, bold and
    labelled with the bytes they move per micro-batch.

    Without ``graph``: one node per stage (``s<k>``), an ``input`` node for the model inputs and a
    ``loss`` node for the model output; one edge per (producer, consumer) stage pair from
    ``plan.values``, labelled with the values' names and bytes. Edges that skip stages are dashed.

    Args:
        plan: the plan.
        graph: optional networkx graph as above (any object with ``nodes(data=True)`` and
            ``edges(data=True)``).
        max_members: at most this many member names per unit are listed in its SVG tooltip.

    Returns:
        DOT text (every attribute value quoted and escaped), ending with a newline.
    """
    ranks = stage_ranks(plan)
    bpos = _bottleneck(plan)
    pos_of = {st.index: pos for pos, st in enumerate(plan.stages)}
    lines = (_unit_graph(plan, graph, ranks, bpos, pos_of, max_members) if graph is not None
             else _stage_graph(plan, ranks, bpos))
    return "\n".join(lines) + "\n"


def _unit_graph(plan: Plan, graph: Any, ranks: list[int], bpos: int, pos_of: dict[int, int],
                max_members: int) -> list[str]:
    node_stage = plan.stage_of_node()
    ids: dict[Any, str] = {}
    stage_of_unit: dict[Any, int | None] = {}
    by_stage: dict[int | None, list[str]] = {}
    for i, (unit, data) in enumerate(graph.nodes(data=True)):
        uid = f"u{i}"
        ids[unit] = uid
        s = _unit_stage(unit, data, node_stage)
        stage_of_unit[unit] = s
        label = [str(unit)]
        members = data.get("members") or ()
        if isinstance(members, str):
            members = (members,)
        if len(members) > 1:
            label.append(f"{len(members)} nodes")
        if data.get("fwd_flops"):
            label.append(f"{human_flops(data['fwd_flops'])}FLOP fwd")
        if data.get("param_bytes"):
            label.append(f"params {human_bytes(data['param_bytes'])}")
        shown = list(members)[:max_members]
        tip = ", ".join(str(m) for m in shown) + (" ..." if len(members) > len(shown) else "")
        attrs = _attrs(
            label="\n".join(label),
            fillcolor=_stage_fill(s) if s is not None else _UNASSIGNED_FILL,
            color=_stage_border(s) if s is not None else "#999999",
            tooltip=tip or str(unit),
        )
        by_stage.setdefault(s, []).append(f"{uid} {attrs};")

    lines = _header(plan, "planning units coloured by stage")
    for s in sorted(k for k in by_stage if k is not None):
        pos = pos_of.get(s)
        caption = (_stage_caption(plan, pos, ranks, bpos) if pos is not None
                   else f"stage {s} (not in plan)")
        lines.append(f"  subgraph cluster_{s} {{")
        cluster_attrs = _attrs(label=caption, style="rounded", color=_stage_border(s),
                               penwidth="3" if pos == bpos else "1")
        lines.append(f"    graph {cluster_attrs};")
        lines += [f"    {n}" for n in by_stage[s]]
        lines.append("  }")
    lines += [f"  {n}" for n in by_stage.get(None, [])]

    for a, b, data in graph.edges(data=True):
        sa, sb = stage_of_unit.get(a), stage_of_unit.get(b)
        nbytes = _edge_bytes(data, plan)
        if sa is not None and sb is not None and sa != sb:
            text = human_bytes(nbytes) if nbytes is not None else "? B"
            value = data.get("value")
            tip = f"{value}: {text}" if value else text
            attrs = _attrs(label=text, color=_CUT_COLOR, fontcolor=_CUT_COLOR, penwidth="2",
                           tooltip=tip)
        elif sa is None or sb is None:
            attrs = _attrs(style="dashed")
        else:
            attrs = ""
        lines.append(f"  {ids[a]} -> {ids[b]}" + (f" {attrs}" if attrs else "") + ";")
    lines.append("}")
    return lines


def _stage_graph(plan: Plan, ranks: list[int], bpos: int) -> list[str]:
    lines = _header(plan, "stage graph")
    known = {st.index for st in plan.stages}
    for pos, st in enumerate(plan.stages):
        label = "\n".join([
            _stage_caption(plan, pos, ranks, bpos),
            f"{len(st.nodes)} nodes, {len(st.params)} params ({human_bytes(st.param_bytes)})",
            f"fwd {human_flops(st.fwd_flops)}FLOP, bwd {human_flops(st.bwd_flops)}FLOP",
            f"memory {human_bytes(st.memory_bytes)}",
        ])
        lines.append(f"  s{st.index} " + _attrs(
            label=label, fillcolor=_stage_fill(st.index), color=_stage_border(st.index),
            penwidth="3" if pos == bpos else "1") + ";")
    for nid, text in (("input", "model inputs"), ("loss", "loss")):
        lines.append(f"  {nid} " + _attrs(label=text, shape="ellipse", fillcolor=_UNASSIGNED_FILL)
                     + ";")

    def node(stage: int) -> str:
        return "input" if stage == MODEL_INPUT else f"s{stage}"

    pairs: dict[tuple[int, int], list[tuple[str, int]]] = {}
    for name, vi in sorted(plan.values.items()):
        for c in vi.consumers:
            if c != vi.producer:
                pairs.setdefault((vi.producer, c), []).append((name, vi.nbytes))
    for (p, c), vals in sorted(pairs.items()):
        total = sum(n for _, n in vals)
        label = "\n".join(([f"total {human_bytes(total)}"] if len(vals) > 1 else [])
                          + [f"{n} ({human_bytes(b)})" for n, b in vals])
        skip = p != MODEL_INPUT and c - p > 1
        lines.append(f"  {node(p)} -> {node(c)} " + _attrs(
            label=label,
            style="dashed" if (skip or p == MODEL_INPUT) else None,
            color=_CUT_COLOR if p != MODEL_INPUT else None,
            fontcolor=_CUT_COLOR if p != MODEL_INPUT else None,
        ) + ";")
    if plan.stages:
        out = plan.values.get(plan.model_output)
        if out is not None and out.producer in known:
            src, nbytes = out.producer, out.nbytes
        else:
            src = plan.stage_of_node().get(plan.model_output, plan.stages[-1].index)
            nbytes = out.nbytes if out is not None else None
        text = human_bytes(nbytes) if nbytes is not None else ""
        lines.append(f"  s{src} -> loss " + _attrs(label=text or None) + ";")
    lines.append("}")
    return lines


# ---------------------------------------------------------------------------- dump
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


def dump_plan(plan: Plan, out_dir: Path | str, graph: Any = None, *, render_svg: bool = True,
              timeout_s: float = 60.0, max_svg_units: int = 5000) -> list[Path]:
    """Write the plan's dumps into ``out_dir`` (created if missing).

    Files (only these; anything else in ``out_dir`` is left untouched):
        ``plan.json``: :meth:`Plan.save` (JSON round-trip with :meth:`Plan.load`).
        ``summary.txt``: :func:`summary_table`.
        ``partition.dot``: :func:`partition_dot` (unit graph when ``graph`` is given, else the
        stage graph).
        ``partition.svg``: rendered by Graphviz's ``dot`` when it is on ``PATH`` and
        ``render_svg`` is True. A failed or timed-out render is a ``RuntimeWarning``, not an
        error (the other files are still written). When no SVG is rendered, a ``partition.svg``
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
        Paths written, in the order plan.json, summary.txt, partition.dot[, partition.svg].

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
    svg_path = out_dir / "partition.svg"
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
