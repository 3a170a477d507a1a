"""Priced planning graph: units, topological order, values crossing cuts, annotations."""

from __future__ import annotations

import operator

import networkx as nx
import pytest
import torch

from fxpipe.errors import PlanError
from fxpipe.examples.cnn import SkipCNN
from fxpipe.partitioner.annotations import annotate
from fxpipe.partitioner.cost import price
from fxpipe.partitioner.graph import PricedGraph, build_graph, values_table
from fxpipe.partitioner.trace import COMPUTE_OPS, module_path_of, trace

try:
    from shared_models import SplitGPT
except ImportError:  # run from the repo root as a package
    from tests.shared_models import SplitGPT

torch.set_num_threads(1)


def _gpt_graph(tracer: str) -> PricedGraph:
    torch.manual_seed(0)
    m = SplitGPT(n_layer=3, n_embd=32, n_head=4, block_size=16)
    annotate(m.h[2], stage=3)
    tm = trace(m, (torch.randint(0, 256, (2, 16)),), tracer=tracer)
    return build_graph(tm, price(tm))


def _cnn_graph(tracer: str) -> PricedGraph:
    tm = trace(SkipCNN(), (torch.randn(2, 1, 8, 8),), tracer=tracer)
    return build_graph(tm, price(tm))


CASES = {
    "gpt-export": lambda: _gpt_graph("export"),
    "gpt-fx": lambda: _gpt_graph("fx"),
    "cnn-export": lambda: _cnn_graph("export"),
    "cnn-fx": lambda: _cnn_graph("fx"),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def pg(request) -> PricedGraph:
    return CASES[request.param]()


def test_order_is_topological_dag(pg):
    g = pg.graph
    assert nx.is_directed_acyclic_graph(g)
    assert list(pg.order) == sorted(g.nodes, key=lambda u: g.nodes[u]["pos"])
    assert set(pg.order) == set(g.nodes)
    for u, v in g.edges:
        assert pg.pos[u] < pg.pos[v], (u, v)
    for i, u in enumerate(pg.order):
        assert pg.pos[u] == i == g.nodes[u]["pos"]


def test_every_compute_node_in_exactly_one_unit(pg):
    compute = [n.name for n in pg.traced.gm.graph.nodes if n.op in COMPUTE_OPS]
    members = [m for u in pg.order for m in pg.graph.nodes[u]["members"]]
    assert sorted(members) == sorted(compute)
    assert len(members) == len(set(members))
    for u in pg.order:
        assert pg.graph.nodes[u]["members"][0] == u
        for m in pg.graph.nodes[u]["members"]:
            assert pg.unit_of[m] == u
    ph = {n.name for n in pg.traced.gm.graph.nodes if n.op in ("placeholder", "get_attr")}
    assert not ph & set(pg.graph.nodes)


def test_getitems_fused_into_producer(pg):
    by_name = {n.name: n for n in pg.traced.gm.graph.nodes}
    fused = 0
    for n in by_name.values():
        if n.op == "call_function" and n.target is operator.getitem:
            src = n.args[0]
            if src.op in COMPUTE_OPS and isinstance(src.meta.get("val"), (tuple, list)):
                assert pg.unit_of[n.name] == pg.unit_of[src.name]
                fused += 1
    if pg.graph.graph["model"] == "SplitGPT":
        assert fused >= 9  # q, k, v of each of the 3 blocks


def test_costs_and_values(pg):
    g = pg.graph
    total = sum(c.fwd_flops for c in pg.costs.values())
    assert sum(pg.unit_attr_list("fwd_flops")) == total > 0
    assert sum(pg.unit_attr_list("param_bytes")) == sum(c.param_bytes for c in pg.costs.values())
    n = len(pg.order)
    rows = values_table(pg)
    assert rows
    for prod, users, nbytes, name in rows:
        assert users == sorted(set(users)) and all(prod < u <= n for u in users)
        assert nbytes == pg.costs[name].out_bytes
        assert pg.pos[pg.unit_of[name]] == prod
    outs = [r for r in rows if r[3] in pg.traced.output_names]
    assert outs and all(r[1][-1] == n for r in outs)  # the output feeds the loss (position n)
    # each edge carries the bytes of the distinct values that flow along it
    for u, v, d in g.edges(data=True):
        assert d["bytes"] == sum(pg.costs[x].out_bytes for x in d["values"])
        assert d["value"] == d["values"][0]
    # every inter-unit data dependency is an edge and a value row
    by_row = {r[3]: r for r in rows}
    for node in pg.traced.gm.graph.nodes:
        if node.name not in pg.unit_of:
            continue
        for user in node.users:
            if user.name in pg.unit_of and pg.unit_of[user.name] != pg.unit_of[node.name]:
                assert g.has_edge(pg.unit_of[node.name], pg.unit_of[user.name])
                assert pg.pos[pg.unit_of[user.name]] in by_row[node.name][1]
    # model inputs are attributes, not units
    assert set(pg.input_users) == set(pg.traced.input_names)
    for name, users in pg.input_users.items():
        assert users and all(name in g.nodes[pg.order[p]]["inputs"] for p in users)


def test_gpt_annotations_recorded():
    pg = _gpt_graph("export")
    assert len(pg.forced_cuts) == 1
    cut = pg.forced_cuts[0]
    # the cut is right after block 0: unit `cut` is in h.0, the next one is not
    assert pg.graph.nodes[pg.order[cut]]["module"].startswith("h.0")
    assert not pg.graph.nodes[pg.order[cut + 1]]["module"].startswith("h.0")
    assert pg.pins and set(pg.pins.values()) == {3}
    for p, u in enumerate(pg.order):
        assert (p in pg.pins) == pg.graph.nodes[u]["module"].startswith("h.2"), u
    # tied weight: listed by both users, charged once
    users = [u for u in pg.order if "wte.weight" in pg.graph.nodes[u]["params"]]
    assert len(users) == 2
    assert pg.graph.nodes[users[1]]["param_bytes"] == 0


def test_cnn_long_skip_is_a_value():
    pg = _cnn_graph("export")
    stem = next(r for r in values_table(pg)
                if pg.graph.nodes[pg.order[r[0]]]["module"] == "" and len(r[1]) >= 3)
    assert stem[1][-1] - stem[0] > 10  # stem output skips over every residual block to the head
    cat = pg.order[stem[1][-1]]
    assert "cat" in cat


def test_build_graph_rejects_foreign_costs():
    tm = trace(SkipCNN(), (torch.randn(2, 1, 8, 8),))
    with pytest.raises(PlanError, match="price\\(traced\\)"):
        build_graph(tm, {})


def test_module_attr():
    pg = _gpt_graph("fx")
    mods = {pg.graph.nodes[u]["module"] for u in pg.order}
    assert "h.1.attn.qkv" in mods
    for u in pg.order:
        assert pg.graph.nodes[u]["module"] == module_path_of(pg.traced.node(u))
    shape, dtype, nbytes = pg.value_info(pg.traced.output_names[0])
    assert shape == [2, 16, 256] and dtype == "float32" and nbytes == 2 * 16 * 256 * 4
