"""Pipeline executor: exact equivalence with single-process training, timeouts, accounting.

Multi-process tests spawn gloo process groups (fxpipe/runtime/local_ranks.py) with a hard deadline. One
process group per world size runs several (mesh, model, schedule) cases in a row to keep the file
fast on two shared cores. In-process tests use a one-rank mesh (several stages on one rank).
"""

from __future__ import annotations

import copy
import re
import time
import types

import pytest
import torch
import torch.nn.functional as F

from fxpipe.errors import RuntimeFailure, ScheduleError
from fxpipe.execution.losses import cross_entropy
from fxpipe.partitioner.boundaries import compute_nodes
from fxpipe.partitioner.split import split_graph
from fxpipe.plans.placement import rank_coords
from fxpipe.plans.plan import Plan, StagePlan
from fxpipe.runtime.data_parallel import GradBucket
from fxpipe.runtime.executor import PipelineExecutor
from fxpipe.runtime.local_ranks import run_ranks
from fxpipe.runtime.mesh import Mesh
from fxpipe.schedule.actions import Action, Op, Schedule
from fxpipe.schedule.generators import compute_schedule
from fxpipe.schedule.lowering import add_communication, schedule_for_plan

try:
    from shared_models import MBS, SEQ, STEPS, VOCAB, M, exact_bounds, tiny_cnn, tiny_gpt
    from tolerances import bound
except ImportError:  # tests/ collected as a package
    from tests.shared_models import (MBS, SEQ, STEPS, VOCAB, M, exact_bounds, tiny_cnn,
                                     tiny_gpt)
    from tests.tolerances import bound


# ----------------------------------------------------------------------------- models and plans
#: AdamW trains in float64: in float32 it magnifies the rounding of a zero gradient to the
#: learning rate (tests/tolerances.py), SGD does not
ADAMW_LR = 1e-2
MODELS = {
    # name: (factory, example-input maker, batch maker, loss, optimizer factory)
    "gpt": (tiny_gpt, lambda b: (torch.randint(0, VOCAB, (b, SEQ)),),
            lambda g, b: (torch.randint(0, VOCAB, (b, SEQ), generator=g),
                          torch.randint(0, VOCAB, (b, SEQ), generator=g)),
            cross_entropy, lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9)),
    "cnn": (lambda: tiny_cnn().double(), lambda b: (torch.randn(b, 1, 8, 8, dtype=torch.float64),),
            lambda g, b: (torch.randn(b, 1, 8, 8, generator=g, dtype=torch.float64),
                          torch.randint(0, 10, (b,), generator=g)),
            F.cross_entropy, lambda ps: torch.optim.AdamW(ps, lr=ADAMW_LR, weight_decay=0.1)),
}
BLOCK = re.compile(r"^(?:h|blocks)\.(\d+)$")


def block_stages(gm, n_blocks: int, num_stages: int, first_alone: bool = False) -> dict[str, int]:
    """Node -> stage: block k goes to stage k * num_stages // n_blocks (shifted by one when the
    stem gets a stage of its own); nodes outside blocks follow the previous node."""
    out, stage = {}, 0
    body = num_stages - 1 if first_alone else num_stages
    for name in compute_nodes(gm):
        node = next(n for n in gm.graph.nodes if n.name == name)
        paths = [v[0] for v in (node.meta.get("nn_module_stack") or {}).values()]
        ks = [int(mt.group(1)) for p in paths if (mt := BLOCK.match(p))]
        if ks:
            stage = ks[0] * body // n_blocks + (1 if first_alone else 0)
        out[name] = stage
    return out


