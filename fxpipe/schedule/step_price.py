"""The one rule that prices a training step: the planner's layout search ranks every candidate
cut with it and the Plan's prediction (:func:`~fxpipe.schedule.simulate.simulate_plan`) is
made with it, so a plan is predicted on the numbers it was chosen on.

Both sides describe the step the same way: per stage a :class:`StageStep` (its F/B/W seconds
per micro-batch, its activation bytes, the parameter bytes it holds and how many of them other
stages use too, the shapes of its trained matrices, its send seconds) and the bytes crossing
each stage edge per micro-batch; :func:`price_step` adds what follows from the training
options and the cluster (:class:`Reduction`: the data-parallel all-reduce, reduce-scatter and
all-gather bytes under ``train.grad_compression`` and ``parallel.data_sharding``, the state
each stage holds; :func:`links_of`: the links the layout uses) and simulates the step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from fxpipe.plans.placement import grid_slots_per_node
from fxpipe.schedule.actions import Schedule
from fxpipe.schedule.simulate import Edge, Links, LoweredSchedule, SimResult, StageCosts, simulate
from fxpipe.schedule.wire import WIRE16, compressed_bytes, ring_allreduce_bytes
from fxpipe.specs.gpus import link_curve
from fxpipe.specs.schema import (OPTIMIZER_STATE_FACTOR, ClusterSpec, CompressionSpec, TrainSpec,
                                 state_factor)

__all__ = ["StageStep", "Reduction", "links_of", "gather_exposure", "price_step"]


@dataclass
class StageStep:
    """One stage's share of a step, as the pricing rule reads it.

    Attributes:
        fwd_s, bwd_input_s, bwd_weight_s: seconds per micro-batch (a recomputing stage's
            forward again included in ``bwd_input_s``).
        activation_bytes: bytes held per micro-batch in flight.
        param_bytes: bytes of the parameters charged to the stage (a tied one to its first
            stage only): what its replicas reduce.
        shared_bytes: of those, the bytes of parameters other stages use too (a tied
            embedding): reduced whole, never sharded.
        tied_bytes: the bytes of parameters charged to another stage that this one uses too
            (a tied embedding's later copy): not in ``param_bytes``; gathered block by block,
            held whole with their gradients and optimizer state like ``shared_bytes``.
        matrices: the shapes of the stage's trained parameters (PowerSGD compresses each
            matrix); empty when unknown (then priced as one vector of ``param_bytes``).
        send_s, grad_send_s: sender-side seconds of one forward / gradient send.
        gather_rows: under ``data_sharding: full`` gathered block by block
            (``parallel.param_gather: block``), per group of the stage's unshared parameters
            in the order its forward gathers them, ``[bytes, F, B, W, replay]``: the group's
            bytes and the seconds of the stage's F, B (its replayed forward aside), W and
            replayed forward that run while it is the last group gathered
            (:func:`gather_exposure` prices their gathers); empty: gathered whole once per
            step, or not sharded.
        gather_replay: a recomputing stage: its replayed forward gathers every group again.
        expert_bytes: of ``param_bytes``, the bytes of this rank's experts (expert
            parallelism): never sharded (they differ between replicas), held with their whole
            state, reduced over the replicas holding the same experts.
    """

    fwd_s: float
    bwd_input_s: float
    bwd_weight_s: float
    activation_bytes: int = 0
    param_bytes: float = 0.0
    shared_bytes: float = 0.0
    matrices: list[tuple[int, ...]] = field(default_factory=list)
    send_s: float = 0.0
    grad_send_s: float = 0.0
    gather_rows: list[list[float]] = field(default_factory=list)
    gather_replay: bool = False
    tied_bytes: float = 0.0
    expert_bytes: float = 0.0


@dataclass(frozen=True)
class Reduction:
    """How each stage's gradients travel between its ``dp`` replicas, and the training state a
    stage holds per parameter byte.

    Attributes:
        dp: replicas per stage.
        optimizer: ``train.optimizer`` (the state it keeps per parameter).
        method, rank, ratio: ``train.grad_compression`` and its settings.
        sharding: ``parallel.data_sharding`` as planned (``none``, ``optimizer``,
            ``gradients``, ``full``).
        servers: parameter servers (``train.updates: async``): they replace the all-reduce.
    """

    dp: int = 1
    optimizer: str = "adamw"
    method: str = "none"
    rank: int = CompressionSpec().rank
    ratio: float = CompressionSpec().ratio
    sharding: str = "none"
    servers: int = 0

    @classmethod
    def of(cls, train: TrainSpec, dp: int, sharding: str, servers: int = 0) -> "Reduction":
        """From the typed ``train`` section, the layout's replicas and sharding level."""
        c = train.compression
        opt = train.optimizer if train.optimizer in OPTIMIZER_STATE_FACTOR else "adamw"
        return cls(dp, opt, train.grad_compression or "none", c.rank, c.ratio, sharding,
                   servers)

    @property
    def state_factor(self) -> float:
        """Bytes of parameters, gradients and optimizer state a stage holds per parameter
        byte (:func:`~fxpipe.specs.schema.state_factor`)."""
        return state_factor(self.optimizer, self.sharding, self.dp)

    def sharded_bytes(self, st: StageStep) -> float:
        """Bytes of the stage's parameters its replicas shard: those no other stage uses,
        under data sharding (0 without it, with one replica or parameter servers)."""
        if self.sharding == "none" or self.dp <= 1 or self.servers:
            return 0.0
        return max(0.0, float(st.param_bytes) - float(st.shared_bytes) - float(st.expert_bytes))

    def allreduce_bytes(self, st: StageStep) -> float:
        """The bytes the simulator prices for the stage's all-reduce: its unsharded
        parameters' (fp32) bytes, scaled by what the compression sends once compressing
        against the fp32 ring (:func:`~fxpipe.schedule.wire.compressed_bytes`: half for
        ``fp16`` / ``bf16``, ``rank x (rows + cols)`` per matrix for ``powersgd``, the
        values and indices all-gather for ``topk``)."""
        raw = float(st.param_bytes) - self.sharded_bytes(st)
        if self.method == "none" or self.dp <= 1 or self.servers:
            return raw
        if self.method == "powersgd" and not st.matrices:
            return raw
        numel = int(raw) // 4
        mine = [tuple(s) for s in st.matrices] if self.method == "powersgd" else []
        if not mine or numel <= 0:
            mine = [(numel,)]
        total = sum(math.prod(s) for s in mine)
        exact = ring_allreduce_bytes(total * 4, self.dp)
        sent = compressed_bytes(self.method, mine, self.dp, rank=self.rank, ratio=self.ratio)
        return raw * sent / exact if exact else raw

    def scatter_gather_bytes(self, st: StageStep) -> tuple[float, float]:
        """The bytes priced for the reduce-scatter of the stage's sharded gradients (half under
        16-bit compression) and for the all-gather of its parameters after the step (none for
        a stage gathered block by block: it reduce-scatters and gathers per micro-batch,
        :func:`gather_exposure`)."""
        sharded = self.sharded_bytes(st)
        if sharded and st.gather_rows:
            return 0.0, 0.0
        return sharded * (0.5 if self.method in WIRE16 else 1.0), sharded

    def static_bytes(self, st: StageStep, split: bool) -> float:
        """Bytes of parameters, gradients and optimizer state the stage holds at its peak:
        ``state_factor x param_bytes``, or, gathered block by block, the runtime's peak
        (:mod:`fxpipe.runtime.block_gather`; groups' padding aside) for the stage's groups
        ``P_g`` (``P`` in all; ``n`` replicas, ``k`` optimizer bytes per parameter byte):
        ``(3 + k) / n x P`` of shards (master, float32 gradient slices of the step and kept
        across steps, optimizer state), the shared parameters whole with their state
        (``(2 + k) x (shared_bytes + tied_bytes)``), the largest adjacent pair of groups gathered
        (``P_g + P_g+1``; one group alone), the reduce-scatters' buffers (the largest
        ``w P_g + w P_g / n + w P_g-1``, ``w`` the wire's share: 1/2 under 16-bit compression)
        and the whole gradients of one group (the largest), or of every group under a split
        backward (``split``)."""
        sharded = self.sharded_bytes(st)
        if not (sharded and st.gather_rows):
            whole = float(st.expert_bytes) if sharded else 0.0  # experts: never sharded
            return ((float(st.param_bytes) - whole) * self.state_factor
                    + whole * state_factor(self.optimizer))
        return block_static_bytes([float(r[0]) for r in st.gather_rows],
                                  float(st.shared_bytes) + float(st.tied_bytes), self.dp,
                                  OPTIMIZER_STATE_FACTOR[self.optimizer] - 2.0,
                                  0.5 if self.method in WIRE16 else 1.0, split)


