"""``fxpipe run``: plan in this process, then start one worker process per device with torchrun's
launcher (``torch.distributed.launcher.api.elastic_launch``, the engine behind
``torch.distributed.run``), rendezvous on loopback unless ``--rdzv-endpoint`` says otherwise.

Multi-node: run the same command on every node with ``--nnodes N --rdzv-endpoint HOST:PORT``
(and ``--node-rank R``, or let the nodes number themselves: the endpoint's machine is node 0);
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
from fxpipe.training import fork_server
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


def _check_launchable(spec, nnodes: int, endpoint: str | None,
                      node_rank: int | None = None) -> None:
    """Everything that would otherwise fail only after the workers start."""
    import torch

    from fxpipe.execution.losses import resolve_loss

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
    if node_rank is not None and not 0 <= node_rank < nnodes:
        raise FxpipeError(f"--node-rank {node_rank} must be in 0 .. {nnodes - 1} (--nnodes {nnodes})")
    resolve_loss(spec.train.loss, spec.train.ignore_index)
    if spec.cluster.device == "cuda":
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < spec.cluster.devices_per_node:
            raise FxpipeError(
                f"cluster.device is cuda with {spec.cluster.devices_per_node} devices per node, "
                f"but this machine has {plural(have, 'CUDA device')}; set cluster.device: cpu or run on "
                "a machine with enough GPUs"
            )
    if spec.train.compile == "stages":  # inductor's compiler, here as on the workers
        from fxpipe.execution.compiled_stage import resolve_compile

        resolve_compile("stages", spec.train.cuda_graphs, torch.device(spec.cluster.device))


def _import_model_code(spec) -> None:
    """Import the code the spec's model lives in (transformers and the model's class for
    ``model.hf``, the factory's module), as planning would: imported here, before the fork
    server forks, the workers start with it instead of importing it once each (transformers
    and a model class: about 2 s of CPU per worker on two cores). An error here is the one
    planning would raise."""
    from fxpipe.specs.resolve import resolve_callable

    if spec.model.hf is not None:
        from fxpipe.specs.hf import transformers_class

        transformers_class(spec)
    elif spec.model.factory:
        resolve_callable(spec.model.factory, "model.factory", spec=spec)


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
    from fxpipe.execution.losses import MODEL_LOSS, resolve_loss

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


def _check_out_path(out: Path) -> None:
    """Refuse an output folder that is the current folder or one above it (moving it aside or
    filling it would take the user's working folder with it)."""
    here, target = Path.cwd().resolve(), out.resolve()
    if target == here or target in here.parents:
        raise FxpipeError(f"--out {out} is the current folder or one above it; give a folder "
                          "of its own for the run, e.g. --out runs/NAME")


def check_checkpoint_dir(out: Path, spec) -> Path:
    """Create the run's checkpoint folder and check that it can be written, so a bad
    ``train.checkpoint.dir`` fails before training, not at the first save.

    Raises:
        FxpipeError: it is a file, lies outside the run, or cannot be written.
    """
    root = out / spec.train.checkpoint.dir
    if out.resolve() not in root.resolve().parents:  # e.g. a symlink pointing elsewhere
        raise FxpipeError(f"train.checkpoint.dir {spec.train.checkpoint.dir!r} resolves to "
                          f"{root.resolve()}, outside the run folder {out}; name a folder inside it")
    if root.exists() and not root.is_dir():
        raise FxpipeError(f"the checkpoint folder {root} is a file; remove it or set "
                          "train.checkpoint.dir to another name")
    probe = root / f".write-test.{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise FxpipeError(f"cannot write checkpoints to {root}: {e.strerror or e}; make it "
                          "writable or set train.checkpoint.dir") from None
    return root


