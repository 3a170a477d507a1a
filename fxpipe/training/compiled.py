"""``fxpipe.compile``: this rank's share of a pipelined model, for your own torchrun script.

Takes a model and a Plan (or a spec to plan from); gives a :class:`CompiledPipeline` that runs
this rank's stages. Your script keeps its loop, optimizer, learning-rate scheduler, logging and
evaluation::

    pipe = fxpipe.compile(model, "spec.yaml", example_inputs=(x,))   # under torchrun
    opt = torch.optim.AdamW(pipe.parameters(), lr=3e-4)
    for x, y in batches:                 # the GLOBAL batch, the same on every rank
        loss = pipe.step(x, y)           # micro-batches, sends, backward, all-reduce
        pipe.clip_grad_norm_(1.0)        # the norm over every stage and replica
        opt.step(); pipe.zero_grad()

``step()`` only computes and all-reduces gradients (the executor runs with ``optimizer=None``);
they stay in ``.grad`` of ``pipe.parameters()`` (the model's own Parameter objects, named by
their original FQNs), so any ``torch.optim`` optimizer, parameter groups and
``lr_scheduler`` work as in one process. With ``grad_accumulation=k``, each ``step()``
contributes ``1/k`` of its batch's mean-loss gradient: ``k`` steps then one optimizer step
equal one step on the average of the ``k`` batch losses (what ``(loss / k).backward()`` does
in a single-process loop), tied weights included.

Misuse fails with a message saying what to do: an optimizer over parameters another rank
trains (``model.parameters()`` instead of ``pipe.parameters()``), an optimizer step after
another number of ``step()`` calls than ``grad_accumulation``, a batch that does not split
into the plan's micro-batches, ``compile`` outside a torch.distributed job.

Size: over 600 lines because it is the whole surface a user's own loop calls (one class whose
methods share the rank's stages, mesh and gradient reducer: step, evaluation, state dicts under
every degree)."""

from __future__ import annotations

import hashlib
import json
import itertools
import os
import weakref
from typing import Any, Iterator, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn

from fxpipe.data.batches import Batch, as_tuple
from fxpipe.errors import FxpipeError, RuntimeFailure, UsageError
from fxpipe.plans.plan import Plan
from fxpipe.execution.compiled_stage import resolve_compile

__all__ = ["CompiledPipeline", "ServerShare", "UsageError", "compile"]

_ENV_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


# ---------------------------------------------------------------------- optimizer step checks
_LIVE: list[weakref.ref] = []  # compiled pipelines of this process, oldest first
_HOOK = None


def _optimizer_pre_hook(optimizer, args, kwargs) -> None:
    """Global ``optimizer.step()`` pre-hook: an optimizer over a compiled model must hold only
    this rank's parameters, and step after ``grad_accumulation`` calls of ``pipe.step()``."""
    _LIVE[:] = [r for r in _LIVE if r() is not None]
    if not _LIVE:
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    related = [pipe for pipe in (r() for r in _LIVE)
               if pipe is not None and any(pipe._of_model(p) for p in params)]
    if not related:
        return
    for pipe in reversed(related):  # the newest pipeline that trains all of them
        if not pipe._foreign(params):
            pipe._check_accumulation()
            pipe._check_sharded(params)
            return
    pipe = related[-1]
    foreign = pipe._foreign(params)
    raise UsageError(
        f"optimizer.step() on rank {pipe.rank}: the optimizer holds {len(foreign)} parameters "
        f"that this rank does not train (e.g. {foreign[:3]}); rank {pipe.rank} (pipeline rank "
        f"{pipe.pipe_rank}, replica {pipe.replica}) holds stages {list(pipe.stages)} only, so "
        "those parameters never get a gradient here. Build the optimizer over pipe.parameters() "
        "(or pipe.named_parameters() for parameter groups), not model.parameters()")


def _register(pipe: "CompiledPipeline") -> None:
    global _HOOK
    _LIVE.append(weakref.ref(pipe))
    if _HOOK is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _HOOK = register_optimizer_step_pre_hook(_optimizer_pre_hook)


class _LoadResult(NamedTuple):
    missing_keys: list[str]
    unexpected_keys: list[str]


def _install(root: nn.Module, path: str, t: torch.Tensor, persistent: bool = True) -> None:
    """Register ``t`` at dotted ``path`` under ``root``, creating empty container modules."""
    *prefix, leaf = path.split(".")
    mod = root
    for item in prefix:
        child = mod._modules.get(item)
        if child is None:
            child = nn.Module()
            mod.add_module(item, child)
        mod = child
    if isinstance(t, nn.Parameter):
        mod.register_parameter(leaf, t)
    else:
        mod.register_buffer(leaf, t, persistent=persistent)


