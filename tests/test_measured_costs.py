"""Measured costs (issue 9): forwards profiled in sequence, one joint backward per node split
between B and W, and the loss (``train.loss``) priced on the stage that produces the model output.

Nothing here depends on how fast this machine is: the checks are about what is run and how the
times combine (a fake timer where a value matters)."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
import torch.nn as nn

from fxpipe.errors import PlanError
from fxpipe.partitioner import loss_cost, pricing
from fxpipe.partitioner import profile as prof
from fxpipe.partitioner.driver import plan_with_graph
from fxpipe.partitioner.timing import NodeTimes
from fxpipe.partitioner.trace import trace
from fxpipe.plans.plan import Plan


class Probe(nn.Module):
    """Records, per call, whether its input is connected to the autograd graph of the nodes
    before it (as in training) and whether grad mode is on."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[bool, bool]] = []

    def forward(self, x):
        self.seen.append((x.grad_fn is not None, torch.is_grad_enabled()))
        return x * 2


class ProbeNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.probe = Probe()
        self.relu = nn.ReLU(inplace=True)
        self.b = nn.Linear(8, 4)

    def forward(self, x):
        return self.b(self.relu(self.probe(self.a(x))))


def test_forwards_are_timed_in_sequence_with_activations_kept():
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    tr = trace(ProbeNet(), (x,), "fx", leaf_modules=[Probe])
    probe = tr.gm.get_submodule("probe")
    probe.seen.clear()
    times = prof.profile_graph(tr, [x], "cpu", warmup=1, repeats=3)
    # 1 warm-up + 3 timed passes over the whole graph, each input connected to the graph's
    # autograd history; then one call on a detached input for its backward
    assert probe.seen[:4] == [(True, True)] * 4
    assert len(probe.seen) == 5 and probe.seen[4] == (False, True)
    assert set(times) == {n.name for n in tr.compute_nodes()}
    assert all(t.fwd_s > 0 for t in times.values())
    # call_module leaves (fx keeps nn.Linear whole) get their weight gradient timed too, and
    # an in-place ReLU on a detached input still has its backward timed
    assert times["a"].bwd_weight_s > 0 and times["b"].bwd_input_s > 0
    assert times["relu"].bwd_input_s > 0 and times["relu"].bwd_weight_s == 0


def test_the_joint_backward_is_split_in_the_ratio_of_b_and_w(monkeypatch):
    x = torch.randn(4, 8)
    tr = trace(nn.Linear(8, 4), (x,))
    (node,) = [n.name for n in tr.compute_nodes()]
    values = iter([6.0, 1.0, 2.0])  # the calls: joint backward, B alone, W alone
    calls = []

    def fake(fn, device, warmup, repeats):
        fn()
        calls.append((warmup, repeats))
        return next(values)

    monkeypatch.setattr(prof, "_median_time", fake)
    monkeypatch.setattr(prof, "engine_overhead_s", lambda device: 0.0)
    monkeypatch.setattr(prof, "_backward_in_sequence", lambda gm, env, device, record: None)
    t = prof.profile_graph(tr, [x], "cpu", warmup=2, repeats=5)[node]
    assert (t.bwd_input_s, t.bwd_weight_s) == (2.0, 4.0)  # B + W = the joint 6
    assert calls[0] == (2, 5) and len(calls) == 3


def _fake_backward_times(monkeypatch, joint_b_w, engine_s, in_seq):
    """``_median_time`` returns ``joint_b_w`` in turn, the engine costs ``engine_s``, and every
    in-sequence backward records ``in_seq`` for every node (None: records nothing)."""
    values = iter(joint_b_w)
    monkeypatch.setattr(prof, "_median_time", lambda fn, device, warmup, repeats: next(values))
    monkeypatch.setattr(prof, "engine_overhead_s", lambda device: engine_s)

    def seq(gm, env, device, record):
        if record is not None and in_seq is not None:
            for name in record:
                record[name].append(in_seq)
        return None
    monkeypatch.setattr(prof, "_backward_in_sequence", seq)