def run_fingerprint(plan) -> str:
    """What every node of a run must share, as JSON: the spec (less ``output``), fxpipe's
    version and a hash of its source, torch's version, and the plan's shape and hash."""
    import hashlib
    import json

    import torch

    import fxpipe

    spec = {k: v for k, v in (plan.spec.model_dump(mode="json") if plan.spec is not None
                              else {}).items() if k != "output"}
    source = hashlib.sha256()
    root = Path(fxpipe.__file__).parent
    for f in sorted(root.rglob("*.py")):
        source.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    d = plan.to_dict()
    d["spec"] = spec
    shape = {"schedule": plan.schedule, "pipeline": plan.pipeline, "dp": plan.dp,
             "microbatches": plan.microbatches, "placement": plan.placement,
             "nodes per stage": [len(st.nodes) for st in plan.stages],
             "hash": hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]}
    return json.dumps({"spec": spec, "fxpipe": {"version": fxpipe.__version__,
                                                 "source": source.hexdigest()[:12]},
                       "torch": torch.__version__, "plan": shape}, sort_keys=True)


def _resume_dir(args, spec) -> Path:
    """The run folder ``--resume RUN_DIR`` names, checked: it holds a valid checkpoint."""
    from fxpipe.training.checkpoint import open_checkpoint

    run_dir = Path(args.resume)
    if spec.train.updates == "async":
        raise FxpipeError(f"--resume {run_dir}: train.updates: async writes only its final "
                          "checkpoint (replicas hold weights of different versions mid-run), so "
                          "there is nothing to resume from; start a new run, or use updates: "
                          "sync with train.checkpoint.every")
    if args.out and Path(args.out).resolve() != run_dir.resolve():
        raise FxpipeError(f"--resume {run_dir} continues that run in its own folder; drop --out "
                          f"{args.out} (or give the same folder)")
    if not run_dir.is_dir():
        raise FxpipeError(f"--resume {run_dir}: no such run folder")
    folder, manifest = open_checkpoint(run_dir / spec.train.checkpoint.dir)
    if manifest["step"] >= spec.train.steps:
        raise FxpipeError(f"--resume {run_dir}: its checkpoint {folder.name} is at step "
                          f"{manifest['step']} and train.steps is {spec.train.steps}; nothing "
                          "left to train: raise train.steps or pass --steps N")
    return run_dir


def _not_local(e: OSError, bind: str) -> None:
    """Raise the clear error for binding an address this machine does not have."""
    import errno

    if e.errno == errno.EADDRNOTAVAIL:
        raise FxpipeError(f"--bind {bind}: not an address of this machine ({e.strerror}); give "
                          "one of its interfaces (e.g. eth0) or one of their addresses") from None


def _rendezvous(args, nnodes: int, wait: float) -> tuple[str, str]:
    """``(endpoint, bind address)``: loopback and a free port for a single node; for several
    nodes the given endpoint (checked to answer, when another node hosts it) and the address of
    the interface named by ``--bind`` (default: the one that routes to the endpoint)."""
    from fxpipe.training.rendezvous import (LOOPBACK, is_local_host, interface_address,
                                            probe_endpoint, route_address)

    endpoint = args.rdzv_endpoint
    if nnodes == 1:
        bind = LOOPBACK if not getattr(args, "bind", None) else interface_address(args.bind)
        if endpoint is None:
            return f"{LOOPBACK}:{_free_port()}", bind
        host, _, port = endpoint.rpartition(":")
        if not is_local_host(host):
            raise FxpipeError(f"--rdzv-endpoint {endpoint}: a single-node run hosts its own "
                              "rendezvous, so the host must be this machine (e.g. 127.0.0.1)")
        with socket.socket() as s:
            try:
                s.bind((bind, int(port)))
            except OSError as e:
                _not_local(e, bind)
                raise FxpipeError(f"--rdzv-endpoint {endpoint}: port {port} is taken "
                                  f"({e.strerror}); pick a free one or leave the option out"
                                  ) from None
        return endpoint, bind
    host, _, port = endpoint.rpartition(":")
    bind = interface_address(args.bind) if getattr(args, "bind", None) else route_address(host)
    node_rank = getattr(args, "node_rank", None)
    local = is_local_host(host)
    if node_rank == 0 and not local:
        raise FxpipeError(f"--node-rank 0 hosts the rendezvous, but {host} (--rdzv-endpoint) is "
                          "not this machine; start node 0 on the machine the endpoint names")
    hosting = False
    if local and node_rank in (None, 0):
        with socket.socket() as s:
            try:
                s.bind((bind, int(port)))
                hosting = True
            except OSError as e:  # hosted by another launcher on this machine, or taken
                _not_local(e, bind)
                if node_rank == 0:
                    raise FxpipeError(f"--rdzv-endpoint {endpoint}: port {port} is taken "
                                      f"({e.strerror}): another launcher started with "
                                      "--node-rank 0 (each node needs its own --node-rank) or "
                                      "another program holds it; pick a free one") from None
    if not hosting:
        probe_endpoint(endpoint, wait)
    return endpoint, bind


