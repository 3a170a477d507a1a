"""Graphviz DOT text of a plan's partition (written by hand: no pydot or Graphviz binding).

Takes a :class:`~fxpipe.plans.plan.Plan` and, optionally, the planner's networkx graph of
planning units; gives DOT text. With the graph, every unit is a node filled with its stage's
colour, units are clustered per stage and cut edges are labelled with the bytes they move per
micro-batch; without it, a stage-level graph is drawn from ``plan.values`` (skip connections
included). Graphviz itself is optional and only renders the SVG (:mod:`fxpipe.plans.dump`).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from fxpipe.plans.summary import bottleneck_position
from fxpipe.plans.values import MODEL_INPUT
from fxpipe.units import human_bytes, human_flops, ms, plural

__all__ = ["partition_dot", "STAGE_FILLS", "STAGE_BORDERS"]


# Pastel fills, one per stage (cycled), and a stronger border colour of the same hue.
_FILLS = (
    "#a6cee3", "#b2df8a", "#fdbf6f", "#cab2d6", "#fb9a99", "#ffff99",
    "#8dd3c7", "#bebada", "#80b1d3", "#fccde5", "#d9d9d9", "#ccebc5",
)
_BORDERS = (
    "#1f78b4", "#33a02c", "#ff7f00", "#6a3d9a", "#e31a1c", "#b15928",
    "#1b9e77", "#7570b3", "#386cb0", "#e7298a", "#666666", "#4daf4a",
)
#: the stage palette every drawing shares (the pictures of :mod:`fxpipe.reports` too)
STAGE_FILLS, STAGE_BORDERS = _FILLS, _BORDERS
_UNASSIGNED_FILL = "#f0f0f0"  # units in no stage (model inputs, unused parameters)
_CUT_COLOR = "#d62728"


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


def _edge_bytes(data: dict[str, Any], plan: "Plan") -> int | None:
    b = data.get("bytes")
    if b is None:
        value = data.get("value")
        if isinstance(value, str) and value in plan.values:
            b = plan.values[value].nbytes
    return None if b is None else int(b)


def _header(plan: "Plan", what: str) -> list[str]:
    title = (f"{plan.model}: {what}, {plural(plan.num_stages, 'stage')}, schedule {plan.schedule}, "
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


def _stage_caption(plan: "Plan", pos: int, ranks: list[int], bpos: int) -> str:
    st = plan.stages[pos]
    cap = f"stage {st.index} (rank {ranks[pos]}): {ms(st.time_s)} ms"
    if getattr(st, "loss_time_s", 0.0) > 0:
        cap += f" (incl. loss {ms(st.loss_time_s)} ms)"
    return cap + ("  [bottleneck]" if pos == bpos else "")


def partition_dot(plan: "Plan", graph: Any = None, max_members: int = 12) -> str:
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
    ranks = plan.stage_ranks()
    bpos = bottleneck_position(plan)
    pos_of = {st.index: pos for pos, st in enumerate(plan.stages)}
    lines = (_unit_graph(plan, graph, ranks, bpos, pos_of, max_members) if graph is not None
             else _stage_graph(plan, ranks, bpos))
    return "\n".join(lines) + "\n"


def _unit_graph(plan: "Plan", graph: Any, ranks: list[int], bpos: int, pos_of: dict[int, int],
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


def _stage_graph(plan: "Plan", ranks: list[int], bpos: int) -> list[str]:
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
