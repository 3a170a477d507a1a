"""Sharded data parallelism: a stage's replicas split its training state instead of each holding
it whole (ZeRO, Rajbhandari et al., SC'20; Megatron-LM's distributed optimizer).

Per stage, this rank's trained parameters that no other stage shares are laid end to end in a
flat buffer (the data-parallel bucket of :mod:`fxpipe.runtime.data_parallel`), padded to a
multiple of the replicas ``n``; replica ``d`` owns the ``d``-th of ``n`` equal slices. Instead
of the all-reduce:

* the bucket's gradients are **reduce-scattered** after the stage's last backward (the same
  moment the all-reduce started, overlapping the rank's other stages), each replica adding its
  slice of the average to a float32 gradient slice kept across ``step()`` calls (gradient
  accumulation);
* the optimizer (:class:`ShardedOptimizer`, wrapping any ``torch.optim`` optimizer built over
  ``pipe.parameters()``: its class, hyperparameters and parameter groups) steps this rank's
  **master slices** of the parameters, pieces of the slice cut at parameter boundaries, so its
  state (AdamW's moments) is ``1/n`` of the whole. The master is the float32 parameters
  themselves (``optimizer``, ``gradients``: views of their elements; mixed precision computes
  in 16 bits under autocast beside them) or, at ``full``, a separate slice;
* the updated slices are **all-gathered** back into the parameters.

Reduce-scatter plus all-gather move the bytes of one ring all-reduce (``fp16`` / ``bf16``
gradient compression halves the reduce-scatter's; the all-gather stays exact). The levels
differ in what a rank keeps between steps: ``optimizer``, the whole gradients (their buffers,
zeroed once reduced) and parameters; ``gradients``, no whole gradient (freed once reduced);
``full``, neither whole gradients nor whole parameters (the all-gather waits until the next
step starts, and the parameters are freed once its gradients are reduced). While a step's
micro-batches run, a stage holds its whole parameters and gradients at every level (a pipeline
runs the same stage on every micro-batch, forward then backward, before the reduction), so the
peak a plan must fit is, per byte of sharded parameter, ``2 + (1 + k) / n`` bytes
(``optimizer``, ``gradients``: weights, gradients, the gradient slice and ``k`` bytes of
optimizer state per parameter byte, ``k = 2`` for AdamW) and ``2 + (2 + k) / n`` (``full``: the
master slice too) instead of ``2 + k``
(:func:`~fxpipe.specs.schema.state_factor`; :func:`~fxpipe.plans.state_bytes.held_state_bytes`
counts them per rank). The reduce-scatter's flat buffer is transient.

At ``full`` a stage whose plan says ``param_gather: block`` instead gathers one group (a block of
the model) at a time, in every forward and backward, and reduce-scatters per micro-batch and
group: one bucket per group (:class:`~fxpipe.runtime.block_gather.GroupBucket`, its held bytes
and peak in :mod:`fxpipe.runtime.block_gather`).

Parameters shared between stages (a tied embedding and head) stay whole on every replica and are
all-reduced over their group as without sharding. torch's ``ZeroRedundancyOptimizer`` (whole
parameters per rank, all-reduce and broadcasts) and ``fully_shard`` (per-module hooks that
gather and reduce around each forward and backward) do not fit a pipeline stage that runs many
micro-batches, splits its backward into B and W and accumulates over several ``step()`` calls:
the reduction here runs once per step at the point the schedule marks.

Size: over 600 lines because the flat buffer, its collectives and the state dict views of the
shards are one object's methods."""

from __future__ import annotations

import inspect
from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from fxpipe.errors import RuntimeFailure, UsageError
from fxpipe.runtime.block_gather import GroupBucket, Held
from fxpipe.runtime.sharded_bucket import ShardedBucket

