"""Discrete-event simulator: prices a schedule's per-rank action lists with a cost model.

It walks the very lists the executor runs (:mod:`fxpipe.schedule.actions`), so the predicted
timeline and the measured one have the same actions. Semantics:

* each rank runs its list in order; F/B/W take the stage's forward / input-gradient /
  weight-gradient seconds (when the backward is not split, B takes input + weight seconds);
* SEND occupies the sender's own thread for ``StageCosts.send_s[stage]`` seconds (host-side
  staging: gloo on CPU moves the bytes in the sending rank's thread, and the receiver's gloo
  thread reads them on its CPU, both taken from compute: a measured send cost holds both, charged
  here to the sender; about 0 with NCCL, the default when ``send_s`` is None), then returns (non-blocking); the transfer starts after that,
  when the link between the two ranks is free, and arrives ``latency + bytes / bandwidth`` later
  (one transfer at a time per directed rank pair);
* RECV blocks until the matching SEND's data has arrived;
* ALLREDUCE starts the stage's data-parallel ring all-reduce asynchronously (one at a time per
  rank), ``2(n-1)/n x bytes / bandwidth + 2(n-1) x latency`` seconds (Patarasuk & Yuan, 2009);
  it overlaps with later work; STEP waits for all of the rank's all-reduces, then takes
  ``StageCosts.step_s``;
* with parameter servers (``train.updates: async``, ``server_bytes`` given) there is no
  all-reduce: STEP adds the push of the rank's gradients to the servers and the pull of its
  weights (:meth:`Links.push_pull_seconds`), as the runtime does them after the step.

Bubble fraction (the documented definition): ``1 - mean over ranks of (compute busy seconds of
the rank) / step time``, i.e. the mean per-rank idle share of the step, where "busy" counts only
F/B/W (a send's sender-side seconds count as idle, as in the executor's measurement). With
uniform costs and no communication, GPipe and 1F1B give exactly ``(p-1)/(m+p-1)``.

Units: seconds, bytes, GB/s = 1e9 bytes/s.

Size: over 600 lines because the event loop, its lowered program and the link model are kept with
the semantics above, which they implement together."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from dataclasses import dataclass, field

import numpy as np

from fxpipe.errors import ScheduleError
from fxpipe.plans.placement import (global_rank, node_of, replica_period, ring_members_per_node,
                                    server_link_crosses_nodes)
from fxpipe.plans.plan import Predicted
from fxpipe.schedule.actions import Action, Op, Schedule
from fxpipe.schedule.lowering import add_communication, communication_peers, linear_edges
from fxpipe.schedule.timeline import TimelineEvent, action_label
from fxpipe.schedule.validate import validate
from fxpipe.specs.schema import DEFAULT_INTER_NODE_GBPS, DEFAULT_INTRA_NODE_GBPS, DEFAULT_LATENCY_S

Edge = tuple[int, int]


@dataclass
class StageCosts:
    """Per-stage costs for one micro-batch (lists indexed by stage).

    Attributes:
        fwd_s: forward seconds.
        bwd_input_s: input-gradient (B) seconds.
        bwd_weight_s: weight-gradient (W) seconds; a non-split B costs ``bwd_input_s +
            bwd_weight_s``.
        activation_bytes: bytes held per micro-batch in flight (default 0).
        static_bytes: bytes held regardless of micro-batches: parameters, gradients, optimizer
            state (default 0).
        step_s: optimizer-step seconds per rank (default 0).
        send_s: seconds the sending rank's own thread is occupied per SEND_F / SEND_B action of
            the stage (host-side staging: copying the bytes into gloo's buffers on CPU, and, in a
            measured cost, the receiver's share; about 0 with NCCL, where the copy is on the
            device). None: 0 (sends free for the sender).
            Not counted as compute busy time.
        grad_send_s: the same per SEND_B action (the input gradients a stage sends back to its
            producers, sized by those gradients, not by its forward outputs). None: ``send_s``.
    """

    fwd_s: list[float]
    bwd_input_s: list[float]
    bwd_weight_s: list[float]
    activation_bytes: list[int] | None = None
    static_bytes: list[int] | None = None
    step_s: float = 0.0
    send_s: list[float] | None = None
    grad_send_s: list[float] | None = None

    @classmethod
    def uniform(cls, num_stages: int, f: float = 1.0, b: float = 1.0, w: float = 0.0,
                activation_bytes: int = 0, static_bytes: int = 0,
                send: float = 0.0) -> "StageCosts":
        """Every stage costs ``f`` / ``b`` / ``w`` seconds (a non-split B costs ``b + w``) and
        ``send`` sender-side seconds per SEND action."""
        return cls([f] * num_stages, [b] * num_stages, [w] * num_stages,
                   [activation_bytes] * num_stages, [static_bytes] * num_stages,
                   send_s=[send] * num_stages)

    def check(self, num_stages: int) -> None:
        """Raise ScheduleError unless every list has ``num_stages`` non-negative entries and
        ``step_s`` is non-negative."""
        if self.step_s < 0:
            raise ScheduleError(f"StageCosts.step_s is negative ({self.step_s}); give seconds >= 0")
        for name in ("fwd_s", "bwd_input_s", "bwd_weight_s", "activation_bytes", "static_bytes",
                     "send_s", "grad_send_s"):
            vals = getattr(self, name)
            if vals is None:
                continue
            if len(vals) != num_stages:
                raise ScheduleError(
                    f"StageCosts.{name} has {len(vals)} entries but the schedule has "
                    f"{num_stages} stages; give one per stage"
                )
            if any(x < 0 for x in vals):
                raise ScheduleError(f"StageCosts.{name} has a negative entry: {list(vals)}; "
                                    "costs are seconds / bytes >= 0")


@dataclass
class Links:
    """Link model between pipeline ranks and within data-parallel groups.

    Attributes:
        p2p_GBps: default point-to-point bandwidth, GB/s (1e9 bytes/s, one direction).
        latency_s: per-message latency, seconds.
        dp_GBps: default bandwidth of a data-parallel ring; None: ``p2p_GBps``.
        pair_GBps: overrides for a (src pipeline rank, dst pipeline rank) pair.
        dp_rank_GBps: overrides of the ring bandwidth per pipeline rank (its stages' groups).
        server_GBps: bandwidth between a pipeline rank and a parameter server, by
            ``(pipeline rank, server index)``; default ``p2p_GBps``.
        half_bytes: collectives only: the message size at which the bus bandwidth reaches
            half its peak (NCCL on GPUs, :mod:`fxpipe.partitioner.gpu_model`): a ring pass
            costs ``(bytes + half_bytes) / bw``; 0 (default) prices plain rings.
    """

    p2p_GBps: float = DEFAULT_INTRA_NODE_GBPS
    latency_s: float = 0.0
    dp_GBps: float | None = None
    pair_GBps: dict[tuple[int, int], float] = field(default_factory=dict)
    dp_rank_GBps: dict[int, float] = field(default_factory=dict)
    server_GBps: dict[tuple[int, int], float] = field(default_factory=dict)
    half_bytes: float = 0.0

    def p2p_seconds(self, src: int, dst: int, nbytes: float) -> tuple[float, float]:
        """(link occupancy, latency) seconds to move ``nbytes`` from rank ``src`` to ``dst``."""
        bw = self.pair_GBps.get((src, dst), self.pair_GBps.get((dst, src), self.p2p_GBps))
        return nbytes / (bw * 1e9), self.latency_s

    def allreduce_seconds(self, nbytes: float, n: int, rank: int = 0) -> float:
        """Ring all-reduce of ``nbytes`` over ``n`` ranks: ``2(n-1)/n x bytes / bw + 2(n-1) x
        latency`` (Patarasuk & Yuan, 2009); 0 when ``n == 1``."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        bw = self.dp_rank_GBps.get(rank, self.dp_GBps or self.p2p_GBps)
        return (2 * (n - 1) / n * (nbytes + self.half_bytes) / (bw * 1e9)
                + 2 * (n - 1) * self.latency_s)

    def gather_seconds(self, nbytes: float, n: int, rank: int = 0) -> float:
        """Ring reduce-scatter, or all-gather, of ``nbytes`` over ``n`` ranks (each half of a
        ring all-reduce): ``(n-1)/n x bytes / bw + (n-1) x latency``; 0 when ``n == 1``."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        bw = self.dp_rank_GBps.get(rank, self.dp_GBps or self.p2p_GBps)
        return (n - 1) / n * (nbytes + self.half_bytes) / (bw * 1e9) + (n - 1) * self.latency_s

    def push_pull_seconds(self, rank: int, stage_bytes: Sequence[float],
                          loads: Sequence[float], dp: int) -> float:
        """Parameter servers: seconds pipeline rank ``rank`` spends pushing a stage's gradients
        to, and pulling its weights from, every server ``j`` holding ``stage_bytes[j]`` of them,
        where server ``j`` holds ``loads[j]`` bytes for every one of ``dp`` replicas. Per server
        the longer of the rank's own round trip (``2 x bytes / bandwidth``) and the server's
        link carrying all replicas' traffic (``dp x load / bandwidth`` each way: the central
        bottleneck of a parameter server), plus two latencies; the servers work in parallel."""
        out = 0.0
        for j, b in enumerate(stage_bytes):
            if b > 0:
                bw = self.server_GBps.get((rank, j), self.p2p_GBps) * 1e9
                out = max(out, max(2 * b, dp * loads[j]) / bw + 2 * self.latency_s)
        return out

    @classmethod
    def from_cluster(
        cls,
        pipeline: int,
        dp: int,
        nodes: int = 1,
        devices_per_node: int | None = None,
        intra_node_GBps: float = DEFAULT_INTRA_NODE_GBPS,
        inter_node_GBps: float = DEFAULT_INTER_NODE_GBPS,
        latency_s: float = DEFAULT_LATENCY_S,
        layout: str = "pipeline-inner",
        servers: int = 0,
        rails: bool = False,
        half_bytes: float = 0.0,
    ) -> "Links":
        """Links for ``pipeline x dp`` ranks (and ``servers`` parameter servers after them) on
        ``nodes`` nodes of ``devices_per_node``, placed as :mod:`fxpipe.plans.placement` places
        them: a pipeline pair / data-parallel ring / rank-to-server link gets the inter-node
        bandwidth when any replica's pair / the ring / the rank crosses nodes. ``rails`` (GPU
        nodes, one NIC per device): a ring crossing nodes with ``k`` members on each node runs
        ``k`` NICs at once, ``min(intra, k x inter)``
        (:func:`fxpipe.partitioner.gpu_model.ring_bus_GBps`); ``half_bytes``: see the class."""
        dpn = devices_per_node or max(1, (pipeline * dp) // max(nodes, 1))
        # replicas repeat with period dpn (placement.replica_period), and a rank's node does
        # not decrease with the replica: the first dpn replicas decide the pairs, the first and
        # last replica the rings
        reps = sorted(set(range(min(dp, replica_period(dpn)))) | {dp - 1})
        node = np.array([[node_of(global_rank(r, d, pipeline, dp, layout), dpn)
                          for r in range(pipeline)] for d in reps])  # [replica, rank]
        per = node[:min(dp, replica_period(dpn))]
        cross = (per[:, :, None] != per[:, None, :]).any(axis=0)
        pairs = {(a, b): inter_node_GBps if cross[a, b] else intra_node_GBps
                 for a in range(pipeline) for b in range(pipeline) if a != b}
        dpr = {r: inter_node_GBps if node[0, r] != node[-1, r] else intra_node_GBps
               for r in range(pipeline)}
        if rails:
            k = ring_members_per_node(pipeline, dp, dpn, layout)
            dpr = {r: bw if bw == intra_node_GBps else min(intra_node_GBps,
                                                           k[r] * inter_node_GBps)
                   for r, bw in dpr.items()}
        srv = {(r, j): inter_node_GBps if server_link_crosses_nodes(
                   r, pipeline * dp + j, pipeline, dp, dpn, layout) else intra_node_GBps
               for r in range(pipeline) for j in range(servers)}
        return cls(intra_node_GBps, latency_s, intra_node_GBps, pairs, dpr, srv, half_bytes)


@dataclass
class SimResult:
    """Simulated training step.

    Attributes:
        step_time_s: seconds from the first action to the last rank's STEP end.
        busy_s: per rank, seconds of F/B/W compute.
        idle_fraction: per rank, ``1 - busy_s[r] / step_time_s``.
        bubble_fraction: mean of ``idle_fraction`` (see the module docstring).
        peak_inflight: per stage, peak number of micro-batches whose F is done and whose B (W when
            split) is not.
        peak_memory_bytes: per stage, ``peak_inflight x activation_bytes + static_bytes``.
        events: the timeline (:class:`TimelineEvent`), ready for ``write_chrome_trace``.
    """

    step_time_s: float
    busy_s: list[float]
    idle_fraction: list[float]
    bubble_fraction: float
    peak_inflight: list[int]
    peak_memory_bytes: list[int]
    events: list[TimelineEvent]

    def predicted(self) -> Predicted:
        """As the Plan's :class:`~fxpipe.plans.plan.Predicted`."""
        return Predicted(self.step_time_s, self.bubble_fraction, list(self.peak_memory_bytes),
                         list(self.peak_inflight))


