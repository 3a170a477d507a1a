"""The analytic CUDA cost model: per-GPU profiles and the efficiency curves that turn a node's
FLOPs and bytes into seconds on a GPU (``cluster.device: cuda``, ``cluster.costs: analytic``).

Every constant below comes from a datasheet, a published measurement, or is marked
**estimate** with the reason. None is fitted to the published training runs that
``benchmarks/bench_published_runs.py`` compares against, nor to the one GPU fxpipe has run on
(``benchmarks/gpu_check.py`` on an H200, BENCHMARKS.md's gpu-check section: the H200 model
predicted the kernel time of 2-stage GPT micro-batches within 1-3 % in fp32 and within 3 %
forward, 17 % backward in bf16; in bf16 those small stages wait on the host, which the model
does not price, and ran 1.39-1.45x its prediction in the recorded run, 1.35-1.9x over four).

What it models, per node of the traced graph (one micro-batch, one pass):

* **Matmuls** (nodes with FLOPs, attention excepted): the slower of compute at the achievable
  matmul rate and their bytes at the achievable HBM bandwidth (a thin matmul, e.g. one dimension
  of 64, has low arithmetic intensity and goes memory-bound), plus a fixed ramp-up/tail time per
  GEMM, so small matmuls run far from peak: efficiency ``F / (F + F0)`` of a GEMM of ``F``
  FLOPs, with ``F0 = matmul_fixed_us x matmul rate``. The achievable rate of large GEMMs is
  ``matmul_efficiency`` x the dense peak. Wave and tile quantization (NVIDIA, "Matrix
  Multiplication Background User's Guide", DU-09799-001, 2023) are averaged into these two
  constants: the traced graph records FLOPs and bytes per node, not the GEMM dimensions.
* **Memory-bound ops** (element-wise, norms, softmax, copies, the loss): their bytes read and
  written at ``hbm_efficiency`` x the datasheet HBM bandwidth. Under ``bf16`` / ``fp16``
  training the bytes are half the traced (fp32) ones: activations are 16-bit.
* **Attention** (``scaled_dot_product_attention``): ``flash`` (PyTorch's SDPA flash kernel on
  16-bit inputs): its FLOPs (half of them under a causal mask, which the kernel skips) at
  ``flash_efficiency`` x peak, with no score matrix in memory. ``math`` (the unfused path of
  PyTorch's math SDPA and of Megatron-LM before flash attention): the two batched GEMMs at the
  matmul rate, plus the score matrix (batch x heads x s x s, 16-bit) written and read
  ``MATH_FWD_PASSES`` times forward and ``MATH_BWD_PASSES`` backward at the HBM rate.
* **Launch overhead**: ``cluster.op_overhead_us`` per op and pass, as on the CPU.
* **Collectives** (NCCL): a ring moves ``2(n-1)/n`` (all-reduce) or ``(n-1)/n`` (reduce-scatter,
  all-gather: together the bytes of one all-reduce) of the message over the *bus bandwidth*,
  which saturates with the message size ``S``: ``busbw(S) = B S / (S + S0)`` (``S0``: the size
  that reaches half of ``B``), i.e. ``(S + S0) / B`` per ring pass. Inside a node ``B`` is the
  NVLink/NVSwitch bus bandwidth NCCL reaches; an all-reduce may reach more (NVLink SHARP on
  H100/H200). Between nodes each GPU has its own NIC (rail-optimised DGX/HGX clusters), so a
  ring with ``k`` members on every node it spans runs at ``min(B_intra, k x B_nic)``
  (:func:`ring_bus_GBps`; NVIDIA/nccl#1168: 45 GB/s with 4 GPUs per node, 90 with 8).

The profiles (peaks, bandwidths, efficiencies) and the source of every constant are in
:mod:`fxpipe.specs.gpus`; the curves' own constants below.

* ``MATH_FWD_PASSES`` / ``MATH_BWD_PASSES``: counted for an unfused attention with a fused
  scale-mask-softmax and attention dropout (Megatron-LM, Narayanan et al. SC'21): forward
  writes the scores, the softmax reads and writes them, dropout writes its mask and output,
  the second GEMM reads them (about 6 score-sized passes); backward about 10.

``device: cuda`` without ``cluster.gpu`` uses the ``H100-80GB`` curves (efficiencies, ``S0``)
on the spec's own ``device_tflops``, ``memory_GBps`` and links.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fxpipe.execution.fp8 import fp8_shape_ok
from fxpipe.partitioner.cost import NodeCost
from fxpipe.partitioner.timing import NodeTimes
from fxpipe.specs.gpus import DEFAULT_CURVES, GPU_NAMES, PROFILES, GpuProfile, profile

__all__ = ["GpuProfile", "PROFILES", "GPU_NAMES", "profile", "GpuRates", "gpu_rates",
           "matmul_seconds", "matmul_efficiency", "attention_seconds", "gpu_times",
           "bus_bandwidth", "collective_seconds", "ring_bus_GBps", "DEFAULT_CURVES"]

#: score-matrix passes of the unfused (math) attention, forward and backward (module doc)
MATH_FWD_PASSES = 6.0
MATH_BWD_PASSES = 10.0


@dataclass(frozen=True)
class GpuRates:
    """What pricing one node on a GPU needs (per second, per byte and fixed seconds)."""

    matmul_flops_per_s: float
    matmul_fixed_s: float
    flash_flops_per_s: float
    bytes_per_s: float
    byte_scale: float
    op_overhead_s: float
    attention: str = "flash"
    #: ``train.precision: fp8``: the rate of the weight matmuls (None: ``matmul_flops_per_s``)
    fp8_matmul_flops_per_s: float | None = None


def gpu_rates(prof: GpuProfile, device_tflops: float, memory_GBps: float, precision: str,
              op_overhead_s: float, attention: str = "flash") -> GpuRates:
    """Rates of a device with peak ``device_tflops`` (dense 16-bit) and ``memory_GBps`` on
    ``prof``'s curves, training in ``precision`` (fp32: the FP32 peak, scaled from the 16-bit
    one by the profile's ratio: PyTorch leaves TF32 off for matmuls by default; traced bytes as
    they are. bf16 / fp16: the 16-bit peak, half the traced bytes. fp8: as bf16, the matmuls
    at the FP8 peak times the profile's ``fp8_matmul_efficiency``, which holds their casts and
    scales)."""
    peak = device_tflops * 1e12
    half = precision in ("bf16", "fp16", "fp8")
    if not half:
        peak *= prof.fp32_tflops / prof.bf16_tflops
    mm = peak * prof.matmul_efficiency
    fp8 = None
    if precision == "fp8":  # the weight matmuls on the FP8 peak, at their own efficiency
        if prof.fp8_tflops is None:
            raise ValueError(f"train.precision: fp8 needs FP8 tensor cores; {prof.name} has none")
        fp8 = peak * prof.fp8_tflops / prof.bf16_tflops * prof.fp8_matmul_efficiency
    # fp32 runs on the CUDA cores, no flash kernel: attention at the matmul rate
    flash = peak * prof.flash_efficiency if half else mm
    return GpuRates(mm, prof.matmul_fixed_us * 1e-6, flash,
                    memory_GBps * 1e9 * prof.hbm_efficiency, 0.5 if half else 1.0,
                    op_overhead_s, attention, fp8)


def matmul_seconds(flops: float, nbytes: float, r: GpuRates) -> float:
    """One GEMM of ``flops`` moving ``nbytes`` (traced bytes): the slower of compute (plus the
    fixed ramp-up/tail) and memory traffic; 0 FLOPs: the traffic alone."""
    if flops <= 0:
        return nbytes * r.byte_scale / r.bytes_per_s
    return max(flops / r.matmul_flops_per_s + r.matmul_fixed_s,
               nbytes * r.byte_scale / r.bytes_per_s)


def matmul_efficiency(flops: float, nbytes: float, r: GpuRates, peak_flops_per_s: float
                      ) -> float:
    """Achieved fraction of ``peak_flops_per_s`` of one GEMM (:func:`matmul_seconds`)."""
    return flops / matmul_seconds(flops, nbytes, r) / peak_flops_per_s


def attention_seconds(flops: float, nbytes: float, scores: int, causal: bool, backward: bool,
                      r: GpuRates) -> float:
    """One pass of an attention op (module doc): ``flash`` or ``math``."""
    if r.attention == "flash":
        work = flops * (0.5 if causal else 1.0)
        return max(work / r.flash_flops_per_s + r.matmul_fixed_s,
                   nbytes * r.byte_scale / r.bytes_per_s)
    passes = MATH_BWD_PASSES if backward else MATH_FWD_PASSES
    score_bytes = passes * scores * 4.0 * r.byte_scale  # 16-bit scores under bf16 / fp16
    return (flops / r.matmul_flops_per_s + 2 * r.matmul_fixed_s
            + (score_bytes + nbytes * r.byte_scale) / r.bytes_per_s)


def gpu_times(costs: dict[str, NodeCost], r: GpuRates) -> dict[str, NodeTimes]:
    """:class:`NodeTimes` of every priced node on the GPU (module doc); the same passes as the
    CPU roofline (:func:`fxpipe.partitioner.timing.analytic_times`): views move nothing, the
    backward reads and writes about the forward's bytes again."""
    out = {}
    o = r.op_overhead_s
    # train.precision: fp8 runs the weight matmuls fxpipe.execution.fp8 rewrites (a linear /
    # addmm of a 2-D trained weight whose dims on its rank are multiples of 16) in float8,
    # everything else in bf16
    r8 = (r if r.fp8_matmul_flops_per_s is None
          else dataclasses.replace(r, matmul_flops_per_s=r.fp8_matmul_flops_per_s))
    for name, c in costs.items():
        moved = (c.in_bytes + c.out_bytes) if c.moves_memory else 0
        if c.attn_scores:
            fwd = o + attention_seconds(c.fwd_flops, moved, c.attn_scores, c.attn_causal,
                                        False, r)
            bi = (o + attention_seconds(c.bwd_input_flops, moved, c.attn_scores,
                                        c.attn_causal, True, r) if c.input_grad else 0.0)
            bw = (o + attention_seconds(c.bwd_weight_flops, 0, 0, c.attn_causal, True, r)
                  if c.weight_grad and c.bwd_weight_flops else 0.0)
        else:
            rr = r8 if c.fp8_shape is not None and fp8_shape_ok(c.fp8_shape) else r
            fwd = o + matmul_seconds(c.fwd_flops, moved, rr)
            bi = o + matmul_seconds(c.bwd_input_flops, moved, rr) if c.input_grad else 0.0
            bw = (o + matmul_seconds(c.bwd_weight_flops, c.in_bytes + c.out_bytes, rr)
                  if c.weight_grad else 0.0)
        out[name] = NodeTimes(fwd, bi, bw)
    return out