def test_a_node_the_whole_backward_misses_pays_its_own_call_less_the_engine(monkeypatch):
    x = torch.randn(4, 8)
    tr = trace(nn.Linear(8, 4), (x,))
    (node,) = [n.name for n in tr.compute_nodes()]
    _fake_backward_times(monkeypatch, [7.0, 1.0, 2.0], 1.0, None)
    t = prof.profile_graph(tr, [x], "cpu", warmup=1, repeats=1)[node]
    assert t.bwd_input_s + t.bwd_weight_s == pytest.approx(6.0)
    # a node faster than the engine's cost keeps a small share of its time, never 0 or less
    _fake_backward_times(monkeypatch, [0.5, 1.0, 2.0], 1.0, None)
    t = prof.profile_graph(tr, [x], "cpu", warmup=1, repeats=1)[node]
    assert t.bwd_input_s + t.bwd_weight_s == pytest.approx(prof.MIN_BACKWARD_SHARE * 0.5)


def test_the_in_sequence_backward_is_split_in_the_ratio_of_b_and_w(monkeypatch):
    x = torch.randn(4, 8)
    tr = trace(nn.Linear(8, 4), (x,))
    (node,) = [n.name for n in tr.compute_nodes()]
    _fake_backward_times(monkeypatch, [1.0, 2.0], 0.0, 12.0)  # only B and W alone are timed
    t = prof.profile_graph(tr, [x], "cpu", warmup=1, repeats=3)[node]
    assert (t.bwd_input_s, t.bwd_weight_s) == pytest.approx((4.0, 8.0))  # 1:2 of 12


def test_the_in_sequence_backward_attributes_time_to_every_node_without_touching_grad():
    torch.manual_seed(0)
    x = torch.randn(64, 32)
    model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    tr = trace(model, (x,))
    names = [n.name for n in tr.compute_nodes()]
    record = {n: [] for n in names}
    with torch.enable_grad():
        env = prof._forward_in_sequence(tr.gm, {n.name: x for n in tr.gm.graph.nodes
                                                if n.op == "placeholder"}, torch.device("cpu"),
                                        None)
    whole = prof._backward_in_sequence(tr.gm, env, torch.device("cpu"), record)
    assert whole is not None and whole > 0
    assert all(len(record[n]) == 1 and record[n][0] > 0 for n in names), record
    assert sum(v[0] for v in record.values()) <= whole
    assert all(p.grad is None for p in model.parameters())


def test_split_joint():
    assert prof._split_joint(3.0, 1.0, 2.0) == (1.0, 2.0)
    assert prof._split_joint(2.0, 0.0, 0.0) == (1.0, 1.0)


def test_profile_key_changes_with_the_format(monkeypatch):
    x = torch.randn(4, 8)
    tr = trace(nn.Linear(8, 4), (x,))
    a = prof.profile_key(tr, "cpu")
    monkeypatch.setattr(prof, "PROFILE_FORMAT", "profile-v1")
    assert prof.profile_key(tr, "cpu") != a


def test_profile_key_names_the_precision_and_the_parameter_dtype():
    x = torch.randn(4, 8)
    tr = trace(nn.Linear(8, 4), (x,))
    keys = {prof.profile_key(tr, "cpu", p) for p in ("fp32", "bf16", "fp16")}
    assert len(keys) == 3 and prof.profile_key(tr, "cpu") == prof.profile_key(tr, "cpu", "fp32")
    wide = trace(nn.Linear(8, 4).double(), (x.double(),))
    assert prof.profile_key(wide, "cpu") not in keys


def test_bf16_is_profiled_under_autocast_as_the_ranks_run(monkeypatch):
    """Under ``train.precision: bf16`` every node runs in autocast's dtypes while timed."""
    seen = []
    real = prof._op

    def spy(gm, n):
        fn = real(gm, n)

        def wrapped(*a, **k):
            out = fn(*a, **k)
            if isinstance(out, torch.Tensor):
                seen.append(out.dtype)
            return out
        return wrapped
    monkeypatch.setattr(prof, "_op", spy)
    tr = trace(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), (torch.randn(4, 8),))
    prof.profile_graph(tr, [torch.randn(4, 8)], "cpu", warmup=0, repeats=1, precision="bf16")
    assert torch.bfloat16 in seen
    seen.clear()
    prof.profile_graph(tr, [torch.randn(4, 8)], "cpu", warmup=0, repeats=1)
    assert seen and set(seen) == {torch.float32}
    assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("bad", [float("nan"), -5.0, float("inf"), 1e308, True, "x", None])
