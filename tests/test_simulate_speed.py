"""The fast paths of the simulator, the lowering and the ZB-V generator give exactly what the
per-action code gave (pure Python, a few seconds).

* Pinned figures: simulate() results (every float by its bits, the timeline as a digest of its
  events in order) and generated action lists, computed by the per-action simulator and the
  generators as they were before the compiled loop (fxpipe 621a5e8). A change that moves any
  of them fails here.
* Equivalences on random small cases: the compiled loop against the per-action reference loop
  (``_run_reference``, the definition), :class:`LoweredSchedule` against ``add_communication``,
  the incremental ZB-V list scheduler against re-examining every rank for every action.
* The speed-ups themselves: one ``Links.p2p_seconds`` per distinct send, no full schedule built
  for a LoweredSchedule, the garbage collector restored after a schedule is built.
"""

from __future__ import annotations

import gc
import hashlib
import random

import pytest

import fxpipe.schedule.simulate as S
from fxpipe.errors import ScheduleError
from fxpipe.plans.placement import stage_to_rank
from fxpipe.schedule.actions import Action, Op
from fxpipe.schedule.generators import _list_schedule, compute_schedule, one_f_one_b
from fxpipe.schedule.lowering import add_communication, build_schedule, linear_edges
from fxpipe.schedule.simulate import Links, LoweredSchedule, StageCosts, simulate

try:
    from schedule_reference import list_schedule_definition
except ImportError:  # collected as a package
    from tests.schedule_reference import list_schedule_definition


# ----------------------------------------------------------------------------- pinned cases
def _costs(n, k=0):
    """Deterministic, uneven per-stage costs (exact binary fractions and not)."""
    f = [0.1 * (1 + (s * 7 + k) % 5) for s in range(n)]
    b = [0.15 * (1 + (s * 3 + k) % 4) for s in range(n)]
    w = [0.05 * (1 + (s * 5 + k) % 3) for s in range(n)]
    return StageCosts(f, b, w, [1000 * (s + 1) for s in range(n)], [10 ** 6 + s for s in range(n)],
                      step_s=0.01, send_s=[0.001 * (s % 3) for s in range(n)],
                      grad_send_s=[0.002 * ((s + 1) % 2) for s in range(n)])


def _digest(lines) -> str:
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def _events_digest(events) -> str:
    return _digest(f"{e.rank}|{e.name}|{float(e.start_s).hex()}|{float(e.end_s).hex()}|{e.lane}"
                   for e in events)


def _figures(res):
    return {"step": float(res.step_time_s).hex(), "busy": [float(x).hex() for x in res.busy_s],
            "bubble": float(res.bubble_fraction).hex(), "peak": list(res.peak_inflight),
            "memory": list(res.peak_memory_bytes), "events": len(res.events),
            "timeline": _events_digest(res.events)}


