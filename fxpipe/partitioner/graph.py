"""The priced graph the planner cuts: a networkx DiGraph of planning units in a topological order.

A planning **unit** is one FX compute node; a multi-output node (``aten.split``, an fx
``x.shape``) and the ``getitem`` nodes that unpack it form ONE unit, so a tuple never crosses a
stage boundary. Placeholders (model inputs) and ``get_attr`` nodes (parameters) are not units:
inputs are fed by the data loader to every stage that reads them, parameters live with the
units that read them.

Positions: units are numbered ``0 .. n-1`` in FX graph order (a topological order). A stage is
a contiguous range of positions; "a cut at position p" means a boundary between ``order[p]`` and
``order[p+1]``. Position ``n`` (= ``len(order)``) stands for the model output / loss, which lives
on the last stage.

Reference: chains-on-chains partitioning over a topological order (Pinar & Aykanat, "Fast optimal
load balancing algorithms for 1D partitioning", JPDC 2004) needs exactly this: per-unit costs in a
line, plus every value's producer and users so that cut edges (skip connections included) can be
priced.
"""

from __future__ import annotations

import operator
import warnings
from dataclasses import dataclass, field
from typing import NamedTuple

import networkx as nx
import torch
import torch.fx

from fxpipe.errors import PlanError
from fxpipe.partitioner.cost import NodeCost, value_bytes
from fxpipe.partitioner.trace import COMPUTE_OPS, TracedModel, module_path_of

__all__ = ["PricedGraph", "ValueRow", "build_graph", "values_table"]


class ValueRow(NamedTuple):
    """A value that may cross a cut: ``(producer_pos, user_positions, nbytes, name)``.

    ``user_positions`` is sorted, without duplicates, excludes the producer's own position, and
    contains ``len(order)`` when the value is a model output (the loss reads it on the last
    stage). ``nbytes`` is the size for one micro-batch; ``name`` is the FX node name.
    """

    producer_pos: int
    user_positions: list[int]
    nbytes: int
    name: str


@dataclass
class PricedGraph:
    """Planning units with costs, their data dependencies, and the user's annotations.

    Attributes:
        graph: ``networkx.DiGraph``. Node key: the unit's name (its producer's FX node name).
            Node attributes: ``pos`` (int), ``fwd_flops``, ``bwd_flops``, ``bwd_weight_flops``
            (FLOPs per micro-batch), ``param_bytes``, ``buffer_bytes`` (each tensor charged once
            overall, to its first unit), ``params`` / ``buffers`` (canonical FQNs the unit reads,
            including tied ones charged elsewhere), ``saved_bytes``, ``out_bytes`` (bytes),
            ``members`` (FX node names, producer first), ``module`` (innermost module path,
            ``""`` for the root), ``inputs`` (model-input placeholder names the unit reads).
            Edge ``u -> v`` attributes: ``bytes`` (sum over distinct values u sends v),
            ``value`` (first such FX node name), ``values`` (all of them).
            Graph attributes: ``model``, ``model_inputs``, ``model_outputs``.
        order: unit names in FX order, a topological order of ``graph``.
        pos: unit name -> position in ``order``.
        unit_of: FX compute node name -> unit name (getitems map to their producer's unit).
        forced_cuts: sorted positions p with a ``pipe_split()`` right after unit ``order[p]``.
        pins: position -> stage, from ``fxpipe.annotate``.
        input_users: model input name -> sorted positions of the units that read it.
        values: see :func:`values_table`.
        traced: the TracedModel the graph was built from.
        costs: the per-FX-node costs it was built from.
    """

    graph: nx.DiGraph
    order: list[str]
    pos: dict[str, int]
    unit_of: dict[str, str]
    forced_cuts: list[int] = field(default_factory=list)
    pins: dict[int, int] = field(default_factory=dict)
    input_users: dict[str, list[int]] = field(default_factory=dict)
    values: list[ValueRow] = field(default_factory=list)
    traced: TracedModel | None = None
    costs: dict[str, NodeCost] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.order)

    def value_info(self, name: str) -> tuple[list[int], str, int]:
        """``(shape, dtype, nbytes)`` of the value FX node ``name`` produces (one micro-batch).

        dtype is the torch dtype name without ``torch.`` (``"float32"``); non-tensor values
        (Python ints from shape arithmetic under ``tracer="fx"``) give ``([], type name, 0)``.

        Raises:
            KeyError: no such node.
        """
        if self.traced is None:
            raise KeyError(f"{name!r}: this PricedGraph has no traced model attached")
        v = self.traced.node(name).meta.get("val")
        if isinstance(v, torch.Tensor):
            return list(v.shape), str(v.dtype).replace("torch.", ""), value_bytes(v)
        return [], type(v).__name__, value_bytes(v)

    def unit_attr_list(self, attr: str) -> list:
        """``[graph.nodes[u][attr] for u in order]``: e.g. per-position FLOPs for the planner."""
        return [self.graph.nodes[u][attr] for u in self.order]


def _is_multi(node: torch.fx.Node) -> bool:
    return isinstance(node.meta.get("val"), (tuple, list))