def simulate(
    schedule: Schedule | LoweredSchedule,
    costs: StageCosts,
    edge_bytes: Mapping[Edge, float] | None = None,
    links: Links | None = None,
    dp: int = 1,
    allreduce_bytes: Sequence[float] | None = None,
    grad_edge_bytes: Mapping[Edge, float] | None = None,
    check: bool = True,
    timeline: bool = True,
    server_bytes: Sequence[Sequence[float]] | None = None,
    scatter_bytes: Sequence[float] | None = None,
    gather_bytes: Sequence[float] | None = None,
) -> SimResult:
    """Price one training step of ``schedule`` (see the module docstring for the semantics).

    Args:
        schedule: a full schedule (with communication, e.g. from ``build_schedule``), or a
            :class:`LoweredSchedule` (the same results, faster when only the figures matter).
        costs: per-stage seconds and bytes.
        edge_bytes: ``{(producer_stage, consumer_stage): bytes per micro-batch}`` of forward
            values; its keys are the stage graph's edges. Default: the linear chain, 0 bytes.
        links: bandwidths and latency; default ``Links()`` (450 GB/s, zero latency).
        dp: data-parallel degree ``n`` of every stage's all-reduce.
        allreduce_bytes: per stage, gradient bytes all-reduced per step (default 0).
        grad_edge_bytes: bytes of gradients sent back per edge per micro-batch; default
            ``edge_bytes`` (all values floating point).
        check: validate the schedule first (recommended; raises on a broken schedule).
        timeline: record the per-action events (``SimResult.events``); False when only the
            figures matter (the planner's search), which is faster.
        server_bytes: parameter servers instead of the all-reduce: ``[stage][server]`` bytes
            each stage pushes and pulls per step (see the module docstring); None: all-reduce.
        scatter_bytes: sharded data parallelism: per stage, gradient bytes reduce-scattered at
            its ALLREDUCE (besides ``allreduce_bytes``' all-reduce; default 0).
        gather_bytes: per stage, parameter bytes all-gathered after the optimizer step (the
            updated slices; default 0).

    Returns:
        :class:`SimResult`.

    Raises:
        ScheduleError: invalid schedule, mismatched cost lists, or a deadlock.
    """
    lowered = None
    if isinstance(schedule, LoweredSchedule):
        if check or timeline or schedule.program is None:
            schedule = schedule.full()
        else:  # its compute-only schedule has the full one's ranks, stages and placement
            lowered, schedule = schedule, schedule.schedule
    n, p = schedule.num_stages, schedule.num_ranks
    costs.check(n)
    links = links or Links()
    if edge_bytes is None:
        edge_bytes = {e: 0 for e in linear_edges(n)}
    if grad_edge_bytes is None:
        grad_edge_bytes = edge_bytes
    ar_bytes = list(allreduce_bytes) if allreduce_bytes is not None else [0] * n
    if len(ar_bytes) != n:
        raise ScheduleError(f"allreduce_bytes has {len(ar_bytes)} entries for {n} stages")
    if dp < 1:
        raise ScheduleError(f"data-parallel degree must be >= 1, got dp={dp}")
    if check:
        validate(schedule, set(edge_bytes), set(grad_edge_bytes))
    s2r = schedule.stage_to_rank
    send_cost = list(costs.send_s) if costs.send_s is not None else [0.0] * n
    grad_send_cost = list(costs.grad_send_s) if costs.grad_send_s is not None else send_cost
    push_pull = [0.0] * p  # per rank: parameter-server round trips of its stages
    scatter = list(scatter_bytes) if scatter_bytes is not None else [0.0] * n
    gather = list(gather_bytes) if gather_bytes is not None else [0.0] * n
    if len(scatter) != n or len(gather) != n:
        raise ScheduleError(f"scatter_bytes / gather_bytes have {len(scatter)} / {len(gather)} "
                            f"entries for {n} stages")
    servers = server_bytes is not None
    # seconds of each stage's ALLREDUCE action (its all-reduce, and its reduce-scatter)
    ar_secs = [0.0 if servers else links.allreduce_seconds(ar_bytes[s], dp, s2r[s])
               + links.gather_seconds(scatter[s], dp, s2r[s]) for s in range(n)]
    for r in range(p):  # after the step, the all-gather of the rank's updated slices
        mine = sum(gather[s] for s in range(n) if s2r[s] == r)
        push_pull[r] += 0.0 if servers else links.gather_seconds(mine, dp, r)
    if server_bytes is not None:
        loads = [sum(row[j] for row in server_bytes) for j in range(len(server_bytes[0]))] \
            if server_bytes else []
        for s in range(n):
            push_pull[s2r[s]] += links.push_pull_seconds(s2r[s], server_bytes[s], loads, dp)

    prog = lowered.program if lowered is not None else _compile(schedule)
    run = None
    if prog is not None:
        try:
            bound = prog.bind(costs, edge_bytes, grad_edge_bytes, links, send_cost,
                              grad_send_cost)
        except Exception:  # noqa: BLE001  (the reference loop raises it where it used to)
            bound = None
        if bound is not None:
            run = _run_program(prog, bound, schedule.actions if timeline else None, ar_secs,
                               costs.step_s, push_pull)
    if run is None:
        if lowered is not None:
            schedule, lowered = lowered.full(), None
        run = _run_reference(schedule, costs, edge_bytes, grad_edge_bytes, links, ar_secs,
                             send_cost, grad_send_cost, push_pull, timeline)
    t, busy, ar_free, ptr, peak, events = run
    lengths = [len(c) for c in prog.code] if lowered is not None else [
        len(schedule.actions[r]) for r in range(p)]
    stuck = [r for r in range(p) if ptr[r] < lengths[r]]
    if stuck:
        if lowered is not None:
            schedule = lowered.full()
        raise ScheduleError(
            "deadlock in simulation: "
            + "; ".join(f"rank {r} waits at {schedule.actions[r][ptr[r]]}" for r in stuck)
            + "; validate the schedule (fxpipe.schedule.validate.validate) for details"
        )
    step = max([*t, *ar_free, 0.0])
    idle = [1.0 - b / step if step > 0 else 0.0 for b in busy]
    act = costs.activation_bytes or [0] * n
    static = costs.static_bytes or [0] * n
    mem = [int(peak[s] * act[s] + static[s]) for s in range(n)]
    return SimResult(step, busy, idle, sum(idle) / p, peak, mem, events)


