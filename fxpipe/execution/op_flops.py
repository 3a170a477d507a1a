"""FLOPs of one ATen op call, the same count for the planner's pricing and the runtime's
selective recomputation policy: torch's ``FlopCounterMode`` formulas (matmul-like work: mm,
addmm, bmm, convolution, attention; 2 FLOPs per multiply-accumulate) and those torch 2.13 lacks
(:data:`EXTRA_FORMULAS`): the CPU fused attention kernel
``aten._scaled_dot_product_flash_attention_for_cpu`` (+ backward) and the fused inference fast
paths ``aten._native_multi_head_attention`` and ``aten._transformer_encoder_layer_fwd``. Every
other op (element-wise, norms, softmax, views) counts 0."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import (flop_registry, sdpa_backward_flop_count, sdpa_flop_count,
                                      shape_wrapper)

__all__ = ["EXTRA_FORMULAS", "op_flops", "has_flops"]

aten = torch.ops.aten


def _sdpa_cpu_flop(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)


def _sdpa_cpu_backward_flop(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


def _mha_flops(b: int, t: int, s: int, e: int) -> int:
    """Multi-head attention with in/out projections: query length t, key length s, width e."""
    proj = 2 * b * t * e * e + 2 * 2 * b * s * e * e + 2 * b * t * e * e  # q, k+v, out
    attn = 2 * b * t * s * e * 2  # scores q@k^T and probabilities@v, summed over heads
    return proj + attn


def _btc(shape) -> tuple[int, int]:
    """(batch, length) of a [B, T, E] or [T, E] shape."""
    return (shape[0], shape[1]) if len(shape) == 3 else (1, shape[0])


def _native_mha_flop(query, key, value, embed_dim, num_head, *args, out_shape=None,
                     **kwargs) -> int:
    b, t = _btc(query)
    _, s = _btc(key)
    return _mha_flops(b, t, s, int(embed_dim))


def _encoder_layer_fwd_flop(src, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight,
                            proj_bias, use_gelu, norm_first, eps, norm_weight_1, norm_bias_1,
                            norm_weight_2, norm_bias_2, ffn_weight_1, *args, out_shape=None,
                            **kwargs) -> int:
    b, t = _btc(src)
    e = int(embed_dim)
    ffn = int(ffn_weight_1[0])
    return _mha_flops(b, t, t, e) + 2 * (2 * b * t * e * ffn)


#: op packet -> formula (shape arguments), passed to ``FlopCounterMode(custom_mapping=...)``.
EXTRA_FORMULAS: dict[Any, Any] = {
    aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu_flop,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_backward_flop,
    aten._native_multi_head_attention: _native_mha_flop,
    aten._transformer_encoder_layer_fwd: _encoder_layer_fwd_flop,
}

_FORMULAS = {**flop_registry, **{k: shape_wrapper(v) for k, v in EXTRA_FORMULAS.items()}}


def has_flops(func) -> bool:
    """Whether ``func`` (an ATen op overload) has a FLOP formula (matmul-like work)."""
    return getattr(func, "_overloadpacket", func) in _FORMULAS


def op_flops(func, args: tuple, kwargs: dict, out: Any) -> int:
    """FLOPs of ``func(*args, **kwargs) -> out`` (tensors of any device, fake and meta ones
    included: only shapes are read); 0 for an op without a formula."""
    f = _FORMULAS.get(getattr(func, "_overloadpacket", func))
    return int(f(*args, **kwargs, out_val=out)) if f is not None else 0
