"""Sharded data parallelism (issue 25): each stage's replicas split the optimizer state, the
gradients and the parameters (``parallel.data_sharding``), exactly.

* Exact (pipeline 2 x data 2, 3 steps, the bundled GPT with its embedding tied across the two
  stages, clipping on): at every level, with AdamW and with SGD with momentum, losses and final
  parameters equal the unsharded pipeline's within the bound of what differs between them (the
  clipping norm summed over slices instead of whole gradients: float32 rounding of that one
  sum) and SGD's equal single-process training within tests/tolerances.py's bounds; composed
  with tensor parallelism, ZB-V, gradient accumulation, bf16, fp16 loss scaling and fp16
  gradient compression.
* Memory: per rank, the storages of parameters, gradients and optimizer state after a step, and
  at the step's fullest (its gradients computed, before their reduction), equal
  :func:`fxpipe.plans.state_bytes.held_state_bytes` of the plan; the reduce-scatter and
  all-gather bytes equal :func:`~fxpipe.plans.state_bytes.sharded_bytes_sent`.
* Checkpoints: saved sharded (torch.distributed.checkpoint), resumed under another data-parallel
  degree or level with the same next loss; the plain model loads it.
* Per-block gathering (``param_gather: block``, issue 37): under 1F1B, interleaved, ZB-V and
  tensor 2 x data 2, SGD trains like one process; the gathered-parameter and reduce-buffer
  bytes each rank held at a step's fullest equal :mod:`fxpipe.runtime.block_gather`'s formula
  (a pair of adjacent groups, not the stage).
"""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fxpipe
from fxpipe.errors import SpecError, UsageError
from fxpipe.plans.plan import Plan
from fxpipe.plans.state_bytes import held_state_bytes, sharded_bytes_sent
from fxpipe.runtime.data_sharding import state_storage_bytes
from fxpipe.runtime.local_ranks import run_ranks
from fxpipe.training.checkpoint import load_checkpoint, load_into_model, save_checkpoint

try:
    from shared_models import exact_bounds, tiny_gpt
    from tolerances import FP32_EPS, bound
except ImportError:  # tests/ collected as a package
    from tests.shared_models import exact_bounds, tiny_gpt
    from tests.tolerances import FP32_EPS, bound

STEPS, CLIP, B = 3, 0.5, 8
LR = {"adamw": 1e-2, "sgd": 0.2}


def _batch(step: int):
    g = torch.Generator().manual_seed(900 + step)
    x = torch.randint(0, 64, (B, 16), generator=g)
    y = torch.randint(0, 64, (B, 16), generator=g).masked_fill(
        torch.rand(B, 16, generator=g) < 0.2, -100)
    return x, y


def _optimizer(kind: str, params):
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=LR["adamw"], weight_decay=0.1)
    return torch.optim.SGD(params, lr=LR["sgd"], momentum=0.9)


FIELDS = {"adamw": 2, "sgd": 1}  # state tensors per parameter: moments / momentum buffer

_PLANS: dict[tuple, dict] = {}


def _plan(p: int, d: int, level: str, t: int = 1, schedule: str = "1f1b",
          precision: str = "fp32", compression: str = "none", optimizer: str = "adamw",
          batch: int = B, virtual: int = 1) -> dict:
    key = (p, d, level, t, schedule, precision, compression, optimizer, batch, virtual)
    if key not in _PLANS:
        spec = {"model": {"factory": "shared_models:tiny_gpt"},
                "data": {"batch_size": batch, "seq_len": 16},
                "parallel": {"pipeline": p, "data": d, "tensor": t, "microbatches": 2,
                             "schedule": schedule, "data_sharding": level,
                             "virtual_stages": virtual},
                "cluster": {"nodes": 1, "devices_per_node": p * d * t, "memory_gb": 4,
                            "device_tflops": 0.02, "links": {"intra_node_GBps": 5}},
                "train": {"optimizer": optimizer, "loss": "cross_entropy",
                          "precision": precision, "grad_compression": compression,
                          "timeout_s": 120}}
        with torch.device("meta"):
            model = tiny_gpt()
        _PLANS[key] = fxpipe.plan(model, spec, (torch.zeros(1, 16, dtype=torch.long,
                                                            device="meta"),)).to_dict()
    return copy.deepcopy(_PLANS[key])


