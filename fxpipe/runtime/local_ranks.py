"""Local ranks: run a function on N gloo ranks of this machine (spawned processes) with a hard
deadline, for tests, benchmarks and trying a pipeline without torchrun.

``run_ranks(fn, world_size, *args, timeout_s=...)`` starts ``world_size`` processes (start method
``forkserver``: children fork from a clean server process that imported torch and fxpipe once and
made torch.export's first call on the meta device but never ran an op, so no fork of a parent
whose OpenMP pool is live, and no per-child import and first-export cost of about 2.5 s CPU),
sets torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1, a free
MASTER_PORT), gives each :func:`fxpipe.runtime.threads.rank_threads` threads (1 unless
``OMP_NUM_THREADS`` says), joins the default gloo group, calls ``fn(rank, *args)`` and sends its
(picklable) return value back. The parent kills every child still alive at the deadline and
raises, so a hang can never outlive ``timeout_s``. A rank that exits with status 0 without
returning gives ``None``.
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

from fxpipe.errors import RuntimeFailure

#: modules the fork server imports once (its children start with them loaded)
PRELOAD = ["torch", "torch.distributed", "torch.export", "torch._dynamo",
           "fxpipe.runtime.executor", "fxpipe.schedule.generators", "fxpipe.partitioner.split",
           "fxpipe.examples.gpt", "fxpipe.examples.cnn",
           "fxpipe.partitioner.trace_warmup"]  # last: torch.export's first call, made once


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn: Callable, rank: int, world_size: int, port: int, dist_timeout_s: float,
           args: tuple, results) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch.distributed as dist

    from fxpipe.runtime.threads import set_rank_threads

    set_rank_threads()
    try:
        from fxpipe.runtime.mesh import init_distributed

        init_distributed("cpu", timeout_s=dist_timeout_s)
        out = fn(rank, *args)
        results.put((rank, "ok", out))
    except BaseException:  # report everything, including assertion errors, to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout_s: float = 60.0,
              dist_timeout_s: float = 30.0) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``world_size`` gloo ranks; return the results by rank.

    ``fn`` must be importable by module name (defined at module level).

    Raises:
        RuntimeFailure: a rank raised (its traceback included), exited with a non-zero status,
            or the deadline passed (all children are then killed).
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # no effect once the server runs
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, dist_timeout_s, args,
                                              results), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    got: dict[int, tuple[str, Any]] = {}
    try:
        while len(got) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, status, out = results.get(timeout=min(left, 0.5))
                got[rank] = (status, out)
                continue
            except queue.Empty:
                pass
            # a rank that died without reporting (crash, os._exit) will never report
            if all(not p.is_alive() for p in procs):
                while True:  # drain what was put just before exit
                    try:
                        rank, status, out = results.get(timeout=0.2)
                        got[rank] = (status, out)
                    except queue.Empty:
                        break
                break
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    errors = [f"rank {r}:\n{out}" for r, (status, out) in sorted(got.items()) if status == "error"]
    if errors:
        raise RuntimeFailure("ranks failed:\n" + "\n".join(errors))
    missing = [r for r in range(world_size) if r not in got]
    bad_exit = [(r, procs[r].exitcode) for r in missing if procs[r].exitcode not in (0,)]
    if bad_exit:
        raise RuntimeFailure(f"ranks exited abnormally or passed the {timeout_s:g} s deadline "
                             f"without reporting (rank, exit code): {bad_exit}")
    return [got[r][1] if r in got else None for r in range(world_size)]
