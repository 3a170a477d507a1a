"""The per-rank training worker started by ``fxpipe run`` (through torchrun).

``python -m fxpipe.training.worker --plan OUT/plan.json --out OUT [--resume]`` on every rank:
rebuild the model from the plan's spec (same seed everywhere), compile this rank's share of it
(:func:`fxpipe.compile`: the same code path as a user's own training script) and train it with
the plan's schedule in the spec's ``train.precision`` (fp32, or bf16/fp16 autocast with fp32
master weights; fp16 with dynamic loss scaling), the spec's optimizer, learning-rate schedule,
gradient clipping and accumulation. Rank 0 shows progress (step, loss, tokens/s, time left: a
bar on a terminal, plain lines otherwise, :mod:`fxpipe.reports.progress`), writes
``environment.json`` (:mod:`fxpipe.training.run_record`) and appends
to ``losses.csv`` (flushed every row); all ranks write checkpoints (see
:mod:`fxpipe.training.checkpoint`: model, optimizer, RNG, step, schedule and loss-scaler state)
and rank 0 writes the measured timeline (Chrome trace JSON, one track per rank, the optimizer
steps included).

Resuming (``--resume``, or a restart after a failure under ``train.max_restarts``): every rank
loads the latest checkpoint (under any plan: keys are parameter names), ``losses.csv`` keeps
the rows before its step, and training continues from there; on CPU the losses equal an
uninterrupted run's bit for bit. A run that stopped for a reason a restart would meet again
(a non-finite loss, a bad dataset) leaves each stopped rank's reason in ``.stopped/``: the
launcher prints it, and restarts end at once instead of training again.

Under ``train.updates: async`` the servers serve and the replicas train at their own pace
(:func:`train_async`, on :mod:`fxpipe.training.async_updates`: its logs, its final
checkpoint).

Size: over 600 lines because it is a rank's whole run in order (data, checkpoints, steps,
evaluation, logging), read top to bottom."""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from pathlib import Path
from typing import Callable

from fxpipe.errors import (FxpipeError, RuntimeFailure, SpecError, TrainingStopped, first_line,
                           peer_gone)

# torch is imported inside the functions: a Ctrl-C while a worker is still starting then ends
# in main()'s handler instead of a traceback from the middle of `import torch`.

#: folder of the run where each rank that stopped training for a reason a restart would meet
#: again records why (``rank<R>.txt``); the launcher says it (:func:`stop_messages`)
STOPPED = ".stopped"
#: folder of the run where each rank that failed because another rank ended first leaves an
#: empty ``rank<R>`` (:func:`lost_peer_ranks`): not where a failure began
LOST_PEER = ".lost_peer"
LOSSES = "losses.csv"
_HEADER = ["step", "loss", "step_time_s"]


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
    if ids:
        return "tokens", batch_size * ids[0].shape[1]
    return "samples", batch_size


class LossLog:
    """Rank 0's ``losses.csv``: one row per optimizer step, the loss at full precision (its
    ``repr``: a resumed run's rows compare bit for bit), flushed as it is written so a crash loses
    nothing. Created at the first row (a run that fails before any step leaves no loss file)."""

    def __init__(self, path: Path, unit: str, start: int = 0):
        self.path, self.header = path, [*_HEADER, f"{unit}_per_s"]
        self._fh = self._writer = None
        if start > 0 and path.exists():  # resuming: keep the rows before the checkpoint's step
            with open(path, newline="") as f:
                rows = list(csv.reader(f))
            kept = [r for r in rows[1:] if r and r[0].isdigit() and int(r[0]) < start]
            self._open("w")
            for row in kept:
                self._writer.writerow(row)
            self._fh.flush()
        elif start == 0 and path.exists():
            path.unlink()  # a restart before the first checkpoint: start the file again

    def _open(self, mode: str) -> None:
        self._fh = open(self.path, mode, newline="")
        self._writer = csv.writer(self._fh)
        if mode == "w":
            self._writer.writerow(self.header)

    def write(self, step: int, loss: float, dt: float, rate: float) -> None:
        if self._writer is None:
            self._open("a" if self.path.exists() else "w")
        self._writer.writerow([step, repr(loss), f"{dt:.4f}", f"{rate:.1f}"])
        self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()


def _weights_finite(pipe) -> bool:
    """True when every rank's parameters are finite (one all-reduce over all ranks)."""
    import torch
    import torch.distributed as dist

    bad = any(not bool(torch.isfinite(p).all()) for p in pipe.parameters())
    flag = torch.tensor([int(bad)])
    if dist.get_backend() == "nccl":
        flag = flag.cuda()
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return not int(flag.item())