def test_a_cached_profile_with_impossible_times_is_measured_again(tmp_path, monkeypatch, bad):
    import json
    monkeypatch.setenv("FXPIPE_CACHE_DIR", str(tmp_path))
    prof.save_profile("k", {"a": NodeTimes(1e-3, 1e-3, 0.0), "b": NodeTimes(2e-3, 0.0, 0.0)},
                      {})
    assert prof.load_profile("k")["b"] == NodeTimes(2e-3, 0.0, 0.0)
    path = tmp_path / "profiles" / "k.json"
    data = json.loads(path.read_text())
    data["nodes"]["b"][0] = bad
    path.write_text(json.dumps(data))
    assert prof.load_profile("k") is None
    prof.save_loss_profile("k", NodeTimes(1e-3, 1e-3, 0.0), {})
    lpath = tmp_path / "profiles" / "loss-k.json"
    data = json.loads(lpath.read_text())
    data["bwd_s"] = bad
    lpath.write_text(json.dumps(data))
    assert prof.load_loss_profile("k") is None


def test_a_node_that_fails_is_named():
    emb = nn.Embedding(10, 4)
    tr = trace(emb, (torch.zeros(2, 3, dtype=torch.long),))
    with pytest.raises(PlanError, match=r"profiling node 'embedding' .* failed on the example "
                                        r"batch with IndexError"):
        prof.profile_graph(tr, [torch.full((2, 3), 99)], "cpu", warmup=0, repeats=1)


# ------------------------------------------------------------------------------------- the loss
def test_analytic_loss_times():
    mb, bps, o = 1e6, 1e9, 1e-5
    assert loss_cost.analytic_loss_times("cross_entropy", mb, bps, o) == pytest.approx(
        NodeTimes(2e-3 + 2 * o, 2e-3 + 2 * o, 0.0))
    assert loss_cost.analytic_loss_times("mse", mb, bps, o) == pytest.approx(
        NodeTimes(2e-3 + o, 3e-3 + o, 0.0))
    assert loss_cost.analytic_loss_times("my.pkg:loss", mb, bps, o) == pytest.approx(
        NodeTimes(1e-3 + o, 1e-3 + o, 0.0))
    assert loss_cost.analytic_loss_times("model", mb, bps, o) == NodeTimes()


def test_profile_loss_times_forward_and_backward():
    t = prof.profile_loss(torch.nn.functional.cross_entropy, torch.randn(16, 50),
                          torch.randint(0, 50, (16,)), "cpu", warmup=1, repeats=3)
    assert t.fwd_s > 0 and t.bwd_input_s > 0 and t.bwd_weight_s == 0


def test_measured_loss_is_cached_per_loss(tmp_path, monkeypatch):
    monkeypatch.setenv("FXPIPE_CACHE_DIR", str(tmp_path))
    x = torch.randint(0, 50, (2, 8))
    tr = trace(nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 50)), (x,))
    first = loss_cost.measured_loss_times(tr, "cross_entropy", "cpu", warmup=1, repeats=2)
    assert first.fwd_s > 0 and first.bwd_input_s > 0
    assert len(list((tmp_path / "profiles").glob("loss-*.json"))) == 1

    def no_more(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr(loss_cost, "profile_loss", no_more)
    assert loss_cost.measured_loss_times(tr, "cross_entropy", "cpu") == first
    with pytest.raises(PlanError, match="measured again"):  # another loss: its own entry
        loss_cost.measured_loss_times(tr, "mse", "cpu")
    assert loss_cost.measured_loss_times(tr, "model", "cpu") == NodeTimes()


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 64)
        self.b = nn.Linear(64, 64)
        self.head = nn.Linear(64, 1000)

    def forward(self, x):
        return self.head(torch.relu(self.b(torch.relu(self.a(x)))))


