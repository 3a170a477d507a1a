"""Per-block parameter gathering (``parallel.param_gather: block``, ``StagePlan.param_gather``):
under ``data_sharding: full`` a stage's sharded parameters come back one group at a time, just
before they are used, and go again right after, in every forward and backward (ZeRO-3 / FSDP).

**Groups.** A stage's sharded parameters (trained, not tied across stages) grouped by
:func:`fxpipe.plans.param_blocks.group_of` (a block of the model, ``h.3``; else the parameter's
module, ``lm_head``), in the order the stage graph first uses them. Each group is a
:class:`GroupBucket`: its own flat buffer ``U`` of the group's elements padded to a multiple of
the replicas ``n`` (one all-gather and one reduce-scatter per group), its parameters' ``.data``
views of ``U`` set once; ``U``'s storage is freed (``resize_(0)``) and allocated again, so the
tensors autograd saved (views of the parameters) see the values again when the backward needs
them. Replica ``d`` owns the ``d``-th of ``n`` slices of every group: its master slice, float32
gradient slice and optimizer state are ``ceil(numel_g / n)`` elements per group.

**When (per micro-batch, on every replica in the same order).**

* Forward (and the forward replay of a recomputing stage): the stage graph is rewritten
  (:func:`rewrite`): before the first node reading a group (through a view too), *need* it
  (all-gather, or wait for its prefetch) and start the **next** group's all-gather
  (asynchronous prefetch); after the last node reading it, free ``U``. A group read by a stage
  output is freed after the backward.
* Backward (a whole backward, B of a split one, W; and after a recomputation): the tensors
  autograd saves that live in a gathered ``U`` (the parameters and their views) are packed by
  ``saved_tensors_hooks`` (composed with activation offload's, :meth:`BlockGather.hooks`);
  unpacking one *needs* its group: every other gathered group is freed, the group is gathered
  (or its prefetch waited), and the **neighbouring** group in the direction the backward goes
  (the previous one in forward order, among the groups this micro-batch saved) is prefetched.
  Groups whose backward reads no parameter (an embedding) are not gathered in the backward.
  At the end of each backward call every group is freed.
* Gradients: a whole backward reduce-scatters a group as soon as every parameter of it has
  its gradient (post-accumulate-grad hooks), the rest at the end of the backward, last group
  first; a split backward reduce-scatters at the end of W (B computes no weight gradient). The
  whole gradients are dropped once copied into the wire buffer; the reduce-scatter runs
  asynchronously, the previous one is waited before the next is launched and every one by the
  step's reduction; its output (``1/n`` of the sum over replicas) is added to a float32 slice
  of this step's gradients, handed to the optimizer at the step's end as the whole-stage
  reduction's is. A micro-batch of zero loss weight runs its backward on zero gradients (every
  replica issues the same collectives).
* Between steps no whole parameter is held: the executor frees every group at a step's start
  and the optimizer's update is gathered per group by the next forward. Evaluation and
  checkpoints (``ensure_gathered``) gather every group whole, as ``stage`` does.

**Per-rank peak** (bytes; ``P_g`` = ``padded_g x`` parameter bytes, ``S_g = P_g / n``):
``shards + gathered + reducing + whole gradients + activations``, with

* ``shards = sum_g S_g (master) + sum_g padded_g / n x 4 (float32 gradient slice) + k x
  sum_g S_g`` (optimizer state; ``k = 2`` AdamW) ``+ sum_g padded_g / n x 4`` (this step's
  slice, during the step);
* ``gathered = max over stages of max_g (P_g + P_next(g))``: a group and the one prefetched
  beside it (``next``: the following group in forward order; the backward's prefetches are
  adjacent too); a stage with one group holds ``P_0``. ``stage`` holds ``sum_g P_g`` (every
  local stage's parameters through the step);
* ``reducing = max over consecutive reduce-scatters (a, b) of the rank of W_a + O_a + W_b``
  (``W`` = ``padded x`` wire bytes, ``O = W / n``: the one in flight while the next is packed;
  one reduce-scatter is in flight at a time, rank-wide). A backward reduces its stage's groups
  last group first, so the pairs are ``(g, g - 1)`` within a stage and ``(first group of one
  stage, last group of the stage whose backward comes next)`` between backwards;
* whole gradients: one group's under a whole backward (freed as it is reduced), every group of
  the stage at the end of W under a split backward.

:attr:`BlockGather.held` counts what the sharding holds of the gathered and reducing terms
(:class:`Held`: now and peak, exact storage bytes). Communication per micro-batch and group:
one all-gather in the forward, one in the backward for a group whose parameters the backward
reads (a split backward: in B and again in W where W reads them), one reduce-scatter.
"""