class CompiledPipeline:
    """This rank's share of a pipelined model (made by :func:`compile`).

    Attributes:
        plan: the :class:`~fxpipe.plans.plan.Plan`. mesh: the rank's
            :class:`~fxpipe.runtime.mesh.Mesh`. executor: the
            :class:`~fxpipe.runtime.executor.PipelineExecutor` (events, peak micro-batches).
        module: an ``nn.Module`` holding this rank's parameters and persistent buffers under
            their original FQNs (the model's own tensors), e.g. for
            ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(pipe.module, opt)``.
        rank, world_size: global rank and size. pipe_rank, replica: this rank's pipeline rank
            and data-parallel replica. stages: the (virtual) stages this rank runs.
        is_first_stage / is_last_stage: this rank runs stage 0 / the stage computing the loss.
        grad_accumulation: ``step()`` calls per optimizer step (their losses weigh ``1/k``).
        training: train (True) or eval mode.
        device: this rank's device.
    """

    def __init__(self, model: nn.Module, plan: Plan, spec, mesh, stages: dict[int, nn.Module],
                 executor, count, grad_accumulation: int, model_loss: bool, tensor=None):
        self.plan, self.spec, self.mesh, self.executor = plan, spec, mesh, executor
        #: :class:`~fxpipe.runtime.tensor_parallel.TensorShards` under tensor parallelism
        self.tensor_shards = tensor
        self._stages = stages
        self._count = count
        self._model_loss = model_loss
        self.grad_accumulation = int(grad_accumulation)
        self.device = mesh.device
        self.rank, self.world_size = mesh.rank, mesh.world_size
        self.pipe_rank, self.replica = mesh.pipe_rank, mesh.dp_rank
        self.stages = tuple(sorted(stages))
        self.is_first_stage = 0 in stages
        self.is_last_stage = executor.loss_stage in stages
        self.training = True
        self._eval_modules: dict[int, nn.Module] | None = None
        # this rank's tensors under the model's own first names (model.named_parameters order)
        local: dict[int, torch.Tensor] = {}
        stage_name: dict[int, str] = {}
        for m in stages.values():
            for name, t in m.state_dict(keep_vars=True).items():
                local.setdefault(id(t), t)
                stage_name.setdefault(id(t), plan.param_aliases.get(name, name))
            for name, p in m.named_parameters():
                local.setdefault(id(p), p)
                stage_name.setdefault(id(p), plan.param_aliases.get(name, name))
            # a buffer the stage reads under a non-persistent name may be one the model saves
            # under another (installed below only where the model's state_dict names it)
            for name, b in m.named_buffers():
                local.setdefault(id(b), b)
                stage_name.setdefault(id(b), plan.param_aliases.get(name, name))
        model_names = list(model.named_parameters(remove_duplicate=False))
        # weak references: the model's other parameters may be freed once compile returns
        self._model_params = weakref.WeakValueDictionary((id(p), p) for _, p in model_names)
        self._model_param_name: dict[int, str] = {}
        for name, p in model_names:
            self._model_param_name.setdefault(id(p), name)
        model_state = model.state_dict(keep_vars=True)
        # under tensor parallelism a shard takes the place (and the names) of its whole tensor
        shard_of = ({id(whole): local[sid] for sid, whole in tensor.origin.items()
                     if sid in local} if tensor is not None else {})
        model_state = {n: shard_of.get(id(t), t) for n, t in model_state.items()}
        model_names = [(n, shard_of.get(id(t), t)) for n, t in model_names]
        for shard in shard_of.values():
            self._model_params[id(shard)] = shard
        first: dict[int, str] = {}
        for name, t in [*model_names, *model_state.items()]:
            first.setdefault(id(t), name)
        self.module = nn.Module()
        placed: set[int] = set()
        for name, t in [*model_names, *model_state.items()]:
            if id(t) in local and id(t) not in placed:
                placed.add(id(t))
                _install(self.module, first[id(t)], t)
        # the model's tensors no stage reads (a buffer kept only for its checkpoint, a parameter
        # forward() never uses): held by pipeline rank 0, so that state_dict() and checkpoints
        # hold every key of the plain model's state_dict()
        if mesh.pipe_rank == 0:
            read = {plan.param_aliases.get(n, n) for st in plan.stages
                    for n in [*st.params, *st.buffers]}
            names: dict[int, set[str]] = {}
            for name, t in model_state.items():
                names.setdefault(id(t), set()).add(name)
            for name, t in model_state.items():
                if id(t) in placed or any(plan.param_aliases.get(n, n) in read
                                          for n in names[id(t)]):
                    continue
                placed.add(id(t))
                _install(self.module, first[id(t)], t)
        # parameters the model does not name (should not happen) stay trainable; a buffer the
        # model's state_dict() leaves out (non-persistent) stays out of this module too, so its
        # state_dict() and checkpoints hold exactly the plain model's keys
        for tid, t in local.items():
            if tid not in placed and isinstance(t, nn.Parameter):
                placed.add(tid)
                _install(self.module, stage_name[tid], t)
        self._local_ids = {id(p) for p in self.module.parameters()}
        # model name (aliases included) -> local name, for loading whole-model state dicts
        mine = {id(t): n for n, t in self.module.state_dict(keep_vars=True).items()}
        self._local_name = {n: mine[id(t)] for n, t in model_state.items() if id(t) in mine}
        self._model_keys = set(model_state)
        if tensor is not None:
            tensor.name_in(self.module)
        #: the shards' bookkeeping, read by the checkpoint functions when they are given
        #: ``pipe.module`` (sharded tensors are saved and loaded whole)
        self.module.fxpipe_tensor_shards = tensor
        # parameters whose gradient norm this rank counts: a shared (tied) parameter only on
        # the lowest pipeline rank holding it, and a parameter whole on every rank of a tensor
        # group only on its first, so clipping counts each once (shards on every rank)
        shared = executor.shared_param_ranks
        self._grad_params = [p for p in self.module.parameters() if p.requires_grad]
        self._norm_params = [p for p in self._grad_params if (
            id(p) not in shared or min(shared[id(p)][0]) == self.pipe_rank) and (
            mesh.tp_rank <= 0 or (tensor is not None and id(p) in tensor.by_id))]
        self._accumulated = 0
        self._marks: list[tuple[int, int] | None] = []
        self._cleared_seen = 0  # DataSharding.cleared at the last accumulation start
        #: train.updates: async: this rank's ParameterClient (set by compile), else None
        self.client = None
        _register(self)

    def _of_model(self, p: torch.Tensor) -> bool:
        return self._model_params.get(id(p)) is p

    def _foreign(self, params: list[torch.Tensor]) -> list[str]:
        """Names of the model's parameters among ``params`` that this rank does not train."""
        return [self._model_param_name[id(p)] for p in params
                if id(p) not in self._local_ids and self._of_model(p)]

    # ------------------------------------------------------------------ parameters and state
    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """This rank's parameters (each once, tied ones included), in the model's order."""
        return self.module.parameters(recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters by their original FQN (the model's first name for a tied
        one), e.g. for parameter groups."""
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's persistent buffers by their original FQN."""
        return self.module.named_buffers(prefix, recurse, remove_duplicate)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and persistent buffers by original FQN (detached, sharing
        storage). ``torch.distributed.checkpoint.save(pipe.state_dict(), checkpoint_id=DIR)`` on
        every rank writes one checkpoint that
        ``fxpipe.training.checkpoint.load_into_model(model, DIR)`` loads into the plain model;
        ``dcp.load(sd := pipe.state_dict(), checkpoint_id=DIR)`` loads it back in place.
        Under tensor parallelism each sharded tensor comes whole (gathered over the tensor
        group: collective, and a copy)."""
        if self.executor.sharding is not None:  # ``full`` keeps only slices between steps
            self.executor.sharding.ensure_gathered(self.executor.timeout_s)
        state = dict(self.module.state_dict())
        if self.tensor_shards is not None:
            state = self.tensor_shards.whole_state(state)
        return state

    def shard_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """``optimizer`` (built over :meth:`parameters` or :meth:`named_parameters` groups,
        before its first step) as this rank's share under ``parallel.data_sharding``: the
        same class, hyperparameters and groups over this replica's slices of the parameters
        (:class:`~fxpipe.runtime.data_sharding.ShardedOptimizer`); ``optimizer`` itself when
        the plan does not shard. Use the returned one (and build schedulers on it)."""
        sharding = self.executor.sharding
        if sharding is None:
            return optimizer
        from fxpipe.runtime.data_sharding import ShardedOptimizer

        names = {id(p): n for n, p in self.module.named_parameters()}
        return ShardedOptimizer(optimizer, sharding, names, self.executor.timeout_s)

    def _check_sharded(self, params: list) -> None:
        """Under ``parallel.data_sharding`` an optimizer over the whole parameters would step
        them with gradients the replicas no longer hold: it must be :meth:`shard_optimizer`'s."""
        sharding = self.executor.sharding
        if sharding is not None and any(sharding.owns(p) for p in params):
            raise UsageError(
                f"optimizer.step() on rank {self.rank}: the plan shards the data-parallel "
                f"training state (parallel.data_sharding: {sharding.level}), so each replica "
                "holds only its slice of the gradients; wrap the optimizer before its first "
                "step: opt = pipe.shard_optimizer(torch.optim.AdamW(pipe.parameters(), ...))")

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True
                        ) -> _LoadResult:
        """Copy this rank's tensors from ``state_dict``: a :meth:`state_dict` or the whole
        model's ``model.state_dict()`` (keys of other ranks' tensors are skipped, aliases of
        tied parameters accepted).

        Raises:
            UsageError: with ``strict``, a tensor of this rank is missing, or a key names no
                tensor of the model.
        """
        if self.executor.sharding is not None:  # ``full``: whole parameters to copy into
            self.executor.sharding.ensure_gathered(self.executor.timeout_s)
        own = self.module.state_dict(keep_vars=True)
        filled: set[str] = set()
        unexpected = []
        with torch.no_grad():
            for key, value in state_dict.items():
                name = self._local_name.get(key, key if key in own else None)
                if name is None:
                    if key not in self._model_keys:
                        unexpected.append(key)
                    continue
                if self.tensor_shards is not None:  # a whole tensor: this rank's shard of it
                    value = self.tensor_shards.local(name, value, own[name])
                own[name].copy_(value)
                filled.add(name)
        if self.executor.sharding is not None:
            self.executor.sharding.refresh_master()
        missing = sorted(set(own) - filled)
        if strict and (missing or unexpected):
            raise UsageError(f"load_state_dict on rank {self.rank}: missing keys {missing[:5]}, "
                             f"keys the model does not have {unexpected[:5]}; pass a state "
                             "dict of this model (pipe.state_dict() or model.state_dict()), or "
                             "strict=False")
        return _LoadResult(missing, unexpected)

    # ------------------------------------------------------------------ gradients
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of this rank's parameters (start a new accumulation)."""
        if self.executor.sharding is not None:
            self.executor.sharding.zero_grad()
        for p in self.module.parameters():
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.zero_()
        self._accumulated = 0
        self._marks = []

    def _grad_marks(self) -> list[tuple[int, int] | None]:
        return [None if p.grad is None else (id(p.grad), p.grad._version)
                for p in self._grad_params]

    def _note_cleared(self) -> None:
        """Start a new accumulation when the script cleared the gradients since the last
        ``step()`` (``optimizer.zero_grad()``, with or without ``set_to_none``)."""
        sharding = self.executor.sharding
        if sharding is not None and sharding.cleared != self._cleared_seen:
            self._cleared_seen = sharding.cleared  # the sharded optimizer's zero_grad()
            self._accumulated = 0
            return
        now = self._grad_marks()
        if all(m is None for m in now) or (self._marks and all(
                a is None or a != b for a, b in zip(now, self._marks))):
            self._accumulated = 0

    def _check_accumulation(self) -> None:
        if self._accumulated and self._accumulated != self.grad_accumulation:
            raise UsageError(
                f"optimizer.step() on rank {self.rank} after {self._accumulated} pipe.step() "
                f"calls, but grad_accumulation is {self.grad_accumulation} (each step() adds "
                f"1/{self.grad_accumulation} of its batch's gradient); call step() "
                f"{self.grad_accumulation} times per optimizer step, set pipe.grad_accumulation "
                "to the number of calls, or clear the gradients after each optimizer step "
                "(pipe.zero_grad() or optimizer.zero_grad())")

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the gradients of the whole model (every stage, tied parameters once) to total
        norm ``max_norm``, as ``torch.nn.utils.clip_grad_norm_`` does on the unsplit model
        (replicas hold the same all-reduced gradients). Collective: every rank calls it.

        Returns the total norm before clipping (a tensor in the gradients' dtype, the same on
        every rank).
        """
        norm_type = float(norm_type)
        sharding = self.executor.sharding
        grads = [p.grad for p in self._norm_params if p.grad is not None
                 and (sharding is None or not sharding.owns(p))]
        if sharding is not None:  # every replica its slices; whole gradients once
            if self.replica != 0:
                grads = []
            split = self.tensor_shards.by_id if self.tensor_shards is not None else {}
            grads += [g for p, g in sharding.segment_grads()
                      if self.mesh.tp_rank <= 0 or id(p) in split]
        dev = self.device
        experts = getattr(self.tensor_shards, "expert_ids", set())
        mine = [p.grad for p in self._norm_params if id(p) in experts and p.grad is not None]
        if experts:  # each rank of an expert group holds other experts: summed over it below
            grads = [g for g in grads if not any(g is e for e in mine)]
        local = self._norm_of(grads, norm_type, dev)
        if experts:
            part = self._norm_of(mine, norm_type, dev).reshape(1)
            if sharding is not None:  # summed over every rank below: the first expert group's
                if self.mesh.dp_rank >= self.mesh.expert:  # ranks count every expert once
                    part = torch.zeros_like(part)
            elif self.mesh.ep_group is not None:
                op = dist.ReduceOp.MAX if norm_type == float("inf") else dist.ReduceOp.SUM
                dist.all_reduce(part, op=op, group=self.mesh.ep_group)
            local = (torch.maximum(local, part[0]) if norm_type == float("inf")
                     else local + part[0])
        local = local.reshape(1).to(dev)
        # every pipeline and tensor rank of the replica (with sharding, every replica too)
        group = self.mesh.mp_group if sharding is None else None
        if self.mesh.world_size > 1 and (sharding is not None or group is not None):
            op = dist.ReduceOp.MAX if norm_type == float("inf") else dist.ReduceOp.SUM
            dist.all_reduce(local, op=op, group=group)
        total = local[0] if norm_type == float("inf") else local[0] ** (1.0 / norm_type)
        # in the gradients' dtype, as torch's clip_grad_norm_ (its clipping factor too)
        total = total.to(self._grad_params[0].dtype if self._grad_params else torch.float32)
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(f"the total norm of order {norm_type} of the gradients is "
                               f"{float(total)}, so they cannot be clipped; set "
                               "error_if_nonfinite=False to clip anyway")
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        every = [p.grad for p in self.module.parameters() if p.grad is not None and (
            sharding is None or not sharding.owns(p))]
        if sharding is not None:
            every += sharding.grad_slices()
        if every:
            torch._foreach_mul_(every, coef.to(every[0].device))
        self._marks = self._grad_marks()
        return total

    @staticmethod
    def _norm_of(grads: list, norm_type: float, dev) -> torch.Tensor:
        """The ``norm_type`` norm of ``grads`` to the power (the max for inf), float64."""
        if not grads:
            return torch.zeros((), dtype=torch.float64, device=dev)
        norms = [torch.linalg.vector_norm(g, norm_type) for g in grads]
        if norm_type == float("inf"):
            return torch.stack(norms).max().to(torch.float64).to(dev)
        return (torch.stack(norms).to(torch.float64) ** norm_type).sum().to(dev)

    # ------------------------------------------------------------------ modes
    def train(self, mode: bool = True) -> "CompiledPipeline":
        """Train mode (``step()`` allowed) or, with ``mode=False``, eval mode."""
        self.training = bool(mode)
        for m in self._stages.values():
            m.train(mode)
        return self

    def eval(self) -> "CompiledPipeline":
        """Eval mode: :meth:`evaluate` runs dropout off and BatchNorm on its running
        statistics, as ``model.eval()`` would."""
        return self.train(False)

    def _eval_stage_modules(self) -> dict[int, nn.Module]:
        if self._eval_modules is None:
            from fxpipe.training.eval_graphs import eval_copy

            self._eval_modules = {s: eval_copy(m) if isinstance(m, torch.fx.GraphModule)
                                  else m for s, m in self._stages.items()}
        return self._eval_modules

    # ------------------------------------------------------------------ batches
    def _batch(self, inputs: Any, target: Any, what: str) -> Batch:
        """The global batch as a :class:`Batch`, checked against the plan."""
        if isinstance(inputs, Batch):
            if target is not None:
                raise UsageError(f"{what}: got a Batch and a target; a Batch carries its target")
            b = inputs
        elif isinstance(inputs, dict) and target is None and not self._model_loss:
            kwargs = dict(inputs)
            if "labels" not in kwargs:
                raise UsageError(f"{what}: got a dict without 'labels' and no target; pass the "
                                 "target (step(inputs, target)) or put it under 'labels'")
            target = kwargs.pop("labels")
            b = Batch((), kwargs, target)
        elif isinstance(inputs, dict):
            b = Batch((), dict(inputs), target)
        else:
            b = Batch(as_tuple(inputs), {}, target)
        tensors = [*b.args, *b.kwargs.values()]
        bad = [type(t).__name__ for t in tensors if not isinstance(t, torch.Tensor)]
        if bad or not tensors:
            raise UsageError(f"{what}: the inputs must be tensors (a tensor, a tuple of tensors "
                             f"or a dict of named tensors), got {bad or 'none'}")
        if b.target is None and self.executor.needs_target:
            raise UsageError(f"{what}: no target; pass step(inputs, target) (the loss is "
                             f"{self.spec.train.loss!r}, which compares the output with it)")
        if b.target is not None and not isinstance(b.target, torch.Tensor):
            raise UsageError(f"{what}: the target is a {type(b.target).__name__}, not a tensor")
        sizes = {int(t.shape[0]) if t.dim() else -1
                 for t in [*tensors, *([b.target] if b.target is not None else [])]}
        if len(sizes) != 1 or -1 in sizes:
            raise UsageError(f"{what}: the inputs and the target have different batch sizes "
                             f"(dim 0: {sorted(sizes)}); every tensor needs the batch first")
        plan = self.plan
        parts, mbs = plan.dp * plan.microbatches, plan.microbatch_size
        n = b.size
        if n % parts:
            raise UsageError(
                f"{what}: the batch has {n} samples, which does not split into parallel.data x "
                f"parallel.microbatches = {plan.dp} x {plan.microbatches} = {parts} equal "
                f"micro-batches; pass the global batch of {parts * mbs} samples (the same on "
                "every rank; each replica takes its share)")
        if n != parts * mbs:
            raise UsageError(
                f"{what}: the batch has {n} samples but the plan was made for a global batch of "
                f"{parts * mbs} ({parts} micro-batches of {mbs}; it fixes the shapes sent between "
                f"stages); pass {parts * mbs} samples, or plan with data.batch_size: {n}")
        return b

    def _mine(self, b: Batch, scale: float) -> tuple[dict[str, torch.Tensor], Any, list[float]]:
        from fxpipe.errors import SpecError
        from fxpipe.training.losses import microbatch_weights

        plan = self.plan
        try:
            b.named(plan.model_inputs, plan.input_kwargs)
        except SpecError as e:
            raise UsageError(str(e).replace("feed batches like the ones planned",
                                            "pass inputs like the example inputs")) from None
        share = self.mesh.sample_replica  # a context group's replicas take the same samples
        weights = microbatch_weights(b, share, plan.dp, plan.microbatches, self._count)
        per = plan.microbatches * plan.microbatch_size
        mine = b.slice(share * per, (share + 1) * per).to(self.device)
        return (mine.named(plan.model_inputs, plan.input_kwargs), mine.target,
                [w * scale for w in weights])

    # ------------------------------------------------------------------ running
    def step(self, inputs: Any, target: torch.Tensor | None = None) -> float:
        """Forward and backward of one GLOBAL batch through the schedule (every rank passes the
        same batch; each replica takes its slice): micro-batching, sends, backward and the
        data-parallel all-reduce. Gradients are added to ``.grad`` (``1/grad_accumulation`` of
        the batch's mean-loss gradient); no optimizer step. Collective: every rank calls it.

        Args:
            inputs: a tensor, a tuple of tensors (positional inputs), a dict of named tensors
                (keyword inputs; with a built-in loss and no ``target``, its ``labels`` is the
                target), or a :class:`~fxpipe.data.batches.Batch`; each ``[global batch, ...]``.
            target: what the loss compares the output with, ``[global batch, ...]``; None when
                the model computes its own loss (its labels are among the inputs).

        Returns:
            The batch's mean loss (over the targets that count), the same float on every rank.

        Raises:
            UsageError: eval mode, or a batch that does not fit the plan.
            RuntimeFailure: a peer timed out or died, shapes differ from the plan.
        """
        if not self.training:
            raise UsageError("step() in eval mode: call pipe.train() before training steps "
                             "(pipe.evaluate(inputs, target) gives the loss without a backward)")
        b = self._batch(inputs, target, "pipe.step()")
        named, tgt, weights = self._mine(b, 1.0 / self.grad_accumulation)
        self._note_cleared()
        loss = self.executor.step(named, tgt, weights)
        self._accumulated += 1
        self._marks = self._grad_marks()
        return loss * self.grad_accumulation

    def evaluate(self, inputs: Any, target: torch.Tensor | None = None) -> float:
        """The loss of one global batch, forward only (no backward, gradients untouched), in
        the current mode (after :meth:`eval`: dropout off, BatchNorm on running statistics).
        Takes what :meth:`step` takes. Collective: every rank calls it.

        Returns the batch's mean loss, the same float on every rank."""
        b = self._batch(inputs, target, "pipe.evaluate()")
        named, tgt, weights = self._mine(b, 1.0)
        modules = None if self.training else self._eval_stage_modules()
        return self.executor.evaluate(named, tgt, weights, modules)

    @property
    def skipped_steps(self) -> list[int]:
        """fp16 only: indices of the ``step()`` calls whose inf/NaN gradients were dropped."""
        return list(self.executor.skipped_steps)

    def __repr__(self) -> str:
        return (f"CompiledPipeline(rank={self.rank}, pipe_rank={self.pipe_rank}, "
                f"replica={self.replica}, stages={list(self.stages)}, "
                f"schedule={self.plan.schedule!r}, pipeline={self.plan.pipeline}, "
                f"dp={self.plan.dp}, microbatches={self.plan.microbatches})")


class ServerShare:
    """A parameter server rank's share of the model (what :func:`fxpipe.compile` gives there).

    Attributes:
        plan, spec, mesh: as for a CompiledPipeline (``mesh.is_server`` is True).
        index: this server's index in ``plan.parameter_servers``.
        params: canonical parameter name -> the tensor this server keeps (on its device).
        module: an ``nn.Module`` holding those parameters under the model's own first names
            (for the optimizer's state and checkpoints).
        group: the process group of the parameter traffic (:func:`~fxpipe.runtime.
            parameter_server.wire_group`).
        rank, device: global rank and device.
    """

    is_server = True

    def __init__(self, model: nn.Module, plan, spec, mesh, group):
        self.plan, self.spec, self.mesh, self.group = plan, spec, mesh, group
        self.rank, self.device = mesh.rank, mesh.device
        self.index = plan.parameter_servers.index(mesh.rank)
        every = dict(model.named_parameters(remove_duplicate=False))
        first = {}
        for name, p in model.named_parameters():
            first.setdefault(id(p), name)
        self.params: dict[str, torch.Tensor] = {}
        self.module = nn.Module()
        for canon, j in plan.server_params.items():
            if j != self.index:
                continue
            if canon not in every:
                raise RuntimeFailure(f"parameter server {self.index}: the plan places {canon!r} "
                                     "here but the model has no parameter of that name; plan "
                                     "and model disagree")
            p = every[canon]
            p.data = p.data.to(self.device)
            p.grad = None
            self.params[canon] = p
            _install(self.module, first[id(p)], p)

    def parameters(self):
        """The parameters this server keeps (each once)."""
        return self.module.parameters()

    def __repr__(self) -> str:
        return (f"ServerShare(rank={self.rank}, server={self.index}, "
                f"params={len(self.params)})")


# ---------------------------------------------------------------------- compile
def _join(spec, world: int, timeout_s: float) -> torch.device:
    """This process's device, joining torchrun's process group when there is none yet."""
    from fxpipe.runtime.mesh import init_distributed

    if dist.is_initialized() or all(v in os.environ for v in _ENV_VARS):
        return init_distributed(spec.cluster.device, timeout_s)
    if world == 1:  # one rank: no process group needed
        if spec.cluster.device == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeFailure("cluster.device is 'cuda' but torch sees no CUDA device; use "
                                     "device 'cpu' or run on a machine with GPUs")
            return torch.device("cuda", 0)
        return torch.device("cpu")
    raise UsageError(
        f"fxpipe.compile: the plan runs on {world} ranks (parallel.pipeline x parallel.data) but "
        "this process is not part of a torch.distributed job (no process group, and RANK, "
        "WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not set); launch the script with "
        f"`torchrun --nproc-per-node {world} SCRIPT` (or call "
        "torch.distributed.init_process_group first)")


def _as_plan(source) -> tuple[Plan | None, Any, bool]:
    """``(plan, spec, to_plan)``: a Plan or plan.json path with its spec, or ``(None, spec,
    True)`` for a spec still to plan."""
    from pathlib import Path

    from fxpipe.partitioner.driver import as_spec
    from fxpipe.specs.loader import load_spec

    if isinstance(source, Plan):
        return source, load_spec(source.spec), False
    if isinstance(source, (str, Path)) and str(source).endswith(".json"):
        plan = Plan.load(source)
        return plan, load_spec(plan.spec), False
    return None, as_spec(source), True


def _plan_on_rank0(model, spec, example_inputs, example_kwargs) -> Plan:
    from fxpipe.partitioner.driver import plan

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return plan(model, spec, example_inputs, example_kwargs)
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", plan(model, spec, example_inputs, example_kwargs).to_dict())
        except FxpipeError as e:
            box[0] = ("error", type(e).__name__, str(e))
            dist.broadcast_object_list(box, src=0)
            raise
        except Exception as e:  # noqa: BLE001 - tell the other ranks before failing
            box[0] = ("error", "RuntimeFailure", f"planning failed: {type(e).__name__}: {e}")
            dist.broadcast_object_list(box, src=0)
            raise
    dist.broadcast_object_list(box, src=0)
    if box[0][0] == "error":
        import fxpipe.errors as errors

        raise getattr(errors, box[0][1], FxpipeError)(f"(planned on rank 0) {box[0][2]}")
    return Plan.from_dict(box[0][1])


def _same_plan_everywhere(plan: Plan) -> None:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    d = plan.to_dict()  # the run folder (spec.output) may differ between nodes
    d["spec"] = {k: v for k, v in d["spec"].items() if k != "output"}
    digest = hashlib.sha1(json.dumps(d, sort_keys=True).encode()).hexdigest()
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, digest)
    if len(set(every)) > 1:
        groups = {d: [r for r, x in enumerate(every) if x == d] for d in set(every)}
        raise UsageError("fxpipe.compile: the ranks were given different plans (ranks "
                         f"{sorted(groups.values())} agree among themselves); give every rank "
                         "the same Plan or plan.json, or pass the spec and let fxpipe plan")