# ----------------------------------------------------------------------------- the event loop
#
# simulate() compiles the schedule's action lists into integer programs once per call
# (:func:`_compile`) and runs them with the costs looked up per position (:func:`_run_program`):
# the same round-robin over ranks, the same floating-point operations in the same order, so the
# results, and the timeline events with their order, are exactly those of the per-action loop
# (:func:`_run_reference`, the definition; kept for the schedules the compiled form does not
# take: an action off its stage's rank, a stage outside 0..n-1, an op that is not an ``Op``,
# costs or links that raise while being looked up).

_ALLREDUCE, _STEP = -1, -2  # ``other_row`` of the actions that are not SENDs


@dataclass
class _Program:
    """A full schedule as integer programs, independent of the costs (plain ints in lists: next
    to nothing for the garbage collector to track).

    Attributes:
        num_ranks / num_stages: ``p`` / ``n``.
        split: the schedule's ``split_backward`` (B costs input + weight seconds when False).
        code: per rank, per action: ``kind x n + stage`` for F (kind 0) / B (1) / W (2), an
            index into the duration table :meth:`bind` gives; ``3n + slot`` for a RECV that
            waits for message ``slot``; ``~j`` (negative) for the ``j``-th of the rank's other
            actions.
        other_row / other_arg: per rank, per other action: a SEND is ``(row of sends, slot)``,
            an ALLREDUCE ``(_ALLREDUCE, stage)``, the STEP ``(_STEP, 0)``. ``slot`` indexes the
            arrival time of one (direction, sender stage, micro-batch, receiver stage) message.
        sends: distinct ``(rank, gradient?, stage, peer, link)`` of the SEND actions; ``link``
            indexes ``links``, the distinct ``(rank, destination rank)`` pairs (one transfer
            at a time on each).
        num_slots: message slots (``microbatches`` per channel, a channel being one direction
            between two stages).
        peak: per stage, peak micro-batches in flight (F done, B / W not): it depends only on
            the order of the stage's actions on its rank, not on the costs.
    """

    num_ranks: int
    num_stages: int
    split: bool
    code: list[list[int]]
    other_row: list[list[int]]
    other_arg: list[list[int]]
    sends: list[tuple[int, bool, int, int, int]]
    links: list[tuple[int, int]]
    num_slots: int
    peak: list[int]

    def bind(self, costs: StageCosts, edge_bytes: Mapping[Edge, float],
             grad_edge_bytes: Mapping[Edge, float], links: Links,
             send_cost: Sequence[float], grad_send_cost: Sequence[float]
             ) -> tuple[list[float], list[tuple[float, int, float, float]]]:
        """(durations, sends): F/B/W seconds indexed by ``code`` (the very expressions of the
        per-action loop: a non-split B is ``bwd_input_s + bwd_weight_s``, a split one
        ``bwd_input_s + 0.0``), and per row of ``sends`` ``(sender seconds, link, link
        occupancy, latency)`` (:meth:`Links.p2p_seconds` once per distinct send)."""
        n, split = self.num_stages, self.split
        fwd, bi, bw = costs.fwd_s, costs.bwd_input_s, costs.bwd_weight_s
        dur = ([fwd[s] for s in range(n)]
               + [bi[s] + (0.0 if split else bw[s]) for s in range(n)]
               + [bw[s] for s in range(n)])
        sends = []
        for r, grad, s, q, li in self.sends:
            if grad:
                c = grad_send_cost[s]
                nbytes = grad_edge_bytes.get((q, s), 0)
            else:
                c = send_cost[s]
                nbytes = edge_bytes.get((s, q), 0)
            occ, lat = links.p2p_seconds(r, self.links[li][1], nbytes)
            sends.append((c, li, occ, lat))
        return dur, sends


