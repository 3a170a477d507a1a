"""Fixtures shared by several test modules, and how the two xdist workers share the files."""

from __future__ import annotations

import subprocess
import sys

import pytest

# The suite starts about a hundred Python processes (fxpipe CLIs, torchrun workers). Where
# PYTHONDONTWRITEBYTECODE is set, each would compile fxpipe from source (about 0.7 s CPU): the
# test session writes the bytecode caches (gitignored, __pycache__) that they then read.
sys.dont_write_bytecode = False

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


#: the files that take longest (CPU seconds on 2 cores, heaviest first): under xdist (pyproject's
#: addopts: ``-n 2 --dist loadfile``) whole files go to the two workers in collection order, so
#: these start first and no long file is left for the end; the others follow as collected
HEAVY_FIRST = ("test_compiled_stages.py", "test_resume.py", "test_multinode.py",
               "test_real_models.py",
               "test_tensor_parallel.py", "test_tensor_resume.py", "test_real_model_inputs.py",
               "test_moe_example.py", "test_context_parallel.py",
               "test_compiled.py", "test_data_sharding.py",
               "test_user_data.py", "test_check.py", "test_gpu_check_dry_run.py",
               "test_faults.py", "test_bench_planning_smoke.py", "test_cli.py",
               "test_planning_at_scale.py", "test_executor.py", "test_schedules_execute.py",
               "test_lever_explanations.py", "test_recompute.py", "test_memory_consistency.py",
               "test_async_updates.py", "test_compression.py", "test_bench_hf_smoke.py",
               "test_bench_compression_smoke.py")
#: files that share a session fixture or cache run on one xdist worker, as one unit: one launch
#: of :func:`tiny_run` rather than one per worker
SAME_WORKER = {"test_cli.py": "tiny_run", "test_reports.py": "tiny_run",
               "test_user_data.py": "tiny_run",
               # real_models.plan's cache: the plans both ask for are made once
               "test_real_models.py": "real_models", "test_real_model_inputs.py": "real_models",
               # the tensor-parallel tests' plans and single-process references, and the fork
               # server's preload, serve the compiled-stage tests too
               "test_tensor_parallel.py": "tensor", "test_compiled_stages.py": "tensor"}


def pytest_collection_modifyitems(items):
    first = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: files stay whole


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` (a module's fixtures run once, on one worker), with the files of
    SAME_WORKER as one unit. Units go out in collection order (``--no-loadscope-reorder``)."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Scheduler(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = super()._split_scope(nodeid)
            return SAME_WORKER.get(file.rsplit("/", 1)[-1], file)

    return Scheduler(config, log)
