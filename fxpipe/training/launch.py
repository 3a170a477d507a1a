"""``fxpipe run``: plan in this process, then start one worker process per device with torchrun's
launcher (``torch.distributed.launcher.api.elastic_launch``, the engine behind
``torch.distributed.run``), rendezvous on loopback unless ``--rdzv-endpoint`` says otherwise.

Multi-node: run the same command on every node with ``--nnodes N --rdzv-endpoint HOST:PORT``;
each node plans for itself (planning is deterministic) and starts ``cluster.devices_per_node``
workers.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from pathlib import Path

from fxpipe.errors import FxpipeError
from fxpipe.units import plural

#: Files whose presence marks a folder as holding an earlier training run (plan dumps alone do
#: not: they are regenerated from the spec).
RUN_MARKERS = ("losses.csv", "checkpoint", "timeline.json", "eval.json")


def holds_run(out: Path) -> bool:
    """True when ``out`` is a folder with the outputs of an earlier training run."""
    return out.is_dir() and any((out / m).exists() for m in RUN_MARKERS)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_output_dir(out: Path, overwrite: bool) -> None:
    """Raise FxpipeError if ``out`` is a file, or holds an earlier run and ``overwrite`` is
    False. Touches nothing."""
    if out.exists() and not out.is_dir():
        raise FxpipeError(f"output path {out} is a file; choose a folder with --out")
    if holds_run(out) and not overwrite:
        raise FxpipeError(
            f"{out} already holds an earlier run; pass --out NEW_DIR, or --overwrite to move "
            "the old run aside (it is renamed, not deleted)"
        )


def prepare_output_dir(out: Path, overwrite: bool) -> None:
    """Create ``out``; if it holds an earlier run, stop (or, with ``overwrite``, rename the old
    folder to ``<out>.old-<timestamp>``). Nothing is ever deleted.

    Raises:
        FxpipeError: see :func:`check_output_dir`.
    """
    check_output_dir(out, overwrite)
    if holds_run(out):
        aside = out.with_name(f"{out.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
        out.rename(aside)
        print(f"moved the earlier run to {aside}")
    out.mkdir(parents=True, exist_ok=True)


def _check_endpoint(endpoint: str) -> None:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise FxpipeError(f"--rdzv-endpoint {endpoint!r} is not HOST:PORT (e.g. node0:29500)")


def _check_launchable(spec, nnodes: int, endpoint: str | None) -> None:
    """Everything that would otherwise fail only after the workers start."""
    import torch

    from fxpipe.training.losses import resolve_loss

    if nnodes < 1:
        raise FxpipeError(f"--nnodes must be at least 1 (got {nnodes})")
    if nnodes != spec.cluster.nodes:
        raise FxpipeError(
            f"--nnodes {nnodes} disagrees with cluster.nodes={spec.cluster.nodes} in the spec; "
            "make them equal"
        )
    if nnodes > 1 and not endpoint:
        raise FxpipeError("multi-node runs need --rdzv-endpoint HOST:PORT (the same on every node)")
    if endpoint:
        _check_endpoint(endpoint)
    resolve_loss(spec.train.loss, spec.train.ignore_index)
    if spec.cluster.device == "cuda":
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < spec.cluster.devices_per_node:
            raise FxpipeError(
                f"cluster.device is cuda with {spec.cluster.devices_per_node} devices per node, "
                f"but this machine has {plural(have, 'CUDA device')}; set cluster.device: cpu or run on "
                "a machine with enough GPUs"
            )


def _check_loss_fits(spec, plan) -> None:
    """Apply ``train.loss`` to meta tensors shaped like one micro-batch's model output and
    target, so a loss that does not fit the model fails here, not on every worker.

    Raises:
        SpecError: the loss raises on those shapes.
    """
    import torch

    from fxpipe.data.batches import example_microbatch
    from fxpipe.errors import SpecError
    from fxpipe.specs.loader import spec_location
    from fxpipe.training.losses import MODEL_LOSS, resolve_loss

    out = plan.values[plan.model_output]
    if spec.train.loss == MODEL_LOSS:
        if out.shape:
            where = spec_location(spec, "train.loss")
            raise SpecError(f"{where + ': ' if where else ''}train.loss is 'model' but the "
                            f"output the loss reads ({plan.model_output}, {tuple(out.shape)}) is "
                            "not a scalar; feed the model its labels (a dict batch with "
                            "'labels') or set model.output to the loss output")
        return
    output = torch.empty(out.shape, dtype=getattr(torch, out.dtype), device="meta")
    target = example_microbatch(spec, plan.microbatch_size).target.to("meta")
    try:
        resolve_loss(spec.train.loss, spec.train.ignore_index)(output, target)
    except Exception as e:  # noqa: BLE001 - the user's loss, any failure
        where = spec_location(spec, "train.loss")
        raise SpecError(
            f"{where + ': ' if where else ''}train.loss {spec.train.loss!r} cannot take the "
            f"model output {tuple(out.shape)} {out.dtype} and the target "
            f"{tuple(target.shape)} {str(target.dtype).replace('torch.', '')}: "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}; pick a loss that "
            "fits the model (built in: cross_entropy, mse) or fix the dataset's targets"
        ) from None


def run(args) -> int:
    """Plan the spec, dump the plan into the output folder and train with torchrun.

    Every check that can fail before training (spec, launch arguments, plan) runs before the
    output folder is touched. Returns 0 on success. Raises FxpipeError (printed cleanly by the
    CLI) on failure, KeyboardInterrupt when interrupted.
    """
    from fxpipe.partitioner.driver import plan_from_spec
    from fxpipe.specs.loader import load_spec

    spec = load_spec(args.spec)
    if args.steps is not None:
        if args.steps < 1:
            raise FxpipeError(f"--steps must be at least 1 (got {args.steps})")
        spec = spec.model_copy(update={"train": spec.train.model_copy(update={"steps": args.steps})})
    out = Path(args.out or spec.output.dir)
    spec = spec.model_copy(update={"output": spec.output.model_copy(update={"dir": str(out)})})
    nnodes = args.nnodes
    _check_launchable(spec, nnodes, args.rdzv_endpoint)
    check_output_dir(out, args.overwrite)

    from fxpipe.reports.progress import PROGRESS_ENV, planning_progress, progress_mode

    with planning_progress():  # a spinner with the planner's phases on a terminal
        plan, graph = plan_from_spec(spec)
    _check_loss_fits(spec, plan)
    prepare_output_dir(out, args.overwrite)
    plan.dump(out, graph)
    from fxpipe.reports.partition_picture import write_partition_picture

    write_partition_picture(plan, out, graph)
    print(plan.summary(), flush=True)

    per_node = spec.cluster.devices_per_node
    endpoint = args.rdzv_endpoint or f"127.0.0.1:{_free_port()}"

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault(PROGRESS_ENV, progress_mode())  # the workers' stdout is ours
    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
    wait = int(spec.train.timeout_s)
    config = LaunchConfig(
        min_nodes=nnodes, max_nodes=nnodes, nproc_per_node=per_node,
        run_id=args.rdzv_id, rdzv_backend="c10d", rdzv_endpoint=endpoint,
        rdzv_configs={"join_timeout": wait, "timeout": wait}, max_restarts=0,
        monitor_interval=0.5, start_method="spawn",
    )
    worker_args = ["-m", "fxpipe.training.worker", "--plan", str(out / "plan.json"), "--out", str(out)]
    print(f"launching {nnodes} x {plural(per_node, 'worker')}, rendezvous at {endpoint}", flush=True)
    try:
        elastic_launch(config, sys.executable)(*worker_args)
    except SignalException:
        raise KeyboardInterrupt from None
    except ChildFailedError as e:
        first = min(e.failures.items(), key=lambda kv: kv[1].timestamp or 0)
        rank, failure = first
        raise FxpipeError(
            f"training failed (first failure: rank {rank}, exit code {failure.exitcode}); the "
            f"ranks' messages are printed above. Outputs so far are kept in {out}"
        ) from None
    except (RendezvousError, RuntimeError, ValueError) as e:  # e.g. a peer never joins
        what = str(e) or type(e).__name__
        raise FxpipeError(
            f"could not start the workers: {what}. For multi-node runs, start `fxpipe run` on "
            f"every node within train.timeout_s ({wait} s) with the same --rdzv-endpoint and "
            "--rdzv-id"
        ) from None
    if nnodes == 1:  # multi-node: checkpoint shards live on several machines
        from fxpipe.training.evaluate import evaluate_run

        figures = evaluate_run(spec, out)
        if figures:
            print(f"validation loss ({figures['eval_batches']} held-out batches): "
                  f"{figures['val_loss_initial']:.4f} at start -> "
                  f"{figures['val_loss_final']:.4f} after training", flush=True)
    _write_report(out)
    print(f"done: outputs in {out}")
    return 0


def _write_report(out: Path) -> None:
    """The run's pictures and ``report.html`` (``fxpipe report`` writes them again); a failure
    here is a warning: the training itself succeeded."""
    from fxpipe.reports.report import write_report

    try:
        path = write_report(out)
    except Exception as e:  # noqa: BLE001 - the run's outputs are kept whatever fails here
        print(f"fxpipe: warning: could not write the run report: {type(e).__name__}: {e}; "
              f"try `fxpipe report {out}`", file=sys.stderr, flush=True)
        return
    print(f"report: {path} (pictures: partition, timeline and training .png/.svg)", flush=True)
