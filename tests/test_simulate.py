"""Simulator against closed forms, the timeline writer, and predict(plan) (pure Python)."""

from __future__ import annotations

import json

import pytest

from fxpipe.errors import ScheduleError
from fxpipe.plans.plan import Plan, Predicted, StagePlan
from fxpipe.plans.values import ValueInfo
from fxpipe.schedule.actions import Op
from fxpipe.schedule.lowering import build_schedule
from fxpipe.schedule.plan_price import predict, simulate_plan
from fxpipe.specs.loader import load_spec
from fxpipe.schedule.simulate import Links, StageCosts, simulate
from fxpipe.schedule.timeline import action_label, chrome_trace, write_chrome_trace

PM = [(p, m) for p in (1, 2, 3, 4) for m in (1, 2, 3, 4, 8)]


def _uniform(sched, f=1.0, b=1.0, w=0.0):
    return simulate(sched, StageCosts.uniform(sched.num_stages, f, b, w))


# ----------------------------------------------------------------------------- closed forms
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_1f1b_bubble_closed_form(name):
    for p, m in PM:
        r = _uniform(build_schedule(name, p, m))
        assert r.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12), (p, m)
        assert r.step_time_s == pytest.approx(2 * (m + p - 1))
        assert r.busy_s == pytest.approx([2.0 * m] * p)


def test_peak_inflight_gpipe_m_1f1b_p_minus_s():
    for p, m in PM:
        assert _uniform(build_schedule("gpipe", p, m)).peak_inflight == [m] * p
        want = [min(p - s, m) for s in range(p)]
        assert _uniform(build_schedule("1f1b", p, m)).peak_inflight == want


def test_interleaved_bubble_about_one_over_v():
    # Same model: each of the v chunks costs 1/v of a 1F1B stage. Closed form of the bubble
    # fraction: (p-1)/(v m + p - 1) (Narayanan et al.: bubble time (p-1)/v stage-passes). Its
    # ratio to 1F1B's, (m+p-1)/(v m+p-1), exceeds 1/v by (p-1)(v-1)/(v(v m+p-1)) <= (p-1)/(v m).
    for p in (2, 3, 4):
        for v in (2, 3):
            for m in (p, 2 * p, 4 * p):
                r = _uniform(build_schedule("interleaved", p, m, v), 1 / v, 1 / v)
                assert r.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-9)
                ratio = r.bubble_fraction / ((p - 1) / (m + p - 1))
                assert 1 / v <= ratio + 1e-12 <= 1 / v + (p - 1) / (v * m) + 1e-12


def test_zb_h1_bubble_is_a_third_of_1f1b():
    for p in (2, 3, 4):
        for m in (p, 2 * p, 3 * p + 1):
            zb = _uniform(build_schedule("zb-h1", p, m), 1, 1, 1)
            ob = _uniform(build_schedule("1f1b", p, m), 1, 1, 1)  # B = b + w = 2
            idle_zb = [zb.step_time_s - b for b in zb.busy_s]
            idle_ob = [ob.step_time_s - b for b in ob.busy_s]
            # per-rank idle seconds: (p-1)(F+B-W) vs (p-1)(F+B+W) -> exactly one third
            assert idle_zb == pytest.approx([(p - 1) * 1.0] * p)
            assert idle_ob == pytest.approx([(p - 1) * 3.0] * p)
            assert zb.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1))
            # 1F1B's peak memory: p micro-batches held (F done, W not) on every stage
            assert max(zb.peak_inflight) == p


def test_zb_h1_general_costs():
    # (p-1)(T_F + T_B - T_W) idle per rank holds whenever T_W <= T_F and T_W <= T_B
    p, m = 4, 8
    r = simulate(build_schedule("zb-h1", p, m), StageCosts.uniform(p, 2.0, 1.0, 0.5))
    assert [r.step_time_s - b for b in r.busy_s] == pytest.approx([(p - 1) * 2.5] * p)


def test_zb_v_nearly_zero_bubble():
    for p in (2, 3, 4):
        for m in (2 * p, 4 * p):
            zv = _uniform(build_schedule("zb-v", p, m, 2), 1, 1, 1)
            zh = simulate(build_schedule("zb-h1", p, m), StageCosts.uniform(p, 2, 2, 2))
            work = 6 * m  # 2 stages x (F + B + W) per micro-batch on every rank
            assert zv.busy_s == pytest.approx([work] * p)
            # rank p-1 cannot start before p-1 forwards: step >= work + p - 1; we stay within 2
            assert work + p - 1 <= zv.step_time_s <= work + p + 1
            assert zv.bubble_fraction < zh.bubble_fraction


