"""The CLI: clear errors without tracebacks, and a small end-to-end `fxpipe run`."""

from __future__ import annotations

import csv
import json
import re

import pytest
import torch

from fxpipe.examples.gpt import CharGPT
from fxpipe.training.checkpoint import load_into_model

try:
    from cli_helpers import fxpipe_cli, fxpipe_in_process
except ImportError:  # collected as a package
    from tests.cli_helpers import fxpipe_cli, fxpipe_in_process


TINY = """
model:
  factory: "fxpipe.examples.gpt:CharGPT"
  args: {vocab_size: 256, block_size: 32, n_layer: 2, n_head: 2, n_embd: 32}
data: {batch_size: 8, seq_len: 32}
parallel: {pipeline: 2, data: 2, microbatches: 2, schedule: 1f1b}
cluster: {devices_per_node: 4, memory_gb: 2}
train: {steps: 3, optimizer: adamw, lr: 1.0e-3, seed: 0, log_every: 1, timeout_s: 60,
       grad_accumulation: 2, grad_clip: 1.0,
       lr_schedule: {warmup_steps: 1, decay: cosine, min_lr: 5.0e-4}}
output: {dir: tiny-run}
"""


def test_bad_spec_exits_2_with_file_line_and_no_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(TINY.replace("microbatches: 2", "microbatchs: 2"))
    r = fxpipe_in_process("plan", str(bad))
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert f"{bad}:" in r.stderr and "did you mean 'microbatches'" in r.stderr


def test_batch_that_does_not_split_is_rejected(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(TINY.replace("batch_size: 8", "batch_size: 6"))
    r = fxpipe_in_process("plan", str(bad))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "data.batch_size" in r.stderr and "divisible" in r.stderr


@pytest.mark.distributed
def test_show_missing_plan_is_a_clear_error(tmp_path):
    r = fxpipe_cli("show", str(tmp_path / "nope.json"))
    assert r.returncode == 2 and "Traceback" not in r.stderr and "fxpipe plan" in r.stderr
    junk = tmp_path / "junk.json"
    junk.write_text("{not json")
    r = fxpipe_cli("show", str(junk))
    assert r.returncode == 2 and "Traceback" not in r.stderr


def test_launch_errors_leave_no_output_folder(tmp_path):
    spec = tmp_path / "tiny.yaml"
    spec.write_text(TINY)
    for args, words in ((["--nnodes", "2"], "cluster.nodes"),
                        (["--rdzv-endpoint", "127.0.0.1:notaport"], "HOST:PORT"),
                        (["--steps", "0"], "--steps")):
        out = tmp_path / "never"
        r = fxpipe_in_process("run", str(spec), "--out", str(out), *args)
        assert r.returncode == 2 and "Traceback" not in r.stderr and words in r.stderr
        assert not out.exists(), "a run that fails before training must not create its folder"
    r = fxpipe_in_process("run", str(spec), "--out", str(spec / "sub"))
    assert r.returncode == 2 and "Traceback" not in r.stderr and "Not a directory" in r.stderr


def test_loss_that_does_not_fit_is_caught_before_launch(tmp_path):
    spec = tmp_path / "mse.yaml"
    spec.write_text(TINY.replace("optimizer: adamw", "loss: mse, optimizer: adamw"))
    out = tmp_path / "never"
    r = fxpipe_in_process("run", str(spec), "--out", str(out))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "train.loss 'mse' cannot take the model output" in r.stderr
    assert not out.exists()


@pytest.mark.distributed
def test_plan_then_show(tmp_path):
    spec = tmp_path / "tiny.yaml"
    spec.write_text(TINY)
    r = fxpipe_in_process("plan", str(spec), "--out", str(tmp_path / "p"))
    assert r.returncode == 0, r.stderr
    for f in ("plan.json", "partition.dot", "summary.txt", "partition.png", "partition.svg"):
        assert (tmp_path / "p" / f).exists()
    svg = (tmp_path / "p" / "partition.svg").read_text()  # the picture: a column per stage
    assert sorted(set(re.findall(r'id="(stage-column-\d+)"', svg))) == ["stage-column-0",
                                                                       "stage-column-1"]
    assert 'id="block-0-' in svg and 'id="cut-0-1-' in svg
    r2 = fxpipe_cli("show", str(tmp_path / "p"))
    assert r2.returncode == 0 and "bottleneck" in r2.stdout


def test_simulate_prints_every_schedule(tmp_path):
    spec = tmp_path / "tiny.yaml"
    spec.write_text(TINY)
    r = fxpipe_in_process("simulate", str(spec), "--out", str(tmp_path / "sim"))
    assert r.returncode == 0, r.stderr
    for name in ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "v-half", "v-min", "dualpipev"):
        assert name in r.stdout
    assert (tmp_path / "sim" / "simulated_1f1b.json").exists()
    both = (tmp_path / "sim" / "simulated.svg").read_text()  # every schedule, 2 rows each
    for name in ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"):
        assert (tmp_path / "sim" / f"simulated_{name}.png").exists()
        assert len(set(re.findall(rf'id="(timeline-{name}-row-\d+)"', both))) == 2, name


@pytest.mark.distributed
def test_run_end_to_end_and_never_overwrites(tiny_run):
    """The run of conftest.tiny_run (shared with test_reports): conftest.TINY_RUN_SPEC has the
    training knobs of TINY above, over 6 steps with a log line every 2 and 2 held-out batches."""
    spec, out, r = tiny_run
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "tokens/s" in r.stdout
    # the training knobs of the spec: 2 batches per optimizer step, clipping, warm-up + cosine
    # (the full rate at step 0, min_lr at the last step, 5)
    assert "grad norm" in r.stdout and "lr 1.00e-03" in r.stdout and "lr 5.00e-04" in r.stdout
    rows = list(csv.DictReader(open(out / "losses.csv")))
    assert [int(x["step"]) for x in rows] == list(range(6))
    assert (out / "timeline.json").exists() and (out / "plan.json").exists()
    figures = json.loads((out / "eval.json").read_text())
    assert figures["val_loss_final"] < figures["val_loss_initial"]
    # the DCP checkpoint is keyed by the original FQNs: it loads into the plain model
    torch.manual_seed(123)
    model = CharGPT(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32)
    before = model.h[0].fc.weight.detach().clone()
    keys = load_into_model(model, out / "checkpoint")
    assert "h.0.fc.weight" in keys
    assert not torch.equal(before, model.h[0].fc.weight)
    # a second run into the same folder refuses and keeps the first run's files
    stamp = (out / "losses.csv").read_text()
    r2 = fxpipe_in_process("run", str(spec), "--out", str(out))
    assert r2.returncode == 2 and "Traceback" not in r2.stderr
    assert "--overwrite" in r2.stderr
    assert (out / "losses.csv").read_text() == stamp
    # nor may `fxpipe plan --out` replace the plan that run's checkpoints belong to
    plan_stamp = (out / "plan.json").read_text()
    r3 = fxpipe_in_process("plan", str(spec), "--out", str(out))
    assert r3.returncode == 2 and "Traceback" not in r3.stderr
    assert (out / "plan.json").read_text() == plan_stamp