# ----------------------------------------------------------------------------- references
def _reference(kind: str, accumulation: int = 1):
    """Single-process training of the same steps (the float32 reference; ``accumulation``:
    each global batch in that many parts, each part's mean loss weighing ``1/accumulation``)."""
    model = tiny_gpt()
    init = {k: v.detach().clone() for k, v in model.named_parameters(remove_duplicate=False)}
    opt = _optimizer(kind, model.parameters())
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        k = B // accumulation
        loss = 0.0
        for i in range(accumulation):
            part = F.cross_entropy(model(x[i * k:(i + 1) * k]).reshape(-1, 64),
                                   y[i * k:(i + 1) * k].reshape(-1)) / accumulation
            part.backward()
            loss += part
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    final = {k: v.detach() for k, v in model.named_parameters(remove_duplicate=False)}
    return losses, final, exact_bounds(losses, init, final, B, STEPS)


# ----------------------------------------------------------------------------- on the ranks
#: this rank's compiled pipelines by (plan, grad_accumulation): the runs of one plan (AdamW,
#: then SGD; the checkpoint's) share one trace and compile; each run starts from the initial
#: weights, cleared gradients and a new optimizer, so nothing of an earlier run carries over
#: (the SGD runs, checked against single-process training, would show it)
_PIPES: dict[tuple[str, int], object] = {}


def _compiled(plan_dict: dict, accumulation: int = 1):
    key = (json.dumps(plan_dict, sort_keys=True, default=str), accumulation)
    pipe = _PIPES.get(key)
    if pipe is None:
        pipe = _PIPES[key] = fxpipe.compile(tiny_gpt(), Plan.from_dict(plan_dict),
                                            grad_accumulation=accumulation)
    else:  # a fresh start: the initial weights (and the master slices), no gradients
        pipe.load_state_dict(tiny_gpt().state_dict())
        pipe.zero_grad()
    return pipe


def _train(plan_dict: dict, kind: str, accumulation: int = 1) -> dict:
    pipe = _compiled(plan_dict, accumulation)
    opt = pipe.shard_optimizer(_optimizer(kind, pipe.parameters()))
    sharding = pipe.executor.sharding
    losses, held, peak, sent = [], {}, {}, {}
    for step in range(STEPS):
        x, y = _batch(step)
        if accumulation == 1:
            losses.append(pipe.step(x, y))
        else:  # the same global batch in ``accumulation`` calls
            k = B // accumulation
            losses.append(sum(pipe.step(x[i * k:(i + 1) * k], y[i * k:(i + 1) * k])
                              for i in range(accumulation)) / accumulation)
        pipe.clip_grad_norm_(CLIP)
        opt.step()
        if sharding is not None:
            held = sharding.measure()
            peak = dict(sharding.at_reduce)
            # an optimizer step's calls: each reduce-scatters, the first all-gathers the
            # previous update (counted when its step finishes)
            sent = {"bytes": sum(b.gradients for b in
                                 pipe.executor.step_bytes_sent[-accumulation:])}
        else:
            held = state_storage_bytes(pipe.parameters(), opt)
        opt.zero_grad()
    gathered = (dict(sharding.block_held.peak) if sharding is not None
                and sharding.block_held is not None else None)  # the last step's
    whole = pipe.state_dict()
    return {"losses": losses, "gathered": gathered, "params": {k: v.numpy().copy() for k, v in whole.items()},
            "held": held, "peak": peak, "sent": sent, "stages": list(pipe.executor.local_stages),
            "replica": pipe.replica, "skipped": pipe.skipped_steps}