def _stop(out: Path, rank: int, message: str) -> None:
    """Record why this rank stopped training (a reason a restart would meet again), atomically
    and before the rank exits: the launcher prints it (:func:`stop_messages`), as no rank can:
    the launcher ends the other ranks as soon as the first one exits."""
    _record(out / STOPPED, f"rank{rank}.txt", message)


def _record(folder: Path, name: str, text: str = "") -> None:
    """Write ``folder/name`` atomically (the launcher may read it while the rank exits)."""
    folder.mkdir(exist_ok=True)
    tmp = folder / f".{name}.tmp"
    tmp.write_text(text)
    os.replace(tmp, folder / name)


def stop_messages(out: Path) -> dict[int, str]:
    """Why the ranks of the run in ``out`` stopped training (:func:`_stop`): rank -> message,
    by rank; empty when none did."""
    found = {}
    for f in (out / STOPPED).glob("rank*.txt"):
        try:
            found[int(f.stem[4:])] = f.read_text()
        except (OSError, ValueError):
            continue
    return dict(sorted(found.items()))


def lost_peer_ranks(out: Path) -> set[int]:
    """The ranks of the run in ``out`` that failed because another rank ended first."""
    return {int(f.name[4:]) for f in (out / LOST_PEER).glob("rank*") if f.name[4:].isdigit()}


def clear_exit_records(out: Path) -> None:
    """Forget earlier runs' :func:`_stop` and lost-peer records in ``out`` (a resumed run
    starts anew)."""
    import shutil

    for folder in (STOPPED, LOST_PEER):
        shutil.rmtree(out / folder, ignore_errors=True)