from __future__ import annotations

import itertools
import operator
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn

from fxpipe.errors import RuntimeFailure
from fxpipe.execution.rebuild import rebuilt
from fxpipe.plans.param_blocks import group_of
from fxpipe.runtime.compression import ring_allgather_bytes
from fxpipe.runtime.sharded_bucket import _REDUCE_SCATTER, ShardedBucket, wait_collective

__all__ = ["BlockGather", "GroupBucket", "Held", "stage_groups", "predicted_gathered_peak",
           "predicted_reducing_peak"]

_ALL_GATHER = (getattr(dist, "all_gather_single", None)
               or getattr(dist, "all_gather_into_tensor", None))


class Held:
    """Bytes the per-block buffers hold now and at most (one per rank's sharding)."""

    def __init__(self) -> None:
        self.now = {"gathered": 0, "reducing": 0}
        self.peak = {"gathered": 0, "reducing": 0}
        #: the buckets with a reduce-scatter in flight (finished before the next one starts)
        self.reducing: list["GroupBucket"] = []

    def add(self, kind: str, nbytes: int) -> None:
        self.now[kind] += nbytes
        self.peak[kind] = max(self.peak[kind], self.now[kind])

    def reset_peak(self) -> None:
        self.peak = dict(self.now)


class GroupBucket(ShardedBucket):
    """One group's sharded parameters (level ``full``) with its flat unsharded buffer ``U``
    (:attr:`flat`), gathered and freed per use, its gradients reduce-scattered per micro-batch
    (the module doc)."""

    def __init__(self, name: str, params: Sequence[nn.Parameter], group, n: int, index: int,
                 wire: torch.dtype, held: Held):
        super().__init__(name, params, group, n, index, "full", wire)
        self.held, self.timeout_s = held, 300.0
        self.flat = torch.zeros(self.padded, dtype=self.dtype, device=self._device())
        self.nbytes = self.flat.numel() * self.flat.element_size()
        at = 0
        with torch.no_grad():
            for p in self.params:
                k = p.numel()
                self.flat[at:at + k].copy_(p.detach().reshape(-1))
                p.data = self.flat[at:at + k].view(p.shape)
                at += k
        self.held.add("gathered", self.nbytes)
        self._ag = None  # an all-gather in flight
        self._rs: list[tuple[Any, torch.Tensor, torch.Tensor]] = []  # (work, wire, out)
        self._acc: torch.Tensor | None = None  # this step's reduced slices, summed

    # ------------------------------------------------------------------ parameters
    @property
    def allocated(self) -> bool:
        return self.flat.untyped_storage().nbytes() > 0

    @property
    def gathered(self) -> bool:
        return self.allocated and self._ag is None

    def start_gather(self) -> None:
        """Allocate ``U`` and start the all-gather of the master slices into it."""
        if self.allocated or not self.params:
            return
        self.flat.untyped_storage().resize_(self.nbytes)
        self.held.add("gathered", self.nbytes)
        if self.group is None:
            with torch.no_grad():
                self.flat.copy_(self._flat_master)
            return
        if _ALL_GATHER is not None:
            self._ag = _ALL_GATHER(self.flat, self._flat_master, group=self.group,
                                   async_op=True)
        else:  # pragma: no cover - older torch
            self._ag = dist.all_gather(list(self.flat.chunk(self.n)), self._flat_master,
                                       group=self.group, async_op=True)
        self.bytes_sent += ring_allgather_bytes(self.slice * self.flat.element_size(), self.n)

    def finish_gather(self, timeout_s: float | None = None) -> None:
        """Wait for the all-gather started by :meth:`start_gather`."""
        work, self._ag = self._ag, None
        if work is None:
            return
        wait_collective(work, "parameter all-gather", self.name, self.nbytes, self.peers,
                        self.timeout_s if timeout_s is None else timeout_s)

    def gather(self, timeout_s: float) -> None:
        self.start_gather()
        self.finish_gather(timeout_s)

    def free(self) -> None:
        """Free ``U`` (after the all-gather in flight into it, if any)."""
        if not self.allocated:
            return
        self.finish_gather()
        self.flat.untyped_storage().resize_(0)
        self.held.add("gathered", -self.nbytes)

    # ------------------------------------------------------------------ gradients
    def reduce_now(self) -> None:
        """Reduce-scatter the group's gradients of this micro-batch (asynchronously) and drop
        them; the previous reduce-scatter is finished first."""
        wire = torch.zeros(self.padded, dtype=self.wire, device=self._device())
        self.held.add("reducing", wire.numel() * wire.element_size())
        at = 0
        for p in self.params:
            if p.grad is not None:
                g = p.grad.reshape(-1)
                wire[at:at + g.numel()] = g if self.wire == torch.float32 else g / self.n
                p.grad = None
            at += self.numels[id(p)]
        for b in self.held.reducing:
            b._drain()
        self.held.reducing.clear()
        out = torch.empty(self.slice, dtype=self.wire, device=wire.device)
        self.held.add("reducing", out.numel() * out.element_size())
        work = None
        if self.group is None:
            out.copy_(wire)
        else:
            work = _REDUCE_SCATTER(out, wire, group=self.group, async_op=True)
            self.bytes_sent += round((self.n - 1) / self.n * self._wire_bytes)
        self._rs.append((work, wire, out))
        self.held.reducing.append(self)

    def _drain(self) -> None:
        """Finish the reduce-scatters in flight, adding their slices to this step's."""
        for work, wire, out in self._rs:
            if work is not None:
                wait_collective(work, "gradient reduce-scatter", self.name, self._wire_bytes,
                                self.peers, self.timeout_s, slow_hint=True)
            if self._acc is None:
                self._acc = torch.zeros(self.slice, dtype=torch.float32, device=out.device)
            self._acc.add_(out.float())
            self.held.add("reducing", -(wire.numel() * wire.element_size()
                                        + out.numel() * out.element_size()))
        self._rs.clear()

    def launch(self) -> None:
        """The stage's last backward ran: what is left of its gradients is reduced now (they
        were reduce-scattered per micro-batch)."""
        if self.launched:
            return
        self.launched = True
        if any(p.grad is not None for p in self.params):
            self.reduce_now()

    def wait(self, timeout_s: float) -> None:
        if not self.launched:
            raise RuntimeFailure(f"{self.name} reduce-scatter waited before it was launched (bug)")
        self.timeout_s = timeout_s
        self._drain()
        acc, self._acc = self._acc, None
        self._pending = (acc.div_(self.n) if acc is not None and self.wire == torch.float32
                         else acc)
        for p in self.params:
            p.grad = None
        self.free()

    def held_bytes(self) -> dict[str, int]:
        out = super().held_bytes()
        out["params"] = self.flat.untyped_storage().nbytes()
        return out


