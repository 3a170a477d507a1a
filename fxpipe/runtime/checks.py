"""Checks of the executor: the schedule, the mesh and the modules fit the plan (at
construction), and so does each batch it is given (:func:`split_batch`).

The construction checks raise :class:`~fxpipe.errors.ScheduleError` naming what is missing or
inconsistent and how to build a schedule that fits (``fxpipe.schedule.lowering.
schedule_for_plan``); a batch that does not fit is a :class:`~fxpipe.errors.RuntimeFailure`
saying what to feed instead.
"""

from __future__ import annotations

import torch

from fxpipe.errors import RuntimeFailure, ScheduleError
from fxpipe.plans.plan import Plan
from fxpipe.plans.values import ValueInfo, needs_grad
from fxpipe.runtime.mesh import Mesh
from fxpipe.schedule.actions import Action, Op, Schedule


def check_fits(plan: Plan, schedule: Schedule, mesh: Mesh) -> None:
    """Raise ScheduleError unless the schedule and the mesh have the plan's ranks, stages and
    micro-batches."""
    problems = []
    if plan.pipeline != mesh.pipeline or plan.replicas != mesh.dp:
        problems.append(f"plan is pipeline={plan.pipeline} x dp={plan.replicas} but the mesh is "
                        f"{mesh.pipeline} x {mesh.dp}; build Mesh(plan.pipeline, plan.replicas)")
    if getattr(mesh, "layout", "pipeline-inner") != plan.placement:
        problems.append(f"plan places its ranks {plan.placement} but the mesh is "
                        f"{getattr(mesh, 'layout', None)}; build Mesh(..., layout=plan.placement)")
    if schedule.num_ranks != plan.pipeline or len(schedule.actions) != plan.pipeline:
        problems.append(f"schedule has {schedule.num_ranks} ranks ({len(schedule.actions)} "
                        f"action lists) but the plan has pipeline={plan.pipeline}")
    if schedule.num_stages != plan.num_stages or len(schedule.stage_to_rank) != plan.num_stages:
        problems.append(f"schedule has {schedule.num_stages} stages but the plan has "
                        f"{plan.num_stages}")
    if schedule.microbatches != plan.microbatches:
        problems.append(f"schedule runs {schedule.microbatches} micro-batches but the plan "
                        f"has {plan.microbatches}")
    if sorted(sp.index for sp in plan.stages) != list(range(plan.num_stages)):
        problems.append("plan.stages indices are not 0..num_stages-1")
    if problems:
        raise ScheduleError("schedule does not fit the plan: " + "; ".join(problems)
                            + ". Generate the schedule from this plan's pipeline, stages "
                            "and micro-batches")