@torch.no_grad()
def _broadcast_weights(pipe: CompiledPipeline) -> None:
    """Replica 0's parameters and buffers to every replica, and each tied parameter from the
    lowest pipeline rank holding it, as DDP does at construction: every copy starts equal
    whatever the seeds."""
    mesh = pipe.mesh
    if mesh.world_size == 1:
        return

    def bcast(tensors: list[torch.Tensor], src: int, group) -> None:
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for ts in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1) for t in ts])
            dist.broadcast(flat, src=src, group=group)
            off = 0
            for t in ts:
                t.copy_(flat[off:off + t.numel()].view_as(t))
                off += t.numel()

    state = list(pipe.module.state_dict(keep_vars=True).values())
    shards = pipe.tensor_shards
    experts = getattr(shards, "expert_ids", set())
    if experts:  # each from the first replica holding the same experts
        mine = [t for t in state if id(t) in experts]
        state = [t for t in state if id(t) not in experts]
        if mesh.dp > mesh.expert:
            bcast(mine, mesh.global_rank(mesh.pipe_rank, mesh.ep_rank), mesh.expert_dp_group)
    if mesh.dp > 1 and state:
        bcast(state, mesh.global_rank(mesh.pipe_rank, 0), mesh.dp_group)
    whole = [t for t in state if shards is None or id(t) not in shards.by_id]
    if mesh.tensor > 1 and whole:  # what every rank of a tensor group holds whole
        bcast(whole, mesh.tp_ranks[0], mesh.tp_group)
    shared = pipe.executor.shared_param_ranks
    by_key: dict[tuple[int, ...], list[tuple[str, torch.Tensor]]] = {}
    for p in pipe.module.parameters():
        if id(p) in shared:
            key, fqn = shared[id(p)]
            by_key.setdefault(key, []).append((fqn, p))
    for key in sorted(by_key):
        if len(key) > 1:
            tensors = [p for _, p in sorted(by_key[key], key=lambda x: x[0])]
            bcast(tensors, mesh.global_rank(min(key), 0), mesh.replica_group(key))