def make_plan(b, pipeline: int, dp: int, m: int, mbs: int, schedule: str,
              num_stages: int | None = None) -> Plan:
    """A Plan from split.py's Boundaries (costs left at zero: the executor does not read them)."""
    stages = [StagePlan(index=sb.index, nodes=sb.nodes, params=sb.params, buffers=sb.buffers,
                        inputs=sb.inputs, outputs=sb.outputs, fwd_flops=0.0, bwd_flops=0.0,
                        bwd_weight_flops=0.0, param_bytes=0, activation_bytes=0, recv_bytes=0,
                        send_bytes=0, compute_time_s=0.0, comm_time_s=0.0, time_s=0.0,
                        memory_bytes=0) for sb in b.stages]
    n = num_stages or pipeline
    return Plan(model="test", num_stages=n, pipeline=pipeline, dp=dp, microbatches=m,
                schedule=schedule, virtual_stages=n // pipeline, microbatch_size=mbs,
                stages=stages, values=b.values, model_inputs=b.model_inputs,
                model_output=b.model_outputs[0], shared_params=b.shared_params,
                param_aliases=b.param_aliases)


class Case:
    """One model traced once per process; parameters reset to the initial state for each run."""

    def __init__(self, name: str):
        factory, example, self.batch, self.loss_fn, self.opt = MODELS[name]
        self.name = name
        self.model = factory()
        self.init = copy.deepcopy(self.model.state_dict())
        self.gm = torch.export.export(self.model, example(MBS), strict=False).module()
        self.n_blocks = len(self.model.h if name == "gpt" else self.model.blocks)
        self._refs: dict[int, tuple[list[float], dict[str, torch.Tensor]]] = {}

    def batches(self, global_batch: int):
        """STEPS global batches: the same random batch each step, so the loss must fall."""
        g = torch.Generator().manual_seed(1234)
        return [self.batch(g, global_batch)] * STEPS

    def reference(self, global_batch: int):
        """Single-process training on the whole global batch: losses, final parameters and
        the ``(loss, parameter)`` bounds on a pipelined run's difference from them
        (:func:`shared_models.exact_bounds`)."""
        if global_batch not in self._refs:
            ref = MODELS[self.name][0]()
            ref.load_state_dict(self.init)
            init = {k: v.detach().clone() for k, v in ref.named_parameters(remove_duplicate=False)}
            opt = self.opt(ref.parameters())
            losses, grad = [], 0.0
            for x, y in self.batches(global_batch):
                loss = self.loss_fn(ref(x), y)
                loss.backward()
                grad = max([grad] + [float(p.grad.abs().max()) for p in ref.parameters()])
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            params = {k: v.detach().clone()
                      for k, v in ref.named_parameters(remove_duplicate=False)}
            dtype = next(ref.parameters()).dtype
            adamw = (ADAMW_LR * STEPS, grad) if isinstance(opt, torch.optim.AdamW) else None
            self._refs[global_batch] = (losses, params, exact_bounds(
                losses, init, params, global_batch, STEPS, dtype, adamw))
        return self._refs[global_batch]

    def split(self, num_stages: int, first_alone: bool = False):
        node_stage = block_stages(self.gm, self.n_blocks, num_stages, first_alone)
        return split_graph(self.gm, node_stage, num_stages)


def run_pipeline(case: Case, mesh, plan: Plan, schedule: Schedule, modules, timeout_s=60.0):
    """Train STEPS steps through the executor; return (losses, max param error, executor)."""
    case.model.load_state_dict(case.init)  # stage modules share these Parameter objects
    local = {s: modules[s] for s in schedule.stages_of_rank(mesh.pipe_rank)}
    params = list({id(p): p for mod in local.values() for p in mod.parameters()}.values())
    ex = PipelineExecutor(plan, schedule, local, mesh, case.loss_fn, case.opt(params), timeout_s)
    per = MBS * plan.microbatches
    gb = per * mesh.dp
    losses = []
    for x, y in case.batches(gb):
        sl = slice(mesh.dp_rank * per, (mesh.dp_rank + 1) * per)
        losses.append(ex.step({plan.model_inputs[0]: x[sl]}, y[sl]))
    ref_losses, ref_params, _ = case.reference(gb)
    err = 0.0
    for mod in local.values():
        for name, p in mod.named_parameters(remove_duplicate=False):
            err = max(err, (p.detach() - ref_params[name]).abs().max().item())
    loss_err = max(abs(a - b) for a, b in zip(losses, ref_losses))
    return losses, loss_err, err, ex


