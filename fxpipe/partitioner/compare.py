"""``fxpipe simulate``: one spec planned once, then every schedule priced on its stages.

Takes a spec (or its path/name); gives a side-by-side text table of predicted step time, bubble
and peak memory per schedule, optionally one simulated Chrome trace per schedule, and the
simulations themselves (``results``: for the CLI's timeline pictures). Schedules that hold two
stages per rank (interleaved, zb-v) are re-planned with that many stages.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fxpipe.errors import PlanError, ScheduleError
from fxpipe.partitioner.driver import as_spec, plan_from_spec
from fxpipe.plans.plan import Plan
from fxpipe.schedule.plan_price import simulate_plan
from fxpipe.schedule.simulate import SimResult
from fxpipe.schedule.timeline import write_chrome_trace
from fxpipe.specs.schema import AUTO_VIRTUAL_STAGES, SCHEDULES, stages_per_rank
from fxpipe.units import human_bytes, ms


def simulate_spec(spec: Any, out_dir: str | Path | None = None,
                  results: dict[str, tuple[Plan, SimResult]] | None = None) -> str:
    """``fxpipe simulate``: plan the spec, then price every schedule on the same stages.

    Returns the side-by-side table (text). With ``out_dir``, writes ``simulated_<schedule>.json``
    (Chrome trace) for each schedule that applies. ``results``, when given, is filled with
    schedule -> (the plan it was priced on, its :class:`SimResult`).
    """
    plan, _ = plan_from_spec(spec)
    lines = [plan.summary(), "",
             f"{'schedule':12s} {'step time':>12s} {'bubble':>8s} {'peak memory per stage':s}"]
    for name in SCHEDULES:
        if stages_per_rank(name, AUTO_VIRTUAL_STAGES) > 1 and plan.virtual_stages == 1:
            p2 = _replan_virtual(spec, name)
            if p2 is None:
                lines.append(f"{name:12s} {'n/a':>12s}   (needs a re-plan with 2 stages per rank)")
                continue
            target = p2
        else:
            target = plan
        try:
            res = simulate_plan(target, name)
        except (ScheduleError, PlanError) as e:
            lines.append(f"{name:12s} {'n/a':>12s}   ({e})")
            continue
        if results is not None:
            results[name] = (target, res)
        mem = ", ".join(human_bytes(b) for b in res.peak_memory_bytes)
        lines.append(f"{name:12s} {ms(res.step_time_s):>10s}ms {res.bubble_fraction:8.3f} "
                     f"[{mem}]")
        if out_dir:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            write_chrome_trace(res.events, Path(out_dir) / f"simulated_{name}.json",
                               process_name=f"fxpipe simulated {name}")
    return "\n".join(lines)


def _replan_virtual(spec: Any, schedule: str) -> Plan | None:
    spec = as_spec(spec)
    par = spec.parallel.model_copy(update={"schedule": schedule,
                                           "virtual_stages": AUTO_VIRTUAL_STAGES
                                           if schedule == "interleaved" else 1})
    try:
        return plan_from_spec(spec.model_copy(update={"parallel": par}))[0]
    except (PlanError, ScheduleError):
        return None
