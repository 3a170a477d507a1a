"""Selective recomputation above the ridge point (issue 36): where what selective recomputation
keeps at the device's ridge point does not fit a stage's rank, the planner weighs keep
thresholds above it (recomputing the ops with the least FLOPs per byte kept first) before full
or partial recomputation, prices them exactly, records each stage's threshold in the plan and
says what it bought; the runtime keeps exactly the ops that reach a stage's threshold."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpipe.execution.selective as selective
from fxpipe.plans.plan import StagePlan
from fxpipe.plans.values import ValueInfo
from fxpipe.runtime.stage import StageWork

try:
    from shared_models import planned_chargpt as _plan
except ImportError:  # tests/ collected as a package
    from tests.shared_models import planned_chargpt as _plan

#: the default CPU device's ridge point: 0.05 TFLOP/s over 20 GB/s
RIDGE = 0.05e12 / 20e9
#: what the plan's explanation prints its step times with (ms, two decimals)
PRINTED_MS = 0.005


def _ms(line: str, before: str) -> float:
    return float(line.split(before)[1].split(" ms/step")[0].replace(",", ""))


def test_a_tight_device_recomputes_more_ops_selectively_before_recomputing_fully():
    """16 MB per device: stage 0's rank (8 micro-batches in flight under 1F1B) does not hold
    what selective recomputation keeps at the ridge point. ``auto`` keeps only the ops above a
    higher threshold there (the other stage keeps everything), which is faster than full
    recomputation of the same layout; the plan records the threshold per stage, the
    explanation names it and what recomputing fully would cost, and the search's score is the
    plan's prediction."""
    auto = _plan("auto", 0.016)
    above = [st for st in auto.stages if st.recompute_mode == "selective"
             and st.keep_ridge > RIDGE * (1 + 1e-9)]
    assert [st.index for st in above] == [0], [(s.recompute_mode, s.keep_ridge)
                                               for s in auto.stages]
    t = above[0].keep_ridge
    full = _plan("full", 0.016)
    assert auto.predicted.step_time_s < full.predicted.step_time_s
    notes = [x for x in auto.explain if x.startswith("selective recomputation on stage 0:")]
    assert len(notes) == 1 and f"reach {t:.3g} FLOP per byte of output" in notes[0]
    assert f"the device's ridge point, {RIDGE:.3g})" in notes[0]
    bought = next(x for x in auto.explain
                  if x.startswith("selective recomputation above the ridge point"))
    assert f"{t:.3g} FLOP per byte" in bought
    assert _ms(bought, "would take ") > auto.predicted.step_time_s * 1e3
    score = float(next(x for x in auto.explain if x.lstrip().startswith("1. "))
                  .split()[-2].replace(",", ""))
    assert score == pytest.approx(auto.predicted.step_time_s * 1e3, abs=PRINTED_MS)


def test_folded_blocks_keep_a_threshold_per_stage_and_selective_asked_stays_selective():
    """A model planned as repeated blocks (8 layers), ``selective`` asked on a device where
    the first stage's rank holds what the ridge point keeps for only some of its blocks: the
    first stage recomputes above the ridge point, the second (fewer micro-batches in flight)
    at it, and the explanation gives each stage's threshold on its own line."""
    plan = _plan("selective", 0.025, n_layer=8)
    assert plan.folded is not None
    modes = [st.recompute_mode for st in plan.stages]
    ridges = [st.keep_ridge for st in plan.stages]
    assert modes == ["selective", "selective"], modes
    assert ridges[0] > RIDGE * (1 + 1e-9) and ridges[1] == pytest.approx(RIDGE), ridges
    assert plan.stages[0].activation_bytes < plan.stages[1].activation_bytes
    assert any(x.startswith("selective recomputation on stage 0:")
               and f"reach {ridges[0]:.3g} FLOP per byte" in x for x in plan.explain)
    assert any(x.startswith("selective recomputation on stage 1:")
               and f"the device's ridge point ({RIDGE:.3g} FLOP per byte" in x
               for x in plan.explain)


B, D = 8, 16


class TwoWidths(nn.Module):
    """A linear layer of input width D (FLOPs per fp32 output byte D / 2 = 8) and one of input
    width 4D (32); counts its forwards."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return (self.b(F.dropout(F.gelu(self.a(x)), 0.2, training=True)),)


def _run(keep_ridge: float | None, recompute: bool) -> dict:
    torch.manual_seed(0)
    mod = TwoWidths()
    sp = StagePlan(index=0, nodes=[], params=[], buffers=[], inputs=["x"], outputs=["y"],
                   fwd_flops=0, bwd_flops=0, bwd_weight_flops=0, param_bytes=0,
                   activation_bytes=0, recv_bytes=0, send_bytes=0, compute_time_s=0,
                   comm_time_s=0, time_s=0, memory_bytes=0, recompute=recompute,
                   keep_ridge=keep_ridge)
    values = {"y": ValueInfo("y", 0, [], [B, D], "float32", B * D * 4)}
    work = StageWork(sp, mod, values, {}, False, contextlib.nullcontext,
                     lambda i: f"micro-batch {i}", loss_input="y")
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(B, D, generator=g).requires_grad_() for _ in range(2)]
    target = torch.randn(B, D, generator=g)
    torch.manual_seed(7)
    for i, x in enumerate(xs):
        work.forward(i, [x], F.mse_loss, target)
    grads = [work.backward(i)[0][1] for i in range(2)]
    return dict(calls=mod.calls, in_grads=grads,
                grads=[p.grad.clone() for p in mod.parameters()])


def test_a_stage_above_the_ridge_keeps_only_the_ops_that_reach_it_and_is_exact(monkeypatch):
    """A stage whose keep threshold (16 FLOP per byte) is between its two linear layers'
    (8 and 32): the runtime keeps the wide one's output, runs the narrow one again before B
    (with the first forward's dropout mask), and its gradients are those of a stage that
    keeps everything, bit for bit."""
    seen: list[tuple[int, bool]] = []

    def recording(func, args, kwargs, out, ridge):
        kept = keeps_op(func, args, kwargs, out, ridge)
        if func is torch.ops.aten.addmm.default:
            seen.append((int(args[1].shape[-1]), kept))
        return kept

    keeps_op = selective.keeps_op
    monkeypatch.setattr(selective, "keeps_op", recording)
    ref = _run(None, False)
    got = _run(16.0, True)
    assert got["calls"] == 4 and ref["calls"] == 2  # each micro-batch's forward ran again
    assert set(seen) == {(D, False), (4 * D, True)}, seen
    for a, b in zip(ref["in_grads"] + ref["grads"], got["in_grads"] + got["grads"]):
        assert torch.equal(a, b)
