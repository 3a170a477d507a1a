"""The partition picture: the model at block granularity, one column per stage.

Takes a :class:`~fxpipe.plans.plan.Plan` and, when the caller has it, the planner's graph of
planning units (any object with ``nodes(data=True)`` / ``edges(data=True)``, read as plain
data: each unit's ``module`` path, which the partitioner takes from the FX nodes'
``nn_module_stack``, its ``members``, ``fwd_flops``, ``bwd_flops``, ``param_bytes``; each
edge's ``values``). Gives a :class:`BlockView` (plain data) and a matplotlib figure of it:

* units are grouped into **blocks** by module path (:func:`block_name`: ``h.3.attn.qkv`` ->
  ``h.3``, ``transformer.wte`` stays, the model's own top-level ops are ``(top level)``), per
  stage, stacked top to bottom in execution order in the stage's column;
* each block is coloured by its cost (forward + backward FLOPs per micro-batch, colour bar);
* cut edges (values crossing a stage boundary) are red arrows labelled with the bytes they
  move per micro-batch, drawn from the producing block to the first block of the later stage
  that reads them (so the labels of a stage pair add up to what crosses it);
* under each column: the stage's predicted time per micro-batch (compute + comm), its peak
  memory and a bar of its time against the slowest stage; the **bottleneck** column is outlined
  in red and labelled.

A plan made as repeated blocks (``plan.folded``) has no nodes per stage: its blocks come from
the fold record (``run``: the block container, ``blocks``: the stage of each block,
``prologue`` / ``epilogue``: the nodes before / after them), each block priced as the stage
FLOPs shared out (``≈``: identical blocks cost the same; a stage of blocks only gives the
exact figure). Without a graph, each stage is one box. A column with more than ``max_boxes``
blocks shows runs of numbered blocks as ranges (``h.0-h.11``).

SVG ids: ``stage-column-<k>`` (one per stage), ``stage-caption-<k>``, ``block-<k>-<i>``,
``cut-<a>-<b>-<j>``, ``bottleneck``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fxpipe.plans.summary import bottleneck_position
from fxpipe.plans.values import MODEL_INPUT
from fxpipe.reports.figures import (new_figure, save_figure, stage_border, stage_fill, styled,
                                    text_color_on)
from fxpipe.units import human_bytes, human_flops, ms, plural

if TYPE_CHECKING:  # annotations only
    from fxpipe.plans.plan import Plan

__all__ = ["Block", "CutEdge", "BlockView", "block_name", "block_view", "partition_figure",
           "write_partition_picture", "TOP_LEVEL"]

#: block name of the ops the model's own ``forward`` runs (module path ``""``)
TOP_LEVEL = "(top level)"


@dataclass
class Block:
    """A group of planning units of one stage that share a module path prefix.

    Attributes:
        name: the block's module path (``h.3``), :data:`TOP_LEVEL`, or a range ``h.0-h.11``.
        stage: stage index.
        flops: forward + backward FLOPs per micro-batch.
        param_bytes: bytes of the parameters charged to the block.
        units: planning units (FX nodes) in it (0 when unknown, for folded plans).
        order: position of its first unit (sorting key inside the column).
        estimated: the costs are shared out from the stage's (folded plans).
        count: blocks merged into this box (a range), 1 otherwise.
    """

    name: str
    stage: int
    flops: float
    param_bytes: int = 0
    units: int = 0
    order: float = 0.0
    estimated: bool = False
    count: int = 1


@dataclass
class CutEdge:
    """Values that cross from one stage's block to a later stage's block.

    ``src`` / ``dst``: ``(stage position, block index in its column)``; ``nbytes``: bytes per
    micro-batch; ``values``: their names (FX node names)."""

    src: tuple[int, int]
    dst: tuple[int, int]
    nbytes: int
    values: list[str] = field(default_factory=list)


@dataclass
class BlockView:
    """The picture's data: ``columns[pos]`` lists the blocks of ``plan.stages[pos]``; ``edges``
    the cut edges; ``source``: ``"units"`` (a unit graph), ``"folded"`` or ``"stages"``."""

    columns: list[list[Block]]
    edges: list[CutEdge]
    source: str


_NUMBERED = re.compile(r"^(.*?)(\d+)$")


def block_name(module_path: str) -> str:
    """The block a module path belongs to: up to its first numeric component (the child of a
    ``ModuleList`` / ``Sequential``: ``h.3.attn.qkv`` -> ``h.3``, ``transformer.h.0.mlp`` ->
    ``transformer.h.0``), else its first two components (``transformer.wte``, ``lm_head``);
    ``""`` (the model's own forward) -> :data:`TOP_LEVEL`."""
    if not module_path:
        return TOP_LEVEL
    parts = module_path.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[:i + 1])
    return ".".join(parts[:2])


