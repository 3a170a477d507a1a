"""Tests for fxpipe.plans views: summary table, DOT text, dumps (plan.json, summary.txt, partition.*)."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import warnings

import networkx as nx
import pytest

from fxpipe.errors import PlanError
from fxpipe.plans.dot import partition_dot
from fxpipe.plans.dump import dump_plan
from fxpipe.plans.plan import Plan, Predicted, StagePlan
from fxpipe.plans.summary import summary_table
from fxpipe.plans.values import MODEL_INPUT, ValueInfo
from fxpipe.specs.loader import load_spec
from fxpipe.units import human_bytes

# --------------------------------------------------------------------------- fixtures

STAGE_NODES = [
    ["embedding", "add", "ln0"],
    ["fc1", "relu", 'we"ird\\name'],  # a quote and a backslash: DOT escaping must hold
    ["add_skip", "head", "loss_in"],
]


def _stage(i: int, nodes: list[str], params: list[str], time_s: float, comm_s: float,
           recv: int, send: int, inputs: list[str], outputs: list[str]) -> StagePlan:
    return StagePlan(
        index=i, nodes=nodes, params=params, buffers=[], inputs=inputs, outputs=outputs,
        fwd_flops=1.5e9 * (i + 1), bwd_flops=3.0e9 * (i + 1), bwd_weight_flops=1.5e9 * (i + 1),
        param_bytes=4096 * (i + 1) ** 3, activation_bytes=1 << 20, recv_bytes=recv,
        send_bytes=send, compute_time_s=time_s - comm_s, comm_time_s=comm_s, time_s=time_s,
        memory_bytes=(3 << 20) * (i + 1),
    )


def make_plan(predicted: bool = True) -> Plan:
    """3 stages; value 'add' goes 0 -> 1 and skips 0 -> 2; 'emb.weight' is tied (stages 0, 2)."""
    values = {
        "x": ValueInfo("x", MODEL_INPUT, [0], [4, 16], "int64", 4 * 16 * 8),
        "add": ValueInfo("add", 0, [1, 2], [4, 16, 32], "float32", 4 * 16 * 32 * 4),
        "relu": ValueInfo("relu", 1, [2], [4, 16, 64], "float32", 4 * 16 * 64 * 4),
        "loss_in": ValueInfo("loss_in", 2, [], [4, 16, 100], "float32", 4 * 16 * 100 * 4),
    }
    a, r = values["add"].nbytes, values["relu"].nbytes
    stages = [
        _stage(0, STAGE_NODES[0], ["emb.weight", "ln0.weight"], 0.010, 0.001, 0, a,
               ["x"], ["add"]),
        _stage(1, STAGE_NODES[1], ["fc1.weight", "fc1.bias"], 0.014, 0.002, a, r,
               ["add"], ["relu"]),
        _stage(2, STAGE_NODES[2], ["emb.weight"], 0.012, 0.003, a + r, 0,
               ["add", "relu"], ["loss_in"]),
    ]
    return Plan(
        model="TinyNet", num_stages=3, pipeline=3, dp=2, microbatches=6, schedule="1f1b",
        virtual_stages=1, microbatch_size=4, stages=stages, values=values, model_inputs=["x"],
        model_output="loss_in", shared_params={"emb.weight": [0, 2]},
        param_aliases={"head.weight": "emb.weight"}, bottleneck_stage=1, lower_bound_s=0.0100,
        predicted=Predicted(0.1234, 0.25, [3 << 20, 6 << 20, 9 << 20], [3, 2, 1])
        if predicted else None,
        explain=["chose 1f1b: fastest of 4 candidates that fit", "pinned fc1 to stage 1"],
        spec=load_spec({"model": {"factory": "x:y"}}),
    )


def make_graph() -> nx.DiGraph:
    """Units: one per FX node except 'ln0' and 'relu', which are merged into other units; plus
    an input unit in no stage. Edge bytes are set (cut and uncut), one edge gives only 'value'."""
    g = nx.DiGraph()
    g.add_node("x", members=["x"])  # model input: in no stage
    g.add_node("embedding", members=["embedding"], fwd_flops=1e6, param_bytes=8192)
    g.add_node("block0", members=["add", "ln0"], fwd_flops=2e6)
    g.add_node("fc1", members=["fc1", "relu"], fwd_flops=5e8, param_bytes=65536)
    g.add_node('we"ird\\name', members=['we"ird\\name'])
    g.add_node("add_skip", members=["add_skip"])
    g.add_node("head", members=["head", "loss_in"], param_bytes=8192)
    g.add_edge("x", "embedding", bytes=512, value="x")
    g.add_edge("embedding", "block0", bytes=8192, value="embedding")
    g.add_edge("block0", "fc1", bytes=8192, value="add")              # cut 0 -> 1
    g.add_edge("block0", "add_skip", value="add")                    # cut 0 -> 2 (skip), no bytes
    g.add_edge("fc1", 'we"ird\\name', bytes=16384, value="relu")
    g.add_edge('we"ird\\name', "add_skip", bytes=3 * 1024 * 1024, value="relu")  # cut 1 -> 2
    g.add_edge("add_skip", "head", bytes=8192, value="add_skip")
    return g


# --------------------------------------------------------------------------- DOT parsing helpers

_ATTR = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def _unescape(s: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), s)


def _structure_ok(text: str) -> bool:
    """Strings closed, braces and brackets balanced outside strings, never negative."""
    depth = {"{": 0, "[": 0}
    closing = {"}": "{", "]": "["}
    in_str = esc = False
    for ch in text:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch in depth:
            depth[ch] += 1
        elif ch in closing:
            depth[closing[ch]] -= 1
            if depth[closing[ch]] < 0:
                return False
    return not in_str and all(v == 0 for v in depth.values())


def _nodes_and_edges(text: str):
    nodes, edges = {}, []
    for line in text.splitlines():
        line = line.strip()
        m = re.match(r"^(\w+) -> (\w+)(?: \[(.*)\])?;$", line)
        if m:
            edges.append((m.group(1), m.group(2),
                          {k: _unescape(v) for k, v in _ATTR.findall(m.group(3) or "")}))
            continue
        m = re.match(r"^(\w+) \[(.*)\];$", line)
        if m and m.group(1) not in ("graph", "node", "edge"):
            nodes[m.group(1)] = {k: _unescape(v) for k, v in _ATTR.findall(m.group(2))}
    return nodes, edges


# --------------------------------------------------------------------------- summary

def test_human_bytes_units():
    assert human_bytes(0) == "0 B"
    assert human_bytes(1023) == "1023 B"
    assert human_bytes(1536) == "1.5 KiB"
    assert human_bytes(5 * 1024**2) == "5.0 MiB"
    assert human_bytes(3 * 1024**3) == "3.0 GiB"


def test_stage_ranks_placements():
    plan = make_plan()
    assert plan.stage_ranks() == [0, 1, 2]
    p = 2
    plan.pipeline, plan.virtual_stages = p, 2
    plan.stages = [plan.stages[0]] + [
        StagePlan(**{**plan.stages[0].__dict__, "index": i}) for i in range(1, 2 * p)
    ]
    plan.num_stages = 2 * p
    plan.schedule = "interleaved"
    assert plan.stage_ranks() == [s % p for s in range(2 * p)]
    plan.schedule = "zb-v"
    ranks = plan.stage_ranks()
    for r in range(p):  # rank r holds r and 2p-1-r
        assert [s for s, rr in enumerate(ranks) if rr == r] == [r, 2 * p - 1 - r]


def test_summary_rows_bottleneck_and_footer():
    plan = make_plan()
    text = summary_table(plan)
    lines = text.splitlines()
    header_idx = next(i for i, ln in enumerate(lines) if ln.startswith("stage"))
    rows = lines[header_idx + 2: header_idx + 2 + len(plan.stages)]
    for st, row in zip(plan.stages, rows):
        cells = row.split()
        assert cells[0] == str(st.index)
        assert cells[2] == str(len(st.nodes))
        assert f"{len(st.params)} / {human_bytes(st.param_bytes)}" in row
        assert human_bytes(st.memory_bytes) in row
        assert f"{st.time_s * 1e3:.3f}" in row
        assert row.rstrip().endswith("*") == (st.index == plan.bottleneck_stage)
    b = plan.stages[plan.bottleneck_stage]
    ratio = b.time_s / plan.lower_bound_s
    assert f"lower bound:  {plan.lower_bound_s * 1e3:.3f} ms" in text
    assert f"{ratio:.3f}x" in text
    assert f"stage {b.index} (rank {b.index}), {b.time_s * 1e3:.3f} ms" in text
    assert f"pipeline {plan.pipeline} x dp {plan.dp} = world size {plan.world_size}" in text
    assert f"{plan.microbatches} per step" in text and plan.schedule in text
    assert f"bubble {plan.predicted.bubble_fraction * 100:.1f} %" in text
    assert human_bytes(max(plan.predicted.peak_memory_bytes)) in text
    assert "emb.weight (alias head.weight): stages 0, 2" in text
    for e in plan.explain:
        assert e in text
    assert plan.summary() == text  # Plan.summary delegates here


def test_summary_without_prediction_or_stages():
    plan = make_plan(predicted=False)
    assert "predicted" not in summary_table(plan)
    plan.stages, plan.shared_params = [], {}
    text = summary_table(plan)  # must not crash on an empty plan
    assert "bottleneck" not in text and "world size" in text


def test_summary_every_column_has_a_header_and_a_rule():
    text = summary_table(make_plan())
    lines = text.splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.startswith("stage"))
    header, rule = lines[i], lines[i + 1]
    # each run of dashes in the rule sits under a header word, and the last column has one
    dash_spans = [(m.start(), m.end()) for m in re.finditer(r"-+", rule)]
    heads = [(m.start(), m.end()) for m in re.finditer(r"\S+(?: \S+)*", header)]
    assert len(dash_spans) == len(heads) == 14
    assert header.split()[-1] == "slowest"
    for (a, b), (c, d) in zip(dash_spans, heads):
        assert a <= c and d <= b  # the header lies over its rule
    # the bottleneck's '*' lies in the last column
    star_row = next(ln for ln in lines[i + 2:] if ln.rstrip().endswith("*"))
    assert star_row.rstrip().index("*") >= dash_spans[-1][0]


def test_summary_singular_counts():
    plan = make_plan()
    plan.stages = plan.stages[:1]
    plan.stages[0].index = 0
    plan.num_stages, plan.pipeline, plan.microbatch_size = 1, 1, 1
    plan.shared_params, plan.bottleneck_stage = {}, 0
    text = summary_table(plan)
    assert "1 stage on 1 pipeline rank  |" in text
    assert "total compute / 1 stage)" in text and "1 sample each" in text
    assert not re.search(r"\b1 (stages|units|samples|pipeline ranks)\b", text)
    assert "(s)" not in text and "(es)" not in text


# --------------------------------------------------------------------------- plan.json

def test_plan_from_dict_rejects_malformed_plans_plainly():
    good = make_plan().to_dict()

    def problem(**changes) -> str:
        d = {**good, **changes}
        with pytest.raises(ValueError) as err:
            Plan.from_dict(d)
        msg = str(err.value)
        for leak in ("__init__", "positional argument", "argument after **", "keyword argument"):
            assert leak not in msg, msg
        assert msg.startswith("plan.json: ") and msg.endswith("re-create it with `fxpipe plan`")
        return msg

    stage0 = dict(good["stages"][0])
    del stage0["nodes"], stage0["time_s"]
    assert "stage 0 lacks fields ['nodes', 'time_s']" in problem(
        stages=[stage0] + good["stages"][1:])
    assert 'num_stages must be an integer, got "two"' in problem(num_stages="two")
    assert "stage 1 must be a mapping, got str" in problem(stages=[good["stages"][0], "x"])
    assert "stages must be a list of mappings" in problem(stages="x")
    assert "stage 0: index must be an integer, got true" in problem(
        stages=[{**good["stages"][0], "index": True}] + good["stages"][1:])
    assert "stage 0: nodes must be a list of strings" in problem(
        stages=[{**good["stages"][0], "nodes": [1, 2]}] + good["stages"][1:])
    assert "value 'add' lacks field ['dtype']" in problem(
        values={**good["values"], "add": {k: v for k, v in good["values"]["add"].items()
                                         if k != "dtype"}})
    assert "predicted: step_time_s must be a number" in problem(
        predicted={**good["predicted"], "step_time_s": "fast"})
    assert "the plan has unknown field ['colour']" in problem(colour="red")
    lacks = problem(model=None)
    assert "model must be a string, got null" in lacks
    d = dict(good)
    del d["schedule"]
    with pytest.raises(ValueError, match=r"the plan lacks field \['schedule'\]"):
        Plan.from_dict(d)
    with pytest.raises(ValueError, match="JSON object"):
        Plan.from_dict(["not", "a", "plan"])
    assert Plan.from_dict(good) == make_plan()  # a good plan still loads (ints as floats too)
    ints = {**good, "lower_bound_s": 1}
    assert Plan.from_dict(ints).lower_bound_s == 1


# --------------------------------------------------------------------------- DOT

def test_unit_dot_colours_clusters_and_cut_labels():
    plan, g = make_plan(), make_graph()
    text = partition_dot(plan, g)
    assert text.startswith("digraph") and _structure_ok(text)
    nodes, edges = _nodes_and_edges(text)
    name_of = {nid: attrs["label"].split("\n")[0] for nid, attrs in nodes.items()}
    assert sorted(name_of.values()) == sorted(map(str, g.nodes))
    node_stage = plan.stage_of_node()
    unit_stage = {}
    for u, data in g.nodes(data=True):
        st = {node_stage[m] for m in data["members"] if m in node_stage}
        unit_stage[u] = st.pop() if st else None
    fills = {}
    for nid, attrs in nodes.items():
        assert attrs.get("fillcolor", "").startswith("#"), f"{nid} has no fillcolor"
        fills.setdefault(unit_stage[name_of[nid]], set()).add(attrs["fillcolor"])
    staged = [s for s in fills if s is not None]
    assert all(len(fills[s]) == 1 for s in fills)  # one colour per stage ...
    assert len({next(iter(fills[s])) for s in staged}) == len(staged)  # ... distinct per stage
    for st in plan.stages:
        assert re.search(rf"subgraph cluster_{st.index} \{{", text)
        assert f"{st.time_s * 1e3:.3f} ms" in text
    assert len(edges) == g.number_of_edges()
    n_cut = 0
    for a, b, attrs in edges:
        ua, ub = name_of[a], name_of[b]
        sa, sb = unit_stage[ua], unit_stage[ub]
        if sa is not None and sb is not None and sa != sb:
            n_cut += 1
            data = g.edges[ua, ub]
            nbytes = data.get("bytes", plan.values[data["value"]].nbytes)
            assert attrs.get("label") == human_bytes(nbytes), (ua, ub, attrs)
        else:
            assert "label" not in attrs
    assert n_cut == 3


def test_stage_dot_without_graph_shows_skip():
    plan = make_plan()
    text = partition_dot(plan)
    assert _structure_ok(text)
    nodes, edges = _nodes_and_edges(text)
    for st in plan.stages:
        assert nodes[f"s{st.index}"]["fillcolor"].startswith("#")
    pairs = {(a, b): attrs for a, b, attrs in edges}
    for name, vi in plan.values.items():
        for c in vi.consumers:
            src = "input" if vi.producer == MODEL_INPUT else f"s{vi.producer}"
            attrs = pairs[(src, f"s{c}")]
            assert f"{name} ({human_bytes(vi.nbytes)})" in attrs["label"]
    assert pairs[("s0", "s2")].get("style") == "dashed"  # the skip connection
    assert "total" not in pairs[("s0", "s1")]["label"]
    # two values on one stage pair: one edge, a total line and both values
    plan.values["extra"] = ValueInfo("extra", 0, [1], [7], "float32", 28)
    _, edges = _nodes_and_edges(partition_dot(plan))
    label = {(a, b): attrs for a, b, attrs in edges}[("s0", "s1")]["label"]
    total = plan.values["add"].nbytes + plan.values["extra"].nbytes
    assert f"total {human_bytes(total)}" in label and "extra (28 B)" in label
    assert ("s2", "loss") in pairs


def test_dot_accepted_by_graphviz_if_installed():
    exe = shutil.which("dot")
    if exe is None:
        pytest.skip("Graphviz `dot` not installed")
    plan = make_plan()
    for g in (make_graph(), None):
        proc = subprocess.run([exe, "-Tcanon"], input=partition_dot(plan, g), text=True,
                              capture_output=True, timeout=30)
        assert proc.returncode == 0 and not proc.stderr.strip(), proc.stderr


def test_dot_readable_by_networkx_pydot():
    pytest.importorskip("pydot")
    import io

    plan, g = make_plan(), make_graph()
    text = partition_dot(plan, g)
    h = nx.nx_pydot.read_dot(io.StringIO(text))
    assert h.number_of_edges() == g.number_of_edges()
    assert {f"u{i}" for i in range(g.number_of_nodes())} <= set(h.nodes)


# --------------------------------------------------------------------------- dumps

def test_dump_writes_files_and_roundtrips(tmp_path):
    plan, g = make_plan(), make_graph()
    out = tmp_path / "new" / "dir"
    written = dump_plan(plan, out, g, render_svg=False)
    assert [p.name for p in written] == ["plan.json", "summary.txt", "partition.dot"]
    assert all(p.parent == out and p.is_file() for p in written)
    loaded = Plan.load(out / "plan.json")
    assert loaded == plan and loaded.to_dict() == plan.to_dict()
    assert (out / "summary.txt").read_text() == summary_table(plan) + "\n"
    assert (out / "partition.dot").read_text() == partition_dot(plan, g)
    # Plan.dump delegates; second dump overwrites our files without leftovers
    again = plan.dump(out)
    assert {p.name for p in again} <= {"plan.json", "summary.txt", "partition.dot",
                                       "partition-units.svg"}
    assert (out / "partition.dot").read_text() == partition_dot(plan)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in again)


def test_dump_file_permissions_follow_umask(tmp_path):
    ref = tmp_path / "ref.txt"
    ref.write_text("x")  # created like any other file: the process umask applies
    written = dump_plan(make_plan(), tmp_path / "out", make_graph(), render_svg=False)
    for p in written:
        assert stat.S_IMODE(p.stat().st_mode) == stat.S_IMODE(ref.stat().st_mode), p.name


def test_dump_leaves_unrelated_files_alone(tmp_path):
    keep = {"notes.txt": "mine", "plan.json.bak": "old", "sub/partition.dot": "nested"}
    for rel, content in keep.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(content)
    before = {rel: os.stat(tmp_path / rel).st_mtime_ns for rel in keep}
    written = dump_plan(make_plan(), tmp_path, make_graph())
    for rel, content in keep.items():
        assert (tmp_path / rel).read_text() == content
        assert os.stat(tmp_path / rel).st_mtime_ns == before[rel]
    top = {p.name for p in tmp_path.iterdir()}
    assert top == {"notes.txt", "plan.json.bak", "sub"} | {p.name for p in written}


def test_out_dir_is_a_file(tmp_path):
    f = tmp_path / "out"
    f.write_text("not a folder")
    with pytest.raises(PlanError, match="is a file"):
        dump_plan(make_plan(), f)
    with pytest.raises(PlanError, match="is a file"):
        dump_plan(make_plan(), f / "below")
    assert f.read_text() == "not a folder"
    (tmp_path / "d" / "plan.json").mkdir(parents=True)
    with pytest.raises(PlanError, match="remove or rename"):
        dump_plan(make_plan(), tmp_path / "d")


posix_only = pytest.mark.skipif(os.name != "posix", reason="stand-in `dot` is a /bin/sh script")


def _fake_dot(tmp_path, script: str):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    exe = bindir / "dot"
    exe.write_text("#!/bin/sh\n" + script + "\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return str(bindir) + os.pathsep + os.environ.get("PATH", "")


@posix_only
def test_svg_render_failure_is_a_warning(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", _fake_dot(tmp_path, 'echo "syntax error" >&2; exit 3'))
    out = tmp_path / "out"
    out.mkdir()
    (out / "partition-units.svg").write_text("<svg>stale</svg>")
    with pytest.warns(RuntimeWarning, match="syntax error"):
        written = dump_plan(make_plan(), out, make_graph())
    assert [p.name for p in written] == ["plan.json", "summary.txt", "partition.dot"]
    assert not (out / "partition-units.svg").exists()  # the stale SVG does not outlive its DOT
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


@posix_only
def test_svg_rendered_with_dot_on_path(tmp_path, monkeypatch):
    # a stand-in `dot` that copies its input (argv: -Tsvg IN -o OUT), so the test runs anywhere
    monkeypatch.setenv("PATH", _fake_dot(tmp_path, 'cp "$2" "$4"'))
    out = tmp_path / "out"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        written = dump_plan(make_plan(), out)
    assert written[-1] == out / "partition-units.svg"
    assert written[-1].read_text() == (out / "partition.dot").read_text()


@posix_only
def test_huge_graph_not_rendered(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", _fake_dot(tmp_path, 'cp "$2" "$4"'))
    g = make_graph()
    with pytest.warns(RuntimeWarning, match="max_svg_units"):
        written = dump_plan(make_plan(), tmp_path / "out", g, max_svg_units=g.number_of_nodes() - 1)
    assert not (tmp_path / "out" / "partition-units.svg").exists()
    assert [p.name for p in written] == ["plan.json", "summary.txt", "partition.dot"]


def test_real_graphviz_svg(tmp_path):
    if shutil.which("dot") is None:
        pytest.skip("Graphviz `dot` not installed")
    written = dump_plan(make_plan(), tmp_path, make_graph())
    svg = tmp_path / "partition-units.svg"
    assert svg in written and "<svg" in svg.read_text()
