"""Real models train exactly: transformers GPT-2, BERT (masked LM, ``-100`` labels), Llama
(grouped-query attention), T5 (encoder-decoder), ViT, plus ``nn.Transformer`` and a ResNet-style
CNN with BatchNorm (:mod:`real_models`), with the default attention and config (dropout 0).

Each is planned into 2 and 4 stages from its meta-device copy, then trained 3 steps on 2 stages x
2 replicas under 1F1B and ZB-H1, GPT-2 and T5 under GPipe too (one process group of 4 gloo ranks
runs every case; the planner cuts a model alike under the three schedules, so its 1F1B plan is
run under each: one plan and one trace per model and rank) and compared with single-process training on the whole
batch: losses and final parameters within the float32 bounds of their reordered sums
(tests/tolerances.py; fp32, SGD). The transformers models get dict batches and compute their
own loss from ``labels``; the loss is the mean over the tokens that count in the whole batch.
BatchNorm statistics are per micro-batch (as in GPipe), so the ResNet's reference runs
micro-batch by micro-batch; everything else is the same. GPT-2 and Llama also run their cuts
with the memory levers: full, selective and partial recomputation, activation offload, and sharded
data parallelism gathering the parameters per block (``data_sharding: full``,
``param_gather: block``; GPT-2 under 1F1B), each lever under a whole backward (1F1B) on one
model and a split one (ZB-H1) on the other, and GPT-2 under ZB-V (selective
recomputation, per-block gathering) and Llama interleaved over 4 stages (offload, per-block
gathering).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from fxpipe.execution.losses import MODEL_LOSS, resolve_loss
from fxpipe.partitioner.loss_targets import target_counter
from fxpipe.partitioner.split import build_stages, trace_for_plan
from fxpipe.plans.plan import Plan
from fxpipe.runtime.executor import PipelineExecutor
from fxpipe.runtime.local_ranks import run_ranks
from fxpipe.runtime.mesh import Mesh
from fxpipe.schedule.lowering import schedule_for_plan
from fxpipe.specs.loader import load_spec
from fxpipe.training.losses import batch_counter, microbatch_weights

try:
    import real_models as zoo
    from shared_models import exact_bounds
except ImportError:  # tests/ collected as a package
    from tests import real_models as zoo
    from tests.shared_models import exact_bounds

pytest.importorskip("transformers")

PIPE, DP, M = 2, 2, 2
MBS = zoo.B // (DP * M)
STEPS = 3
SCHEDULES = ("gpipe", "1f1b", "zb-h1")
#: the models run under GPipe too (its order differs from 1F1B's only in when each backward
#: runs, which the bundled models' schedule tests cover; a causal LM and the encoder-decoder)
GPIPE_TOO = ("gpt2", "t5")


def schedules_of(name: str) -> tuple[str, ...]:
    return SCHEDULES if name in GPIPE_TOO else tuple(s for s in SCHEDULES if s != "gpipe")
#: selective recomputation's ridge (FLOP per output byte) in these runs: above an unfused
#: attention score's (2 x head width 8 / 4 bytes = 4) and below a linear layer's (2 x input
#: width 32 / 4 = 16): the linear layers keep their outputs, the rest runs again
SELECTIVE_RIDGE = 6.0


def _plan(name: str, pipeline: int, data: int, microbatches: int, schedule: str,
          _raw: bool = False, **train) -> Plan:
    """fxpipe's plan (planned once per configuration: real_models.plan); ``train`` fields, or
    ``section__field`` ones as they are with ``_raw``."""
    return zoo.plan(name, pipeline, data, microbatches, schedule,
                    **(train if _raw else {f"train__{k}": v for k, v in train.items()}))


def _batch(name: str, step: int):
    from fxpipe.data.batches import Batch

    args, kwargs, target = zoo.batch(name, step)
    return Batch(args, kwargs, target)


def _counter(plan: Plan, traced):
    spec = load_spec(plan.spec)
    own = spec.train.loss == MODEL_LOSS
    return batch_counter(plan.model_inputs, plan.input_kwargs, spec.train.ignore_index,
                         target_counter(traced.gm) if own else None, own)


def _variant(plan: Plan, schedule: str | None = None, placement: str | None = None,
             recompute: list[bool] | None = None, **stage_fields) -> Plan:
    """A copy of ``plan`` (same cut) run under another schedule, placement or per-stage
    recomputation: what the executor reads of them (the planner cuts these models alike under
    GPipe, 1F1B and ZB-H1; only its predictions and memory estimates differ). ``stage_fields``:
    set on every stage (selective recomputation's ``keep_ridge``, ``offload_bytes``)."""
    plan = copy.deepcopy(plan)
    if schedule is not None:
        plan.schedule = schedule
        plan.spec = plan.spec.model_copy(update={"parallel": plan.spec.parallel.model_copy(
            update={"schedule": schedule})})
    if placement is not None:
        plan.placement = placement
    for st, on in zip(plan.stages, recompute or ()):
        st.recompute = on
    for st in plan.stages:
        for k, v in stage_fields.items():
            setattr(st, k, v)
    return plan


def _worker(rank: int, cases: list[tuple[str, dict, dict[str, dict]]]):
    meshes = {layout: Mesh(PIPE, DP, timeout_s=120, layout=layout)
              for layout in ("pipeline-inner", "data-inner")}  # collective: every rank, in order
    out = {}
    for name, plan_dict, variants in cases:  # one trace per case: its variants share the cut
        base = Plan.from_dict(plan_dict)
        spec = load_spec(base.spec)
        model = zoo.build(name)
        traced = trace_for_plan(base, model)  # resolves a plan made of blocks in place
        count = _counter(base, traced)
        start = {k: v.detach().clone() for k, v in model.state_dict().items()}
        loss_fn = resolve_loss(spec.train.loss, spec.train.ignore_index)
        built: dict[int, dict] = {}  # pipeline rank -> its stage modules (of the one cut)
        for label, change in variants.items():
            change = dict(change)
            level = change.pop("data_sharding", "none")  # (runs after the unsharded ones)
            plan = _variant(base, **change)
            mesh = meshes[plan.placement]
            schedule = schedule_for_plan(plan)
            if mesh.pipe_rank not in built:
                built[mesh.pipe_rank] = build_stages(plan, traced,
                                                     schedule.stages_of_rank(mesh.pipe_rank))
            stages = built[mesh.pipe_rank]
            with torch.no_grad():
                for k, v in model.state_dict().items():
                    v.copy_(start[k])
            params = list({id(p): p for m in stages.values() for p in m.parameters()}.values())
            opt = torch.optim.SGD(params, lr=spec.train.lr)
            ex = PipelineExecutor(plan, schedule, stages, mesh, loss_fn, opt,
                                  timeout_s=120, needs_target=spec.train.loss != MODEL_LOSS,
                                  data_sharding=level)
            if ex.sharding is not None:  # the replica's slices (ZeRO)
                from fxpipe.runtime.data_sharding import ShardedOptimizer

                names = {id(p): n for m in stages.values() for n, p in m.named_parameters()}
                ex.optimizer = ShardedOptimizer(opt, ex.sharding, names, 120)
            losses = []
            for step in range(STEPS):
                b = _batch(name, step)
                w = microbatch_weights(b, mesh.dp_rank, DP, M, count)
                mine = b.slice(mesh.dp_rank * M * MBS, (mesh.dp_rank + 1) * M * MBS)
                losses.append(ex.step(mine.named(plan.model_inputs, plan.input_kwargs),
                                      mine.target, w))
            if ex.sharding is not None:  # whole parameters again (collective)
                ex.sharding.ensure_gathered(120)
            params = {n: p.detach().numpy().copy() for m in stages.values()  # by value
                      for n, p in m.named_parameters()}
            out[(name, label)] = (losses, params)
    return out


@functools.cache  # read only: GPT-2's and Llama's serve several schedules
def _reference(name: str):
    """Single-process training on the whole batch (micro-batch by micro-batch for BatchNorm):
    losses, the trained model and the ``(loss, parameter)`` bounds on a pipelined run's
    difference (:func:`shared_models.exact_bounds`)."""
    from fxpipe.partitioner.trace import pick_output, trace_kwargs

    spec = load_spec(zoo.spec_for(name, PIPE, DP, M, "1f1b"))
    model = zoo.build(name)
    model.train()
    init = {k: v.detach().clone() for k, v in model.named_parameters(remove_duplicate=False)}
    loss_fn = resolve_loss(spec.train.loss, spec.train.ignore_index)
    opt = torch.optim.SGD(model.parameters(), lr=spec.train.lr)
    losses = []
    for step in range(STEPS):
        b = _batch(name, step)
        opt.zero_grad()
        if name == "resnet":  # per micro-batch statistics, as the pipeline computes them
            parts = []
            count = batch_counter([], [], spec.train.ignore_index, None, False)
            for r in range(DP):
                w = microbatch_weights(b, r, DP, M, count)
                for i in range(M):
                    lo = (r * M + i) * MBS
                    mb = b.slice(lo, lo + MBS)
                    parts.append(loss_fn(model(*mb.args), mb.target) * w[i] / DP)
            loss = sum(parts)
        else:
            out = model(*b.args, **trace_kwargs(model, b.kwargs))
            loss = loss_fn(pick_output(out, spec.loss_output, name), b.target)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    final = {k: v.detach() for k, v in model.named_parameters(remove_duplicate=False)}
    return losses, model, exact_bounds(losses, init, final, zoo.B, STEPS)


@pytest.fixture(scope="module")
def trained():
    cases = [(name, _plan(name, PIPE, DP, M, "1f1b").to_dict(),
              {s: {"schedule": s} for s in schedules_of(name)}) for name in zoo.NAMES]
    cases[zoo.NAMES.index("gpt2")][2]["1f1b data-inner"] = {  # each stage's replicas on
        "placement": "data-inner"}                            # adjacent ranks
    # activation recomputation (the backward runs the forward again): planned with it on, its
    # own cut; under ZB-H1 per stage, as the planner chooses it: the first stage only
    again = _plan("llama", PIPE, DP, M, "1f1b", activation_recompute="on")
    assert all(st.recompute for st in again.stages)
    cases.append(("llama", again.to_dict(), {
        "zb-h1 recompute": {"schedule": "zb-h1",
                            "recompute": [True] + [False] * (again.num_stages - 1)}}))
    # the memory levers of issue 36 on the same cuts, each model and lever once, alternating
    # a whole backward (1F1B) and a split one (ZB-H1): selective recomputation (the linear
    # layers' outputs kept, SELECTIVE_RIDGE) and activation offload
    cases[zoo.NAMES.index("gpt2")][2]["zb-h1 selective"] = {
        "schedule": "zb-h1", "recompute": [True] * PIPE, "keep_ridge": SELECTIVE_RIDGE}
    cases[zoo.NAMES.index("llama")][2].update({
        "1f1b selective": {"recompute": [True] * PIPE, "keep_ridge": SELECTIVE_RIDGE},
        "zb-h1 offload": {"schedule": "zb-h1", "offload_bytes": 1}})
    cases[zoo.NAMES.index("gpt2")][2]["1f1b offload"] = {"offload_bytes": 1}
    # partial recomputation (each stage's first block recomputes, the rest keep theirs):
    # GPT-2 under a whole backward, Llama under a split one
    cases[zoo.NAMES.index("gpt2")][2]["1f1b partial"] = {"recompute": [True] * PIPE,
                                                         "recompute_blocks": 1}
    cases[zoo.NAMES.index("llama")][2]["zb-h1 partial"] = {
        "schedule": "zb-h1", "recompute": [True] * PIPE, "recompute_blocks": 1}
    # the V and interleaved schedules (two stages per rank: GPT-2 under ZB-V, Llama
    # interleaved over 4 stages) with the levers, per-block gathering last (see below)
    levers = {"selective": {"recompute": [True] * 2 * PIPE, "keep_ridge": SELECTIVE_RIDGE},
              "offload": {"offload_bytes": 1},
              "block": {"param_gather": "block", "data_sharding": "full"}}
    for name, schedule, over, which in (
            ("gpt2", "zb-v", {}, ("selective", "block")),
            ("llama", "interleaved", {"virtual_stages": 2}, ("offload", "block"))):
        vplan = _plan(name, PIPE, DP, M, schedule, **{f"parallel__{k}": v
                                                      for k, v in over.items()}, _raw=True)
        assert vplan.num_stages == 2 * PIPE, (name, vplan.num_stages)
        cases.append((name, vplan.to_dict(), {f"{schedule} {k}": levers[k] for k in which}))
    # issue 36: data_sharding full gathered per block (param_gather: block) under a whole
    # backward here (the split one runs under ZB-V above); last, since it leaves the
    # parameters views of the gathered buffers
    cases[zoo.NAMES.index("gpt2")][2]["1f1b block"] = {"param_gather": "block",
                                                       "data_sharding": "full"}
    results: dict = {}
    for per_rank in run_ranks(_worker, PIPE * DP, cases, timeout_s=600, dist_timeout_s=120):
        for key, (losses, params) in per_rank.items():
            entry = results.setdefault(key, {"losses": losses, "params": {}})
            entry["params"].update(params)
    return results


@pytest.mark.parametrize("name", zoo.NAMES)
def test_plans_into_two_and_four_stages(name):
    for pipeline, data, m in ((2, 2, 2), (4, 1, 4)):
        plan = _plan(name, pipeline, data, m, "1f1b")
        assert plan.num_stages == pipeline and plan.traced_on == "cpu"
        if plan.folded:  # planned as blocks: every stage holds some of them
            assert sorted(set(plan.folded["blocks"])) == list(range(pipeline))
        else:
            assert all(st.nodes for st in plan.stages)


@pytest.mark.distributed
@pytest.mark.parametrize("name, schedule", [(n, s) for n in zoo.NAMES for s in schedules_of(n)]
                         + [("gpt2", "1f1b data-inner"), ("llama", "zb-h1 recompute")]
                         + [("gpt2", "zb-h1 selective"), ("llama", "1f1b selective"),
                            ("gpt2", "1f1b offload"), ("llama", "zb-h1 offload")]
                         + [("gpt2", "1f1b block")]
                         + [("gpt2", "1f1b partial"), ("llama", "zb-h1 partial")]
                         + [("gpt2", "zb-v selective"), ("gpt2", "zb-v block"),
                            ("llama", "interleaved offload"), ("llama", "interleaved block")])
def test_trains_like_single_process(trained, name, schedule):
    ref_losses, ref_model, (loss_tol, param_tol) = _reference(name)
    got = trained[(name, schedule)]
    for a, b in zip(got["losses"], ref_losses):
        assert abs(a - b) < loss_tol, (got["losses"], ref_losses, loss_tol)
    ref_params = dict(ref_model.named_parameters(remove_duplicate=False))  # tied: every alias
    assert set(got["params"]) <= set(ref_params)
    covered = {id(ref_params[n]) for n in got["params"]}
    assert covered == {id(p) for p in ref_model.parameters()}, "every parameter is trained"
    worst = max(float((torch.from_numpy(got["params"][n]) - ref_params[n].detach()).abs().max())
                for n in got["params"])
    assert worst < param_tol, (worst, param_tol)
