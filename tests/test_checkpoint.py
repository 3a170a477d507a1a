"""fxpipe.training.checkpoint: DCP checkpoints of stage modules load into the plain model (one process)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn

import fxpipe
from fxpipe.errors import FxpipeError
from fxpipe.partitioner.split import materialize_stages
from fxpipe.training.checkpoint import load_checkpoint, load_into_model, save_checkpoint


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
    saved = {k for k in dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
             if not k.startswith("rng.")}  # the rank's RNG state rides along, for resuming
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
def test_checkpoint_fxpipe_did_not_write_is_refused(tmp_path):
    model, stages = _trained_stages()
    params = {n: p.detach() for m in stages.values() for n, p in m.named_parameters()}
    dcp.save(params, checkpoint_id=str(tmp_path / "step_000001"), no_dist=True)
    with pytest.raises(FxpipeError, match="not a checkpoint fxpipe wrote .*runs code"):
        load_into_model(BNNet(), tmp_path / "step_000001")


def test_checkpoint_without_buffers_is_refused(tmp_path):
    model, stages = _trained_stages()
    for m in stages.values():  # a checkpoint of the parameters only
        for name, _ in list(m.named_buffers()):
            *parents, leaf = name.split(".")
            owner = m.get_submodule(".".join(parents))
            owner._non_persistent_buffers_set.add(leaf)
    save_checkpoint(stages, tmp_path, 1)
    with pytest.raises(FxpipeError, match="running_mean|num_batches_tracked"):
        load_into_model(BNNet(), tmp_path)


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


# ------------------------------------------------------------------ damaged and foreign checkpoints
def _saved(tmp_path):
    model, stages = _trained_stages()
    return model, stages, save_checkpoint(stages, tmp_path, 2)


def _shard(folder):
    return next(p for p in sorted(folder.iterdir()) if p.suffix == ".distcp")


def _relink(p):
    """Replace ``p`` by a symbolic link to a copy of it elsewhere (same bytes)."""
    import shutil

    copy = p.parent.parent / (p.name + ".elsewhere")
    (shutil.copytree if p.is_dir() else shutil.copy2)(p, copy)
    (shutil.rmtree if p.is_dir() else os.unlink)(p)
    p.symlink_to(copy)


@pytest.mark.parametrize("damage, words", [
    (lambda f: _shard(f).write_bytes(_shard(f).read_bytes()[:-7]), "truncated or changed"),
    (lambda f: _shard(f).write_bytes(b"x" + _shard(f).read_bytes()[1:]), "truncated or changed"),
    (lambda f: _shard(f).unlink(), "a shard is missing"),
    (lambda f: (f / ".metadata").write_bytes(b"\x80\x04junk"), "truncated or changed"),
    (lambda f: (f / "manifest.json").write_text("{not json"), "not a valid manifest"),
    (lambda f: (f / "manifest.json").write_text('{"writer": "x"}'), "not an fxpipe checkpoint"),
    (lambda f: (f / "manifest.json").unlink(), "not a checkpoint fxpipe wrote"),
    (lambda f: (f / "extra.pkl").write_bytes(b"\x80\x04."), "does not list"),
    (lambda f: _relink(_shard(f)), "is a symbolic link"),
    (lambda f: _relink(f), "is a symbolic link"),
])
def test_damaged_checkpoint_is_refused_before_it_is_read(tmp_path, damage, words):
    model, _, folder = _saved(tmp_path)
    damage(folder)
    fresh = BNNet()
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(FxpipeError, match=words):
        load_into_model(fresh, tmp_path)
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())  # untouched


def test_checkpoint_of_another_model_is_refused(tmp_path):
    _saved(tmp_path)

    class Wider(BNNet):
        def __init__(self):
            super().__init__()
            self.c = nn.Linear(8, 5)

    with pytest.raises(FxpipeError, match="another model: shapes differ .*c.weight"):
        load_into_model(Wider(), tmp_path)

    class Extra(BNNet):
        def __init__(self):
            super().__init__()
            self.d = nn.Linear(3, 3)

    with pytest.raises(FxpipeError, match="lacks .*d.weight"):
        load_into_model(Extra(), tmp_path)

    class Fewer(BNNet):  # a part of the saved model: its common keys must not load silently
        def __init__(self):
            super().__init__()
            del self.bn2

    with pytest.raises(FxpipeError, match="holds 5 parameters or buffers this model does not "
                                          r"have \(bn2\.bias, bn2\.num_batches_tracked"):
        load_into_model(Fewer(), tmp_path)
    with pytest.raises(FxpipeError, match="saved from another model"):
        load_checkpoint(Fewer(), tmp_path, rng=False)


@pytest.mark.parametrize("pointer", ["../../etc", "/etc/passwd", "step_000009", "x" * 5000])
def test_latest_is_validated_before_it_is_followed(tmp_path, pointer):
    _saved(tmp_path)
    (tmp_path / "latest").write_text(pointer)
    with pytest.raises(FxpipeError, match="not a step_NNNNNN checkpoint folder"):
        load_into_model(BNNet(), tmp_path)


def test_crash_mid_save_keeps_the_previous_latest_and_the_next_save_cleans_up(tmp_path, capsys):
    from fxpipe.training.checkpoint import latest_checkpoint

    _, stages, first = _saved(tmp_path)
    partial = tmp_path / ".step_000004.partial"  # what a save killed half-way leaves
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half")
    assert latest_checkpoint(tmp_path) == first
    load_into_model(BNNet(), tmp_path)  # still loads the previous one
    save_checkpoint(stages, tmp_path, 6)
    assert not partial.exists() and "removed .step_000004.partial" in capsys.readouterr().out
    assert latest_checkpoint(tmp_path).name == "step_000006"


def test_unwritable_checkpoint_folder_is_a_clean_error(tmp_path):
    _, stages = _trained_stages()
    blocker = tmp_path / "ckpt"
    blocker.write_text("a file where the folder should be")
    with pytest.raises(FxpipeError, match="cannot write the checkpoint folder"):
        save_checkpoint(stages, blocker, 1)
    assert blocker.read_text().startswith("a file")  # nothing lost


def test_optimizer_rng_and_train_state_round_trip(tmp_path):
    from fxpipe.training.checkpoint import load_checkpoint

    model, stages = _trained_stages()
    params = list({id(p): p for m in stages.values() for p in m.parameters()}.values())
    opt = torch.optim.AdamW(params, lr=1e-2)
    for m in stages.values():
        for p in m.parameters():
            p.grad = torch.ones_like(p)
    opt.step()
    torch.manual_seed(123)
    save_checkpoint(stages, tmp_path, 5, optimizer=opt, train_state={"lr_schedule": {"x": 1}})
    want_rng = torch.rand(3)
    want = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}

    torch.manual_seed(7)
    fresh = BNNet()
    plan = fxpipe.plan(fresh, SPEC, example_inputs=(torch.randn(4, 4),))
    fresh_stages = materialize_stages(plan, fresh, [0, 1])
    fresh_opt = torch.optim.AdamW(
        list({id(p): p for m in fresh_stages.values() for p in m.parameters()}.values()), lr=1e-2)
    state = load_checkpoint(fresh_stages, tmp_path, optimizer=fresh_opt)
    assert state["step"] == 5 and state["lr_schedule"] == {"x": 1}
    assert torch.equal(torch.rand(3), want_rng)  # the RNG continues where it was saved
    got = fresh_opt.state_dict()["state"][0]
    for k in want:
        assert torch.equal(want[k], got[k]), k
    for (n, p), (_, q) in zip(model.named_parameters(), fresh.named_parameters()):
        assert torch.equal(p, q), n
