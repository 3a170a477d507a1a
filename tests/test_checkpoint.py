"""fxpipe.training.checkpoint: DCP checkpoints of stage modules load into the plain model (one process)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn

import fxpipe
from fxpipe.errors import FxpipeError
from fxpipe.partitioner.split import materialize_stages
from fxpipe.training.checkpoint import load_into_model, save_checkpoint


class BNNet(nn.Module):
    """Two stages, each with a BatchNorm; a weight tied across the stages; a non-persistent
    buffer (a constant the model rebuilds, never checkpointed)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.mix = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.b.weight = self.mix.weight  # tied across stages 0 and 1
        self.bn2 = nn.BatchNorm1d(8)
        self.c = nn.Linear(8, 3)
        self.register_buffer("scale", torch.tensor(2.0), persistent=False)

    def forward(self, x):
        h = self.mix(self.bn(self.a(x)).relu())
        fxpipe.pipe_split()
        return self.c(self.bn2(self.b(h)).relu() * self.scale)


SPEC = {"model": {"factory": "torch.nn:Identity"}, "data": {"batch_size": 8},
        "parallel": {"pipeline": 2, "data": 1, "microbatches": 2, "schedule": "gpipe"},
        "cluster": {"devices_per_node": 2}}


def _trained_stages():
    torch.manual_seed(0)
    model = BNNet()
    plan = fxpipe.plan(model, SPEC, example_inputs=(torch.randn(4, 4),))
    stages = materialize_stages(plan, model, [0, 1])
    for step in range(3):  # training-mode forwards update the running statistics
        x = torch.randn(4, 4) * (step + 1) + step
        stages[1](*stages[0](x))[0].sum().backward()
    return model, stages


def test_checkpoint_holds_persistent_buffers_and_restores_them(tmp_path):
    model, stages = _trained_stages()
    assert int(model.bn.num_batches_tracked) == 3
    path = save_checkpoint(stages, tmp_path, 3)
    saved = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    assert {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked",
            "bn2.running_mean"} <= saved
    assert "scale" not in saved  # non-persistent: excluded, as in model.state_dict()
    # every key of the plain model's state_dict, the tied weight under one of its two names
    assert len(saved & {"b.weight", "mix.weight"}) == 1
    assert saved | {"b.weight", "mix.weight"} == set(model.state_dict())

    torch.manual_seed(1)
    fresh = BNNet()
    assert not torch.equal(fresh.bn.running_mean, model.bn.running_mean)
    keys = load_into_model(fresh, tmp_path)  # follows root/latest
    assert "bn.running_mean" in keys and "bn2.num_batches_tracked" in keys
    want, got = model.state_dict(), fresh.state_dict()
    assert set(want) == set(got)
    for name in want:  # every parameter and running statistic, tied aliases included
        assert torch.equal(want[name], got[name]), name
    assert fresh.b.weight is fresh.mix.weight
    assert int(fresh.bn.num_batches_tracked) == 3


@pytest.mark.filterwarnings("ignore:.*assuming the intent is to")
def test_checkpoint_without_buffers_is_refused(tmp_path):
    model, stages = _trained_stages()
    params = {n: p.detach() for m in stages.values() for n, p in m.named_parameters()}
    dcp.save(params, checkpoint_id=str(tmp_path / "step_000001"), no_dist=True)
    with pytest.raises(FxpipeError, match="running_mean|num_batches_tracked"):
        load_into_model(BNNet(), tmp_path / "step_000001")


def test_existing_checkpoint_is_never_overwritten(tmp_path):
    _, stages = _trained_stages()
    save_checkpoint(stages, tmp_path, 1)
    with pytest.raises(FxpipeError, match="refusing to overwrite"):
        save_checkpoint(stages, tmp_path, 1)


def test_stage_state_shares_storage_and_skips_constants():
    from fxpipe.training.checkpoint import stage_state

    model, stages = _trained_stages()
    state = stage_state(stages)
    assert state["bn.running_mean"].data_ptr() == model.bn.running_mean.data_ptr()  # no copy
    assert not any(t.requires_grad for t in state.values())
    assert "scale" not in state and not any(k.startswith("lifted") for k in state)
