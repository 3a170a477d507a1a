"""``fxpipe run``: plan in this process, then start one worker process per device with torchrun's
launcher (``torch.distributed.launcher.api.elastic_launch``, the engine behind
``torch.distributed.run``), rendezvous on loopback unless ``--rdzv-endpoint`` says otherwise.

Multi-node: run the same command on every node with ``--nnodes N --rdzv-endpoint HOST:PORT``;
each node plans for itself (planning is deterministic) and starts ``cluster.devices_per_node``
workers.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

from fxpipe.errors import FxpipeError

#: Files whose presence marks a folder as holding an earlier run.
RUN_MARKERS = ("losses.csv", "plan.json", "checkpoint", "timeline.json")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare_output_dir(out: Path, overwrite: bool) -> None:
    """Create ``out``; if it holds an earlier run, stop (or, with ``overwrite``, rename the old
    folder to ``<out>.old-<timestamp>``). Nothing is ever deleted.

    Raises:
        FxpipeError: the folder holds an earlier run and ``overwrite`` is False, or is a file.
    """
    if out.exists() and not out.is_dir():
        raise FxpipeError(f"output path {out} is a file; choose a folder with --out")
    if out.is_dir() and any((out / m).exists() for m in RUN_MARKERS):
        if not overwrite:
            raise FxpipeError(
                f"{out} already holds an earlier run; pass --out NEW_DIR, or --overwrite to move "
                "the old run aside (it is renamed, not deleted)"
            )
        aside = out.with_name(f"{out.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
        out.rename(aside)
        print(f"moved the earlier run to {aside}")
    out.mkdir(parents=True, exist_ok=True)


def run(args) -> int:
    """Plan the spec, dump the plan into the output folder and train with torchrun.

    Returns 0 on success. Raises FxpipeError (printed cleanly by the CLI) on failure.
    """
    from fxpipe.api import plan_from_spec
    from fxpipe.specs.loader import load_spec

    spec = load_spec(args.spec)
    if args.steps is not None:
        if args.steps < 1:
            raise FxpipeError(f"--steps must be at least 1 (got {args.steps})")
        spec = spec.model_copy(update={"train": spec.train.model_copy(update={"steps": args.steps})})
    out = Path(args.out or spec.output.dir)
    spec = spec.model_copy(update={"output": spec.output.model_copy(update={"dir": str(out)})})
    prepare_output_dir(out, args.overwrite)

    plan, graph = plan_from_spec(spec)
    plan.dump(out, graph)
    print(plan.summary(), flush=True)

    nnodes = int(args.nnodes)
    per_node = spec.cluster.devices_per_node
    if nnodes != spec.cluster.nodes:
        raise FxpipeError(
            f"--nnodes {nnodes} disagrees with cluster.nodes={spec.cluster.nodes} in the spec; "
            "make them equal"
        )
    if nnodes > 1 and not args.rdzv_endpoint:
        raise FxpipeError("multi-node runs need --rdzv-endpoint HOST:PORT (the same on every node)")
    endpoint = args.rdzv_endpoint or f"127.0.0.1:{_free_port()}"

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    config = LaunchConfig(
        min_nodes=nnodes, max_nodes=nnodes, nproc_per_node=per_node,
        run_id=args.rdzv_id, rdzv_backend="c10d", rdzv_endpoint=endpoint,
        rdzv_configs={"timeout": int(spec.train.timeout_s)}, max_restarts=0,
        monitor_interval=0.5, start_method="spawn",
    )
    worker_args = ["-m", "fxpipe.train", "--plan", str(out / "plan.json"), "--out", str(out)]
    print(f"launching {nnodes} x {per_node} worker(s), rendezvous at {endpoint}", flush=True)
    try:
        elastic_launch(config, sys.executable)(*worker_args)
    except ChildFailedError as e:
        first = min(e.failures.items(), key=lambda kv: kv[1].timestamp or 0)
        rank, failure = first
        raise FxpipeError(
            f"training failed on rank {rank} (exit code {failure.exitcode}); its message is "
            f"printed above. Outputs so far are kept in {out}"
        ) from None
    if nnodes == 1:  # multi-node: checkpoint shards live on several machines
        from fxpipe.evaluate import evaluate_run

        figures = evaluate_run(spec, out)
        if figures:
            print(f"validation loss ({figures['eval_batches']} held-out batches): "
                  f"{figures['val_loss_initial']:.4f} at start -> "
                  f"{figures['val_loss_final']:.4f} after training", flush=True)
    print(f"done: outputs in {out}")
    return 0