# ------------------------------------------------------------------------------ collectives


def bus_bandwidth(nbytes: float, busbw_GBps: float, half_bytes: float) -> float:
    """NCCL bus bandwidth (GB/s) reached by a message of ``nbytes``: ``B S / (S + S0)``."""
    if nbytes <= 0:
        return 0.0
    return busbw_GBps * nbytes / (nbytes + half_bytes)


def collective_seconds(kind: str, nbytes: float, n: int, busbw_GBps: float,
                       half_bytes: float = 0.0, latency_s: float = 0.0) -> float:
    """Seconds of a ring ``all_reduce``, ``reduce_scatter`` or ``all_gather`` of a message of
    ``nbytes`` (the whole tensor) over ``n`` ranks at bus bandwidth ``busbw_GBps`` saturating
    with the message size (:func:`bus_bandwidth`), plus a latency per ring step. An all-reduce
    costs a reduce-scatter plus an all-gather."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
    if kind not in ("all_reduce", "reduce_scatter", "all_gather"):
        raise ValueError(f"unknown collective {kind!r}")
    return steps / n * (nbytes + half_bytes) / (busbw_GBps * 1e9) + steps * latency_s


def ring_bus_GBps(members_per_node: int, crosses_nodes: bool, intra_GBps: float,
                  inter_GBps: float) -> float:
    """Bus bandwidth of a ring (module doc): inside a node the NVLink one; across nodes, with
    ``members_per_node`` of its members on each node it spans (each with its own NIC),
    ``min(intra, members x inter)``."""
    if not crosses_nodes:
        return intra_GBps
    return min(intra_GBps, max(1, members_per_node) * inter_GBps)
