"""One stage on this rank: its module, its parameters, and each micro-batch's F / B / W state.

A :class:`StageWork` runs the compute actions of one (virtual) stage and keeps what a
micro-batch needs between them: the received float inputs (autograd leaves), the outputs, the
loss (on the stage that computes it), the gradients of its outputs as they arrive from the
stages that read them, and, after a split B, what W still has to do
(:mod:`fxpipe.runtime.backward_split`). It knows nothing of ranks or communication: the
executor (:mod:`fxpipe.runtime.executor`) feeds it inputs and routes what it returns.

An output that only other ranks read stops being held once it is sent (:meth:`StageWork.sent`,
Megatron-LM's ``deallocate_output_tensor``): the stage keeps where its backward enters the
output's graph (a ``GradientEdge``), not the output's data, and B starts there; only the
send's own alias (:mod:`fxpipe.runtime.p2p`) keeps the storage until the send completes. A
gradient arriving for such an output is checked against the plan's shape and dtype here, and
by autograd against the graph's own record of the output (never against the tensor's shape).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from fxpipe.errors import RuntimeFailure, ScheduleError
from fxpipe.plans.plan import StagePlan
from fxpipe.plans.values import ValueInfo, needs_grad
from fxpipe.runtime.backward_split import WeightWork, backward_input, backward_weight
from fxpipe.runtime.offload import Offload
from fxpipe.runtime.partial_recompute import Partial, PartialReplay, backward_weights
from fxpipe.runtime.recompute import Replay, forward_keeping_inputs, replay


@dataclass
class _Microbatch:
    """Saved state of one micro-batch between its forward and its last backward."""

    leaves: list[tuple[str, torch.Tensor]]  # received float inputs (autograd leaves)
    outs: dict[str, torch.Tensor | Sent]  # (a sent output: its graph edge only)
    loss: torch.Tensor | None
    grads: dict[str, torch.Tensor]  # gradient of each output, summed over its consumers
    grad_counts: dict[str, int]
    pending_w: WeightWork | list[WeightWork] | None = None  # after a split B: what W needs
    replay: Replay | PartialReplay | None = None  # a recomputing stage: its second forward's
    loss_leaf: torch.Tensor | None = None  # ... and the output its loss read (a leaf)
    sends: dict[str, int] | None = None  # sent output -> sends still to come before release


@dataclass(frozen=True)
class Sent:
    """An output sent to other ranks whose data the stage no longer holds (:meth:`StageWork.
    sent`): its dtype, and where B enters its graph (None: it takes no gradient)."""

    dtype: torch.dtype
    edge: GradientEdge | None

    @property
    def requires_grad(self) -> bool:
        return self.edge is not None


def _root(t: torch.Tensor | Sent) -> torch.Tensor | GradientEdge:
    """What B starts from for an output: the tensor, or a sent one's graph edge."""
    return t.edge if isinstance(t, Sent) else t


def trainable_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The module's parameters that require gradients, each once (tied ones deduplicated)."""
    out, seen = [], set()
    for p in module.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


