"""fxpipe.compile in a user's own training loop: the same numbers as single-process PyTorch.

One user-style loop (:func:`user_loop`: parameter groups with weight decay on the matrices
only, a cosine learning-rate schedule, clipping at 1.0, gradient accumulation over 2 batches,
5 optimizer steps) runs once on the whole model in this process and once through
``fxpipe.compile`` on 2 stages x 2 replicas (4 gloo ranks, one process group for every case):
AdamW under 1F1B (planned from the spec on rank 0), in float64, and SGD with momentum under
ZB-H1 (from a Plan), in float32. The bounds follow from what is compared (tests/tolerances.py:
AdamW magnifies float32 rounding of zero gradients to the learning rate, float64's it does not). The model is CharGPT with tied embeddings, so the tied gradient is accumulated across
two stages and two ``step()`` calls. The same ranks then check forward-only evaluation, the
DCP round trip of ``pipe.state_dict()`` and the misuse errors.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpipe
from fxpipe.runtime.local_ranks import run_ranks
from fxpipe.training.compiled import UsageError

try:
    from shared_models import SEQ, VOCAB, tiny_gpt
    from tolerances import adamw_param_bound, bound, max_abs
except ImportError:  # tests/ collected as a package
    from tests.shared_models import SEQ, VOCAB, tiny_gpt
    from tests.tolerances import adamw_param_bound, bound, max_abs

PIPE, DP, M, MBS = 2, 2, 2, 2
B = DP * M * MBS
K, OPT_STEPS, CLIP = 2, 5, 1.0
LR = {"adamw": 3e-3, "sgd": 0.3}
DTYPE = {"adamw": torch.float64, "sgd": torch.float32}  # see the module doc


def spec(schedule: str) -> dict:
    return {
        "model": {"factory": "fxpipe.examples.gpt:CharGPT"},
        "data": {"batch_size": B, "seq_len": SEQ},
        "parallel": {"pipeline": PIPE, "data": DP, "microbatches": M, "schedule": schedule},
        "cluster": {"nodes": 1, "devices_per_node": PIPE * DP, "memory_gb": 4,
                    "device_tflops": 0.02},
        "train": {"loss": "cross_entropy", "grad_accumulation": K, "timeout_s": 60},
    }


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global batch ``i``: random tokens, about 30% of the targets ignored (-100), so that the
    micro-batches count different numbers of targets."""
    g = torch.Generator().manual_seed(500 + i)
    x = torch.randint(0, VOCAB, (B, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (B, SEQ), generator=g)
    return x, y.masked_fill(torch.rand(B, SEQ, generator=g) < 0.3, -100)


def make_optimizer(kind: str, named) -> torch.optim.Optimizer:
    named = list(named)
    groups = [{"params": [p for n, p in named if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for n, p in named if p.dim() < 2], "weight_decay": 0.0}]
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=LR[kind])
    return torch.optim.SGD(groups, lr=LR[kind], momentum=0.9)


def user_loop(kind, named, step, clip, zero_grad, first_grads=None):
    """The training loop a user writes; the same code drives both runs."""
    opt = make_optimizer(kind, named)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=OPT_STEPS)
    losses, norms = [], []
    for s in range(OPT_STEPS):
        for j in range(K):
            losses.append(step(*batch(s * K + j)))
        if s == 0 and first_grads is not None:
            first_grads.update({n: p.grad.detach().clone() for n, p in named if p.grad is not None})
        norms.append(float(clip(CLIP)))
        opt.step()
        sched.step()
        zero_grad()
    return losses, norms


def _ce(model, x, y):
    return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1), ignore_index=-100)


def reference(kind: str):
    """Single-process PyTorch: the whole model in ``DTYPE[kind]``, (loss / K).backward() per
    batch."""
    model = tiny_gpt().to(DTYPE[kind])

    def step(x, y):
        loss = _ce(model, x, y)
        (loss / K).backward()
        return loss.item()

    grads: dict[str, torch.Tensor] = {}
    named = list(model.named_parameters())
    losses, norms = user_loop(kind, named, step,
                              lambda c: torch.nn.utils.clip_grad_norm_(model.parameters(), c),
                              model.zero_grad, grads)
    return losses, norms, model, grads