#: the levels that shard (``parallel.data_sharding``)
LEVELS = ("optimizer", "gradients", "full")
#: ``train.grad_compression`` -> dtype the reduce-scatter sends (those that fit a reduce-scatter)
WIRE_DTYPES = {"none": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

class DataSharding:
    """This rank's sharded buckets and what the executor (through the
    :class:`~fxpipe.runtime.grad_reducer.GradReducer` interface: ``stage_done``, ``finish``,
    ``pending``, ``commit``, ``take_bytes``, ``reset``, ``ensure_gathered``) and the optimizer
    ask of them.

    Args:
        level: ``optimizer``, ``gradients`` or ``full``.
        stage_params: local stage -> its trained parameters (the executor's).
        shared: ids of the parameters shared between stages (left whole).
        group, n, index: the data-parallel group, its size and this rank's place in it.
        groups: per-block gathering (``full``): parameter id -> (its group's place in its
            stage's forward order, the group's name); each group of one stage is a
            :class:`~fxpipe.runtime.block_gather.GroupBucket` of its own.
    """

    def __init__(self, level: str, stage_params: dict[int, list[nn.Parameter]],
                 shared: Iterable[int], group, n: int, index: int,
                 wire: torch.dtype = torch.float32,
                 groups: dict[int, tuple[int, str]] | None = None):
        if level not in LEVELS:
            raise RuntimeFailure(f"data sharding level {level!r}; use one of {LEVELS}")
        self.level, self.group, self.n, self.index = level, group, n, index
        skip = set(shared)
        users: dict[int, set[int]] = {}
        param: dict[int, nn.Parameter] = {}
        order: list[int] = []
        for s in sorted(stage_params):
            for p in stage_params[s]:
                if not p.requires_grad or id(p) in skip:
                    continue
                if id(p) not in param:
                    param[id(p)] = p
                    order.append(id(p))
                users.setdefault(id(p), set()).add(s)
        groups = groups if level == "full" else None
        by_users: dict[tuple, list[nn.Parameter]] = {}
        for pid in order:
            g = groups.get(pid) if groups is not None and len(users[pid]) == 1 else None
            by_users.setdefault((frozenset(users[pid]), param[pid].dtype, g),
                                []).append(param[pid])
        #: the per-block buffers' bytes now and at most (per-block gathering)
        self.block_held = None
        if groups:
            self.block_held = Held()

        def bucket(k: frozenset, g, ps: list[nn.Parameter]) -> ShardedBucket:
            if g is None:
                return ShardedBucket(f"stages {sorted(k)} data-parallel", ps, group, n, index,
                                     level, wire)
            return GroupBucket(f"stage {min(k)} block {g[1]!r} data-parallel", ps, group, n,
                               index, wire, self.block_held)

        #: (the stages whose last backward launches it, the bucket), launch order
        self.buckets: list[tuple[frozenset, ShardedBucket]] = [
            (k, bucket(k, g, ps))
            for (k, _, g), ps in sorted(by_users.items(), key=lambda kv: (
                sorted(kv[0][0]), str(kv[0][1]), kv[0][2] is not None,
                kv[0][2][0] if kv[0][2] is not None else 0))]
        self.params = [param[pid] for pid in order]
        #: every trained parameter of this rank's stages (sharded or not), for :meth:`measure`
        self.all_params = list({id(p): p for ps in stage_params.values() for p in ps
                                if p.requires_grad}.values())
        #: the :class:`ShardedOptimizer` stepping the slices (it registers itself)
        self.optimizer: torch.optim.Optimizer | None = None
        #: :meth:`measure` when the step's gradients were all computed, before their reduction
        #: (the most a step holds), for the last step
        self.at_reduce: dict[str, int] = {}
        self.cleared = 0
        self._done: set[int] = set()

    def owns(self, p: nn.Parameter) -> bool:
        return any(p is q for _, b in self.buckets for q in b.params)

    def stage_done(self, stage: int) -> None:
        self._done.add(stage)
        for users, b in self.buckets:
            if users <= self._done:
                b.launch()

    def finish(self, timeout_s: float) -> None:
        self.at_reduce = self.measure()
        for _, b in self.buckets:
            b.launch()
        for _, b in self.buckets:
            b.wait(timeout_s)

    def measure(self) -> dict[str, int]:
        """Bytes of training state this rank holds now (:func:`state_storage_bytes`)."""
        return state_storage_bytes(self.all_params, self.optimizer,
                                   grads=[b.grad for _, b in self.buckets],
                                   params=[b._flat_master for _, b in self.buckets
                                           if b._flat_master is not None])

    def commit(self, applied: bool = True) -> None:
        """Add the step's reduced slices to the accumulated gradient (see
        :meth:`ShardedBucket.commit`)."""
        for _, b in self.buckets:
            b.commit(applied)

    def pending(self) -> list[torch.Tensor]:
        """This step's reduced slices, before :meth:`commit` (the fp16 inf/NaN check)."""
        return [b._pending for _, b in self.buckets if b._pending is not None]

    def reset(self) -> None:
        self._done = set()
        for _, b in self.buckets:
            b.reset()

    def take_bytes(self) -> int:
        """Bytes sent since the last call (reduce-scatters and all-gathers)."""
        total = sum(b.bytes_sent for _, b in self.buckets)
        for _, b in self.buckets:
            b.bytes_sent = 0
        return total

    def gather(self, timeout_s: float) -> None:
        for _, b in self.buckets:
            b.gather(timeout_s)

    def ensure_gathered(self, timeout_s: float) -> None:
        """``full``: all-gather the parameters before a step or an evaluation needs them."""
        for _, b in self.buckets:
            if not b.gathered:
                b.gather(timeout_s)

    def start_step(self, timeout_s: float) -> None:
        """A training step starts under per-block gathering: every group is freed (its
        forward gathers it, with the optimizer's last update), the other buckets gathered."""
        for _, b in self.buckets:
            if getattr(b, "flat", None) is not None:
                b.free()
            elif not b.gathered:
                b.gather(timeout_s)
        if self.block_held is not None:
            self.block_held.reset_peak()

    def group_buckets(self) -> dict[int, ShardedBucket]:
        """Per-block gathering: parameter id -> its group's bucket."""
        return {id(p): b for _, b in self.buckets if getattr(b, "flat", None) is not None
                for p in b.params}

    def scaled_pending(self) -> list[torch.Tensor]:
        """This step's reduced slices of the buckets reduced per micro-batch (their gradients
        were reduce-scattered before the loss scale was taken out: unscale them)."""
        return [b._pending for _, b in self.buckets
                if getattr(b, "flat", None) is not None and b._pending is not None]

    def refresh_master(self) -> None:
        """Take the master slices from the whole parameters again (after they were set from
        outside: weights broadcast from replica 0, a checkpoint or a state dict loaded)."""
        for _, b in self.buckets:
            b.refresh_master()

    def grad_slices(self) -> list[torch.Tensor]:
        """This rank's gradient slices (padding included)."""
        return [b.grad for _, b in self.buckets]

    def segment_grads(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """``(parameter, this rank's piece of its averaged gradient)`` for every piece."""
        return [(p, b.grad[off:off + e - a]) for _, b in self.buckets
                for p, a, e, off in b.segments]

    def zero_grad(self) -> None:
        """Clear the accumulated slices (a new accumulation; :attr:`cleared` counts them)."""
        self.cleared += 1
        for _, b in self.buckets:
            b.grad.zero_()

    def held_bytes(self) -> dict[str, int]:
        out = {"params": 0, "grads": 0, "master": 0}
        for _, b in self.buckets:
            for k, v in b.held_bytes().items():
                out[k] += v
        return out


def state_storage_bytes(trained: Iterable[nn.Parameter], optimizer=None,
                        grads: Iterable[torch.Tensor] = (),
                        params: Iterable[torch.Tensor] = ()) -> dict[str, int]:
    """Bytes of the storages holding training state, each storage counted once: ``params``
    (the parameters' data, and ``params`` such as a separate master slice), ``grads`` (their
    ``.grad``, and ``grads`` such as accumulated gradient slices) and ``optimizer`` (the
    optimizer's state tensors of one or more dimensions: AdamW's moments, SGD's momentum; not
    a per-parameter scalar such as ``step``)."""
    seen: set[int] = set()

    def size(ts) -> int:
        total = 0
        for t in ts:
            if t is None or t.numel() == 0:
                continue
            st = t.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
        return total

    trained = list(trained)
    out = {"params": size([p.data for p in trained] + list(params)),
           "grads": size([p.grad for p in trained] + list(grads))}
    state = getattr(optimizer, "state", {}) or {}
    out["optimizer"] = size(v for st in state.values() for v in st.values()
                            if isinstance(v, torch.Tensor) and v.dim() > 0)
    return out


#: optimizers whose update of an element reads only that element's gradient and state (and
#: scalars): stepping slices of flattened parameters equals stepping the whole tensors
ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "RMSprop", "ASGD",
               "Rprop")


def _check_shardable(optimizer: torch.optim.Optimizer) -> None:
    """Raises UsageError for what would silently train differently over slices: an optimizer
    whose update reads a tensor's shape or whole-tensor norms (Adafactor's factored moments,
    LAMB's trust ratio, Muon's orthogonalisation), or a learning-rate scheduler already built
    on the optimizer passed in (it would drive the discarded optimizer)."""
    name = type(optimizer).__name__
    if type(optimizer).__module__.split(".")[0] != "torch" or name not in ELEMENTWISE:
        raise UsageError(
            f"parallel.data_sharding steps each replica's slice of the flattened parameters, "
            f"which equals whole-tensor training only for element-wise optimizers "
            f"({', '.join(ELEMENTWISE)} from torch.optim); {type(optimizer).__module__}.{name} "
            "may read a tensor's shape or whole-tensor norms (Adafactor, LAMB, Muon do): use "
            "one of those, or data_sharding: none")
    if getattr(optimizer.step, "_wrapped_by_lr_sched", False):
        raise UsageError("a learning-rate scheduler is already built on this optimizer, and "
                         "shard_optimizer returns a new one that the scheduler would not drive: "
                         "wrap first, then build the scheduler on the returned optimizer "
                         "(opt = pipe.shard_optimizer(opt); sched = LambdaLR(opt, ...))")


class ShardedOptimizer(torch.optim.Optimizer):
    """``optimizer``'s class, hyperparameters and parameter groups over this rank's master
    slices of the sharded parameters, and over the shared (whole) ones as they are.

    ``step()`` steps the slices (their gradients are the reduce-scattered average), then
    all-gathers the parameters (``full``: at the next step's start). ``state_dict`` and
    :meth:`whole_state` speak in whole parameters (keyed like torch.distributed.checkpoint's
    flattened optimizer state, ``state.<name>.<field>``), so a checkpoint resumes under another
    degree or level. Learning-rate schedulers work on it (it shares the inner optimizer's
    ``param_groups``).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, sharding: DataSharding,
                 names: dict[int, str], timeout_s: float = 300.0):
        _check_shardable(optimizer)
        self.sharding, self.timeout_s, self.names = sharding, float(timeout_s), names
        #: whole parameter id -> (its master slice, first, last element, bucket, offset)
        self._slices: dict[int, list[tuple[nn.Parameter, int, int, ShardedBucket, int]]] = {}
        for _, b in sharding.buckets:
            for piece, (p, a, e, off) in zip(b.master, b.segments):
                view = nn.Parameter(piece, requires_grad=True)  # shares the piece's storage
                view.grad = b.grad[off:off + e - a]
                self._slices.setdefault(id(p), []).append((view, a, e, b, off))
        groups = []
        self._owner: dict[int, int] = {}  # id of a slice or shared param -> whole param id
        for g in optimizer.param_groups:
            mine = []
            for p in g["params"]:
                if sharding.owns(p):
                    for view, *_ in self._slices.get(id(p), []):
                        mine.append(view)
                        self._owner[id(view)] = id(p)
                else:
                    mine.append(p)
                    self._owner[id(p)] = id(p)
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": mine})
        self._whole = {id(p): p for g in optimizer.param_groups for p in g["params"]}
        if optimizer.state:
            raise UsageError("shard the optimizer before its first step (its state would be "
                             "thrown away)")
        accepted = inspect.signature(type(optimizer).__init__).parameters
        self.inner = type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items()
                                                if k in accepted})
        super().__init__([{"params": [torch.zeros(0, requires_grad=True)]}], {})
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
        sharding.optimizer = self
        self.defaults = self.inner.defaults

    def _sync_grads(self) -> None:
        """Point every slice's ``.grad`` at its piece of the gradient slice (again: a
        ``zero_grad(set_to_none=True)`` of the inner optimizer drops it)."""
        for slices in self._slices.values():
            for view, a, e, b, off in slices:
                view.grad = b.grad[off:off + e - a]

    def _init_state(self) -> None:
        """Give every parameter its (zero) state by a step of learning rate 0 on zero
        gradients, as torch.distributed.checkpoint does before loading into a new optimizer."""
        if self.inner.state:
            return
        lrs = [g["lr"] for g in self.inner.param_groups]
        grads = {id(t): t.grad for g in self.inner.param_groups for t in g["params"]}
        for g in self.inner.param_groups:
            g["lr"] = 0.0 if not isinstance(g["lr"], torch.Tensor) else torch.zeros_like(g["lr"])
            for t in g["params"]:
                t.grad = torch.zeros_like(t)
        self.inner.step()
        for g, lr in zip(self.inner.param_groups, lrs):
            g["lr"] = lr
            for t in g["params"]:
                t.grad = grads[id(t)]

    @torch.no_grad()
    def step(self, closure=None):
        self._sync_grads()
        loss = self.inner.step(closure)
        if self.sharding.level != "full":
            self.sharding.gather(self.timeout_s)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.sharding.zero_grad()
        for p in self._whole.values():
            if not self.sharding.owns(p) and p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    # ------------------------------------------------------------------ whole state
    def whole_state(self, init: bool = False) -> dict[str, object]:
        """The optimizer state per whole parameter, by name, as
        ``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)`` gives it
        (``state.<name>.<field>``, ``param_groups.<name>.<hyper>``): each sharded entry
        all-gathered over the replicas (collective). ``init``: an optimizer that has not
        stepped yet gets its zero state first (to load a checkpoint into)."""
        if init:
            self._init_state()
        out: dict[str, object] = {}
        by_whole_group = {}
        for g in self.inner.param_groups:
            hyper = {k: v for k, v in g.items() if k != "params"}
            for t in g["params"]:
                by_whole_group[self._owner[id(t)]] = hyper
        for pid, p in self._whole.items():
            name = self.names[pid]
            for k, v in by_whole_group.get(pid, {}).items():
                out[f"param_groups.{name}.{k}"] = v
            if not self.sharding.owns(p):
                for k, v in self.inner.state.get(p, {}).items():
                    out[f"state.{name}.{k}"] = v
        for _, b in self.sharding.buckets:
            fields, scalars = self._bucket_fields(b)
            for field, flat in fields.items():
                whole = _gather_flat(flat, b)
                at = 0
                for p in b.params:
                    k = b.numels[id(p)]
                    if field in scalars:  # a per-parameter scalar (AdamW's step)
                        v = whole[at:at + 1].reshape(())
                    else:
                        v = whole[at:at + k].view(b.shapes[id(p)])
                    out[f"state.{self.names[id(p)]}.{field}"] = v.clone()
                    at += k
        return out

    def _bucket_fields(self, b: ShardedBucket) -> tuple[dict[str, torch.Tensor], set[str]]:
        """Per state field, this rank's slice of it in the bucket's flat layout, and the fields
        that are a scalar per parameter (such as ``step``, repeated over its elements)."""
        fields: dict[str, torch.Tensor] = {}
        mine: dict[str, bool] = {}
        for p, _, _, _ in b.segments:
            v = self._slice_of(p, b)
            for k, val in (self.inner.state.get(v, {}) if v is not None else {}).items():
                mine[k] = isinstance(val, torch.Tensor) and val.dim() == 0 or not isinstance(
                    val, torch.Tensor)
        every = _all_names(sorted(mine.items()), b)
        scalars = {k for k, scalar in every if scalar}
        for k in sorted({k for k, _ in every}):
            flat = torch.zeros(b.slice, dtype=torch.float32, device=b.grad.device)
            for p, a, e, off in b.segments:
                v = self._slice_of(p, b)
                val = self.inner.state.get(v, {}).get(k) if v is not None else None
                if val is None:
                    continue
                val = torch.as_tensor(val, dtype=torch.float32)
                flat[off:off + e - a] = val.reshape(-1) if k not in scalars else val.reshape(())
            fields[k] = flat
        return fields, scalars

    def _slice_of(self, p: nn.Parameter, b: ShardedBucket):
        for view, _, _, owner, _ in self._slices.get(id(p), []):
            if owner is b:
                return view
        return None

    def load_whole_state(self, state: dict[str, object]) -> None:
        """Set the state from :meth:`whole_state`'s form (every rank takes its slices)."""
        for g in self.inner.param_groups:
            for t in g["params"]:
                name = self.names[self._owner[id(t)]]
                for k in list(g):
                    key = f"param_groups.{name}.{k}"
                    if k != "params" and key in state:
                        g[k] = state[key]
        for pid, p in self._whole.items():
            name = self.names[pid]
            fields = {k[len(f"state.{name}."):]: v for k, v in state.items()
                      if k.startswith(f"state.{name}.")}
            if not fields:
                continue
            if not self.sharding.owns(p):
                self.inner.state[p] = {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                                       for k, v in fields.items()}
                continue
            for view, a, e, _, _ in self._slices.get(pid, []):
                self.inner.state[view] = {
                    k: (v.reshape(-1)[a:e].clone().to(view.dtype) if isinstance(v, torch.Tensor)
                        and v.dim() > 0 else (v.clone() if isinstance(v, torch.Tensor) else v))
                    for k, v in fields.items()}

    def state_dict(self):
        return self.whole_state()

    def load_state_dict(self, state_dict) -> None:
        self.load_whole_state(state_dict)


def _all_names(names: list, b: ShardedBucket) -> list:
    """The state fields any replica holds for the bucket (a replica whose slice is padding
    only has none): agreed over the group so every replica gathers the same fields."""
    if b.group is None:
        return names
    every: list = [None] * b.n
    dist.all_gather_object(every, names, group=b.group)
    return sorted({tuple(k) for got in every for k in got})


def _gather_flat(flat: torch.Tensor, b: ShardedBucket) -> torch.Tensor:
    if b.group is None:
        return flat
    parts = [torch.empty_like(flat) for _ in range(b.n)]
    dist.all_gather(parts, flat.contiguous(), group=b.group)
    return torch.cat(parts)