def _is_getitem(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def build_graph(traced: TracedModel, costs: dict[str, NodeCost]) -> PricedGraph:
    """Build the priced planning graph from a traced model and its node costs.

    Args:
        traced: from :func:`fxpipe.partitioner.trace.trace`.
        costs: from :func:`fxpipe.partitioner.cost.price` (FX node name -> NodeCost).

    Returns:
        A :class:`PricedGraph`.

    Raises:
        PlanError: ``costs`` lacks a compute node of ``traced`` (price the same traced model).
    """
    gm = traced.gm
    nodes = list(gm.graph.nodes)
    missing = [n.name for n in nodes if n.op in COMPUTE_OPS and n.name not in costs]
    if missing:
        raise PlanError(f"costs has no entry for FX nodes {missing[:5]} (of {len(missing)}); "
                        f"pass price(traced) of the same TracedModel to build_graph")

    # --- units
    unit_of: dict[str, str] = {}
    members: dict[str, list[str]] = {}
    order: list[str] = []
    for n in nodes:
        if n.op not in COMPUTE_OPS:
            continue
        src = n.args[0] if _is_getitem(n) and n.args else None
        if isinstance(src, torch.fx.Node) and src.name in unit_of and _is_multi(src):
            u = unit_of[src.name]
            unit_of[n.name] = u
            members[u].append(n.name)
        else:
            unit_of[n.name] = n.name
            members[n.name] = [n.name]
            order.append(n.name)
    pos = {u: i for i, u in enumerate(order)}
    by_name = {n.name: n for n in nodes}

    g = nx.DiGraph(model=traced.model_name, model_inputs=list(traced.input_names),
                   model_outputs=list(traced.output_names))
    buffer_set = traced.buffer_fqns
    for u in order:
        mem = members[u]
        head = by_name[u]
        params: list[str] = []
        for m in mem:
            for fqn in traced.node_params(by_name[m]):
                if fqn not in params:
                    params.append(fqn)
        inputs = sorted({a.name for m in mem for a in by_name[m].all_input_nodes
                         if a.op == "placeholder"})
        c = [costs[m] for m in mem]
        g.add_node(
            u, pos=pos[u],
            fwd_flops=sum(x.fwd_flops for x in c),
            bwd_flops=sum(x.bwd_flops for x in c),
            bwd_weight_flops=sum(x.bwd_weight_flops for x in c),
            param_bytes=sum(x.param_bytes for x in c),
            buffer_bytes=sum(x.buffer_bytes for x in c),
            params=[p for p in params if p not in buffer_set],
            buffers=[p for p in params if p in buffer_set],
            saved_bytes=sum(x.saved_bytes for x in c),
            out_bytes=costs[u].out_bytes,
            members=list(mem),
            module=module_path_of(head),
            inputs=inputs,
        )

    # --- edges and values
    outputs = set(traced.output_names)
    n_units = len(order)
    rows: list[ValueRow] = []
    for n in nodes:
        if n.name not in unit_of:
            continue
        pu = unit_of[n.name]
        users: set[int] = set()
        for user in n.users:
            if user.op == "output":
                users.add(n_units)
            elif user.name in unit_of and unit_of[user.name] != pu:
                cu = unit_of[user.name]
                users.add(pos[cu])
                nbytes = costs[n.name].out_bytes
                if g.has_edge(pu, cu):
                    e = g.edges[pu, cu]
                    if n.name not in e["values"]:
                        e["values"].append(n.name)
                        e["bytes"] += nbytes
                else:
                    g.add_edge(pu, cu, bytes=nbytes, value=n.name, values=[n.name])
        if n.name in outputs:
            users.add(n_units)
        if users:
            rows.append(ValueRow(pos[pu], sorted(users), costs[n.name].out_bytes, n.name))

    input_users: dict[str, list[int]] = {}
    for name in traced.input_names:
        ph = by_name[name]
        input_users[name] = sorted({pos[unit_of[u.name]] for u in ph.users
                                    if u.name in unit_of})

    # --- annotations
    forced: set[int] = set()
    for name in traced.split_after:
        if name not in unit_of:
            continue
        p = pos[unit_of[name]]
        if p >= n_units - 1:
            warnings.warn(f"pipe_split() after the last computation ({name}) is ignored",
                          stacklevel=2)
            continue
        forced.add(p)
    pins: dict[int, int] = {}
    for u in order:  # the producer's pin wins over its getitems'
        for m in members[u]:
            if m in traced.pins:
                pins[pos[u]] = traced.pins[m]
                break

    return PricedGraph(graph=g, order=order, pos=pos, unit_of=unit_of,
                       forced_cuts=sorted(forced), pins=pins, input_users=input_users,
                       values=rows, traced=traced, costs=costs)


def values_table(pg: PricedGraph) -> list[tuple[int, list[int], int, str]]:
    """Every value a cut could separate from a user: ``(producer_pos, [user_pos...], nbytes,
    name)`` in FX order.

    A value crosses the cut after position p when ``producer_pos <= p < max(user_positions)``;
    the stage that needs it is every stage holding a user position (position ``len(pg.order)``
    is the model output, read by the last stage). Values used only inside their own unit (e.g. a
    split's tuple) are absent. Model inputs are not listed (see ``pg.input_users``).
    """
    return [tuple(r) for r in pg.values]  # type: ignore[misc]