# ---------------------------------------------------------------------- the stage graph
def _aliases(node: fx.Node) -> bool:
    """Whether ``node``'s output may share storage with its tensor inputs (a view op, a
    getitem, or a callable fxpipe cannot inspect)."""
    if node.op == "call_function":
        if node.target is operator.getitem:
            return True
        schema = getattr(node.target, "_schema", None)
        if schema is None:
            return not getattr(node.target, "__module__", "").startswith("torch._ops")
        return any(r.alias_info is not None for r in schema.returns)
    return node.op == "call_method"


def stage_groups(gm: fx.GraphModule, params: Sequence[nn.Parameter]
                 ) -> tuple[list[tuple[str, list[nn.Parameter]]], dict[str, tuple[int, int]]]:
    """``params`` (of ``gm``) by gathering group, groups in the order the graph first reads
    them (groups the graph never reads last), and per group the indices of the first and the
    last node reading it (through views; ``-1`` as last: a stage output reads it, held until the
    backward ends)."""
    want = {id(p) for p in params}
    name_of: dict[int, str] = {}
    for n, p in gm.named_parameters(remove_duplicate=False):
        if id(p) in want:
            name_of.setdefault(id(p), n)
    group: dict[int, str] = {pid: group_of(n) for pid, n in name_of.items()}
    reach: dict[fx.Node, set[str]] = {}
    span: dict[str, list[int]] = {}
    for i, node in enumerate(gm.graph.nodes):
        if node.op == "get_attr":
            try:
                t = gm.get_parameter(node.target)
            except AttributeError:
                t = None
            if t is not None and id(t) in group:
                reach[node] = {group[id(t)]}
            continue
        read: set[str] = set()
        for a in node.all_input_nodes:
            read |= reach.get(a, set())
        if node.op == "call_module":
            prefix = f"{node.target}."
            read |= {group[pid] for pid, n in name_of.items() if n.startswith(prefix)}
        for g in read:
            first_last = span.setdefault(g, [i, i])
            first_last[1] = -1 if node.op == "output" or first_last[1] == -1 else i
        if read and _aliases(node):
            reach[node] = read
    order = sorted(span, key=lambda g: span[g][0])
    order += sorted({g for g in group.values()} - set(order))
    groups = [(g, [p for p in params if group.get(id(p)) == g]) for g in order]
    return groups, {g: (span[g][0], span[g][1]) for g in span}


