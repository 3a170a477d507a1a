"""The mesh: this rank's place on the data x pipeline x tensor grid, and the process groups.

The one owner of the rank layout at run time (the rule itself lives in
:mod:`fxpipe.plans.placement`); nobody else computes ``rank // p``. Layout (Megatron-LM /
torchtitan convention, tensor innermost, then pipeline)::

    rank = (dp_rank * pipeline + pipe_rank) * tensor + tp_rank

so a tensor group is ``t`` adjacent ranks (inside one node), replica ``d`` owns the consecutive
ranks ``d*p*t .. (d+1)*p*t - 1`` and pipeline rank ``r`` has one copy in every replica.

Process groups (created with ``torch.distributed.new_group``; creation is collective, so every
rank builds a :class:`Mesh` with the same arguments in the same order):

* one **data-parallel group** per (pipeline rank, tensor rank): the replicas of that rank's
  shards; their gradients are averaged over it;
* one **pipeline group** per (replica, tensor rank): the ranks that pass activations to each
  other (tensor rank ``k`` of one stage sends to tensor rank ``k`` of the next);
* one **tensor group** per (replica, pipeline rank): the ranks that split the stages' layers
  (:mod:`fxpipe.tensor`); with ``tensor == 1`` none;
* one **model-parallel group** per replica: its pipeline x tensor ranks (a gradient norm over the
  whole model, the loss);
* with expert parallelism (``expert`` = ``N`` > 1), per (pipeline rank, tensor rank) one
  **expert group** per ``N`` consecutive replicas (their ranks split each MoE layer's experts
  and exchange tokens by all-to-all, :mod:`fxpipe.experts`) and one **expert-replica group**
  per expert-group rank (the replicas holding the same experts: their gradients are reduced
  over it);
* with context parallelism (``context`` = ``N`` > 1), per (pipeline rank, tensor rank) one
  **context group** per ``N`` consecutive replicas: they hold the same samples, each its part
  of every sequence (:mod:`fxpipe.context`), and all-gather keys and values over it; as
  replicas they average their gradients over the data-parallel group with the others;
* on request (:meth:`Mesh.replica_group`), a group of the ranks holding a **shared parameter**
  (e.g. tied input embedding on pipeline rank 0 and output head on the last pipeline rank) in all
  replicas, per tensor rank, over which its gradient is summed (Megatron-LM's "embedding
  group");
* with parameter servers (``train.updates: async``), the **server group** their traffic uses
  (:func:`server_wire_group`: the world group on CPU, a gloo group of every rank on CUDA).

Nothing else in the runtime creates a process group. Point-to-point traffic uses the default
(world) group with global ranks. The tensor group's collectives (:mod:`fxpipe.tensor.
collectives`) report their timing to the mesh's :attr:`Mesh.tp_recorder` (``tp_collectives``
pairs it with the group; the executor listens while it runs a step).
"""

from __future__ import annotations

import datetime
import os
from typing import Iterable

import torch
import torch.distributed as dist

from fxpipe.errors import RuntimeFailure
from fxpipe.execution.host_memory import keep_freed_memory
from fxpipe.plans.placement import global_rank, rank_coords
from fxpipe.tensor.collectives import CollectiveRecorder, TimedGroup

_ENV_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def init_distributed(device: str = "cpu", timeout_s: float = 300.0) -> torch.device:
    """Join the default process group from torchrun's environment and return this rank's device.

    Reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (and ``LOCAL_RANK`` for CUDA),
    as set by ``torchrun`` / ``torch.distributed.run`` / ``fxpipe run``. Backend: gloo for
    ``device="cpu"``, NCCL for ``device="cuda"`` with device ``cuda:LOCAL_RANK``. If the default
    group already exists it is reused. On a CPU the process's malloc keeps freed memory from
    then on (:func:`fxpipe.execution.host_memory.keep_freed_memory`).

    Args:
        device: ``"cpu"`` or ``"cuda"``.
        timeout_s: seconds any collective or rendezvous may wait before failing.

    Returns:
        ``torch.device("cpu")`` or ``torch.device("cuda", LOCAL_RANK)``.

    Raises:
        RuntimeFailure: unknown device, missing launcher environment, no CUDA device.
    """
    if device not in ("cpu", "cuda"):
        raise RuntimeFailure(
            f"device {device!r} is not supported; use 'cpu' (gloo) or 'cuda' (NCCL)")
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeFailure(
                "cluster.device is 'cuda' but torch sees no CUDA device; use device 'cpu' or run "
                "on a machine with GPUs and a CUDA build of torch"
            )
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
        keep_freed_memory()  # activations freed each micro-batch are reused, not page-faulted
    if dist.is_initialized():
        return dev
    missing = [v for v in _ENV_VARS if v not in os.environ]
    if missing:
        raise RuntimeFailure(
            f"environment variables {', '.join(missing)} are not set, so this process cannot join "
            "a process group; launch it with `fxpipe run SPEC` or `torchrun --nproc-per-node N ...`"
        )
    timeout = datetime.timedelta(seconds=timeout_s)
    kwargs = {}
    store = _attempt_store(timeout)
    if store is not None:
        kwargs = dict(store=store, rank=int(os.environ["RANK"]),
                      world_size=int(os.environ["WORLD_SIZE"]))
    if device == "cuda":
        dist.init_process_group("nccl", timeout=timeout, device_id=dev, **kwargs)
    else:
        dist.init_process_group("gloo", timeout=timeout, **kwargs)
    return dev


