"""What a send costs the sending rank: measured points interpolated (gloo's cost is far from
linear in the size), and gradient sends priced by the gradients a stage sends back (the last
stage of a pipeline sends only those), in the simulator, the search and the plan."""

from __future__ import annotations

import pytest
import torch

from fxpipe.partitioner.profile import SendCost
from fxpipe.schedule.lowering import build_schedule
from fxpipe.schedule.simulate import StageCosts, costs_from_plan, simulate


def test_measured_points_are_interpolated_not_fitted_by_one_line():
    pts = [(4096, 1e-4), (1 << 20, 3e-4), (1 << 24, 30e-3)]
    c = SendCost(2e-3, 5e8, pts)  # the straight line: 2 ms at any small size
    assert c.seconds(0) == 0.0
    assert c.seconds(100) == pytest.approx(1e-4)  # below the smallest: its time
    assert c.seconds(1 << 20) == pytest.approx(3e-4)
    assert 1e-4 < c.seconds(1 << 19) < 3e-4
    assert c.seconds(1 << 25) == pytest.approx(30e-3 + (1 << 24) / 5e8)  # past: the fitted rate
    assert SendCost(2e-3, 5e8).seconds(1e6) == pytest.approx(2e-3 + 1e6 / 5e8)
    back = SendCost(**{k: v for k, v in c.to_dict().items() if k != "points"},
                    points=c.to_dict()["points"])
    assert back.seconds(1 << 19) == c.seconds(1 << 19)


def test_gradient_sends_cost_the_stage_that_sends_them():
    sched = build_schedule("1f1b", 2, 4)
    fwd_only = simulate(sched, StageCosts([1.0] * 2, [1.0] * 2, [0.0] * 2, send_s=[0.1, 0.0]))
    both = simulate(sched, StageCosts([1.0] * 2, [1.0] * 2, [0.0] * 2, send_s=[0.1, 0.0],
                                      grad_send_s=[0.0, 0.1]))
    assert both.step_time_s > fwd_only.step_time_s
    # without grad_send_s, a SEND_B costs send_s (older plans)
    same = simulate(sched, StageCosts([1.0] * 2, [1.0] * 2, [0.0] * 2, send_s=[0.1, 0.1]))
    assert same.step_time_s == pytest.approx(
        simulate(sched, StageCosts([1.0] * 2, [1.0] * 2, [0.0] * 2, send_s=[0.1, 0.1],
                                   grad_send_s=[0.1, 0.1])).step_time_s)


def test_plan_prices_the_last_stage_gradient_send(tmp_path, monkeypatch):
    import fxpipe
    import torch.nn as nn

    monkeypatch.setenv("FXPIPE_CACHE_DIR", str(tmp_path))  # no measured send cost: CPU default
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    spec = {"model": {"factory": "x:y"}, "data": {"batch_size": 16},
            "parallel": {"pipeline": 2, "data": 1, "microbatches": 4, "schedule": "1f1b"},
            "cluster": {"devices_per_node": 2, "device": "cpu"}, "train": {"loss": "mse"}}
    plan = fxpipe.plan(model, spec, (torch.randn(4, 64),))
    first, last = plan.stages
    assert first.send_time_s > 0 and last.send_bytes == 0
    assert last.grad_send_time_s and last.grad_send_time_s > 0
    assert not first.grad_send_time_s  # stage 0 sends no gradient back
    assert costs_from_plan(plan).grad_send_s[1] == last.grad_send_time_s
    again = type(plan).from_dict(plan.to_dict())
    assert again.stages[1].grad_send_time_s == last.grad_send_time_s
