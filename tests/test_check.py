"""``fxpipe check SPEC``: the planned pipeline against the same model trained in one process.

Passes (exit 0, ``verdict: EQUIVALENT``) on the bundled gpt-char spec as shipped and on a
transformers GPT-2 (a small configuration of hf-gpt2, so the suite stays quick); fails (exit 1) naming
the first diverging parameter, its stage and the cause on a model with BatchNorm and one with
dropout; the non-mean-loss and hook detectors are checked in this process; spec errors exit 2.
The checks run in this process (``fxpipe_in_process``): the ranks come from one fork server,
started once for the file.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

try:
    from cli_helpers import fxpipe_in_process
except ImportError:  # tests/ collected as a package
    from tests.cli_helpers import fxpipe_in_process

from fxpipe.training.equivalence import (EPS, bound, hooked_modules, likely_causes,
                                         loss_not_a_mean)

HF = """
model:
  hf: GPT2LMHeadModel
  config: {vocab_size: 256, n_positions: 32, n_embd: 32, n_layer: 2, n_head: 2,
           resid_pdrop: 0.0, embd_pdrop: 0.0, attn_pdrop: 0.0}
data: {dataset: "fxpipe.examples.data:python_source_lm", batch_size: 8, seq_len: 32}
parallel: {pipeline: 2, data: 1, microbatches: 2, schedule: 1f1b}
cluster: {devices_per_node: 2, memory_gb: 2}
train: {steps: 50, optimizer: adamw, lr: 1.0e-3, loss: model, seed: 0, timeout_s: 60}
"""

MLP = """
model: {{factory: "tests.check_models:{model}"}}
data: {{dataset: "tests.check_models:features", batch_size: 8}}
parallel: {{pipeline: 2, data: 1, microbatches: 2, schedule: 1f1b}}
cluster: {{devices_per_node: 2, memory_gb: 2}}
train: {{steps: 10, optimizer: {opt}, lr: {lr}, loss: cross_entropy, seed: 0, timeout_s: 60}}
"""


def _check(tmp_path, name: str, text: str, steps: int = 2):
    spec = tmp_path / f"{name}.yaml"
    spec.write_text(text)
    return fxpipe_in_process("check", spec, "--steps", steps)


def _loss_rows(out: str) -> list[tuple[float, float]]:
    rows = re.findall(r"^ *\d+ +\S+ +\S+ +(\S+) +(\S+)", out, re.M)
    return [(float(d), float(t)) for d, t in rows]


@pytest.mark.distributed
def test_passes_on_the_bundled_gpt_spec():
    """The shipped gpt-char spec as a user runs it (its model, data, layout and AdamW)."""
    r = fxpipe_in_process("check", "gpt-char", "--steps", 2)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 stages x 2 replicas" in r.stdout and "fp32, adamw" in r.stdout
    rows = _loss_rows(r.stdout)
    assert len(rows) == 2 and all(d <= t for d, t in rows)
    assert re.search(r"largest parameter difference: \S+ ", r.stdout)
    assert "verdict: EQUIVALENT" in r.stdout and "BEYOND" not in r.stdout


@pytest.mark.distributed
def test_passes_on_a_transformers_gpt2(tmp_path):
    r = _check(tmp_path, "hf", HF)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "GPT2LMHeadModel" in r.stdout and "verdict: EQUIVALENT" in r.stdout
    assert "transformer.h.0" in r.stdout or "lm_head" in r.stdout or "transformer." in r.stdout


@pytest.mark.distributed
def test_batchnorm_fails_with_its_cause(tmp_path):
    r = _check(tmp_path, "bn", MLP.format(model="BatchNormMLP", opt="sgd", lr=0.1))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "verdict: NOT EQUIVALENT" in r.stdout
    assert "first loss beyond it: step 0" in r.stdout
    assert re.search(r"first diverging parameter: fc1\.weight \(stage 0\)", r.stdout)
    assert "- BatchNorm statistics per micro-batch: BatchNorm bn" in r.stdout
    assert "4 samples per micro-batch" in r.stdout
    assert "dropout" not in r.stdout.split("likely causes:")[1]


@pytest.mark.distributed
def test_dropout_fails_with_its_cause(tmp_path):
    r = _check(tmp_path, "drop", MLP.format(model="DropoutMLP", opt="adamw", lr=1.0e-3))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "verdict: NOT EQUIVALENT" in r.stdout
    assert re.search(r"first diverging parameter: fc1\.\w+ \(stage 0\)", r.stdout)
    causes = r.stdout.split("likely causes:")[1]
    assert "- dropout without a fixed generator: dropout drop (p = 0.5)" in causes
    assert "BatchNorm" not in causes


def test_loss_that_is_not_a_mean_is_named():
    torch.manual_seed(0)
    out, target = torch.randn(8, 4), torch.randint(0, 4, (8,))
    w = [0.25] * 4
    summed = lambda o, t: F.cross_entropy(o, t, reduction="sum")  # noqa: E731
    got = loss_not_a_mean(summed, out, target, 4, w, EPS["fp32"])
    assert got is not None and got[0] == pytest.approx(4 * got[1])
    assert loss_not_a_mean(F.cross_entropy, out, target, 4, w, EPS["fp32"]) is None
    causes = likely_causes(nn.Linear(4, 4), microbatches=4, dp=1, mbs=2, loss_check=got,
                           loss_name="mymod:summed")
    assert [c.title for c in causes] == ["a loss that is not a mean"]
    assert "'mymod:summed'" in causes[0].detail and "reduction='mean'" in causes[0].suggestion


def test_hooks_and_batchnorm_with_one_microbatch():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.0))
    assert likely_causes(model, microbatches=1, dp=1, mbs=8, loss_check=None,
                         loss_name="cross_entropy") == []  # one batch: BatchNorm sees it all
    handle = model[0].register_forward_hook(lambda m, i, o: None)
    try:
        assert hooked_modules(model) == ["0"]
        causes = likely_causes(model, microbatches=2, dp=1, mbs=4, loss_check=None,
                               loss_name="cross_entropy")
        assert [c.title for c in causes] == ["BatchNorm statistics per micro-batch",
                                             "a hook with side effects"]
    finally:
        handle.remove()
    assert hooked_modules(model) == []


def test_tolerance_follows_the_precision():
    assert EPS["fp32"] == torch.finfo(torch.float32).eps
    assert EPS["bf16"] == 2.0 ** -7 == torch.finfo(torch.bfloat16).eps  # 8 significant bits
    assert bound(2.0, 16, 3, EPS["bf16"]) == 2.0 ** -7 * 16 * 3 * 2.0


@pytest.mark.parametrize("args, message", [
    (("no-such-spec.yaml",), "no-such-spec"),
    (("gpt-char", "--steps", "0"), "--steps must be at least 1"),
])
def test_spec_errors_exit_2(args, message):
    r = fxpipe_in_process("check", *args)
    assert r.returncode == 2 and message in r.stderr, r.stderr


@pytest.mark.parametrize("method, warm", [("fp16", 0), ("powersgd", 2), ("topk", 0)])
def test_lossy_gradient_compression_is_named(method, warm):
    """Compressed gradients differ from one process's by design: named, with the step it
    starts (after the exact warm-up steps of PowerSGD / top-k; fp16 rounds from the first)."""
    kw = dict(microbatches=2, mbs=4, loss_check=None, loss_name="cross_entropy",
              compression=method, warmup_steps=warm)
    assert likely_causes(nn.Linear(4, 4), dp=1, **kw) == []  # one replica: nothing reduced
    causes = likely_causes(nn.Linear(4, 4), dp=2, **kw)
    assert [c.title for c in causes] == ["gradient compression"]
    assert f"'{method}'" in causes[0].detail and f"from step {warm + 1} on" in causes[0].detail
    assert "grad_compression: none" in causes[0].suggestion
    assert likely_causes(nn.Linear(4, 4), dp=2, **{**kw, "compression": "none"}) == []