def run(args) -> int:
    """Plan the spec, dump the plan into the output folder, train with torchrun and write the
    run's pictures and ``report.html`` (not with ``--no-report``).

    Every check that can fail before training (spec, launch arguments, plan, the checkpoint
    folder, the rendezvous endpoint) runs before the workers start; the output folder is
    touched only after the plan exists. ``--resume RUN_DIR`` continues the run in that folder
    from its latest checkpoint, under the plan the spec gives now (any stage count, replica
    count or schedule). Returns 0 on success. Raises FxpipeError (printed cleanly by the CLI)
    on failure, KeyboardInterrupt when interrupted.
    """
    from fxpipe.partitioner.driver import plan_from_spec
    from fxpipe.specs.loader import load_spec
    from fxpipe.training.worker import clear_exit_records

    spec = load_spec(args.spec)
    if args.steps is not None:
        if args.steps < 1:
            raise FxpipeError(f"--steps must be at least 1 (got {args.steps})")
        spec = spec.model_copy(update={"train": spec.train.model_copy(update={"steps": args.steps})})
    resume = getattr(args, "resume", None)
    out = _resume_dir(args, spec) if resume else Path(args.out or spec.output.dir)
    _check_out_path(out)
    spec = spec.model_copy(update={"output": spec.output.model_copy(update={"dir": str(out)})})
    nnodes = args.nnodes
    _check_launchable(spec, nnodes, args.rdzv_endpoint, getattr(args, "node_rank", None))
    if not resume:
        check_output_dir(out, args.overwrite)

    from fxpipe.reports.progress import planning_progress

    _import_model_code(spec)  # before the fork: every worker starts with it imported
    fork_server.start()  # this process forked into the server the workers fork from
    try:
        with planning_progress():  # a spinner with the planner's phases on a terminal
            plan, graph = plan_from_spec(spec)
        _check_loss_fits(spec, plan)
        if "tensorboard" in spec.train.log:  # the optional package, before any worker starts
            from fxpipe.specs.loader import spec_location
            from fxpipe.training.tensorboard_log import require_tensorboard

            where = spec_location(spec, "train.log")
            require_tensorboard(f"{where + ': ' if where else ''}train.log")
        wait = float(spec.train.timeout_s)
        endpoint, bind = _rendezvous(args, nnodes, wait)
        if not resume:
            prepare_output_dir(out, args.overwrite)
        check_checkpoint_dir(out, spec)
        clear_exit_records(out)
        plan.dump(out, graph)
        report = not args.no_report
        if report:
            from fxpipe.reports.partition_picture import write_partition_picture

            write_partition_picture(plan, out, graph)
        print(plan.summary(), flush=True)
        _launch(spec, out, nnodes, endpoint, bind, args.rdzv_id, resume=bool(resume),
                node_rank=getattr(args, "node_rank", None), fingerprint=run_fingerprint(plan))
    finally:  # the workers are done; a Ctrl-C or an error while planning: it is not needed
        fork_server.stop()
    if nnodes == 1:  # multi-node: checkpoint shards live on several machines
        from fxpipe.training.evaluate import evaluate_run

        figures = evaluate_run(spec, out)
        if figures:
            print(f"validation loss ({figures['eval_batches']} held-out batches): "
                  f"{figures['val_loss_initial']:.4f} at start -> "
                  f"{figures['val_loss_final']:.4f} after training", flush=True)
            if "tensorboard" in spec.train.log:
                from fxpipe.training.tensorboard_log import write_held_out

                write_held_out(out, figures, spec.train.steps)
    if report:
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


