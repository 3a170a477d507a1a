"""Price every node of a traced graph: FLOPs (forward, backward), output, parameter and saved bytes.

Everything runs on fake tensors (``torch._subclasses.FakeTensorMode``): no real compute, no weight
memory, so a model built on the meta device can be priced.

Method (per FX compute node, in graph order, through a ``torch.fx.Interpreter``):

* **Forward FLOPs**: ``torch.utils.flop_counter.FlopCounterMode`` stacked above the fake mode; the
  node's count is the counter's increase while the node runs. Like the counter, only matmul-like
  work is counted (mm/addmm/bmm/conv/attention: 2 FLOPs per multiply-accumulate); element-wise
  ops, norms and softmax count 0. Formulas the counter lacks in torch 2.13 are added
  (:data:`EXTRA_FORMULAS`): the CPU fused attention kernel
  ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ backward), and the fused inference fast
  paths ``aten._native_multi_head_attention`` and ``aten._transformer_encoder_layer_fwd``.
  Tracing and pricing also run with grad enabled, which keeps ``nn.MultiheadAttention`` /
  ``nn.TransformerEncoderLayer`` off those fast paths in the first place.
* **Backward FLOPs** (source ``"autograd"``): for each node with forward FLOPs, the counter
  measures ``torch.autograd.grad`` of the node's output with respect to (a) its activation inputs
  that require grad -> input-gradient FLOPs (the ``B`` pass of zero-bubble schedules), and (b) its
  parameters -> weight-gradient FLOPs (``W``). Only that node's backward runs (autograd executes
  just the graph between the output and the requested inputs). When autograd cannot differentiate
  the op (source ``"ratio"``), backward = ``backward_ratio`` x forward, split 1:1 between input and
  weight gradients when the node has parameters (the usual 2x-forward rule for matmul layers,
  Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", SC 2021).
* **Saved bytes**: the tensors autograd saves for backward while the node runs (recorded with
  ``torch.autograd.graph.saved_tensors_hooks``), counted by storage, each storage once overall
  (first node that saves it), parameters and buffers excluded. An estimate of the activation
  memory a micro-batch keeps alive between its forward and backward.
* **Matmul-like ops** (``ops``): each ATen op with a FLOP formula the node runs, its FLOPs and
  output bytes, recorded by a dispatch mode (what selective recomputation decides on).
* **Parameter bytes**: each parameter (by canonical FQN, tied tensors deduplicated) is charged
  once, to the first node in graph order that reads it.

All counts are for the example inputs the model was traced with (one micro-batch).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from fxpipe.execution.fp8 import fp8_weight
from fxpipe.execution.op_flops import EXTRA_FORMULAS, has_flops, op_flops
from fxpipe.execution.selective import out_bytes
from fxpipe.partitioner.trace import COMPUTE_OPS, FakeInterpreter, TracedModel

__all__ = ["NodeCost", "price", "seconds", "transfer_seconds", "value_bytes", "EXTRA_FORMULAS"]

aten = torch.ops.aten


@dataclass
class NodeCost:
    """Cost of one FX node for one micro-batch.

    Attributes:
        fwd_flops: forward FLOPs (matmul-like work, 2 per multiply-accumulate).
        bwd_flops: backward FLOPs, input-gradient plus weight-gradient.
        bwd_weight_flops: the weight-gradient part of ``bwd_flops``.
        out_bytes: bytes of the node's output value(s) (a tuple output summed; 0 for non-tensors).
        param_bytes: bytes of parameters charged to this node (each parameter once overall, to
            its first user).
        saved_bytes: bytes of activations autograd keeps for backward (estimate, see module doc).
        buffer_bytes: bytes of buffers charged to this node (first user), e.g. BatchNorm stats.
        bwd_source: ``"autograd"`` (measured), ``"ratio"`` (backward_ratio x forward) or
            ``"none"`` (no forward FLOPs, so no backward FLOPs counted).
        in_bytes: bytes of the tensors the node reads (activations and parameters).
        input_grad / weight_grad: whether the node's backward computes gradients of activation
            inputs / of parameters.
        moves_memory: False for views (the output aliases an input: ``view``, ``permute``,
            ``expand``, ``getitem``...), which read and write nothing.
        attn_scores: for a fused attention op (``scaled_dot_product_attention`` and its
            kernels), the elements of its score matrix (batch x heads x query length x key
            length), which a math-path kernel writes and reads and a flash kernel never
            stores; 0 for every other op. Read only by the GPU model
            (:mod:`fxpipe.partitioner.gpu_model`).
        attn_causal: the attention op masks causally (a flash kernel skips the masked half).
        ops: ``(FLOPs, output bytes)`` of each matmul-like ATen op the node runs (those with a
            FLOP formula, :mod:`fxpipe.execution.op_flops`): what selective recomputation
            keeps or recomputes (:func:`selective`); every other op it recomputes.
        saved_by: the node whose ``saved_bytes`` count this node's output (the first node
            that saves its storage for backward), ``""`` when none saves it (what partial
            recomputation reads: a value its kept part saves is counted there already).
        fp8_shape: for a weight matmul ``train.precision: fp8`` may run in float8
            (:func:`fxpipe.execution.fp8.fp8_weight`), its weight's shape on one rank (a
            tensor-parallel shard's after :func:`fxpipe.partitioner.tensor_costs.scaled_costs`);
            the GPU model prices it at the FP8 rate where the shape qualifies.
    """

    fwd_flops: int = 0
    bwd_flops: int = 0
    bwd_weight_flops: int = 0
    out_bytes: int = 0
    param_bytes: int = 0
    saved_bytes: int = 0
    buffer_bytes: int = 0
    bwd_source: str = "none"
    in_bytes: int = 0
    input_grad: bool = False
    weight_grad: bool = False
    moves_memory: bool = True
    attn_scores: int = 0
    attn_causal: bool = False
    ops: tuple[tuple[float, float], ...] = ()
    saved_by: str = ""
    fp8_shape: tuple[int, ...] | None = None

    def selective(self, ridge: float) -> tuple[float, bool]:
        """Under selective recomputation at ``ridge`` (:mod:`fxpipe.execution.selective`):
        the bytes of this node's kept outputs per micro-batch, and whether its forward runs
        again (no op of it kept)."""
        kept = sum(b for f, b in self.ops if b > 0 and f >= ridge * b)
        return float(kept), not any(b > 0 and f >= ridge * b for f, b in self.ops)

    @property
    def bwd_input_flops(self) -> int:
        """Input-gradient FLOPs: ``bwd_flops - bwd_weight_flops``."""
        return self.bwd_flops - self.bwd_weight_flops


# ---------------------------------------------------------------------------------------------
# helpers


def value_bytes(v: Any) -> int:
    """Bytes of a value: a tensor's ``numel * element_size``, tuples/lists/dicts summed, else 0."""
    total = 0
    for leaf in pytree.tree_leaves(v):
        if isinstance(leaf, torch.Tensor):
            total += int(leaf.numel()) * leaf.element_size()
    return total


