"""Per-block parameter gathering, planner side (``parallel.param_gather``, issue 37 items 2 and
5): the gathers each micro-batch runs priced in F/B/W with the next group's prefetch, the
runtime's peak bytes (:mod:`fxpipe.runtime.block_gather`), spec checks, the search's score
equal to the plan's prediction, and a 175B model at tensor 8 over 124 replicas planned block
by block (what does not fit gathering whole stages)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn

import fxpipe
from fxpipe.errors import FxpipeError, SpecError
from fxpipe.partitioner import layout_search
from fxpipe.partitioner.assemble import assemble, finish_plan
from fxpipe.partitioner.units import PricedUnits
from fxpipe.plans.plan import Plan
from fxpipe.runtime.block_gather import predicted_gathered_peak, predicted_reducing_peak
from fxpipe.schedule.plan_price import predict
from fxpipe.schedule.step_price import StageStep, block_static_bytes, gather_exposure
from fxpipe.specs.loader import load_spec

try:
    from shared_models import tiny_gpt
except ImportError:  # collected as a package
    from tests.shared_models import tiny_gpt


def _step(rows, replay=False) -> StageStep:
    return StageStep(0.0, 0.0, 0.0, gather_rows=[list(map(float, r)) for r in rows],
                     gather_replay=replay)


def test_gathers_are_priced_with_the_next_groups_prefetch():
    # rows [bytes, F, B, W, replay]; a group's gather takes bytes / 10 s, its reduce-scatter
    # bytes / 20 s (e.g. half the wire)
    rows = [[10, 0.5, 1.0, 0.5, 0.5], [30, 2.0, 1.0, 1.0, 2.0], [20, 1.0, 4.0, 2.0, 0.0]]
    g, r = (lambda b: b / 10), (lambda b: b / 20)
    f, b, w = gather_exposure(_step(rows), g, r, split=False)
    # F: G0 + max(0, G1 - F0) + max(0, G2 - F1) = 1 + (3 - 0.5) + 0
    assert f == pytest.approx(1.0 + 2.5)
    # B, last group first: G2; then during group 2's (B+W = 6): G1 = 3 -> 0; during group 1's
    # (2): G0 + R2 = 1 + 1 -> 0; during group 0's (1.5): R1 = 1.5 -> 0; then R0 = 0.5
    assert b == pytest.approx(2.0 + 0.5)
    assert w == 0.0
    # split backward: B gathers only (G2, then G1 during group 2's B, G0 during group 1's),
    # W reduce-scatters every group after computing every weight gradient
    f2, b2, w2 = gather_exposure(_step(rows), g, r, split=True)
    assert (f2, b2) == (pytest.approx(3.5), pytest.approx(2.0 + max(0, 3 - 4) + max(0, 1 - 1)))
    assert w2 == pytest.approx((10 + 30 + 20) / 20)
    # a recomputing stage replays the groups it runs (replay seconds > 0): groups 0 and 1
    _, b3, _ = gather_exposure(_step(rows, replay=True), g, r, split=False)
    assert b3 == pytest.approx(2.5 + 1.0 + (3.0 - 0.5))
    # gathers shorter than the compute they overlap: only the first one shows
    fast = [[1, 5, 5, 5, 0]] * 4
    assert gather_exposure(_step(fast), g, r, False)[:2] == (pytest.approx(0.1),
                                                           pytest.approx(0.1 + 0.05))


def test_block_peak_is_the_runtimes():
    # groups of a multiple of n elements (no padding): the runtime's gathered and reducing
    # terms, its shards ((3 + k) / n: master, two float32 gradient slices, AdamW's 2 moments),
    # the largest group's whole gradients (split: every group's), shared bytes whole x (2 + k)
    n, k = 4, 2.0
    groups = [4096, 16384, 16384, 8192]
    for split in (False, True):
        for wire in (1.0, 0.5):
            got = block_static_bytes(groups, 400.0, n, k, wire, split)
            wired = [int(g * wire) for g in groups]
            want = (predicted_gathered_peak([groups], True)
                    + predicted_reducing_peak([wired], n)
                    + (3 + k) / n * sum(groups) + (2 + k) * 400.0
                    + (sum(groups) if split else max(groups)))
            assert got == pytest.approx(want, rel=1e-12), (split, wire)
    # with many blocks, well below the stage's whole parameters and gradients held as
    # ``stage`` holds them (and the same shards besides)
    many = [4096.0] * 48
    shards = (3 + k) / n * sum(many)
    assert block_static_bytes(many, 0.0, n, k, 1.0, False) - shards < 0.1 * 2 * sum(many)


def _spec(**over) -> dict:
    par = {"pipeline": 2, "data": 2, "microbatches": 4, "schedule": "auto",
           "data_sharding": "full", "param_gather": "block"}
    par.update(over.pop("parallel", {}))
    return {"model": {"factory": "shared_models:tiny_gpt"},
            "data": {"batch_size": 16, "seq_len": 16}, "parallel": par,
            "cluster": {"nodes": 2, "devices_per_node": 2, "memory_gb": 4,
                        "device_tflops": 0.02,
                        "links": {"intra_node_GBps": 5, "inter_node_GBps": 0.5}},
            "train": {"optimizer": "adamw", **over}}


@pytest.mark.parametrize("train", [{}, {"activation_recompute": "on"}],
                         ids=["keep", "recompute"])
def test_a_block_plan_is_predicted_as_the_search_scored_it(train, monkeypatch):
    spec = load_spec(_spec(**train))
    model = tiny_gpt()
    x = torch.randint(0, 64, (1, 16))
    scored = []
    real = layout_search.simulate_cut

    def spy(pr, prefix, problem, result, cand, spec_, scale, recompute=None, steps=None):
        res = real(pr, prefix, problem, result, cand, spec_, scale, recompute, steps)
        scored.append((pr, result, cand, res.step_time_s))
        return res

    monkeypatch.setattr(layout_search, "simulate_cut", spy)
    units = PricedUnits(model, (x,), {}, spec)
    best = layout_search.search_layouts(lambda t: units.at(2, t), spec, prune=False)[0]
    # the explanation prices the chosen layout gathering whole stages once (what forcing
    # block costs against it); everything the search ranked gathers block by block
    whole = [c for _, _, c, _ in scored if c.gather != "block"]
    assert len(whole) == 1 and (whole[0].pipeline, whole[0].dp, whole[0].schedule) == (
        best.pipeline, best.dp, best.schedule)
    scored = [s for s in scored if s[2].gather == "block"]
    assert all(c.gather == "block" and c.sharding == "full" for _, _, c, _ in scored)
    schedules = {c.schedule for _, _, c, _ in scored}
    assert {"1f1b", "zb-h1"} <= schedules  # a whole backward and a split one
    for pr, result, cand, score in scored:
        mine = dataclasses.replace(pr, traced=dataclasses.replace(
            pr.traced, gm=copy.deepcopy(pr.traced.gm)))
        mine.table = pr.table
        plan = assemble(mine, result, cand, spec, 2, [])
        finish_plan(plan, mine, spec, model, {}, "cpu")
        assert plan.predicted.step_time_s == pytest.approx(score, rel=1e-12, abs=0), cand.label()
        assert all(st.param_gather == "block" and st.gather_groups for st in plan.stages)
        again = Plan.from_dict(plan.to_dict())  # plan.json keeps the gathering
        assert [(s.param_gather, s.gather_groups) for s in again.stages] == \
            [(s.param_gather, s.gather_groups) for s in plan.stages]
        assert predict(again).step_time_s == plan.predicted.step_time_s
        if train:
            assert all(st.recompute for st in plan.stages)
    # the gathers' lower bound prunes nothing the exhaustive search would pick
    assert layout_search.search_layouts(lambda t: units.at(2, t), spec)[0] == best


def test_gathering_blocks_costs_time_where_the_stage_fits_whole():
    # plenty of memory: the same layout gathering whole stages, once per step, is faster
    # than gathering every block in every micro-batch's forward and backward
    def planned(gather):
        spec = _spec(parallel={"schedule": "1f1b", "param_gather": gather})
        return fxpipe.plan(tiny_gpt(), spec, torch.randint(0, 64, (1, 16)))

    block, stage = planned("block"), planned("stage")
    assert [s.param_gather for s in block.stages] == ["block"] * 2
    assert [s.param_gather for s in stage.stages] == ["stage"] * 2
    assert block.predicted.step_time_s > stage.predicted.step_time_s
    auto = planned("auto")  # weighed only where whole stages need recomputation: not here
    assert [s.param_gather for s in auto.stages] == ["stage"] * 2
    assert any("param_gather: block not tried" in line for line in auto.explain)


class _Flat(nn.Module):
    """No module list: no block structure."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def test_bad_param_gather_is_one_clear_line():
    base = _spec()
    for par, words in (({"data_sharding": "optimizer"}, "only data_sharding: full"),
                       ({"data": 1, "pipeline": 4}, "parallel.data is 1")):
        with pytest.raises(SpecError) as e:
            load_spec({**base, "parallel": {**base["parallel"], **par}})
        assert "param_gather" in str(e.value) and words in str(e.value)
    spec = {"model": {"factory": "x:y"}, "data": {"batch_size": 8},
            "parallel": {"pipeline": 1, "data": 2, "microbatches": 2, "schedule": "1f1b",
                         "data_sharding": "full", "param_gather": "block"},
            "cluster": {"devices_per_node": 2, "memory_gb": 4},
            "train": {"optimizer": "adamw", "loss": "mse"}}
    with pytest.raises(FxpipeError) as e:
        fxpipe.plan(_Flat(), spec, torch.zeros(4, 8))
    text = str(e.value)
    assert "no block structure" in text and len(text.splitlines()) == 1
    spec["parallel"]["param_gather"] = "auto"  # weighs whole stages only: plans
    assert fxpipe.plan(_Flat(), spec, torch.zeros(4, 8)).stages[0].param_gather == "stage"