def _np(named) -> dict[str, np.ndarray]:
    return {n: t.detach().numpy().copy() for n, t in named}


def _error(fn) -> str:
    try:
        fn()
    except UsageError as e:
        return str(e)
    return "no error"


def _worker(rank: int, zb_plan: dict, ckpt: str):
    import torch.distributed.checkpoint as dcp

    out = {}
    # AdamW, 1F1B, float64: planned from the spec on rank 0 and broadcast
    pipe = fxpipe.compile(tiny_gpt().double(), spec("1f1b"),
                          example_inputs=(torch.zeros(1, SEQ, dtype=torch.long),))
    named = list(pipe.named_parameters())
    grads: dict[str, torch.Tensor] = {}
    losses, norms = user_loop("adamw", named, pipe.step, pipe.clip_grad_norm_, pipe.zero_grad,
                              grads)
    out["adamw"] = (losses, norms, _np(named), _np(grads.items()))
    out["where"] = (pipe.pipe_rank, pipe.replica, pipe.stages, pipe.is_first_stage,
                    pipe.is_last_stage)
    # SGD with momentum, ZB-H1 (split backward), float32: from a Plan
    model = tiny_gpt()
    pipe = fxpipe.compile(model, fxpipe.Plan.from_dict(zb_plan))
    named = list(pipe.named_parameters())
    grads = {}
    losses, norms = user_loop("sgd", named, pipe.step, pipe.clip_grad_norm_, pipe.zero_grad,
                              grads)
    out["sgd"] = (losses, norms, _np(named), _np(grads.items()))
    # forward-only evaluation: the same loss on every rank, gradients untouched
    pipe.step(*batch(100))
    before = _np((n, p.grad) for n, p in named)
    pipe.eval()
    out["eval"] = pipe.evaluate(*batch(200))
    out["eval_in_eval_mode_step"] = _error(lambda: pipe.step(*batch(0)))
    pipe.train()
    after = _np((n, p.grad) for n, p in named)
    out["grads_untouched"] = all(np.array_equal(before[n], after[n]) for n in before)
    pipe.zero_grad()
    # DCP: save, spoil, load back in place
    state = _np(pipe.state_dict().items())
    dcp.save(pipe.state_dict(), checkpoint_id=ckpt)
    with torch.no_grad():
        for p in pipe.parameters():
            p.zero_()
    sd = pipe.state_dict()
    dcp.load(sd, checkpoint_id=ckpt)
    pipe.load_state_dict(sd)
    out["dcp_roundtrip"] = all(np.array_equal(state[n], v) for n, v in _np(sd.items()).items())
    from fxpipe.training.checkpoint import save_checkpoint

    save_checkpoint(pipe.module, os.path.join(os.path.dirname(ckpt), "fxpipe"), 1)
    out["full_state_dict_loads"] = pipe.load_state_dict(tiny_gpt().state_dict()) is not None
    # misuse: another rank's parameters in the optimizer, a batch that does not split,
    # an optimizer step after the wrong number of step() calls
    wrong = torch.optim.SGD(model.parameters(), lr=0.1)
    for j in range(K):
        pipe.step(*batch(j))
    out["foreign"] = _error(wrong.step)
    pipe.zero_grad()
    x, y = batch(0)
    out["odd_batch"] = _error(lambda: pipe.step(x[:6], y[:6]))
    out["big_batch"] = _error(lambda: pipe.step(torch.cat([x, x]), torch.cat([y, y])))
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    pipe.step(x, y)
    out["count"] = _error(opt.step)
    # no false alarm: gradients cleared by optimizer.zero_grad(set_to_none=False)
    opt.zero_grad(set_to_none=False)
    ok = True
    for _ in range(2):
        for j in range(K):
            pipe.step(*batch(j))
        ok = ok and _error(opt.step) == "no error"
        opt.zero_grad(set_to_none=False)
    out["zero_grad_not_none_ok"] = ok
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    zb = fxpipe.plan(tiny_gpt(), spec("zb-h1"), (torch.zeros(1, SEQ, dtype=torch.long),))
    ckpt = tmp_path_factory.mktemp("dcp") / "ckpt"
    return run_ranks(_worker, PIPE * DP, zb.to_dict(), str(ckpt), timeout_s=400,
                     dist_timeout_s=60), ckpt