_LIVE: "weakref.WeakValueDictionary[int, BlockGather]" = weakref.WeakValueDictionary()
_KEYS = itertools.count()


def _fx_need(key: int, g: int) -> None:
    """Graph node: group ``g`` of gatherer ``key`` is read next (forward)."""
    _LIVE[key].need_forward(g)


def _fx_free(key: int, g: int) -> None:
    """Graph node: group ``g`` of gatherer ``key`` was read for the last time (forward)."""
    _LIVE[key].release(g)


def rewrite(gm: fx.GraphModule, key: int, order: list[str],
            spans: dict[str, tuple[int, int]]) -> fx.GraphModule:
    """A copy of ``gm`` (sharing its parameters) with a *need* node before each group's first
    reader and a *free* node after its last one."""
    graph = fx.Graph()
    graph._codegen = gm.graph._codegen
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    nodes = list(graph.nodes)
    for gi, g in enumerate(order):
        if g not in spans:
            continue
        first, last = spans[g]
        with graph.inserting_before(nodes[first]):
            graph.call_function(_fx_need, (key, gi))
        if last >= 0:
            with graph.inserting_after(nodes[last]):
                graph.call_function(_fx_free, (key, gi))
    copy = rebuilt(gm, graph, class_name=type(gm).__name__)
    copy.meta = dict(getattr(gm, "meta", {}))
    return copy


