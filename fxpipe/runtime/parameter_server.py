"""Parameter servers for ``train.updates: async``: the server loop, its rules, and the client.

The last ``len(plan.parameter_servers)`` ranks hold the parameters and their optimizer state,
sharded as ``plan.server_params`` says (:mod:`fxpipe.partitioner.servers`). Every replica (one
pipeline of ranks) trains at its own pace, with no barrier across replicas:

1. before each of its steps, the replica's pipeline rank 0 asks server 0 (the *head*) for a
   ticket and tells its pipeline (a broadcast over the pipeline group); no ticket left: the
   replica leaves and receives the final weights;
2. every rank pulls the weights of its parameters from the servers holding them (each reply
   carries the server's *version*: the updates it has applied);
3. the replica runs its schedule (forward, backward: gradients in ``.grad``, no all-reduce);
4. every rank pushes its gradients, tagged with the version it used.

A server applies *rounds*: the mean of the replica-steps that are complete (every rank holding
the server's parameters pushed; a tied parameter's contributions summed), one optimizer step
each, ``version += 1``. The staleness of an applied gradient is ``version - used version``, and
:class:`RoundBook` keeps it at most ``max_staleness`` (S) by making ranks wait instead:

* a pull for step ``c`` is answered once at most S of the replica's earlier steps are unapplied
  (its gradient can be applied no sooner than after those);
* a round closes when every live replica's oldest step is complete (then it holds one step of
  each), or early, without the slow ones, when a replica that is ready waits on a pull and no
  other replica's outstanding step would become more than S updates stale.

With S = 0 no round closes early: every update averages one step of every replica, computed on
the same weights: exactly synchronous data parallelism. Tickets: with S = 0 each replica runs
``train.steps`` steps; with S > 0 they share ``steps x replicas`` (a fast replica does more).
Each replica's step ``c`` trains on its slice of global batch ``c``.

Every server appends the staleness of every applied gradient to its log (:data:`LOG_FIELDS`;
``serve()`` returns it, ``log_path`` writes it as CSV). Every wait (a message, a reply, a
ticket) is bounded by ``timeout_s`` and fails with one line naming the rank, the peer and what
it waited for.

Wire format (point-to-point over the mesh's server group, ``Mesh.server_group``: gloo on CPU
and CUDA alike; one header of 4 int64 ``[kind, step, version, flag]`` then a flat float
tensor): trainer -> server on ``TAG_REQUEST`` (+ ``TAG_GRADIENTS``), server -> trainer on
``TAG_REPLY`` (+ ``TAG_WEIGHTS``), tickets back on ``TAG_TICKET``. A server receives headers
from any source in arrival order; messages of one source keep their order.
"""

from __future__ import annotations

import csv
import datetime
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from fxpipe.errors import RuntimeFailure, comm_error_text, failed_how
from fxpipe.plans.placement import global_rank, rank_coords
from fxpipe.runtime.mesh import server_wire_group

PUSH, PULL, LEAVE, TICKET = 1, 2, 3, 4
TAG_REQUEST, TAG_GRADIENTS, TAG_REPLY, TAG_WEIGHTS, TAG_TICKET = 1, 2, 3, 4, 5
#: columns of a server's log: one row per applied gradient
LOG_FIELDS = ["round", "replica", "step", "used_version", "staleness", "round_size", "dropped",
              "time_s"]


def shard_layout(plan) -> dict[int, dict[int, list[str]]]:
    """server index -> pipeline rank -> the canonical parameter names that rank pushes to and
    pulls from that server, in a fixed order (both sides lay out their flat tensors by it)."""
    ranks = plan.stage_ranks()
    out: dict[int, dict[int, list[str]]] = {j: {} for j in range(len(plan.parameter_servers))}
    for st, r in sorted(zip(plan.stages, ranks), key=lambda x: x[0].index):
        for name in st.params:
            canon = plan.param_aliases.get(name, name)
            names = out[plan.server_params[canon]].setdefault(r, [])
            if canon not in names:
                names.append(canon)
    return out


