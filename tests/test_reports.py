"""The pictures, the offline report and the progress display (fxpipe.reports).

Content, not only files: the partition picture has a column per stage and the blocks the plan
puts there, the timeline a row per rank with each rank's bubble, the loss figure a point per CSV
row, the report names every stage and embeds pictures that decode to those figures; one small
`fxpipe run` feeds the run-level checks, and headless Chromium renders the report (skipped with
a message where Chromium is not installed: .ci/run installs it).
"""

from __future__ import annotations

import base64
import csv
import io
import json
import logging
import re
import shutil
import subprocess
import tempfile
from html.parser import HTMLParser

import pytest
import torch

from fxpipe.examples.gpt import CharGPT
from fxpipe.partitioner.driver import plan_with_graph
from fxpipe.plans.plan import Plan
from fxpipe.reports.figures import KIND_COLORS, svg_text
from fxpipe.reports.partition_picture import block_name, block_view, partition_figure
from fxpipe.reports.progress import TrainingProgress, planning_progress
from fxpipe.reports.report import write_report
from fxpipe.reports.timeline_picture import (measured_panel, measured_steps_summary,
                                             simulated_panel, timeline_figure)
from fxpipe.reports.training_picture import read_training_log, training_figure
from fxpipe.schedule.timeline import TimelineEvent, event_kind, split_steps
from fxpipe.units import human_bytes, ms

try:
    from cli_helpers import fxpipe_in_process
except ImportError:  # collected as a package
    from tests.cli_helpers import fxpipe_in_process


def _spec(pipeline: int, layers: int = 4, microbatches: int = 4) -> dict:
    return {"model": {"factory": "fxpipe.examples.gpt:CharGPT",
                      "args": {"vocab_size": 64, "block_size": 16, "n_layer": layers,
                               "n_head": 2, "n_embd": 32}},
            "data": {"batch_size": 8, "seq_len": 16},
            "parallel": {"pipeline": pipeline, "data": 1, "microbatches": microbatches},
            "cluster": {"devices_per_node": pipeline, "memory_gb": 2}}


def _ids(svg: str, prefix: str) -> list[str]:
    return re.findall(rf'id="({re.escape(prefix)}[^"]*)"', svg)


@pytest.fixture(scope="module")
def planned():
    torch.manual_seed(0)
    model = CharGPT(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32)
    return plan_with_graph(model, _spec(3), (torch.zeros(2, 16, dtype=torch.long),))


# ----------------------------------------------------------------------------- partition
def test_block_names_group_module_paths():
    assert block_name("h.3.attn.qkv") == "h.3"
    assert block_name("transformer.h.0.mlp.c_fc") == "transformer.h.0"
    assert block_name("transformer.wte") == "transformer.wte"
    assert block_name("lm_head") == "lm_head"
    assert block_name("") == "(top level)"


def test_partition_picture_has_a_column_per_stage_with_its_blocks(planned):
    plan, graph = planned
    view = block_view(plan, graph)
    assert len(view.columns) == plan.num_stages == 3
    # every planning unit is in exactly one block of its own stage's column
    node_stage = plan.stage_of_node()
    for col, st in zip(view.columns, plan.stages):
        assert all(b.stage == st.index for b in col)
        units = sum(b.units for b in col)
        assert units == sum(1 for u in graph.nodes if node_stage.get(u) == st.index)
    names = [b.name for col in view.columns for b in col]
    assert {"wte", "h.0", "h.1", "h.2", "h.3", "head"} <= set(names)
    assert not any(re.search(r"\.(attn|fc|ln_\d)", n) for n in names)  # blocks, not aten nodes
    # cut edges: bytes per micro-batch, adding up to what crosses each stage pair
    fwd, _ = plan.edge_bytes()
    drawn: dict[tuple[int, int], int] = {}
    for e in view.edges:
        pair = (plan.stages[e.src[0]].index, plan.stages[e.dst[0]].index)
        drawn[pair] = drawn.get(pair, 0) + e.nbytes
    assert drawn == {k: v for k, v in fwd.items() if v}
    svg = svg_text(partition_figure(plan, graph))
    assert sorted(_ids(svg, "stage-column-")) == [f"stage-column-{k}" for k in range(3)]
    assert len(_ids(svg, "stage-caption-")) == 3
    assert _ids(svg, "bottleneck") == ["bottleneck"]
    assert len(_ids(svg, "cut-")) == len(view.edges) >= 2
    assert len(_ids(svg, "block-")) == len(names)
    fig = partition_figure(plan, graph)
    texts = [t.get_text() for t in fig.axes[0].texts]
    for st in plan.stages:  # each stage's predicted time and memory under its column
        assert any(t.startswith(f"{ms(st.time_s)} ms / micro-batch") and
                   human_bytes(st.memory_bytes) in t for t in texts)
    for e in view.edges:
        assert any(t.startswith(human_bytes(e.nbytes)) for t in texts)
    b = plan.bottleneck_stage
    heads = [t.get_text() for t in fig.axes[0].texts if t.get_gid() == f"stage-header-{b}"]
    assert heads == [f"stage {b}  (rank {plan.stage_ranks()[b]})"]