class BlockGather:
    """Per-block gathering of one stage: the rewritten stage module (:attr:`module`) and the
    hooks that gather, free and reduce its groups (the module doc).

    Args:
        module: the stage's GraphModule.
        params: its sharded parameters (trained, not tied to another stage).
        stage: the stage index (messages).
    """

    def __init__(self, module: nn.Module, params: Sequence[nn.Parameter], stage: int):
        if not isinstance(module, fx.GraphModule):
            raise RuntimeFailure(f"stage {stage}: per-block parameter gathering rewrites the "
                                 f"stage graph, but its module is a {type(module).__name__}")
        self.stage = stage
        self.groups, spans = stage_groups(module, params)
        self.key = next(_KEYS)
        _LIVE[self.key] = self
        self.module = rewrite(module, self.key, [g for g, _ in self.groups], spans)
        #: the groups the forward reads (the others are never gathered by it)
        self._read = {gi for gi, (g, _) in enumerate(self.groups) if g in spans}
        self.buckets: list[GroupBucket] = []
        self._slot = {id(p): gi for gi, (_, ps) in enumerate(self.groups) for p in ps}
        self._got = [0] * len(self.groups)
        self._reduced = [False] * len(self.groups)
        self._last: int | None = None  # the group the backward read last
        self._collect = False  # a whole backward is running: reduce groups as they complete

    def attach(self, buckets: dict[int, GroupBucket], timeout_s: float) -> None:
        """Bind each group to its bucket (``buckets``: parameter id -> its bucket)."""
        self.buckets = [buckets[id(ps[0])] for _, ps in self.groups]
        for b in self.buckets:
            b.timeout_s = timeout_s
        for _, ps in self.groups:
            for p in ps:
                p.register_post_accumulate_grad_hook(self._grad_done)

    # ------------------------------------------------------------------ forward
    def need_forward(self, g: int) -> None:
        self.buckets[g].gather(self.buckets[g].timeout_s)
        if g + 1 in self._read:
            self.buckets[g + 1].start_gather()

    def release(self, g: int) -> None:
        self.buckets[g].free()

    def free_all(self) -> None:
        for b in self.buckets:
            b.free()

    # ------------------------------------------------------------------ backward
    def hooks(self, inner: tuple[Callable, Callable] | None = None
              ) -> tuple[Callable, Callable]:
        """``(pack, unpack)`` for ``saved_tensors_hooks`` over one forward: a tensor that lives
        in a gathered group is kept as it is and its group gathered again when the backward
        unpacks it; everything else goes to ``inner`` (activation offload's hooks), if any."""
        saved: set[int] = set()
        inner_pack, inner_unpack = inner if inner is not None else (None, None)

        def pack(t: torch.Tensor) -> Any:
            try:
                ptr = t.untyped_storage().data_ptr()
            except (RuntimeError, NotImplementedError, TypeError):
                ptr = 0  # a tensor without plain storage of its own
            if ptr:
                for gi, b in enumerate(self.buckets):
                    if b.allocated and b.flat.untyped_storage().data_ptr() == ptr:
                        saved.add(gi)
                        return _Saved(gi, t, saved)
            return inner_pack(t) if inner_pack is not None else t

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, _Saved):
                self.need_backward(packed.group, packed.saved)
                return packed.tensor
            return inner_unpack(packed) if inner_unpack is not None else packed

        return pack, unpack

    @contextmanager
    def saving(self, inner: tuple[Callable, Callable] | None = None) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(*self.hooks(inner)):
            yield

    def need_backward(self, g: int, saved: set[int]) -> None:
        """The backward reads group ``g``: only it (and the prefetched neighbour) stays."""
        b = self.buckets[g]
        if g == self._last and b.gathered:
            return
        down = self._last is None or g <= self._last
        for i, other in enumerate(self.buckets):
            if i != g:
                other.free()
        b.gather(b.timeout_s)
        self._last = g
        steps = range(g - 1, -1, -1) if down else range(g + 1, len(self.buckets))
        nxt = next((i for i in steps if i in saved), None)
        if nxt is not None:
            self.buckets[nxt].start_gather()

    @contextmanager
    def backward(self, weights: bool) -> Iterator[None]:
        """One backward call (``weights``: it computes the weight gradients, a whole backward
        or W): groups are reduce-scattered as they complete (a whole backward) or at its end
        (W), then every group is freed."""
        self._got = [0] * len(self.groups)
        self._reduced = [False] * len(self.groups)
        self._collect = weights
        try:
            yield
            if weights:
                for gi in reversed(range(len(self.buckets))):
                    if not self._reduced[gi]:
                        self._reduce(gi)
        finally:
            self._collect = False
            self._last = None
            self.free_all()

    def _grad_done(self, p: torch.Tensor) -> None:
        gi = self._slot.get(id(p))
        if not self._collect or gi is None or self._reduced[gi]:
            return
        self._got[gi] += 1
        if self._got[gi] == len(self.groups[gi][1]):
            self._reduce(gi)

    def _reduce(self, gi: int) -> None:
        self._reduced[gi] = True
        self.buckets[gi].reduce_now()


class _Saved:
    """A saved tensor living in group ``group``'s buffer (and the groups its forward saved)."""

    __slots__ = ("group", "tensor", "saved")

    def __init__(self, group: int, tensor: torch.Tensor, saved: set[int]):
        self.group, self.tensor, self.saved = group, tensor, saved


def predicted_reducing_peak(stage_group_wire: Sequence[Sequence[int]], n: int) -> int:
    """The ``reducing`` term of the module doc's peak: per local stage the wire bytes of its
    groups' padded buffers in forward order; every pair a backward's order can make
    (``(g, g - 1)`` within a stage, a stage's first group then any local stage's last)."""
    def pair(a: int, b: int) -> int:
        return a + a // n + b

    best = 0
    for gs in stage_group_wire:
        for a, b in zip(gs[1:], gs):  # g, then g - 1
            best = max(best, pair(a, b))
        for other in stage_group_wire:
            if gs and other:
                best = max(best, pair(gs[0], other[-1]))
        if len(gs) == 1:
            best = max(best, gs[0] + gs[0] // n)
    return best


def predicted_gathered_peak(stage_group_bytes: Sequence[Sequence[int]], block: bool) -> int:
    """The ``gathered`` term of the module doc's peak: per local stage the bytes of its groups'
    padded buffers in forward order; ``block``: the largest adjacent pair of one stage (one
    group alone where a stage has one), else (``stage``) every group of every local stage."""
    if not block:
        return sum(sum(gs) for gs in stage_group_bytes)
    best = 0
    for gs in stage_group_bytes:
        pairs = [a + b for a, b in zip(gs, gs[1:])] or list(gs)
        best = max([best, *pairs])
    return best