def check_actions(schedule: Schedule, pipe_rank: int, local_stages: list[int],
                  edges: dict[tuple[int, int], list[str]], dtypes: dict[str, torch.dtype]) -> None:
    """Every local stage needs F, B (and W) once per micro-batch, and every edge to another
    rank its sends/receives; raise ScheduleError naming what is missing."""
    pr, m, split = pipe_rank, schedule.microbatches, bool(schedule.split_backward)
    acts = schedule.actions[pr]
    stage_rank = schedule.stage_to_rank
    seen: dict[tuple, int] = {}
    for a in acts:
        if a.stage not in local_stages:
            raise ScheduleError(
                f"pipeline rank {pr}'s action {a} belongs to stage {a.stage}, which rank {pr} "
                f"does not hold (it holds {local_stages}); the schedule is corrupt")
        if a.op in (Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B):
            pair = (a.stage, a.peer) if a.op in (Op.SEND_F, Op.RECV_B) else (a.peer, a.stage)
            if pair not in edges:
                raise ScheduleError(
                    f"action {a} on pipeline rank {pr}: no values flow from stage {pair[0]} "
                    f"to stage {pair[1]} in the plan; build the schedule from this plan "
                    "(fxpipe.schedule.lowering.schedule_for_plan)")
        if a.op in (Op.F, Op.B, Op.W, Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B) and not (
                0 <= a.microbatch < m):
            raise ScheduleError(f"action {a} on pipeline rank {pr}: micro-batch "
                                f"{a.microbatch} is outside 0..{m - 1}")
        key = (a.op, a.stage, a.microbatch, a.peer)
        seen[key] = seen.get(key, 0) + 1
    last_bwd = Op.W if split else Op.B
    for pos, a in enumerate(acts):
        if a.op is Op.ALLREDUCE and any(b.op is last_bwd and b.stage == a.stage
                                        for b in acts[pos + 1:]):
            raise ScheduleError(
                f"pipeline rank {pr}: {a} comes before the last {last_bwd.value} of stage "
                f"{a.stage}, so it would all-reduce incomplete gradients; place ALLREDUCE "
                "after the stage's last backward")
    missing, dup = [], [k for k, n in seen.items() if n > 1 and k[0] is not Op.ALLREDUCE]
    compute = [Op.F, Op.B] + ([Op.W] if split else [])
    for s in local_stages:
        for i in range(m):
            missing += [Action(op, s, i) for op in compute if (op, s, i, -1) not in seen]
    for (s, t), names in edges.items():
        if stage_rank[s] == stage_rank[t]:
            continue
        grads = any(needs_grad(dtypes[n]) for n in names)
        for i in range(m):
            if s in local_stages:
                need = [Op.SEND_F] + ([Op.RECV_B] if grads else [])
                missing += [Action(op, s, i, t) for op in need if (op, s, i, t) not in seen]
            if t in local_stages:
                need = [Op.RECV_F] + ([Op.SEND_B] if grads else [])
                missing += [Action(op, t, i, s) for op in need if (op, t, i, s) not in seen]
    if missing or dup:
        text = []
        if missing:
            text.append("missing " + " ".join(str(a) for a in missing[:12])
                        + (f" (+{len(missing) - 12} more)" if len(missing) > 12 else ""))
        if dup:
            text.append("repeated " + " ".join(str(Action(*k)) for k in dup[:12]))
        raise ScheduleError(
            f"schedule {schedule.name!r} for pipeline rank {pr}: " + "; ".join(text)
            + ". Every stage needs F and B (and W when split_backward) once per micro-batch, "
            "and every edge between ranks a send and a receive in each direction: build it "
            "with fxpipe.schedule.lowering.schedule_for_plan(plan)")


def loss_stage(plan: Plan) -> int:
    """The one stage that returns the model output (and computes the loss).

    Raises:
        RuntimeFailure: no stage or several do.
    """
    holders = [sp.index for sp in plan.stages if plan.model_output in sp.outputs]
    if len(holders) != 1:
        raise RuntimeFailure(
            f"the model output {plan.model_output!r} is in the outputs of stages {holders}; "
            "exactly one stage must return it - re-create the plan")
    return holders[0]


def split_batch(name: str, x: torch.Tensor, m: int, mbs: int, info: ValueInfo | None,
                device: torch.device) -> tuple[torch.Tensor, ...]:
    """``x`` (model input or target ``name``, this replica's batch) as ``m`` micro-batches on
    ``device``, checked against the plan: ``mbs`` samples each (0: any) and, for a model input
    (``info``), the planned per-sample shape and dtype.

    Raises:
        RuntimeFailure: the batch does not split so (the message says what to feed).
    """
    b = x.shape[0]
    if b % m:
        raise RuntimeFailure(
            f"{name!r} has batch {b}, which does not split into {m} equal micro-batches; use a "
            f"per-replica batch divisible by {m} (global batch = dp x micro-batches x "
            "micro-batch size)")
    if mbs and b // m != mbs:
        raise RuntimeFailure(
            f"{name!r} has batch {b} = {m} micro-batches of {b // m}, but the plan was made "
            f"for micro-batches of {mbs} samples (it fixes the shapes sent between stages); pass a "
            f"per-replica batch of {m * mbs} or re-plan with this batch size")
    if info is not None and (list(x.shape[1:]) != list(info.shape[1:])
                             or str(x.dtype).removeprefix("torch.") != info.dtype):
        raise RuntimeFailure(
            f"model input {name!r} is {tuple(x.shape[1:])} {str(x.dtype).removeprefix('torch.')}"
            f" per sample but the plan was made for {tuple(info.shape[1:])} {info.dtype} (it "
            "fixes the shapes sent between stages); feed inputs of the planned shape (e.g. the "
            "same data.seq_len) or re-plan with this one")
    return x.to(device).split(b // m, dim=0)