def test_folded_plan_draws_the_blocks_of_its_record():
    with torch.device("meta"):
        model = CharGPT(vocab_size=64, block_size=16, n_layer=8, n_head=2, n_embd=32)
    plan, graph = plan_with_graph(model, _spec(4, layers=8),
                                  (torch.zeros(2, 16, dtype=torch.long, device="meta"),))
    assert plan.folded and graph is None and not any(st.nodes for st in plan.stages)
    view = block_view(plan)
    assert len(view.columns) == 4
    for pos, st in enumerate(plan.stages):
        want = [f"h.{i}" for i, s in enumerate(plan.folded["blocks"]) if s == st.index]
        assert [b.name for b in view.columns[pos] if b.name.startswith("h.")] == want
    assert view.columns[0][0].name == "before h" and view.columns[-1][-1].name == "after h"
    assert [(e.src[0], e.dst[0]) for e in view.edges] == [(0, 1), (1, 2), (2, 3)]
    svg = svg_text(partition_figure(plan))
    assert len(_ids(svg, "stage-column-")) == 4
    # a long column shows runs of blocks as ranges and keeps every block counted
    short = block_view(plan, max_boxes=2)
    assert sum(b.count for col in short.columns for b in col if b.name.startswith("h.")) == 8
    assert any("-" in b.name for col in short.columns for b in col)


# ----------------------------------------------------------------------------- timeline
def _fake_measured(world: int = 4, steps: int = 3) -> list[TimelineEvent]:
    """Per rank and step: F, a receive, B, the executor's STEP, then the optimizer."""
    evs, t = [], 100.0
    for k in range(steps):
        for r in range(world):
            s = t + 0.001 * r
            evs += [TimelineEvent(r, f"F0 s{r % 2}", s, s + 0.002),
                    TimelineEvent(r, f"RECV_B0 s{r % 2}<-1", s + 0.002, s + 0.004),
                    TimelineEvent(r, f"B0 s{r % 2}", s + 0.004, s + 0.008),
                    TimelineEvent(r, "STEP", s + 0.008, s + 0.009),
                    TimelineEvent(r, "OPTIMIZER", s + 0.009, s + 0.010)]
        t += 0.02 + 0.005 * k
    return evs


def test_measured_timeline_cut_into_steps_with_a_row_per_rank(planned):
    plan, _ = planned
    evs = _fake_measured()
    assert [event_kind(e.name) for e in evs[:5]] == ["F", "receive", "B", "step", "optimizer"]
    steps = split_steps(evs)
    assert len(steps) == 3 and all(len(s) == 20 for s in steps)  # optimizer kept in its step
    summary = measured_steps_summary(evs, range(4))
    assert summary["steps"] == 3
    assert summary["step_time_s"] == pytest.approx(0.013)  # median of steps 1, 2
    assert summary["bubble_fraction"] == pytest.approx(1 - 0.006 / 0.013)
    panel = measured_panel(evs)
    assert panel.ranks == [0, 1, 2, 3]
    assert panel.bubbles()[0] == pytest.approx(1 - 0.006 / 0.013)
    sim = simulated_panel(plan)
    assert sim.ranks == list(range(plan.pipeline))
    fig = timeline_figure([sim, panel])
    assert len(fig.axes) == 2
    assert fig.axes[0].get_xlim() == fig.axes[1].get_xlim()  # one time axis
    assert [len(ax.get_yticks()) for ax in fig.axes] == [plan.pipeline, 4]
    svg = svg_text(fig)
    assert len(_ids(svg, "timeline-measured-row-")) == 4
    assert len(_ids(svg, "timeline-simulated-row-")) == plan.pipeline
    bubbles = [t.get_text() for t in fig.axes[1].texts if t.get_gid() and "bubble" in t.get_gid()]
    assert len(bubbles) == 4 and all(t.startswith("bubble ") for t in bubbles)
    # every kind gets its own colour: F, receive (a thin wait line), B, step, optimizer
    colours = {tuple(round(c, 3) for c in coll.get_facecolor()[0])
               for coll in fig.axes[1].collections}
    assert len(colours) == 5
    assert KIND_COLORS["optimizer"] != KIND_COLORS["F"]