def block_static_bytes(groups: Sequence[float], shared: float, n: int, k: float, wire: float,
                       split: bool) -> float:
    """:meth:`Reduction.static_bytes` of a stage gathered block by block: its groups' bytes
    ``groups`` in forward order, ``shared`` bytes of parameters other stages use too."""
    if not groups:
        return (2.0 + k) * shared
    pairs = [a + b for a, b in zip(groups, groups[1:])] or [groups[0]]
    w = [wire * g for g in groups]
    reducing = max([a + a / n + b for a, b in zip(w[1:], w)] or [w[0] + w[0] / n])
    mine = sum(groups)
    return ((2.0 + k) * shared + (3.0 + k) / n * mine + max(pairs) + reducing
            + (mine if split else max(groups)))


def links_of(cluster: ClusterSpec, pipeline: int, dp: int, tensor: int = 1,
             layout: str = "pipeline-inner", servers: int = 0) -> Links:
    """The links a ``pipeline x dp`` grid of tensor groups of ``tensor`` uses on ``cluster``
    (typed, its defaults applied once by the schema), placed by ``layout``, with ``servers``
    parameter servers after the grid."""
    lk = cluster.links
    return Links.from_cluster(pipeline, dp, cluster.nodes,
                              grid_slots_per_node(cluster.devices_per_node, tensor),
                              lk.intra_node_GBps, lk.inter_node_GBps, lk.latency_s, layout,
                              servers, **link_curve(cluster.device, cluster.gpu))


