"""The bundled mixture-of-experts GPT (``fxpipe.examples.moe``), issue 38's model.

* Its math: top-2 routing with capacity (a token over an expert's capacity dropped by it, the
  first choices placed before the second ones), the load-balancing loss at its minimum (1) for
  an even router, torch.export traces it whole.
* Trained by fxpipe on 4 gloo ranks with its experts split by expert parallelism 2
  (``parallel.expert``, issue 38: pipeline 2 x data 2 under 1F1B and ZB-V, data 2 x tensor 2
  under ZB-H1): losses and parameters equal to one process running the same micro-batches
  (routing, capacity and the auxiliary loss are per forward call, i.e. per micro-batch) within
  the float32 bounds of tests/tolerances.py. So do transformers' dropless Mixtral (1F1B) and
  Qwen2-MoE (ZB-V, a shared expert besides) at pipeline 2 x data 2 x expert 2 against one
  process on the whole batch.
* The all-to-all bytes each replica sends in a step equal the plan's (``plan.expert_bytes``).
* A checkpoint saved with split experts holds the plain model's tensors (loaded whole).
* Bad input, one line each: expert not dividing data, with data sharding, a model without
  expert layers, experts not dividing by the degree.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import fxpipe
from fxpipe.examples.moe import MoEGPT, MoEMLP
from fxpipe.plans.plan import Plan
from fxpipe.runtime.local_ranks import run_ranks

try:
    import real_models as zoo
    from shared_models import exact_bounds
except ImportError:  # tests/ collected as a package
    from tests import real_models as zoo
    from tests.shared_models import exact_bounds

ARGS = {"vocab_size": 64, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32,
        "n_expert": 4, "top_k": 2, "capacity_factor": 1.0}
B, T, STEPS, LR, CLIP = 8, 16, 3, 0.2, 0.5


def _model() -> MoEGPT:
    torch.manual_seed(0)
    return MoEGPT(**ARGS)


def _batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(900 + step)
    return {"idx": torch.randint(0, 64, (B, T), generator=g),
            "labels": torch.randint(0, 64, (B, T), generator=g)}


def test_routing_keeps_capacity_and_priority():
    moe = MoEMLP(4, n_expert=2, top_k=1, capacity_factor=1.0)
    with torch.no_grad():
        moe.router.weight.copy_(torch.tensor([[1.0, 0, 0, 0], [-1.0, 0, 0, 0]]))
        moe.w_in.normal_()
        moe.w_out.normal_()
    # 4 tokens all preferring expert 0: capacity ceil(1.0 * 4 * 1 / 2) = 2 keeps the first two
    x = torch.tensor([[[1.0, 0, 0, 0], [2.0, 0, 0, 0], [3.0, 0, 0, 0], [4.0, 0, 0, 0]]])
    y, aux = moe(x)
    assert moe.capacity(4) == 2
    assert torch.count_nonzero(y[0, :2].abs().sum(-1)) == 2
    assert torch.all(y[0, 2:] == 0)  # dropped: the residual alone carries them
    even = MoEMLP(8, n_expert=4, top_k=2)
    with torch.no_grad():
        even.router.weight.zero_()  # every expert equally likely: the balanced minimum
    _, aux = even(torch.randn(2, 8, 8))
    # ties go to the first experts, so the choices are not spread; the probabilities are
    assert aux.item() == pytest.approx(1.0 * 4 * (0.5 * 0.25 + 0.5 * 0.25), rel=1e-6)


def test_torch_export_traces_the_whole_model():
    batch = _batch(0)
    ep = torch.export.export(_model(), (), {k: v[:2] for k, v in batch.items()})
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert "aten.topk.default" in targets and "aten.bmm.default" in targets


def _spec(p: int, d: int, t: int, schedule: str, expert: int = 1,
          sharding: str = "none") -> dict:
    return {"model": {"factory": "fxpipe.examples.moe:MoEGPT", "args": ARGS},
            "data": {"batch_size": B, "seq_len": T},
            "parallel": {"pipeline": p, "data": d, "tensor": t, "microbatches": 2,
                         "schedule": schedule, "expert": expert, "data_sharding": sharding},
            "cluster": {"devices_per_node": p * d * t, "memory_gb": 4, "device_tflops": 0.02},
            "train": {"loss": "model", "optimizer": "sgd", "timeout_s": 120}}


#: (pipeline, data, tensor, schedule, expert, data sharding)
CASES = [(2, 2, 1, "1f1b", 2, "none"), (2, 2, 1, "zb-v", 2, "optimizer"),
         (1, 2, 2, "zb-h1", 2, "none")]
#: transformers' dropless MoE models (sorted rows through grouped matmuls) under expert 2:
#: (model, pipeline, data, schedule)
HF_CASES = [("mixtral", 2, 2, "1f1b"), ("qwen2_moe", 2, 2, "zb-v")]


def _hf_plan(case) -> dict:
    name, p, d, schedule = case
    return zoo.plan(name, p, d, 2, schedule, parallel__expert=2).to_dict()


def _hf_reference(name: str):
    """One process, the whole batch (dropless routing is per token: micro-batching does not
    change it; the models add no auxiliary loss by default), SGD with momentum."""
    from fxpipe.partitioner.trace import pick_output, trace_kwargs

    model = zoo.build(name)
    init = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for step in range(STEPS):
        _, kwargs, _ = zoo.batch(name, step)
        loss = pick_output(model(**trace_kwargs(model, kwargs)), "loss", name)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    final = {k: v.detach() for k, v in model.named_parameters()}
    return losses, final, exact_bounds(losses, init, final, zoo.B, STEPS)


def _plan(case) -> dict:
    with torch.device("meta"):
        model = MoEGPT(**ARGS)
    batch = _batch(0)
    return fxpipe.plan(model, _spec(*case), (), {k: v[:1].to("meta") for k, v in
                                                 batch.items()}).to_dict()


def _reference(case):
    """One process, the pipeline's micro-batches (data ranks' rows, then each rank's
    micro-batches), their losses averaged (equal tokens), SGD with momentum."""
    p, d, t, *_ = case
    model = _model()
    init = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    pieces = d * 2
    for step in range(STEPS):
        batch = _batch(step)
        total = 0.0
        for i in range(pieces):
            part = {k: v.chunk(pieces)[i] for k, v in batch.items()}
            loss = model(**part)["loss"] / pieces
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    final = {k: v.detach() for k, v in model.named_parameters()}
    return losses, final, exact_bounds(losses, init, final, B, STEPS)


def _worker(rank: int, plans: list, ckpt: str) -> list:
    from fxpipe.training.checkpoint import save_checkpoint

    out = []
    for i, plan in enumerate(plans):
        hf = i >= len(CASES)
        name = HF_CASES[i - len(CASES)][0] if hf else None
        pipe = fxpipe.compile(zoo.build(name) if hf else _model(), Plan.from_dict(plan))
        opt = pipe.shard_optimizer(torch.optim.SGD(pipe.parameters(), lr=LR, momentum=0.9))
        losses, sent = [], 0
        for step in range(STEPS):
            losses.append(pipe.step(zoo.batch(name, step)[1] if hf else _batch(step), None))
            if step == 0:
                sent = pipe.executor.collective_bytes.get("all-to-all", 0)
            if not hf:  # every expert's gradient counted once in the norm
                pipe.clip_grad_norm_(CLIP)
            opt.step()
            pipe.zero_grad()
        if i == SAVED:  # experts split over the expert group: saved whole
            save_checkpoint(pipe.module, ckpt, STEPS, optimizer=opt)
        out.append({"losses": losses, "sent": sent, "replica": pipe.mesh.dp_rank,
                    "tp_rank": pipe.mesh.tp_rank,
                    "params": {k: v.numpy().copy() for k, v in pipe.state_dict().items()}})
    return out


#: the case whose trained model is also saved (a checkpoint of split experts)
SAVED = 1  # (with data sharding: the sharded optimizer saves whole experts too)


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("moe-ckpt"))
    plans = [_plan(c) for c in CASES] + [_hf_plan(c) for c in HF_CASES]
    return ckpt, run_ranks(_worker, 4, plans, ckpt, timeout_s=300, dist_timeout_s=120)


@pytest.mark.distributed
@pytest.mark.parametrize("i", [i for i, c in enumerate(CASES) if c[4] > 1])
def test_the_all_to_all_bytes_are_the_planned_ones(world4, i):
    _, world4 = world4
    """Each rank of a replica sends (N-1)/N of the token slots the plan priced, per
    micro-batch, forward and backward (counted by the run's collective recorder)."""
    plan = Plan.from_dict(_plan(CASES[i]))
    n = plan.expert
    per_replica: dict[tuple[int, int], int] = {}
    for r in world4:
        row = r[i]
        per_replica[(row["replica"], row["tp_rank"])] = (
            per_replica.get((row["replica"], row["tp_rank"]), 0) + row["sent"])
    want = plan.microbatches * sum(plan.expert_bytes) * (n - 1) / n
    assert want > 0
    for key, got in per_replica.items():
        assert got == pytest.approx(want, rel=1e-9), (CASES[i], key, got, want)


@pytest.mark.distributed
@pytest.mark.parametrize("i", range(len(CASES)), ids=["-".join(map(str, c)) for c in CASES])
def test_the_moe_gpt_trains_like_one_process(world4, i):
    _, world4 = world4
    ref_losses, ref_params, (loss_tol, param_tol) = _reference(CASES[i])
    params: dict[str, np.ndarray] = {}
    for r in world4:
        row = r[i]
        worst = max(abs(a - b) for a, b in zip(row["losses"], ref_losses))
        assert worst < loss_tol, (CASES[i], row["losses"], ref_losses, loss_tol)
        params.update({n: v for n, v in row["params"].items() if n in ref_params})
    assert set(ref_params) <= set(params) | {"head.weight"}
    worst = max(float(np.abs(v - ref_params[n].numpy()).max()) for n, v in params.items())
    assert worst < param_tol, (CASES[i], worst, param_tol)


@pytest.mark.distributed
def test_a_checkpoint_of_split_experts_holds_the_plain_models_tensors(world4):
    """Saved under expert 2: the plain model loads it whole (its names, its shapes), equal to
    the trained run's gathered state."""
    from fxpipe.training.checkpoint import load_into_model

    ckpt, results = world4
    model = MoEGPT(**ARGS)
    load_into_model(model, ckpt)
    trained = {}
    for r in results:
        trained.update(r[SAVED]["params"])
    for name, p in model.state_dict().items():
        if name == "head.weight":  # tied to wte.weight: the run names it once
            continue
        assert name in trained, name
        assert np.array_equal(p.numpy(), trained[name]), name
    assert model.h[0].moe.w_in.shape[0] == ARGS["n_expert"]


def test_expert_parallelism_bad_input_is_one_line():
    from fxpipe.errors import PlanError, SpecError

    base = _spec(2, 2, 1, "1f1b", 2)
    for change, msg in (({"expert": 3, "data": 2}, "expert=3 splits the experts"),
                        ({"data_sharding": "full", "param_gather": "block"},
                         "gathering block by block with parallel.expert > 1 is not")):
        spec = {**base, "parallel": {**base["parallel"], **change}}
        with pytest.raises(SpecError, match=msg):
            fxpipe.load_spec(spec)
    from fxpipe.examples.gpt import CharGPT

    dense = {**base, "model": {"factory": "fxpipe.examples.gpt:CharGPT"},
             "train": {"optimizer": "sgd"}}
    with pytest.raises(PlanError, match="CharGPT has no expert layer fxpipe can split"):
        fxpipe.plan(CharGPT(64, 16, 2, 2, 32), dense, (torch.zeros(1, T, dtype=torch.long),))
    odd = dict(ARGS, n_expert=3)
    with pytest.raises(PlanError, match="3 experts, which do not split over 2 ranks"):
        fxpipe.plan(MoEGPT(**odd), {**base, "model": {"factory": "x:y", "args": odd}}, (),
                    {k: v[:1] for k, v in _batch(0).items()})


def test_experts_stay_whole_under_data_sharding_and_are_planned_so():
    """The sharding leaves the experts whole (they differ between replicas): the plan holds
    their whole state, the dense parameters' optimizer state halved over 2 replicas."""
    def stages(level):
        with torch.device("meta"):
            model = MoEGPT(**ARGS)
        spec = _spec(2, 2, 1, "1f1b", 2, level)
        spec["train"]["optimizer"] = "adamw"
        return fxpipe.plan(model, spec, (), {k: v[:1].to("meta") for k, v in
                                             _batch(0).items()}).stages
    whole, sharded = stages("none"), stages("optimizer")
    layer = sum(p.numel() * 4 for n, p in _model().h[0].moe.named_parameters()
                if not n.startswith("router"))
    for a, b in zip(whole, sharded):
        assert b.expert_bytes == layer // 2 and b.param_bytes == a.param_bytes
        # AdamW: 4 bytes of state per byte whole, 2 + 3/2 sharded over 2 replicas
        assert a.memory_bytes - b.memory_bytes == pytest.approx(
            (b.param_bytes - b.expert_bytes) * 0.5, abs=4)


def test_auto_expert_degree_plans_each_and_says_why_one_was_left_out():
    spec = _spec(2, "auto", 1, "1f1b", "auto")
    spec["cluster"]["devices_per_node"] = 8
    with torch.device("meta"):
        model = MoEGPT(**ARGS)
    made = fxpipe.plan(model, spec, (), {k: v[:1].to("meta") for k, v in _batch(0).items()})
    text = "\n".join(made.explain)
    assert made.explain[0].startswith(f"parallel.expert: auto: chose expert {made.expert} ")
    for e in (1, 2, 4):
        assert f"expert {e}" in text
    assert "expert 8: parallel.expert: 8: MoEGPT's MoE layer has 4 experts" in text


@pytest.mark.distributed
@pytest.mark.parametrize("j", range(len(HF_CASES)), ids=[c[0] for c in HF_CASES])
def test_transformers_dropless_moe_under_expert_2_trains_like_one_process(world4, j):
    _, results = world4
    name = HF_CASES[j][0]
    ref_losses, ref_params, (loss_tol, param_tol) = _hf_reference(name)
    params: dict[str, np.ndarray] = {}
    for r in results:
        row = r[len(CASES) + j]
        worst = max(abs(a - b) for a, b in zip(row["losses"], ref_losses))
        assert worst < loss_tol, (name, row["losses"], ref_losses, loss_tol)
        params.update({n: v for n, v in row["params"].items() if n in ref_params})
        assert row["sent"] > 0  # the rows went to their experts
    assert set(params) == set(ref_params)
    worst = max(float(np.abs(v - ref_params[n].numpy()).max()) for n, v in params.items())
    assert worst < param_tol, (name, worst, param_tol)


def test_accumulated_expert_gradients_are_set_aside_and_empty_microbatches_still_run():
    """Under gradient accumulation what earlier calls left of an expert's gradient is set
    aside (it is summed over fewer replicas than it is divided by: reducing it again would
    scale it by 1/N per call), and a micro-batch whose targets all are ignored still runs its
    backward (a zero loss) where experts are split, so its all-to-alls meet the group's."""
    import torch.nn as nn

    from fxpipe.runtime.executor import PipelineExecutor
    from fxpipe.runtime.step_grads import StepGrads

    dense, expert = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2, 2))
    expert.fxpipe_expert = True
    grads = StepGrads({0: [dense, expert]}, None, shared=())
    assert grads._aside_ids == [id(expert)]

    class _Mesh:
        expert = 2

    ex = PipelineExecutor.__new__(PipelineExecutor)
    ex.mesh, ex.m, ex.loss_fn = _Mesh(), 2, lambda out, target: out.mean()
    out = torch.full((3,), float("nan"), requires_grad=True)
    loss = ex._microbatch_loss(out, None, 0.0)
    assert loss is not None and float(loss) == 0.0
    loss.backward()  # the backward runs (and adds nothing)
    _Mesh.expert = 1
    assert ex._microbatch_loss(out, None, 0.0) is None