class _Builder:
    """Collects the channels, send rows and links of a :class:`_Program` as actions come."""

    def __init__(self, n: int, m: int):
        self.n, self.m = n, m
        self.chan: dict[int, int] = {}  # (sender x n + receiver) x 2 + gradient -> first slot
        self.sends: list[tuple[int, bool, int, int, int]] = []
        self.link_idx: dict[tuple, int] = {}

    def channel(self, key: int) -> int:
        base = self.chan.get(key)
        if base is None:
            base = self.chan[key] = len(self.chan) * self.m
        return base

    def send_row(self, rows: dict[int, int], key: int, r: int, grad: bool, s: int, q: int,
                 dst: int) -> int:
        li = self.link_idx.get((r, dst))
        if li is None:
            li = self.link_idx[(r, dst)] = len(self.link_idx)
        row = rows[key] = len(self.sends)
        self.sends.append((r, grad, s, q, li))
        return row

    def program(self, p: int, split: bool, codes, rows, args, peak) -> _Program:
        return _Program(p, self.n, split, codes, rows, args, self.sends, list(self.link_idx),
                        len(self.chan) * self.m, peak)


def _compile(schedule: Schedule) -> _Program | None:
    """The schedule as a :class:`_Program`, or None where the compiled loop would not give the
    per-action loop's results (see above)."""
    try:
        return _compile_lists(schedule.actions, schedule.stage_to_rank, schedule.num_ranks,
                              schedule.num_stages, schedule.microbatches,
                              schedule.split_backward)
    except Exception:  # noqa: BLE001  (malformed actions: the reference loop handles them)
        return None