#: what :func:`compile` says to a spec or plan with ``train.updates: async``
ASYNC_REFUSED = (
    "fxpipe.compile: train.updates: async runs through `fxpipe run` (parameter servers and "
    "replicas, each at its own pace: the server ranks keep the weights and apply the updates, "
    "which a script's own loop and optimizer cannot do); fxpipe.compile trains with sync "
    "updates: set train.updates: sync (and drop cluster.parameter_servers) for your own "
    "training script, or run the spec with `fxpipe run`")


def compile(model: nn.Module, spec_or_plan: Any, example_inputs: Any = None,
            example_kwargs: dict | None = None, *, loss_fn=None,
            grad_accumulation: int | None = None, timeout_s: float | None = None,
            broadcast_weights: bool = True) -> CompiledPipeline:
    """This rank's share of ``model`` pipelined by a plan, inside a torchrun script.

    Synchronous updates only: a spec or plan with ``train.updates: async`` (parameter servers)
    is refused with a :class:`UsageError` (it runs through ``fxpipe run``, whose worker compiles
    it with :func:`_compile_async`).

    Args:
        model: the whole ``nn.Module`` with its initial weights, the same model on every rank;
            it is moved to this rank's device and put in train mode (its traced graph is the
            training graph). Only this rank's stages train; the other parameters stay unused.
        spec_or_plan: a :class:`~fxpipe.plans.plan.Plan` or ``plan.json`` path (as
            ``fxpipe plan`` writes), or a spec (``ParallelSpec``, YAML path, bundled name or
            dict) to plan from (on rank 0, broadcast to the others). The spec's ``cluster``
            says the device, ``data.batch_size`` the global batch, ``train`` the loss,
            precision, gradient compression, timeout and ``grad_accumulation``.
        example_inputs, example_kwargs: ONE micro-batch of positional / keyword inputs for
            planning (as :func:`fxpipe.plan` takes them); ignored with a Plan.
        loss_fn: ``loss_fn(output, target) -> mean loss over the micro-batch``; default the
            spec's ``train.loss``.
        grad_accumulation: ``step()`` calls per optimizer step (default
            ``train.grad_accumulation``).
        timeout_s: seconds any wait may take (default ``train.timeout_s``).
        broadcast_weights: copy replica 0's weights to every replica and each tied weight from
            its first holder (as DDP does), so every copy starts equal whatever the seeds.

    Returns:
        A :class:`CompiledPipeline`.

    Raises:
        UsageError: ``train.updates: async``, not launched under torch.distributed (for more
            than one rank), ranks given different plans, a model on the meta device.
            RuntimeFailure: the world size is not the plan's. PlanError / TraceError /
            SpecError: see :func:`fxpipe.plan`.
    """
    return _compile(model, spec_or_plan, example_inputs, example_kwargs, loss_fn=loss_fn,
                    grad_accumulation=grad_accumulation, timeout_s=timeout_s,
                    broadcast_weights=broadcast_weights, allow_async=False)


