"""What pricing a cut needs beyond the unit table, computed once per priced graph: the trained
parameters each unit reads (which ones several stages share, the shapes PowerSGD compresses)
and the values each stage rebuilds instead of receiving (the cones of
:mod:`fxpipe.partitioner.recompute`, whose copies run in every reader stage).

Both are read per cut: :func:`stage_params` (per stage, the bytes of parameters other stages use
too and the stage's parameter names) and :func:`rebuilt_seconds` (per stage, the seconds of the
cone copies it runs). A plan made from the cut lists the same parameters and runs the same
copies (:func:`fxpipe.partitioner.recompute.apply_recompute`), so the layout search and the
Plan's prediction price the same step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from fxpipe.partitioner.blocks import KEEP
from fxpipe.partitioner.boundaries import stage_boundaries
from fxpipe.partitioner.pricing import Priced
from fxpipe.partitioner.recompute import recompute_cones
from fxpipe.partitioner.split import build_stage_module
from fxpipe.tensor.analysis import VOCAB_PARALLEL_LOSSES, stage_sharding

__all__ = ["UnitParams", "unit_params", "stage_params", "rebuilt_seconds", "stage_tensor_comms"]


@dataclass
class UnitParams:
    """The trained parameters of the units, by the names the full model gives them.

    Attributes:
        names: per unit, the parameters it reads (tied ones under their canonical name).
        nbytes: parameter -> bytes one rank holds (a tensor-parallel shard's share).
        shapes: parameter -> whole shape.
        spread: the parameters read by several units: ``(name, unit positions)``.
        first: parameter -> the first unit reading it (the one its bytes are charged to).
    """

    names: list[tuple[str, ...]]
    nbytes: dict[str, float]
    shapes: dict[str, tuple[int, ...]]
    spread: list[tuple[str, tuple[int, ...]]]
    first: dict[str, int]


def _param_tensors(pr: Priced) -> tuple[dict[str, float], dict[str, tuple[int, ...]]]:
    """Bytes (at ``pr``'s tensor degree) and whole shape of every parameter of the trace, by
    canonical FQN of the traced model."""
    traced = pr.traced
    sharded = pr.tensor.choice.params if pr.tensor is not None else {}
    t = pr.degree
    nbytes: dict[str, float] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for n in traced.gm.graph.nodes:
        if n.op != "get_attr" or n.target not in traced.param_fqns:
            continue
        fqn = traced.param_fqns[n.target]
        if fqn in traced.buffer_fqns or fqn in nbytes:
            continue
        v = n.meta.get("val")
        if v is None or not hasattr(v, "numel"):
            try:
                v = traced.gm.get_parameter(n.target)
            except AttributeError:
                continue
        size = float(v.numel() * v.element_size())
        p = sharded.get(n.target)
        nbytes[fqn] = size / t if p is not None and p.sharded else size
        shapes[fqn] = tuple(int(d) for d in v.shape)
    return nbytes, shapes


def unit_params(pr: Priced) -> UnitParams:
    """:class:`UnitParams` of ``pr``'s units (node-level, or folded: a block unit reads the
    representative block's parameters under its own block's names), computed once."""
    got = pr.cache.get("unit_params")
    if got is not None:
        return got
    pg, fo = pr.pg, pr.table.folding
    g = pg.graph
    nbytes, shapes = _param_tensors(pr)
    if fo is None:
        names = [tuple(g.nodes[u]["params"]) for u in pg.order]
    else:
        run = fo.run
        rep_prefix = f"{run.block(run.start + KEEP - 1)}."
        rep = list(dict.fromkeys(f for p_ in fo.block_units[-1]
                                 for f in g.nodes[pg.order[p_]]["params"]
                                 if f.startswith(rep_prefix)))
        full_bytes, full_shapes = {}, {}
        for f, b in nbytes.items():
            full_bytes[run.full_name(f)], full_shapes[run.full_name(f)] = b, shapes[f]
        names = []
        for p_ in fo.prologue:
            names.append(tuple(run.full_name(f) for f in g.nodes[pg.order[p_]]["params"]))
        for b in range(run.count):
            at = f"{run.block(run.start + b)}."
            block = tuple(at + f[len(rep_prefix):] for f in rep)
            for f, r in zip(block, rep):
                full_bytes[f], full_shapes[f] = nbytes[r], shapes[r]
            names.append(block)
        for p_ in fo.epilogue:
            names.append(tuple(run.full_name(f) for f in g.nodes[pg.order[p_]]["params"]))
        nbytes, shapes = full_bytes, full_shapes
    where: dict[str, list[int]] = {}
    for pos, ns in enumerate(names):
        for f in ns:
            where.setdefault(f, []).append(pos)
    spread = [(f, tuple(ps)) for f, ps in where.items() if len(ps) > 1]
    out = UnitParams(names, nbytes, shapes, spread, {f: ps[0] for f, ps in where.items()})
    pr.cache["unit_params"] = out
    return out


def _copied_params(pr: Priced, stage_of: Sequence[int], k: int) -> list[dict[str, None]]:
    """Per stage, the parameters its copies of rebuilt values read (an embedding table in the
    cone of a value rebuilt there: the stage then holds it too, as a tied one)."""
    per: list[dict[str, None]] = [{} for _ in range(k)]
    for producer, users, _, params in _rebuilt(pr):
        home = stage_of[producer]
        for s in {stage_of[u] for u in users} - {home}:
            per[s].update(dict.fromkeys(params))
    return per


def stage_params(pr: Priced, stage_of: Sequence[int], k: int, names: bool = False
                 ) -> tuple[list[float], list[list[str]] | None]:
    """Per stage of the cut ``stage_of`` (unit -> stage): the bytes of the parameters charged
    to it (their first reader) that another stage reads too (its units, or its copies of
    rebuilt values), and, with ``names``, the parameters it reads (each once)."""
    up = unit_params(pr)
    copied = _copied_params(pr, stage_of, k)
    shared = [0.0] * k
    spread = {f: positions for f, positions in up.spread}
    for f in {f for d in copied for f in d}:
        spread.setdefault(f, (up.first[f],) if f in up.first else ())
    for f, positions in spread.items():
        if not positions:
            continue
        stages = {stage_of[p] for p in positions} | {s for s in range(k) if f in copied[s]}
        if len(stages) > 1:
            shared[stage_of[positions[0]]] += up.nbytes.get(f, 0.0)
    if not names:
        return shared, None
    per: list[dict[str, None]] = [{} for _ in range(k)]
    for pos, ns in enumerate(up.names):
        for f in ns:
            per[stage_of[pos]].setdefault(f, None)
    for s in range(k):
        for f in copied[s]:
            per[s].setdefault(f, None)
    return shared, [list(d) for d in per]


def _rebuilt(pr: Priced) -> list[tuple[int, tuple[int, ...], tuple[str, ...], tuple[str, ...]]]:
    """The values each reader stage rebuilds: ``(producer unit, reader units, cone nodes,
    trained parameters the cone reads)`` (node-level units only: a plan of repeated blocks
    rebuilds them unpriced)."""
    got = pr.cache.get("rebuilt")
    if got is not None:
        return got
    out: list[tuple[int, tuple[int, ...], tuple[str, ...], tuple[str, ...]]] = []
    if pr.cheap and pr.table.folding is None:
        traced = pr.traced
        cones = recompute_cones(traced.gm)
        nodes = {n.name: n for n in traced.gm.graph.nodes}
        n = len(pr.pg.order)
        for row in pr.pg.values:
            if row.name in pr.cheap and row.name in cones:
                users = tuple(u for u in row.user_positions if u < n)
                if users:
                    params = tuple(dict.fromkeys(
                        f for c in cones[row.name] for f in traced.node_params(nodes[c])
                        if f not in traced.buffer_fqns))
                    out.append((row.producer_pos, users, tuple(cones[row.name]), params))
    pr.cache["rebuilt"] = out
    return out


def rebuilt_seconds(pr: Priced, stage_of: Sequence[int], k: int) -> list[np.ndarray]:
    """Per stage, the forward / input-gradient / weight-gradient seconds (per traced
    micro-batch) of the cone copies it runs: the union of the cones of the values it reads from
    another stage, each node once (as :func:`~fxpipe.partitioner.recompute.apply_recompute`
    copies them)."""
    out = [np.zeros(3) for _ in range(k)]
    rows = _rebuilt(pr)
    if not rows:
        return out
    nodes: list[dict[str, None]] = [{} for _ in range(k)]
    for producer, users, cone, _ in rows:
        home = stage_of[producer]
        for s in sorted({stage_of[u] for u in users} - {home}):
            nodes[s].update(dict.fromkeys(cone))
    for s in range(k):
        for name in nodes[s]:
            t = pr.times.get(name)
            if t is not None:
                out[s] += (t.fwd_s, t.bwd_input_s, t.bwd_weight_s)
    return out


def _range_comms(pr: Priced, a: int, b: int, loss_name: str | None) -> list:
    """The tensor group's collectives of one micro-batch of a stage holding units ``a..b-1``,
    as the runtime runs the stage (:func:`fxpipe.tensor.analysis.stage_sharding` over the
    stage's own graph: its inputs arrive whole, its outputs leave whole, a value split where
    a cut falls is gathered there); computed once per unit range."""
    return [c for comms in _range_node_comms(pr, a, b, loss_name).values() for c in comms]


def _range_node_comms(pr: Priced, a: int, b: int, loss_name: str | None) -> dict[str, list]:
    """:func:`_range_comms` node by node (the stage graph's node names: the traced graph's,
    and ``output`` for what leaves the stage)."""
    key = ("comms", a, b)
    got = pr.cache.get(key)
    if got is not None:
        return got
    tp, traced, pg = pr.tensor, pr.traced, pr.pg
    g, order = pg.graph, pg.order
    where = {}
    for pos, u in enumerate(order):
        s = 0 if pos < a else (1 if pos < b else 2)
        for m in g.nodes[u]["members"]:
            where[m] = s
    used = sorted(set(where.values()))
    number = {s: i for i, s in enumerate(used)}
    bounds = stage_boundaries(traced.gm, {m: number[s] for m, s in where.items()}, len(used))
    me = number[1]
    mod = build_stage_module(traced.gm, bounds, me)
    sb = bounds.stages[me]
    canon = {traced.param_fqns.get(k, k): v for k, v in tp.choice.params.items()}
    placements = {n.target: tp.choice.params.get(n.target, canon.get(n.target))
                  for n in mod.graph.nodes if n.op == "get_attr"}
    placements = {k: v for k, v in placements.items() if v is not None}
    received = {v for v in sb.inputs if v not in bounds.model_inputs and v not in pr.cheap}
    logits = None
    model_output = bounds.model_outputs[0]
    if loss_name in VOCAB_PARALLEL_LOSSES and model_output in sb.outputs:
        out = next(iter(mod.graph.find_nodes(op="output"))).args[0]
        outs = out if isinstance(out, (tuple, list)) else (out,)
        logits = outs[sb.outputs.index(model_output)]
    sharding = stage_sharding(mod, placements, tp.t, sequence_parallel=tp.sequence_parallel,
                              received=received, logits=logits)
    comms = {n: list(ns.comm) for n, ns in sharding.nodes.items() if ns.comm}
    pr.cache[key] = comms
    return comms


def stage_tensor_comms(pr: Priced, cuts: Sequence[int], loss_name: str | None
                       ) -> tuple[list[list], list[np.ndarray]] | None:
    """Under tensor parallelism, per stage of the cut (stage starts ``cuts`` over the units):
    the collectives the runtime's per-stage analysis runs, and the forward / input-gradient
    seconds they take beyond what the units' prices hold (the traced graph's collectives of the
    stage's nodes): the gathers and slices where a cut splits a sharded value, and any decision
    a stage's whole inputs change. For units that are repeated blocks, see
    :func:`_folded_stage_comms`. None at degree 1."""
    tp = pr.tensor
    if tp is None:
        return None
    ends = list(cuts[1:]) + [len(pr.table.names)]
    g, order = pr.pg.graph, pr.pg.order
    fo = pr.table.folding
    lists, extra = [], []
    for a, b in zip(cuts, ends):
        if fo is None:
            comms = _range_comms(pr, a, b, loss_name)
            positions = list(range(a, b))
        else:
            comms, positions = _folded_stage_comms(pr, a, b, loss_name)
        fs, bs = tp.seconds(comms)
        had_f = had_b = 0.0
        for pos in positions:
            for m in g.nodes[order[pos]]["members"]:
                f, bw = tp.comm_s.get(m, (0.0, 0.0))
                had_f, had_b = had_f + f, had_b + bw
        lists.append(comms)
        extra.append(np.array([fs - had_f, bs - had_b, 0.0]))
    return lists, extra


def _folded_stage_comms(pr: Priced, a: int, b: int, loss_name: str | None
                        ) -> tuple[list, list[int]]:
    """The collectives of a stage holding folded units ``a..b-1`` (prologue nodes, ``k``
    blocks, epilogue nodes), and the positions of the reduced graph whose priced collectives
    the units hold (a block counts its representative's, once per block).

    The runtime's per-stage analysis over stretches of the reduced graph (two kept blocks)
    that have the stage's ends: a stage's first block reads the prologue's output where the
    stage holds the prologue or starts the model's run of blocks (the first kept block does
    too), else a previous block's output received whole (the second kept block does); its
    last block is followed by the stage's epilogue part or a cut (the second kept block, or
    the first when it is the only one). Every block between the first and the last adds the
    collectives of the representative block as the whole reduced graph runs it (between two
    blocks, as in the middle of a stage)."""
    fo = pr.table.folding
    n_pro, count = len(fo.prologue), fo.run.count
    pro = [fo.prologue[u] for u in range(a, min(b, n_pro))]
    epi = [fo.epilogue[u - n_pro - count] for u in range(max(a, n_pro + count), b)]
    k = max(0, min(b, n_pro + count) - max(a, n_pro))
    g, order = pr.pg.graph, pr.pg.order
    rep = fo.block_units[-1]
    owned = pro + rep * k + epi
    start = [min(units) for units in fo.block_units]
    end = [start[1] - 1, (min(fo.epilogue) if fo.epilogue else len(order)) - 1]

    def members(lo: int, hi: int) -> set[str]:
        return {m for p in range(lo, hi + 1) for m in g.nodes[order[p]]["members"]}

    def flat(per: dict[str, list], skip: set[str] = frozenset(), only: set[str] | None = None
             ) -> list:
        return [c for n, cs in per.items() if n not in skip and (only is None or n in only)
                for c in cs]

    if k == 0:
        lo, hi = (pro or epi)[0], (pro or epi)[-1]
        return _range_comms(pr, lo, hi + 1, loss_name), owned
    tail = epi[-1] if epi else end[1]
    if pro or a == n_pro:  # the first block reads the prologue's output, as the first kept one
        lo = pro[0] if pro else start[0]
        if k >= 2:
            comms = _range_comms(pr, lo, tail + 1, loss_name)
        elif not epi:
            comms = _range_comms(pr, lo, end[0] + 1, loss_name)
        else:  # a run of one block (not folded in practice): the second kept one left out
            comms = flat(_range_node_comms(pr, lo, tail + 1, loss_name),
                         skip=members(start[1], end[1]))
    elif k == 1:  # the first block reads a block's output, received whole: the second kept
        return _range_comms(pr, start[1], tail + 1, loss_name), owned
    else:  # that block as it starts a stage, then as it ends one after a block
        comms = (flat(_range_node_comms(pr, start[1], end[1] + 1, loss_name),
                      only=members(start[1], end[1]))
                 + flat(_range_node_comms(pr, start[0], tail + 1, loss_name),
                        skip=members(start[0], end[0])))
    nodes = pr.tensor.sharding.nodes
    between = [c for p in rep for m in g.nodes[order[p]]["members"] if m in nodes
               for c in nodes[m].comm]
    return comms + between * max(0, k - 2), owned