def _after(restarts: int) -> str:
    return f" after {plural(restarts, 'restart')}" if restarts else ""


def _silent_rank(out: Path, world: int) -> int | None:
    """The one rank of ``world`` that did not record losing a peer when all the others did
    (:func:`~fxpipe.training.worker.lost_peer_ranks`): the rank that ended first; None when
    that is not known (no record, or several ranks without one, e.g. another node's)."""
    from fxpipe.training.worker import lost_peer_ranks

    lost = lost_peer_ranks(out)
    silent = set(range(world)) - lost
    return silent.pop() if lost and len(silent) == 1 else None


def _first_failure(failures: dict, out: Path, world: int) -> str:
    """Where a failed run's failure began, from torchrun's failures (global rank -> exit code
    and time) and the ranks that only lost a peer (:func:`~fxpipe.training.worker.main`
    records them): torchrun reports the first rank to exit, which is often one that lost
    contact with a rank killed without a word (SIGKILL, out of memory)."""
    from fxpipe.training.worker import lost_peer_ranks

    rank, failure = min(failures.items(), key=lambda kv: kv[1].timestamp or 0)
    said = f"first failure: rank {rank}, exit code {failure.exitcode}"
    if failure.exitcode is not None and failure.exitcode < 0:
        import signal

        try:
            said += f" ({signal.Signals(-failure.exitcode).name})"
        except ValueError:
            pass
    if rank not in lost_peer_ranks(out):
        return said
    first = _silent_rank(out, world)
    if first is not None:
        return (f"rank {first} ended first and the others lost contact with it (with no "
                f"message of its own above, it was killed: out of memory?)")
    return (f"rank {rank} exited first, having lost contact with a rank that ended before it "
            f"(one with no message of its own above was killed: out of memory?)")