def _merged(results, kind):
    params = {}
    for r in results:
        params.update(r[kind][2])
    return params


def _worst(got: dict[str, np.ndarray], ref: dict[str, torch.Tensor]) -> float:
    return max(float((torch.from_numpy(v) - ref[n].detach()).abs().max()) for n, v in got.items())


def _bounds(kind: str, ref_run) -> dict[str, float]:
    """What rounding explains (tests/tolerances.py): every reduction the two runs order
    differently runs over the K batches of B samples an optimizer step accumulates; losses are
    per batch (B samples, K x OPT_STEPS of them), gradients and parameters per optimizer step.
    SGD's momentum carries a gradient difference into every later step: lr / (1 - 0.9)."""
    ref_losses, _, ref_model, ref_grads = ref_run
    dtype, steps, terms = DTYPE[kind], OPT_STEPS, K * B
    g = max_abs(ref_grads.values())
    theta = max_abs(p.detach() for p in ref_model.parameters())
    out = {"loss": bound(max(ref_losses), B, K * OPT_STEPS, dtype),
           "norm": bound(1.0, terms, steps, dtype),  # relative
           "grads": bound(g, terms, 1, dtype)}  # the first step, from the same weights
    if kind == "adamw":
        lrs = [LR[kind] * 0.5 * (1 + math.cos(math.pi * s / OPT_STEPS)) for s in range(steps)]
        out["params"] = adamw_param_bound(sum(lrs), g, theta, terms, steps, dtype=dtype)
    else:
        out["params"] = bound(theta + LR[kind] / (1 - 0.9) * g, terms, steps, dtype)
    return out


def _check(results, kind, ref_run):
    ref_losses, ref_norms, ref_model, ref_grads = ref_run
    tol = _bounds(kind, ref_run)
    ref = dict(ref_model.named_parameters())
    for r in results:  # every rank reports the same losses and gradient norms
        losses, norms = r[kind][0], r[kind][1]
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < tol["loss"], (losses, tol)
        assert max(abs(a - b) / b for a, b in zip(norms, ref_norms)) < tol["norm"], (norms, tol)
    params = _merged(results, kind)
    assert set(params) == set(ref), "every parameter is trained, under the model's names"
    assert _worst(params, ref) < tol["params"], (_worst(params, ref), tol)
    assert ref_norms[0] > CLIP  # clipping was active
    grads = {}  # the first accumulated gradients themselves (before the optimizer), tied included
    for r in results:
        grads.update(r[kind][3])
    assert "wte.weight" in grads and set(grads) == set(ref)
    assert _worst(grads, ref_grads) < tol["grads"], (_worst(grads, ref_grads), tol)


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_user_loop_matches_single_process(ranks, kind):
    results, _ = ranks
    _check(results, kind, reference(kind))


@pytest.mark.distributed
def test_ranks_know_their_place(ranks):
    results, _ = ranks
    assert [r["where"] for r in results] == [
        (0, 0, (0,), True, False), (1, 0, (1,), False, True),
        (0, 1, (0,), True, False), (1, 1, (1,), False, True)]


@pytest.mark.distributed
def test_evaluate_and_checkpoint(ranks):
    from fxpipe.training.checkpoint import load_into_model

    results, ckpt = ranks
    _, _, model, _ = reference("sgd")
    x, y = batch(200)
    with torch.no_grad():
        want = float(F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)))
    tol = bound(want, K * B, OPT_STEPS + 1)  # the SGD run's weights, one more batch
    for r in results:
        assert abs(r["eval"] - want) < tol, (r["eval"], want, tol)
        assert r["grads_untouched"] and r["dcp_roundtrip"] and r["full_state_dict_loads"]
        assert "pipe.train()" in r["eval_in_eval_mode_step"]
    fresh = tiny_gpt()
    load_into_model(fresh, ckpt.parent / "fxpipe")  # fxpipe's checkpoint of the same state
    params = _merged(results, "sgd")
    for n, p in fresh.named_parameters():
        assert np.array_equal(p.detach().numpy(), params[n]), n