def _compile_async(model: nn.Module, plan: Any, **kw) -> "CompiledPipeline | ServerShare":
    """What ``fxpipe run``'s worker (:func:`fxpipe.training.worker.train_async`) and the async
    benchmarks compile: as :func:`compile`, and a plan with ``train.updates: async`` (a plan
    with ``parameter_servers``) gives, on a trainer rank, a :class:`CompiledPipeline` whose
    executor keeps the replica's gradients (no all-reduce) and whose ``pipe.client`` pulls and
    pushes them, and on a parameter server rank a :class:`ServerShare` (see
    :mod:`fxpipe.training.async_updates`: ``serve`` / ``train_replica``)."""
    return _compile(model, plan, allow_async=True, **kw)


def _fp8_config(t, device: torch.device):
    """torchao's float8 config of ``train.precision: fp8`` on ``device`` (None otherwise).

    Raises:
        UsageError: the device has no FP8 tensor cores, or torchao is missing (one line).
    """
    if t.precision != "fp8":
        return None
    from fxpipe.execution.fp8 import float8_config, fp8_problem

    problem = fp8_problem(device)
    if problem is not None:
        raise UsageError(problem)
    return float8_config(t.fp8_scaling)


def _compile(model: nn.Module, spec_or_plan: Any, example_inputs: Any = None,
             example_kwargs: dict | None = None, *, loss_fn=None,
             grad_accumulation: int | None = None, timeout_s: float | None = None,
             broadcast_weights: bool = True, allow_async: bool = False):
    from fxpipe.partitioner.loss_targets import target_counter
    from fxpipe.partitioner.split import build_stages, trace_for_plan
    from fxpipe.runtime.compression import Compression
    from fxpipe.runtime.executor import PipelineExecutor
    from fxpipe.runtime.mesh import Mesh
    from fxpipe.schedule.lowering import schedule_for_plan
    from fxpipe.execution.losses import MODEL_LOSS, resolve_loss
    from fxpipe.training.losses import batch_counter

    if not isinstance(model, nn.Module):
        raise UsageError(f"fxpipe.compile: model must be a torch.nn.Module, got "
                         f"{type(model).__name__}")
    if any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers())):
        raise UsageError("fxpipe.compile: the model has tensors on the meta device (no values "
                         "to train); build it with real weights (fxpipe.plan takes a meta "
                         "model, compile needs the real one)")
    plan, spec, to_plan = _as_plan(spec_or_plan)
    if not allow_async and (spec.train.updates == "async" or (
            plan is not None and plan.parameter_servers)):
        raise UsageError(ASYNC_REFUSED)  # before joining: every rank refuses alike
    timeout = float(timeout_s if timeout_s is not None else spec.train.timeout_s)
    world = spec.cluster.world_size if to_plan else plan.world_size
    device = _join(spec, world, timeout)
    model.train()
    model.to(device)
    if to_plan:
        plan = _plan_on_rank0(model, spec, example_inputs, example_kwargs)
    else:
        _same_plan_everywhere(plan)
    layout = getattr(plan, "placement", None)  # how the grid lies on the ranks, when planned
    servers = len(plan.parameter_servers)  # train.updates: async
    mesh = Mesh(plan.pipeline, plan.replicas, device=device, timeout_s=timeout,
                servers=servers, tensor=plan.tensor, expert=plan.expert, context=plan.context,
                **({"layout": layout} if layout is not None else {}))
    if mesh.is_server:  # this rank keeps parameters and optimizer state, no stage
        return ServerShare(model, plan, spec, mesh, mesh.server_group)
    traced = trace_for_plan(plan, model, device)  # resolves a plan made of repeated blocks,
    schedule = schedule_for_plan(plan)  # so the schedule gets the sends of its stage edges
    stages = build_stages(plan, traced, schedule.stages_of_rank(mesh.pipe_rank))
    t = spec.train
    model_loss = loss_fn is None and t.loss == MODEL_LOSS
    count = batch_counter(plan.model_inputs, plan.input_kwargs, t.ignore_index,
                          target_counter(traced.gm) if model_loss else None, model_loss)
    loss = loss_fn if loss_fn is not None else resolve_loss(t.loss, t.ignore_index)
    run_plan = plan  # the plan as this rank runs it (values split along the sequence: local)
    if plan.context > 1:  # this rank's share of every sequence (fxpipe.context)
        from fxpipe.runtime.context_parallel import split_sequences

        stages, loss, run_plan = split_sequences(
            plan, traced.gm, stages, mesh, loss, t.loss if loss_fn is None else None,
            model_loss, t.ignore_index)
    del traced
    shards = None
    if plan.tensor > 1:  # this rank's shards of its stages (fxpipe.tensor)
        from fxpipe.runtime.tensor_parallel import shard_stages

        stages, shards, vocab = shard_stages(
            plan, stages, mesh, None if loss_fn is not None or model_loss else t.loss,
            t.ignore_index)
        loss = vocab if vocab is not None else loss
    if plan.expert > 1:  # this rank's experts of its stages (fxpipe.experts)
        from fxpipe.runtime.expert_parallel import ShardSet, shard_expert_stages

        stages, experts = shard_expert_stages(stages, mesh)
        shards = ShardSet(shards, experts)
    executor = PipelineExecutor(run_plan, schedule, stages, mesh, loss, None, timeout_s=timeout,
                                grad_compression=Compression.from_train(t),
                                precision=t.precision, needs_target=not model_loss,
                                sync_gradients=not servers,
                                fuse_grad_accumulation=t.fuse_grad_accumulation,
                                data_sharding=plan.data_sharding,
                                compile=resolve_compile(t.compile, t.cuda_graphs, device),
                                fp8_config=_fp8_config(t, device))
    k = grad_accumulation if grad_accumulation is not None else t.grad_accumulation
    if not isinstance(k, int) or k < 1:
        raise UsageError(f"fxpipe.compile: grad_accumulation must be a positive integer, got {k!r}")
    pipe = CompiledPipeline(model, plan, spec, mesh, stages, executor, count, k, model_loss,
                            shards)
    if servers:  # the weights come from the servers at every step's pull
        from fxpipe.runtime.parameter_server import ParameterClient

        canonical = {plan.param_aliases.get(n, n): p for m in stages.values()
                     for n, p in m.named_parameters(remove_duplicate=False)}
        pipe.client = ParameterClient(plan, mesh, canonical, timeout, mesh.server_group)
    elif broadcast_weights:
        _broadcast_weights(pipe)
    if executor.sharding is not None:  # the slices of the weights every replica now has
        executor.sharding.refresh_master()
    return pipe