def _worker(rank: int, runs: list, ckpt: str, resume_plans: dict) -> list:
    """The runs, then the checkpoint's resumes (``[-2]``), then the refusal of an unwrapped
    optimizer (``[-1]``)."""
    out = [_train(*run) for run in runs]
    out.append(_resume(ckpt, resume_plans))
    out.append(_unwrapped(resume_plans["optimizer"]))
    return out


def _resume(ckpt: str, plans: dict) -> dict:
    """Save at pipeline 2 x data 2 sharding ``optimizer`` (AdamW), then continue under data 2
    unsharded, under data 2 ``full``, and under pipeline 1 x data 4 ``gradients`` (``plans``:
    made by the parent, not planned again on every rank)."""
    def build(plan, level_ckpt=None):
        pipe = _compiled(plan)
        opt = pipe.shard_optimizer(_optimizer("adamw", pipe.parameters()))
        if level_ckpt is not None:
            load_checkpoint(pipe.module, level_ckpt, optimizer=opt)
        return pipe, opt

    def step(pipe, opt, i):
        loss = pipe.step(*_batch(i))
        pipe.clip_grad_norm_(CLIP)
        opt.step()
        opt.zero_grad()
        return loss

    a, opt = build(plans["optimizer"])
    for i in range(2):
        step(a, opt, i)
    save_checkpoint(a.module, ckpt, 2, optimizer=opt)
    out = {"continued": [step(a, opt, 2), step(a, opt, 3)]}
    for name in ("none", "full", "dp4"):
        b, opt_b = build(plans[name], f"{ckpt}/step_000002")
        out[name] = [step(b, opt_b, 2), step(b, opt_b, 3)]
    return out


def _resume_plans() -> dict:
    return {"optimizer": _plan(2, 2, "optimizer"), "none": _plan(2, 2, "none"),
            "full": _plan(2, 2, "full"), "dp4": _plan(1, 4, "gradients")}