@pytest.mark.distributed
def test_misuse_errors(ranks):
    results, _ = ranks
    for r in results:
        assert "does not train" in r["foreign"] and "pipe.parameters()" in r["foreign"]
        assert "does not split" in r["odd_batch"] and f"global batch of {B}" in r["odd_batch"]
        assert f"global batch of {B}" in r["big_batch"] and "data.batch_size: 16" in r["big_batch"]
        assert "after 1 pipe.step() calls, but grad_accumulation is 2" in r["count"]
        assert r["zero_grad_not_none_ok"]


def test_compile_outside_torch_distributed(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(UsageError, match=r"torchrun --nproc-per-node 4"):
        fxpipe.compile(tiny_gpt(), spec("1f1b"))


class DropNet(nn.Module):
    """Dropout and BatchNorm: eval mode changes what they compute."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.bn, self.drop = nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Dropout(0.5)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x)))))


def test_eval_mode_runs_dropout_off_and_batchnorm_on_running_stats():
    """One rank, one stage (no process group needed): after a few training steps, the
    evaluation loss in eval mode equals the plain model's in eval mode, and evaluating
    changes no running statistic."""
    net_spec = {"model": {"factory": "test_compiled:DropNet"}, "data": {"batch_size": 8},
                "parallel": {"pipeline": 1, "data": 1, "microbatches": 2},
                "train": {"loss": "cross_entropy", "timeout_s": 30}}
    model = DropNet()
    pipe = fxpipe.compile(model, net_spec, example_inputs=(torch.randn(2, 6),))
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    for _ in range(3):
        pipe.step(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g))
        opt.step()
        pipe.zero_grad()
    x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
    stats = {n: b.clone() for n, b in model.bn.named_buffers()}
    pipe.eval()
    got = pipe.evaluate(x, y)
    model.eval()
    with torch.no_grad():
        want = float(F.cross_entropy(model(x), y))
    assert abs(got - want) < bound(want, 8, 4), (got, want)  # 3 steps of 8 samples, eval
    assert all(torch.equal(stats[n], b) for n, b in model.bn.named_buffers())
    with pytest.raises(UsageError, match="eval mode"):
        pipe.step(x, y)


class TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def test_fp16_overflowing_step_adds_nothing_to_the_accumulation():
    """fp16 loss scaling with gradients left in .grad: a step() whose gradients overflow is
    dropped (the earlier step's gradients stay as they were, unscaled once), the scale backs
    off, and the next step adds its own."""
    net_spec = {"model": {"factory": "test_compiled:TinyNet"}, "data": {"batch_size": 8},
                "parallel": {"pipeline": 1, "data": 1, "microbatches": 2},
                "train": {"loss": "cross_entropy", "precision": "fp16", "timeout_s": 30}}
    model = TinyNet()
    pipe = fxpipe.compile(model, net_spec, example_inputs=(torch.randn(2, 6),),
                          grad_accumulation=3)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
    pipe.step(x, y)
    first = {n: p.grad.clone() for n, p in pipe.named_parameters()}
    scale = pipe.executor.loss_scaler.scale
    pipe.step(x * 1e6, y)  # overflows fp16
    assert pipe.skipped_steps == [1] and pipe.executor.loss_scaler.scale == scale / 2
    assert all(torch.equal(first[n], p.grad) for n, p in pipe.named_parameters())
    pipe.step(x, y)  # the same batch again: twice the first gradients (fp16 forward)
    for n, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, 2 * first[n], rtol=1e-2, atol=1e-4)


@pytest.mark.distributed
def test_example_script_trains_resumes_and_loads_into_the_plain_model(tmp_path):
    """examples/train_torchrun.py under torchrun: 4 steps, stopped after 2 and resumed; the
    final checkpoint loads into the plain CharGPT."""
    import subprocess
    import sys
    from pathlib import Path

    from fxpipe.examples.gpt import CharGPT
    from fxpipe.training.checkpoint import load_into_model

    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(repo), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "4", str(repo / "examples" / "train_torchrun.py"), "--steps", "4", "--accum", "1",
           "--warmup", "1", "--eval-every", "4", "--out", str(tmp_path)]
    first = subprocess.run([*cmd, "--stop-after", "2"], capture_output=True, text=True,
                           env=env, timeout=300)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    second = subprocess.run([*cmd, "--resume"], capture_output=True, text=True, env=env,
                            timeout=300)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    assert "step    3  loss" in second.stdout and "held-out loss" in second.stdout
    assert "step    0" not in second.stdout  # resumed at step 2
    model = CharGPT(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=64)
    before = model.h[0].fc.weight.detach().clone()
    assert "h.0.fc.weight" in load_into_model(model, tmp_path / "ckpt")
    assert not torch.equal(before, model.h[0].fc.weight)


def test_spec_training_knobs_are_validated_with_file_and_line(tmp_path):
    from fxpipe.errors import SpecError
    from fxpipe.specs.loader import load_spec

    path = tmp_path / "knobs.yaml"
    path.write_text("model: {factory: 'fxpipe.examples.gpt:CharGPT'}\n"
                    "train:\n"
                    "  steps: 10\n"
                    "  lr: 1.0e-3\n"
                    "  grad_clip: -1\n"
                    "  grad_accumulation: 0\n"
                    "  lr_schedule:\n"
                    "    warmup_steps: 10\n"
                    "    decay: cosin\n")
    with pytest.raises(SpecError) as e:
        load_spec(path)
    text = str(e.value)
    assert f"{path}:5: train.grad_clip: -1 is negative" in text
    assert f"{path}:6: train.grad_accumulation: 0 is zero" in text
    assert f"{path}:9: train.lr_schedule.decay: unknown decay 'cosin'; did you mean 'cosine'" in text
    path.write_text(path.read_text().replace("grad_clip: -1", "grad_clip: 1.0")
                    .replace("grad_accumulation: 0", "grad_accumulation: 2")
                    .replace("decay: cosin", "decay: cosine\n    min_lr: 0.1"))
    with pytest.raises(SpecError) as e:
        load_spec(path)
    text = str(e.value)
    assert f"{path}:8: train.lr_schedule.warmup_steps: warmup_steps=10 is not below" in text
    assert f"{path}:10: train.lr_schedule.min_lr: min_lr=0.1 is above train.lr" in text
    t = load_spec({"model": {"factory": "fxpipe.examples.gpt:CharGPT"},
                   "train": {"steps": 10, "grad_clip": 1.0, "grad_accumulation": 2,
                             "lr_schedule": {"warmup_steps": 2, "decay": "cosine"}}}).train
    assert (t.grad_clip, t.grad_accumulation, t.lr_schedule.warmup_steps) == (1.0, 2, 2)


def test_lr_schedule_warms_up_then_decays_to_min_lr():
    from fxpipe.training.lr_schedule import lr_factor

    f = [lr_factor(s, 10, warmup_steps=2, decay="cosine", lr=1.0, min_lr=0.1) for s in range(10)]
    assert f[:3] == [0.5, 1.0, 1.0] and f[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(f[1:], f[2:]))  # non-increasing after the warm-up
    assert [lr_factor(s, 10, 0, "constant") for s in (0, 9)] == [1.0, 1.0]


def _folded_spec() -> dict:
    return {"model": {"factory": "fxpipe.examples.gpt:CharGPT"},
            "data": {"batch_size": 4, "seq_len": 16},
            "parallel": {"pipeline": 2, "data": 1, "microbatches": 2, "schedule": "1f1b"},
            "cluster": {"devices_per_node": 2, "device_tflops": 0.02},
            "train": {"loss": "cross_entropy", "timeout_s": 60}}


def _folded_model() -> nn.Module:
    torch.manual_seed(0)
    from fxpipe.examples.gpt import CharGPT

    return CharGPT(vocab_size=64, block_size=16, n_layer=8, n_head=2, n_embd=32)


def _folded_worker(rank: int, plan_dict: dict) -> float:
    from fxpipe.plans.plan import Plan

    pipe = fxpipe.compile(_folded_model(), Plan.from_dict(plan_dict))
    x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    return pipe.step(x, x)


def _top_sequential() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(16, 16) for _ in range(8)), nn.Linear(16, 4))


class _ResidualOutside(nn.Module):
    """``for b in blocks: x = x + b(x)``: the residual add is the parent's, between blocks."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16),
                                                  nn.Tanh()) for _ in range(9))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