def _sim_cases():
    """name -> SimResult, small schedules covering the simulator's paths."""
    out = {}
    # ZB-V (split backward, V placement, same-rank hand-over) with a skip edge, two nodes,
    # data parallel, latency, sender-side send seconds, the timeline
    s = build_schedule("zb-v", 3, 5, 2, {(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (0, 3)},
                       {(1, 2), (2, 3), (3, 4), (4, 5), (0, 3)})
    eb = {(0, 1): 3e6, (1, 2): 2e6, (2, 3): 2.5e6, (3, 4): 1e6, (4, 5): 4e6, (0, 3): 5e5}
    gb = {(1, 2): 1e6, (2, 3): 1.5e6, (3, 4): 7e5, (4, 5): 2e6, (0, 3): 3e5}
    out["zb-v"] = simulate(s, _costs(6), eb, Links.from_cluster(3, 2, 2, 3, 450.0, 12.5, 2e-5),
                           dp=2, allreduce_bytes=[1e8 * (i + 1) for i in range(6)],
                           grad_edge_bytes=gb)
    # interleaved, parameter servers (no all-reduce), no timeline
    s = build_schedule("interleaved", 2, 4, 2)
    lk = Links.from_cluster(2, 2, 2, 2, 100.0, 10.0, 1e-5, "data-inner", servers=2)
    out["interleaved-servers"] = simulate(
        s, _costs(4, 1), {(i, i + 1): 1e6 * (i + 1) for i in range(3)}, lk, dp=2,
        timeline=False, server_bytes=[[2e7, 1e7], [0, 3e7], [5e6, 5e6], [1e7, 0]])
    # 1F1B with per-pair bandwidths and a data-parallel ring
    s = build_schedule("1f1b", 4, 6)
    lk = Links(50.0, 1e-5, 25.0, {(0, 1): 5.0, (2, 3): 1.0}, {1: 2.0}, {})
    out["1f1b-pairs"] = simulate(s, _costs(4, 2), {(i, i + 1): 2e6 for i in range(3)}, lk, dp=3,
                                 allreduce_bytes=[4e7, 0, 1e7, 2e7])
    # GPipe with the defaults (no edges, no links, uniform costs)
    out["gpipe-defaults"] = simulate(build_schedule("gpipe", 3, 2), StageCosts.uniform(3))
    # ZB-H1 without the check, send seconds but no gradient send seconds
    c = _costs(3, 3)
    c.grad_send_s = None
    out["zb-h1-unchecked"] = simulate(build_schedule("zb-h1", 3, 4), c,
                                      {(0, 1): 1e7, (1, 2): 3e7}, Links(12.5, 1e-4),
                                      check=False)
    return out


def _schedule_cases():
    """name -> Schedule (generators and lowering)."""
    return {
        "zb-v 4 9": compute_schedule("zb-v", 4, 9, 2),
        "zb-v 3 5": compute_schedule("zb-v", 3, 5),
        "interleaved 3 6 3": compute_schedule("interleaved", 3, 6, 3),
        "zb-h1 4 5": compute_schedule("zb-h1", 4, 5),
        "list 4 7 uneven": _list_schedule("zb-v", 4, 7, stage_to_rank("zb-v", 4, 8), 8,
                                          0.5, 1.3, 0.7),
        "list loop 3 5": _list_schedule("x", 3, 5, [0, 1, 2, 0, 1, 2], 4, 1.0, 2.0, 0.5),
        "lowered skip": build_schedule("1f1b", 4, 3, 1, {(0, 1), (1, 2), (2, 3), (0, 2), (-1, 3)},
                                       {(1, 2), (2, 3), (0, 2)}),
    }


def _schedule_digest(s) -> str:
    return _digest([f"{s.name} {s.num_ranks} {s.num_stages} {s.microbatches} "
                    f"{s.stage_to_rank} {s.split_backward}", s.format()])


# computed by the per-action simulator and the generators of fxpipe 621a5e8
SIM = {
    "zb-v": {"step": "0x1.4fd96726df381p+3",
             "busy": ["0x1.5fffffffffffep+2", "0x1.1800000000002p+3", "0x1.ffffffffffffdp+2"],
             "bubble": "0x1.2c5fab4a04696p-2",
             "peak": [5, 4, 4, 3, 2, 1],
             "memory": [1005000, 1008001, 1012002, 1012003, 1010004, 1006005],
             "events": 209,
             "timeline": "cb5da0155c4169af"},
    "interleaved-servers": {"step": "0x1.cbce3150dae3ep+2",
                            "busy": ["0x1.7333333333334p+2", "0x1.7333333333333p+2"],
                            "bubble": "0x1.8aa75c2744582p-3",
                            "peak": [4, 3, 2, 1],
                            "memory": [1004000, 1006001, 1006002, 1004003],
                            "events": 0,
                            "timeline": "e3b0c44298fc1c14"},
    "1f1b-pairs": {"step": "0x1.23e85a38a24fap+3",
                   "busy": ["0x1.599999999999ap+2", "0x1.599999999999ap+2",
                            "0x1.3333333333333p+1", "0x1.b99999999999ap+2"],
                   "bubble": "0x1.cbeb914138130p-2",
                   "peak": [4, 3, 2, 1],
                   "memory": [1004000, 1006001, 1006002, 1004003],
                   "events": 146,
                   "timeline": "4c143a4e27f7bed3"},
    "gpipe-defaults": {"step": "0x1.0000000000000p+3",
                       "busy": ["0x1.0000000000000p+2", "0x1.0000000000000p+2",
                                "0x1.0000000000000p+2"],
                       "bubble": "0x1.0000000000000p-1",
                       "peak": [2, 2, 2],
                       "memory": [0, 0, 0],
                       "events": 34,
                       "timeline": "f9720a63d16820d4"},
    "zb-h1-unchecked": {"step": "0x1.2487fcb923a28p+2",
                        "busy": ["0x1.0cccccccccccdp+2", "0x1.6666666666666p+1",
                                 "0x1.6666666666667p+1"],
                        "bubble": "0x1.242a819081e08p-2",
                        "peak": [3, 3, 3],
                        "memory": [1003000, 1006001, 1009002],
                        "events": 86,
                        "timeline": "01a76ea735fc87dd"},
}

SCHEDULES = {
    "zb-v 4 9": "bb0d75ea6be113bb",
    "zb-v 3 5": "6d8eff41a7dc6c76",
    "interleaved 3 6 3": "802e5c1ffee63901",
    "zb-h1 4 5": "1453d2a2fde8fff2",
    "list 4 7 uneven": "fd64123242c291d2",
    "list loop 3 5": "1b6f2ce9fdaabf40",
    "lowered skip": "b7fef5659e587b95",
}


def test_simulate_gives_the_pinned_figures_and_timelines():
    got = {name: _figures(res) for name, res in _sim_cases().items()}
    for name, want in SIM.items():
        assert got[name] == want, name


def test_generators_and_lowering_give_the_pinned_action_lists():
    got = {name: _schedule_digest(s) for name, s in _schedule_cases().items()}
    assert got == SCHEDULES


def test_pinned_deadlock_message_and_an_action_off_its_rank():
    s = one_f_one_b(2, 3)
    s.actions[0] = s.actions[0][::-1]  # rank 0 starts with a backward: nothing can run
    want = ("deadlock in simulation: rank 0 waits at 0RECV_B2@1; rank 1 waits at 1RECV_F0@0; "
            "validate the schedule (fxpipe.schedule.validate.validate) for details")
    for sched in (add_communication(s, linear_edges(2)), LoweredSchedule(s, linear_edges(2))):
        with pytest.raises(ScheduleError) as e:
            simulate(sched, StageCosts.uniform(2), check=False, timeline=False)
        assert str(e.value) == want
    # a W of stage 0 on rank 1 (only without the check): the per-action loop prices it
    full = add_communication(one_f_one_b(2, 2), linear_edges(2))
    full.actions[1].insert(0, Action(Op.W, 0, 0))
    r = simulate(full, StageCosts.uniform(2, 1.0, 1.0, 0.25), check=False)
    assert (r.step_time_s.hex(), [b.hex() for b in r.busy_s], r.peak_inflight, len(r.events)) == (
        "0x1.b000000000000p+2", ["0x1.2000000000000p+2", "0x1.3000000000000p+2"], [2, 1], 21)


# ----------------------------------------------------------------------------- equivalences
def _random_case(rng: random.Random):
    name = rng.choice(["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"])
    p = rng.randint(1, 5)
    v = rng.choice([1, 2, 3]) if name == "interleaved" else 1
    m = p * rng.randint(1, 3) if name == "interleaved" else rng.randint(1, 9)
    comp = compute_schedule(name, p, m, v)
    n = comp.num_stages
    edges = set(linear_edges(n))
    for _ in range(rng.choice([0, 1, 2])):
        if n >= 3:
            q = rng.randrange(n - 2)
            edges.add((q, rng.randrange(q + 2, n)))
    grad = {e for e in edges if rng.random() < 0.8} if rng.random() < 0.5 else None
    costs = StageCosts([rng.random() for _ in range(n)], [rng.random() for _ in range(n)],
                       [rng.choice([0.0, rng.random()]) for _ in range(n)],
                       [rng.randint(0, 99) for _ in range(n)],
                       [rng.randint(0, 99) for _ in range(n)],
                       rng.random() * 0.1,
                       [rng.choice([0.0, rng.random() * 0.01]) for _ in range(n)]
                       if rng.random() < 0.6 else None,
                       [rng.random() * 0.01 for _ in range(n)] if rng.random() < 0.3 else None)
    eb = {e: rng.choice([0, rng.random() * 1e8]) for e in edges}
    gb = {e: rng.random() * 1e8 for e in (grad if grad is not None else edges)} \
        if rng.random() < 0.5 else None
    if gb is None:  # the gradient bytes default to edge_bytes: gradients on every edge
        grad = None
    dp = rng.choice([1, 2, 3])
    servers = rng.choice([0, 0, 2])
    links = Links.from_cluster(p, dp, rng.randint(1, 3), None, 450.0, 12.5,
                               rng.choice([0.0, 1e-5]),
                               rng.choice(["pipeline-inner", "data-inner"]), servers)
    kw = dict(dp=dp, allreduce_bytes=[rng.random() * 1e9 for _ in range(n)], grad_edge_bytes=gb,
              server_bytes=[[rng.randint(0, 10 ** 7) for _ in range(servers)] for _ in range(n)]
              if servers else None)
    return comp, edges, grad, costs, eb, links, kw


def _same(a, b):
    return _figures(a) == _figures(b) and a.events == b.events


def test_compiled_loop_matches_the_per_action_loop(monkeypatch):
    rng = random.Random(0)
    cases = [_random_case(rng) for _ in range(40)]
    runs = []
    for comp, edges, grad, costs, eb, links, kw in cases:
        full = add_communication(comp, edges, grad)
        assert S._compile(full) is not None  # generated schedules take the compiled loop
        runs.append([simulate(full, costs, eb, links, timeline=tl, **kw) for tl in (True, False)])
    monkeypatch.setattr(S, "_compile", lambda schedule: None)  # the per-action loop only
    for (comp, edges, grad, costs, eb, links, kw), got in zip(cases, runs):
        full = add_communication(comp, edges, grad)
        want = [simulate(full, costs, eb, links, timeline=tl, **kw) for tl in (True, False)]
        assert _same(got[0], want[0]) and _same(got[1], want[1])


def _decoded(prog):
    return (prog.num_ranks, prog.num_stages, prog.split, prog.sends, prog.links, prog.num_slots,
            prog.peak, [[x if x >= 0 else (prog.other_row[r][~x], prog.other_arg[r][~x])
                         for x in code] for r, code in enumerate(prog.code)])


def test_lowered_schedule_prices_exactly_as_the_full_schedule():
    rng = random.Random(1)
    for _ in range(40):
        comp, edges, grad, costs, eb, links, kw = _random_case(rng)
        full = add_communication(comp, edges, grad)
        lowered = LoweredSchedule(comp, edges, grad)
        assert _decoded(lowered.program) == _decoded(S._compile(full))
        want = simulate(full, costs, eb, links, check=False, timeline=False, **kw)
        got = simulate(lowered, costs, eb, links, check=False, timeline=False, **kw)
        assert _same(got, want)
        assert lowered._full is None  # priced without building the communication actions
        # the timeline (and the check) need the actions: built then, the same results
        assert _same(simulate(lowered, costs, eb, links, **kw),
                     simulate(full, costs, eb, links, **kw))
    with pytest.raises(ScheduleError, match="does not go forward"):
        LoweredSchedule(one_f_one_b(3, 2), {(0, 1), (2, 1)})


def test_list_schedule_matches_its_definition_on_any_placement():
    rng = random.Random(2)
    for _ in range(60):
        p = rng.randint(1, 4)
        s2r = rng.choice([stage_to_rank("zb-v", p, 2 * p), [s % p for s in range(2 * p)],
                          [rng.randrange(p) for _ in range(rng.randint(1, 3 * p))]])
        m = rng.randint(1, 6)
        limit = rng.choice([1, 2, p, 2 * p, 100])
        costs = rng.choice([(1.0, 1.0, 1.0), (0.5, 1.3, 0.7), (1.0, 2.0, 0.5), (1.0, 1.0, 0.0)])
        want = list_schedule_definition(p, m, s2r, limit, *costs)
        if want is None:
            with pytest.raises(ScheduleError, match="got stuck"):
                _list_schedule("x", p, m, s2r, limit, *costs)
        else:
            assert _list_schedule("x", p, m, s2r, limit, *costs).actions == want


# ----------------------------------------------------------------------------- the speed-ups
class _CountingLinks(Links):
    calls = 0

    def p2p_seconds(self, src, dst, nbytes):
        type(self).calls += 1
        return super().p2p_seconds(src, dst, nbytes)


def test_p2p_seconds_once_per_distinct_send():
    sched = build_schedule("1f1b", 3, 8)  # 2 x 8 forward and 2 x 8 gradient SENDs
    _CountingLinks.calls = 0
    simulate(sched, StageCosts.uniform(3), {(0, 1): 1e6, (1, 2): 2e6}, _CountingLinks(12.5))
    assert _CountingLinks.calls == 4  # 0->1, 1->2 forward, 2->1, 1->0 gradients


@pytest.mark.parametrize("enabled", [True, False])
def test_building_a_schedule_leaves_the_collector_as_it_was(enabled):
    was = gc.isenabled()
    try:
        gc.enable() if enabled else gc.disable()
        compute_schedule("zb-v", 5, 17 + enabled)  # not cached yet: built here
        assert gc.isenabled() == enabled
        with pytest.raises(ScheduleError):
            compute_schedule("interleaved", 4, 6, 2)  # m not a multiple of p
        assert gc.isenabled() == enabled
    finally:
        gc.enable() if was else gc.disable()