def test_single_rank_has_no_bubble():
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 3), ("zb-h1", 1), ("zb-v", 2)):
        r = _uniform(build_schedule(name, 1, 5, v), 1, 1, 1)
        assert r.bubble_fraction == pytest.approx(0.0)
        assert r.step_time_s == pytest.approx(v * 5 * 3)


# ----------------------------------------------------------------------------- communication
def test_p2p_latency_and_bandwidth():
    # GPipe p=2, m=1: F0 | send | F1 B1 | send | B0: 4 compute seconds + 2 transfers
    s = build_schedule("gpipe", 2, 1)
    links = Links(p2p_GBps=2.0, latency_s=0.25)
    r = simulate(s, StageCosts.uniform(2), {(0, 1): 1e9}, links)
    xfer = 0.25 + 1e9 / 2e9
    assert r.step_time_s == pytest.approx(4 + 2 * xfer)
    # gradients may be smaller than the forward values (e.g. integer values carry no gradient)
    r2 = simulate(s, StageCosts.uniform(2), {(0, 1): 1e9}, links, grad_edge_bytes={(0, 1): 0})
    assert r2.step_time_s == pytest.approx(4 + xfer + 0.25)


def test_sends_on_one_link_serialise():
    s = build_schedule("gpipe", 2, 2)
    r = simulate(s, StageCosts.uniform(2, 0.0, 0.0), {(0, 1): 1e9}, Links(p2p_GBps=1.0))
    # two 1 s forward transfers back to back, then two 1 s gradient transfers back to back
    assert r.step_time_s == pytest.approx(4.0)


def test_send_cost_occupies_the_sender():
    # GPipe, F = B = 1, zero latency, each SEND costs its sender c seconds. Forward: ranks
    # 0..p-2 run F + SEND (1 + c) per micro-batch, so the last rank starts micro-batch i at
    # (p-1+i)(1+c) and ends its forwards at (m+p-2)(1+c) + 1; its m backwards + sends take
    # m(1+c); the last micro-batch's gradient then passes p-2 middle ranks (B + SEND each) and
    # rank 0's B. Step = 2(m+p-2)(1+c) + 2 (c = 0: the usual 2(m+p-1)).
    c = 0.3
    for p in (2, 3, 4):
        for m in (1, 2, 3, 4):
            s = build_schedule("gpipe", p, m)
            r = simulate(s, StageCosts.uniform(p, 1.0, 1.0, send=c))
            step = 2 * (m + p - 2) * (1 + c) + 2
            assert r.step_time_s == pytest.approx(step), (p, m)
            assert r.busy_s == pytest.approx([2.0 * m] * p)  # send seconds are not busy
            assert r.bubble_fraction == pytest.approx(1 - 2 * m / step)
            free = simulate(s, StageCosts.uniform(p, 1.0, 1.0))
            assert r.step_time_s - free.step_time_s == pytest.approx(2 * (m + p - 2) * c)
    # the sender-side seconds are an event on the rank's main lane, the transfer follows them
    s = build_schedule("gpipe", 2, 1)
    links = Links(p2p_GBps=2.0, latency_s=0.25)
    r = simulate(s, StageCosts([1.0] * 2, [1.0] * 2, [0.0] * 2, send_s=[0.5, 0.125]),
                 {(0, 1): 1e9}, links)
    xfer = 0.25 + 1e9 / 2e9
    assert r.step_time_s == pytest.approx(4 + 2 * xfer + 0.5 + 0.125)  # per-stage costs
    main = [e for e in r.events if e.name == "SEND_F0 s0->1" and e.lane == "compute"]
    comm = [e for e in r.events if e.name == "SEND_F0 s0->1" and e.lane == "comm"]
    assert [(e.start_s, e.end_s) for e in main] == [(1.0, 1.5)]
    assert comm[0].start_s == pytest.approx(1.5) and comm[0].end_s == pytest.approx(1.5 + xfer)
    # None and zeros are the same (free sends, no main-lane send events)
    base = simulate(s, StageCosts.uniform(2), {(0, 1): 1e9}, links)
    assert base.step_time_s == pytest.approx(4 + 2 * xfer)
    assert not [e for e in base.events if e.name.startswith("SEND") and e.lane == "compute"]