def test_175b_at_tensor_8_over_124_replicas_gathers_block_by_block():
    """OPT-175B's layout (Megatron tensor 8 and FSDP over 124 replicas of 8 A100-80GB): whole
    stages (2 x 22B parameters x 4 bytes on every rank) cannot fit; block by block it does."""
    from fxpipe.examples.gpt import CharGPT

    shape = dict(vocab_size=51200, block_size=2048, n_head=96, n_embd=12288, n_layer=96,
                 fused_attention=False)
    with torch.device("meta"):
        model = CharGPT(**shape)
    spec = {"model": {"factory": "fxpipe.examples.gpt:CharGPT", "args": shape},
            "data": {"batch_size": 992, "seq_len": 2048},
            "parallel": {"pipeline": 1, "data": 124, "tensor": 8, "microbatches": "auto",
                         "schedule": "1f1b", "data_sharding": "full"},
            "cluster": {"nodes": 124, "devices_per_node": 8, "gpu": "A100-80GB",
                        "attention": "math"},
            "train": {"optimizer": "adamw", "precision": "bf16"}}
    plan = fxpipe.plan(model, spec, torch.zeros(1, 2048, dtype=torch.long, device="meta"))
    (st,) = plan.stages
    assert (plan.tensor, plan.pipeline, plan.dp, plan.data_sharding) == (8, 1, 124, "full")
    assert st.param_gather == "block" and len(st.gather_groups) >= 96
    assert plan.predicted.peak_memory_bytes[0] <= 80e9
    note = next(line for line in plan.explain if line.startswith("param_gather: block"))
    assert "shard=full does not fit" in note
    assert st.param_bytes > 80e9  # a rank's whole parameters alone exceed the device
