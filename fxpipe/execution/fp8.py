"""FP8 matmuls (spec ``train.precision: fp8``): a stage's weight matmuls through torchao's float8.

Under ``fp8`` a stage computes in bf16 (autocast, fp32 master weights, as ``bf16``) and its
weight matmuls, the ``linear``, ``addmm`` and ``mm`` nodes whose weight is one of the stage's
parameters (GPT-2's ``Conv1D`` is an ``addmm``, its row-parallel shard an ``mm``), run in float8 through torchao's float8
training (``torchao.float8``: the operands scaled into ``float8_e4m3fn`` per tensor
(``tensorwise``) or per row (``rowwise``, ``train.fp8_scaling``), multiplied on the FP8 tensor
cores by ``torch._scaled_mm``, the output in bf16; the backward's two matmuls likewise), the
recipe torchtitan runs Llama 3 with. The rewrite is on the stage's FX graph: each such node's
target becomes :class:`Float8Matmul`, reading the same parameters (names, checkpoints and the
optimizer unchanged). A weight whose two dimensions are not multiples of 16 (what
``_scaled_mm`` takes) stays in bf16; so do attention's matmuls (no weight) and the loss.

FP8 tensor cores exist from compute capability 8.9 (Ada: L4, L40S; Hopper: H100, H200):
:func:`fp8_problem` says why a device cannot (a CPU, an A100), in one line. torchao's
``emulate`` mode (the same casts and scales, the matmul in fp32) runs the rewrite on a CPU for
the tests.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

__all__ = ["FP8_SCALINGS", "Float8Matmul", "float8_config", "fp8_problem", "fp8_stage",
           "fp8_weight", "fp8_shape_ok"]

#: ``train.fp8_scaling`` -> torchao's recipe name
FP8_SCALINGS = ("tensorwise", "rowwise")
#: compute capability of the first GPUs with FP8 tensor cores (Ada, Hopper)
FP8_CAPABILITY = (8, 9)
_aten = torch.ops.aten


def fp8_problem(device: torch.device) -> str | None:
    """Why ``train.precision: fp8`` cannot run on ``device`` (None: it can)."""
    if device.type != "cuda":
        return (f"train.precision: fp8 runs its matmuls on FP8 tensor cores (CUDA, compute "
                f"capability 8.9 or later: H100, H200, L40S); this run is on {device.type}: "
                "use bf16")
    cap = torch.cuda.get_device_capability(device)
    if tuple(cap) < FP8_CAPABILITY:
        return (f"train.precision: fp8 needs FP8 tensor cores (compute capability 8.9 or "
                f"later: H100, H200, L40S); {torch.cuda.get_device_name(device)} is "
                f"{cap[0]}.{cap[1]}: use bf16")
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return ("train.precision: fp8 runs through torchao's float8 training, which is not "
                "installed: pip install torchao")
    return None


def float8_config(scaling: str, emulate: bool = False):
    """torchao's ``Float8LinearConfig`` of the recipe ``scaling`` (``tensorwise`` |
    ``rowwise``); ``emulate``: the matmul in fp32 (CPU tests)."""
    from torchao.float8 import Float8LinearConfig

    if scaling not in FP8_SCALINGS:
        raise ValueError(f"fp8 scaling {scaling!r}: one of {', '.join(FP8_SCALINGS)}")
    cfg = Float8LinearConfig.from_recipe_name(scaling)
    return dataclasses.replace(cfg, emulate=True) if emulate else cfg


class Float8Matmul:
    """``linear(x, weight, bias)``, ``addmm(bias, x, weight)`` or ``mm(x, weight)`` with the
    matmul in float8 (a graph node's target; see the module doc)."""

    def __init__(self, config, transposed: bool, bias: bool = True):
        from torchao.float8.float8_linear import LinearMMConfig
        from torchao.float8.float8_training_tensor import ScaledMMConfig

        self.config, self.transposed = config, transposed  # transposed: linear's [out, in]
        self.bias = bias  # False: mm(x, weight) (a row-parallel addmm's matmul, its bias after)
        self.__name__ = ("float8_linear" if transposed else "float8_addmm" if bias
                         else "float8_mm")

        def mm(accum: bool) -> ScaledMMConfig:
            return ScaledMMConfig(config.emulate, accum, False, config.pad_inner_dim)
        self.mm_config = LinearMMConfig(mm(config.gemm_config_output.use_fast_accum),
                                        mm(config.gemm_config_grad_input.use_fast_accum),
                                        mm(config.gemm_config_grad_weight.use_fast_accum))

    def __call__(self, *args):
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

        if self.transposed:
            x, w, b = (*args, None)[:3]
            w = w.t()
        elif self.bias:
            b, x, w = args
        else:
            (x, w), b = args, None
        if torch.is_autocast_enabled(x.device.type):  # as autocast runs a matmul: bf16 in
            x = x.to(torch.get_autocast_dtype(x.device.type))
        lead = x.shape[:-1]
        out = matmul_with_hp_or_float8_args.apply(x.reshape(-1, x.shape[-1]), w,
                                                  self.mm_config, self.config)
        out = out.reshape(*lead, out.shape[-1])
        return out if b is None else out + b.to(out.dtype)

    def __repr__(self) -> str:
        return self.__name__


def _param_2d(gm: fx.GraphModule, node) -> torch.Tensor | None:
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return None
    try:
        t = gm.get_parameter(node.target)
    except AttributeError:
        return None
    return t if t.dim() == 2 and t.requires_grad else None


def fp8_weight(gm: fx.GraphModule, node: fx.Node) -> torch.Tensor | None:
    """The trained 2-D weight of a ``linear`` / ``addmm`` / ``mm`` node of ``gm`` (a weight
    matmul the rewrite takes when :func:`fp8_shape_ok`; a tensor-parallel rewrite turns a
    row-parallel ``addmm`` into ``mm`` and an add after the reduction), else None. The planner
    prices the same nodes at the FP8 rate (:mod:`fxpipe.partitioner.gpu_model`)."""
    if node.op != "call_function" or node.kwargs:
        return None
    if node.target is _aten.linear.default and len(node.args) >= 2:
        return _param_2d(gm, node.args[1])
    if node.target is _aten.addmm.default and len(node.args) == 3:
        return _param_2d(gm, node.args[2])
    if node.target is _aten.mm.default and len(node.args) == 2:
        return _param_2d(gm, node.args[1])
    return None


def fp8_shape_ok(shape) -> bool:
    """Whether a weight of ``shape`` (on its rank: a tensor-parallel shard) runs in float8:
    both dimensions multiples of 16, what ``torch._scaled_mm`` takes."""
    return len(shape) == 2 and all(int(s) % 16 == 0 and int(s) > 0 for s in shape)


def fp8_stage(gm: fx.GraphModule, config) -> int:
    """Rewrite ``gm``'s weight matmuls (module doc) in place to :class:`Float8Matmul` under
    torchao ``config``; returns how many nodes now run in float8."""
    targets = {_aten.linear.default: Float8Matmul(config, True),
               _aten.addmm.default: Float8Matmul(config, False),
               _aten.mm.default: Float8Matmul(config, False, bias=False)}
    count = 0
    for node in gm.graph.nodes:
        w = fp8_weight(gm, node)
        if w is None or not fp8_shape_ok(w.shape):
            continue
        node.target = targets[node.target]
        count += 1
    if count:
        gm.recompile()
    return count