def _attempt_store(timeout: datetime.timedelta):
    """Under torchrun's elastic agent: its shared store, with keys prefixed by the restart
    attempt. The agent keeps one store across restarts, so without a prefix the workers of a
    restart read the addresses the dead workers published and never connect. None otherwise."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                         is_master=False, timeout=timeout)
    return dist.PrefixStore(f"fxpipe/attempt_{attempt}", base)


def server_wire_group(device: str, timeout_s: float):
    """The process group parameter-server traffic uses: None (the world group) on CPU, where
    it is gloo; on CUDA a gloo group of every rank (NCCL cannot receive from any source), its
    tensors on the host. Collective: every rank calls it (:class:`Mesh` does, with servers)."""
    if device != "cuda":
        return None
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


class Mesh:
    """This rank's place on the ``dp x pipeline x tensor`` grid and its process groups.

    Args:
        pipeline: ranks per pipeline group (``p``).
        dp: data-parallel degree (replicas of every stage).
        device: device of this rank (default CPU); tensors the runtime allocates live there.
        timeout_s: timeout of the groups created here, seconds.
        layout: how the pipeline x data grid lies on the ranks (:data:`fxpipe.plans.placement.
            LAYOUTS`; the Plan's ``placement``).
        servers: parameter servers (``train.updates: async``): the last ranks, after the grid.
            They build the mesh too (group creation is collective) but hold no grid place.
        tensor: tensor-parallel degree (``t``, innermost).
        expert: expert-parallel degree (``N``, dividing ``dp``): replicas per expert group.
        context: context-parallel degree (dividing ``dp``): consecutive replicas per context
            group, which share samples (``dp / context`` of them apart in data).

    Attributes:
        rank / world_size: global rank and ``pipeline * dp * tensor + servers``.
        server_ranks: global ranks of the parameter servers; is_server: this rank is one.
        pipe_rank / dp_rank / tp_rank: this rank's coordinates (-1 on a parameter server).
        dp_group: data-parallel group of this (pipeline rank, tensor rank) (``None`` when
            ``dp == 1``).
        pipe_group: pipeline group of this (replica, tensor rank) (``None`` when
            ``pipeline == 1``).
        tp_group: tensor group of this (replica, pipeline rank) (``None`` when ``tensor == 1``).
        mp_group: every pipeline and tensor rank of this replica (``None`` when
            ``pipeline * tensor == 1``).
        dp_ranks / pipe_ranks / tp_ranks / mp_ranks: global ranks of those groups, ascending.
        server_group: with ``servers``, the group of the parameter-server traffic
            (:func:`server_wire_group`; None: the world group), on every rank; else None.
        ep_rank / ep_group / expert_dp_group: with ``expert > 1``, this rank's place in its
            expert group (``dp_rank % expert``), the group, and the group of the replicas
            holding the same experts (None when one rank).
        cp_rank / cp_group: with ``context > 1``, this rank's place in its context group
            (``dp_rank % context``) and the group; sample_replica: which share of the batch the
            rank's replica takes (``dp_rank // context``).
        tp_recorder: the :class:`~fxpipe.tensor.collectives.CollectiveRecorder` the tensor
            group's collectives (and the expert group's all-to-alls) report their timing to; tp_collectives: ``tp_group`` with it
            (a :class:`~fxpipe.tensor.collectives.TimedGroup`, what tensor-parallel stages run
            their collectives over).

    A ``Mesh(1, 1)`` also works without torch.distributed (one process, no groups): all stages on
    one rank, e.g. to run several virtual stages in-process.

    Raises:
        RuntimeFailure: torch.distributed is not initialised (and ``pipeline * dp * tensor >
            1``), or its world size is not ``pipeline * dp * tensor`` (+ servers).
    """

    def __init__(self, pipeline: int, dp: int, device: torch.device | str | None = None,
                 timeout_s: float = 300.0, layout: str = "pipeline-inner", servers: int = 0,
                 tensor: int = 1, expert: int = 1, context: int = 1):
        if pipeline < 1 or dp < 1 or tensor < 1:
            raise RuntimeFailure(f"Mesh(pipeline={pipeline}, dp={dp}, tensor={tensor}): all must "
                                 "be >= 1")
        grid = pipeline * dp * tensor
        single = not dist.is_initialized()
        if single and grid != 1:
            raise RuntimeFailure(
                "torch.distributed is not initialised; call fxpipe.runtime.mesh.init_distributed() "
                "first (under `fxpipe run` or torchrun)"
            )
        world = 1 if single else dist.get_world_size()
        if world != grid + servers:
            more = f" + {servers} parameter servers" if servers else ""
            tp = f" x tensor {tensor}" if tensor > 1 else ""
            raise RuntimeFailure(
                f"world size is {world} but pipeline x dp{' x tensor' if tensor > 1 else ''}"
                f"{' + servers' if servers else ''} = {pipeline} x {dp}{tp}{more} = "
                f"{grid + servers}; launch {grid + servers} processes or change "
                "parallel.pipeline / parallel.data / parallel.tensor"
            )
        if expert < 1 or dp % expert:
            raise RuntimeFailure(f"Mesh: expert={expert} must divide dp={dp}")
        if context < 1 or dp % context:
            raise RuntimeFailure(f"Mesh: context={context} must divide dp={dp}")
        self.pipeline, self.dp, self.tensor, self.expert = pipeline, dp, tensor, expert
        self.context = context
        self.world_size, self.layout = world, layout
        self.rank = 0 if single else dist.get_rank()
        self.server_ranks = list(range(grid, grid + servers))
        self.is_server = self.rank in self.server_ranks
        if self.is_server:
            self.pipe_rank = self.dp_rank = self.tp_rank = -1
        else:
            self.pipe_rank, self.dp_rank = rank_coords(self.rank, pipeline, dp, layout, tensor)
            self.tp_rank = self.rank % tensor
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.timeout = datetime.timedelta(seconds=timeout_s)
        # Collective creation: every rank creates every group, in the same order.
        at = self._at
        self._dp_groups: dict[tuple[int, int], object] = {}
        for r in range(pipeline):
            for k in range(tensor):
                ranks = [at(r, d, k) for d in range(dp)]
                self._dp_groups[(r, k)] = self._new(ranks)
        self._pipe_groups: dict[tuple[int, int], object] = {}
        for d in range(dp):
            for k in range(tensor):
                self._pipe_groups[(d, k)] = self._new([at(r, d, k) for r in range(pipeline)])
        self._tp_groups: dict[tuple[int, int], object] = {}
        self._mp_groups: dict[int, object] = {}
        for d in range(dp):
            for r in range(pipeline):
                self._tp_groups[(d, r)] = self._new([at(r, d, k) for k in range(tensor)])
            self._mp_groups[d] = (self._pipe_groups[(d, 0)] if tensor == 1 else  # the same
                                  self._new(sorted(at(r, d, k) for r in range(pipeline)
                                                   for k in range(tensor))))
        self._ep_groups: dict[tuple[int, int, int], object] = {}
        self._expert_dp_groups: dict[tuple[int, int, int], object] = {}
        if expert > 1:
            for r in range(pipeline):
                for k in range(tensor):
                    for g in range(dp // expert):
                        self._ep_groups[(r, k, g)] = self._new(
                            [at(r, g * expert + i, k) for i in range(expert)])
                    for i in range(expert):
                        self._expert_dp_groups[(r, k, i)] = self._new(
                            [at(r, g * expert + i, k) for g in range(dp // expert)])
        self._cp_groups: dict[tuple[int, int, int], object] = {}
        if context > 1:
            for r in range(pipeline):
                for k in range(tensor):
                    for g in range(dp // context):
                        self._cp_groups[(r, k, g)] = self._new(
                            [at(r, g * context + i, k) for i in range(context)])
        self._replica_groups: dict[tuple[int, ...], dict[int, object]] = {}
        self.server_group = (server_wire_group(self.device.type, timeout_s) if servers
                             else None)
        self.tp_recorder = CollectiveRecorder()
        if self.is_server:
            self.dp_ranks, self.pipe_ranks, self.tp_ranks, self.mp_ranks = [], [], [], []
            self.dp_group = self.pipe_group = self.tp_group = self.mp_group = None
            self.ep_rank, self.ep_group, self.expert_dp_group = -1, None, None
            self.cp_rank, self.cp_group, self.sample_replica = -1, None, -1
            return
        r, d, k = self.pipe_rank, self.dp_rank, self.tp_rank
        self.dp_ranks = [at(r, e, k) for e in range(dp)]
        self.pipe_ranks = [at(j, d, k) for j in range(pipeline)]
        self.tp_ranks = [at(r, d, j) for j in range(tensor)]
        self.mp_ranks = sorted(at(j, d, i) for j in range(pipeline) for i in range(tensor))
        self.dp_group = self._dp_groups[(r, k)]
        self.pipe_group = self._pipe_groups[(d, k)]
        self.tp_group = self._tp_groups[(d, r)]
        self.mp_group = self._mp_groups[d]
        self.ep_rank = d % expert
        self.ep_group = self._ep_groups.get((r, k, d // expert))
        self.expert_dp_group = self._expert_dp_groups.get((r, k, self.ep_rank))
        self.cp_rank, self.sample_replica = d % context, d // context
        self.cp_group = self._cp_groups.get((r, k, d // context))

    @property
    def tp_collectives(self) -> TimedGroup:
        """This rank's tensor group with :attr:`tp_recorder`, for the tensor-parallel stages'
        collectives (:mod:`fxpipe.tensor.collectives`)."""
        return TimedGroup(self.tp_group, self.tp_recorder)

    @property
    def ep_collectives(self) -> TimedGroup:
        """This rank's expert group with :attr:`tp_recorder` (the all-to-alls of
        :mod:`fxpipe.experts.all_to_all` report there)."""
        return TimedGroup(self.ep_group, self.tp_recorder)

    @property
    def cp_collectives(self) -> TimedGroup:
        """This rank's context group with :attr:`tp_recorder` (the all-gathers and
        reduce-scatters of :mod:`fxpipe.context.collectives` report there)."""
        return TimedGroup(self.cp_group, self.tp_recorder)

    def _at(self, pipe_rank: int, dp_rank: int, tp_rank: int) -> int:
        return global_rank(pipe_rank, dp_rank, self.pipeline, self.dp, self.layout, self.tensor,
                           tp_rank)

    def _new(self, ranks: list[int]):
        """A process group of ``ranks`` (collective), or None for a single rank."""
        return dist.new_group(ranks, timeout=self.timeout) if len(ranks) > 1 else None

    def global_rank(self, pipe_rank: int, dp_rank: int | None = None) -> int:
        """Global rank of ``pipe_rank`` in replica ``dp_rank`` (default: this rank's replica),
        at this rank's tensor rank."""
        return self._at(pipe_rank, self.dp_rank if dp_rank is None else dp_rank,
                        max(0, self.tp_rank))

    def group_ranks(self, pipe_ranks: Iterable[int], tp_rank: int | None = None) -> list[int]:
        """Global ranks holding any of ``pipe_ranks`` in any replica at tensor rank ``tp_rank``
        (default: this rank's), ascending."""
        k = max(0, self.tp_rank) if tp_rank is None else tp_rank
        key = sorted(set(pipe_ranks))
        return sorted(self._at(r, d, k) for r in key for d in range(self.dp))

    def replica_group(self, pipe_ranks: Iterable[int]):
        """Process group of the ranks holding ``pipe_ranks`` in every replica, at this rank's
        tensor rank (shared parameters: each tensor rank holds its own shard of them).

        Collective: every rank must call it with the same arguments in the same order (members
        and non-members alike). Cached per set of pipeline ranks. A single pipeline rank gives
        its data-parallel group. Returns ``None`` when the group would hold one rank only.
        """
        key = tuple(sorted(set(pipe_ranks)))
        if not key or min(key) < 0 or max(key) >= self.pipeline:
            raise RuntimeFailure(f"pipeline ranks {key} are outside 0..{self.pipeline - 1}")
        k = max(0, self.tp_rank)
        if len(key) == 1:
            return self._dp_groups[(key[0], k)]
        if key not in self._replica_groups:
            self._replica_groups[key] = {
                j: dist.new_group(self.group_ranks(key, j), timeout=self.timeout)
                for j in range(self.tensor)}
        return self._replica_groups[key][k]

    def __repr__(self) -> str:
        tp = f", tensor={self.tensor}, tp_rank={self.tp_rank}" if self.tensor > 1 else ""
        return (f"Mesh(pipeline={self.pipeline}, dp={self.dp}, rank={self.rank}, "
                f"pipe_rank={self.pipe_rank}, dp_rank={self.dp_rank}{tp})")