#: the group of the parameter-server traffic; the mesh creates it (``Mesh.server_group``)
wire_group = server_wire_group


def _header(kind: int, step: int = 0, version: int = 0, flag: int = 0) -> torch.Tensor:
    return torch.tensor([kind, step, version, flag], dtype=torch.int64)


def _wait(work, timeout_s: float, what: str) -> None:
    try:
        work.wait(datetime.timedelta(seconds=timeout_s))
    except Exception as e:  # gloo / NCCL: RuntimeError, DistBackendError
        raise RuntimeFailure(f"{what} {failed_how(e, timeout_s)} "
                             f"({comm_error_text(e)}); check that "
                             "rank's log; raise train.timeout_s if it is only slow") from None


# ------------------------------------------------------------------------------ the rules
@dataclass
class _Entry:
    """One replica-step on one server: the oldest version its ranks pulled, who pushed."""

    step: int
    used: int
    pushed: set[int] = field(default_factory=set)
    dropped: bool = False  # a pushed gradient was not finite: the step adds nothing


class RoundBook:
    """Which replica-steps each server update averages, under a staleness bound (plain Python,
    no tensors: see the module docstring for the rules).

    Args:
        replicas: data-parallel replicas.
        contributors: ranks of each replica that push to this server.
        max_staleness: the bound S.
    """

    def __init__(self, replicas: int, contributors: int, max_staleness: int):
        self.replicas, self.contributors, self.s = replicas, contributors, max_staleness
        self.version = 0
        self.entries: list[OrderedDict[int, _Entry]] = [OrderedDict() for _ in range(replicas)]
        self.active = [contributors > 0] * replicas
        self.left: list[set[int]] = [set() for _ in range(replicas)]
        self.waiting: list[tuple[int, int, int]] = []  # pulls not answered: (rank, replica, step)

    def pull(self, rank: int, replica: int, step: int) -> None:
        """``rank`` of ``replica`` asks for the weights of its step ``step``."""
        self.waiting.append((rank, replica, step))

    def grant(self) -> list[tuple[int, int, int]]:
        """Answer every waiting pull the rule allows, at the current version: ``(rank,
        replica, step)`` of each; the others stay waiting."""
        granted, still = [], []
        for rank, r, step in self.waiting:
            if sum(1 for c in self.entries[r] if c < step) <= self.s:
                e = self.entries[r].setdefault(step, _Entry(step, self.version))
                e.used = min(e.used, self.version)
                granted.append((rank, r, step))
            else:
                still.append((rank, r, step))
        self.waiting = still
        return granted

    def push(self, rank: int, replica: int, step: int, finite: bool = True) -> _Entry:
        """``rank`` of ``replica`` pushed the gradients of ``step`` (it pulled for it first).

        Raises:
            RuntimeFailure: a push of a step whose weights were never pulled (a protocol bug).
        """
        e = self.entries[replica].get(step)
        if e is None:
            raise RuntimeFailure(f"rank {rank} (replica {replica}) pushed step {step} without "
                                 "pulling its weights first")
        e.pushed.add(rank)
        e.dropped |= not finite
        return e

    def complete(self, e: _Entry) -> bool:
        return len(e.pushed) >= self.contributors

    def leave(self, rank: int, replica: int) -> list[int]:
        """``rank`` of ``replica`` trains no more; once all of the replica's ranks left, its
        steps that will never be complete are dropped (returned)."""
        self.left[replica].add(rank)
        if len(self.left[replica]) < self.contributors:
            return []
        self.active[replica] = False
        gone = [c for c, e in self.entries[replica].items() if not self.complete(e)]
        for c in gone:
            del self.entries[replica][c]
        return gone

    def close(self) -> list[tuple[int, _Entry, int]] | None:
        """The next round, if one may close now: ``(replica, entry, staleness)`` of each
        replica-step it averages (the version is then one higher); None otherwise."""
        live = [r for r in range(self.replicas) if self.active[r] or self.entries[r]]
        heads = {r: next(iter(self.entries[r].values())) for r in live if self.entries[r]}
        ready = [r for r, e in heads.items() if self.complete(e)]
        if not ready:
            return None
        if len(ready) < len(live):  # early: only for a ready replica that waits, and only if
            if not any(r in ready for _, r, _ in self.waiting):  # nobody gets too stale
                return None
            for r in live:
                if r in ready:
                    continue
                if not self.entries[r] and self.s < 1:  # it will pull now: 1 update stale
                    return None
                for i, e in enumerate(self.entries[r].values()):
                    if self.version + 1 + i - e.used > self.s:
                        return None
        out = []
        for r in ready:
            _, e = self.entries[r].popitem(last=False)
            out.append((r, e, self.version - e.used))
        self.version += 1
        return out

    def finished(self) -> bool:
        """Every replica left and every complete step was applied."""
        return not any(self.active) and not any(self.entries)

    def describe(self) -> str:
        """What the server waits for, for a timeout message."""
        parts = []
        for r in range(self.replicas):
            for c, e in self.entries[r].items():
                if not self.complete(e):
                    parts.append(f"replica {r} step {c} (pushed by {len(e.pushed)} of "
                                 f"{self.contributors} ranks)")
            if self.active[r] and not self.entries[r]:
                parts.append(f"replica {r}'s next pull")
        return "; ".join(parts[:4]) or "nothing pending"


