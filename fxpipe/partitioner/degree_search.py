"""``parallel.expert: auto``, ``parallel.context: auto`` and ``parallel.context_attention:
auto``: the planner plans each degree (and, with context parallelism, each way attention reads
the other ranks' keys and values: all-gather or ring) that can work and keeps the fastest
plan.

Each degree changes what every rank holds and runs (:mod:`fxpipe.partitioner.expert_costs`,
:mod:`fxpipe.partitioner.context_costs`), so each is planned whole (its own trace-and-price
pass and layout search, a second or so for a model planned as blocks). Degrees tried:
expert 1 and powers of two up to the training devices (over the tensor degree) that divide
them, context 1 and the divisors of a node's devices (over the tensor degree: its groups then
stay in a node); only 1 where the spec combines them with what they do not support (the
other of the two above 1, tensor parallelism or data sharding for context, data sharding
for experts, asynchronous updates). A degree that cannot work for the model (experts that do
not divide, a sequence that does not split into ``2 x context`` chunks, no memory) is left out
and the plan says why; the plan's explanation ranks the others by predicted step.
"""

from __future__ import annotations

from typing import Callable

from fxpipe.errors import PlanError, SpecError
from fxpipe.plans.plan import Plan
from fxpipe.specs.schema import ParallelSpec


def searches_degrees(spec: ParallelSpec) -> bool:
    """Whether the spec asks for ``auto`` expert or context degrees, or leaves the context
    group's attention to the planner."""
    par = spec.parallel
    return "auto" in (par.expert, par.context) or (
        par.context != 1 and par.context_attention == "auto")


def _powers(limit: int) -> list[int]:
    out, k = [], 1
    while k <= limit:
        out.append(k)
        k *= 2
    return out


def _why_only_one(spec: ParallelSpec, kind: str) -> str | None:
    """Why ``auto`` tries only degree 1 of ``kind`` (what it does not combine with yet)."""
    par = spec.parallel
    blocks = [("asynchronous updates", spec.train.updates != "sync")]
    if kind == "context":
        blocks.append(("tensor parallelism", par.tensor != 1))
        blocks.append(("expert parallelism", par.expert not in (1, "auto")))
    else:
        blocks.append(("data sharding", par.data_sharding != "none"))
        blocks.append(("context parallelism", par.context not in (1, "auto")))
    found = [name for name, on in blocks if on]
    return (f"parallel.{kind}: auto planned {kind} 1 only: {kind} parallelism does not "
            f"combine with {' or '.join(found)} yet") if found else None


def degree_options(spec: ParallelSpec) -> tuple[list[tuple[int, int, str]], list[str]]:
    """The ``(expert, context, attention)`` choices to plan (module doc), and why any
    ``auto`` was kept to 1."""
    par, cl, t = spec.parallel, spec.cluster, spec.parallel.tensor
    tensor = t if isinstance(t, int) else 1
    per = cl.trainers // tensor
    notes = [n for k in ("expert", "context") if getattr(par, k) == "auto"
             for n in [_why_only_one(spec, k)] if n]
    if par.expert == "auto":
        experts = ([e for e in _powers(per) if per % e == 0]
                   if _why_only_one(spec, "expert") is None else [1])
    else:
        experts = [par.expert]
    if par.context == "auto":
        node = cl.devices_per_node
        contexts = ([c for c in range(1, node + 1) if node % c == 0 and per % c == 0]
                    if _why_only_one(spec, "context") is None else [1])
        p, d = par.pipeline, par.data
        if isinstance(p, int) and isinstance(d, int):  # the devices left over them
            contexts = [c for c in contexts if p * d * c == per] or [per // (p * d)]
    else:
        contexts = [par.context]
    way = par.context_attention
    return [(e, c, w) for e in experts for c in contexts if e == 1 or c == 1
            for w in ((("all-gather", "ring") if way == "auto" else (way,)) if c > 1
                      else ("all-gather",))], notes


def _reason(err: Exception) -> str:
    """The first line of an error (with the next where it ends in a colon)."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    if not lines:
        return type(err).__name__
    first = lines[0]
    if first.endswith(":") and len(lines) > 1:
        first += " " + lines[1]
    return first


def _label(spec: ParallelSpec, e: int, c: int, way: str) -> str:
    par, parts = spec.parallel, []
    if par.expert == "auto":
        parts.append(f"expert {e}")
    if par.context == "auto":
        parts.append(f"context {c}")
    if par.context_attention == "auto" and c > 1:
        parts.append(f"{way} attention")
    return " x ".join(parts)


def plan_degrees(spec: ParallelSpec, plan_one: Callable[[ParallelSpec], tuple]) -> tuple:
    """Plan each degree of :func:`degree_options` with ``plan_one(spec at that degree)``
    (returning ``(plan, graph)``) and return the fastest's result, its plan explaining the
    choice.

    Raises:
        PlanError: no degree gives a plan (each one's reason listed).
    """
    made: list[tuple[float, str, tuple]] = []
    left_out: list[str] = []
    errors: list[Exception] = []
    options, notes = degree_options(spec)
    for e, c, way in options:
        par = spec.parallel.model_copy(update={"expert": e, "context": c,
                                               "context_attention": way})
        one = spec.model_copy(update={"parallel": par})
        label = _label(spec, e, c, way)
        try:
            result = plan_one(one)
        except (PlanError, SpecError) as err:
            left_out.append(f"{label}: {_reason(err)}")
            errors.append(err)
            continue
        plan: Plan = result[0]
        made.append((plan.predicted.step_time_s if plan.predicted else float("inf"), label,
                     result))
    if not made:
        if len({str(err) for err in errors}) == 1:  # every choice fails alike: that reason
            raise errors[0]
        raise PlanError("no expert / context choice gives a plan:\n  " + "\n  ".join(
            left_out + notes))
    made.sort(key=lambda x: x[0])
    best_s, best, result = made[0]
    par = spec.parallel
    asked = " and ".join(f"parallel.{k}: auto" for k in ("expert", "context",
                                                          "context_attention")
                         if getattr(par, k) == "auto"
                         and (k != "context_attention" or par.context != 1))
    lines = [f"{asked}: chose {best} ({best_s * 1e3:.2f} ms/step predicted)"]
    lines += [f"  {label}: {s * 1e3:.2f} ms/step ({(s / best_s - 1) * 100:+.1f}%)"
              for s, label, _ in made[1:]]
    lines += [f"  {why}" for why in left_out + notes]
    result[0].explain[:0] = lines
    return result
