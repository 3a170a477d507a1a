"""Fixtures shared by several test modules."""

from __future__ import annotations

import subprocess
import sys

import pytest

try:
    from cli_helpers import REPO, cli_env
except ImportError:  # collected as a package
    from tests.cli_helpers import REPO, cli_env

#: the spec of :func:`tiny_run`: what test_cli (the training knobs: 2 batches per optimizer step,
#: clipping, warm-up + cosine) and test_reports (a log line every 2 steps, held-out batches)
#: read from that run
TINY_RUN_SPEC = """
model:
  factory: "fxpipe.examples.gpt:CharGPT"
  args: {vocab_size: 256, block_size: 32, n_layer: 2, n_head: 2, n_embd: 32}
data: {batch_size: 8, seq_len: 32}
parallel: {pipeline: 2, data: 2, microbatches: 2, schedule: 1f1b}
cluster: {devices_per_node: 4, memory_gb: 2}
train: {steps: 6, optimizer: adamw, lr: 1.0e-3, seed: 0, log_every: 2, timeout_s: 60,
        eval_batches: 2, grad_accumulation: 2, grad_clip: 1.0,
        lr_schedule: {warmup_steps: 1, decay: cosine, min_lr: 5.0e-4}}
output: {dir: tiny-run}
"""


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """One small ``fxpipe run`` in a child process (CharGPT on 2 stages x 2 replicas, 1F1B, 6
    steps), shared by test_cli's end-to-end run and test_reports' run-level checks: one launch
    (about half a minute on two cores) instead of one per module. Off a terminal
    (FXPIPE_PROGRESS unset): plain progress lines.

    Returns ``(spec path, run folder, CompletedProcess)``; the tests assert the exit code."""
    tmp = tmp_path_factory.mktemp("tiny-run")
    spec = tmp / "tiny.yaml"
    spec.write_text(TINY_RUN_SPEC)
    out = tmp / "run"
    env = cli_env()
    env.pop("FXPIPE_PROGRESS", None)
    r = subprocess.run([sys.executable, "-m", "fxpipe", "run", str(spec), "--out", str(out)],
                       capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    return spec, out, r
