"""What ``fxpipe run`` records for its report besides losses and checkpoints.

* :class:`OptimizerTimer`: the time each rank spends between two schedule runs on the optimizer
  step (gradient clipping, ``optimizer.step()``, the learning-rate schedule, ``zero_grad``), as
  :data:`~fxpipe.schedule.timeline.OPTIMIZER_LABEL` timeline events on the executor's clock
  (seconds since the epoch), so that ``timeline.json`` shows it next to F / B / W.
* :func:`environment`: torch and Python versions, platform, world size, backend, and every
  rank's device and host (a collective: every rank calls it); rank 0 writes it as
  ``environment.json`` (:func:`write_environment`).
"""

from __future__ import annotations

import json
import platform
import socket
import time
from pathlib import Path

from fxpipe.schedule.timeline import OPTIMIZER_LABEL, TimelineEvent

__all__ = ["OptimizerTimer", "environment", "write_environment", "ENVIRONMENT_FILE"]

#: the file rank 0 writes into the run folder
ENVIRONMENT_FILE = "environment.json"


class OptimizerTimer:
    """Timeline events of this rank's optimizer steps: call :meth:`start` before clipping and
    :meth:`stop` after ``zero_grad``; :attr:`events` holds one event per pair."""

    def __init__(self, rank: int):
        self.rank = rank
        self.events: list[TimelineEvent] = []
        self._clock0 = time.time() - time.perf_counter()
        self._t0: float | None = None

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self._t0 is not None:
            self.events.append(TimelineEvent(self.rank, OPTIMIZER_LABEL, self._clock0 + self._t0,
                                             self._clock0 + time.perf_counter()))
            self._t0 = None


def _device_text(device) -> str:
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        try:
            return f"{dev} ({torch.cuda.get_device_name(dev)})"
        except (RuntimeError, AssertionError):
            return str(dev)
    return f"{dev} ({platform.processor() or platform.machine()})"


def environment(device, nnodes: int | None = None) -> dict:
    """The run's environment; every rank must call it (it gathers each rank's device and host).

    Args:
        device: this rank's device (``pipe.device``).
        nnodes: nodes of the run (from the launcher), when known.
    """
    import torch
    import torch.distributed as dist

    mine = (_device_text(device), socket.gethostname())
    world = dist.get_world_size() if dist.is_initialized() else 1
    every = [None] * world
    if dist.is_initialized():
        dist.all_gather_object(every, mine)
    else:
        every = [mine]
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "",
        "python": platform.python_version(),
        "platform": platform.platform(),
        "world_size": world,
        "backend": str(dist.get_backend()) if dist.is_initialized() else "none",
        "nnodes": nnodes if nnodes is not None else len({h for _, h in every}),
        "devices": [d for d, _ in every],
        "hosts": [h for _, h in every],
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def write_environment(out: str | Path, record: dict) -> Path:
    """Write ``record`` as ``environment.json`` into ``out``."""
    path = Path(out) / ENVIRONMENT_FILE
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path
