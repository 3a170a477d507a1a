"""The per-rank training worker started by ``fxpipe run`` (through torchrun).

``python -m fxpipe.training.worker --plan OUT/plan.json --out OUT`` on every rank:
rebuild the model from the plan's spec (same seed everywhere), compile this rank's share of it
(:func:`fxpipe.compile`: the same code path as a user's own training script) and train it with
the plan's schedule in the spec's ``train.precision`` (fp32, or bf16/fp16 autocast with fp32
master weights; fp16 with dynamic loss scaling), the spec's optimizer, learning-rate schedule,
gradient clipping and accumulation. Rank 0 shows progress (step, loss, tokens/s, time left: a
bar on a terminal, plain lines otherwise, :mod:`fxpipe.reports.progress`), writes
``environment.json`` (:mod:`fxpipe.training.run_record`) and ``losses.csv``; all ranks write
checkpoints (torch.distributed.checkpoint, keyed by the original parameter FQNs) and rank 0
writes the measured timeline (Chrome trace JSON, one track per rank, the optimizer steps
included).
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

from fxpipe.errors import FxpipeError

# torch is imported inside the functions: a Ctrl-C while a worker is still starting then ends
# in main()'s handler instead of a traceback from the middle of `import torch`.


def _optimizer(spec, params):
    """The spec's optimizer over ``params``; None for a rank whose stages hold no parameter (a
    stage of only activations or reshapes)."""
    import torch

    if not params:
        return None
    t = spec.train
    if t.optimizer == "sgd":
        return torch.optim.SGD(params, lr=t.lr, weight_decay=t.weight_decay)
    return torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay)


def _throughput_unit(plan, batch_size: int) -> tuple[str, int]:
    """``("tokens", batch x seq_len)`` for a token-id input (int64 ``[batch, seq]``), else
    ``("samples", batch)``."""
    ids = [plan.values[n] for n in plan.model_inputs
           if plan.values[n].dtype == "int64" and len(plan.values[n].shape) == 2]
    first = ids[0] if ids else None
    if first is not None and first.dtype == "int64" and len(first.shape) == 2:
        return "tokens", batch_size * first.shape[1]
    return "samples", batch_size


def train(plan_path: Path, out: Path) -> None:
    """Train one rank's share of the plan at ``plan_path``; outputs go to ``out``.

    The loop is a user's training script on :func:`fxpipe.compile`: the spec's optimizer over
    ``pipe.parameters()``, ``train.lr_schedule`` (warm-up, then constant or cosine),
    ``train.grad_accumulation`` global batches per optimizer step, ``train.grad_clip``.

    Raises:
        FxpipeError: bad plan, a peer timed out, or shapes disagree with the plan.
    """
    import torch
    import torch.distributed as dist

    from fxpipe.data.batches import get_batch, make_batches
    from fxpipe.plans.plan import Plan
    from fxpipe.runtime.mesh import init_distributed
    from fxpipe.schedule.timeline import write_chrome_trace
    from fxpipe.specs.loader import build_model, load_spec
    from fxpipe.training.checkpoint import save_checkpoint
    from fxpipe.training.compiled import compile
    from fxpipe.training.lr_schedule import build_scheduler, lr_factor
    from fxpipe.training.run_record import OptimizerTimer, environment, write_environment

    plan = Plan.load(plan_path)
    spec = load_spec(plan.spec)
    t = spec.train
    torch.set_num_threads(1)
    init_distributed(spec.cluster.device, t.timeout_s)
    rank = dist.get_rank()
    pipe = compile(build_model(spec), plan)
    executor = pipe.executor
    optimizer = _optimizer(spec, list(pipe.parameters()))
    sched = t.lr_schedule
    scheduler = (build_scheduler(optimizer, t) if optimizer is not None
                 and (sched.warmup_steps or sched.decay != "constant") else None)
    batches = make_batches(spec)
    k = t.grad_accumulation
    unit, items_per_step = _throughput_unit(plan, spec.data.batch_size * k)
    env = environment(pipe.device)  # collective: every rank's device and host
    if rank == 0:
        from fxpipe.reports.progress import TrainingProgress

        write_environment(out, env)
        progress = TrainingProgress(t.steps, unit, t.log_every)
    opt_timer = OptimizerTimer(rank)  # optimizer steps on the timeline
    losses_path = out / "losses.csv"
    fh = writer = None  # rank 0 creates losses.csv after the first step: a run that fails
    # before any step leaves no loss file, so its folder does not count as an earlier run
    t_start = time.perf_counter()
    for step in range(t.steps):
        t0 = time.perf_counter()
        loss = 0.0
        for j in range(k):
            batch = get_batch(batches, spec, step * k + j)
            try:
                loss += pipe.step(batch) / k
            except FxpipeError as e:
                raise type(e)(f"step {step}: {e}") from None
        opt_timer.start()
        norm = float(pipe.clip_grad_norm_(t.grad_clip)) if t.grad_clip else None
        if optimizer is not None:
            optimizer.step()
        if scheduler is not None:
            scheduler.step()
        pipe.zero_grad()
        opt_timer.stop()
        dt = time.perf_counter() - t0
        if rank == 0:
            if writer is None:
                fh = open(losses_path, "w", newline="")
                writer = csv.writer(fh)
                writer.writerow(["step", "loss", "step_time_s", f"{unit}_per_s"])
            writer.writerow([step, f"{loss:.6f}", f"{dt:.4f}", f"{items_per_step / dt:.1f}"])
            if step % t.log_every == 0 or step == t.steps - 1:
                fh.flush()
            lr = t.lr * lr_factor(step, t.steps, sched.warmup_steps, sched.decay, t.lr,
                                  sched.min_lr)
            extra = f"  lr {lr:.2e}" + (f"  grad norm {norm:.3f}" if norm is not None else "")
            progress.update(step, loss, items_per_step / dt, dt, extra)  # bar or plain lines
        every = t.checkpoint.every
        if every and (step + 1) % every == 0 and step + 1 < t.steps:
            save_checkpoint({0: pipe.module}, out / t.checkpoint.dir, step + 1)
    save_checkpoint({0: pipe.module}, out / t.checkpoint.dir, t.steps)
    wall = time.perf_counter() - t_start
    events = [None] * dist.get_world_size()
    dist.all_gather_object(events, executor.events + opt_timer.events)
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, executor.peak_inflight)
    if rank == 0:
        progress.close()
        fh.close()
        write_chrome_trace([e for evs in events for e in evs], out / "timeline.json",
                           process_name="fxpipe measured")
        per_stage: dict[int, int] = {}
        for peak in peaks:
            for stage, n in peak.items():
                per_stage[stage] = max(per_stage.get(stage, 0), n)
        held = ", ".join(f"stage {s}: {n}" for s, n in sorted(per_stage.items()))
        print(f"trained {t.steps} steps in {wall:.1f} s; peak micro-batches held per "
              f"stage: {held}", flush=True)
        if executor.loss_scaler is not None:
            n = len(executor.skipped_steps)
            print(f"{t.precision} loss scaling: {n} batch{'' if n == 1 else 'es'} dropped for "
                  f"inf/NaN gradients {executor.skipped_steps[:10]}, final scale "
                  f"{executor.loss_scaler.scale:g}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Worker entry point; returns the exit code (2 on an fxpipe error, 130 on Ctrl-C)."""
    ap = argparse.ArgumentParser(prog="python -m fxpipe.training.worker")
    ap.add_argument("--plan", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args(argv)
    try:
        train(args.plan, args.out)
    except FxpipeError as e:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else "?"
        print(f"fxpipe: error on rank {rank}: {e}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