def gather_exposure(st: StageStep, gather_s, scatter_s, split: bool
                    ) -> tuple[float, float, float]:
    """Seconds a stage gathered block by block adds to its F, B and W per micro-batch: the
    all-gather of each group (``gather_s(bytes)``) before it runs, the next group's prefetched
    while the current one computes, and (not split) the reduce-scatter of each group's
    gradients (``scatter_s(bytes)``) once its backward is done, overlapping the next group's.
    With ``G_k``, ``R_k`` and ``C_k`` the group's gather, reduce-scatter and compute:

    * F: ``G_0 + sum_k max(0, G_{k+1} - C_k)``;
    * B, groups in reverse order ``q``: ``G_q0 + sum_j max(0, G_q(j+1) + R_q(j-1) - C_qj) +
      R_q(last)`` (split: no ``R``, W computes the weight gradients); a recomputing stage's
      replayed forward first gathers again every group it runs (those with replay seconds:
      all of them, or a partially recomputing stage's first blocks), priced as F over them;
    * W (split only): every group's reduce-scatter after it, ``sum_k R_k``."""
    rows = st.gather_rows
    if not rows:
        return 0.0, 0.0, 0.0
    g = [gather_s(float(r[0])) for r in rows]
    rs = [scatter_s(float(r[0])) for r in rows]
    n = len(rows)

    def forward(col: int, only: list[int]) -> float:
        if not only:
            return 0.0
        return g[only[0]] + sum(max(0.0, g[b] - float(rows[a][col]))
                                for a, b in zip(only[:-1], only[1:]))

    back = [float(r[2]) + (0.0 if split else float(r[3])) for r in rows]
    r_b = [0.0] * n if split else rs
    q = list(range(n - 1, -1, -1))
    xb = g[q[0]] + r_b[q[-1]] + sum(
        max(0.0, (g[q[j + 1]] if j + 1 < n else 0.0) + (r_b[q[j - 1]] if j else 0.0)
            - back[q[j]]) for j in range(n))
    if st.gather_replay:
        xb += forward(4, [i for i in range(n) if float(rows[i][4]) > 0])
    return forward(1, list(range(n))), xb, sum(rs) if split else 0.0