def seconds(flops: float, device_tflops: float, efficiency: float = 1.0) -> float:
    """Compute time in seconds: ``flops / (device_tflops * 1e12 * efficiency)``.

    Args:
        flops: floating-point operations.
        device_tflops: the device's peak rate in TFLOP/s (e.g. 989 for H100 dense BF16).
        efficiency: achieved fraction of peak, in (0, 1].

    Raises:
        ValueError: non-positive rate or efficiency outside (0, 1], negative flops.
    """
    if not device_tflops > 0:
        raise ValueError(f"device_tflops={device_tflops!r} must be > 0 (TFLOP/s of one device)")
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency={efficiency!r} must be in (0, 1] (fraction of peak)")
    if flops < 0:
        raise ValueError(f"flops={flops!r} must be >= 0")
    return float(flops) / (device_tflops * 1e12 * efficiency)


def transfer_seconds(nbytes: float, GBps: float, latency_s: float = 0.0) -> float:  # noqa: N803
    """Point-to-point transfer time in seconds: ``latency_s + nbytes / (GBps * 1e9)``.

    No bytes means no message: 0 bytes take 0 s (no latency charged).

    Args:
        nbytes: bytes sent.
        GBps: link bandwidth in GB/s (10^9 bytes per second), one direction.
        latency_s: fixed per-message latency in seconds.

    Raises:
        ValueError: non-positive bandwidth, negative bytes or latency.
    """
    if not GBps > 0:
        raise ValueError(f"GBps={GBps!r} must be > 0 (link bandwidth in GB/s)")
    if nbytes < 0 or latency_s < 0:
        raise ValueError(f"nbytes={nbytes!r} and latency_s={latency_s!r} must be >= 0")
    if nbytes == 0:
        return 0.0
    return latency_s + float(nbytes) / (GBps * 1e9)