# ----------------------------------------------------------------------------- multi-process
MESHES = {2: [(2, 1)], 4: [(4, 1), (2, 2)], 8: [(4, 2)]}
#: the split-backward variant runs in the smallest world only (its W path is what is new)
SCHEDULES = {2: ["gpipe", "1f1b", "1f1b-w"], 4: ["gpipe", "1f1b"], 8: ["gpipe", "1f1b"]}


def _compressed_allreduce_error(mesh, compression: str) -> float:
    """Max error of a 16-bit compressed data-parallel average against the exact one."""
    param = torch.nn.Parameter(torch.zeros(1000))
    param.grad = torch.linspace(-1, 1, 1000) * (mesh.dp_rank + 1)
    bucket = GradBucket("test", [param], mesh.dp_group, mesh.dp, compression)
    bucket.launch()
    bucket.wait(30.0)
    exact = torch.linspace(-1, 1, 1000) * (mesh.dp + 1) / 2  # mean of (d + 1) over replicas
    return (param.grad - exact).abs().max().item()


def _deferred_w(plan: Plan) -> Schedule:
    """1F1B with the backward split into B (input gradients) and W (weight gradients), every W
    deferred to the end of the rank's list (the zero-bubble split, across ranks)."""
    base = compute_schedule("1f1b", plan.pipeline, plan.microbatches)
    acts = [lst + [Action(Op.W, a.stage, a.microbatch) for a in lst if a.op is Op.B]
            for lst in base.actions]
    split = Schedule("1f1b-w", base.num_ranks, base.num_stages, base.microbatches,
                     base.stage_to_rank, acts, split_backward=True)
    fwd, grad = plan.edge_bytes()
    return add_communication(split, set(fwd), set(grad))


def _equivalence_worker(rank: int, meshes, models, schedules):
    out = []
    cases = {name: Case(name) for name in models}
    for p, dp in meshes:
        mesh = Mesh(p, dp)
        if dp > 1:
            out.append(dict(compression={c: _compressed_allreduce_error(mesh, c)
                                         for c in ("none", "fp16", "bf16")}))
        for name, case in cases.items():
            boundaries, modules = case.split(p, first_alone=(name == "cnn" and p == 4))
            for sched in schedules:
                plan = make_plan(boundaries, p, dp, M, MBS, sched)
                schedule = _deferred_w(plan) if sched == "1f1b-w" else schedule_for_plan(plan)
                losses, loss_err, param_err, ex = run_pipeline(case, mesh, plan, schedule, modules)
                out.append(dict(model=name, schedule=sched, p=p, dp=dp, rank=rank,
                                pipe_rank=mesh.pipe_rank, losses=losses, loss_err=loss_err,
                                param_err=param_err, tol=case.reference(MBS * M * dp)[2],
                                peak=ex.peak_inflight, open_sends=ex.open_forward_sends,
                                released={s: w.released for s, w in ex.work.items()},
                                outputs={s: len(plan.stages[s].outputs)
                                         for s in ex.work},
                                n_events=len(ex.events), fused=sum(ex.fused_nodes.values()),
                                n_actions=len(schedule.actions[mesh.pipe_rank]),
                                shared=sorted(plan.shared_params),
                                skip=[e for e in plan.stage_edges() if e[1] - e[0] > 1]))
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4, 8])
def test_equivalence_with_single_process(world):
    """GPipe and 1F1B, p in {2, 4}, dp in {1, 2}, GPT (tied) and SkipCNN (long skip): losses of 3
    steps and final parameters equal single-process training within 1e-5; peak in-flight
    micro-batches: GPipe m, 1F1B p - s."""
    results = run_ranks(_equivalence_worker, world, MESHES[world], ["gpt", "cnn"],
                        SCHEDULES[world], timeout_s=150, dist_timeout_s=60)
    rows = [r for per_rank in results for r in per_rank if "compression" not in r]
    assert len(rows) == world * len(MESHES[world]) * 2 * len(SCHEDULES[world])
    for per_rank in results:
        for r in per_rank:
            if "compression" in r:  # 16-bit all-reduce payloads: close, not exact
                errs = r["compression"]
                # fp32: the mean of 2 replicas' entries of size <= 1.5, summed in another
                # order (tests/tolerances.py); 16-bit: the format's rounding (2^-11, 2^-8)
                assert errs["none"] < bound(1.5, 2), errs
                assert errs["fp16"] < 2e-3 and errs["bf16"] < 2e-2, errs
    for r in rows:
        tag = f"{r['model']} {r['schedule']} p={r['p']} dp={r['dp']} rank {r['rank']}"
        # weight gradients accumulate in place on a full backward (every GPT stage has a
        # Linear or an embedding), never on a split B / W one
        if r["schedule"] == "1f1b-w":
            assert r["fused"] == 0, tag
        elif r["model"] == "gpt":
            assert r["fused"] > 0, tag
        loss_tol, param_tol = r["tol"]
        assert r["loss_err"] < loss_tol, (tag, r["loss_err"], loss_tol)
        assert r["param_err"] < param_tol, (tag, r["param_err"], param_tol)
        assert r["losses"][-1] < r["losses"][0], tag  # it trained
        assert r["n_events"] == STEPS * r["n_actions"], tag
        (stage, peak), = r["peak"].items()
        assert stage == r["pipe_rank"]
        # every output of a stage but the last is sent to other ranks only: its data let go
        # once sent, each micro-batch of each step; the sends finished as gradients came back
        sent = 0 if stage == r["p"] - 1 else r["outputs"][stage] * STEPS * M
        assert r["released"] == {stage: sent} and r["open_sends"] == 0, tag
        want = min(r["p"] - stage, M) if r["schedule"] == "1f1b" else M  # W deferred: all m
        assert peak == want, tag
        if r["model"] == "gpt":
            assert r["shared"], "the tied embedding/head must be a shared parameter"
        if r["model"] == "cnn" and r["p"] == 4:
            assert (0, 3) in r["skip"], "the stem output must skip to the last stage"
    # every rank of a run reports the same loss
    for key in {(r["model"], r["schedule"], r["p"], r["dp"]) for r in rows}:
        losses = {tuple(r["losses"]) for r in rows
                  if (r["model"], r["schedule"], r["p"], r["dp"]) == key}
        assert len(losses) == 1, key