def restart_count() -> int:
    """How many times torchrun restarted the workers (``TORCHELASTIC_RESTART_COUNT``)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def train(plan_path: Path, out: Path, resume: bool = False) -> None:
    """Train one rank's share of the plan at ``plan_path``; outputs go to ``out``.

    The loop is a user's training script on :func:`fxpipe.compile`: the spec's optimizer over
    ``pipe.parameters()``, ``train.lr_schedule`` (warm-up, then constant or cosine),
    ``train.grad_accumulation`` global batches per optimizer step, ``train.grad_clip``; a
    non-finite loss stops the run (``train.nan_policy: stop``) or drops that step's update
    (``skip``).

    Args:
        plan_path: the plan (``OUT/plan.json``).
        out: the run folder.
        resume: continue from the latest checkpoint in ``out`` (also done on a torchrun
            restart, when one exists).

    Raises:
        FxpipeError: bad plan, a peer timed out, shapes disagree with the plan, the loss is not
            finite, no checkpoint to resume from.
    """
    import math

    import torch.distributed as dist

    from fxpipe.data.batches import get_batch, make_batches
    from fxpipe.plans.plan import Plan
    from fxpipe.execution.compiled_stage import (compile_counters, compile_report,
                                               rank_compile_state)
    from fxpipe.runtime.mesh import init_distributed
    from fxpipe.runtime.threads import set_rank_threads
    from fxpipe.schedule.timeline import write_chrome_trace
    from fxpipe.specs.loader import build_model, load_spec
    from fxpipe.training.checkpoint import (clean_partial, latest_checkpoint, load_checkpoint,
                                            save_checkpoint)
    from fxpipe.training.compiled import compile
    from fxpipe.training.lr_schedule import build_scheduler, lr_factor
    from fxpipe.training.run_record import OptimizerTimer, environment, write_environment

    plan = Plan.load(plan_path)
    spec = load_spec(plan.spec)
    t = spec.train
    set_rank_threads()  # 1, or OMP_NUM_THREADS
    init_distributed(spec.cluster.device, t.timeout_s)
    rank = dist.get_rank()
    restarts = restart_count()
    stopped = stop_messages(out) if restarts else {}
    if stopped:  # the launcher said why: it would meet it again
        raise TrainingStopped(next(iter(stopped.values())))
    if t.updates == "async":  # parameter servers: fxpipe.training.async_updates
        train_async(plan_path, out, resume=resume, restarts=restarts)
        dist.barrier()
        dist.destroy_process_group()
        return
    pipe = compile(build_model(spec), plan)
    executor = pipe.executor
    setting = executor.compile_setting
    if rank == 0 and setting is not None and not setting.on and t.compile == "auto" \
            and pipe.device.type == "cuda":  # auto meant to compile here but cannot: why
        print(setting.note, flush=True)
    optimizer = _optimizer(spec, list(pipe.parameters()))
    if optimizer is not None:  # parallel.data_sharding: this replica's slices
        optimizer = pipe.shard_optimizer(optimizer)
    sched = t.lr_schedule
    scheduler = (build_scheduler(optimizer, t) if optimizer is not None
                 and (sched.warmup_steps or sched.decay != "constant") else None)
    ckpt_root = out / t.checkpoint.dir
    start = position = 0
    if resume or restarts:
        if rank == 0:
            for stale in clean_partial(ckpt_root):
                print(f"removed {stale} (a save that did not finish)", flush=True)
        dist.barrier()
        latest = latest_checkpoint(ckpt_root)
        if latest is None and resume:
            raise RuntimeFailure(f"--resume: {ckpt_root} holds no checkpoint to resume from")
        if latest is not None:
            state = load_checkpoint(pipe.module, latest, optimizer=optimizer,
                                    tensor=pipe.tensor_shards)
            start = int(state["step"])
            # batches read so far (older checkpoints: steps x this run's accumulation)
            position = int(state.get("data_position") or start * t.grad_accumulation)
            if scheduler is not None and state.get("lr_schedule"):
                scheduler.load_state_dict(state["lr_schedule"])
            if executor.loss_scaler is not None and state.get("loss_scaler"):
                executor.loss_scaler.load_state_dict(state["loss_scaler"])
            if rank == 0:
                why = "resuming" if resume and not restarts else f"restart {restarts}: resuming"
                print(f"{why} from {latest} (step {start} of {t.steps})", flush=True)
    if start >= t.steps:
        raise RuntimeFailure(f"the checkpoint in {ckpt_root} is at step {start}, and train.steps "
                             f"is {t.steps}: nothing left to train; raise train.steps (or "
                             "--steps) to continue")
    batches = make_batches(spec)
    k = t.grad_accumulation
    # global batch index of step s's j-th accumulation part: the stream continues where the
    # checkpoint left it, whatever the pipeline, data degree or accumulation now
    first = position - start * k
    unit, items_per_step = _throughput_unit(plan, spec.data.batch_size * k)
    log = LossLog(out / LOSSES, unit, start) if rank == 0 else None
    env = environment(pipe.device)  # collective: every rank's device and host
    if rank == 0:
        from fxpipe.reports.progress import TrainingProgress

        write_environment(out, env)
        progress = TrainingProgress(t.steps, unit, t.log_every, start=start)
        if "tensorboard" in t.log:
            from fxpipe.training.tensorboard_log import TensorBoardLog

            board = TensorBoardLog(out, unit)
    opt_timer = OptimizerTimer(rank)  # optimizer steps on the timeline
    skipped: list[int] = []

    def save(step: int) -> None:
        state = {"data_position": first + step * k,
                 "lr_schedule": scheduler.state_dict() if scheduler is not None else None,
                 "loss_scaler": (executor.loss_scaler.state_dict()
                                 if executor.loss_scaler is not None else None)}
        save_checkpoint(pipe.module, ckpt_root, step, optimizer=optimizer, train_state=state,
                        tensor=pipe.tensor_shards)

    t_start = time.perf_counter()
    counted = [compile_counters()]  # train.compile: before the first step, after it, at the end
    for step in range(start, t.steps):
        t0 = time.perf_counter()
        loss = 0.0
        for j in range(k):
            try:
                batch = get_batch(batches, spec, first + step * k + j)
            except SpecError as e:
                _stop(out, rank, f"step {step}: {e}")
                raise TrainingStopped(f"step {step}: {e}") from None
            try:
                loss += pipe.step(batch) / k
            except FxpipeError as e:
                raise type(e)(f"step {step}: {e}") from None
        if not math.isfinite(loss):
            if t.nan_policy == "stop":
                message = (f"step {step}: the loss is {loss} (not finite); training stopped. "
                           f"The latest checkpoint (if any) in {ckpt_root} is from before it. "
                           f"Lower train.lr (now {t.lr:g}), set train.grad_clip"
                           + (", use fp32" if t.precision != "fp32" else "")
                           + ", or set train.nan_policy: skip to drop such steps")
                _stop(out, rank, message)
                raise TrainingStopped(message)
            if not _weights_finite(pipe):  # skipping cannot recover weights that are NaN
                message = (f"step {step}: the loss is {loss} (not finite) and so are the "
                           "weights (an earlier update made them so): skipping steps cannot "
                           f"recover; training stopped. Lower train.lr (now {t.lr:g}) or set "
                           "train.grad_clip, and resume from a checkpoint before it")
                _stop(out, rank, message)
                raise TrainingStopped(message)
            skipped.append(step)
            pipe.zero_grad()
            if rank == 0:
                print(f"step {step:5d}/{t.steps}  loss {loss} (not finite): update skipped "
                      "(train.nan_policy: skip)", flush=True)
        opt_timer.start()
        norm = float(pipe.clip_grad_norm_(t.grad_clip)) if t.grad_clip else None
        if optimizer is not None and math.isfinite(loss):
            optimizer.step()
        if scheduler is not None:
            scheduler.step()
        pipe.zero_grad()
        opt_timer.stop()
        dt = time.perf_counter() - t0
        if rank == 0:
            log.write(step, loss, dt, items_per_step / dt)
            lr = t.lr * lr_factor(step, t.steps, sched.warmup_steps, sched.decay, t.lr,
                                  sched.min_lr)
            extra = f"  lr {lr:.2e}" + (f"  grad norm {norm:.3f}" if norm is not None else "")
            progress.update(step, loss, items_per_step / dt, dt, extra)  # bar or plain lines
            if "tensorboard" in t.log:
                board.step(step, loss, dt, items_per_step / dt, lr, norm)
        if step == start:
            counted.append(compile_counters())
        every = t.checkpoint.every
        if every and (step + 1) % every == 0 and step + 1 < t.steps:
            save(step + 1)
    save(t.steps)
    wall = time.perf_counter() - t_start
    events = [None] * dist.get_world_size()
    dist.all_gather_object(events, executor.events + opt_timer.events)
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, executor.peak_inflight)
    compiling = [None] * dist.get_world_size()
    dist.all_gather_object(compiling, rank_compile_state(executor.compiled, counted[0],
                                                         counted[1], compile_counters()))
    if rank == 0:
        progress.close()
        log.close()
        write_chrome_trace([e for evs in events for e in evs], out / "timeline.json",
                           process_name="fxpipe measured")
        if "tensorboard" in t.log:
            board.timeline([e for evs in events for e in evs], start)
            board.close()
        per_stage: dict[int, int] = {}
        for peak in peaks:
            for stage, n in peak.items():
                per_stage[stage] = max(per_stage.get(stage, 0), n)
        held = ", ".join(f"stage {s}: {n}" for s, n in sorted(per_stage.items()))
        print(f"trained {t.steps - start} steps in {wall:.1f} s; peak micro-batches held per "
              f"stage: {held}", flush=True)
        for line in compile_report(compiling, executor.step_times_s):
            print(line, flush=True)
        if skipped:
            print(f"train.nan_policy skip: {len(skipped)} step(s) with a non-finite loss had "
                  f"their update dropped: {skipped[:10]}", flush=True)
        if executor.loss_scaler is not None:
            n = len(executor.skipped_steps)
            print(f"{t.precision} loss scaling: {n} batch{'' if n == 1 else 'es'} dropped for "
                  f"inf/NaN gradients {executor.skipped_steps[:10]}, final scale "
                  f"{executor.loss_scaler.scale:g}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _name_process(name: str) -> None:
    """Linux: the name ``ps``, ``top`` and ``/proc/PID/comm`` show for this process (at most 15
    bytes): every worker is a fork of the same fork server, with its command line."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def _watch_launcher(pid: int) -> None:
    """End this process (exit code 2) as soon as process ``pid`` has ended, from a daemon
    thread. The fork server a worker is forked from outlives a launcher killed with SIGKILL
    (every worker holds the server's keep-alive pipe), so the parent-death signal of
    :func:`_die_with_launcher` alone would leave the workers training on."""
    import threading

    def wait() -> None:
        try:
            import select

            fd = os.pidfd_open(pid)  # Linux 5.3+: readable once the process has ended
            select.select([fd], [], [])
        except (AttributeError, OSError):  # no pidfd: poll whether it still exists
            while True:
                time.sleep(0.5)
                try:
                    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                except (OSError, IndexError):
                    break
                if state in ("Z", "X"):
                    break
        os._exit(2)

    threading.Thread(target=wait, name="fxpipe-launcher-watch", daemon=True).start()


