"""Deeper interleaving chosen by the planner (issue 36, item 3): ``virtual_stages: auto`` (and
``schedule: auto``) weighs 2, 3, 4, ... stages per rank, the bubble against the extra messages,
each depth simulated by the one pricing rule; a fixed depth is planned as given; the runtime
runs deeper schedules exactly (tests/test_schedules_execute.py::test_deeper_interleaving)."""

from __future__ import annotations

import pytest
import torch

import fxpipe
from fxpipe.errors import SpecError
from fxpipe.examples.gpt import CharGPT
from fxpipe.partitioner.search import DEEP_VIRTUAL_STAGES, candidates
from fxpipe.specs.loader import load_spec


def _plan(v, m=4, schedule="interleaved"):
    torch.manual_seed(0)
    with torch.device("meta"):
        model = CharGPT(n_layer=16, n_embd=256, n_head=4, block_size=128)
    spec = {"model": {"factory": "x:y"}, "data": {"batch_size": 16, "seq_len": 128},
            "parallel": {"pipeline": 4, "data": 1, "microbatches": m, "schedule": schedule,
                         "virtual_stages": v},
            "cluster": {"nodes": 1, "devices_per_node": 4}}
    return fxpipe.plan(model, spec, torch.zeros(1, 128, dtype=torch.long, device="meta"))


def test_auto_depth_shortens_the_bubble_where_it_pays_and_says_so():
    # 16 blocks on 4 ranks, 4 micro-batches: the bubble of v = 2 is large
    auto, two = _plan("auto"), _plan(2)
    assert two.virtual_stages == 2 and two.num_stages == 8
    assert auto.virtual_stages > 2 and auto.num_stages == 4 * auto.virtual_stages
    assert auto.predicted.step_time_s < two.predicted.step_time_s
    assert auto.predicted.bubble_fraction < two.predicted.bubble_fraction
    # the plan's prediction is its depth's own plan (a fixed depth plans the same)
    fixed = _plan(auto.virtual_stages)
    assert fixed.predicted.step_time_s == pytest.approx(auto.predicted.step_time_s, rel=1e-12)
    line = next(x for x in auto.explain if x.startswith("interleaving depth"))
    assert f"depth {auto.virtual_stages} stages per rank" in line and "2 ->" in line


def _spec(schedule: str, v) -> dict:
    return {"model": {"factory": "x:y"}, "data": {"batch_size": 16, "seq_len": 8},
            "parallel": {"pipeline": 2, "data": 1, "microbatches": 4, "schedule": schedule,
                         "virtual_stages": v},
            "cluster": {"nodes": 1, "devices_per_node": 2}}


def test_depths_tried_stop_at_the_models_units():
    spec = load_spec(_spec("interleaved", "auto"))
    depths = sorted({c.virtual_stages for c in candidates(spec, max_stages=9)})
    assert depths == [v for v in DEEP_VIRTUAL_STAGES if v <= 4] == [2, 3, 4]
    fixed = load_spec(_spec("interleaved", 3))
    assert {c.virtual_stages for c in candidates(fixed, max_stages=9)} == {3}


def test_virtual_stages_auto_with_another_schedule_is_one_stage_per_rank_and_bad_values_fail():
    spec = load_spec(_spec("1f1b", "auto"))
    assert {c.virtual_stages for c in candidates(spec, max_stages=9)} == {1}
    with pytest.raises(SpecError, match="virtual_stages"):
        load_spec(_spec("interleaved", "deep"))