# ------------------------------------------------------------------------------ the server
class ParameterServer:
    """One parameter server rank: its shard of the parameters, their optimizer, the loop.

    Args:
        plan: the Plan (``parameter_servers``, ``server_params``).
        mesh: this rank's :class:`~fxpipe.runtime.mesh.Mesh` (``is_server``).
        params: canonical name -> this server's tensor of every parameter it holds.
        optimizer: the optimizer over those tensors (its state lives here), or None when the
            server holds no parameter.
        steps: ``train.steps`` (the ticket budget, see the module docstring).
        max_staleness: the bound S.
        timeout_s: seconds any wait may take.
        lr_at: learning rate for the update after ``k`` global batches' worth of gradients
            (``train.lr_schedule``), or None to keep the optimizer's.
        log_path: where to write the log as CSV (optional), a row per applied gradient as
            it is applied, flushed (a failed run keeps the rows before the failure).
        group: the process group carrying the traffic (default: the mesh's
            ``server_group``: the world group, gloo, on CPU; on CUDA a gloo group of every
            rank, :func:`~fxpipe.runtime.mesh.server_wire_group`).

    Attributes:
        is_server: True. index: this server's index. log: one dict per applied gradient
        (:data:`LOG_FIELDS`). module: set by the caller to an ``nn.Module`` holding ``params``
        under the model's names, for checkpoints.
    """

    is_server = True

    def __init__(self, plan, mesh, params: dict[str, torch.Tensor], optimizer, steps: int,
                 max_staleness: int, timeout_s: float, lr_at: Callable[[float], float] | None = None,
                 log_path: str | Path | None = None, group=None):
        self.plan, self.mesh, self.params, self.optimizer = plan, mesh, params, optimizer
        self.group = group if group is not None else getattr(mesh, "server_group", None)
        self.rank, self.device = mesh.rank, mesh.device
        self.index = plan.parameter_servers.index(mesh.rank)
        self.steps, self.s, self.timeout_s, self.lr_at = steps, max_staleness, timeout_s, lr_at
        self.log_path = Path(log_path) if log_path is not None else None
        self.log: list[dict] = []
        self._log_fh = self._log_writer = None
        self.module = None
        self.layout = shard_layout(plan)[self.index]  # pipeline rank -> names
        self.dp = plan.dp
        self.book = RoundBook(plan.dp, len(self.layout), max_staleness)
        self._grads: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self._final: list[int] = []  # ranks that left, waiting for the final weights
        self._applied = 0  # gradients applied (for the learning-rate schedule)
        # the head (server 0) hands out the tickets
        self._head = self.index == 0
        self._tickets = [0] * plan.dp
        self._denied = [False] * plan.dp

    def _coords(self, rank: int) -> tuple[int, int]:
        """(pipeline rank, replica) of a trainer rank."""
        return rank_coords(rank, self.plan.pipeline, self.plan.dp, self.plan.placement)

    def _rank(self, pipe_rank: int, replica: int) -> int:
        return global_rank(pipe_rank, replica, self.plan.pipeline, self.plan.dp,
                           self.plan.placement)

    def _who(self) -> str:
        return f"rank {self.rank} (parameter server {self.index})"

    # ------------------------------------------------------------------ the loop
    def serve(self) -> list[dict]:
        """Serve pushes, pulls and tickets until every replica left and got the final weights.

        Returns the log (one dict per applied gradient).

        Raises:
            RuntimeFailure: no message within ``timeout_s`` (naming what it waited for), or a
                reply that could not be delivered.
        """
        t0 = time.perf_counter()
        if self.log_path is not None:  # row by row, flushed: a failed run keeps what was applied
            self._log_fh = open(self.log_path, "w", newline="")
            self._log_writer = csv.DictWriter(self._log_fh, fieldnames=LOG_FIELDS)
            self._log_writer.writeheader()
            self._log_fh.flush()
        try:
            while not self._done():
                src, (kind, step, version, flag) = self._next_message()
                pipe_rank, replica = self._coords(src)
                if kind == TICKET:
                    self._ticket(src, replica, step)
                elif kind == PUSH:
                    self._receive_push(src, pipe_rank, replica, step, finite=not flag)
                elif kind == PULL:
                    self.book.pull(src, replica, step)
                elif kind == LEAVE:
                    self.book.leave(src, replica)
                    self._final.append(src)
                self._advance(t0)
        finally:
            if self._log_fh is not None:
                self._log_fh.close()
                self._log_fh = self._log_writer = None
        return self.log

    def _log_row(self, row: dict) -> None:
        self.log.append(row)
        if self._log_writer is not None:
            self._log_writer.writerow(row)
            self._log_fh.flush()

    def _done(self) -> bool:
        shard_done = self.book.finished() and not self._final
        return shard_done and (not self._head or all(self._denied))

    def _next_message(self) -> tuple[int, list[int]]:
        hdr = torch.zeros(4, dtype=torch.int64)
        work = dist.irecv(hdr, src=None, tag=TAG_REQUEST, group=self.group)
        waiting = self.book.describe()
        if self._head and not all(self._denied):
            waiting += "; tickets of replicas " + ", ".join(
                str(r) for r in range(self.dp) if not self._denied[r])
        _wait(work, self.timeout_s, f"{self._who()}: waiting for a push, pull or ticket from "
                                    f"the trainer ranks ({waiting})")
        return work._source_rank(), hdr.tolist()

    def _ticket(self, src: int, replica: int, step: int) -> None:
        if self.s == 0:  # lockstep: each replica its own share
            grant = step < self.steps
        else:  # shared: a fast replica takes more
            grant = sum(self._tickets) < self.steps * self.dp
        if grant:
            self._tickets[replica] += 1
        else:
            self._denied[replica] = True
        work = dist.isend(_header(TICKET, step, 0, int(grant)), src, tag=TAG_TICKET,
                          group=self.group)
        _wait(work, self.timeout_s, f"{self._who()}: the ticket reply to rank {src}")

    def _receive_push(self, src: int, pipe_rank: int, replica: int, step: int,
                      finite: bool) -> None:
        names = self.layout.get(pipe_rank, [])
        flat = torch.empty(sum(self.params[n].numel() for n in names))
        work = dist.irecv(flat, src=src, tag=TAG_GRADIENTS, group=self.group)
        _wait(work, self.timeout_s, f"{self._who()}: the gradients of step {step} from rank "
                                    f"{src} (replica {replica}, pipeline rank {pipe_rank})")
        entry = self.book.push(src, replica, step, finite)
        if entry.dropped:  # a non-finite gradient: the whole replica-step adds nothing
            self._grads.pop((replica, step), None)
            return
        acc = self._grads.setdefault((replica, step), {})
        flat = flat.to(self.device)
        off = 0
        for n in names:
            p = self.params[n]
            g = flat[off:off + p.numel()].view_as(p)
            off += p.numel()
            if n in acc:
                acc[n] += g  # a tied parameter: its stages' parts
            else:
                acc[n] = g

    def _advance(self, t0: float) -> None:
        """Answer the pulls the rules allow and apply the rounds that may close, until neither
        moves; then, once everything is applied, send the final weights to the ranks that
        left."""
        while True:
            granted = self.book.grant()
            for rank, _, _ in granted:
                self._reply(rank, final=False)
            rnd = self.book.close()
            if rnd is not None:
                self._apply(rnd, t0)
            if not granted and rnd is None:
                break
        if self.book.finished() and self._final:
            for rank in self._final:
                self._reply(rank, final=True)
            self._final = []

    def _apply(self, rnd: list[tuple[int, _Entry, int]], t0: float) -> None:
        """One optimizer step on the mean of the round's gradients; log each."""
        version = self.book.version - 1
        grads = [self._grads.pop((r, e.step), None) for r, e, _ in rnd]
        valid = [g for (r, e, _), g in zip(rnd, grads) if not e.dropped and g is not None]
        if valid and self.optimizer is not None:
            if self.lr_at is not None:
                lr = self.lr_at(self._applied / self.dp)
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
            with torch.no_grad():
                for n, p in self.params.items():
                    total = valid[0][n].clone()
                    for g in valid[1:]:
                        total += g[n]
                    p.grad = total.div_(len(valid))
            self.optimizer.step()
            for p in self.params.values():
                p.grad = None
        self._applied += len(valid)
        now = time.perf_counter() - t0
        for r, e, stale in rnd:
            self._log_row({"round": version, "replica": r, "step": e.step,
                             "used_version": e.used, "staleness": stale,
                             "round_size": len(rnd), "dropped": int(e.dropped),
                             "time_s": round(now, 4)})

    def _reply(self, rank: int, final: bool) -> None:
        """The weights of this server that ``rank`` holds, with the version."""
        pipe_rank, replica = self._coords(rank)
        names = self.layout.get(pipe_rank, [])
        flat = (torch.cat([self.params[n].detach().reshape(-1) for n in names]).cpu() if names
                else torch.empty(0))
        what = "final weights" if final else "weights"
        works = [dist.isend(t, rank, tag=tag, group=self.group) for t, tag in (
            (_header(LEAVE if final else PULL, 0, self.book.version), TAG_REPLY),
            (flat, TAG_WEIGHTS))]
        for work in works:
            _wait(work, self.timeout_s, f"{self._who()}: sending the {what} to rank {rank} "
                                        f"(replica {replica})")


