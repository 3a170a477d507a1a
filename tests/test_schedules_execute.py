"""Every schedule on the executor, planned by the real partitioner (issue 4, items 3 and 4), and
mixed precision.

* Equivalence: interleaved 1F1B (v=2), ZB-H1 and ZB-V, with data parallel off (p=2, dp=1) and on
  (p=2, dp=2), on CharGPT (tied embedding/head) and SkipCNN (long skip): losses of 3 steps and the
  final parameters equal single-process training within 1e-5 (fp32, SGD with momentum).
* Skip connections across non-adjacent stages: ``LongSkip`` (below) makes a value in stage 0 that
  every later stage reads (``pipe_split()`` markers fix the cuts); GPipe, 1F1B, ZB-H1 (4 stages,
  p=4), interleaved and ZB-V (8 stages, p=4; and 4 stages, p=2) train exactly.
* Mixed precision: bf16 trains with finite losses close to fp32, every float value sent between
  ranks (and its gradient) travels in bf16; fp16 with dynamic loss scaling skips overflowing
  steps on all ranks alike.

Plans come from ``fxpipe.partitioner.driver.plan_with_graph`` (in the test process, once per configuration);
each rank rebuilds its stage modules with ``fxpipe.partitioner.split.materialize_stages``. One process group per
world size (2 and 4) runs every case of that size (a module-scoped fixture), to keep the file fast
on two shared cores.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpipe
from fxpipe.errors import RuntimeFailure
from fxpipe.execution.dtypes import autocast_dtype, message_dtype
from fxpipe.execution.losses import cross_entropy
from fxpipe.partitioner.driver import plan_with_graph
from fxpipe.partitioner.split import materialize_stages
from fxpipe.plans.param_blocks import block_of
from fxpipe.plans.plan import Plan
from fxpipe.runtime.executor import PipelineExecutor
from fxpipe.runtime.local_ranks import run_ranks
from fxpipe.runtime.mesh import Mesh
from fxpipe.runtime.precision import LossScaler
from fxpipe.schedule.actions import Action, Op, Schedule
from fxpipe.schedule.lowering import schedule_for_plan

try:
    from shared_models import MBS, SEQ, STEPS, VOCAB, M, exact_bounds, tiny_cnn, tiny_gpt
    from tolerances import bound, max_abs
except ImportError:  # tests/ collected as a package
    from tests.shared_models import (MBS, SEQ, STEPS, VOCAB, M, exact_bounds, tiny_cnn,
                                     tiny_gpt)
    from tests.tolerances import bound, max_abs
FP16_STEPS = 8
FP16_INIT_SCALE = 2.0 ** 21  # overflows fp16 in the backward: the first step must skip


class LongSkip(nn.Module):
    """``n_stages`` segments separated by ``fxpipe.pipe_split()``; the stem output ``a``
    ``[B, width]`` is read by EVERY later segment (``h = tanh(lin(h)) + a``), so it travels from
    stage 0 to stages 1..n-1, across ranks and within a rank depending on the placement.
    Input ``[B, in_features]`` float32, output logits ``[B, classes]``."""

    def __init__(self, n_stages: int = 4, width: int = 8, in_features: int = 6, classes: int = 5):
        super().__init__()
        self.stem = nn.Linear(in_features, width)
        self.body = nn.ModuleList(nn.Linear(width, width) for _ in range(n_stages - 1))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.tanh(self.stem(x))
        h = a
        for lin in self.body:
            fxpipe.pipe_split()
            h = torch.tanh(lin(h)) + a
        return self.head(h)


def _skip(n):
    def make():
        torch.manual_seed(0)
        return LongSkip(n)
    return make


def _tokens(g, b):
    return (torch.randint(0, VOCAB, (b, SEQ), generator=g),
            torch.randint(0, VOCAB, (b, SEQ), generator=g))


def _vectors(g, b):
    return torch.randn(b, 6, generator=g), torch.randint(0, 5, (b,), generator=g)


MODELS = {
    # name: (factory, batch maker (generator, batch) -> (x, y), loss, SGD learning rate)
    "gpt": (tiny_gpt, _tokens, cross_entropy, 0.5),
    "cnn": (tiny_cnn, lambda g, b: (torch.randn(b, 1, 8, 8, generator=g),
                                torch.randint(0, 10, (b,), generator=g)), F.cross_entropy, 0.05),
    "skip4": (_skip(4), _vectors, F.cross_entropy, 0.2),
    "skip8": (_skip(8), _vectors, F.cross_entropy, 0.2),
}


def _optimizer(name, params):
    return torch.optim.SGD(params, lr=MODELS[name][3], momentum=0.9)


def _batches(name, global_batch, steps):
    """``steps`` copies of one random global batch (the loss must fall step after step)."""
    g = torch.Generator().manual_seed(1234)
    return [MODELS[name][1](g, global_batch)] * steps


# ----------------------------------------------------------------------------- plans, references
_PLANS: dict[tuple, Plan] = {}
_REFS: dict[tuple, tuple[list[float], dict[str, torch.Tensor]]] = {}


def make_plan(name: str, p: int, dp: int, schedule: str, m: int = M, v: int = 2) -> Plan:
    """The real partitioner's plan for ``name`` on ``p`` pipeline ranks x ``dp`` replicas, ``m``
    micro-batches (interleaved: ``v`` stages per rank)."""
    key = (name, p, dp, schedule, m, v)
    if key not in _PLANS:
        model = MODELS[name][0]()
        x, _ = MODELS[name][1](torch.Generator().manual_seed(0), MBS)
        spec = {"model": {"factory": f"test_schedules_execute:{name}"},
                "data": {"batch_size": dp * m * MBS, "seq_len": SEQ},
                "parallel": {"pipeline": p, "data": dp, "microbatches": m, "schedule": schedule,
                             "virtual_stages": v if schedule == "interleaved" else 1},
                "cluster": {"nodes": 1, "devices_per_node": p * dp},
                "train": {"optimizer": "sgd"}}
        _PLANS[key] = plan_with_graph(model, spec, (x,))[0]
    return _PLANS[key]


def reference(name: str, global_batch: int, steps: int = STEPS):
    """Single-process fp32 training on the whole global batch: losses, final parameters and
    the ``(loss, parameter)`` bounds on a pipelined run's difference from them
    (:func:`shared_models.exact_bounds`)."""
    key = (name, global_batch, steps)
    if key not in _REFS:
        model = MODELS[name][0]()
        init = {k: v.detach().clone() for k, v in model.named_parameters(remove_duplicate=False)}
        opt = _optimizer(name, model.parameters())
        loss_fn, losses = MODELS[name][2], []
        for x, y in _batches(name, global_batch, steps):
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        final = {k: v.detach().clone() for k, v in model.named_parameters(remove_duplicate=False)}
        _REFS[key] = (losses, final, exact_bounds(losses, init, final, global_batch, steps))
    return _REFS[key]


def recomputing(plan: Plan, mode: str) -> Plan:
    """A copy of ``plan`` whose every stage recomputes its activations, ``full``,
    ``selective`` (at the CPU default's ridge: linear layers and attention kept) or
    ``partial`` (its first block; the whole stage where it holds none), or offloads them to
    host memory (``offload``)."""
    plan = copy.deepcopy(plan)
    for st in plan.stages:
        if mode == "offload":
            st.offload_bytes = 1  # (the runtime reads whether, the planner prices how many)
        else:
            st.recompute, st.keep_ridge = True, (CPU_RIDGE if mode == "selective" else None)
        if mode == "partial" and any(block_of(p) for p in st.params):
            st.recompute_blocks = 1  # (where the stage holds a block)
    return plan


def run_spec(name, p, dp, schedule, precision="fp32", steps=STEPS, scale=None, poison=None,
             m=M, recompute=None, v=2):
    """One case for the workers: its plan, the fp32 reference and the precision settings
    (``scale``: a LossScaler's initial scale; ``poison``: the global rank whose first stage
    parameter gets an inf gradient in the first step; ``m``: micro-batches per step;
    ``recompute``: every stage recomputes, ``full`` or ``selective``; ``v``: interleaved's
    stages per rank)."""
    plan = make_plan(name, p, dp, schedule, m, v)
    if recompute:
        plan = recomputing(plan, recompute)
    if precision == "fp16" and scale is None:
        scale = FP16_INIT_SCALE
    return dict(model=name, schedule=schedule, p=p, dp=dp, m=m, plan=plan, precision=precision,
                steps=steps, scale0=scale, recompute=recompute, v=v,
                # a poisoned run skips its first step: compare with one step less
                ref=reference(name, dp * m * MBS, steps - (poison is not None)),
                poison=poison)


# ----------------------------------------------------------------------------- worker
_SENT: list[tuple[str, torch.dtype, tuple[int, ...]]] = []


def _record_sends() -> None:
    """Wrap p2p.isend once per process: record (what, dtype, shape) of every tensor sent."""
    from fxpipe.runtime import p2p

    if getattr(p2p.isend, "_recording", False):
        return
    orig = p2p.isend

    def isend(tensor, *args, **kwargs):
        _SENT.append((args[2] if len(args) > 2 else kwargs.get("what", ""), tensor.dtype,
                      tuple(tensor.shape)))
        return orig(tensor, *args, **kwargs)

    isend._recording = True
    p2p.isend = isend


def _inf_once():
    """A gradient hook that turns the first gradient it sees into inf (then passes them on)."""
    seen = []

    def hook(g):
        seen.append(1)
        return torch.full_like(g, math.inf) if len(seen) == 1 else g
    return hook


def _worker(rank: int, runs: list[dict]):
    _record_sends()
    out, mesh, models, staged = [], None, {}, {}
    for run in runs:
        plan, name = run["plan"], run["model"]
        if mesh is None or (mesh.pipeline, mesh.dp) != (plan.pipeline, plan.dp):
            mesh = Mesh(plan.pipeline, plan.dp)  # collective: same order on every rank
        if name not in models:
            model = MODELS[name][0]()
            models[name] = (model, copy.deepcopy(model.state_dict()))
        model, init = models[name]
        key = (name, tuple(tuple(sp.nodes) for sp in plan.stages))
        if key not in staged:  # same partition, same modules (they share the model's Parameters)
            staged[key] = materialize_stages(plan, model, list(range(plan.num_stages)))
        model.load_state_dict(init)
        schedule = schedule_for_plan(plan)
        local = {s: staged[key][s] for s in schedule.stages_of_rank(mesh.pipe_rank)}
        params = list({id(q): q for mod in local.values() for q in mod.parameters()}.values())
        initial = {id(q): q.detach().clone() for q in params}
        scaler = LossScaler(init_scale=run["scale0"]) if run["scale0"] else None
        handle = None
        if run["poison"] == rank:  # an inf gradient on this rank only, first step only
            handle = params[0].register_hook(_inf_once())
        ex = PipelineExecutor(plan, schedule, local, mesh, MODELS[name][2],
                              _optimizer(name, params), timeout_s=60.0,
                              precision=run["precision"], loss_scaler=scaler)
        per = MBS * plan.microbatches
        sl = slice(mesh.dp_rank * per, (mesh.dp_rank + 1) * per)
        _SENT.clear()
        losses = [ex.step({plan.model_inputs[0]: x[sl]}, y[sl])
                  for x, y in _batches(name, per * mesh.dp, run["steps"])]
        if handle is not None:
            handle.remove()
        ref_losses, ref_params, _ = run["ref"]
        param_err = max((q.detach() - ref_params[n]).abs().max().item()
                        for mod in local.values()
                        for n, q in mod.named_parameters(remove_duplicate=False))
        raw16 = []  # boundary values a stage makes in 16 bits under autocast (before the cast)
        if run["precision"] != "fp32" and 0 in local:
            x, _ = _batches(name, per, 1)[0]
            with torch.no_grad(), torch.autocast("cpu", dtype=autocast_dtype(run["precision"])):
                raw = local[0](x[:MBS])
            raw = raw if isinstance(raw, tuple) else (raw,)
            raw16 = [n for n, t in zip(plan.stages[0].outputs, raw)
                     if t.dtype in (torch.bfloat16, torch.float16)]
        out.append(dict(
            {k: v for k, v in run.items() if k not in ("plan", "ref")},
            rank=rank, pipe_rank=mesh.pipe_rank, stages=sorted(local), losses=losses,
            loss_err=max(abs(a - b) for a, b in zip(losses, ref_losses)), param_err=param_err,
            sent=list(_SENT), raw16=raw16, skipped=list(ex.skipped_steps),
            scale=ex.loss_scaler.scale if ex.loss_scaler else None,
            params_changed=any(not torch.equal(q.detach(), initial[id(q)]) for q in params)))
    return out


# ----------------------------------------------------------------------------- fixtures
#: the controllable-memory V schedules and DualPipeV (issue 28)
V_NEW = ("v-half", "v-min", "dualpipev")
#: the schedules recomputing stages are run under (issue 36): one whole backward, the
#: interleaved one and split backwards (B then W)
RECOMPUTE_SCHEDULES = ("interleaved", "zb-h1", "zb-v")
#: the CPU default's ridge point (0.05 TFLOP/s over 20 GB/s): FLOPs per byte
CPU_RIDGE = 0.05e12 / 20e9


def _m_for(schedule: str, p: int) -> int:
    """Micro-batches for a case: ``M``, or DualPipeV's least multiple of 4 >= 2p - 1."""
    return max(M, -(-(2 * p - 1) // 4) * 4) if schedule == "dualpipev" else M


def _world2_runs():
    runs = [run_spec(n, 2, 1, s) for n in ("gpt", "cnn") for s in ("interleaved", "zb-h1", "zb-v")]
    runs += [run_spec("skip4", 2, 1, s) for s in ("interleaved", "zb-v")]
    runs += [run_spec("gpt", 2, 1, s) for s in V_NEW] + [run_spec("skip4", 2, 1, "dualpipev")]
    runs += [run_spec("gpt", 2, 1, s, recompute=r) for s in RECOMPUTE_SCHEDULES
             for r in ("selective", "full", "offload", "partial")]
    runs += [run_spec("gpt", 2, 1, "interleaved", v=3), run_spec("skip8", 2, 1, "interleaved", v=4)]
    return runs


def _world4_runs():
    runs = [run_spec(n, 2, 2, s) for n in ("gpt", "cnn") for s in ("interleaved", "zb-h1", "zb-v")]
    runs += [run_spec(n, 2, 2, "zb-v", precision="bf16") for n in ("gpt", "cnn")]
    runs += [run_spec("gpt", 2, 2, "zb-h1", precision="fp16", steps=FP16_STEPS)]
    runs += [run_spec("cnn", 2, 2, "zb-h1", scale=1.0, poison=3)]
    runs += [run_spec("skip4", 4, 1, s) for s in ("gpipe", "1f1b", "zb-h1")]
    runs += [run_spec("skip8", 4, 1, s) for s in ("interleaved", "zb-v")]
    runs += [run_spec("cnn", 2, 2, s) for s in V_NEW]
    runs += [run_spec("skip8", 4, 1, s, m=_m_for(s, 4)) for s in V_NEW]
    runs += [run_spec(n, 2, 2, "zb-v", recompute="selective") for n in ("gpt", "cnn")]
    runs += [run_spec("gpt", 2, 2, "zb-v", recompute=r) for r in ("offload", "partial")]
    return runs


@pytest.fixture(scope="module")
def world2():
    runs = _world2_runs()
    return runs, run_ranks(_worker, 2, runs, timeout_s=200, dist_timeout_s=60)


@pytest.fixture(scope="module")
def world4():
    runs = _world4_runs()
    return runs, run_ranks(_worker, 4, runs, timeout_s=330, dist_timeout_s=60)


def _rows(results, **match):
    match.setdefault("recompute", None)
    match.setdefault("v", 2)
    rows = [r for per_rank in results[1] for r in per_rank
            if all(r[k] == v for k, v in match.items())]
    assert rows, f"no results for {match}"
    return rows


def _assert_exact(rows):
    for r in rows:
        tag = f"{r['model']} {r['schedule']} p={r['p']} dp={r['dp']} rank {r['rank']}"
        loss_tol, param_tol = reference(r["model"], r["dp"] * r["m"] * MBS,
                                        r["steps"] - (r["poison"] is not None))[2]
        assert r["loss_err"] < loss_tol, (tag, r["loss_err"], loss_tol)
        assert r["param_err"] < param_tol, (tag, r["param_err"], param_tol)
        assert r["losses"][-1] < r["losses"][0], (tag, r["losses"])  # it trained
    assert len({tuple(r["losses"]) for r in rows}) == 1, "ranks disagree on the loss"


# ----------------------------------------------------------------------------- equivalence
@pytest.mark.distributed
@pytest.mark.parametrize("schedule", ["interleaved", "zb-h1", "zb-v"])
@pytest.mark.parametrize("model", ["gpt", "cnn"])
def test_equivalence_without_data_parallel(world2, model, schedule):
    """p=2, dp=1: interleaved (4 stages, v=2), ZB-H1 (2 stages), ZB-V (4 stages, V placement)
    equal single-process training within 1e-5."""
    rows = _rows(world2, model=model, schedule=schedule, precision="fp32")
    assert len(rows) == 2
    plan = make_plan(model, 2, 1, schedule)
    assert plan.num_stages == (2 if schedule == "zb-h1" else 4)
    if schedule == "zb-v":  # V placement: rank 0 holds the first and the last stage
        assert next(r for r in rows if r["rank"] == 0)["stages"] == [0, 3]
    if model == "gpt":
        assert plan.shared_params, "the tied embedding/head must be a shared parameter"
    _assert_exact(rows)


@pytest.mark.distributed
@pytest.mark.parametrize("schedule", ["interleaved", "zb-h1", "zb-v"])
@pytest.mark.parametrize("model", ["gpt", "cnn"])
def test_equivalence_with_data_parallel(world4, model, schedule):
    """p=2, dp=2: the same schedules with gradients all-reduced per stage replica group (and the
    tied weight over its embedding group) are exact, zero-bubble included."""
    rows = _rows(world4, model=model, schedule=schedule, precision="fp32", p=2, dp=2, poison=None)
    assert len(rows) == 4
    _assert_exact(rows)
    if model == "cnn" and schedule != "zb-h1":  # 4 stages: the stem output skips to stage 3
        assert (0, 3) in make_plan(model, 2, 2, schedule).stage_edges()


# ----------------------------------------------------------------------------- long skips
@pytest.mark.distributed
@pytest.mark.parametrize("schedule,p,name", [
    ("gpipe", 4, "skip4"), ("1f1b", 4, "skip4"), ("zb-h1", 4, "skip4"),
    ("interleaved", 4, "skip8"), ("zb-v", 4, "skip8"),
    ("interleaved", 2, "skip4"), ("zb-v", 2, "skip4")])
def test_skip_across_non_adjacent_stages(request, schedule, p, name):
    """A value made in stage 0 and read by stage 2 (and every later stage) trains exactly in
    every schedule, whether the stages sit on different ranks or on the same one."""
    plan = make_plan(name, p, 1, schedule)
    stem = plan.stages[0].outputs[0]
    assert plan.values[stem].consumers == list(range(1, plan.num_stages))
    assert (0, 2) in plan.stage_edges()
    sched = schedule_for_plan(plan)
    s2r = sched.stage_to_rank
    # the 0 -> 2 value crosses ranks (except interleaved p=2, where it is handed over in memory
    # and 0 -> 3 crosses instead)
    assert (s2r[0] != s2r[2]) == (not (schedule == "interleaved" and p == 2))
    assert any(a.op is Op.SEND_F and a.stage == 0 and a.peer >= 2 for a in sched.actions[s2r[0]])
    rows = _rows(request.getfixturevalue(f"world{p}"), model=name, schedule=schedule, p=p)
    assert len(rows) == p
    _assert_exact(rows)


# ----------------------------------------------------------------------------- precision
@pytest.mark.distributed
@pytest.mark.parametrize("model", ["gpt", "cnn"])
def test_bf16_trains_and_sends_16bit_messages(world4, model):
    """bf16 autocast with ZB-V, p=2, dp=2: finite losses close to fp32's, training progresses,
    and every tensor sent between ranks (activations and gradients) has the plan's shape and
    travels in bf16 when the plan says fp32 (``message_dtype``), in its plan dtype otherwise."""
    rows = _rows(world4, model=model, precision="bf16")
    assert len(rows) == 4
    plan = make_plan(model, 2, 2, "zb-v")
    for r in rows:
        assert all(math.isfinite(x) for x in r["losses"]), r["losses"]
        assert r["losses"][-1] < r["losses"][0], r["losses"]
        assert r["loss_err"] < 0.05, (r["losses"], reference(model, 2 * M * MBS)[0])
        assert r["param_err"] > 0, "bf16 compute should not be bit-identical to fp32"
        assert r["sent"], "ranks exchanged nothing"
        for what, dtype, shape in r["sent"]:
            value = re.search(r"'([^']+)'", what).group(1)
            info = plan.values[value]
            want = message_dtype(getattr(torch, info.dtype), "bf16")
            assert dtype == want and list(shape) == info.shape, (what, dtype)
    if model == "cnn":  # conv stages make 16-bit values under autocast: the cast is what aligns
        assert any(r["raw16"] for r in rows)
    assert len({tuple(r["losses"]) for r in rows}) == 1


@pytest.mark.distributed
def test_fp16_loss_scaling_skips_overflow_steps_on_every_rank(world4):
    """fp16 with an initial loss scale that overflows: the same steps are skipped on all 4 ranks
    (parameters untouched, so the next loss on the same batch repeats exactly), the scale halves
    per skip, and once it fits training proceeds with finite losses."""
    rows = _rows(world4, model="gpt", precision="fp16")
    assert len(rows) == 4
    skipped = {tuple(r["skipped"]) for r in rows}
    assert len(skipped) == 1, skipped
    (skips,) = skipped
    assert skips and skips[0] == 0, "the 2**21 scale must overflow fp16 on the first step"
    assert len(skips) < FP16_STEPS - 2, "the scale never came down far enough to train"
    for r in rows:
        assert r["scale"] == FP16_INIT_SCALE * 0.5 ** len(skips)
        losses = r["losses"]
        assert all(math.isfinite(x) for x in losses)
        for k in range(FP16_STEPS - 1):  # same batch every step: a skipped step changes nothing
            assert (losses[k + 1] == losses[k]) == (k in skips), (k, losses, skips)
        assert losses[-1] < losses[0]
        assert r["params_changed"]
        assert abs(losses[0] - reference("gpt", 2 * M * MBS, FP16_STEPS)[0][0]) < 0.05
    assert len({tuple(r["losses"]) for r in rows}) == 1


@pytest.mark.distributed
def test_inf_gradient_on_one_rank_skips_the_step_everywhere(world4):
    """An inf gradient on global rank 3 only (pipeline rank 1 of replica 1; the data-parallel
    all-reduce alone would not reach pipeline rank 0) skips step 0 on all four ranks; with a loss
    scale of 1 the run then equals fp32 single-process training that starts one step later."""
    rows = _rows(world4, model="cnn", poison=3)
    assert len(rows) == 4
    ref2_losses, _, (loss_tol, param_tol) = reference("cnn", 2 * M * MBS, STEPS - 1)
    for r in rows:
        assert r["skipped"] == [0], r["skipped"]
        assert r["losses"][0] == r["losses"][1]  # nothing moved in step 0
        assert max(abs(a - b) for a, b in zip(r["losses"][1:], ref2_losses)) < loss_tol
        assert r["param_err"] < param_tol, (r["param_err"], param_tol)
        assert r["scale"] == 0.5


# ----------------------------------------------------------------------------- in-process
def test_loss_scaler_semantics():
    s = LossScaler(init_scale=8.0, growth_interval=2)
    g = torch.tensor([16.0, -4.0])
    s.unscale_([g, None])
    assert g.tolist() == [2.0, -0.5]
    s.update(found_inf=True)
    assert (s.scale, s.skipped, s.clean_steps) == (4.0, 1, 0)
    s.update(False)
    assert s.scale == 4.0
    s.update(False)
    assert (s.scale, s.clean_steps) == (8.0, 0)
    clone = LossScaler()
    clone.load_state_dict(s.state_dict())
    assert clone.state_dict() == s.state_dict()
    with pytest.raises(RuntimeFailure, match="backoff_factor"):
        LossScaler(backoff_factor=1.5)


class _Count(torch.autograd.Function):
    """Identity whose backward counts its calls (to see whether W redoes B's work)."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        _Count.calls += 1
        return g


class _Chain(nn.Module):
    """A typical stage: linear, tanh, (counting identity), linear; plus a weight-only second
    output and a weight-only term that reuses ``lin1.weight`` (tied-weight-like reuse)."""

    def __init__(self):
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(5, 7), nn.Linear(7, 3)
        self.ln = nn.LayerNorm(7)

    def forward(self, x):
        h = _Count.apply(self.ln(torch.tanh(self.lin1(x))))
        out = self.lin2(h) + self.lin1.weight.sum()
        return out, self.lin2.weight * 2.0


class _Tricky(_Chain):
    """Adds a parameter ``s`` used on the input path AND off it (``h * s`` and ``s.sum()``): its
    gradient entry has two incoming edges (the exact but slower path)."""

    def __init__(self):
        super().__init__()
        self.s = nn.Parameter(torch.randn(7))

    def forward(self, x):
        h = _Count.apply(self.ln(torch.tanh(self.lin1(x))) * self.s)
        out = self.lin2(h) + self.lin1.weight.sum() * self.s.sum()
        return out, self.lin2.weight * 2.0


@pytest.mark.parametrize("model", ["chain", "tricky"])
@pytest.mark.parametrize("with_leaf", [True, False])
def test_backward_split_equals_full_backward_without_recompute(model, with_leaf):
    """B then W gives the full backward's input and parameter gradients; B leaves ``.grad``
    alone; on a typical stage W does not run the activation-gradient chain again (the counting
    identity's backward runs once per micro-batch, as in the full backward)."""
    from fxpipe.runtime.backward_split import backward_input, backward_weight

    torch.manual_seed(0)
    mod = _Chain() if model == "chain" else _Tricky()
    params = list(mod.parameters())
    x0 = torch.randn(4, 5)
    g_out, g_w = torch.randn(4, 3), torch.randn(3, 7)

    def run(split):
        for p in params:
            p.grad = None
        x = x0.clone().requires_grad_(with_leaf)
        out, w2 = mod(x)
        _Count.calls = 0
        if split:
            gx, work = backward_input([out, w2], [g_out, g_w], [x] if with_leaf else [], params)
            assert all(p.grad is None for p in params), "B must not touch weight gradients"
            backward_weight(work)
            gx = gx[0] if with_leaf else None
        else:
            torch.autograd.backward([out, w2], [g_out, g_w])
            gx = x.grad
        return gx, [p.grad.clone() for p in params], _Count.calls

    gx_full, gp_full, calls_full = run(False)
    gx_split, gp_split, calls_split = run(True)
    assert calls_full == 1
    if model == "chain":
        assert calls_split == 1, "W re-ran the activation-gradient chain"
    # the same gradient terms, added in another order (a parameter used on both sides of the
    # split gets 2 contributions): float32 rounding of 2 terms (tests/tolerances.py)
    if with_leaf:
        assert torch.allclose(gx_split, gx_full, rtol=0, atol=bound(max_abs([gx_full]), 2))
    for a, b in zip(gp_split, gp_full):
        assert torch.allclose(a, b, rtol=0, atol=bound(max_abs([b]), 2)), (a - b).abs().max()


def _local_schedule(num_stages: int, m: int) -> Schedule:
    acts = [Action(Op.F, s, i) for i in range(m) for s in range(num_stages)]
    acts += [Action(Op.B, s, i) for i in range(m) for s in reversed(range(num_stages))]
    acts.append(Action(Op.STEP, 0))
    return Schedule("local", 1, num_stages, m, [0] * num_stages, [acts])


def test_precision_in_process_and_bad_precision():
    """All stages on one rank (values handed over in memory): bf16 trains close to fp32; fp16 with
    default scaling trains; an unknown precision is a clear error naming the choices."""
    plan = make_plan("cnn", 2, 1, "zb-v")  # 4 stages, handed over on one rank here
    model = MODELS["cnn"][0]()
    mods = materialize_stages(plan, model, list(range(plan.num_stages)))
    local_plan = dataclasses.replace(plan, pipeline=1)
    init = copy.deepcopy(model.state_dict())
    got = {}
    for precision in ("fp32", "bf16", "fp16"):
        model.load_state_dict(init)
        ex = PipelineExecutor(local_plan, _local_schedule(plan.num_stages, M), mods, Mesh(1, 1),
                              F.cross_entropy, _optimizer("cnn", model.parameters()),
                              precision=precision)
        got[precision] = [ex.step({"x": x}, y) for x, y in _batches("cnn", M * MBS, STEPS)]
    ref, _, (loss_tol, _) = reference("cnn", M * MBS)
    assert max(abs(a - b) for a, b in zip(got["fp32"], ref)) < loss_tol
    for precision in ("bf16", "fp16"):
        assert got[precision][-1] < got[precision][0], got
        assert max(abs(a - b) for a, b in zip(got[precision], ref)) < 0.05, (precision, got, ref)
    with pytest.raises(RuntimeFailure, match="bf16"):
        PipelineExecutor(local_plan, _local_schedule(plan.num_stages, M), mods, Mesh(1, 1),
                         F.cross_entropy, None, precision="fp4")
    with pytest.raises(RuntimeFailure, match="fp8 needs fp8_config"):  # (torchao's config)
        PipelineExecutor(local_plan, _local_schedule(plan.num_stages, M), mods, Mesh(1, 1),
                         F.cross_entropy, None, precision="fp8")


if __name__ == "__main__":  # print the measured figures
    for fx, runs_of, world in (("world2", _world2_runs, 2), ("world4", _world4_runs, 4)):
        for per_rank in run_ranks(_worker, world, runs_of(), timeout_s=240, dist_timeout_s=60):
            for r in per_rank:
                print(f"{r['model']:5s} {r['schedule']:11s} p={r['p']} dp={r['dp']} "
                      f"{r['precision']} rank {r['rank']} stages {r['stages']} loss_err "
                      f"{r['loss_err']:.2e} param_err {r['param_err']:.2e} losses "
                      f"{[round(x, 5) for x in r['losses']]} skipped {r['skipped']} "
                      f"sent {sorted({str(d) for _, d, _ in r['sent']})} raw16 {r['raw16']}")


# ----------------------------------------------------------------------------- issue 36
@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["selective", "full", "offload", "partial"])
@pytest.mark.parametrize("schedule", RECOMPUTE_SCHEDULES)
def test_recomputing_stages_are_exact(world2, world4, schedule, mode):
    """Every stage recomputing its activations, fully, selectively (the linear layers'
    and attention's outputs kept) or partially (its first block: the tail's backward, then
    the head's forward again and its backward; split into B and W under the zero-bubble
    schedules), or offloading them to host memory, trains like one process: interleaved (one
    whole backward per stage), ZB-H1 and ZB-V (B then W: the forward runs again once, before
    B; offloaded tensors come back for B and for W) at p=2; selective under ZB-V with data
    parallel 2 on CharGPT and SkipCNN (a skip from stage 0 to stage 3), offload and partial
    on CharGPT."""
    rows = _rows(world2, model="gpt", schedule=schedule, recompute=mode)
    assert len(rows) == 2
    _assert_exact(rows)
    if mode == "partial":  # stages that hold a block recompute it only
        assert any(st.recompute_blocks for st in recomputing(
            make_plan("gpt", 2, 1, schedule, M, 2), mode).stages)
    if schedule == "zb-v" and mode != "full":
        for model in ("gpt", "cnn") if mode == "selective" else ("gpt",):  # (partial too)
            rows = _rows(world4, model=model, schedule=schedule, recompute=mode, p=2, dp=2)
            assert len(rows) == 4
            _assert_exact(rows)


@pytest.mark.distributed
def test_deeper_interleaving_is_exact(world2):
    """Interleaved 1F1B with 3 and 4 stages per rank (the depths ``virtual_stages: auto``
    weighs): CharGPT over 6 stages and LongSkip over 8 (a value of stage 0 read by every later
    stage) on 2 ranks train like one process."""
    for model, v in (("gpt", 3), ("skip8", 4)):
        plan = make_plan(model, 2, 1, "interleaved", M, v)
        assert plan.num_stages == 2 * v and plan.virtual_stages == v
        rows = _rows(world2, model=model, schedule="interleaved", v=v)
        assert len(rows) == 2 and next(r for r in rows if r["rank"] == 0)["stages"] == \
            list(range(0, 2 * v, 2))
        _assert_exact(rows)


# ----------------------------------------------------------------------------- issue 28
@pytest.mark.distributed
@pytest.mark.parametrize("schedule", V_NEW)
def test_controllable_memory_and_dualpipev_are_exact(world2, world4, schedule):
    """V-Half, V-Min and DualPipeV equal single-process fp32 training: p=2 dp=1 (CharGPT, tied
    weight; LongSkip for DualPipeV), p=2 dp=2 (SkipCNN: its stem output skips from stage 0 to
    stage 3, gradients all-reduced per replica group) and p=4 dp=1 (LongSkip over 8 stages:
    a value of stage 0 read by every later stage, on this rank and others)."""
    rows = _rows(world2, model="gpt", schedule=schedule)
    assert len(rows) == 2 and next(r for r in rows if r["rank"] == 0)["stages"] == [0, 3]
    _assert_exact(rows)
    if schedule == "dualpipev":
        _assert_exact(_rows(world2, model="skip4", schedule=schedule))
    rows = _rows(world4, model="cnn", schedule=schedule, p=2, dp=2)
    assert len(rows) == 4 and (0, 3) in make_plan("cnn", 2, 2, schedule).stage_edges()
    _assert_exact(rows)
    m = _m_for(schedule, 4)
    plan = make_plan("skip8", 4, 1, schedule, m)
    assert (0, 2) in plan.stage_edges() and plan.microbatches == m
    rows = _rows(world4, model="skip8", schedule=schedule, p=4)
    assert len(rows) == 4 and next(r for r in rows if r["rank"] == 1)["stages"] == [1, 6]
    _assert_exact(rows)