# ---------------------------------------------------------------------------------------------
# the pricing interpreter


class _OpRecorder(TorchDispatchMode):
    """Records ``(FLOPs, output bytes)`` of every matmul-like op into the node the pricer
    is running forward (not its backward's re-runs)."""

    def __init__(self, pricer: "_Pricer"):
        super().__init__()
        self.pricer = pricer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        cost = self.pricer._current
        if cost is not None and has_flops(func):
            cost.ops += ((float(op_flops(func, args, kwargs, out)), float(out_bytes(out))),)
        return out


class _Pricer(FakeInterpreter):
    def __init__(self, traced: TracedModel, counter: FlopCounterMode, backward_ratio: float):
        super().__init__(traced.gm, enter_fake_mode=False)
        self.traced = traced
        self.counter = counter
        self.ratio = backward_ratio
        self.costs: dict[str, NodeCost] = {}
        self._param_storages: set[int] = set()
        self._seen_storages: set[int] = set()
        self._current: NodeCost | None = None
        self._current_name = ""
        self._saved_keep: list[torch.Tensor] = []
        self._saver: dict[int, str] = {}  # storage -> the node that saved it first
        self._out_keys: dict[str, list[int]] = {}  # node -> its output's storages

    # fake copies of parameters/buffers: remember their storages so they are not "saved bytes"
    def to_fake(self, t: Any) -> Any:
        f = super().to_fake(t)
        if isinstance(f, torch.Tensor):
            self._param_storages.add(_storage_key(f))
        return f

    def _node_params(self, n: torch.fx.Node) -> list[torch.Tensor]:
        """Fake trainable parameters the node reads (leaves requiring grad)."""
        if n.op == "call_module":
            sub = self.fetch_attr(n.target)
            ps = [self.to_fake(p) for p in sub.parameters()]
        else:  # get_attr inputs, wherever they sit in args (lists included); memoised fakes
            ps = [self.to_fake(self.fetch_attr(a.target)) for a in n.all_input_nodes
                  if a.op == "get_attr"]
        out, seen = [], set()
        for p in ps:
            if isinstance(p, torch.Tensor) and p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
        return out

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if self._current is not None and isinstance(t, torch.Tensor):
            key = _storage_key(t)
            if key not in self._param_storages and key not in self._seen_storages:
                self._seen_storages.add(key)
                self._saver[key] = self._current_name
                self._current.saved_bytes += _storage_nbytes(t)
                self._saved_keep.append(t)  # keep the storage alive: keys stay unique
        return t

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.op not in COMPUTE_OPS:
            return super().run_node(n)
        cost = NodeCost()
        self.costs[n.name] = cost
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        params = self._node_params(n)
        pids = {id(p) for p in params}
        acts, seen = [], set()
        for v in pytree.tree_leaves((args, kwargs)):
            if (isinstance(v, torch.Tensor) and v.requires_grad and id(v) not in pids
                    and id(v) not in seen):
                seen.add(id(v))
                acts.append(v)

        before = self.counter.get_total_flops()
        self._current, self._current_name = cost, n.name
        try:
            out = getattr(self, n.op)(n.target, args, kwargs)
        finally:
            self._current = None
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        self._out_keys[n.name] = [_storage_key(t) for t in outs]
        self._saved_keep.extend(outs)  # alive: storage keys stay unique
        cost.fwd_flops = self.counter.get_total_flops() - before
        val = n.meta.get("val", None)
        cost.out_bytes = value_bytes(val if val is not None else out)
        cost.in_bytes = value_bytes([v for v in pytree.tree_leaves((args, kwargs))
                                     if isinstance(v, torch.Tensor)])
        cost.input_grad, cost.weight_grad = bool(acts), bool(params)
        cost.moves_memory = not _is_view(n)
        weight = fp8_weight(self.traced.gm, n) if n.op == "call_function" else None
        cost.fp8_shape = tuple(int(s) for s in weight.shape) if weight is not None else None
        if n.target in ATTENTION_OPS:
            cost.attn_scores, cost.attn_causal = _attention_scores(n.target, args, kwargs)
        if cost.fwd_flops > 0:
            self._backward(n, cost, args, kwargs, acts, params)
        return out

    def _backward(self, n: torch.fx.Node, cost: NodeCost, args, kwargs, acts: list,
                  params: list) -> None:
        """Count this node's backward alone: re-run it on detached activation inputs (so
        autograd cannot reach earlier nodes, e.g. through a tied weight), then differentiate."""
        outs: list[torch.Tensor] = []
        local: list[torch.Tensor] = []
        if acts or params:
            swap = {id(a): a.detach().requires_grad_(True) for a in acts}
            local = list(swap.values())
            l_args, l_kwargs = pytree.tree_map(
                lambda v: swap.get(id(v), v) if isinstance(v, torch.Tensor) else v,
                (args, kwargs))
            try:
                out = getattr(self, n.op)(n.target, l_args, l_kwargs)
                outs = [o for o in pytree.tree_leaves(out)
                        if isinstance(o, torch.Tensor) and o.requires_grad]
            except Exception:  # pragma: no cover - it ran a moment ago with the same shapes
                outs = []
        acts = local
        if outs:
            try:
                grads_out = [torch.empty_like(o) for o in outs]
                # torch.autograd.backward(inputs=...) rather than autograd.grad: the counter's
                # module tracker installs hooks that autograd.grad rejects on call_module nodes.
                c0 = self.counter.get_total_flops()
                if acts:
                    torch.autograd.backward(outs, grads_out, retain_graph=True, inputs=acts)
                c1 = self.counter.get_total_flops()
                if params:
                    saved_grads = [p.grad for p in params]
                    try:
                        torch.autograd.backward(outs, grads_out, retain_graph=True,
                                                inputs=params)
                    finally:
                        for p, g in zip(params, saved_grads):
                            p.grad = g
                c2 = self.counter.get_total_flops()
                cost.bwd_flops = (c1 - c0) + (c2 - c1)
                cost.bwd_weight_flops = c2 - c1
                cost.bwd_source = "autograd"
                return
            except (RuntimeError, NotImplementedError):
                pass  # no derivative for this op: fall back to the ratio rule
        if acts or params:
            cost.bwd_flops = int(round(self.ratio * cost.fwd_flops))
            cost.bwd_weight_flops = cost.bwd_flops // 2 if params else 0
            cost.bwd_source = "ratio"