def _compile_lists(actions: Sequence[Sequence[Action]], s2r: Sequence[int], p: int, n: int,
                   m: int, split: bool) -> _Program | None:
    """See :func:`_compile`. A message is matched by (direction, sender stage, micro-batch,
    receiver stage), as the per-action loop's keys match; it takes slot ``channel x m +
    micro-batch``, so stages, peers and micro-batches of messages must be ints in range here,
    and compute actions sit on their stage's rank (in-flight peaks are counted per rank)."""
    if len(actions) != p or len(s2r) != n or type(m) is not int or m < 1:
        return None
    F, B, W = Op.F, Op.B, Op.W
    SEND_F, SEND_B, RECV_F, RECV_B = Op.SEND_F, Op.SEND_B, Op.RECV_F, Op.RECV_B
    ALLREDUCE, STEP = Op.ALLREDUCE, Op.STEP
    release = W if split else B
    n2, n3 = 2 * n, 3 * n
    build = _Builder(n, m)
    chan, channel, send_row = build.chan, build.channel, build.send_row
    inflight = [0] * n
    peak = [0] * n
    codes: list[list[int]] = []
    other_rows: list[list[int]] = []
    other_args: list[list[int]] = []
    for r, acts in enumerate(actions):
        code: list[int] = []
        orow: list[int] = []
        oarg: list[int] = []
        emit = code.append
        rows: dict[int, int] = {}  # channel key -> row of ``sends`` (this rank sends on it)
        for a in acts:
            op = a.op
            if op is F or op is B or op is W:
                s = a.stage
                if not 0 <= s < n or s2r[s] != r:
                    return None
                if op is F:
                    emit(s)
                    v = inflight[s] + 1
                    inflight[s] = v
                    if v > peak[s]:
                        peak[s] = v
                elif op is B:
                    emit(n + s)
                else:
                    emit(n2 + s)
                if op is release:
                    inflight[s] -= 1
                continue
            if op is RECV_F or op is RECV_B or op is SEND_F or op is SEND_B:
                s, q, i = a.stage, a.peer, a.microbatch
                if (type(s) is not int or type(q) is not int or type(i) is not int
                        or not (0 <= s < n and 0 <= q < n and 0 <= i < m)):
                    return None
                if op is RECV_F or op is RECV_B:  # waits for the message q -> s
                    key = (q * n + s) * 2 + (op is RECV_B)
                    base = chan.get(key)
                    emit(n3 + (channel(key) if base is None else base) + i)
                    continue
                grad = op is SEND_B
                key = (s * n + q) * 2 + grad
                base = chan.get(key)
                if base is None:
                    base = channel(key)
                row = rows.get(key)
                if row is None:
                    row = send_row(rows, key, r, grad, s, q, s2r[q])
                emit(~len(orow))
                orow.append(row)
                oarg.append(base + i)
            elif op is ALLREDUCE:
                emit(~len(orow))
                orow.append(_ALLREDUCE)
                oarg.append(a.stage)
            elif op is STEP:
                emit(~len(orow))
                orow.append(_STEP)
                oarg.append(0)
            else:
                return None
        codes.append(code)
        other_rows.append(orow)
        other_args.append(oarg)
    return build.program(p, split, codes, other_rows, other_args, peak)


