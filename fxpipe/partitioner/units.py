"""The trace and price passes: :class:`PricedUnits` traces the model as a worker on the spec's
device traces it (itself, or a fake copy; two of its repeated blocks when it folds), at a
micro-batch size, and prices it (:class:`~fxpipe.partitioner.pricing.Priced`) at each tensor
degree, each once."""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Any

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor

from fxpipe.partitioner.blocks import check_run, find_block_run, fold, reduced
from fxpipe.partitioner.context_costs import (context_comm, context_link, context_priced,
                                              context_split, scaled_loss)
from fxpipe.partitioner.cost import price
from fxpipe.partitioner.expert_costs import (expert_link, expert_priced, expert_regions,
                                             with_all_to_alls)
from fxpipe.partitioner.graph import build_graph
from fxpipe.partitioner.loss_cost import loss_node
from fxpipe.partitioner.pricing import (Priced, at_degree, node_seconds, rebuilt_values,
                                        send_cost_of, spec_ridge, tensor_inputs)
from fxpipe.partitioner.trace import fake_on_device, trace
from fxpipe.specs.schema import ParallelSpec

_progress = logging.getLogger("fxpipe.progress")


def resize(t: Any, size: int) -> Any:
    """A tensor with dim 0 resized to ``size`` (repeating or slicing); other values as they are."""
    if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] == size:
        return t
    if t.shape[0] > size:
        return t[:size]
    reps = -(-size // t.shape[0])
    return t.repeat(reps, *([1] * (t.dim() - 1)))[:size]

def _byte_scale(spec: ParallelSpec) -> float:
    """Bytes of a value as the run holds it per byte as traced (fp32): half under bf16/fp16."""
    return 0.5 if spec.train.precision in ("bf16", "fp16", "fp8") else 1.0


def is_fake(model: nn.Module) -> bool:
    return any(isinstance(t, FakeTensor) for t in [*model.parameters(), *model.buffers()])

def _model_device(model: nn.Module) -> str:
    for t in [*model.parameters(), *model.buffers()]:
        return t.device.type
    return "cpu"

def tracing_model(model: nn.Module, args: tuple, kwargs: dict, device: str
                  ) -> tuple[nn.Module, tuple, dict, str]:
    """What to trace so that the graph is the one a worker on ``device`` traces: the model
    itself when it already lives there, else a fake copy on ``device`` (:func:`fake_on_device`;
    a meta model costs no memory), or on meta when ``device`` is CUDA and this machine has none
    (the workers then check the graph and explain a difference). Returns the model, inputs and
    the device type traced on."""
    here = _model_device(model)
    if device == "cuda" and not torch.cuda.is_available():
        if here == "cuda":  # pragma: no cover - a CUDA model without CUDA cannot exist
            return model, args, kwargs, here
        meta = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        fake, fargs, fkw = fake_on_device(model, tuple(a.to("meta") for a in args), meta, "meta")
        return fake, fargs, fkw, "meta"
    if here == device:
        return model, tuple(a.to(device) for a in args), {
            k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}, device
    fake, fargs, fkw = fake_on_device(model, args, kwargs, device)
    return fake, fargs, fkw, device

def warn_again(caught: list) -> None:
    """Issue again the warnings that ``warnings.catch_warnings(record=True)`` held back."""
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


class PricedUnits:
    """The model's planning units priced at a micro-batch size and a tensor degree, each
    traced and priced once (the trace pass, then the price pass).

    A model with a run of identical blocks is traced with two of them and planned as blocks
    when the graph repeats block by block (checked once on the full model); else it is traced
    whole, and :attr:`notes` says why it was not folded.

    Attributes:
        model: the model as given. args, kwargs: one micro-batch of its example inputs.
        notes: lines for the plan's explanation (why a run of blocks was not folded).
    """

    def __init__(self, model: nn.Module, args: tuple, kwargs: dict, spec: ParallelSpec):
        self.model, self.args, self.kwargs, self.spec = model, tuple(args), dict(kwargs), spec
        self.run = find_block_run(model)
        self.notes: list[str] = []
        self._tracers: dict[bool, tuple] = {}
        self._at_size: dict[int, Priced] = {}
        self._at_both: dict[tuple[int, int], Priced] = {}
        # the two-block trace's warnings are about the model only where the fold stands (a
        # pipe_split() after block 1 is "after the last computation" of two blocks); else the
        # full trace is planned and warns for itself
        self._held_back: list = []
        self._checked = False  # the full model ran once and repeats as the fold assumes

    def tracing(self, short: bool) -> tuple[nn.Module, tuple, dict, str]:
        """The model to trace, its inputs and the device type traced on (a fake copy on the
        device, of the shortened model when folding: copying 96 blocks' tensors costs
        seconds, two of them nothing)."""
        if short not in self._tracers:
            with reduced(self.model, self.run) if short else contextlib.nullcontext():
                m, a, kw, on = tracing_model(self.model, self.args, self.kwargs,
                                             self.spec.cluster.device)
            self._tracers[short] = (m, tuple(a), kw, on)
        return self._tracers[short]

    def _price(self, size: int, short: bool) -> Priced:
        spec = self.spec
        m, args_, kwargs_, on = self.tracing(short)
        real = None if on == "meta" or is_fake(m) else m
        a = tuple(resize(x, size) for x in args_)
        kw = {k: resize(v, size) for k, v in kwargs_.items()}
        same = m is self.model and short  # shortening a model traced as it is: swap its blocks
        with reduced(m, self.run) if same else contextlib.nullcontext():
            _progress.info("tracing %s%s at micro-batch %d", type(m).__name__,
                           " (two of its repeated blocks)" if short else "", size)
            traced = trace(m, a, spec.model.tracer, example_kwargs=kw, output=spec.loss_output)
            _progress.info("pricing %d nodes", len(traced.gm.graph.nodes))
            costs = price(traced)
            split, cp_moved = None, None
            if spec.parallel.context > 1:  # this rank's share of every sequence
                split = context_split(traced.gm, spec.parallel.context,
                                      ring=spec.parallel.context_attention == "ring")
                costs, frac = context_priced(traced.gm, costs, split)
            times, loss = node_seconds(traced, costs, spec, real, tensor_inputs(a, kw))
            if split is not None:
                if spec.cluster.costs != "analytic":  # measured whole: each node's share
                    times = {n: x.scaled(frac.get(n, 1.0)) for n, x in times.items()}
                else:  # the loss reads this rank's share of the logits
                    at = loss_node(traced, costs)
                    times, loss = scaled_loss(times, at, loss, frac.get(at, 1.0))
                cp_comm, cp_moved = context_comm(traced.gm, split, times, context_link(spec),
                                                 _byte_scale(spec))
                times = with_all_to_alls(times, cp_comm)
            moved, comm, expert_held = None, {}, {}
            if spec.parallel.expert > 1:  # this rank's experts, the all-to-alls
                n = spec.parallel.expert
                regions = expert_regions(traced.gm, n, type(self.model).__name__)
                costs, comm, moved, expert_held = expert_priced(
                    traced.gm, costs, regions, n, expert_link(spec), _byte_scale(spec))
                times = with_all_to_alls(times, comm)
        with warnings.catch_warnings(record=True) as held:
            warnings.simplefilter("always")
            pg = build_graph(traced, costs)
        pr = Priced(traced, costs, times, pg, rebuilt_values(pg, spec), send_cost_of(spec),
                    size, loss=loss,
                    loss_at=loss_node(traced, costs) if loss.total_s > 0 else None,
                    ridge=spec_ridge(spec))
        pr.expert_bytes, pr.expert_comm, pr.expert_params = moved, comm, expert_held
        pr.context_split, pr.context_bytes = split, cp_moved
        if short:
            pr.table = fold(pg, self.run, pr.table.times, pr.cheap, pr.table.selective,
                            pr.costs)
            self._held_back[:] = held  # said only where the fold stands (see _priced)
        else:
            warn_again(held)
        return pr

    def _priced(self, size: int) -> Priced:
        run = self.run
        if run is not None:
            pr = self._price(size, True)
            why = None if pr.table is not None else (
                "the graph between them does not repeat block by block (a block's value read "
                "by a later block, the parent's nodes between blocks that differ or hold "
                "parameters, or pipe_split()/annotate() in the run)")
            if why is None and not self._checked:
                _progress.info("checking that the model's %d blocks repeat", run.count)
                why = check_run(self.model, run, tuple(resize(x, 1) for x in self.args),
                                {k: resize(v, 1) for k, v in self.kwargs.items()})
                self._checked = why is None
            if why is None:
                warn_again(self._held_back)
                return pr
            self.notes.append(
                f"not planned as blocks: {run.count} identical {run.prefix or 'top-level '}* "
                f"blocks were found, but {why}; planned node by node, which takes longer for "
                "deep models")
            self.run = None  # the full model does not fold: plan node by node
        return self._price(size, False)

    def at(self, size: int, t: int = 1) -> Priced:
        """The units traced at ``size`` samples per micro-batch, priced at tensor degree
        ``t`` (:func:`~fxpipe.partitioner.pricing.at_degree`)."""
        if size not in self._at_size:
            self._at_size[size] = self._priced(size)
        if (size, t) not in self._at_both:
            self._at_both[(size, t)] = at_degree(self._at_size[size], self.spec, t)
        return self._at_both[(size, t)]