#: fused attention ops (query, key, value first), whose score matrix :class:`NodeCost` records
ATTENTION_OPS = frozenset({
    aten.scaled_dot_product_attention.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
})


def _attention_scores(target, args, kwargs) -> tuple[int, bool]:
    """(batch x heads x query length x key length, is_causal) of an attention call."""
    q, k = args[0], args[1]
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)) or q.dim() < 2:
        return 0, False
    scores = int(q.numel()) // max(1, int(q.shape[-1])) * int(k.shape[-2])
    causal = bool(kwargs.get("is_causal", False))
    if not causal:  # positional: sdpa (q, k, v, attn_mask, dropout_p, is_causal, ...); the
        at = 5 if target is aten.scaled_dot_product_attention.default else 4  # kernels no mask
        causal = len(args) > at and args[at] is True
    return scores, causal


def _is_view(n: torch.fx.Node) -> bool:
    """Whether the node only makes a view of an input (its schema's first output aliases an
    input without writing), or unpacks a tuple."""
    import operator

    if n.target is operator.getitem:
        return True
    schema = getattr(n.target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


def _storage_key(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage()._cdata
    except Exception:  # a tensor without storage (e.g. some subclasses): fall back to identity
        return id(t)


def _storage_nbytes(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().nbytes())
    except Exception:
        return int(t.numel()) * t.element_size()


def price(traced: TracedModel, *, backward_ratio: float = 2.0) -> dict[str, NodeCost]:
    """Price every compute node (call_function / call_method / call_module) of ``traced``.

    Args:
        traced: the output of :func:`fxpipe.partitioner.trace.trace`.
        backward_ratio: backward/forward FLOP ratio used only where autograd cannot price a
            node's backward (see module doc); 2.0 is the usual matmul rule.

    Returns:
        FX node name -> :class:`NodeCost`, in graph order, for one micro-batch (the example
        inputs' batch). Placeholders, ``get_attr`` and the output node are not priced.

    Raises:
        ValueError: ``backward_ratio`` negative or not finite.
        TraceError: the graph cannot be run on fake tensors (message names the node).
    """
    from fxpipe.errors import TraceError

    if not (isinstance(backward_ratio, (int, float)) and math.isfinite(backward_ratio)
            and backward_ratio >= 0):
        raise ValueError(f"backward_ratio={backward_ratio!r} must be a finite number >= 0 "
                         f"(2.0: backward costs twice the forward)")
    counter = FlopCounterMode(display=False, custom_mapping=EXTRA_FORMULAS)
    pricer = _Pricer(traced, counter, float(backward_ratio))
    inputs = pricer.fake_inputs_from_meta()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with torch.enable_grad(), pricer.fake_mode, counter, _OpRecorder(pricer), \
                    torch.autograd.graph.saved_tensors_hooks(pricer.pack, lambda t: t):
                pricer.run(*inputs, enable_io_processing=False)
        except Exception as e:
            bad = next(reversed(pricer.costs), "<before the first node>")
            raise TraceError(
                f"could not price {traced.model_name or 'the model'} on fake tensors: node "
                f"{bad!r} failed with {type(e).__name__}: {str(e).strip()[:400]}; "
                f"an operator may lack a fake/meta kernel (register one with "
                f"torch.library.register_fake) or depend on tensor values") from e

    for name, keys in pricer._out_keys.items():
        pricer.costs[name].saved_by = next(
            (pricer._saver[k] for k in keys if k in pricer._saver), "")
    # parameters and buffers: charge each (canonical FQN) once, to its first user
    charged: set[str] = set()
    for n in traced.gm.graph.nodes:
        if n.name not in pricer.costs:
            continue
        cost = pricer.costs[n.name]
        for fqn in traced.node_params(n):
            if fqn in charged:
                continue
            charged.add(fqn)
            nbytes = traced.param_shapes.get(fqn, (None, None, 0))[2]
            if fqn in traced.buffer_fqns:
                cost.buffer_bytes += nbytes
            else:
                cost.param_bytes += nbytes
    return pricer.costs