class StageWork:
    """Forward, backward and weight-gradient work of one stage, micro-batch by micro-batch.

    Args:
        plan_stage: the stage's :class:`~fxpipe.plans.plan.StagePlan` (inputs, outputs).
        module: ``module(*inputs) -> tuple(outputs)`` in ``plan_stage`` order.
        values: the plan's values (shape and dtype per micro-batch of what is sent).
        consumers: value name -> stages that read it (how many gradients to wait for).
        split_backward: B computes input gradients only and W the weight gradients.
        autocast: a factory of the autocast context for the forward and the loss.
        context: a factory of the text naming (stage, micro-batch) for error messages.
        loss_input: on the stage that computes the loss, the name of the output it reads (the
            model's output); None elsewhere.

    Attributes:
        release_after: output name -> how many sends (one per consumer stage) after which the
            stage stops holding its data (:meth:`sent`), for the outputs read only by stages
            of other ranks; set by the executor (empty: every output held until B).
        released: outputs whose data the stage let go of once sent, over all steps.
    """

    def __init__(self, plan_stage: StagePlan, module: nn.Module, values: dict[str, ValueInfo],
                 consumers: dict[str, list[int]], split_backward: bool,
                 autocast: Callable[[], AbstractContextManager],
                 context: Callable[[int], str], loss_input: str | None = None):
        self.plan_stage, self.module, self.index = plan_stage, module, plan_stage.index
        self.loss_input = loss_input
        self.params = trainable_parameters(module)
        self._values, self._consumers = values, consumers
        self._dtypes = {n: getattr(torch, v.dtype) for n, v in values.items()}
        self._split, self._autocast, self._ctx = split_backward, autocast, context
        self._mb: dict[int, _Microbatch] = {}
        self.peak = 0  # micro-batches held at once this step
        self.release_after: dict[str, int] = {}
        self.released = 0
        self.offload = Offload(module) if plan_stage.offload_bytes else None
        #: per-block parameter gathering (:class:`~fxpipe.runtime.block_gather.BlockGather`,
        #: whose rewritten module this is), set by the executor; None: parameters stay whole
        self.gather = None
        # partial recomputation: the stage's first recompute_blocks blocks recompute
        self.partial = (Partial(module, plan_stage.recompute_blocks, plan_stage.index)
                        if plan_stage.recompute and plan_stage.keep_ridge is None
                        and plan_stage.recompute_blocks > 0 else None)

    # ------------------------------------------------------------------ bookkeeping
    @property
    def inflight(self) -> int:
        """Micro-batches whose activations are held (forward done, last backward not)."""
        return len(self._mb)

    def reset(self) -> None:
        """Forget the last step's micro-batches and peak."""
        self._mb.clear()
        self.peak = 0

    def leftovers(self) -> list[int]:
        """Micro-batches still held (after a step: the schedule missed their backward)."""
        return sorted(self._mb)

    # ------------------------------------------------------------------ F
    def forward(self, i: int, args: list[torch.Tensor], loss_fn: Callable | None = None,
                target: torch.Tensor | None = None, scale: float | None = None
                ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        """Forward of micro-batch ``i`` on ``args`` (in ``plan_stage.inputs`` order; received
        float inputs must already be autograd leaves). On the loss stage, also the loss
        ``loss_fn(outputs[loss_input], target)`` (``scale``: loss-scaling factor for the
        backward).

        Returns the outputs by name (cast back to their plan dtype when autocast changed it) and
        the unscaled loss (detached), or None.

        Raises:
            RuntimeFailure: the module returned a wrong number of values, or values whose shape or
                dtype differ from the plan (say, another sequence length than planned).
        """
        sp = self.plan_stage
        leaves = [(n, t) for n, t in zip(sp.inputs, args) if t.requires_grad and t.is_leaf]
        rep = None
        with self._autocast(), self._gathering(args):
            if self.partial is not None and torch.is_grad_enabled():  # the head's inputs
                out, rep = self.partial.forward(args)
            elif sp.recompute and torch.is_grad_enabled():  # keep the inputs, recompute in B
                out, rep = forward_keeping_inputs(self.module, args, sp.keep_ridge)
            elif self.offload is not None and torch.is_grad_enabled() and self.gather is None:
                with self.offload.saving(args):  # (with gathering: composed in _gathering)
                    out = self.module(*args)
            else:
                out = self.module(*args)
            outs = self._outputs(i, out)
        loss = shown = leaf = None
        if self.loss_input is not None:
            read = outs[self.loss_input]
            if (isinstance(rep, Replay)  # the loss's own graph is kept
                    and read.dtype.is_floating_point):
                read = leaf = read.detach().requires_grad_()
            with self._autocast():
                loss = loss_fn(read, target)
            if loss is not None:
                shown = loss.detach().to(torch.promote_types(loss.dtype, torch.float32))
                if scale is not None:  # the backward starts from the scaled loss
                    loss = loss.float() * scale
        self._mb[i] = _Microbatch(leaves, outs, loss, {}, {}, replay=rep, loss_leaf=leaf)
        self.peak = max(self.peak, len(self._mb))
        return outs, shown

    def _gathering(self, args: list[torch.Tensor]):
        """Per-block gathering: the forward's saved-tensor hooks (activation offload's inside
        them), so the backward gathers a group again when it reads its parameters."""
        if self.gather is None or not torch.is_grad_enabled():
            return nullcontext()
        return self.gather.saving(self.offload.hooks(args) if self.offload is not None else None)

    @contextmanager
    def _gathered_backward(self, weights: bool):
        """Per-block gathering around one backward call (``weights``: it computes weight
        gradients): replays tokenise what they save, groups are reduce-scattered and freed."""
        if self.gather is None:
            yield
            return
        with self.gather.saving(), self.gather.backward(weights):
            yield

    def _outputs(self, i: int, out) -> dict[str, torch.Tensor]:
        """The stage module's return value by output name, cast to the plan dtypes and checked
        against the plan's shapes."""
        sp = self.plan_stage
        if isinstance(out, torch.Tensor):
            out = (out,)
        if not isinstance(out, (tuple, list)) or len(out) != len(sp.outputs):
            raise RuntimeFailure(
                f"{self._ctx(i)}: the stage module returned "
                f"{len(out) if isinstance(out, (tuple, list)) else type(out).__name__} values but "
                f"the plan lists {len(sp.outputs)} outputs {sp.outputs}; build the stage modules "
                "from this plan")
        outs = {name: self._to_plan_dtype(name, t) for name, t in zip(sp.outputs, out)}
        self._check_outputs(i, outs)
        return outs

    def _to_plan_dtype(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """Cast an output that other stages read to its plan dtype (autocast may have made it
        16-bit); differentiable, so its gradient comes back in the plan dtype as well."""
        want = self._dtypes.get(name)
        if (want is None or name not in self._consumers or not isinstance(t, torch.Tensor)
                or t.dtype == want or not (t.dtype.is_floating_point and want.is_floating_point)):
            return t
        return t.to(want)

    def _check_outputs(self, i: int, outs: dict[str, torch.Tensor]) -> None:
        for name, t in outs.items():
            info = self._values.get(name)
            if info is not None and name in self._consumers and (
                    list(t.shape) != list(info.shape) or t.dtype != self._dtypes[name]):
                raise RuntimeFailure(
                    f"{self._ctx(i)}: value {name!r} is {tuple(t.shape)} {t.dtype} but the plan "
                    f"says {tuple(info.shape)} {info.dtype} per micro-batch; re-plan with the "
                    "batch size and sequence length used for training")

    def output(self, i: int, name: str) -> torch.Tensor:
        """Output ``name`` of micro-batch ``i`` (to send or hand over).

        Raises:
            ScheduleError: micro-batch ``i`` has not run its forward, or the output was sent
                to every stage that reads it already (its data released).
        """
        mb = self._mb.get(i)
        if mb is None:
            raise ScheduleError(f"{self._ctx(i)}: send before the stage's forward")
        out = mb.outs[name]
        if isinstance(out, Sent):
            raise ScheduleError(f"{self._ctx(i)}: {name!r} was sent to each of its "
                                f"{self.release_after.get(name, 0)} consumer stages already "
                                "(its data released); a schedule sends it once per consumer")
        return out

    def sent(self, i: int, name: str) -> None:
        """Output ``name`` of micro-batch ``i`` was handed to a send (which keeps its own alias
        of the data until it completes). After the last of its ``release_after[name]`` sends
        the stage keeps only where B enters the output's graph, not its data (Megatron-LM's
        ``deallocate_output_tensor``); the loss's input, outputs read on this rank and
        outputs that are autograd leaves (an input passed on, held as the input anyway) are
        never listed in ``release_after`` / never released."""
        mb = self._mb.get(i)
        want = self.release_after.get(name)
        if mb is None or want is None or name == self.loss_input:
            return
        if mb.sends is None:
            mb.sends = {}
        left = mb.sends.get(name, want) - 1
        mb.sends[name] = left
        out = mb.outs[name]
        if left > 0 or isinstance(out, Sent):
            return
        if out.requires_grad and out.grad_fn is None:  # a leaf: held as the input anyway
            return
        mb.outs[name] = Sent(out.dtype, get_gradient_edge(out) if out.requires_grad else None)
        self.released += 1

    # ------------------------------------------------------------------ gradients in
    def add_output_grad(self, i: int, name: str, g: torch.Tensor) -> None:
        """Add one consumer's gradient of output ``name`` of micro-batch ``i``.

        Raises:
            ScheduleError: the gradient arrived before the forward.
        """
        mb = self._mb.get(i)
        if mb is None:
            raise ScheduleError(f"gradient of {name!r} for stage {self.index} micro-batch {i} "
                                "arrived before that stage's forward")
        info = self._values.get(name)
        if info is not None and (list(g.shape) != list(info.shape)
                                 or g.dtype != self._dtypes[name]):
            raise RuntimeFailure(
                f"{self._ctx(i)}: the gradient of {name!r} is {tuple(g.shape)} {g.dtype} but "
                f"the plan says {tuple(info.shape)} {info.dtype} per micro-batch for the value; "
                "every stage must run from this plan")
        mb.grads[name] = g if name not in mb.grads else mb.grads[name] + g
        mb.grad_counts[name] = mb.grad_counts.get(name, 0) + 1

    def _outputs_and_grads(self, i: int, mb: _Microbatch):
        """The tensors B starts from and their gradients: the loss (on the loss stage) and
        every output other stages read. A recomputing micro-batch runs its forward again
        first (:func:`~fxpipe.runtime.recompute.replay`) and starts from that forward's
        outputs, the loss's gradient arriving at the output it read."""
        outs, loss_grad = mb.outs, None
        tensors, grads = [], []
        full = isinstance(mb.replay, Replay)  # (a partial one keeps the tail's graph)
        if full:
            if mb.loss is not None and mb.loss_leaf is not None:
                loss_grad = torch.autograd.grad(mb.loss, [mb.loss_leaf], allow_unused=True)[0]
        elif mb.loss is not None:
            tensors.append(mb.loss)
            grads.append(None)
        wanted = []
        for name, out in mb.outs.items():
            consumers = self._consumers.get(name, [])
            if not consumers or not needs_grad(out.dtype):
                continue
            if mb.grad_counts.get(name, 0) != len(consumers):
                raise ScheduleError(
                    f"{self._ctx(i)}: backward started with {mb.grad_counts.get(name, 0)} of "
                    f"{len(consumers)} gradients of {name!r} (consumers: stages {consumers}); a "
                    "RECV_B or a consumer's B must come before this B")
            wanted.append(name)
        if full:
            with self._autocast():
                outs = self._outputs(i, replay(self.module, mb.replay))
            mb.replay = None
        for name in wanted:
            g = mb.grads[name]
            if name == self.loss_input and loss_grad is not None:
                g, loss_grad = g + loss_grad, None
            if outs[name].requires_grad:  # (a sent output: its graph edge)
                tensors.append(_root(outs[name]))
                grads.append(g)
        if loss_grad is not None and outs[self.loss_input].requires_grad:
            tensors.append(outs[self.loss_input])
            grads.append(loss_grad)
        if not tensors and self.gather is not None and self.loss_input in outs and \
                outs[self.loss_input].requires_grad:  # a loss of weight 0: the backward runs
            tensors.append(outs[self.loss_input])     # on zeros, so every replica gathers
            grads.append(torch.zeros_like(outs[self.loss_input]))  # and reduces alike
        return tensors, grads

    # ------------------------------------------------------------------ B and W
    def backward(self, i: int) -> list[tuple[str, torch.Tensor]]:
        """Backward of micro-batch ``i``: full, or input gradients only when the backward is
        split. Returns ``(input name, gradient)`` for every received float input (zeros where
        the input did not influence the outputs); frees the micro-batch unless W is pending.

        Raises:
            ScheduleError: no forward for ``i`` (or B twice), or gradients still missing.
        """
        mb = self._mb.get(i)
        if mb is None or mb.pending_w is not None:
            raise ScheduleError(f"{self._ctx(i)}: backward before forward (or twice)")
        with self._gathered_backward(not self._split):
            return self._backward(i, mb)

    def _backward(self, i: int, mb: _Microbatch) -> list[tuple[str, torch.Tensor]]:
        tensors, grads = self._outputs_and_grads(i, mb)
        names = [n for n, _ in mb.leaves]
        leaves = [t for _, t in mb.leaves]
        if isinstance(mb.replay, PartialReplay):  # the tail's backward, the head again, its
            rep, mb.replay = mb.replay, None      # backward
            in_grads, mb.pending_w = self.partial.backward(
                rep, tensors, grads, leaves, self.params, self._split, self._autocast)
            if not self._split:
                del self._mb[i]
            else:
                mb.leaves = []
        elif not self._split:
            if tensors:
                torch.autograd.backward(tensors, grads)
            in_grads = [t.grad for t in leaves]
            del self._mb[i]  # frees the micro-batch's activations
        else:
            in_grads, mb.pending_w = backward_input(tensors, grads, leaves, self.params)
            mb.leaves = []
        return [(n, g if g is not None else torch.zeros_like(t))
                for n, t, g in zip(names, leaves, in_grads)]

    def weight(self, i: int) -> None:
        """Weight gradients of micro-batch ``i`` after its split B; frees the micro-batch.

        Raises:
            ScheduleError: W before its B.
        """
        mb = self._mb.get(i)
        if mb is None or mb.pending_w is None:
            raise ScheduleError(f"{self._ctx(i)}: W before its B")
        with self._gathered_backward(True):
            if isinstance(mb.pending_w, list):  # partial recomputation: the tail's, the head's
                backward_weights(mb.pending_w)
            else:
                backward_weight(mb.pending_w)
        del self._mb[i]