def _silent_peer_worker(rank: int, mode: str, timeout_s: float):
    case = Case("cnn")
    mesh = Mesh(2, 1)
    boundaries, modules = case.split(2)
    plan = make_plan(boundaries, 2, 1, M, MBS, "1f1b")
    schedule = schedule_for_plan(plan)
    if rank == 1:
        if mode == "die":
            import os
            os._exit(0)  # the peer crashes
        time.sleep(timeout_s + 2)  # the peer never sends
        return None
    t0 = time.monotonic()
    try:
        run_pipeline(case, mesh, plan, schedule, modules, timeout_s=timeout_s)
    except RuntimeFailure as e:
        return (str(e), time.monotonic() - t0)
    return ("no error", time.monotonic() - t0)


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["silent", "die"])
def test_silent_or_dead_peer_raises_runtime_failure(mode):
    timeout_s = 2.0
    res = run_ranks(_silent_peer_worker, 2, mode, timeout_s, timeout_s=60, dist_timeout_s=30)
    msg, elapsed = res[0]
    assert msg != "no error"
    assert "rank 0" in msg and "stage 0" in msg and "micro-batch" in msg, msg
    assert "rank 1" in msg, msg  # names the peer
    assert re.search(r"action 0(RECV_B|SEND_F)\d@1", msg), msg
    assert elapsed < timeout_s + 8, elapsed


# ----------------------------------------------------------------------------- in-process
def _local_schedule(num_stages: int, m: int, split: bool) -> Schedule:
    """All stages on one rank: forward of every micro-batch through every stage, then backward."""
    acts = [Action(Op.F, s, i) for i in range(m) for s in range(num_stages)]
    for i in range(m):
        for s in reversed(range(num_stages)):
            acts.append(Action(Op.B, s, i))
    if split:
        acts += [Action(Op.W, s, i) for i in range(m) for s in range(num_stages)]
    acts += [Action(Op.ALLREDUCE, s) for s in reversed(range(num_stages))]
    acts.append(Action(Op.STEP, 0))
    return Schedule("local", 1, num_stages, m, [0] * num_stages, [acts], split_backward=split)