def _with_gathers(stages: Sequence[StageStep], reduction: "Reduction", links: Links,
                  s2r: Sequence[int], split: bool) -> list[StageStep]:
    """The stages with their per-micro-batch gathers (:func:`gather_exposure`) in their F, B
    and W, over the data-parallel ring of their rank."""
    out = []
    wire = 0.5 if reduction.method in WIRE16 else 1.0
    for j, st in enumerate(stages):
        if not (st.gather_rows and reduction.sharded_bytes(st)):
            out.append(st)
            continue
        r = s2r[j]
        xf, xb, xw = gather_exposure(
            st, lambda b: links.gather_seconds(b, reduction.dp, r),
            lambda b: links.gather_seconds(b * wire, reduction.dp, r), split)
        out.append(StageStep(st.fwd_s + xf, st.bwd_input_s + xb, st.bwd_weight_s + xw,
                             st.activation_bytes, st.param_bytes, st.shared_bytes,
                             st.matrices, st.send_s, st.grad_send_s, st.gather_rows,
                             st.gather_replay, st.tied_bytes))
    return out


def price_step(schedule: Schedule | LoweredSchedule, stages: Sequence[StageStep],
               fwd_edges: Mapping[Edge, float], grad_edges: Mapping[Edge, float],
               links: Links, reduction: Reduction,
               server_bytes: Sequence[Sequence[float]] | None = None, *, check: bool = True,
               timeline: bool = True) -> SimResult:
    """Simulate one step of ``schedule`` over ``stages`` (see the module doc).

    Args:
        fwd_edges / grad_edges: ``{(sender, receiver): bytes per micro-batch}`` of the values
            and of their gradients.
        server_bytes: ``[stage][server]`` bytes each stage pushes and pulls under parameter
            servers (None: the all-reduce).
        check, timeline: as :func:`~fxpipe.schedule.simulate.simulate`.
    """
    plain = schedule.schedule if isinstance(schedule, LoweredSchedule) else schedule
    split = bool(plain.split_backward)
    static = [int(reduction.static_bytes(s, split)) for s in stages]
    if any(s.gather_rows for s in stages):
        stages = _with_gathers(stages, reduction, links, plain.stage_to_rank, split)
    costs = StageCosts([float(s.fwd_s) for s in stages], [float(s.bwd_input_s) for s in stages],
                       [float(s.bwd_weight_s) for s in stages],
                       activation_bytes=[int(s.activation_bytes) for s in stages],
                       static_bytes=static,
                       send_s=[float(s.send_s) for s in stages],
                       grad_send_s=[float(s.grad_send_s) for s in stages])
    sharding = reduction.sharding != "none" and reduction.dp > 1 and not reduction.servers
    sg = [reduction.scatter_gather_bytes(s) for s in stages] if sharding else None
    return simulate(schedule, costs, dict(fwd_edges), links, dp=reduction.dp,
                    allreduce_bytes=[reduction.allreduce_bytes(s) for s in stages],
                    grad_edge_bytes=dict(grad_edges), check=check, timeline=timeline,
                    server_bytes=server_bytes if reduction.servers else None,
                    scatter_bytes=[x[0] for x in sg] if sg else None,
                    gather_bytes=[x[1] for x in sg] if sg else None)
