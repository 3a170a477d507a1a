"""Planning units priced at a tensor-parallel degree.

At degree ``t`` every node runs as :mod:`fxpipe.tensor.analysis` decides on the parameter
placements :func:`fxpipe.tensor.choose.choose` picks: a node whose data is sharded does ``1/t``
of its FLOPs, moves ``1/t`` of its bytes and saves ``1/t`` of its activations (sequence
parallelism shards the norms' and residuals' activations too); a sharded parameter costs ``1/t``
of its bytes (and so do its gradient, optimizer state and data-parallel all-reduce); each
collective of the tensor group is added to the node that runs it, on the intra-node link (the
tensor group stays inside a node): a ring all-reduce of ``N`` bytes over ``t`` ranks costs
``2 (t-1)/t N / B + 2 (t-1)`` latencies, an all-gather or reduce-scatter half of that; forward
collectives to the node's forward, backward ones to its input-gradient pass. A node that runs
replicated costs what it costs at degree 1 on every rank.

With ``parallel.tp_overlap: k`` the collectives of :func:`fxpipe.tensor.overlap.find_sites`'s
sites run in ``k`` chunks beside their matmuls' compute: :func:`with_comm` charges the exposed
part (:func:`fxpipe.tensor.overlap.exposed_seconds`: the matmuls' own forward or
input-gradient seconds against one chunk's collective, priced as its own message) plus what
chunking adds (launches per chunk, the copies), on the node that carries the collective;
``tp_overlap: auto`` takes the chunk count of 1, 2, 4, 8 that costs least (:func:`best_overlap`).

The values between stages stay whole (every rank of a tensor group sends its copy to the same
tensor rank of the next stage), so cut values keep their bytes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.fx as fx

from fxpipe.execution.fp8 import fp8_weight
from fxpipe.partitioner.cost import NodeCost
from fxpipe.partitioner.timing import NodeTimes
from fxpipe.tensor.analysis import (VOCAB_PARALLEL_LOSSES, Comm, Sharding, analyse, grad_values,
                                   vocab_loss_comms)
from fxpipe.tensor.choose import TensorChoice, choose
from fxpipe.tensor.overlap import Site, exposed_seconds, find_sites

aten = torch.ops.aten

@dataclass
class TensorPricing:
    """A traced graph's sharding at degree ``t`` and what it costs per node.

    Attributes:
        t / sequence_parallel: the degree and the option.
        choice: the parameter placements (get_attr target -> placement) and the layers left
            whole, with why.
        sharding: every node's decision (:class:`~fxpipe.tensor.analysis.Sharding`).
        fraction: node -> the share of its work, bytes and saved activations one rank has.
        param_fraction: node -> the share of the parameter bytes charged to it one rank holds.
        comm_s: node -> (forward, backward) seconds of its tensor-group collectives.
        comm_bytes: node -> (forward, backward) bytes its collectives move (whole tensors).
        link: what prices one collective on the tensor group: :func:`ring_seconds`'s
            ``(bandwidth_Bps, latency_s, half_bytes, allreduce_Bps, byte_scale)``.
        overlap: chunks of the overlapped collectives (``parallel.tp_overlap``; 1: none).
        sites: the overlapped sites by starting node (:func:`fxpipe.tensor.overlap.find_sites`).
        weight_split: weight-matmul node -> the dimension of its weight split ``t`` ways (the
            FP8 pricing's shard shape).
        hidden_s: per carrying node, the (forward, backward) seconds its site saves (negative:
            chunking costs more than it hides), as the last :func:`with_comm` found them.
        asked: ``parallel.tp_overlap`` as the spec gave it (``auto``: :attr:`overlap` is the
            planner's choice).
        chunk_op_s: seconds one more op costs (a launch: ``cluster.op_overhead_us``, and on
            a GPU a matmul's fixed ramp) and memory_Bps the copies' bandwidth.
    """

    t: int
    sequence_parallel: bool
    choice: TensorChoice
    sharding: Sharding
    fraction: dict[str, float]
    param_fraction: dict[str, float]
    comm_s: dict[str, tuple[float, float]]
    comm_bytes: dict[str, tuple[float, float]]
    link: tuple = (1.0, 0.0, 0.0, None, 1.0)
    overlap: int = 1
    sites: dict[str, Site] = dataclasses.field(default_factory=dict)
    hidden_s: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    weight_split: dict[str, int] = dataclasses.field(default_factory=dict)
    chunk_op_s: float = 0.0
    memory_Bps: float = float("inf")
    asked: int | str = 1

    def seconds(self, comms) -> tuple[float, float]:
        """Forward and backward seconds of ``comms`` (:class:`~fxpipe.tensor.analysis.Comm`)
        on the tensor group."""
        fs = bs = 0.0
        for c in comms:
            sec = ring_seconds(c, self.t, *self.link)
            if c.phase == "fwd":
                fs += sec
            else:
                bs += sec
        return fs, bs

    def placements_text(self) -> dict[str, str]:
        """get_attr target -> placement text (the Plan's ``tensor_params``)."""
        return {k: v.to_json() for k, v in sorted(self.choice.params.items())}

    def replicated(self) -> list[list[str]]:
        """``[name, why]`` of the layers and sharded-input ops that run whole."""
        out = [[w, why] for w, why in self.choice.replicated]
        out += [[n, f"{op}: {why}"] for n, op, why in self.sharding.replicated]
        return out


def ring_seconds(c: Comm, t: int, bandwidth_Bps: float, latency_s: float,
                 half_bytes: float = 0.0, allreduce_Bps: float | None = None,
                 byte_scale: float = 1.0) -> float:
    """Seconds of one ring collective over ``t`` ranks (see the module doc). On a GPU
    (:func:`fxpipe.partitioner.gpu_model.collective_seconds`) the bus bandwidth also saturates
    with the message size (``half_bytes``: the size that reaches half of it) and an all-reduce
    may run faster than a reduce-scatter plus an all-gather (``allreduce_Bps``: NVLink SHARP);
    ``byte_scale``: bytes on the wire per traced byte (0.5 for 16-bit activations of a model
    traced in fp32)."""
    if t <= 1 or c.nbytes <= 0:
        return 0.0
    hops = 2 * (t - 1) if c.kind == "all_reduce" else t - 1
    bw = allreduce_Bps if (c.kind == "all_reduce" and allreduce_Bps) else bandwidth_Bps
    return hops / t * (c.nbytes * byte_scale + half_bytes) / bw + hops * latency_s


def _param_fractions(gm: fx.GraphModule, choice: TensorChoice, t: int) -> dict[str, float]:
    """Per compute node, the share of the parameter bytes charged to it (each parameter to its
    first reader, as :func:`fxpipe.partitioner.cost.price` charges them) one rank holds."""
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    whole: dict[str, float] = {}
    mine: dict[str, float] = {}
    for n in gm.graph.nodes:
        if n.op != "get_attr" or not n.users:
            continue
        v = n.meta.get("val")
        if v is None or not hasattr(v, "numel"):
            continue
        first = min(n.users, key=lambda u: order[u.name]).name
        size = float(v.numel() * v.element_size())
        p = choice.params.get(n.target)
        whole[first] = whole.get(first, 0.0) + size
        mine[first] = mine.get(first, 0.0) + (size / t if p is not None and p.sharded else size)
    return {k: mine[k] / whole[k] for k in whole if whole[k] > 0}


def tensor_pricing(gm: fx.GraphModule, t: int, *, sequence_parallel: bool,
                   overlap: int = 1, chunk_op_s: float = 0.0,
                   memory_Bps: float = float("inf"), output_loss: str | None, trainable: set[str], intra_node_GBps: float,
                   latency_s: float, strict: bool = True, half_bytes: float = 0.0,
                   allreduce_GBps: float | None = None, byte_scale: float = 1.0
                   ) -> TensorPricing:
    """The sharding of ``gm`` at degree ``t`` and its costs (see the module doc).

    Args:
        gm: the traced graph.
        t: the degree.
        sequence_parallel: the spec's option.
        overlap: ``parallel.tp_overlap`` (chunks; 1: no overlap).
        chunk_op_s, memory_Bps: what a further chunk's op and its copies cost (the
            attributes of the same names).
        output_loss: the loss the executor computes on the model output (``train.loss``), or
            None when the model computes its own (its output is the loss).
        trainable: get_attr targets of the parameters that get gradients.
        intra_node_GBps, latency_s: the link the tensor group's collectives use.
        strict: the degree was asked for (a vocabulary that does not divide is an error).
        half_bytes, allreduce_GBps: the GPU model's message-size curve and all-reduce bus
            bandwidth, and its bytes on the wire per traced byte (:func:`ring_seconds`); the
            defaults price plain rings of the traced bytes.

    Raises:
        fxpipe.tensor.choose.DegreeError: heads or the vocabulary do not divide by ``t``.
    """
    out_node = next(iter(gm.graph.find_nodes(op="output")))
    outs = out_node.args[0] if isinstance(out_node.args[0], (tuple, list)) else (out_node.args[0],)
    logits = outs[0] if output_loss in VOCAB_PARALLEL_LOSSES else None

    def sharded_output(n: fx.Node) -> bool:
        return n is logits

    choice = choose(gm, t, sequence_parallel=sequence_parallel, sharded_output=sharded_output,
                    strict=strict)
    grads = grad_values(gm, trainable, set())
    sharding = analyse(gm, choice.params, t, sequence_parallel=sequence_parallel, grads=grads,
                       sharded_outputs=sharded_output)
    if logits is not None and sharding.placement(logits.name).sharded:  # the executor's loss
        v = logits.meta["val"]
        sharding.nodes[logits.name].comm += vocab_loss_comms(v.numel() // int(v.shape[-1]))
    link = (intra_node_GBps * 1e9, latency_s, half_bytes,
            allreduce_GBps * 1e9 if allreduce_GBps else None, byte_scale)
    fraction, comm_s, comm_bytes = {}, {}, {}
    for name, ns in sharding.nodes.items():
        fraction[name] = ns.compute
        fs = bs = fb = bb = 0.0
        for c in ns.comm:
            sec = ring_seconds(c, t, *link)
            if c.phase == "fwd":
                fs, fb = fs + sec, fb + c.nbytes
            else:
                bs, bb = bs + sec, bb + c.nbytes
        if fs or bs:
            comm_s[name], comm_bytes[name] = (fs, bs), (fb, bb)
    weight_split = {}
    for n in gm.graph.nodes:
        w = fp8_weight(gm, n)
        p = choice.params.get(n.args[2 if n.target is aten.addmm.default else 1].target) \
            if w is not None else None
        if p is not None and p.sharded:
            weight_split[n.name] = p.dim
    return TensorPricing(t, sequence_parallel, choice, sharding, fraction,
                         _param_fractions(gm, choice, t), comm_s, comm_bytes, link,
                         overlap, find_sites(gm, sharding, overlap), weight_split=weight_split,
                         chunk_op_s=chunk_op_s, memory_Bps=memory_Bps)


def scaled_costs(costs: dict[str, NodeCost], tp: TensorPricing) -> dict[str, NodeCost]:
    """Per-node costs of one rank at the degree (FLOPs, moved and saved bytes, parameters)."""
    out = {}
    for name, c in costs.items():
        f = tp.fraction.get(name, 1.0)
        pf = tp.param_fraction.get(name, 1.0)
        shape = c.fp8_shape
        if shape is not None and name in tp.weight_split:
            d = tp.weight_split[name]
            shape = tuple(s // tp.t if i == d else s for i, s in enumerate(shape))
        out[name] = dataclasses.replace(
            c, fwd_flops=c.fwd_flops * f, bwd_flops=c.bwd_flops * f,
            bwd_weight_flops=c.bwd_weight_flops * f, out_bytes=int(c.out_bytes * f),
            in_bytes=int(c.in_bytes * f), saved_bytes=int(c.saved_bytes * f),
            param_bytes=int(c.param_bytes * pf), attn_scores=int(c.attn_scores * f),
            fp8_shape=shape,
            ops=tuple((fl * f, b * f) for fl, b in c.ops))
    return out


def hidden_seconds(times: dict[str, NodeTimes], tp: TensorPricing
                   ) -> dict[str, tuple[float, float]]:
    """Per carrying node, the (forward, backward) seconds its overlapped site saves against
    running whole (``times``: the nodes' compute alone): the collective's seconds less the
    chunks' exposed communication and what chunking adds (module doc); negative where
    chunking costs more than it hides."""
    out: dict[str, tuple[float, float]] = {}
    k = tp.overlap
    for site in tp.sites.values():
        fc, bc = tp.seconds(site.comms)
        fk, bk = tp.seconds([dataclasses.replace(c, nbytes=c.nbytes // k) for c in site.comms])
        fm = sum(times[m].fwd_s for m in site.matmuls if m in times)
        bm = sum(times[m].bwd_input_s for m in site.matmuls if m in times)
        share = max((tp.fraction.get(m, 1.0) for m in site.matmuls), default=1.0)
        copies = site.copy_bytes * share * tp.link[4] * 2 / tp.memory_Bps  # read + write
        added = (k - 1) * site.extra_ops * tp.chunk_op_s + copies
        hf = fc - exposed_seconds(fc, fm, k, fk) - added if fc else 0.0
        hb = bc - exposed_seconds(bc, bm, k, bk) - added if bc else 0.0
        pf, pb = out.get(site.carrier, (0.0, 0.0))
        out[site.carrier] = (pf + hf, pb + hb)
    return out


def best_overlap(times: dict[str, NodeTimes], tp: TensorPricing, gm: fx.GraphModule,
                 choices: tuple[int, ...] = (1, 2, 4, 8)) -> TensorPricing:
    """``tp`` at the chunk count of ``choices`` whose sites save most in all (``times``: the
    nodes' compute alone); 1 (no overlap) unless one saves something."""
    best, gain = dataclasses.replace(tp, overlap=1, sites={}), 0.0
    for k in choices:
        if k <= 1:
            continue
        trial = dataclasses.replace(tp, overlap=k, sites=find_sites(gm, tp.sharding, k))
        total = sum(f + b for f, b in hidden_seconds(times, trial).values())
        if total > gain:
            best, gain = trial, total
    return best


def with_comm(times: dict[str, NodeTimes], tp: TensorPricing) -> dict[str, NodeTimes]:
    """``times`` plus every node's tensor-group collectives, less what overlapped sites hide
    (:func:`hidden_seconds`)."""
    out = dict(times)
    hidden = tp.hidden_s = hidden_seconds(times, tp)
    for name, (fs, bs) in tp.comm_s.items():
        t = out.get(name, NodeTimes())
        hf, hb = hidden.get(name, (0.0, 0.0))
        out[name] = NodeTimes(t.fwd_s + fs - hf, t.bwd_input_s + bs - hb, t.bwd_weight_s)
    return out


def expand_blocks(text: dict[str, str], prefix: str, start: int, count: int) -> dict[str, str]:
    """Placements of a model planned from two of its ``count`` repeated blocks (block
    ``start + 1`` the representative) for every block of the run."""
    rep = f"{prefix}{start + 1}."
    out = dict(text)
    for k, v in text.items():
        if k.startswith(rep):
            rest = k[len(rep):]
            for i in range(start + 1, start + count):
                out[f"{prefix}{i}.{rest}"] = v
    return out
