"""A CPU rank's malloc keeps freed memory (:mod:`fxpipe.execution.host_memory`): a block freed
and allocated again every micro-batch is not page-faulted in again each time.

Each case runs in a fresh interpreter (the setting is process-wide and cannot be undone); the
page faults are the kernel's count (``ru_minflt``), not a timing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# joins a one-rank gloo group as every CPU rank does, then frees and allocates a 40 MiB
# activation 40 times, counting the faults of the last 20 (above glibc's largest automatic mmap threshold, 32 MiB)
SCRIPT = """
import json, os, resource, socket, torch
from fxpipe.execution import host_memory
from fxpipe.runtime.mesh import init_distributed
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
init_distributed("cpu", timeout_s=30)
for _ in range(20):  # the first steps: the heap settles (after a gloo group, ~8 steps)
    torch.empty(10 << 20).fill_(1)
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    torch.empty(10 << 20).fill_(1)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
print(json.dumps({"set": host_memory.keep_freed_memory(), "faults": faults}))
"""


def _run(**env: str) -> dict:
    full = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    full.pop("LD_PRELOAD", None)
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=full, capture_output=True,
                         text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.distributed
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_cpu_rank_reuses_freed_memory_instead_of_faulting_it_in_again():
    kept = _run()
    system = _run(FXPIPE_KEEP_FREED_MEMORY="0")
    assert kept["set"] is True and system["set"] is False
    pages = 20 * (40 << 20) // 4096  # every allocation faulted in afresh
    assert system["faults"] >= pages * 0.9
    assert kept["faults"] <= system["faults"] / 4


@pytest.mark.parametrize("value", ["0", "off", " OFF ", "false", "No"])
def test_the_environment_turns_it_off(monkeypatch, value):
    from fxpipe.execution import host_memory

    monkeypatch.setattr(host_memory, "_done", None)
    monkeypatch.setattr(host_memory, "_libc", lambda: pytest.fail("mallopt called"))
    monkeypatch.setenv("FXPIPE_KEEP_FREED_MEMORY", value)
    assert host_memory.keep_freed_memory() is False
