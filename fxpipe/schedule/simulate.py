"""Discrete-event simulator: prices a schedule's per-rank action lists with a cost model.

It walks the very lists the executor runs (:mod:`fxpipe.schedule.actions`), so the predicted
timeline and the measured one have the same actions. Semantics:

* each rank runs its list in order; F/B/W take the stage's forward / input-gradient /
  weight-gradient seconds (when the backward is not split, B takes input + weight seconds);
* SEND occupies the sender's own thread for ``StageCosts.send_s[stage]`` seconds (host-side
  staging: gloo on CPU moves the bytes in the sending rank's thread; about 0 with NCCL, the
  default when ``send_s`` is None), then returns (non-blocking); the transfer starts after that,
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
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
from dataclasses import dataclass, field

from fxpipe.errors import ScheduleError
from fxpipe.plans.placement import (global_rank, node_of, replica_period,
                                    server_link_crosses_nodes)
from fxpipe.plans.plan import Plan, Predicted
from fxpipe.schedule.actions import Action, Op, Schedule
from fxpipe.schedule.lowering import linear_edges, schedule_for_plan
from fxpipe.schedule.timeline import TimelineEvent, action_label
from fxpipe.schedule.validate import validate
from fxpipe.specs.schema import (
    DEFAULT_INTER_NODE_GBPS,
    DEFAULT_INTRA_NODE_GBPS,
    DEFAULT_LATENCY_S,
    OPTIMIZER_STATE_FACTOR,
    LinksSpec,
)

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
            the stage (host-side staging: copying the bytes into gloo's buffers on CPU; about 0
            with NCCL, where the copy is on the device). None: 0 (sends free for the sender).
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
    """

    p2p_GBps: float = DEFAULT_INTRA_NODE_GBPS
    latency_s: float = 0.0
    dp_GBps: float | None = None
    pair_GBps: dict[tuple[int, int], float] = field(default_factory=dict)
    dp_rank_GBps: dict[int, float] = field(default_factory=dict)
    server_GBps: dict[tuple[int, int], float] = field(default_factory=dict)

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
        return 2 * (n - 1) / n * nbytes / (bw * 1e9) + 2 * (n - 1) * self.latency_s

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
    ) -> "Links":
        """Links for ``pipeline x dp`` ranks (and ``servers`` parameter servers after them) on
        ``nodes`` nodes of ``devices_per_node``, placed as :mod:`fxpipe.plans.placement` places
        them: a pipeline pair / data-parallel ring / rank-to-server link gets the inter-node
        bandwidth when any replica's pair / the ring / the rank crosses nodes."""
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
        srv = {(r, j): inter_node_GBps if server_link_crosses_nodes(
                   r, pipeline * dp + j, pipeline, dp, dpn, layout) else intra_node_GBps
               for r in range(pipeline) for j in range(servers)}
        return cls(intra_node_GBps, latency_s, intra_node_GBps, pairs, dpr, srv)


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
    schedule: Schedule,
    costs: StageCosts,
    edge_bytes: Mapping[Edge, float] | None = None,
    links: Links | None = None,
    dp: int = 1,
    allreduce_bytes: Sequence[float] | None = None,
    grad_edge_bytes: Mapping[Edge, float] | None = None,
    check: bool = True,
    timeline: bool = True,
    server_bytes: Sequence[Sequence[float]] | None = None,
) -> SimResult:
    """Price one training step of ``schedule`` (see the module docstring for the semantics).

    Args:
        schedule: a full schedule (with communication, e.g. from ``build_schedule``).
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

    Returns:
        :class:`SimResult`.

    Raises:
        ScheduleError: invalid schedule, mismatched cost lists, or a deadlock.
    """
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
    split = schedule.split_backward
    send_cost = list(costs.send_s) if costs.send_s is not None else [0.0] * n
    grad_send_cost = list(costs.grad_send_s) if costs.grad_send_s is not None else send_cost
    push_pull = [0.0] * p  # per rank: parameter-server round trips of its stages
    if server_bytes is not None:
        loads = [sum(row[j] for row in server_bytes) for j in range(len(server_bytes[0]))] \
            if server_bytes else []
        for s in range(n):
            push_pull[s2r[s]] += links.push_pull_seconds(s2r[s], server_bytes[s], loads, dp)

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
                    d = 0.0 if server_bytes is not None else links.allreduce_seconds(
                        ar_bytes[a.stage], dp, r)
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
    stuck = [r for r in range(p) if ptr[r] < len(schedule.actions[r])]
    if stuck:
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


# ----------------------------------------------------------------------------- from a Plan

