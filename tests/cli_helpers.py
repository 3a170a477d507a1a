"""Running the ``fxpipe`` CLI in a child process, shared by the CLI and fault tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def cli_env(**extra: str) -> dict[str, str]:
    """The environment a child ``fxpipe`` runs in: this checkout first on the path, one thread,
    tracebacks off (FXPIPE_DEBUG unset)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **extra)
    env.pop("FXPIPE_DEBUG", None)
    return env


def fxpipe_cli(*args, cwd=None, timeout=240, **env: str) -> subprocess.CompletedProcess:
    """``python -m fxpipe ARGS`` with its output captured."""
    return subprocess.run([sys.executable, "-m", "fxpipe", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd or REPO, env=cli_env(**env), timeout=timeout)