# ------------------------------------------------------------------------------ the client
class ParameterClient:
    """A trainer rank's side: tickets, pulls, pushes and the final weights.

    Args:
        plan: the Plan. mesh: this trainer rank's Mesh.
        params: canonical name -> this rank's parameter, for every parameter it holds.
        timeout_s: seconds any wait may take. group: as for :class:`ParameterServer` (default
            the mesh's ``server_group``).

    Attributes:
        versions: server index -> the version of the weights pulled last from it.
        waited_s: seconds spent waiting for pulls (staleness waits included), in all.
    """

    def __init__(self, plan, mesh, params: dict[str, torch.nn.Parameter], timeout_s: float,
                 group=None):
        self.mesh, self.timeout_s, self.device = mesh, timeout_s, mesh.device
        self.group = group if group is not None else getattr(mesh, "server_group", None)
        self.head = plan.parameter_servers[0]
        self.shards = []  # (server index, server rank, names, tensors)
        for j, by_rank in shard_layout(plan).items():
            names = by_rank.get(mesh.pipe_rank, [])
            if names:
                self.shards.append((j, plan.parameter_servers[j], names,
                                    [params[n] for n in names]))
        self.versions: dict[int, int] = {}
        self.waited_s = 0.0
        self._sends: list[tuple[object, str]] = []

    def _who(self) -> str:
        m = self.mesh
        return f"rank {m.rank} (replica {m.dp_rank}, pipeline rank {m.pipe_rank})"

    def ticket(self, step: int) -> bool:
        """Whether this replica trains step ``step``: pipeline rank 0 asks the head server,
        the others learn it from a broadcast over the replica's pipeline group."""
        m = self.mesh
        flag = torch.zeros(1, dtype=torch.int64, device=self.device)
        if m.pipe_rank == 0:
            reply = torch.zeros(4, dtype=torch.int64)
            work = dist.irecv(reply, src=self.head, tag=TAG_TICKET, group=self.group)
            sent = dist.isend(_header(TICKET, step), self.head, tag=TAG_REQUEST, group=self.group)
            what = (f"{self._who()}: the ticket for step {step} from the head parameter server "
                    f"(rank {self.head})")
            _wait(work, self.timeout_s, what)
            _wait(sent, self.timeout_s, what)
            flag.fill_(int(reply[3]))
        if m.pipe_group is not None:
            work = dist.broadcast(flag, src=m.global_rank(0), group=m.pipe_group,
                                  async_op=True)
            what = (f"telling its pipeline ranks {m.pipe_ranks[1:]} whether step {step} runs"
                    if m.pipe_rank == 0 else f"whether step {step} runs, from its pipeline "
                    f"rank 0 (rank {m.global_rank(0)})")
            _wait(work, self.timeout_s, f"{self._who()}: {what}")
        return bool(flag.item())

    def _request(self, kind: int, step: int, what: str) -> None:
        """Send ``kind`` to every server of this rank and copy the weights they answer."""
        pending = []
        g = self.group
        for j, server, names, tensors in self.shards:
            hdr = torch.zeros(4, dtype=torch.int64)
            flat = torch.empty(sum(t.numel() for t in tensors))
            pending.append((j, server, tensors, hdr, flat,
                            dist.irecv(hdr, src=server, tag=TAG_REPLY, group=g),
                            dist.irecv(flat, src=server, tag=TAG_WEIGHTS, group=g),
                            dist.isend(_header(kind, step), server, tag=TAG_REQUEST, group=g)))
        t0 = time.perf_counter()
        for j, server, tensors, hdr, flat, *works in pending:
            why = (" (a pull waits while this replica is more than max_staleness updates "
                   "ahead of a slower one)" if kind == PULL else "")
            for work in works:
                _wait(work, self.timeout_s, f"{self._who()}: the {what} of step {step} from "
                                            f"parameter server {j} (rank {server}){why}")
            self.versions[j] = int(hdr[2])
            flat = flat.to(self.device)
            off = 0
            with torch.no_grad():
                for t in tensors:
                    t.copy_(flat[off:off + t.numel()].view_as(t))
                    off += t.numel()
        self.waited_s += time.perf_counter() - t0
        for work, what_ in self._sends:  # the servers read them before answering
            _wait(work, self.timeout_s, what_)
        self._sends = []

    def pull(self, step: int) -> None:
        """The weights for step ``step`` from every server (waits while the staleness bound
        says so)."""
        self._request(PULL, step, "weights")

    def push(self, step: int, drop: bool = False) -> None:
        """Send this rank's gradients of step ``step`` (``.grad``; none counts as zeros) to
        every server holding its parameters, tagged with the versions pulled; returns at once
        (the next pull waits for the sends). A gradient that is not finite, or ``drop`` (e.g.
        a non-finite loss), flags the push: the servers drop the whole replica-step."""
        for j, server, names, tensors in self.shards:
            flat = torch.cat([(t.grad if t.grad is not None else torch.zeros_like(t)).reshape(-1)
                              for t in tensors]).detach().cpu()
            bad = int(drop or not bool(torch.isfinite(flat).all()))
            what = f"{self._who()}: the gradients of step {step} to parameter server {j} " \
                   f"(rank {server})"
            for t, tag in ((_header(PUSH, step, self.versions.get(j, 0), bad), TAG_REQUEST),
                           (flat, TAG_GRADIENTS)):
                self._sends.append((dist.isend(t, server, tag=tag, group=self.group), what))

    def leave(self, step: int) -> None:
        """This replica trains no more: tell the servers and receive the final weights (after
        every replica's last update)."""
        self._request(LEAVE, step, "final weights")