def costs_from_plan(plan: Plan) -> StageCosts:
    """StageCosts from a Plan's stages.

    F/B/W seconds: ``fwd_time_s``, ``bwd_input_time_s``, ``bwd_weight_time_s``. When a stage has
    no split times (all 0) but ``compute_time_s > 0``, forward = 1/3 and backward = 2/3 of it
    (backward costs about twice the forward), the backward split by
    ``bwd_weight_flops / bwd_flops``. Activation bytes: ``activation_bytes``. Static bytes:
    ``param_bytes x 4`` for AdamW (weights, gradients, two moments), ``x 2`` for SGD
    (``plan.spec['train']['optimizer']``, default AdamW). Sender-side send seconds:
    ``send_time_s`` (``grad_send_time_s`` for gradient sends).
    """
    f, bi, bw, act, static = [], [], [], [], []
    opt = str((plan.spec or {}).get("train", {}).get("optimizer", "adamw")).lower()
    factor = OPTIMIZER_STATE_FACTOR.get(opt, OPTIMIZER_STATE_FACTOR["adamw"])
    for st in plan.stages:
        ff, b1, b2 = st.fwd_time_s, st.bwd_input_time_s, st.bwd_weight_time_s
        if ff + b1 + b2 == 0 and st.compute_time_s > 0:
            ff = st.compute_time_s / 3
            bwd = st.compute_time_s - ff
            wfrac = st.bwd_weight_flops / st.bwd_flops if st.bwd_flops else 0.5
            b2 = bwd * wfrac
            b1 = bwd - b2
        f.append(ff)
        bi.append(b1)
        bw.append(b2)
        act.append(int(st.activation_bytes))
        static.append(int(int(st.param_bytes) * factor))
    grad = [st.send_time_s if st.grad_send_time_s is None else st.grad_send_time_s
            for st in plan.stages]
    return StageCosts(f, bi, bw, act, static, send_s=[st.send_time_s for st in plan.stages],
                      grad_send_s=grad)


def links_from_plan(plan: Plan) -> Links:
    """Links from ``plan.spec['cluster']`` (nodes, devices_per_node, links.intra_node_GBps,
    inter_node_GBps, latency_s); defaults of the spec schema when absent."""
    cl = (plan.spec or {}).get("cluster", {}) or {}
    lk = LinksSpec(**(cl.get("links", {}) or {}))
    return Links.from_cluster(
        plan.pipeline,
        plan.dp,
        nodes=int(cl.get("nodes", 1)),
        devices_per_node=cl.get("devices_per_node"),
        intra_node_GBps=lk.intra_node_GBps,
        inter_node_GBps=lk.inter_node_GBps,
        latency_s=lk.latency_s,
        layout=plan.placement,
        servers=len(plan.parameter_servers),
    )


def simulate_plan(
    plan: Plan,
    schedule: str | None = None,
    microbatches: int | None = None,
    links: Links | None = None,
) -> SimResult:
    """Simulate one step of ``plan`` (optionally with another schedule name / micro-batch count).

    Costs from :func:`costs_from_plan`, edges and bytes from the plan's values, links from
    :func:`links_from_plan` unless given, all-reduce bytes = each stage's ``param_bytes``
    over ``plan.dp`` replicas; with parameter servers, their push/pull of
    ``plan.server_stage_bytes`` instead.

    Raises:
        ScheduleError: the plan's parameters do not suit the schedule.
    """
    sched = schedule_for_plan(plan, schedule, microbatches)
    fwd, grad = plan.edge_bytes()
    return simulate(
        sched,
        costs_from_plan(plan),
        fwd,
        links or links_from_plan(plan),
        dp=plan.dp,
        allreduce_bytes=allreduce_priced_bytes(plan),
        grad_edge_bytes=grad,
        server_bytes=plan.server_stage_bytes if plan.parameter_servers else None,
    )


def allreduce_priced_bytes(plan: Plan) -> list[float]:
    """Per stage, the bytes :meth:`Links.allreduce_seconds` prices for its data-parallel
    all-reduce: ``param_bytes`` (fp32) under ``train.grad_compression: none``, else scaled by
    what the compression sends once compressing (after its warm-up) against the fp32 ring,
    by :func:`~fxpipe.runtime.compression.bucket_bytes_sent` (the bytes the reducers count):
    half for ``fp16`` / ``bf16``, ``rank x (rows + cols)`` per matrix parameter and vectors
    exact for ``powersgd`` (``plan.param_shapes``; without them, as ``none``), the all-gather
    of values and indices for ``topk`` (a top-k all-gather priced as the all-reduce that
    sends the same bytes)."""
    raw = [float(st.param_bytes) for st in plan.stages]
    t = (plan.spec or {}).get("train", {}) or {}
    method = t.get("grad_compression", "none") or "none"
    n = plan.dp
    if method == "none" or n <= 1 or plan.parameter_servers:
        return raw
    from fxpipe.runtime.compression import (Compression, bucket_bytes_sent,
                                            ring_allreduce_bytes)

    c = t.get("compression", {}) or {}
    comp = Compression(method, **{k: c[k] for k in ("rank", "ratio", "warmup_steps") if k in c})
    shapes = plan.param_shapes if method == "powersgd" else {}
    if method == "powersgd" and not shapes:
        return raw
    out = []
    for st, b in zip(plan.stages, raw):
        numel = int(b) // 4
        mine = [shapes[f] for f in st.params if f in shapes] if shapes else []
        if not mine or numel <= 0:
            mine = [(numel,)]
        total = sum(math.prod(s) for s in mine)
        exact = ring_allreduce_bytes(total * 4, n)
        out.append(b * bucket_bytes_sent(comp, mine, n) / exact if exact else b)
    return out


def predict(plan: Plan, schedule: str | None = None, microbatches: int | None = None,
            links: Links | None = None) -> Predicted:
    """:func:`simulate_plan` reduced to a :class:`~fxpipe.plans.plan.Predicted` (what
    ``plan.predicted`` holds)."""
    return simulate_plan(plan, schedule, microbatches, links).predicted()
