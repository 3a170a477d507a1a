"""``train.updates: async`` on the training side: a server rank's share, its loop, the replicas'.

:func:`fxpipe.compile` refuses such a plan (async runs through ``fxpipe run``); the worker's
:func:`~fxpipe.training.compiled._compile_async` of a plan with parameter servers
(``plan.parameter_servers``) gives a
:class:`~fxpipe.training.compiled.ServerShare` on a server rank (its parameters, no stage) and, on a trainer rank, a
:class:`~fxpipe.training.compiled.CompiledPipeline` whose executor keeps its replica's gradients
(no all-reduce) and whose ``client`` is a :class:`~fxpipe.runtime.parameter_server.
ParameterClient`. Then every server rank calls :func:`serve` and every trainer rank
:func:`train_replica`; :func:`fxpipe.training.worker.train_async` is the whole of ``fxpipe run``
for such a plan: the loops, the logs and the final checkpoint.

Outputs in the run folder, besides what a sync run writes:

* ``parameter_server_J.csv``: server J's log, one row per applied gradient
  (:data:`~fxpipe.runtime.parameter_server.LOG_FIELDS`: round, replica, step, the version the
  replica used, staleness = version applied to - version used, round size, dropped, time);
* ``replica_losses.csv``: one row per replica-step (replica, step, the server version its
  weights had, loss, step time, seconds since the start); both files are written row by row
  as the gradients are applied and the steps end, flushed, so a run that fails mid-way keeps
  what was done (``replica_losses.csv`` is rewritten in order, every node's replicas, at the
  end);
* ``losses.csv``: written at the end, or by rank 0 from ``replica_losses.csv`` when its
  training fails; as for sync, row ``c`` the mean loss of the replicas' ``c``-th steps (under
  ``max_staleness: 0`` every replica runs ``train.steps`` steps on the same weights: the sync
  run's losses; with ``S > 0`` a fast replica runs more steps, a slow one fewer);
* the final checkpoint (step ``train.steps``): the servers' parameters and optimizer state
  after the last update, the trainers' buffers (``fxpipe export`` and the held-out loss read it
  as for sync).
"""

from __future__ import annotations

import csv
import io
import math
import os
import time
from pathlib import Path
from typing import Callable

import torch.nn as nn

from fxpipe.errors import FxpipeError, RuntimeFailure, TrainingStopped

#: columns of ``replica_losses.csv``
REPLICA_FIELDS = ["replica", "step", "version", "loss", "step_time_s", "wall_s"]
REPLICA_LOSSES = "replica_losses.csv"


def server_log_name(index: int) -> str:
    """File name of parameter server ``index``'s log in the run folder."""
    return f"parameter_server_{index}.csv"


def lr_at(spec) -> Callable[[float], float]:
    """The learning rate for the update made after ``k`` global batches' worth of gradients,
    following ``train.lr_schedule`` (what sync's scheduler gives optimizer step ``k``)."""
    from fxpipe.training.lr_schedule import lr_factor

    t, s = spec.train, spec.train.lr_schedule
    return lambda k: t.lr * lr_factor(int(k), t.steps, s.warmup_steps, s.decay, t.lr, s.min_lr)


def serve(share, optimizer, *, log_path: str | Path | None = None,
          timeout_s: float | None = None) -> list[dict]:
    """Run parameter server ``share.index`` until every replica left (collective with the
    trainers' :func:`train_replica`). Returns its log (one dict per applied gradient).

    Args:
        share: this rank's :class:`~fxpipe.training.compiled.ServerShare`.
        optimizer: over ``share.parameters()`` (its state lives here), or None for a server
            that holds no parameter.
        log_path: where to write the log as CSV.
        timeout_s: seconds any wait may take (default ``train.timeout_s``).
    """
    from fxpipe.runtime.parameter_server import ParameterServer

    t = share.spec.train
    server = ParameterServer(share.plan, share.mesh, share.params, optimizer, t.steps,
                             int(t.max_staleness or 0),
                             float(timeout_s if timeout_s is not None else t.timeout_s),
                             lr_at=lr_at(share.spec), log_path=log_path, group=share.group)
    server.module = share.module
    return server.serve()


