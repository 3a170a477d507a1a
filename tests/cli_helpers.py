"""Running the ``fxpipe`` CLI, shared by the CLI and fault tests: in a child process
(:func:`fxpipe_cli`), or in this process (:func:`fxpipe_in_process`) for the commands that never
start workers."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import tempfile
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parents[1]
#: threads per rank of the commands the tests run: 1, or OMP_NUM_THREADS when the test run sets
#: it (the exactness matrix, .ci/exactness_matrix.sh, runs with 1 and 2)
THREADS = os.environ.get("OMP_NUM_THREADS", "1")


def cli_env(**extra: str) -> dict[str, str]:
    """The environment a child ``fxpipe`` runs in: this checkout first on the path, one thread
    per rank (or ``OMP_NUM_THREADS`` when the test run sets it), tracebacks off (FXPIPE_DEBUG
    unset)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS=THREADS, **extra)
    env.pop("FXPIPE_DEBUG", None)
    return env


def fxpipe_cli(*args, cwd=None, timeout=240, **env: str) -> subprocess.CompletedProcess:
    """``python -m fxpipe ARGS`` with its output captured."""
    return subprocess.run([sys.executable, "-m", "fxpipe", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd or REPO, env=cli_env(**env), timeout=timeout)


def fxpipe_in_process(*args, cwd=None, **env: str) -> subprocess.CompletedProcess:
    """``fxpipe ARGS`` through ``fxpipe.cli.main`` in this process, as :func:`fxpipe_cli` would
    run it (FXPIPE_DEBUG unset, the extra environment ``env``, the working folder ``cwd`` or the
    checkout), and the same answer: exit code, stdout and stderr, captured both from Python
    and at the file descriptors (C++ messages included).

    For commands that never start workers (plan, simulate, profile, report, export and the
    ``run`` errors found before the launch): they skip a new interpreter importing torch and
    fxpipe (seconds per call on two cores). A ``run`` that gets as far as starting workers fails
    the test here rather than training inside the test process. An exception that ``main``
    does not turn into a clean message propagates (where a child would print a traceback).
    The environment, working folder and torch's thread count are restored afterwards.
    """
    import torch

    from fxpipe import cli
    from fxpipe.training import launch

    argv = [str(a) for a in args]

    def no_launch(*_a, **_k):
        raise AssertionError(f"`fxpipe {' '.join(argv)}` reached the worker launch; run it with "
                             "fxpipe_cli (a child process) instead")

    saved_env, saved_cwd, threads = dict(os.environ), os.getcwd(), torch.get_num_threads()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    py_out, py_err = io.StringIO(), io.StringIO()
    with tempfile.TemporaryFile() as fd_out, tempfile.TemporaryFile() as fd_err:
        sys.stdout.flush()
        sys.stderr.flush()
        kept = os.dup(1), os.dup(2)
        try:
            os.environ.pop("FXPIPE_DEBUG", None)
            os.environ.update(OMP_NUM_THREADS=THREADS, **env)
            os.chdir(cwd or REPO)
            os.dup2(fd_out.fileno(), 1)
            os.dup2(fd_err.fileno(), 2)
            with mock.patch.object(launch, "_launch", no_launch), \
                    redirect_stdout(py_out), redirect_stderr(py_err):
                try:
                    code = cli.main(argv)
                except SystemExit as e:  # argparse's usage errors
                    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                    if isinstance(e.code, str):
                        print(e.code, file=sys.stderr)
        finally:
            os.dup2(kept[0], 1)
            os.dup2(kept[1], 2)
            os.close(kept[0])
            os.close(kept[1])
            os.chdir(saved_cwd)
            os.environ.clear()
            os.environ.update(saved_env)
            torch.set_num_threads(threads)
            for sig, handler in handlers.items():  # what the command installed goes
                if handler is not None:
                    signal.signal(sig, handler)
        fd_out.seek(0)
        fd_err.seek(0)
        out = py_out.getvalue() + fd_out.read().decode(errors="replace")
        err = py_err.getvalue() + fd_err.read().decode(errors="replace")
    return subprocess.CompletedProcess(["fxpipe", *argv], code, out, err)