def _die_with_launcher() -> None:
    """Linux: end this worker when its parent dies, as on a node that goes down: a launcher
    killed by SIGKILL cannot stop its workers, and an orphaned worker would go on training with
    the other nodes. Under ``fxpipe run`` the parent is the launcher's fork server
    (:func:`launched` also watches the launcher itself)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the launcher died before the request took effect
        os._exit(2)


def train_async(plan_path: Path, out: Path, *, resume: bool = False, restarts: int = 0,
                after_backward: Callable[[int, int], None] | None = None) -> None:
    """``fxpipe run`` of a plan with ``train.updates: async`` on this rank (the process group
    is joined already; the caller destroys it).

    Args:
        plan_path: the plan. out: the run folder.
        resume, restarts: a resume or a torchrun restart (refused: async runs write only their
            final checkpoint).
        after_backward: test and benchmark hook, ``after_backward(replica, step)`` on every
            trainer rank after each backward (e.g. a sleep slowing one replica).

    Raises:
        FxpipeError: as :func:`train`.
    """
    import torch.distributed as dist

    from fxpipe.data.batches import get_batch, make_batches
    from fxpipe.plans.plan import Plan
    from fxpipe.schedule.timeline import write_chrome_trace
    from fxpipe.specs.loader import build_model, load_spec
    from fxpipe.training.checkpoint import save_checkpoint
    from fxpipe.training.compiled import _compile_async
    from fxpipe.training.run_record import environment, write_environment
    from fxpipe.training.async_updates import (REPLICA_FIELDS, REPLICA_LOSSES, ReplicaLog,
                                               buffers_module, merged_losses,
                                               read_replica_rows, serve, server_log_name,
                                               train_replica)

    plan = Plan.load(plan_path)
    spec = load_spec(plan.spec)
    t = spec.train
    if resume or restarts:
        raise RuntimeFailure("train.updates: async writes only its final checkpoint, so there "
                             "is nothing to resume from; start a new run (or use updates: sync "
                             "to resume)")
    rank = dist.get_rank()
    share = _compile_async(build_model(spec), plan)  # fxpipe.compile refuses async
    if rank == 0:  # the logs below are appended row by row: none left from an earlier run
        for name in (REPLICA_LOSSES, LOSSES):
            (out / name).unlink(missing_ok=True)
    env = environment(share.device)  # collective (after the unlink: nobody appends before)
    ckpt_root = out / t.checkpoint.dir
    k = t.grad_accumulation
    unit, items = _throughput_unit(plan, spec.data.batch_size * k)
    per_replica = items // plan.dp
    t_start = time.perf_counter()
    rows: list[dict] = []
    events: list = []
    if getattr(share, "is_server", False):
        optimizer = _optimizer(spec, list(share.parameters()))
        log = serve(share, optimizer, log_path=out / server_log_name(share.index))
        stale = max((r["staleness"] for r in log), default=0)
        module = share.module
        save_kw = {"optimizer": optimizer}
        summary = (share.index, len(log), stale, len({r["round"] for r in log}))
    else:
        pipe = share
        batches = make_batches(spec)
        progress = None
        if rank == 0:
            from fxpipe.reports.progress import TrainingProgress

            write_environment(out, env)
            progress = TrainingProgress(t.steps, unit, t.log_every)

        def on_step(c: int, loss: float, dt: float, version: int) -> None:
            if progress is not None and c < t.steps:
                progress.update(c, loss, per_replica / dt, dt,
                                f"  (replica 0; weights version {version})")

        def batch_of(i: int):
            try:
                return get_batch(batches, spec, i)
            except SpecError as e:
                _stop(out, rank, f"batch {i}: {e}")
                raise TrainingStopped(f"batch {i}: {e}") from None

        hook = None
        if after_backward is not None:
            hook = lambda c: after_backward(pipe.replica, c)  # noqa: E731
        # replica_losses.csv row by row (pipeline rank 0 of each replica), flushed: a failed
        # run keeps its steps, and rank 0 then writes losses.csv from them
        rlog = ReplicaLog(out / REPLICA_LOSSES) if pipe.pipe_rank == 0 else None
        try:
            rows = train_replica(pipe, batch_of, nan_policy=t.nan_policy, on_step=on_step,
                                 after_backward=hook, log=rlog)
        except BaseException as e:
            if isinstance(e, TrainingStopped):
                _stop(out, rank, str(e))
            if rlog is not None:
                rlog.close()
                rlog = None
            if rank == 0 and (out / REPLICA_LOSSES).exists():
                log = LossLog(out / LOSSES, unit)
                for c, loss, dt, rate in merged_losses(read_replica_rows(out / REPLICA_LOSSES),
                                                       per_replica):
                    log.write(c, loss, dt, rate)
                log.close()
            raise
        if rlog is not None:
            rlog.close()
        if progress is not None:
            progress.close()
        events = pipe.executor.events
        module = buffers_module(pipe)
        save_kw = {}
        summary = None
    wall = time.perf_counter() - t_start
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, (rows if share.mesh.pipe_rank == 0 else [], events, summary))
    save_checkpoint(module, ckpt_root, t.steps,
                    train_state={"updates": "async", "max_staleness": t.max_staleness},
                    **save_kw)
    if rank != 0:
        return
    all_rows = [r for rs, _, _ in every for r in rs]
    tmp = out / f".{REPLICA_LOSSES}.tmp"  # every replica's rows (other nodes' too), in order
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=REPLICA_FIELDS)
        w.writeheader()
        for r in sorted(all_rows, key=lambda r: (r["wall_s"], r["replica"])):
            w.writerow({**r, "loss": repr(r["loss"])})
    os.replace(tmp, out / REPLICA_LOSSES)
    log = LossLog(out / LOSSES, unit)
    for c, loss, dt, rate in merged_losses(all_rows, per_replica):
        log.write(c, loss, dt, rate)
    log.close()
    write_chrome_trace([e for _, evs, _ in every for e in evs], out / "timeline.json",
                       process_name="fxpipe measured")
    steps = {}
    for r in all_rows:
        steps[r["replica"]] = steps.get(r["replica"], 0) + 1
    servers = [s for _, _, s in every if s is not None]
    print(f"trained {sum(steps.values())} replica-steps in {wall:.1f} s (asynchronous updates, "
          f"max_staleness {t.max_staleness}): "
          + ", ".join(f"replica {d}: {n}" for d, n in sorted(steps.items()))
          + "; " + "; ".join(f"server {j}: {n} gradients in {rounds} updates, staleness at "
                             f"most {s}" for j, n, s, rounds in sorted(servers)), flush=True)


def launched(plan: str, out: str, resume: bool, env: dict[str, str], launcher: int) -> None:
    """One worker of ``fxpipe run``: torchrun's launcher (process ``launcher``) forks it from
    its fork server (``start_method="forkserver"``, :mod:`fxpipe.training.fork_server`) and sets the rank's
    environment first; ``env`` is what the launcher set after the server started (threads,
    progress, the socket interface). Exits with :func:`main`'s code when it is not 0 (the
    launcher then sees a failed worker).

    Like torchrun's own subprocess workers, each worker runs in a session of its own: a Ctrl-C
    on the terminal reaches the launcher only, which stops the workers. A worker ends when the
    launcher ends (:func:`_watch_launcher`), even when it was killed with SIGKILL."""
    os.setsid()
    import signal

    signal.signal(signal.SIGINT, signal.default_int_handler)  # the server ignored it
    os.environ.update(env)
    _name_process(f"fxpipe-rank{os.environ.get('RANK', '?')}")
    _watch_launcher(launcher)
    code = main(["--plan", plan, "--out", out, *(["--resume"] if resume else [])])
    if code:
        sys.exit(code)


def main(argv: list[str] | None = None) -> int:
    """Worker entry point; returns the exit code (2 on an error, 130 on Ctrl-C). Every error
    ends in one line naming this rank, never a traceback."""
    ap = argparse.ArgumentParser(prog="python -m fxpipe.training.worker")
    ap.add_argument("--plan", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args(argv)
    os.environ.setdefault("TORCH_SHOW_CPP_STACKTRACES", "0")
    _die_with_launcher()
    try:
        train(args.plan, args.out, args.resume)
    except KeyboardInterrupt:
        return 130
    except BaseException as e:  # noqa: BLE001 - one line per rank, whatever failed
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else \
            os.environ.get("RANK", "?")
        if isinstance(e, TrainingStopped):
            return 2  # recorded (_stop): the launcher says it once
        lost = peer_gone(e)
        if lost:  # a consequence: the launcher names the rank that ended first
            try:
                _record(args.out / LOST_PEER, f"rank{rank}")
            except OSError:
                pass
        if isinstance(e, FxpipeError):
            what = str(e)
        elif lost:
            what = "lost contact with another rank: it ended first (stopped, failed or killed)"
        else:
            what = f"unexpected {first_line(e)} (please report it with the spec)"
        sys.stderr.write(f"fxpipe: error on rank {rank}: {what}\n")  # one write: whole lines
        sys.stderr.flush()
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