def _lowered_program(schedule: Schedule, peers) -> _Program | None:
    """The :class:`_Program` of ``add_communication(schedule, edges, grad_edges)`` straight from
    the compute-only ``schedule`` and :func:`~fxpipe.schedule.lowering.communication_peers`'s
    ``peers`` of those edges, without building the communication actions: the same codes,
    channels, send rows and links (the other actions may be numbered in another order). None
    where :func:`_compile` could give None for the lowered schedule (then the caller lowers it
    for real)."""
    try:
        return _lowered_lists(schedule, peers)
    except Exception:  # noqa: BLE001
        return None


def _lowered_lists(schedule: Schedule, peers) -> _Program | None:
    actions, s2r = schedule.actions, schedule.stage_to_rank
    p, n, m = schedule.num_ranks, schedule.num_stages, schedule.microbatches
    split = schedule.split_backward
    if len(actions) != p or len(s2r) != n or type(m) is not int or m < 1:
        return None
    prod, cons, gprod, gcons = peers
    for table in peers:
        for peer_list in table.values():
            if any(type(q) is not int or not 0 <= q < n for q in peer_list):
                return None
    F, B, W = Op.F, Op.B, Op.W
    release = W if split else B  # also add_communication's last_op (ALLREDUCE after it)
    n2, n3 = 2 * n, 3 * n
    build = _Builder(n, m)
    chan, channel, send_row = build.chan, build.channel, build.send_row
    inflight = [0] * n
    peak = [0] * n
    codes: list[list[int]] = []
    other_rows: list[list[int]] = []
    other_args: list[list[int]] = []
    for r, acts in enumerate(actions):
        code: list[int] = []
        orow: list[int] = []
        oarg: list[int] = []
        emit = code.append
        rows: dict[int, int] = {}
        last_idx: dict[int, int] = {}
        for a in acts:
            op = a.op
            s = a.stage
            if type(s) is not int or not 0 <= s < n or s2r[s] != r:
                return None
            if op is F or op is B:
                grad = op is B
                recv_from, send_to = (gcons[s], gprod[s]) if grad else (prod[s], cons[s])
                if recv_from or send_to:
                    i = a.microbatch
                    if type(i) is not int or not 0 <= i < m:
                        return None
                for q in recv_from:  # RECV_F / RECV_B (stage s, peer q): the message q -> s
                    key = (q * n + s) * 2 + grad
                    base = chan.get(key)
                    emit(n3 + (channel(key) if base is None else base) + i)
                if grad:
                    emit(n + s)
                else:
                    emit(s)
                    v = inflight[s] + 1
                    inflight[s] = v
                    if v > peak[s]:
                        peak[s] = v
                for q in send_to:  # SEND_F / SEND_B (stage s, peer q)
                    key = (s * n + q) * 2 + grad
                    base = chan.get(key)
                    if base is None:
                        base = channel(key)
                    row = rows.get(key)
                    if row is None:
                        row = send_row(rows, key, r, grad, s, q, s2r[q])
                    emit(~len(orow))
                    orow.append(row)
                    oarg.append(base + i)
            elif op is W:
                emit(n2 + s)
            else:
                return None
            if op is release:
                inflight[s] -= 1
                last_idx[s] = len(code)  # after the action's trailing sends
        for s, pos in sorted(last_idx.items(), key=lambda kv: -kv[1]):
            code.insert(pos, ~len(orow))
            orow.append(_ALLREDUCE)
            oarg.append(s)
        code.append(~len(orow))
        orow.append(_STEP)
        oarg.append(0)
        codes.append(code)
        other_rows.append(orow)
        other_args.append(oarg)
    return build.program(p, split, codes, other_rows, other_args, peak)