def _residual_outside() -> nn.Module:
    torch.manual_seed(0)
    return _ResidualOutside()


_RUNS = {"top-level Sequential": _top_sequential, "residual add outside": _residual_outside}


def _run_of_blocks_worker(rank: int, name: str, plan_dict: dict) -> tuple[float, dict]:
    from fxpipe.plans.plan import Plan

    model = _RUNS[name]()
    pipe = fxpipe.compile(model, Plan.from_dict(plan_dict))
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    loss = pipe.step(x, torch.zeros(4, 4))
    # plain lists: a tensor sent through the result queue is shared memory that vanishes when
    # this process exits before the parent reads it
    return loss, {n: p.grad.tolist() for n, p in model.named_parameters() if p.grad is not None}


def _blocks_worker(rank: int, folded: dict, runs: dict) -> dict:
    """The plans made as blocks, one after the other in one 2-rank group (each its own model
    and pipeline)."""
    out = {"folded": _folded_worker(rank, folded)}
    for name, plan_dict in runs.items():
        out[name] = _run_of_blocks_worker(rank, name, plan_dict)
    return out


def _run_of_blocks_plan(name: str):
    spec = {"model": {"factory": "x:y"}, "data": {"batch_size": 4},
            "parallel": {"pipeline": 2, "data": 1, "microbatches": 2, "schedule": "1f1b"},
            "cluster": {"devices_per_node": 2},
            "train": {"loss": "mse", "timeout_s": 60}}
    return fxpipe.plan(_RUNS[name](), spec, (torch.zeros(2, 16),))