# ---------------------------------------------------------------------------- the view
def block_view(plan: "Plan", graph: Any = None, max_boxes: int = 18) -> BlockView:
    """Group the plan's partition into blocks per stage (see the module docstring).

    Args:
        plan: the plan.
        graph: the planner's unit graph (``plan_from_spec``'s second value), or None.
        max_boxes: columns with more blocks show numbered runs as ranges.
    """
    if plan.folded:
        view = _folded_view(plan)
    elif graph is not None:
        view = _unit_view(plan, graph)
    else:
        view = _stage_view(plan)
    return _collapse(view, max_boxes)


def _unit_stage(unit: Any, data: dict, node_stage: dict[str, int]) -> int | None:
    if str(unit) in node_stage:
        return node_stage[str(unit)]
    members = data.get("members") or ()
    found = [node_stage[m] for m in ([members] if isinstance(members, str) else members)
             if m in node_stage]
    return min(found, key=lambda s: (-found.count(s), s)) if found else None


def _unit_view(plan: "Plan", graph: Any) -> BlockView:
    node_stage = plan.stage_of_node()
    pos_of = {st.index: i for i, st in enumerate(plan.stages)}
    keys: dict[tuple[int, str], Block] = {}
    unit_block: dict[Any, tuple[int, str]] = {}
    for i, (unit, data) in enumerate(graph.nodes(data=True)):
        s = _unit_stage(unit, data, node_stage)
        if s is None or s not in pos_of:
            continue
        key = (pos_of[s], block_name(str(data.get("module") or "")))
        b = keys.get(key)
        if b is None:
            b = keys[key] = Block(key[1], s, 0.0, 0, 0, float(data.get("pos", i)))
        b.flops += float(data.get("fwd_flops", 0) or 0) + float(data.get("bwd_flops", 0) or 0)
        b.param_bytes += int(data.get("param_bytes", 0) or 0)
        b.units += 1
        unit_block[unit] = key
    columns: list[list[Block]] = [[] for _ in plan.stages]
    for (pos, _), b in keys.items():
        columns[pos].append(b)
    for col in columns:
        col.sort(key=lambda b: b.order)
    index = {(pos, b.name): i for pos, col in enumerate(columns) for i, b in enumerate(col)}
    # values crossing stages, per (producer block, consumer stage): the consumer end is the
    # first block of that stage reading one of them
    crossing: dict[tuple[tuple[int, str], int], dict[str, int]] = {}
    first_reader: dict[tuple[tuple[int, str], int], int] = {}
    for a, b, data in graph.edges(data=True):
        ka, kb = unit_block.get(a), unit_block.get(b)
        if ka is None or kb is None or ka[0] >= kb[0]:
            continue
        names = list(data.get("values") or ([data["value"]] if data.get("value") else []))
        sent = {}
        for v in names:
            info = plan.values.get(v)
            if info is not None and plan.stages[kb[0]].index in info.consumers:
                sent[v] = int(info.nbytes)
        if not names and data.get("bytes"):
            sent[f"{a}->{b}"] = int(data["bytes"])
        if not sent:
            continue  # recomputed in the later stage, not sent
        key = (ka, kb[0])
        crossing.setdefault(key, {}).update(sent)
        j = index[kb]
        first_reader[key] = min(first_reader.get(key, j), j)
    edges = [CutEdge((ka[0], index[ka]), (dst, first_reader[(ka, dst)]), sum(vals.values()),
                     sorted(vals)) for (ka, dst), vals in crossing.items()]
    edges.sort(key=lambda e: (e.src, e.dst))
    return BlockView(columns, edges, "units")


