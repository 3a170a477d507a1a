"""What a send costs: measured between two busy ranks, points interpolated (gloo's cost is far
from linear in the size), one message per tensor, and gradient sends priced by the gradients a stage sends back (the last
stage of a pipeline sends only those), in the simulator, the search and the plan."""

from __future__ import annotations

import pytest
import torch

from fxpipe.partitioner.profile import SendCost
from fxpipe.schedule.lowering import build_schedule
from fxpipe.schedule.plan_price import stage_steps
from fxpipe.schedule.simulate import StageCosts, simulate


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
    assert stage_steps(plan)[1].grad_send_s == last.grad_send_time_s
    assert "sends ms" in plan.summary() and "sends ms: one forward send" in plan.summary()
    again = type(plan).from_dict(plan.to_dict())
    assert again.stages[1].grad_send_time_s == last.grad_send_time_s


def test_each_tensor_on_an_edge_is_its_own_message():
    from fxpipe.partitioner.cut_price import edge_send_times

    c = SendCost(1e-3, 1e9)  # 1 ms per message plus 1 ns per byte
    one, two = 1e-3 + 1e-4, 2e-3 + 1e-4
    # stage 0 sends one 100 kB tensor to stage 1 and two 50 kB ones to stage 2: per SEND action,
    # the mean over its edges of the summed messages
    got = edge_send_times({(0, 1): [1e5], (0, 2): [5e4, 5e4], (1, 2): [1e5]}, 3, c)
    assert got == pytest.approx([(one + two) / 2, one, 0.0])


def test_the_cost_of_bigger_messages_never_falls():
    from fxpipe.training.profiling import _non_decreasing

    assert _non_decreasing([3.0, 1.0, 2.0, 5.0, 4.0]) == pytest.approx([2.0, 2.0, 2.0, 4.5, 4.5])
    assert _non_decreasing([1.0, 2.0]) == [1.0, 2.0]


@pytest.mark.distributed
def test_send_cost_is_measured_between_busy_ranks_and_cached(tmp_path, monkeypatch):
    from fxpipe.partitioner.profile import SEND_METHOD, load_send_cost, send_cost_path
    from fxpipe.training.profiling import measure_send_cost

    monkeypatch.setenv("FXPIPE_CACHE_DIR", str(tmp_path))
    cost = measure_send_cost("cpu", sizes=[4096, 1 << 20], iters=4, rounds=2)
    ys = [t for _, t in cost.points]
    assert [b for b, _ in cost.points] == [4096, 1 << 20]
    assert all(t >= 0 for t in ys) and ys == sorted(ys)
    back = load_send_cost("cpu")
    assert back is not None and back.points == cost.points and back.method == SEND_METHOD
    # a cache measured another way (an older fxpipe's idle ping-pong) is not used
    import json

    d = json.loads(send_cost_path("cpu").read_text())
    del d["method"]
    send_cost_path("cpu").write_text(json.dumps(d))
    assert load_send_cost("cpu") is None


@pytest.mark.parametrize("damage", [
    lambda d: "[" * 100_000 + "]" * 100_000,  # nested past the recursion limit
    lambda d: {**d, "points": d["points"] + [[1 << 30, 3600.0]]},  # an hour per message
    lambda d: {**d, "points": d["points"] + [[d["points"][0][0], 5.0]]},  # a size twice
    lambda d: {**d, "points": [[4096, 2e-3], [1 << 20, 1e-3]]},  # bigger costs less
    lambda d: {**d, "rate_Bps": True},
    lambda d: {**d, "rate_Bps": 1e-300},
    lambda d: {**d, "rate_Bps": 10 ** 400},  # past a float
    lambda d: {**d, "points": [[10 ** 400, 1e-3]]},
])
def test_a_damaged_send_cost_cache_is_not_planned_with(tmp_path, monkeypatch, damage):
    import json

    import fxpipe.partitioner.pricing as D
    from fxpipe.partitioner.profile import SEND_METHOD, load_send_cost, send_cost_path
    from fxpipe.specs.loader import load_spec

    monkeypatch.setenv("FXPIPE_CACHE_DIR", str(tmp_path))
    good = SendCost(5e-4, 2e9, [(4096, 5e-4), (1 << 20, 1.5e-3)], SEND_METHOD).to_dict()
    path = send_cost_path("cpu")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(good))
    assert load_send_cost("cpu") is not None
    bad = damage(good)
    path.write_text(bad if isinstance(bad, str) else json.dumps(bad))
    assert load_send_cost("cpu") is None
    spec = load_spec({"model": {"factory": "x:y"}, "data": {"batch_size": 8},
                      "parallel": {"pipeline": 2, "data": 1, "microbatches": 2},
                      "cluster": {"devices_per_node": 2, "costs": "measured"}})
    assert D.send_cost_of(spec).method is None  # the default, not a traceback


def test_analytic_plans_do_not_read_the_measured_send_cost(tmp_path, monkeypatch):
    import json

    import fxpipe.partitioner.pricing as D
    from fxpipe.partitioner.profile import SEND_METHOD, send_cost_path
    from fxpipe.specs.loader import load_spec

    monkeypatch.setenv("FXPIPE_CACHE_DIR", str(tmp_path))
    path = send_cost_path("cpu")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(SendCost(5e-4, 2e9, [(4096, 5e-4)], SEND_METHOD).to_dict()))
    spec = {"model": {"factory": "x:y"}, "data": {"batch_size": 8},
            "parallel": {"pipeline": 2, "data": 1, "microbatches": 2},
            "cluster": {"devices_per_node": 2}}
    assert D.send_cost_of(load_spec(spec)).method is None
    spec["cluster"]["costs"] = "measured"
    assert D.send_cost_of(load_spec(spec)).method == SEND_METHOD
