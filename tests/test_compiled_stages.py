"""Compiled stages (issue 37, ``train.compile``): every stage run through torch.compile (inductor).

* Exact up to inductor's reassociation (one process group of 4 gloo ranks, fp32, SGD with
  momentum, clipping, 3 steps): the bundled GPT under 1F1B at pipeline 2 x data 2 with full
  recomputation (the replay runs the compiled graph again), and GPT-2 under ZB-V (two stages
  per rank, B and W split) at pipeline 2 x tensor 2 with activation offload (the collectives
  between compiled regions, the saved tensors of a compiled region on the host): losses and
  final parameters equal single-process training within :func:`inductor_bound`.
* Compiled once: every rank compiles its stages in the first step, and no graph is compiled
  after it (Dynamo's graph counter); the stages really ran compiled (a split B/W backward runs
  each compiled region's backward once, in B).
* Settings: ``compile: auto`` is eager on CPU; ``stages`` where inductor has no compiler,
  ``cuda_graphs`` off CUDA or without compilation: one clear line each; stages under selective
  or partial recomputation or per-block gathering stay eager and say why.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fxpipe
from fxpipe.errors import UsageError
from fxpipe.plans.plan import Plan
from fxpipe.runtime.backward_split import backward_input, backward_weight
from fxpipe.execution.compiled_stage import (compile_counters, compile_problem, eager_reason,
                                           resolve_compile)
from fxpipe.runtime.local_ranks import run_ranks

try:
    import test_tensor_parallel as tp
    from tolerances import bound
except ImportError:  # tests/ collected as a package
    from tests import test_tensor_parallel as tp
    from tests.tolerances import bound

pytest.importorskip("transformers")
CPU = torch.device("cpu")

#: (model, pipeline, data, tensor, schedule, sequence parallel, precision, lever)
CASES = [("gpt", 2, 2, 1, "1f1b", False, "fp32", "full"),
         ("gpt2", 2, 1, 2, "zb-v", False, "fp32", "offload")]


def _compiled_plan(case) -> dict:
    plan = tp._plan(*case)
    plan["spec"]["train"]["compile"] = "stages"
    return plan


def inductor_bound(magnitude: float, batch: int, model: nn.Module) -> float:
    """What inductor's code may add to the float32 reordering of tests/tolerances.py: it
    reorders the sums of every reduction it generates (a norm, a softmax, the loss over the
    widest dimension it reduces: at most the model's largest dimension ``widest``, the
    vocabulary here) and replaces each pointwise op's ATen kernel by its own vectorised one
    (up to an ulp per op: ``ops``, the ops of one forward and backward, bounds how many a
    value passes). So the terms whose order or rounding may differ are the batch's samples
    plus ``widest`` plus ``ops``, over the steps."""
    widest = max(max(p.shape) for p in model.parameters())
    ops = 8 * sum(1 for _ in model.modules())  # a module's forward + backward: a few ops
    return bound(magnitude, batch + widest + ops, tp.STEPS)


def _worker(rank: int, cases: list) -> list:
    results = []
    for case in cases:
        before = compile_counters()
        pipe = fxpipe.compile(tp._build(case[0]), Plan.from_dict(_compiled_plan(case)))
        opt = torch.optim.SGD(pipe.parameters(), lr=tp.LR, momentum=0.9)
        losses, graphs = [], []
        for step in range(tp.STEPS):
            losses.append(pipe.step(*tp._batch(case[0], step)))
            pipe.clip_grad_norm_(tp.CLIP)
            opt.step()
            pipe.zero_grad()
            graphs.append(compile_counters()["graphs"] - before["graphs"])
        whole = pipe.state_dict()
        results.append({"losses": losses, "graphs": graphs,
                        "compiled": list(pipe.executor.compiled.compiled),
                        "eager": dict(pipe.executor.compiled.eager),
                        "params": {k: v.numpy().copy() for k, v in whole.items()}})
    return results


@pytest.fixture(scope="module")
def world4():
    return run_ranks(_worker, 4, CASES, timeout_s=400, dist_timeout_s=120)


@pytest.mark.distributed
@pytest.mark.parametrize("i", range(len(CASES)), ids=["-".join(map(str, c[:5])) + c[7]
                                                      for c in CASES])
def test_compiled_stages_train_like_one_process(world4, i):
    case = CASES[i]
    name = case[0]
    ref_losses, ref_params, _ = tp.reference(name)
    model = tp._build(name)
    batch = tp.GPT_B if name == "gpt" else tp.zoo.B
    loss_tol = inductor_bound(max(abs(x) for x in ref_losses), batch, model)
    param_tol = inductor_bound(max(float(p.abs().max()) for p in ref_params.values()), batch,
                               model)
    rows = [r[i] for r in world4]
    for r in rows:
        assert r["compiled"] and not r["eager"], r  # every stage of every rank compiled
        worst = max(abs(a - b) for a, b in zip(r["losses"], ref_losses))
        assert worst < loss_tol, (case, r["losses"], ref_losses, loss_tol)
    params = {}
    for r in rows:
        params.update({n: v for n, v in r["params"].items() if n in ref_params})
    assert params, case
    worst = max(float(abs(torch.from_numpy(v) - ref_params[n]).max()) for n, v in params.items())
    assert worst < param_tol, (case, worst, param_tol)


@pytest.mark.distributed
def test_no_stage_recompiles_after_the_first_step(world4):
    for rank, rows in enumerate(world4):
        for case, r in zip(CASES, rows):
            first, *later = r["graphs"]
            assert first > 0, (rank, case)  # compiled in the first step
            assert later == [first] * len(later), (rank, case, r["graphs"])


class _Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.b(nn.functional.gelu(self.a(x)))


def test_a_split_backward_runs_each_compiled_region_once():
    torch.manual_seed(0)
    net, ref = _Mlp(), _Mlp()
    ref.load_state_dict(net.state_dict())
    net.compile(dynamic=False)
    x = torch.randn(4, 8, requires_grad=True)
    y = net(x)
    assert type(y.grad_fn).__name__ == "CompiledFunctionBackward"  # one compiled region
    calls = []
    y.grad_fn.register_prehook(lambda g: calls.append(1))
    g = torch.randn_like(y)
    (gx,), work = backward_input([y], [g], [x], list(net.parameters()))
    backward_weight(work)
    assert len(calls) == 1 and not work.reenter  # W took B's weight gradients
    x2 = x.detach().requires_grad_()
    ref(x2).backward(g)
    # one 16-term and one 4-term sum per entry, reordered by inductor: a few float32 ulps
    tol = bound(1.0, 16 + 4, 1)
    assert torch.allclose(gx, x2.grad, rtol=0, atol=tol * float(x2.grad.abs().max()))
    for p, q in zip(net.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=0, atol=tol * float(q.grad.abs().max()) + 1e-12)


def test_compile_settings_resolve_or_say_why(monkeypatch):
    assert not resolve_compile("auto", False, CPU).on  # CPU: eager under auto
    assert resolve_compile("none", False, CPU).note.startswith("stages run eagerly")
    if compile_problem(CPU) is None:
        assert resolve_compile("stages", False, CPU).on
    with pytest.raises(UsageError, match="cuda_graphs: true needs a CUDA device"):
        resolve_compile("stages", True, CPU)
    with pytest.raises(UsageError, match="compile is none"):
        resolve_compile("none", True, torch.device("cuda"))
    from torch._inductor import config

    monkeypatch.setattr(config.cpp, "cxx", ("no-such-compiler++",))
    problem = compile_problem(CPU)
    assert problem and "compiler" in problem
    with pytest.raises(UsageError, match="compile: stages cannot compile here"):
        resolve_compile("stages", False, CPU)


def test_levers_that_stay_eager_say_why():
    plan = Plan.from_dict(tp._plan("gpt", 2, 1, 2, "zb-v", False, "fp32", "selective"))
    assert "selective" in eager_reason(plan.stages[0], False)
    plan = Plan.from_dict(tp._plan("gpt", 2, 1, 2, "zb-h1", True, "fp32", "partial"))
    assert "partial" in eager_reason(plan.stages[0], False)
    plain = Plan.from_dict(tp._plan("gpt", 2, 1, 2, "1f1b"))
    assert eager_reason(plain.stages[0], False) is None
    assert "per block" in eager_reason(plain.stages[0], True)


def test_auto_runs_a_stage_eagerly_where_its_compilation_fails():
    """``train.compile: auto``: a stage whose compilation raises (here a backend that fails)
    runs eagerly, the reason recorded; under ``stages`` (no ``failed``) the error stops it."""
    from types import SimpleNamespace

    from fxpipe.execution.compiled_stage import CompiledStages
    from fxpipe.runtime.compile_warmup import warm_up

    def broken(gm, example_inputs):
        raise RuntimeError("no kernels today")

    net = _Mlp()
    net.compile(backend=broken)
    x = torch.randn(4, 8)
    done = CompiledStages(compiled=[0])
    one_rank = SimpleNamespace(dp=1)
    with pytest.raises(Exception, match="no kernels today"):
        warm_up({0: net}, lambda s: [x], _no_autocast, one_rank)
    warm_up({0: net}, lambda s: [x], _no_autocast, one_rank,
            failed=lambda s, e: done.uncompile(s, net, f"compiling it failed ({e})"))
    assert done.compiled == [] and "no kernels today" in done.eager[0]
    ref = _Mlp()
    ref.load_state_dict(net.state_dict())
    assert torch.equal(net(x), ref(x))  # eager now


def _no_autocast():
    return torch.autocast("cpu", enabled=False)


def test_cuda_graphs_off_cuda_or_uncompiled_is_refused_with_the_spec():
    from fxpipe.errors import SpecError

    spec = {"model": {"factory": "shared_models:tiny_gpt"},
            "data": {"batch_size": 8, "seq_len": 16},
            "parallel": {"pipeline": 2, "data": 1, "microbatches": 2},
            "cluster": {"devices_per_node": 2},
            "train": {"compile": "stages", "cuda_graphs": True}}
    with pytest.raises(SpecError, match="CUDA graphs need CUDA devices; cluster.device is cpu"):
        fxpipe.load_spec(spec)
    spec["cluster"]["device"] = "cuda"
    spec["train"]["compile"] = "none"
    with pytest.raises(SpecError, match="train.compile is none"):
        fxpipe.load_spec(spec)
    spec["train"]["compile"] = "auto"
    assert fxpipe.load_spec(spec).train.cuda_graphs