@pytest.mark.parametrize("name,split", [("cnn", False), ("cnn", True), ("gpt", True)])
def test_stages_on_one_rank_hand_over_and_split_backward(name, split):
    """Several stages on one rank (interleaved/V placements): values handed over in memory, a
    value read by two stages gets the sum of both gradients, tied weights within a rank, and the
    B/W split (zero-bubble) gives the same training as single-process."""
    case = Case(name)
    k = 4 if name == "cnn" else 3
    boundaries, modules = case.split(k, first_alone=(name == "cnn"))
    plan = make_plan(boundaries, 1, 1, M, MBS, "local", num_stages=k)
    if name == "cnn":
        readers = plan.values[plan.stages[0].outputs[0]].consumers
        assert len(readers) >= 2, "the stem output should be read by two later stages"
    else:
        assert plan.shared_params
    losses, loss_err, param_err, ex = run_pipeline(case, Mesh(1, 1), plan,
                                                   _local_schedule(k, M, split), modules)
    loss_tol, param_tol = case.reference(M * MBS)[2]
    assert loss_err < loss_tol and param_err < param_tol, (loss_err, param_err, loss_tol,
                                                           param_tol)
    assert ex.peak_inflight == {s: M for s in range(k)}


def _stub_mesh(pipeline: int):
    return types.SimpleNamespace(pipeline=pipeline, dp=1, rank=0, pipe_rank=0, dp_rank=0,
                                 world_size=pipeline, device=torch.device("cpu"), dp_group=None,
                                 replica_group=lambda key: None,
                                 global_rank=lambda r, d=None: r)


def test_schedule_without_communication_is_rejected():
    case = Case("cnn")
    boundaries, modules = case.split(2)
    plan = make_plan(boundaries, 2, 1, M, MBS, "1f1b")
    compute_only = compute_schedule("1f1b", 2, M)
    with pytest.raises(ScheduleError, match="missing 0SEND_F0@1"):
        PipelineExecutor(plan, compute_only, {0: modules[0]}, _stub_mesh(2), case.loss_fn, None)
    full = add_communication(compute_only, plan.stage_edges())
    with pytest.raises(RuntimeFailure, match="stages \\[0\\]"):
        PipelineExecutor(plan, full, {1: modules[1]}, _stub_mesh(2), case.loss_fn, None)
    # an all-reduce before the stage's last backward would reduce partial gradients
    acts = full.actions[0]
    early = [a for a in acts if a.op is not Op.ALLREDUCE]
    early.insert(1, Action(Op.ALLREDUCE, 0))
    bad = Schedule(full.name, 2, 2, M, full.stage_to_rank, [early, full.actions[1]])
    with pytest.raises(ScheduleError, match="before the last B of stage 0"):
        PipelineExecutor(plan, bad, {0: modules[0]}, _stub_mesh(2), case.loss_fn, None)


def test_bad_batch_is_a_clear_error():
    case = Case("cnn")
    boundaries, modules = case.split(2)
    plan = make_plan(boundaries, 1, 1, M, MBS, "local", num_stages=2)
    ex = PipelineExecutor(plan, _local_schedule(2, M, False), dict(enumerate(modules)),
                          Mesh(1, 1), case.loss_fn, None)
    x, y = case.batch(torch.Generator().manual_seed(0), M * MBS + 1)
    with pytest.raises(RuntimeFailure, match="divisible by 4"):
        ex.step({"x": x}, y)
    x, y = case.batch(torch.Generator().manual_seed(0), M * (MBS + 1))
    with pytest.raises(RuntimeFailure, match="micro-batches of 2 samples"):
        ex.step({"x": x}, y)


def test_rank_layout():
    # rank = dp_rank * pipeline + pipe_rank
    assert [rank_coords(r, 4) for r in (0, 3, 4, 7)] == [(0, 0), (3, 0), (0, 1), (3, 1)]
    mesh = Mesh(1, 1)  # single process: no torch.distributed needed
    assert (mesh.rank, mesh.pipe_rank, mesh.dp_rank, mesh.dp_group) == (0, 0, 0, None)