def test_allreduce_overlaps_but_step_waits():
    s = build_schedule("gpipe", 2, 1)
    links = Links(p2p_GBps=1e9, dp_GBps=1.0)
    nbytes = 3e9
    r = simulate(s, StageCosts.uniform(2), None, links, dp=4, allreduce_bytes=[nbytes, nbytes])
    ar = 2 * 3 / 4 * nbytes / 1e9  # ring: 2(n-1)/n x bytes / bandwidth
    # rank 1 finishes its B at 3 and all-reduces while rank 0 still runs B0 (ends at 4)
    assert r.step_time_s == pytest.approx(4 + ar)
    ev = {(e.rank, e.name): e for e in r.events}
    assert ev[(1, "ALLREDUCE s1")].start_s == pytest.approx(3.0)
    assert ev[(1, "ALLREDUCE s1")].lane == "comm"
    assert ev[(0, "STEP")].end_s == pytest.approx(4 + ar)
    assert Links().allreduce_seconds(1e9, 1) == 0.0


def test_skip_edge_p3_simulates_with_transfer_wait():
    edges = {(0, 1): 0, (1, 2): 0, (0, 2): 5e9}
    for name in ("gpipe", "1f1b", "zb-h1"):
        s = build_schedule(name, 3, 4, edges=set(edges))
        r = simulate(s, StageCosts.uniform(3, 1, 1, 1), edges, Links(p2p_GBps=1.0))
        free = {e: 0 for e in edges}
        base = simulate(s, StageCosts.uniform(3, 1, 1, 1), free, Links(p2p_GBps=1.0))
        assert r.step_time_s > base.step_time_s
        waits = [e for e in r.events if e.name.startswith("RECV_F0 s2<-0")]
        assert len(waits) == 1 and waits[0].end_s == pytest.approx(6.0)  # F0 s0 ends at 1, +5 s


def test_memory_per_stage():
    s = build_schedule("1f1b", 3, 6)
    c = StageCosts([1.0] * 3, [1.0] * 3, [0.0] * 3, activation_bytes=[100, 200, 300],
                   static_bytes=[10, 20, 30])
    r = simulate(s, c)
    assert r.peak_memory_bytes == [3 * 100 + 10, 2 * 200 + 20, 1 * 300 + 30]


def test_simulator_rejects_bad_input():
    s = build_schedule("1f1b", 2, 2)
    with pytest.raises(ScheduleError, match="fwd_s has 3 entries but the schedule has 2 stages"):
        simulate(s, StageCosts.uniform(3))
    with pytest.raises(ScheduleError, match="send_s has 1 entries but the schedule has 2"):
        simulate(s, StageCosts([1.0] * 2, [1.0] * 2, [0.0] * 2, send_s=[0.1]))
    with pytest.raises(ScheduleError, match="send_s has a negative entry"):
        simulate(s, StageCosts.uniform(2, send=-0.1))
    with pytest.raises(ScheduleError, match="step_s is negative"):
        simulate(s, StageCosts([1.0] * 2, [1.0] * 2, [0.0] * 2, step_s=-1.0))
    s.actions[0].insert(0, s.actions[0].pop([a.op for a in s.actions[0]].index(Op.RECV_B)))
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(s, StageCosts.uniform(2))  # via the validator
    with pytest.raises(ScheduleError, match="deadlock in simulation: rank 0 waits at 0RECV_B0@1"):
        simulate(s, StageCosts.uniform(2), check=False)


# ----------------------------------------------------------------------------- timeline
def test_chrome_trace_one_track_per_rank(tmp_path):
    r = _uniform(build_schedule("1f1b", 2, 2))
    path = write_chrome_trace(r.events, tmp_path / "sub" / "trace.json", process_name="sim")
    data = json.loads(path.read_text())
    xs = [e for e in data["traceEvents"] if e["ph"] == "X"]
    names = {(e["pid"], e["name"]) for e in xs}
    assert (0, "F0 s0") in names and (1, "B1 s1") in names
    f1 = next(e for e in xs if e["pid"] == 1 and e["name"] == "F0 s1")
    assert f1["ts"] == pytest.approx(1e6) and f1["dur"] == pytest.approx(1e6)  # microseconds
    procs = {e["pid"]: e["args"]["name"] for e in data["traceEvents"]
             if e["name"] == "process_name"}
    assert procs == {0: "sim rank 0", 1: "sim rank 1"}
    # measured timelines: plain 4-tuples from wall-clock seconds work the same
    d = chrome_trace([(0, "F0 s0", 10.0, 10.5)], rank_offset=100)
    assert d["traceEvents"][-1]["pid"] == 100 and d["traceEvents"][-1]["dur"] == pytest.approx(5e5)
    with pytest.raises(ValueError, match="ends before it starts"):
        chrome_trace([(0, "F0 s0", 2.0, 1.0)])