# ----------------------------------------------------------------------------- training
def test_loss_figure_has_a_point_per_csv_row(tmp_path):
    with open(tmp_path / "losses.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "loss", "step_time_s", "tokens_per_s"])
        for k in range(57):
            w.writerow([k, 5.0 - 0.01 * k, 0.05, 1000 + k])
    (tmp_path / "eval.json").write_text(json.dumps({"val_loss_initial": 5.1,
                                                    "val_loss_final": 4.4, "eval_batches": 2}))
    log = read_training_log(tmp_path)
    fig = training_figure(log)
    lines = {ln.get_gid(): ln for ax in fig.axes for ln in ax.get_lines() if ln.get_gid()}
    assert len(lines["train-loss"].get_xdata()) == 57
    assert list(lines["train-loss"].get_ydata()) == pytest.approx([5.0 - 0.01 * k
                                                                   for k in range(57)])
    assert len(lines["throughput"].get_xdata()) == 57
    assert list(lines["heldout-loss"].get_xdata()) == [0, 57]
    assert list(lines["heldout-loss"].get_ydata()) == [5.1, 4.4]
    assert fig.axes[1].get_ylabel() == "tokens / s"


def test_report_of_a_folder_that_is_no_run_is_a_clear_error(tmp_path):
    from fxpipe.errors import FxpipeError

    with pytest.raises(FxpipeError, match="no plan.json"):
        write_report(tmp_path)


# ----------------------------------------------------------------------------- progress
def test_progress_plain_lines_and_bar(monkeypatch):
    out = io.StringIO()
    p = TrainingProgress(5, "tokens", log_every=2, mode="lines", stream=out)
    for k in range(5):
        p.update(k, 2.0 - k / 10, 1234.0, 0.01, "  lr 1.00e-03")
    p.close()
    lines = out.getvalue().splitlines()
    assert [ln.split()[1] for ln in lines] == ["0/5", "2/5", "4/5"]
    assert "tokens/s" in lines[0] and "lr 1.00e-03" in lines[0] and "eta " in lines[0]
    assert "eta" not in lines[-1] and "\r" not in out.getvalue()
    bar = io.StringIO()
    p = TrainingProgress(3, "tokens", log_every=10, mode="bar", stream=bar)
    for k in range(3):
        p.update(k, 1.5, 999.0, 0.01)
    p.close()
    text = bar.getvalue()
    assert "\r" in text and "3/3" in text and "loss 1.5000" in text and "tokens/s" in text
    assert re.search(r"<\d\d:\d\d", text)  # time left
    monkeypatch.setenv("FXPIPE_PROGRESS", "lines")
    assert TrainingProgress(3).mode == "lines"


def test_planning_phases_on_a_spinner_line():
    err = io.StringIO()
    with planning_progress(stream=err):  # not a terminal: silent
        logging.getLogger("fxpipe.progress").info("tracing X")
    assert err.getvalue() == ""
    with planning_progress(stream=err, force=True):
        model = CharGPT(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
        plan_with_graph(model, {**_spec(2, layers=2), "parallel": {
            "pipeline": "auto", "data": 1, "microbatches": "auto", "schedule": "auto"}},
            (torch.zeros(2, 16, dtype=torch.long),))
        import time
        time.sleep(0.3)
    shown = err.getvalue()
    assert "planning: " in shown and "auto search: candidate" in shown and "\r" in shown
    assert not logging.getLogger("fxpipe.progress").handlers


# ----------------------------------------------------------------------------- one small run
@pytest.fixture(scope="module")
def run_dir(tiny_run):
    """The run of conftest.tiny_run (shared with test_cli): 2 stages x 2 replicas, 1F1B, 6
    steps, a log line every 2 steps, 2 held-out batches."""
    _, out, r = tiny_run
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out, r


class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.text, self.imgs, self.refs, self.scripts = [], {}, [], 0

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "script":
            self.scripts += 1
        if tag == "img":
            self.imgs[a.get("id")] = a.get("src", "")
        for k in ("src", "href"):
            if a.get(k):
                self.refs.append(a[k])

    def handle_data(self, data):
        self.text.append(data)


@pytest.mark.distributed
def test_run_writes_pictures_and_an_offline_report(run_dir):
    out, r = run_dir
    # off a terminal the progress is plain lines, with the time left
    steps = [ln for ln in r.stdout.splitlines() if ln.startswith("step ")]
    assert [ln.split()[1] for ln in steps] == ["0/6", "2/6", "4/6", "5/6"]
    assert "eta " in steps[0] and "\r" not in r.stdout
    for stem in ("partition", "timeline", "training"):
        assert (out / f"{stem}.png").stat().st_size > 1000
    plan = Plan.load(out / "plan.json")
    env = json.loads((out / "environment.json").read_text())
    assert env["world_size"] == 4 and env["backend"] == "gloo"
    assert env["torch"] == torch.__version__ and len(env["devices"]) == 4
    events = json.loads((out / "timeline.json").read_text())["traceEvents"]
    assert sum(1 for e in events if e.get("name") == "OPTIMIZER") == 4 * 6
    page = _Page()
    page.feed((out / "report.html").read_text())
    text = " ".join(page.text)
    for st in plan.stages:
        assert f"stage {st.index}" in text
    for needle in ("Predicted vs measured", "step time", "bubble", "torch", "gloo",
                   "world size", "fxpipe.examples.gpt:CharGPT", "held-out loss"):
        assert needle in text, needle
    assert page.scripts == 0
    assert all(ref.startswith("data:image/svg+xml;base64,") for ref in page.refs)
    svgs = {k: base64.b64decode(v.split(",", 1)[1]).decode() for k, v in page.imgs.items()}
    assert set(svgs) == {"picture-partition", "picture-timeline", "picture-training"}
    assert len(_ids(svgs["picture-partition"], "stage-column-")) == plan.num_stages
    assert len(_ids(svgs["picture-timeline"], "timeline-measured-row-")) == plan.world_size
    assert len(_ids(svgs["picture-timeline"], "timeline-simulated-row-")) == plan.pipeline
    assert not re.search(r"(href|src)=\"(https?:)?//", svgs["picture-partition"])
    # the loss figure's points are the CSV's rows
    rows = list(csv.DictReader(open(out / "losses.csv")))
    fig = training_figure(read_training_log(out))
    loss_line = [ln for ln in fig.axes[0].get_lines() if ln.get_gid() == "train-loss"][0]
    assert len(loss_line.get_xdata()) == len(rows) == 6
    # fxpipe report writes it again from the files
    (out / "report.html").unlink()
    (out / "training.svg").unlink()
    rep = fxpipe_in_process("report", str(out))
    assert rep.returncode == 0, rep.stderr
    assert (out / "report.html").exists() and (out / "training.svg").exists()


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    return None


@pytest.mark.distributed
def test_report_renders_in_headless_chromium(run_dir):
    exe = _chromium()
    if exe is None:
        pytest.skip("Chromium is not installed (Debian: apt-get install chromium; .ci/run "
                    "installs it): the report's browser check did not run")
    out, _ = run_dir
    shot = out / "report-screenshot.png"
    with tempfile.TemporaryDirectory() as profile:
        proc = subprocess.run(
            [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
             "--no-first-run", "--disable-background-networking", "--disable-component-update",
             "--disable-sync", f"--user-data-dir={profile}", "--hide-scrollbars",
             "--window-size=1280,2600", f"--screenshot={shot}",
             (out / "report.html").resolve().as_uri()],
            capture_output=True, text=True, timeout=120)
    assert shot.exists(), proc.stderr[-2000:]
    import matplotlib.image

    px = (matplotlib.image.imread(shot)[:, :, :3] * 255).round()
    assert px.shape[1] == 1280

    def share(hex_color: str) -> float:
        rgb = [int(hex_color[i:i + 2], 16) for i in (1, 3, 5)]
        return float((abs(px - rgb).sum(axis=2) < 12).mean())

    # the embedded pictures were drawn: the forward bars of the timeline (blue), the
    # bottleneck's red, the loss curve's blue; a page of broken images has none of them
    assert share(KIND_COLORS["F"]) > 1e-4
    assert share("#d62728") > 1e-4
    assert share(KIND_COLORS["B"]) > 1e-4