LEVELS = ("none", "optimizer", "gradients", "full")
#: pipeline 2 x data 2, every level, AdamW and SGD with momentum
EXACT = [((2, 2, level), kind) for kind in ("adamw", "sgd") for level in LEVELS]
#: composed with tensor parallelism, ZB-V, gradient accumulation, bf16, fp16 loss scaling and
#: fp16 gradient compression
COMPOSED = [((1, 2, "optimizer", 2), "adamw", 1),
            ((2, 2, "full", 1, "zb-v"), "sgd", 1),
            ((2, 2, "gradients", 1, "1f1b", "fp32", "none", "adamw", B // 2), "sgd", 2),
            ((2, 2, "optimizer", 1, "1f1b", "bf16"), "adamw", 1),
            ((2, 2, "full", 1, "1f1b", "fp16"), "adamw", 1),
            ((2, 2, "optimizer", 1, "1f1b", "fp32", "fp16"), "sgd", 1)]


#: ``full`` gathered per block (``param_gather: block``, set on the plan as the planner would):
#: 1F1B, interleaved, ZB-V, and tensor 2 x data 2
BLOCK = [((2, 2, "full", 1, "1f1b"), {}), ((2, 2, "full", 1, "interleaved"), {"virtual": 2}),
         ((2, 2, "full", 1, "zb-v"), {}), ((1, 2, "full", 2), {})]


def _per_block(plan: dict) -> dict:
    for st in plan["stages"]:
        st["param_gather"] = "block"
    return plan


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("zero-ckpt") / "ckpt")
    runs = [(_plan(*args), kind) for args, kind in EXACT]
    runs += [(_plan(*args), kind, acc) for args, kind, acc in COMPOSED]
    runs += [(_per_block(_plan(*args, **kw)), "sgd") for args, kw in BLOCK]
    return ckpt, run_ranks(_worker, 4, runs, ckpt, _resume_plans(), timeout_s=400,
                           dist_timeout_s=120)


def _params_of(rows) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for r in rows:
        out.update(r["params"])
    return out


@pytest.mark.distributed
def test_every_level_trains_like_the_unsharded_pipeline(world4):
    """Between a sharded and the unsharded run of one plan only the clipping norm's sum differs
    (slices, then replicas, instead of whole gradients): a relative difference of at most
    ``eps x terms`` in the clip coefficient, ``terms`` the partial sums combined (one per
    parameter and slice, under 100 here); it scales every update alike, so the parameters
    differ by at most that relative share of how far they moved, per step."""
    _, results = world4
    for i, (args, kind) in enumerate(EXACT):
        base = EXACT.index(((2, 2, "none"), kind))
        if i == base:
            continue
        terms = 100
        for r, u in zip(results, results):
            got, ref = r[i]["losses"], u[base]["losses"]
            assert max(abs(a - b) for a, b in zip(got, ref)) <= bound(max(ref), terms, STEPS)
        got, ref = _params_of(r[i] for r in results), _params_of(r[base] for r in results)
        assert got.keys() == ref.keys()
        worst = max(float(np.abs(got[k] - ref[k]).max()) for k in ref)
        # the bar, 1e-5, is looser than the derived one (lr x steps x eps x terms)
        assert worst <= max(LR[kind] * STEPS * FP32_EPS * terms, bound(1.0, terms, STEPS)), (
            args, kind, worst)
        assert worst < 1e-5


@pytest.mark.distributed
def test_sgd_levels_train_like_one_process(world4):
    _, results = world4
    ref_losses, ref_params, (loss_tol, param_tol) = _reference("sgd")
    for i, (args, kind) in enumerate(EXACT):
        if kind != "sgd":
            continue
        for r in results:
            worst = max(abs(a - b) for a, b in zip(r[i]["losses"], ref_losses))
            assert worst < loss_tol, (args, r[i]["losses"], ref_losses)
        params = _params_of(r[i] for r in results)
        worst = max(float(np.abs(v - ref_params[n].numpy()).max()) for n, v in params.items()
                    if n in ref_params)
        assert worst < param_tol, (args, worst, param_tol)


@pytest.mark.distributed
def test_composed_runs_train_like_their_unsharded_pipeline(world4):
    """Tensor 2 x data 2, ZB-V, accumulation over 2 calls and fp16 compression against
    single-process SGD or the plain pipeline; bf16 and fp16 (loss scaling) close to fp32."""
    _, results = world4
    adamw_losses = _reference("adamw")[0]
    first = len(EXACT)
    for j, (args, kind, acc) in enumerate(COMPOSED):
        i = first + j
        precision = args[5] if len(args) > 5 else "fp32"
        compression = args[6] if len(args) > 6 else "none"
        sgd_losses, sgd_params, (loss_tol, param_tol) = _reference("sgd", acc)
        for r in results:
            losses = r[i]["losses"]
            ref = sgd_losses if kind == "sgd" else adamw_losses
            if precision != "fp32" or compression != "none":
                # 16-bit compute or wire: 2^-8 (bf16) / 2^-11 (fp16) relative per value
                assert max(abs(a - b) for a, b in zip(losses, ref)) < 0.05, (args, losses)
            elif kind == "sgd":
                assert max(abs(a - b) for a, b in zip(losses, ref)) < loss_tol, (args, losses)
            else:  # AdamW in float32: the first step's loss is the forward only
                assert abs(losses[0] - ref[0]) < loss_tol, (args, losses)
        if kind == "sgd" and precision == "fp32" and compression == "none":
            params = _params_of(r[i] for r in results)
            worst = max(float(np.abs(v - sgd_params[n].numpy()).max())
                        for n, v in params.items() if n in sgd_params)
            assert worst < param_tol, (args, worst)


@pytest.mark.distributed
def test_per_block_gathering_trains_like_one_process(world4):
    """Parameters gathered per block in every forward and backward, gradients reduce-scattered
    per micro-batch: SGD's losses and final parameters within the single-process bounds."""
    _, results = world4
    ref_losses, ref_params, (loss_tol, param_tol) = _reference("sgd")
    first = len(EXACT) + len(COMPOSED)
    for j, (args, kw) in enumerate(BLOCK):
        for r in results:
            worst = max(abs(a - b) for a, b in zip(r[first + j]["losses"], ref_losses))
            assert worst < loss_tol, (args, kw, r[first + j]["losses"], ref_losses)
        params = _params_of(r[first + j] for r in results)
        worst = max(float(np.abs(v - ref_params[n].numpy()).max()) for n, v in params.items()
                    if n in ref_params)
        assert worst < param_tol, (args, kw, worst, param_tol)


@pytest.mark.distributed
def test_per_block_gathering_holds_a_pair_of_blocks_not_the_stage(world4):
    """Exact storage bytes the per-block buffers held at the last step's fullest, per rank:
    gathered parameters = the largest pair of adjacent groups of a local stage (one gathered,
    the next prefetched), gradient reduce buffers = the largest pair of consecutive
    reduce-scatters (fxpipe.runtime.block_gather's formula), against every local stage's
    whole parameters under ``param_gather: stage``."""
    from fxpipe.plans.param_blocks import param_groups
    from fxpipe.runtime.block_gather import predicted_gathered_peak, predicted_reducing_peak

    _, results = world4
    first = len(EXACT) + len(COMPOSED)
    for j, (args, kw) in enumerate(BLOCK[:3]):  # (tensor parallel: shapes are the shards')
        plan = Plan.from_dict(_plan(*args, **kw))
        n = plan.dp
        for r in results:
            row = r[first + j]
            padded = [[-(-sum(math.prod(plan.param_shapes[f]) for f in fs) // n) * n * 4
                       for _, fs in param_groups([f for f in plan.stages[s].params
                                                  if f not in plan.shared_params])]
                      for s in row["stages"]]
            assert row["gathered"]["gathered"] == predicted_gathered_peak(padded, True), (
                args, row["stages"], row["gathered"], padded)
            assert row["gathered"]["reducing"] == predicted_reducing_peak(padded, n), (
                args, row["stages"], row["gathered"], padded)
            whole = sum(math.prod(plan.param_shapes[f]) * 4 for s in row["stages"]
                        for f in plan.stages[s].params if f not in plan.shared_params)
            assert row["gathered"]["gathered"] < whole, (args, row["gathered"], whole)


@pytest.mark.distributed
def test_the_state_each_rank_holds_is_the_plans_prediction(world4):
    """Storage bytes of parameters, gradients and optimizer state after a step and at the
    step's fullest equal held_state_bytes; the reduce-scatter + all-gather bytes equal
    sharded_bytes_sent (plus the tied embedding's all-reduce, the unsharded rule)."""
    from fxpipe.runtime.compression import ring_allreduce_bytes

    _, results = world4
    cases = [(args, kind, 1) for args, kind in EXACT] + COMPOSED
    for i, (args, kind, acc) in enumerate(cases):
        plan = Plan.from_dict(_plan(*args))
        saved = {}
        for r in results:
            row = r[i]
            want = held_state_bytes(plan, row["stages"], row["replica"], FIELDS[kind])
            assert row["held"] == want, (args, kind, row["held"], want)
            saved.setdefault(plan.data_sharding, []).append(sum(want.values()))
            if plan.data_sharding == "none":
                continue
            peak = held_state_bytes(plan, row["stages"], row["replica"], FIELDS[kind],
                                    peak=True)
            assert row["peak"] == peak, (args, kind, row["peak"], peak)
            compression = args[6] if len(args) > 6 else "none"
            sent = sharded_bytes_sent(plan, row["stages"], 2 if compression != "none" else 4)
            # the tied embedding: all-reduced whole over the replicas of every stage holding
            # it (one group of dp x its pipeline ranks), the unsharded rule
            ranks = plan.stage_ranks()
            tied = 0
            for f, users in plan.shared_params.items():
                if any(s in users for s in row["stages"]):
                    group = plan.dp * len({ranks[s] for s in users})
                    size = math.prod(plan.param_shapes[f]) * (2 if compression != "none" else 4)
                    tied += ring_allreduce_bytes(size, group)
            expected = acc * (sent["reduce_scatter"] + tied) + sent["all_gather"]
            assert row["sent"]["bytes"] == expected, (args, row["sent"], sent, tied)
    # AdamW at pipeline 2 x data 2: sharding holds less than the unsharded run
    none = [sum(r[EXACT.index(((2, 2, "none"), "adamw"))]["held"].values()) for r in results]
    opt = [sum(r[EXACT.index(((2, 2, "optimizer"), "adamw"))]["held"].values())
           for r in results]
    assert max(opt) < min(none)


@pytest.mark.distributed
def test_a_sharded_checkpoint_resumes_under_another_degree_or_level(world4):
    ckpt, results = world4
    for r in results:
        got = r[-2]
        cont = got["continued"]
        for name in ("none", "full", "dp4"):
            for a, b in zip(cont, got[name]):
                # the same steps; only the clipping norm's and the replicas' sums reordered
                assert abs(a - b) < bound(max(cont), B, 2), (name, cont, got[name])
    model = tiny_gpt()
    load_into_model(model, f"{ckpt}/step_000002")  # the plain model's tensors
    assert model.h[0].attn.qkv.weight.shape == (96, 32)


# ----------------------------------------------------------------------------- in process
def test_levels_in_the_spec_and_the_pairs_that_do_not_combine():
    base = {"model": {"factory": "x:y"}, "cluster": {"devices_per_node": 2},
            "parallel": {"data": 2, "data_sharding": "optimizer"}}
    assert fxpipe.load_spec(base).parallel.data_sharding == "optimizer"
    for train, msg in (({"updates": "async"}, "data_sharding: optimizer with train.updates"),
                       ({"grad_compression": "powersgd"}, "grad_compression: powersgd")):
        with pytest.raises(SpecError, match=msg):
            fxpipe.load_spec({**base, "train": train})
    with pytest.raises(SpecError):
        fxpipe.load_spec({**base, "parallel": {"data_sharding": "zero3"}})


def test_the_memory_model_and_the_auto_search_use_the_level():
    from fxpipe.specs.schema import state_factor

    assert state_factor("adamw") == 4
    assert state_factor("adamw", "optimizer", 32) == pytest.approx(2 + 3 / 32)
    assert state_factor("adamw", "full", 8) == pytest.approx(2 + 4 / 8)
    assert state_factor("adamw", "optimizer", 1) == 4  # nothing to shard over
    plan = Plan.from_dict(_plan(2, 2, "optimizer"))
    unsharded = Plan.from_dict(_plan(2, 2, "none"))
    for a, b in zip(plan.stages, unsharded.stages):
        assert a.memory_bytes < b.memory_bytes
    assert plan.data_sharding == "optimizer" and plan.param_shapes


def _unwrapped(plan: dict) -> str:
    pipe = _compiled(plan)  # pipeline 2 x data 2, ``optimizer``: a sharded pipeline
    opt = torch.optim.AdamW(pipe.parameters())
    pipe.step(*_batch(0))
    try:
        opt.step()
    except UsageError as e:
        return str(e)
    return "stepped"


@pytest.mark.distributed
def test_an_unwrapped_optimizer_on_a_sharded_pipeline_is_refused(world4):
    _, results = world4
    for r in results:
        assert "pipe.shard_optimizer" in r[-1]


def test_optimizers_that_would_train_differently_over_slices_are_refused():
    """Adafactor (factored moments of a matrix's rows and columns) over flat slices, or a
    scheduler left on the optimizer that shard_optimizer replaces, would silently train
    differently: both are refused before any step."""
    from fxpipe.runtime.data_sharding import _check_shardable

    params = [torch.nn.Parameter(torch.zeros(4, 4))]
    with pytest.raises(UsageError, match="element-wise optimizers.*Adafactor"):
        _check_shardable(torch.optim.Adafactor(params))
    opt = torch.optim.AdamW(params)
    _check_shardable(opt)  # element-wise: accepted
    torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0)
    with pytest.raises(UsageError, match="wrap first, then build the scheduler"):
        _check_shardable(opt)
