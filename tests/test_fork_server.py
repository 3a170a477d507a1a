"""``fxpipe run``'s fork server (:mod:`fxpipe.training.fork_server`): the launcher forks into it
(no second interpreter importing torch), CPython's own server is the fallback when a Python
thread runs, and :func:`stop` ends either at once. Each case runs in a fresh interpreter, as a
launcher does."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

try:
    from cli_helpers import cli_env
except ImportError:  # collected as a package
    from tests.cli_helpers import cli_env

pytestmark = pytest.mark.distributed

PROBE = """
import json, os, sys, threading, time
from pathlib import Path
import multiprocessing.forkserver as forkserver
from fxpipe.training import fork_server

mine = Path("/proc/self/cmdline").read_bytes().split(b"\\0")
needle = b"from multiprocessing.forkserver " + b"import main"  # not this source's own text
out = {}
for mode in ("plain", "thread"):  # one interpreter: the second start follows the first's stop
    if mode == "thread":  # a Python thread running: no fork of this process
        stop = threading.Event()
        threading.Thread(target=stop.wait, daemon=True).start()
    fork_server.start()
    pid = forkserver._forkserver._forkserver_pid
    deadline = time.monotonic() + 30
    while True:
        # CPython's server is spawned with vfork + exec: for an instant after ensure_running()
        # returns, the kernel still shows an empty command line (or, with fork, the parent's)
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\\0")
        if mode == "plain" or (cmd != [b""] and cmd != mine) or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    fork_server.start()  # running: a no-op
    same = forkserver._forkserver._forkserver_pid == pid
    fork_server.stop()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    out[mode] = {"forked": cmd == mine, "cpython": any(needle in a for a in cmd),
                 "same": same, "gone": not Path(f"/proc/{pid}").exists()}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def probed() -> dict:
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                       env=cli_env(), timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_launcher_forks_into_the_server_and_stop_ends_it(probed):
    got = probed["plain"]
    assert got == {"forked": True, "cpython": False, "same": True, "gone": True}, got


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_with_a_thread_running_cpythons_server_starts_instead(probed):
    got = probed["thread"]
    assert got == {"forked": False, "cpython": True, "same": True, "gone": True}, got