@pytest.fixture(scope="module")
def blocks():
    """One 2-rank launch for every plan made as blocks: (plans, per-rank results of
    :func:`_blocks_worker`)."""
    with torch.device("meta"):
        meta = _folded_model()
    plans = {"folded": fxpipe.plan(meta, _folded_spec(), (torch.zeros(2, 16, dtype=torch.long,
                                                                      device="meta"),))}
    plans.update({name: _run_of_blocks_plan(name) for name in _RUNS})
    got = run_ranks(_blocks_worker, 2, plans["folded"].to_dict(),
                    {name: plans[name].to_dict() for name in _RUNS}, timeout_s=180)
    return plans, got


@pytest.mark.distributed
def test_plan_of_repeated_blocks_compiles_and_trains(blocks):
    """A plan made as repeated blocks (``plan.folded``: stages list no edges until a worker
    resolves it) gets the schedule of its resolved stage edges: its sends, not a ScheduleError
    for missing SEND_F/RECV_F."""
    plans, results = blocks
    plan = plans["folded"]
    assert plan.folded, "the 8-block model should plan as repeated blocks"
    got = [r["folded"] for r in results]
    x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    ref = F.cross_entropy(_folded_model()(x).flatten(0, 1), x.flatten()).item()
    assert got[0] == got[1] == pytest.approx(ref, abs=bound(ref, 4))


@pytest.mark.distributed
@pytest.mark.parametrize("name", _RUNS)
def test_a_run_of_blocks_plans_as_blocks_and_trains(blocks, name):
    """``nn.Sequential(8 identical layers, head)`` (the run is the model itself: no parent
    module to shorten it in), and blocks whose residual add is the parent's (each block's
    glue): both plan as blocks and train as one process does."""
    plans, results = blocks
    plan = plans[name]
    assert plan.folded and set(plan.folded["blocks"]) == {0, 1}
    assert plan.folded["run"]["glue"] == (name == "residual add outside")
    got = [r[name] for r in results]
    model = _RUNS[name]()
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    ref = F.mse_loss(model(x), torch.zeros(4, 4))
    ref.backward()
    assert got[0][0] == got[1][0] == pytest.approx(ref.item(), abs=bound(ref.item(), 4))
    grads = {**got[0][1], **got[1][1]}
    assert set(grads) == {n for n, _ in model.named_parameters()}
    tol = bound(max_abs(p.grad for p in model.parameters()), 4)
    for n, p in model.named_parameters():
        assert torch.allclose(torch.tensor(grads[n]), p.grad, rtol=0, atol=tol), n