def test_action_labels():
    s = build_schedule("1f1b", 2, 1)
    labels = [action_label(a) for a in s.actions[1]]
    assert labels == ["RECV_F0 s1<-0", "F0 s1", "B0 s1", "SEND_B0 s1->0", "ALLREDUCE s1", "STEP"]


# ----------------------------------------------------------------------------- plan
def _stage(i: int, **kw) -> StagePlan:
    d = dict(index=i, nodes=[f"n{i}"], params=[f"w{i}"], buffers=[], inputs=[], outputs=[],
             fwd_flops=1.0, bwd_flops=2.0, bwd_weight_flops=1.0, param_bytes=1000,
             activation_bytes=50, recv_bytes=0, send_bytes=0, compute_time_s=0.0, comm_time_s=0.0,
             time_s=0.0, memory_bytes=0, fwd_time_s=1.0, bwd_input_time_s=1.0,
             bwd_weight_time_s=1.0)
    d.update(kw)
    return StagePlan(**d)


def _plan(schedule="1f1b", dp=1, m=4) -> Plan:
    vals = {
        "x": ValueInfo("x", -1, [0, 2], [2, 4], "int64", 64),
        "h0": ValueInfo("h0", 0, [1, 2], [2, 4], "float32", 32),  # skip edge 0 -> 2
        "h1": ValueInfo("h1", 1, [2], [2, 4], "float32", 32),
        "mask": ValueInfo("mask", 0, [1], [2, 4], "bool", 8),  # no gradient
    }
    return Plan(model="toy", num_stages=3, pipeline=3, dp=dp, microbatches=m, schedule=schedule,
                virtual_stages=1, microbatch_size=2, stages=[_stage(i) for i in range(3)],
                values=vals, model_inputs=["x"], model_output="h2",
                spec=load_spec({"model": {"factory": "x:y"}, "train": {"optimizer": "sgd"},
                                "parallel": {"pipeline": 3, "data": dp, "microbatches": m},
                                "data": {"batch_size": 2 * dp * m},
                                "cluster": {"devices_per_node": 3 * dp,
                                            "links": {"intra_node_GBps": 1e-6,
                                                      "latency_s": 0.0}}}))


def test_predict_from_plan():
    plan = _plan()
    res = simulate_plan(plan)
    # 40 bytes forward on (0, 1) at 1000 B/s = 0.04 s, gradients only 32 bytes
    recv = next(e for e in res.events if e.name == "RECV_F0 s1<-0")
    assert recv.end_s == pytest.approx(1.0 + 0.04)
    pred = predict(plan)
    assert isinstance(pred, Predicted)
    assert pred.step_time_s == pytest.approx(res.step_time_s)
    assert pred.peak_inflight == [3, 2, 1]
    assert pred.peak_memory_bytes == [3 * 50 + 2000, 2 * 50 + 2000, 50 + 2000]  # SGD: x2 params
    assert 0 < pred.bubble_fraction < 1
    # other schedules price from the same plan; the interleaved constraint is explained
    assert predict(plan, "zb-h1").step_time_s < predict(plan, "gpipe").step_time_s
    with pytest.raises(ScheduleError, match="divisible by pipeline size"):
        predict(plan, "interleaved")
    # data parallel adds the ring all-reduce at the end
    assert predict(_plan(dp=2)).step_time_s > pred.step_time_s


def test_predict_falls_back_to_compute_time():
    plan = _plan()
    plan.stages = [_stage(i, fwd_time_s=0.0, bwd_input_time_s=0.0, bwd_weight_time_s=0.0,
                          compute_time_s=3.0) for i in range(3)]
    plan.spec = None  # a plan made by hand: the schema's defaults
    r = simulate_plan(plan, links=Links(p2p_GBps=1e9))
    # F = 1, B + W = 2 per stage -> 1F1B closed form
    assert r.step_time_s == pytest.approx(3 * (4 + 3 - 1), rel=1e-6)