class ReplicaLog:
    """``replica_losses.csv`` written row by row as the replicas' steps end, flushed, so a run
    that fails keeps the steps done before the failure. Every replica's writer appends to the
    same file (each row one ``write`` on a file opened in append mode); whoever creates the
    file writes the header."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            pass
        else:
            os.write(fd, (",".join(REPLICA_FIELDS) + "\r\n").encode())
            os.close(fd)
        self._fh = open(self.path, "a", newline="")

    def write(self, row: dict) -> None:
        buf = io.StringIO()
        csv.DictWriter(buf, fieldnames=REPLICA_FIELDS).writerow({**row, "loss": repr(row["loss"])})
        self._fh.write(buf.getvalue())  # one line, one write
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def read_replica_rows(path: str | Path) -> list[dict]:
    """The rows of a ``replica_losses.csv`` (typed as :func:`train_replica` returns them)."""
    with open(path, newline="") as f:
        return [{"replica": int(r["replica"]), "step": int(r["step"]),
                 "version": int(r["version"]), "loss": float(r["loss"]),
                 "step_time_s": float(r["step_time_s"]), "wall_s": float(r["wall_s"])}
                for r in csv.DictReader(f)]


def train_replica(pipe, batch_of: Callable[[int], object], *, nan_policy: str = "stop",
                  on_step: Callable[[int, float, float, int], None] | None = None,
                  after_backward: Callable[[int], None] | None = None,
                  log: ReplicaLog | None = None) -> list[dict]:
    """Train this trainer rank's share until the head server hands out no more tickets.

    Each step ``c``: ticket, pull the weights (waits while the staleness bound says so),
    ``grad_accumulation`` global batches through the schedule (``batch_of(c * k + j)``), push
    the gradients. Then leave and receive the final weights.

    Args:
        pipe: this rank's CompiledPipeline (with ``pipe.client``).
        batch_of: global batch index -> the global batch.
        nan_policy: ``stop`` raises :class:`TrainingStopped` at a non-finite loss; ``skip``
            pushes the step flagged, and the servers drop it.
        on_step: called as ``on_step(c, loss, step_time_s, version)`` after each step.
        after_backward: called with ``c`` after the backward, before the push (tests and
            benchmarks slow one replica down with it).
        log: where each step's row is written as the step ends (pipeline rank 0 of each
            replica passes one; the rows are the same on every rank of a replica).

    Returns one dict per step (:data:`REPLICA_FIELDS`).
    """
    client = pipe.client
    if client is None:
        raise RuntimeFailure("train_replica: this pipeline has no parameter client; compile a "
                             "plan with train.updates: async")
    k = pipe.grad_accumulation
    rows: list[dict] = []
    t_start = time.perf_counter()
    c = 0
    while client.ticket(c):
        t0 = time.perf_counter()
        client.pull(c)
        version = min(client.versions.values()) if client.versions else 0
        loss = 0.0
        for j in range(k):
            batch = batch_of(c * k + j)
            try:
                loss += pipe.step(batch) / k
            except FxpipeError as e:
                raise type(e)(f"step {c} of replica {pipe.replica}: {e}") from None
        finite = math.isfinite(loss)
        if not finite and nan_policy == "stop":
            raise TrainingStopped(
                f"replica {pipe.replica}, step {c}: the loss is {loss} (not finite); training "
                f"stopped. Lower train.lr, or set train.nan_policy: skip to drop such steps")
        if after_backward is not None:
            after_backward(c)
        client.push(c, drop=not finite)
        pipe.zero_grad()
        dt = time.perf_counter() - t0
        rows.append({"replica": pipe.replica, "step": c, "version": version, "loss": loss,
                     "step_time_s": round(dt, 5),
                     "wall_s": round(time.perf_counter() - t_start, 5)})
        if log is not None:
            log.write(rows[-1])
        if on_step is not None:
            on_step(c, loss, dt, version)
        c += 1
    client.leave(c)
    return rows


def buffers_module(pipe) -> nn.Module:
    """This trainer's persistent buffers (no parameter: the servers save those)."""
    from fxpipe.training.compiled import _install

    module = nn.Module()
    params = {id(p) for p in pipe.module.parameters()}
    for name, t in pipe.module.state_dict(keep_vars=True).items():
        if id(t) not in params:
            _install(module, name, t)
    return module


def merged_losses(rows: list[dict], items_per_replica_step: int) -> list[tuple]:
    """``losses.csv`` rows from every replica's steps: ``(c, mean loss, mean step time,
    items/s)`` for each step index ``c`` any replica ran (items/s summed over the replicas)."""
    by_step: dict[int, list[dict]] = {}
    for r in rows:
        by_step.setdefault(r["step"], []).append(r)
    out = []
    for c in sorted(by_step):
        rs = sorted(by_step[c], key=lambda r: r["replica"])
        loss = sum(r["loss"] for r in rs) / len(rs)
        dt = sum(r["step_time_s"] for r in rs) / len(rs)
        rate = sum(items_per_replica_step / max(r["step_time_s"], 1e-9) for r in rs)
        out.append((c, loss, dt, rate))
    return out
