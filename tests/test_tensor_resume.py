"""Tensor-parallel ``fxpipe run`` through its checkpoints (issue 40): models with non-persistent
buffers (the rotary ``inv_freq`` of Llama, a user model's own) under tensor 2 x
pipeline 2 save exactly the plain model's ``state_dict()`` keys, finish with status 0, resume
to the losses of the uninterrupted run, and export a file the plain model loads strictly."""

from __future__ import annotations

import shutil

import pytest
import torch

try:
    import real_models as zoo
    from cli_helpers import fxpipe_cli, fxpipe_in_process
    from shared_models import assert_plain_state_keys, buffered_gpt
    from test_resume import crash_after, losses
except ImportError:  # collected as a package
    from tests import real_models as zoo
    from tests.cli_helpers import fxpipe_cli, fxpipe_in_process
    from tests.shared_models import assert_plain_state_keys, buffered_gpt
    from tests.test_resume import crash_after, losses

pytestmark = pytest.mark.distributed
pytest.importorskip("transformers")

#: 4 steps, a checkpoint every 2: the resume starts from step 2's
STEPS, RESUME_AT = 4, 2
SPEC = """
model: {model}
data: {data}
parallel: {{pipeline: 2, data: 1, tensor: 2, microbatches: 2, schedule: 1f1b}}
cluster: {{devices_per_node: 4, memory_gb: 2}}
train: {{steps: {steps}, optimizer: adamw, lr: 2.0e-3, seed: 0, log_every: 1, eval_batches: 0,
        timeout_s: 60, loss: {loss}, checkpoint: {{every: 2}}}}
output: {{dir: run}}
"""
LM_DATA = '{dataset: "fxpipe.examples.data:python_source_lm", batch_size: 8, seq_len: 16}'


def _hf(name: str) -> str:
    cfg = dict(zoo.hf_spec(name)["config"], vocab_size=256, max_position_embeddings=16)
    return f'{{hf: {zoo.hf_spec(name)["hf"]}, config: {cfg}}}'


MODELS = {
    "llama": (_hf("llama"), LM_DATA, "model"),
    "user": ('{factory: "tests.shared_models:buffered_gpt", args: {vocab_size: 256}}',
             "{batch_size: 8, seq_len: 16}", "cross_entropy"),
}


def _plain(name: str) -> torch.nn.Module:
    if name == "user":
        return buffered_gpt(vocab_size=256)
    tf = zoo._tf()
    spec = zoo.hf_spec(name)
    cls = getattr(tf, spec["hf"])
    return cls._from_config(cls.config_class(**dict(spec["config"], vocab_size=256,
                                                    max_position_embeddings=16)))


@pytest.mark.parametrize("name", MODELS)
def test_tensor_pipeline_run_checkpoints_resumes_and_exports(name, tmp_path):
    model, data, loss = MODELS[name]
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC.format(model=model, data=data, loss=loss, steps=STEPS))
    run = tmp_path / "run"
    r = fxpipe_cli("run", spec, "--out", run, "--no-report", timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    whole = losses(run)
    assert [s for s, _ in whole] == list(range(STEPS))

    plain = _plain(name)
    from fxpipe.training.checkpoint import _saved_model_keys, open_checkpoint

    for step in (RESUME_AT, STEPS):
        _, manifest = open_checkpoint(run / "checkpoint" / f"step_{step:06d}")
        assert_plain_state_keys(plain, _saved_model_keys(manifest))

    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    crash_after(resumed, RESUME_AT)
    r = fxpipe_cli("run", spec, "--resume", resumed, "--no-report", timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert losses(resumed) == whole  # the same steps, the same losses (full precision)

    out = tmp_path / "model.pt"
    r = fxpipe_in_process("export", resumed, out)
    assert r.returncode == 0, r.stderr
    plain.load_state_dict(torch.load(out, weights_only=True), strict=True)