def _report_restarts(restarts: int, world: int, out: Path, checkpoints: Path) -> None:
    """Print one line when torchrun's agent restarts the workers (it logs the decision at INFO,
    which is otherwise silenced); when training stopped for a reason a restart would meet again
    (:func:`fxpipe.training.worker.stop_messages`), the restarted workers end at once."""
    import shutil

    from fxpipe.training.worker import LOST_PEER, stop_messages

    agent = logging.getLogger("torch.distributed.elastic.agent.server.api")

    class Restarts(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            if "attempts left" in record.msg and len(record.args) >= 3:
                which = f"restart {restarts - int(record.args[2]) + 1} of {restarts}"
                if stop_messages(out):
                    print(f"fxpipe: training stopped (why: below); {which} ends at once, as "
                          "it would meet it again", file=sys.stderr, flush=True)
                else:
                    first = _silent_rank(out, world)
                    who = ("a worker failed" if first is None
                           else f"rank {first} ended and the others lost contact with it")
                    start = ("the latest checkpoint" if (checkpoints / "latest").exists()
                             else "the start (no checkpoint yet)")
                    print(f"fxpipe: {who}; restarting all {plural(world, 'worker')} from "
                          f"{start} ({which})", flush=True)
                shutil.rmtree(out / LOST_PEER, ignore_errors=True)  # the next round's own
            return False

    agent.setLevel(logging.INFO)
    agent.addFilter(Restarts())


def _launch(spec, out: Path, nnodes: int, endpoint: str, bind: str, run_id: str,
            resume: bool, node_rank: int | None = None, fingerprint: str = "{}") -> None:
    """Start ``cluster.devices_per_node`` workers with torchrun's launcher (the ``fxpipe``
    rendezvous: stores on ``bind`` only), restarting them up to ``train.max_restarts`` times."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from fxpipe.training.rendezvous import NodeMismatch, register, socket_env

    per_node = spec.cluster.devices_per_node
    wait = int(spec.train.timeout_s)
    restarts = spec.train.max_restarts
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from fxpipe.reports.progress import PROGRESS_ENV, progress_mode

    os.environ.setdefault(PROGRESS_ENV, progress_mode())  # the workers' stdout is ours
    os.environ.update(TORCH_CPP_LOG_LEVEL=os.environ.get("TORCH_CPP_LOG_LEVEL", "FATAL"),
                      TORCH_SHOW_CPP_STACKTRACES="0", **socket_env(bind))
    # torchrun's module loggers carry their own WARNING level ("Received 2 death signal,
    # shutting down workers" on a Ctrl-C): fxpipe says what happened in its own lines
    for name in ["torch.distributed.elastic", *logging.root.manager.loggerDict]:
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    # "Terminating process N via signal SIGTERM" when a worker fails: said by fxpipe's own line
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    world = per_node * nnodes
    if restarts:
        _report_restarts(restarts, world, out, out / spec.train.checkpoint.dir)
    config = LaunchConfig(
        min_nodes=nnodes, max_nodes=nnodes, nproc_per_node=per_node,
        run_id=run_id, rdzv_backend=register(), rdzv_endpoint=endpoint,
        rdzv_configs={"join_timeout": wait, "bind": bind, "fingerprint": fingerprint,
                      "node_rank": -1 if node_rank is None else node_rank},
        max_restarts=restarts, monitor_interval=0.1, start_method="forkserver", local_addr=bind,
    )
    from fxpipe.training.worker import launched

    fork_server.start()  # started before planning; a no-op here then
    # the fork server's environment is the one it started with: the workers get these too
    env = {k: os.environ[k] for k in (
        "OMP_NUM_THREADS", PROGRESS_ENV, "TORCH_CPP_LOG_LEVEL", "TORCH_SHOW_CPP_STACKTRACES",
        "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if k in os.environ}
    print(f"launching {nnodes} x {plural(per_node, 'worker')}, rendezvous at {endpoint} "
          f"(listening on {bind} only)"
          + (f", up to {plural(restarts, 'restart')}" if restarts else ""), flush=True)
    try:
        elastic_launch(config, launched)(str(out / "plan.json"), str(out), resume, env,
                                         os.getpid())
    except SignalException:
        raise KeyboardInterrupt from None
    except ChildFailedError as e:
        from fxpipe.training.worker import stop_messages

        stops = stop_messages(out)
        if stops:  # said here: the first rank to exit ends the others before they could
            said = list(dict.fromkeys(stops.values()))  # the same reason on every rank: once
            for other in said[1:]:  # asynchronous replicas may stop for reasons of their own
                print(f"fxpipe: {other}", file=sys.stderr, flush=True)
            raise FxpipeError(f"{said[0].rstrip('.')}. Outputs so far are kept in {out}") from None
        raise FxpipeError(
            f"training failed{_after(restarts)}: {_first_failure(e.failures, out, world)}. "
            f"The ranks' messages are printed above. Outputs so far are "
            f"kept in {out}" + ("; continue with --resume " + str(out)
                                if (out / spec.train.checkpoint.dir / "latest").exists() else "")
        ) from None
    except NodeMismatch as e:
        raise FxpipeError(str(e)) from None
    except (RendezvousError, RuntimeError, ValueError, OSError) as e:  # e.g. a peer never joins
        what = (str(e).splitlines() or [type(e).__name__])[0][:300]
        hint = "" if "--rdzv-endpoint" in what or "node 0" in what else (
            f". For multi-node runs, start `fxpipe run` on every node within train.timeout_s "
            f"({wait} s) with the same --rdzv-endpoint and --rdzv-id")
        raise FxpipeError(f"could not start the workers: {what}{hint}") from None