class LoweredSchedule:
    """A compute-only schedule and its stage edges, lowered for :func:`simulate` only:
    ``simulate(LoweredSchedule(s, edges, grad_edges), ...)`` gives exactly what
    ``simulate(add_communication(s, edges, grad_edges), ...)`` gives, without building the
    communication actions (hundreds of thousands for a planner-sized layout; the planner
    simulates a layout for many cuts). The full schedule (:meth:`full`) is built only where it
    is needed: ``check=True``, ``timeline=True``, a deadlock's message, or a schedule the
    compiled loop does not take. ``schedule`` must not change afterwards.

    Raises:
        ScheduleError: as :func:`~fxpipe.schedule.lowering.add_communication` would.
    """

    def __init__(self, schedule: Schedule, edges: Iterable[Edge],
                 grad_edges: Iterable[Edge] | None = None):
        self.schedule = schedule
        self.edges = set(edges)
        self.grad_edges = None if grad_edges is None else set(grad_edges)
        self.program = _lowered_program(
            schedule, communication_peers(schedule, self.edges, self.grad_edges))
        self._full: Schedule | None = None

    def full(self) -> Schedule:
        """``add_communication(schedule, edges, grad_edges)`` (built once)."""
        if self._full is None:
            self._full = add_communication(self.schedule, self.edges, self.grad_edges)
        return self._full


def _run_program(prog: _Program, bound, actions, ar_secs: list, step_s: float,
                 push_pull: list[float]):
    """Run the compiled programs (``actions``: the schedule's lists, for the timeline labels;
    None: no timeline; ``ar_secs``: each stage's ALLREDUCE seconds). Returns ``(t, busy, ar_free, ptr, peak, events)`` per rank / stage."""
    p = prog.num_ranks
    n3 = 3 * prog.num_stages
    dur, sends = bound
    timeline = actions is not None
    t = [0.0] * p
    busy = [0.0] * p
    ptr = [0] * p
    ar_free = [0.0] * p
    arrival: list = [None] * prog.num_slots
    link_free = [0.0] * len(prog.links)
    events: list[TimelineEvent] = []
    ev = events.append
    TE = TimelineEvent
    labels = [[action_label(a) for a in acts] for acts in actions] if timeline else None
    lab: list[str] = []
    codes, other_rows, other_args = prog.code, prog.other_row, prog.other_arg
    progress = True
    while progress:
        progress = False
        for r in range(p):
            code = codes[r]
            k = ptr[r]
            end_k = len(code)
            if k >= end_k:
                continue
            k0 = k
            orow = other_rows[r]
            oarg = other_args[r]
            if timeline:
                lab = labels[r]
            tr = t[r]
            br = busy[r]
            while k < end_k:
                x = code[k]
                if x >= 0:
                    if x < n3:  # F / B / W
                        d = dur[x]
                        if timeline:
                            ev(TE(r, lab[k], tr, tr + d))
                        tr += d
                        br += d
                    else:  # RECV
                        arr = arrival[x - n3]
                        if arr is None:
                            break  # blocked: the sender has not issued it yet
                        end = arr if arr > tr else tr  # max(t, arrival)
                        if timeline:
                            ev(TE(r, lab[k], tr, end))
                        tr = end
                else:
                    j = ~x
                    row = orow[j]
                    if row >= 0:  # SEND
                        c, li, occ, lat = sends[row]
                        if c > 0:  # the sender's thread stages the bytes; not compute busy
                            if timeline:
                                ev(TE(r, lab[k], tr, tr + c))
                            tr += c
                        free = link_free[li]
                        start = free if free > tr else tr
                        link_free[li] = start + occ
                        arrival[oarg[j]] = start + occ + lat
                        if timeline:
                            ev(TE(r, lab[k], start, start + occ + lat, "comm"))
                    elif row == _ALLREDUCE:
                        d = ar_secs[oarg[j]]
                        free = ar_free[r]
                        start = free if free > tr else tr
                        ar_free[r] = start + d
                        if timeline:
                            ev(TE(r, lab[k], start, start + d, "comm"))
                    else:  # STEP
                        free = ar_free[r]
                        start = free if free > tr else tr
                        if timeline:
                            ev(TE(r, lab[k], tr, start + step_s + push_pull[r]))
                        tr = start + step_s + push_pull[r]
                k += 1
            t[r] = tr
            busy[r] = br
            if k != k0:
                ptr[r] = k
                progress = True
    return t, busy, ar_free, ptr, list(prog.peak), events