def _spec(loss: str, costs: str = "analytic") -> dict:
    return {"model": {"factory": "x:y"}, "data": {"batch_size": 16},
            "parallel": {"pipeline": 2, "data": 1, "microbatches": 2, "schedule": "1f1b"},
            "cluster": {"devices_per_node": 2, "costs": costs},
            "train": {"loss": loss, "activation_recompute": "off"}}


def test_the_loss_is_priced_on_the_last_stage():
    torch.manual_seed(0)
    model, x = Classifier(), torch.randn(8, 32)
    plans = {loss: plan_with_graph(model, _spec(loss), (x,), cuts=[0, 2])[0]
             for loss in ("cross_entropy", "mse")}
    ce, mse = plans["cross_entropy"], plans["mse"]
    assert ce.stages[0].loss_time_s == 0 and ce.stages[1].loss_time_s > 0
    from fxpipe.specs.loader import load_spec

    cl = load_spec(_spec("cross_entropy")).cluster
    want = loss_cost.analytic_loss_times("cross_entropy", 8 * 1000 * 4, cl.memory_Bps,
                                         cl.op_overhead_s)
    assert ce.stages[1].loss_time_s == pytest.approx(want.total_s)
    # the same cut: only the last stage's times change with the loss, by the loss's difference
    assert ce.stages[0].compute_time_s == mse.stages[0].compute_time_s
    assert (ce.stages[1].compute_time_s - mse.stages[1].compute_time_s) == pytest.approx(
        ce.stages[1].loss_time_s - mse.stages[1].loss_time_s)
    want_mse = loss_cost.analytic_loss_times("mse", 8 * 1000 * 4, cl.memory_Bps,
                                             cl.op_overhead_s)
    assert ce.stages[1].fwd_time_s - mse.stages[1].fwd_time_s == pytest.approx(
        want.fwd_s - want_mse.fwd_s)
    text = ce.summary()
    assert "loss:         cross_entropy on stage 1" in text
    from fxpipe.plans.dot import partition_dot

    assert "incl. loss" in partition_dot(ce)
    # the plan file keeps it; a plan written before it existed still loads
    assert Plan.from_dict(ce.to_dict()).stages[1].loss_time_s == ce.stages[1].loss_time_s
    old = ce.to_dict()
    for st in old["stages"]:
        del st["loss_time_s"]
    assert Plan.from_dict(old).stages[1].loss_time_s == 0.0


def test_the_loss_moves_the_planned_cut_toward_the_input(monkeypatch):
    """Six equal layers on two stages cut 3 | 3; a loss costing about two layers' time on the
    last stage moves a layer to the first (4 | 2)."""
    torch.manual_seed(0)
    model, x = nn.Sequential(*(nn.Linear(64, 64) for _ in range(6))), torch.randn(8, 64)
    monkeypatch.setattr(pricing, "analytic_loss_times", lambda *a: NodeTimes())
    even = plan_with_graph(model, _spec("mse"), (x,))[0]
    assert [len(s.nodes) for s in even.stages] == [3, 3]
    layer = even.stages[1].compute_time_s / 3
    monkeypatch.setattr(pricing, "analytic_loss_times", lambda *a: NodeTimes(layer, layer, 0.0))
    moved = plan_with_graph(model, _spec("mse"), (x,))[0]
    assert [len(s.nodes) for s in moved.stages] == [4, 2]
    assert moved.stages[1].loss_time_s == pytest.approx(2 * layer)
    assert moved.stages[1].compute_time_s == pytest.approx(4 * layer)


