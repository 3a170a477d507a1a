"""Tensor-parallel communication overlapped with compute: where it applies and what it saves.

With ``parallel.tp_overlap: k`` (k > 1) the collective next to a tensor-parallel matmul is
decomposed into ``k`` chunks along a token dimension, each chunk's collective running
asynchronously while the matmul of another chunk computes (the "chunking in the rewritten
graph" form of async tensor parallelism; torch's micro-pipelined async TP does the same with
symmetric memory on NVLink). Two kinds of *site*:

* ``reduce``: a row-parallel matmul (``linear`` / ``addmm`` / ``mm`` whose output is a partial
  sum): chunk ``c``'s partial product is all-reduced (or reduce-scattered along the sequence)
  while chunk ``c + 1`` multiplies; under sequence parallelism the backward all-gathers of the
  gradient chunks run while earlier chunks' input gradients compute.
* ``input``: a replicated value read by column-parallel matmuls through Megatron's ``f``
  (identity forward, all-reduce of the input gradient backward) or an all-gather along the
  sequence (sequence parallelism; reduce-scatter backward): every chunk's all-gather is started
  at once and each matmul chunk waits only for its own; backward, chunk ``c``'s input-gradient
  collective runs while chunk ``c - 1``'s gradient computes. All the value's matmul readers
  (q, k, v; gate, up) share the chunks, so the collectives stay one per chunk.

A site needs a token dimension whose length (per rank, where sequence parallelism splits it)
divides by ``k``; other matmuls run as before. Exact: the chunks are the same rows of the same
matmuls, a chunk's all-reduce sums the same addends as the whole's, and the gathered /
scattered rows are put back in order (strided chunks where the collective's own dimension is
chunked: chunk ``c`` of a gathered sequence is the ``c``-th sub-chunk of every rank's slice).

Price (:func:`exposed_seconds`): ``k`` chunks of compute ``m = M/k`` and communication ``c``
each in a two-stage pipeline take ``m + (k-1) max(m, c) + c``; what exceeds ``M`` is the exposed
communication. ``c`` is one chunk's collective priced whole (its latency per hop and the link's
message-size curve: ``k`` small messages cost more than one big one), and chunking adds work of
its own (:attr:`Site.extra_ops` launches per chunk, the chunks' copies), so a site can cost more
overlapped than not: on a CPU's gloo, or with too many chunks. The planner
(:mod:`fxpipe.partitioner.tensor_costs`) charges the difference to the node that carries the
collective and, under ``tp_overlap: auto``, picks the chunk count that gains most (1: none); the
runtime (:mod:`fxpipe.tensor.rewrite`) runs the same sites, found here on the stage's graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from fxpipe.tensor.analysis import Comm, Sharding

aten = torch.ops.aten

#: matmul ops a site may chunk, with the index of their data (token) input
MATMULS = {aten.linear.default: 0, aten.mm.default: 0, aten.addmm.default: 1}


@dataclass(frozen=True)
class Site:
    """One overlapped collective.

    Attributes:
        kind: ``reduce`` (a row-parallel matmul's output) or ``input`` (a value read by
            column-parallel matmuls).
        value: the chunked tensor's node: the matmul (``reduce``) or the read value (``input``).
        matmuls: the matmul nodes computed chunk by chunk, in graph order.
        dim: the token dimension chunked (of the matmul's data input and output alike).
        collective: ``all_reduce``, ``reduce_scatter`` (``reduce`` sites), ``copy_to``,
            ``gather`` or ``gather_rs`` (``input`` sites: gather with a reduce-scatter backward).
        carrier: the node whose :attr:`~fxpipe.tensor.analysis.NodeShard.comm` lists the
            collective (the matmul, or the first reader of the value).
        comms: the site's collectives (forward and backward), whole-tensor bytes.
        copy_bytes: whole-tensor bytes the chunking copies (the matmul outputs put back
            together; an ``f`` input's chunks, and its gradient's, put back together).
    """

    kind: str
    value: str
    matmuls: tuple[str, ...]
    dim: int
    collective: str
    carrier: str
    comms: tuple[Comm, ...]
    copy_bytes: int = 0

    @property
    def extra_ops(self) -> int:
        """Ops each further chunk launches, each way: per matmul its own, the chunk's slice and
        its collective's start and wait."""
        return len(self.matmuls) + 3


def _data_input(n: fx.Node) -> fx.Node | None:
    i = MATMULS.get(n.target) if n.op == "call_function" else None
    if i is None or len(n.args) <= i or not isinstance(n.args[i], fx.Node):
        return None
    return n.args[i]


def _shape(n: fx.Node) -> list[int] | None:
    v = n.meta.get("val")
    return [int(s) for s in v.shape] if isinstance(v, torch.Tensor) else None


def _nbytes(n: fx.Node) -> int:
    v = n.meta.get("val")
    return int(v.numel()) * v.element_size() if isinstance(v, torch.Tensor) else 0


def _token_dim(shape: list[int], k: int) -> int | None:
    """The first dimension but the last (the contracted / feature one) of length divisible
    by ``k``, or None."""
    for d, size in enumerate(shape[:-1]):
        if size >= k and size % k == 0:
            return d
    return None


def find_sites(gm: fx.GraphModule, sharding: Sharding, k: int) -> dict[str, Site]:
    """Every site of ``gm`` (analysed as ``sharding``) at ``k`` chunks, by the name of the node
    that starts it: the matmul (``reduce``), the value's first matmul reader (``input``).
    Empty when ``k <= 1`` or ``t <= 1``."""
    if k <= 1 or sharding.t <= 1:
        return {}
    t = sharding.t
    out: dict[str, Site] = {}
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    for n in gm.graph.nodes:
        ns = sharding.nodes.get(n.name)
        x = _data_input(n)
        if ns is None or x is None or ns.impl != "row" or ns.reduce is None:
            continue
        shape = _shape(x)
        if shape is None:
            continue
        kind, rdim = ns.reduce
        if kind == "all_reduce":
            d = _token_dim(shape, k)
            comms = (Comm("all_reduce", _nbytes(n), "fwd"),)
        else:
            d = rdim
            if d >= len(shape) - 1 or shape[d] % (t * k):
                d = None
            comms = (Comm("reduce_scatter", _nbytes(n), "fwd"),
                     *[c for c in ns.comm if c.kind == "all_gather" and c.phase == "bwd"
                       and c.nbytes == _nbytes(n)][:1])
        if d is not None:
            out[n.name] = Site("reduce", n.name, (n.name,), d, kind, n.name, comms,
                               _nbytes(n))
    for x in gm.graph.nodes:
        readers = [u for u in x.users if u.op != "output"]
        edges = [sharding.nodes[u.name].edges.get(x.name) if u.name in sharding.nodes else None
                 for u in readers]
        e = edges[0] if edges else None
        if e is None or not all(f == e for f in edges):
            continue
        if e.convert == "none" and e.partial_grad:
            collective = "copy_to"
        elif e.convert == "gather" and e.src.blocks == 1:
            collective = "gather_rs" if e.partial_grad else "gather"
        else:
            continue
        if not all(_data_input(u) is x and sharding.nodes[u.name].impl == "same"
                   and not sharding.nodes[u.name].local for u in readers):
            continue
        first = min(readers, key=lambda u: order[u.name])
        # the readers are emitted together at the first: their other inputs must come before
        if any(order[a.name] >= order[first.name] for u in readers for a in u.all_input_nodes
               if a is not x):
            continue
        shape = _shape(x)
        if shape is None:
            continue
        if collective == "copy_to":
            d = _token_dim(shape, k)
            comms = (Comm("all_reduce", _nbytes(x), "bwd"),)
        else:
            d = e.src.dim
            if d >= len(shape) - 1 or shape[d] % (t * k):
                d = None
            comms = ((Comm("all_gather", _nbytes(x), "fwd"),)
                     + ((Comm("reduce_scatter", _nbytes(x), "bwd"),)
                        if collective == "gather_rs" else ()))
        if d is None:
            continue
        readers.sort(key=lambda u: order[u.name])
        copies = sum(_nbytes(u) for u in readers) + (2 * _nbytes(x) if collective == "copy_to"
                                                      else 0)
        out[first.name] = Site("input", x.name, tuple(u.name for u in readers), d, collective,
                               first.name, comms, copies)
    return out


def exposed_seconds(comm_s: float, compute_s: float, k: int,
                    chunk_comm_s: float | None = None) -> float:
    """The communication seconds left exposed when a collective of ``comm_s`` is split into
    ``k`` chunks of ``chunk_comm_s`` each (default ``comm_s / k``) that pipeline with
    ``compute_s`` of compute (see the module doc)."""
    if k <= 1 or comm_s <= 0:
        return comm_s
    m = compute_s / k
    c = comm_s / k if chunk_comm_s is None else chunk_comm_s
    return max(0.0, m + (k - 1) * max(m, c) + c - compute_s)


# ------------------------------------------------------------- chunk layout (runtime and tests)
def take(x: torch.Tensor, dim: int, blocks: int, k: int, c: int) -> torch.Tensor:
    """Chunk ``c`` of ``k`` of ``x`` along ``dim``: with ``blocks = 1`` the ``c``-th contiguous
    piece; with ``blocks = b`` the ``c``-th piece of each of the ``b`` equal blocks, in block
    order (rows a sequence-parallel collective of chunk ``c`` gathers or scatters)."""
    if blocks == 1:
        return x.narrow(dim, c * (x.shape[dim] // k), x.shape[dim] // k)
    shape = list(x.shape)
    piece = shape[dim] // (blocks * k)
    split = x.reshape(shape[:dim] + [blocks, k, piece] + shape[dim + 1:])
    picked = split.select(dim + 1, c)
    return picked.reshape(shape[:dim] + [blocks * piece] + shape[dim + 1:])


def assemble(parts: list[torch.Tensor], dim: int, blocks: int) -> torch.Tensor:
    """The inverse of :func:`take` over all ``k`` chunks."""
    if blocks == 1:
        return torch.cat(parts, dim=dim)
    shape = list(parts[0].shape)
    piece = shape[dim] // blocks
    split = [p.reshape(shape[:dim] + [blocks, piece] + shape[dim + 1:]) for p in parts]
    whole = torch.stack(split, dim=dim + 1)
    return whole.reshape(shape[:dim] + [blocks * len(parts) * piece] + shape[dim + 1:])