def _run_reference(schedule: Schedule, costs: StageCosts, edge_bytes, grad_edge_bytes,
                   links: Links, ar_secs: list,
                   send_cost: Sequence[float], grad_send_cost: Sequence[float],
                   push_pull: list[float], timeline: bool):
    """The per-action loop (the definition of the semantics, see the module docstring).
    Returns ``(t, busy, ar_free, ptr, peak, events)`` as :func:`_run_program`."""
    n, p = schedule.num_stages, schedule.num_ranks
    s2r = schedule.stage_to_rank
    split = schedule.split_backward

    def dur(a: Action) -> float:
        s = a.stage
        if a.op is Op.F:
            return costs.fwd_s[s]
        if a.op is Op.B:
            return costs.bwd_input_s[s] + (0.0 if split else costs.bwd_weight_s[s])
        return costs.bwd_weight_s[s]

    t = [0.0] * p
    busy = [0.0] * p
    ptr = [0] * p
    ar_free = [0.0] * p
    arrival: dict[tuple, float] = {}
    link_free: dict[tuple[int, int], float] = {}
    inflight = [0] * n
    peak = [0] * n
    events: list[TimelineEvent] = []
    release = Op.W if split else Op.B
    progress = True
    while progress:
        progress = False
        for r, acts in enumerate(schedule.actions):
            while ptr[r] < len(acts):
                a = acts[ptr[r]]
                if a.op in (Op.F, Op.B, Op.W):
                    d = dur(a)
                    if timeline:
                        events.append(TimelineEvent(r, action_label(a), t[r], t[r] + d))
                    t[r] += d
                    busy[r] += d
                    if a.op is Op.F:
                        inflight[a.stage] += 1
                        peak[a.stage] = max(peak[a.stage], inflight[a.stage])
                    if a.op is release:
                        inflight[a.stage] -= 1
                elif a.op in (Op.SEND_F, Op.SEND_B):
                    edge = (a.stage, a.peer) if a.op is Op.SEND_F else (a.peer, a.stage)
                    nbytes = (edge_bytes if a.op is Op.SEND_F else grad_edge_bytes).get(edge, 0)
                    dst = s2r[a.peer]
                    c = (send_cost if a.op is Op.SEND_F else grad_send_cost)[a.stage]
                    if c > 0:  # the sender's thread stages the bytes; not compute busy
                        if timeline:
                            events.append(TimelineEvent(r, action_label(a), t[r], t[r] + c))
                        t[r] += c
                    occ, lat = links.p2p_seconds(r, dst, nbytes)
                    start = max(t[r], link_free.get((r, dst), 0.0))
                    link_free[(r, dst)] = start + occ
                    arrival[(a.op, a.stage, a.microbatch, a.peer)] = start + occ + lat
                    if timeline:
                        events.append(TimelineEvent(r, action_label(a), start,
                                                    start + occ + lat, "comm"))
                elif a.op in (Op.RECV_F, Op.RECV_B):
                    send_op = Op.SEND_F if a.op is Op.RECV_F else Op.SEND_B
                    key = (send_op, a.peer, a.microbatch, a.stage)
                    if key not in arrival:
                        break  # blocked: the sender has not issued it yet
                    end = max(t[r], arrival[key])
                    if timeline:
                        events.append(TimelineEvent(r, action_label(a), t[r], end))
                    t[r] = end
                elif a.op is Op.ALLREDUCE:
                    d = ar_secs[a.stage]
                    start = max(t[r], ar_free[r])
                    ar_free[r] = start + d
                    if timeline:
                        events.append(TimelineEvent(r, action_label(a), start, start + d,
                                                    "comm"))
                elif a.op is Op.STEP:
                    start = max(t[r], ar_free[r])
                    if timeline:
                        events.append(TimelineEvent(r, action_label(a), t[r],
                                                    start + costs.step_s + push_pull[r]))
                    t[r] = start + costs.step_s + push_pull[r]
                ptr[r] += 1
                progress = True
    return t, busy, ar_free, ptr, peak, events