def test_measured_plan_prices_the_loss_and_caches_it(tmp_path, monkeypatch):
    monkeypatch.setenv("FXPIPE_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    model, x = Classifier(), torch.randn(8, 32)
    a = plan_with_graph(model, _spec("cross_entropy", "measured"), (x,), cuts=[0, 2])[0]
    assert a.stages[1].loss_time_s > 0 and a.stages[0].loss_time_s == 0
    assert a.stages[1].compute_time_s > a.stages[1].loss_time_s
    files = sorted(p.name for p in (tmp_path / "profiles").glob("*.json"))
    assert len(files) == 2 and sum(f.startswith("loss-") for f in files) == 1
    # no send cost measured here: the plan says its sends are priced by the default
    assert any(line.startswith("send cost: not measured") for line in a.explain)

    def no_more(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr(pricing, "profile_graph", no_more)
    monkeypatch.setattr(loss_cost, "profile_loss", no_more)
    b = plan_with_graph(model, _spec("cross_entropy", "measured"), (x,), cuts=[0, 2])[0]
    assert [s.loss_time_s for s in b.stages] == [s.loss_time_s for s in a.stages]
    from fxpipe.partitioner.profile import SEND_METHOD, SendCost, send_cost_path

    send_cost_path("cpu").write_text(json.dumps(SendCost(5e-4, 1e9, [(4096, 5e-4)],
                                                         SEND_METHOD).to_dict()))
    c = plan_with_graph(model, _spec("cross_entropy", "measured"), (x,), cuts=[0, 2])[0]
    assert not any(line.startswith("send cost:") for line in c.explain)
    assert c.stages[0].send_time_s >= 5e-4 > b.stages[0].send_time_s


def test_fake_clock_median_of_sequence_passes(monkeypatch):
    """Each node's forward is the median of its times over the timed passes only."""
    x = torch.randn(4, 8)
    tr = trace(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), (x,))
    names = [n.name for n in tr.compute_nodes()]
    # the forward passes read the clock twice per node: pass p (0 = warm-up) takes p + 1 s for
    # every node
    ticks = itertools.count()
    state = {"t": 0.0}
    n_nodes = len(names)

    def clock():
        k = next(ticks)
        if k < 2 * n_nodes * 4:  # 1 warm-up + 3 timed passes
            p = k // (2 * n_nodes)
            if k % 2 == 1:
                state["t"] += p + 1
        else:
            state["t"] += 1e-3
        return state["t"]

    monkeypatch.setattr(prof, "_clock", clock)
    monkeypatch.setattr(prof, "_backward_in_sequence", lambda gm, env, device, record: None)
    times = prof.profile_graph(tr, [x], "cpu", warmup=1, repeats=3)
    assert [times[n].fwd_s for n in names] == [3.0] * n_nodes  # median of 2, 3, 4


def test_a_model_with_batchnorm_is_profiled():
    """BatchNorm's running statistics are buffers: they get no gradient and are not made
    leaves that require one (native_batch_norm is not differentiable in them)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                          nn.Flatten(), nn.Linear(4 * 8 * 8, 5))
    x = torch.randn(2, 3, 8, 8)
    tr = trace(model, (x,))
    times = prof.profile_graph(tr, [x], "cpu", warmup=1, repeats=1)
    bn = [n.name for n in tr.compute_nodes() if "batch_norm" in str(n.target)]
    assert bn and all(times[n].bwd_input_s > 0 and times[n].bwd_weight_s > 0 for n in bn)


def bad_loss(output, target):
    raise ValueError("this loss takes no logits")


def test_a_loss_that_does_not_fit_is_one_clean_error_when_measured(tmp_path, monkeypatch):
    monkeypatch.setenv("FXPIPE_CACHE_DIR", str(tmp_path))
    x = torch.randn(4, 8)
    tr = trace(nn.Linear(8, 10), (x,))
    with pytest.raises(PlanError, match=r"train.loss .*bad_loss.* cannot take the model output "
                                        r"\(4, 10\) float32.*ValueError: this loss takes no"):
        loss_cost.measured_loss_times(tr, f"{__name__}:bad_loss", "cpu", repeats=1, warmup=0)


def test_a_changed_custom_loss_is_measured_again():
    def a(o, t):
        return (o - t).pow(2).mean()

    def b(o, t):
        return (o - t).abs().mean()

    assert loss_cost._code_fingerprint(a) != loss_cost._code_fingerprint(b)
    assert loss_cost._code_fingerprint(a) == loss_cost._code_fingerprint(a)
