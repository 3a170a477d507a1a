"""A Plan's step priced by the one rule (:mod:`fxpipe.schedule.step_price`): the plan's stages
as :class:`~fxpipe.schedule.step_price.StageStep` rows, its links from the typed cluster it was
planned for, its reduction from its training options and sharding. What ``plan.predicted``
holds, ``fxpipe simulate`` prices and the runtime's measurements are compared against."""

from __future__ import annotations

from fxpipe.plans.plan import Plan, Predicted
from fxpipe.schedule.lowering import schedule_for_plan
from fxpipe.schedule.simulate import Links, SimResult
from fxpipe.schedule.step_price import Reduction, StageStep, links_of, price_step
from fxpipe.specs.schema import ClusterSpec, TrainSpec

__all__ = ["stage_steps", "reduction_of", "links_from_plan", "simulate_plan", "predict"]


def stage_steps(plan: Plan) -> list[StageStep]:
    """The plan's stages as the pricing rule reads them: F/B/W seconds (when a stage has no
    split times but ``compute_time_s > 0``: a third forward, the backward split by
    ``bwd_weight_flops / bwd_flops``), activation and parameter bytes, the bytes of parameters
    other stages share, its trained matrices' shapes (``plan.param_shapes``), send seconds and,
    gathered block by block (``param_gather: block``), its groups' rows (``gather_groups``)."""
    out = []
    shapes = plan.param_shapes
    for st in plan.stages:
        ff, b1, b2 = st.fwd_time_s, st.bwd_input_time_s, st.bwd_weight_time_s
        if ff + b1 + b2 == 0 and st.compute_time_s > 0:
            ff = st.compute_time_s / 3
            bwd = st.compute_time_s - ff
            wfrac = st.bwd_weight_flops / st.bwd_flops if st.bwd_flops else 0.5
            b2 = bwd * wfrac
            b1 = bwd - b2
        out.append(StageStep(
            ff, b1, b2, int(st.activation_bytes), float(st.param_bytes), float(st.shared_bytes),
            [tuple(shapes[f]) for f in st.params if f in shapes],
            st.send_time_s, st.send_time_s if st.grad_send_time_s is None
            else st.grad_send_time_s,
            [list(r) for r in st.gather_groups] if st.param_gather == "block" else [],
            st.param_gather == "block" and st.recompute, float(st.tied_bytes),
            float(st.expert_bytes)))
    return out


def _train(plan: Plan) -> TrainSpec:
    return plan.spec.train if plan.spec is not None else TrainSpec()


def _cluster(plan: Plan) -> ClusterSpec:
    if plan.spec is not None:
        return plan.spec.cluster
    # a plan made by hand: one node holding the grid (the schema's other defaults)
    return ClusterSpec(devices_per_node=plan.pipeline * plan.replicas * plan.tensor)


def reduction_of(plan: Plan) -> Reduction:
    """How the plan's replicas reduce gradients (its spec's ``train`` section, its sharding)."""
    return Reduction.of(_train(plan), plan.replicas, plan.data_sharding,
                        len(plan.parameter_servers))


def links_from_plan(plan: Plan) -> Links:
    """The links of the plan's layout on the cluster it was planned for."""
    return links_of(_cluster(plan), plan.pipeline, plan.replicas, plan.tensor, plan.placement,
                    len(plan.parameter_servers))


def simulate_plan(plan: Plan, schedule: str | None = None, microbatches: int | None = None,
                  links: Links | None = None, *, check: bool = True, timeline: bool = True
                  ) -> SimResult:
    """Simulate one step of ``plan`` (optionally with another schedule name / micro-batch count,
    or other links) by the one pricing rule (``check``: validate the action lists first;
    ``timeline``: keep the events).

    Raises:
        ScheduleError: the plan's parameters do not suit the schedule.
    """
    fwd, grad = plan.edge_bytes()
    return price_step(schedule_for_plan(plan, schedule, microbatches), stage_steps(plan), fwd,
                      grad, links or links_from_plan(plan), reduction_of(plan),
                      plan.server_stage_bytes if plan.parameter_servers else None,
                      check=check, timeline=timeline)


def predict(plan: Plan, schedule: str | None = None, microbatches: int | None = None,
            links: Links | None = None) -> Predicted:
    """:func:`simulate_plan` reduced to a :class:`~fxpipe.plans.plan.Predicted` (what
    ``plan.predicted`` holds): the figures only (the generators' action lists, as the search
    priced them; ``fxpipe simulate`` and the timeline validate and keep the events)."""
    return simulate_plan(plan, schedule, microbatches, links, check=False,
                         timeline=False).predicted()
