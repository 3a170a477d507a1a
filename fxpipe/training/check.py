"""``fxpipe check SPEC [--steps N]``: prove that the planned pipeline trains like one process.

Plans the spec, trains ``N`` steps of the plan on local gloo ranks
(:func:`fxpipe.runtime.local_ranks.run_ranks`, one process per rank of the plan, each running
the loop of ``fxpipe run``'s worker: :func:`fxpipe.compile`, the spec's optimizer, learning-rate
schedule, gradient accumulation and clipping, precision), then trains the same model in this
process from the same initial weights (``build_model`` seeds ``train.seed``) on the same
batches with the same recipe (the spec's loss on the whole batch, ``optimizer.step()`` after
``grad_accumulation`` batches, ``clip_grad_norm_`` over the whole model, ``torch.autocast``
for bf16/fp16). It prints each step's loss difference, the largest parameter differences by
name after the last step, and a verdict against tolerances that follow from the precision
(:mod:`fxpipe.training.equivalence`). When they differ beyond them it names the first
parameter (in stage order, then model order) and its stage, and the likely causes it finds.

Exit status: 0 equivalent, 1 not equivalent, 2 a spec or run error (the CLI's convention).
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any

from fxpipe.errors import FxpipeError, SpecError
from fxpipe.units import plural

#: parameters listed after the last step (the largest differences relative to the tolerance)
SHOWN = 5


def _optimizer(spec, params):
    from fxpipe.training.worker import _optimizer as make

    return make(spec, params)


def _scheduler(spec, optimizer):
    from fxpipe.training.lr_schedule import build_scheduler

    t = spec.train
    s = t.lr_schedule
    if optimizer is None or not (s.warmup_steps or s.decay != "constant"):
        return None
    return build_scheduler(optimizer, t)


def _pipeline_rank(rank: int, plan_dict: dict, steps: int) -> dict:
    """One rank of the pipelined run (``fxpipe run``'s worker loop, without its files): the
    losses, and the parameters this rank holds (replica 0's ranks only)."""
    import torch

    from fxpipe.data.batches import get_batch, make_batches
    from fxpipe.plans.plan import Plan
    from fxpipe.specs.loader import build_model, load_spec
    from fxpipe.training.compiled import compile

    try:
        plan = Plan.from_dict(plan_dict)
        spec = load_spec(plan.spec)
        t = spec.train
        pipe = compile(build_model(spec), plan)
        optimizer = _optimizer(spec, list(pipe.parameters()))
        if optimizer is not None:
            optimizer = pipe.shard_optimizer(optimizer)
        scheduler = _scheduler(spec, optimizer)
        batches = make_batches(spec)
        k = t.grad_accumulation
        losses = []
        for step in range(steps):
            loss = 0.0
            for j in range(k):
                loss += pipe.step(get_batch(batches, spec, step * k + j)) / k
            losses.append(loss)
            if t.grad_clip:
                pipe.clip_grad_norm_(t.grad_clip)
            if optimizer is not None and math.isfinite(loss):
                optimizer.step()
            if scheduler is not None:
                scheduler.step()
            pipe.zero_grad()
        names = {n for n, _ in pipe.named_parameters()}
        state = pipe.state_dict()
        # numpy arrays: tensors would travel as shared memory that dies with this process
        params = {n: v.detach().to("cpu", torch.float64).numpy().copy()
                  for n, v in state.items() if n in names}
        return {"losses": losses, "params": params if pipe.replica == 0 else {}}
    except FxpipeError as e:
        return {"error": f"rank {rank}: {e}"}


def _forward_loss(model, batch, spec, plan, loss_fn):
    """The reference forward and loss of one whole batch (what the pipeline's micro-batches
    add up to)."""
    from fxpipe.partitioner.trace import pick_output, trace_kwargs

    kwargs = trace_kwargs(model, {k: v for k, v in batch.kwargs.items()
                                  if k in plan.model_inputs})
    out = pick_output(model(*batch.args, **kwargs), spec.loss_output, plan.model)
    return out, (out if loss_fn is None else loss_fn(out, batch.target))


def _reference(spec, plan, steps: int, eps: float, terms: int):
    """Train the model in this process: losses, final parameters, and the per-entry AdamW
    tolerance (None for SGD) and the largest update seen (for SGD's tolerance)."""
    import torch

    from fxpipe.data.batches import get_batch, make_batches
    from fxpipe.execution.dtypes import autocast_dtype
    from fxpipe.specs.loader import build_model
    from fxpipe.training.equivalence import AdamBound
    from fxpipe.execution.losses import MODEL_LOSS, resolve_loss

    t = spec.train
    model = build_model(spec)
    model.train()
    named = dict(model.named_parameters())
    init = {n: p.detach().clone() for n, p in named.items()}
    optimizer = _optimizer(spec, list(named.values()))
    scheduler = _scheduler(spec, optimizer)
    adam = AdamBound(named) if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) \
        else None
    loss_fn = None if t.loss == MODEL_LOSS else resolve_loss(t.loss, t.ignore_index)
    amp = autocast_dtype(t.precision)
    batches = make_batches(spec)
    k = t.grad_accumulation
    losses = []
    for step in range(steps):
        loss_sum = 0.0
        for j in range(k):
            batch = get_batch(batches, spec, step * k + j)
            with torch.autocast("cpu", dtype=amp or torch.float32, enabled=amp is not None):
                _, loss = _forward_loss(model, batch, spec, plan, loss_fn)
            (loss.float() / k).backward()
            loss_sum += float(loss.detach()) / k
        losses.append(loss_sum)
        grads = [p.grad for p in named.values() if p.grad is not None]
        g = max((float(x.abs().max()) for x in grads), default=0.0)
        if t.grad_clip:
            torch.nn.utils.clip_grad_norm_(list(named.values()), t.grad_clip)
        if optimizer is not None and math.isfinite(loss_sum):
            optimizer.step()
            if adam is not None:
                adam.update(optimizer, named, g, terms, step, eps)
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad() if optimizer is not None else None
    final = {n: p.detach().clone() for n, p in named.items()}
    moved = max((float((final[n] - init[n]).abs().max()) for n in final), default=0.0)
    return model, losses, final, adam, moved


def _first_batch_loss_check(model, spec, plan, eps):
    """:func:`~fxpipe.training.equivalence.loss_not_a_mean` on the first batch with the
    trained reference model (None for a model that computes its own loss)."""
    import torch

    from fxpipe.data.batches import get_batch, make_batches
    from fxpipe.training.equivalence import loss_not_a_mean
    from fxpipe.execution.losses import MODEL_LOSS, count_targets, resolve_loss
    from fxpipe.training.losses import microbatch_weights

    t = spec.train
    if t.loss == MODEL_LOSS:
        return None
    loss_fn = resolve_loss(t.loss, t.ignore_index)
    batch = get_batch(make_batches(spec), spec, 0)
    with torch.no_grad():
        out, _ = _forward_loss(model, batch, spec, plan, None)
    parts = plan.dp * plan.microbatches
    count = lambda b: count_targets(b.target, t.ignore_index)  # noqa: E731
    weights = []
    for r in range(plan.dp):
        weights += [w / plan.dp for w in microbatch_weights(batch, r, plan.dp, plan.microbatches,
                                                            count)]
    return loss_not_a_mean(loss_fn, out.float(), batch.target, parts, weights, eps)


def _fmt(x: float) -> str:
    return f"{x:.3g}" if x else "0"


def memory_levers(plan) -> str:
    """The memory levers the plan exercises, for the check's header: recomputation per stage
    mode (selective, full, partial: the first N blocks), activation offload, data sharding
    and per-block parameter gathering; ``none`` where it uses none."""
    def stages(idx: list[int]) -> str:
        if len(idx) == plan.num_stages and len(idx) > 1:
            return "every stage"
        return f"stage{'s' if len(idx) > 1 else ''} {', '.join(map(str, idx))}"

    parts = []
    by_mode: dict[str, list[int]] = {}
    for j, st in enumerate(plan.stages):
        by_mode.setdefault(st.recompute_mode, []).append(j)
    for mode in ("selective", "full", "partial"):
        idx = by_mode.get(mode)
        if not idx:
            continue
        what = mode + " recomputation"
        if mode == "partial":
            blocks = sorted({plan.stages[j].recompute_blocks for j in idx})
            what = ("partial recomputation (first "
                    + "/".join(map(str, blocks)) + f" block{'s' if blocks != [1] else ''})")
        parts.append(f"{what} on {stages(idx)}")
    off = [j for j, st in enumerate(plan.stages) if st.offload_bytes]
    if off:
        parts.append(f"activation offload on {stages(off)}")
    if plan.data_sharding != "none" and plan.replicas > 1:
        parts.append(f"data sharding {plan.data_sharding}")
    blk = [j for j, st in enumerate(plan.stages) if st.param_gather == "block"]
    if blk:
        parts.append(f"param_gather: block on {stages(blk)}")
    return "; ".join(parts) if parts else "none (activations kept, parameters whole)"


def check(spec_ref: Any, steps: int | None = None, out=None) -> int:
    """Run the check (see the module doc), print the comparison to ``out`` (stdout) and
    return the exit status: 0 equivalent, 1 not.

    Raises:
        FxpipeError: a bad spec, a plan that cannot be made, a rank that failed.
    """
    import torch

    from fxpipe.partitioner.driver import plan_from_spec
    from fxpipe.reports.progress import planning_progress
    from fxpipe.runtime.local_ranks import run_ranks
    from fxpipe.specs.loader import load_spec
    from fxpipe.training.equivalence import EPS, bound, compare_params, likely_causes, \
        loss_tolerance
    from fxpipe.training.launch import _check_loss_fits
    from fxpipe.execution.losses import resolve_loss

    out = out or sys.stdout

    def say(line: str = "") -> None:
        print(line, file=out, flush=True)

    spec = load_spec(spec_ref)
    t = spec.train
    if steps is None:
        steps = min(t.steps, 3)
    if steps < 1:
        raise FxpipeError(f"--steps must be at least 1 (got {steps})")
    if t.updates == "async":
        raise SpecError("train.updates: async lets replicas train on stale weights, which is "
                        "not meant to equal single-process training; check the spec with "
                        "updates: sync")
    resolve_loss(t.loss, t.ignore_index)
    notes = []
    train = {"steps": steps}
    if spec.cluster.device != "cpu":
        notes.append(f"cluster.device {spec.cluster.device}: checked on CPU ranks (gloo)")
        spec = spec.model_copy(update={"cluster": spec.cluster.model_copy(
            update={"device": "cpu", "gpu": None})})  # (a GPU profile needs device: cuda)
        if t.precision == "fp8":  # no FP8 tensor cores on CPU: the same run in bf16
            notes.append("train.precision fp8: checked in bf16 (CPU ranks have no FP8 "
                         "matmuls; the float8 rewrite has its own tests)")
            train["precision"] = "bf16"
        if t.cuda_graphs:
            notes.append("train.cuda_graphs: off on CPU ranks")
            train["cuda_graphs"] = False
    spec = spec.model_copy(update={"train": t.model_copy(update=train)})
    t = spec.train
    with planning_progress():
        plan, _ = plan_from_spec(spec)
    _check_loss_fits(spec, plan)
    eps = EPS[t.precision]
    k = t.grad_accumulation
    terms = spec.data.batch_size * k  # samples per optimizer step
    ranks = (f"{plural(plan.num_stages, 'stage')} on {plural(plan.pipeline, 'pipeline rank')}"
             if plan.num_stages != plan.pipeline else plural(plan.pipeline, 'stage'))
    layout = (f"{ranks} x {plural(plan.dp, 'replica')}"
              + (f" x tensor {plan.tensor}" if plan.tensor > 1 else "")
              + f", {plural(plan.microbatches, 'micro-batch').replace('batchs', 'batches')} of "
              f"{plan.microbatch_size}, {plan.schedule}")
    say(f"fxpipe check: {plural(steps, 'step')} of {plan.model} on the plan ({layout}; "
        f"{plural(plan.world_size, 'rank')}) against one process, {t.precision}, "
        f"{t.optimizer}" + (f", {k} batches per step" if k > 1 else ""))
    say(f"memory levers exercised: {memory_levers(plan)}")
    for note in notes:
        say(f"note: {note}")
    t0 = time.perf_counter()
    results = run_ranks(_pipeline_rank, plan.world_size, plan.to_dict(), steps,
                        timeout_s=600.0 + 120.0 * steps, dist_timeout_s=float(t.timeout_s))
    errors = [r["error"] for r in results if r and "error" in r]
    if errors:
        raise FxpipeError("the pipelined run failed: " + "; ".join(errors[:3]))
    pipe_losses = results[0]["losses"]
    got: dict[str, torch.Tensor] = {}
    for r in results:
        got.update({n: torch.from_numpy(v) for n, v in r["params"].items()})
    t1 = time.perf_counter()
    torch.manual_seed(t.seed)
    model, ref_losses, ref, adam, moved = _reference(spec, plan, steps, eps, terms)
    t2 = time.perf_counter()
    say(f"pipelined run {t1 - t0:.1f} s, single-process run {t2 - t1:.1f} s")
    say("")
    say(f"{'step':>4}  {'pipeline loss':>14}  {'one process':>14}  {'|diff|':>9}  "
        f"{'tolerance':>9}")
    loss_fail = None
    for s, (a, b) in enumerate(zip(pipe_losses, ref_losses)):
        tol = loss_tolerance(ref_losses, terms, s, eps)
        d = abs(a - b)
        ok = d <= tol
        if not ok and loss_fail is None:
            loss_fail = (s, d, tol)
        say(f"{s:>4}  {a:>14.8f}  {b:>14.8f}  {_fmt(d):>9}  {_fmt(tol):>9}"
            + ("" if ok else "  BEYOND"))

    # parameter tolerances (equivalence module doc)
    size = max((float(p.abs().max()) for p in ref.values()), default=0.0)
    base = bound(size, 1, steps, eps)
    if adam is not None:
        tols = {n: adam.tolerance(n) + base for n in ref}
        how = "per entry: AdamW's update at that entry's second moment"
    else:
        tols = {n: base + bound(moved, terms, steps, eps) for n in ref}
        how = f"largest update {_fmt(moved)}"
    stage_of: dict[str, int] = {}
    for st in plan.stages:
        for n in st.params:
            stage_of.setdefault(plan.param_aliases.get(n, n), st.index)
            stage_of.setdefault(n, st.index)
    missing = [n for n in ref if n not in got]
    if missing:
        raise FxpipeError(f"the pipelined run returned no value for {plural(len(missing), 'parameter')} "
                          f"({', '.join(missing[:3])}); please report it with the spec")
    diffs = compare_params(got, ref, tols, stage_of)
    worst = sorted(diffs, key=lambda d: (-d.ratio, -d.diff))
    say("")
    say(f"parameters after step {steps - 1}: largest differences ({len(diffs)} compared; "
        f"tolerance {eps:.3g} x {terms} samples x {steps} steps x size, {how})")
    say(f"  {'parameter':<40} {'stage':>5}  {'max |diff|':>10}  {'tolerance':>10}")
    for d in worst[:SHOWN]:
        say(f"  {d.name:<40} {'-' if d.stage is None else d.stage:>5}  {_fmt(d.diff):>10}  "
            f"{_fmt(d.tolerance):>10}" + (f"  BEYOND ({d.beyond} of {d.numel} entries)"
                                          if d.beyond else ""))
    largest = max(diffs, key=lambda d: d.diff)
    say(f"largest parameter difference: {largest.name} {_fmt(largest.diff)}")
    bad = [d for d in diffs if d.beyond]
    say("")
    if loss_fail is None and not bad:
        share = max([d.ratio for d in diffs] + [
            abs(a - b) / max(loss_tolerance(ref_losses, terms, s, eps), 1e-300)
            for s, (a, b) in enumerate(zip(pipe_losses, ref_losses))])
        say(f"verdict: EQUIVALENT: every loss and parameter within the {t.precision} tolerance "
            f"(the closest at {100 * share:.0f}% of it)")
        return 0
    say(f"verdict: NOT EQUIVALENT (beyond the {t.precision} tolerance)")
    if loss_fail is not None:
        s, d, tol = loss_fail
        say(f"  first loss beyond it: step {s}, |diff| {_fmt(d)} > {_fmt(tol)}")
    if bad:
        order = {n: i for i, n in enumerate(ref)}
        first = min(bad, key=lambda d: (d.stage if d.stage is not None else 1 << 30,
                                        order[d.name]))
        where = f"stage {first.stage}" if first.stage is not None else "no stage"
        say(f"  first diverging parameter: {first.name} ({where}), max |diff| "
            f"{_fmt(first.diff)} > {_fmt(first.tolerance)}; {len(bad)} of {len(diffs)} "
            "parameters beyond")
    causes = likely_causes(
        model, microbatches=plan.microbatches, dp=plan.dp, mbs=plan.microbatch_size,
        loss_check=_first_batch_loss_check(model, spec, plan, eps), loss_name=t.loss,
        compression=t.grad_compression, warmup_steps=t.compression.warmup_steps)
    if causes:
        say("likely causes:")
        for c in causes:
            say(f"  {c.text()}")
    else:
        say("no likely cause detected (no BatchNorm, dropout, non-mean loss or hook found); "
            "please report it with the spec")
    return 1
