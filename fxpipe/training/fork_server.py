"""The fork server of ``fxpipe run``: torchrun's launcher (``start_method="forkserver"``) forks
every worker from it, so the workers start with torch, dynamo and fxpipe loaded instead of
importing them once each.

:func:`start` makes the server by forking the launcher itself once it has imported
:data:`MODULES` and before it plans (one process, no Python thread, no torch op run yet, only
torch.export's first call made on the meta device: :mod:`fxpipe.partitioner.trace_warmup`; the
state of a fresh interpreter that imported them): the server costs no imports of its own
(about 5 s of CPU on two cores, a second process importing torch). Where that cannot be done
(another Python's fork server protocol, a thread already running) CPython's own server starts
instead, a new interpreter that imports :mod:`fxpipe.training.server_imports`.

The server ignores Ctrl-C (the launcher stops it: :func:`stop`). Every object it holds is frozen
out of the garbage collector, as Python's documentation advises before ``fork()`` without
``exec()``: the workers' collections never walk (nor copy-on-write) those objects, and the
server's exit skips the interpreter's final collections over them.
"""

from __future__ import annotations

import gc
import importlib
import inspect
import os
import signal
import threading
import warnings

#: imported once, in this order, before the server forks the workers
MODULES = ("torch", "torch.distributed", "torch.export", "torch._dynamo",
           "torch.distributed.checkpoint", "fxpipe.training.compiled",
           "fxpipe.training.checkpoint", "fxpipe.runtime.executor", "fxpipe.data.batches",
           "fxpipe.training.worker", "fxpipe.partitioner.split",
           "fxpipe.partitioner.trace_warmup")  # last: torch.export's first call, made once
#: what CPython's own server (the fallback) imports: the module that imports :data:`MODULES`
PRELOAD = ["fxpipe.training.server_imports"]
#: the protocol of ``multiprocessing.forkserver.main`` that :func:`_fork_here` speaks
_MAIN_PARAMETERS = ["listener_fd", "alive_r", "preload", "main_path", "sys_path"]


def import_modules() -> None:
    """Import :data:`MODULES` (what every worker needs)."""
    for name in MODULES:
        importlib.import_module(name)


def start() -> None:
    """Start the server the workers fork from (a no-op when it runs): forked from this process
    when it can be (:func:`_fork_here`), else CPython's server."""
    import multiprocessing.forkserver as forkserver

    import torch.multiprocessing as mp

    mp.set_forkserver_preload(PRELOAD)
    server = forkserver._forkserver  # CPython's one ForkServer of this process
    if getattr(server, "_forkserver_pid", None) is not None or not _fork_here(server):
        forkserver.ensure_running()


def _fork_here(server) -> bool:
    """Fork this process into the server, as ``ForkServer.ensure_running`` would have started
    it. Returns False (nothing done) where the protocol is not the one known here or a Python
    thread runs (a fork would copy a lock it may hold)."""
    from multiprocessing import connection, resource_tracker, util
    import multiprocessing.forkserver as forkserver
    import socket

    try:
        known = list(inspect.signature(forkserver.main).parameters) == _MAIN_PARAMETERS
    except (TypeError, ValueError):
        known = False
    if not known or not all(hasattr(server, a) for a in (
            "_lock", "_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid")):
        return False
    import_modules()
    if threading.active_count() != 1:
        return False
    with server._lock:
        resource_tracker.ensure_running()
        with socket.socket(socket.AF_UNIX) as listener:
            address = connection.arbitrary_address("AF_UNIX")
            listener.bind(address)
            if not util.is_abstract_socket_namespace(address):
                os.chmod(address, 0o600)
            listener.listen()
            # every client owns the write end of the "alive" pipe: when they are all gone the
            # server reads EOF and exits
            alive_r, alive_w = os.pipe()
            gc.freeze()
            # a Ctrl-C between the fork and the server's own handlers waits (the launcher gets
            # it right after; the server ignores it, as CPython's does)
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            pid = -1
            try:
                with warnings.catch_warnings():  # 3.12+: torch's own native thread
                    warnings.simplefilter("ignore", DeprecationWarning)
                    pid = os.fork()
            finally:
                if pid != 0:
                    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
            if pid == 0:  # the server
                code = 0
                try:
                    os.close(alive_w)
                    # the handlers the workers get back (forkserver restores them in each)
                    signal.signal(signal.SIGINT, signal.SIG_IGN)
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
                    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
                    forkserver.main(listener.fileno(), alive_r, [])
                except SystemExit:  # every client has gone
                    pass
                except BaseException:  # pragma: no cover - a server bug: say it, end
                    import traceback

                    traceback.print_exc()
                    code = 1
                finally:
                    os._exit(code)  # never the launcher's atexit handlers
            gc.unfreeze()
            os.close(alive_r)
            server._forkserver_address = address
            server._forkserver_alive_fd = alive_w
            server._forkserver_pid = pid
    return True


def stop() -> None:
    """End the server of :func:`start` now (CPython's ignores Ctrl-C while it imports and would
    otherwise finish its imports, seconds of CPU, after the launcher has gone)."""
    import multiprocessing.forkserver as forkserver

    server = forkserver._forkserver
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    server._stop()  # closes its pipe, reaps it, forgets it


def serve_imports() -> None:
    """What CPython's server runs first (:mod:`fxpipe.training.server_imports`): Ctrl-C
    ignored, :data:`MODULES` imported, every object frozen out of the collector."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import_modules()
    gc.freeze()