def _stage_flops(st) -> float:
    return float(st.fwd_flops) + float(st.bwd_flops)


def _folded_view(plan: "Plan") -> BlockView:
    rec = plan.folded
    run = rec.get("run", {})
    path, start = str(run.get("path", "blocks")), int(run.get("start", 0))
    block_stage = [int(s) for s in rec.get("blocks", [])]
    pro: dict[int, int] = {}
    for s in (rec.get("prologue") or {}).values():
        pro[int(s)] = pro.get(int(s), 0) + 1
    epi: dict[int, int] = {}
    for s in rec.get("epilogue") or []:
        epi[int(s)] = epi.get(int(s), 0) + 1
    pos_of = {st.index: i for i, st in enumerate(plan.stages)}
    per_stage = {st.index: [i for i, s in enumerate(block_stage) if s == st.index]
                 for st in plan.stages}
    shares = [(_stage_flops(st) / len(per_stage[st.index]), not pro.get(st.index)
               and not epi.get(st.index)) for st in plan.stages if per_stage[st.index]]
    exact = [f for f, pure in shares if pure]
    block_flops = min(exact) if exact else (min(f for f, _ in shares) if shares else 0.0)
    pb = [st.param_bytes / len(per_stage[st.index]) for st in plan.stages
          if per_stage[st.index] and not pro.get(st.index) and not epi.get(st.index)]
    block_params = int(min(pb)) if pb else 0
    columns: list[list[Block]] = [[] for _ in plan.stages]
    for st in plan.stages:
        col = columns[pos_of[st.index]]
        ks = per_stage[st.index]
        rest = max(0.0, _stage_flops(st) - block_flops * len(ks))
        rest_params = max(0, st.param_bytes - block_params * len(ks))
        n_pro, n_epi = pro.get(st.index, 0), epi.get(st.index, 0)
        both = max(1, n_pro + n_epi)
        if n_pro:
            col.append(Block(f"before {path}", st.index, rest * n_pro / both,
                             rest_params * n_pro // both, n_pro, -1.0, True))
        for k in ks:
            col.append(Block(f"{path}.{start + k}", st.index, block_flops, block_params, 0,
                             float(k), True))
        if n_epi:
            col.append(Block(f"after {path}", st.index, rest * n_epi / both,
                             rest_params * n_epi // both, n_epi, 1e9, True))
    return BlockView(columns, _stage_pair_edges(plan, columns), "folded")


def _stage_view(plan: "Plan") -> BlockView:
    columns = [[Block(f"stage {st.index}", st.index, _stage_flops(st), int(st.param_bytes),
                      len(st.nodes))] for st in plan.stages]
    return BlockView(columns, _stage_pair_edges(plan, columns), "stages")


def _stage_pair_edges(plan: "Plan", columns: list[list[Block]]) -> list[CutEdge]:
    """Cut edges between stages (no unit graph): last block of the producer's column to the
    first block of the consumer's."""
    pos_of = {st.index: i for i, st in enumerate(plan.stages)}
    pairs: dict[tuple[int, int], dict[str, int]] = {}
    for name, info in plan.values.items():
        if info.producer == MODEL_INPUT or info.producer not in pos_of:
            continue
        for c in info.consumers:
            if c != info.producer and c in pos_of and pos_of[c] > pos_of[info.producer]:
                pairs.setdefault((pos_of[info.producer], pos_of[c]), {})[name] = int(info.nbytes)
    if not pairs and plan.folded:  # values are named only once a worker resolves the plan:
        # the stages form a chain, each sending its send_bytes to the next
        return [CutEdge((a, max(0, len(columns[a]) - 1)), (a + 1, 0), int(st.send_bytes), [])
                for a, st in enumerate(plan.stages[:-1]) if st.send_bytes]
    return [CutEdge((a, max(0, len(columns[a]) - 1)), (b, 0), sum(v.values()), sorted(v))
            for (a, b), v in sorted(pairs.items())]


def _family(name: str) -> tuple[str, int] | None:
    m = _NUMBERED.match(name)
    return (m.group(1), int(m.group(2))) if m else None


def _collapse(view: BlockView, max_boxes: int) -> BlockView:
    """Columns longer than ``max_boxes``: consecutive numbered blocks of one container become
    ranges of about equal size, the edges re-pointed at the boxes that hold their ends."""
    remap: dict[tuple[int, int], tuple[int, int]] = {}
    columns = []
    for pos, col in enumerate(view.columns):
        if len(col) <= max_boxes:
            columns.append(col)
            remap.update({(pos, i): (pos, i) for i in range(len(col))})
            continue
        # runs of consecutive blocks of one family
        runs: list[list[int]] = []
        for i, b in enumerate(col):
            f = _family(b.name)
            prev = _family(col[runs[-1][-1]].name) if runs else None
            if f is not None and prev is not None and f[0] == prev[0] and f[1] == prev[1] + 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        numbered = sum(len(r) for r in runs if len(r) > 1)
        other = len(col) - numbered
        room = max(1, max_boxes - other)
        chunk = max(1, -(-numbered // room))
        new: list[Block] = []
        for r in runs:
            for k in range(0, len(r), chunk if len(r) > 1 else 1):
                part = [col[i] for i in r[k:k + chunk]] if len(r) > 1 else [col[r[k]]]
                for i in (r[k:k + chunk] if len(r) > 1 else [r[k]]):
                    remap[(pos, i)] = (pos, len(new))
                if len(part) == 1:
                    new.append(part[0])
                    continue
                first, last = part[0], part[-1]
                new.append(Block(f"{first.name}-{last.name}", first.stage,
                                 sum(b.flops for b in part), sum(b.param_bytes for b in part),
                                 sum(b.units for b in part), first.order,
                                 any(b.estimated for b in part), sum(b.count for b in part)))
        columns.append(new)
    merged: dict[tuple, CutEdge] = {}
    for e in view.edges:
        src, dst = remap.get(e.src, e.src), remap.get(e.dst, e.dst)
        if (src, dst) in merged:
            m = merged[(src, dst)]
            m.nbytes += e.nbytes
            m.values = sorted(set(m.values) | set(e.values))
        else:
            merged[(src, dst)] = CutEdge(src, dst, e.nbytes, list(e.values))
    return BlockView(columns, list(merged.values()), view.source)


# ---------------------------------------------------------------------------- the figure
def _flops_text(x: float) -> str:
    t = human_flops(x)
    return t + "FLOP" if t[-1].isalpha() else t + " FLOP"


def partition_figure(plan: "Plan", graph: Any = None, view: BlockView | None = None,
                     max_boxes: int = 18):
    """The partition picture (see the module docstring) as a matplotlib ``Figure``.

    Args:
        plan: the plan.
        graph: the planner's unit graph, or None (see :func:`block_view`).
        view: a ready :class:`BlockView` (instead of ``graph``).
        max_boxes: see :func:`block_view`.
    """
    import matplotlib
    from matplotlib import cm, colors
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle
    from matplotlib.ticker import FuncFormatter

    view = view or block_view(plan, graph, max_boxes)
    n = len(plan.stages)
    rows = max([len(c) for c in view.columns] + [1])
    ranks = plan.stage_ranks()
    bpos = bottleneck_position(plan)
    slowest = max([st.time_s for st in plan.stages] + [1e-30])
    col_w, box_h = 2.4, 0.42
    with styled():
        fig = new_figure(max(6.5, 1.6 + col_w * n), 2.9 + box_h * rows)
        ax = fig.add_axes((0.02, 0.02, 0.86, 0.86))
        ax.set_xlim(-0.05, n + 0.05)
        ax.set_ylim(rows + 2.7, -1.5)  # rows grow downwards; captions under the last row
        ax.axis("off")
        flops = [b.flops for col in view.columns for b in col]
        norm = colors.Normalize(vmin=0.0, vmax=max(flops + [1.0]))
        cmap = matplotlib.colormaps["YlOrRd"]
        centers: dict[tuple[int, int], tuple[float, float]] = {}
        seen: dict[str, int] = {}
        for col in view.columns:
            for b in col:
                seen[b.name] = seen.get(b.name, 0) + 1
        split = {name for name, k in seen.items() if k > 1 and name != TOP_LEVEL}
        for pos, st in enumerate(plan.stages):
            is_b = pos == bpos
            col = Rectangle((pos + 0.04, -0.95), 0.92, rows + 0.6, facecolor=stage_fill(st.index),
                            edgecolor="#d62728" if is_b else stage_border(st.index),
                            linewidth=3.0 if is_b else 1.0, alpha=0.35 if not is_b else 0.45,
                            zorder=0)
            col.set_gid(f"stage-column-{st.index}")
            ax.add_patch(col)
            t = getattr(plan, "tensor", 1)
            where = (f"rank {ranks[pos]}" if t == 1 else
                     f"pipe rank {ranks[pos]}: tensor group of {t}")
            head = ax.text(pos + 0.5, -1.15, f"stage {st.index}  ({where})",
                           ha="center", va="bottom", fontsize=10, fontweight="bold",
                           color=stage_border(st.index))
            head.set_gid(f"stage-header-{st.index}")
            if is_b:
                tag = ax.text(pos + 0.5, -0.72, "bottleneck", ha="center", va="center",
                              fontsize=8.5, fontweight="bold", color="white",
                              bbox=dict(boxstyle="round,pad=0.25", fc="#d62728", ec="none"))
                tag.set_gid("bottleneck")
            for i, b in enumerate(view.columns[pos]):
                y = i + 0.0
                fill = colors.to_hex(cmap(0.08 + 0.92 * norm(b.flops)))
                box = FancyBboxPatch((pos + 0.12, y - 0.36), 0.76, 0.72,
                                     boxstyle="round,pad=0.0,rounding_size=0.06",
                                     facecolor=fill, edgecolor=stage_border(st.index),
                                     linewidth=0.8, zorder=2)
                box.set_gid(f"block-{st.index}-{i}")
                ax.add_patch(box)
                approx = "≈" if b.estimated else ""
                detail = f"{approx}{_flops_text(b.flops)}"
                if b.count > 1:
                    detail = f"{b.count} blocks, " + detail
                elif b.units > 1:
                    detail = f"{b.units} units, " + detail
                name = b.name + (" (part)" if b.name in split else "")
                ax.text(pos + 0.5, y, f"{name}\n{detail}", ha="center", va="center",
                        fontsize=7.5, color=text_color_on(fill), zorder=3, linespacing=1.1)
                centers[(pos, i)] = (pos + 0.5, y)
            cap = (f"{ms(st.time_s)} ms / micro-batch\ncompute {ms(st.compute_time_s)} + comm "
                   f"{ms(st.comm_time_s)} ms\nmemory {human_bytes(st.memory_bytes)}")
            if st.tensor_bytes:  # the tensor group's collectives, in the compute above
                cap += (f"\ntensor group: {st.tensor_collectives} collectives, "
                        f"{human_bytes(sum(st.tensor_bytes))}")
            t = ax.text(pos + 0.5, rows + 0.05, cap, ha="center", va="top", fontsize=8.5,
                        color="#d62728" if is_b else "#222222",
                        fontweight="bold" if is_b else "normal", linespacing=1.3)
            t.set_gid(f"stage-caption-{st.index}")
            frac = st.time_s / slowest
            ax.add_patch(Rectangle((pos + 0.12, rows + 1.75), 0.76, 0.32, facecolor="#eeeeee",
                                   edgecolor="none", zorder=1))
            ax.add_patch(Rectangle((pos + 0.12, rows + 1.75), 0.76 * frac, 0.32,
                                   facecolor="#d62728" if is_b else stage_border(st.index),
                                   edgecolor="none", zorder=2))
            ax.text(pos + 0.5, rows + 2.3, f"{100 * frac:.0f} % of the slowest", ha="center",
                    va="top", fontsize=7, color="#555555")
        placed: list[tuple[float, float]] = []
        for j, e in enumerate(view.edges):
            if e.src not in centers or e.dst not in centers:
                continue
            (x0, y0), (x1, y1) = centers[e.src], centers[e.dst]
            skip = e.dst[0] - e.src[0] > 1
            arrow = FancyArrowPatch((x0 + 0.38, y0), (x1 - 0.38, y1), arrowstyle="-|>",
                                    mutation_scale=11, color="#d62728", linewidth=1.6,
                                    connectionstyle=f"arc3,rad={-0.18 if skip else 0.0}",
                                    zorder=4, linestyle="--" if skip else "-")
            arrow.set_gid(f"cut-{plan.stages[e.src[0]].index}-{plan.stages[e.dst[0]].index}-{j}")
            ax.add_patch(arrow)
            # the label sits in the gap right of the producing column, at the arrow's height
            # there; labels that would overlap are pushed down
            lx = e.src[0] + 1.0
            ly = y0 + (y1 - y0) * (lx - (x0 + 0.38)) / max(1e-9, (x1 - 0.38) - (x0 + 0.38))
            ly = ly - (0.4 if skip else 0.0)
            while any(abs(px - lx) < 0.3 and abs(py - ly) < 0.75 for px, py in placed):
                ly += 0.78
            placed.append((lx, ly))
            what = ("" if not e.values else "\n" + e.values[0] if len(e.values) == 1
                    else "\n" + plural(len(e.values), "value"))
            ax.text(lx, ly, f"{human_bytes(e.nbytes)}{what}", ha="center", va="center",
                    fontsize=7, color="#d62728", zorder=5, linespacing=1.05,
                    bbox=dict(boxstyle="round,pad=0.2", fc="white", ec="#d62728", lw=0.6))
        cax = fig.add_axes((0.90, 0.25, 0.018, 0.5))
        sm = cm.ScalarMappable(norm=norm, cmap=cmap)
        bar = fig.colorbar(sm, cax=cax, format=FuncFormatter(lambda v, _: _flops_text(v)))
        bar.set_label("fwd + bwd FLOPs per micro-batch" + (" (≈ shared out)" if
                                                           view.source == "folded" else ""))
        pred = plan.predicted
        what = {"units": "blocks by module path", "folded": "planned as repeated blocks",
                "stages": "stages (no unit graph)"}[view.source]
        tp = (f" x tensor {plan.tensor}" + (" (sequence parallel)" if plan.sequence_parallel
                                             else "")) if getattr(plan, "tensor", 1) > 1 else ""
        title = (f"{plan.model}: {plural(n, 'stage')} on {plural(plan.pipeline, 'pipeline rank')}"
                 f" x dp {plan.dp}{tp}, {plan.schedule}, {plan.microbatches} micro-batch"
                 f"{'' if plan.microbatches == 1 else 'es'}  |  {what}")
        if pred is not None:
            title += (f"\npredicted step {ms(pred.step_time_s)} ms, bubble "
                      f"{100 * pred.bubble_fraction:.1f} %; red arrows: bytes per micro-batch "
                      "crossing a cut")
        fig.suptitle(title, x=0.02, ha="left", y=0.995, va="top", fontsize=10)
    return fig


def write_partition_picture(plan: "Plan", out_dir: str | Path, graph: Any = None,
                            stem: str = "partition") -> list[Path]:
    """Draw :func:`partition_figure` and write ``<stem>.png`` and ``<stem>.svg`` into
    ``out_dir``. Returns the paths."""
    return save_figure(partition_figure(plan, graph), out_dir, stem)
