"""GPU profiles for ``cluster.gpu``: dense peaks, HBM and interconnect bandwidths as NCCL and
the kernels reach them, and the efficiencies the CUDA cost model
(:mod:`fxpipe.partitioner.gpu_model`) applies. Plain data (the spec schema reads the names and
the defaults they fill); the curves live in the cost model.

Sources of the profile constants:

* A100-80GB SXM4 (NVIDIA A100 Tensor Core GPU datasheet, 2021): 312 TFLOP/s dense BF16/FP16,
  156 TF32, 19.5 FP32; 2,039 GB/s HBM2e; 80 GB; NVLink 3 600 GB/s (300 each way).
* H100-80GB SXM5 (NVIDIA H100 Tensor Core GPU datasheet, 2023): 989 TFLOP/s dense BF16 (1,979
  with sparsity), 494.5 TF32, 67 FP32; 3,350 GB/s HBM3; NVLink 4 900 GB/s (450 each way).
* H200 SXM (NVIDIA H200 datasheet, 2024): H100's compute and NVLink; 4,800 GB/s HBM3e; 141 GB.
* NCCL bus bandwidth inside a node: A100 8-GPU all_reduce_perf about 200-208 GB/s
  (NVIDIA/nccl-tests#149, #178); H100 about 370 GB/s for rings (the line rate 450 less ~20%
  protocol overhead) and about 480 GB/s for an all-reduce with NVLink SHARP (NCCL maintainer
  in NVIDIA/nccl-tests#212; GTC'24 S62129 as cited in NVIDIA/nccl#1374).
* NCCL between nodes: HDR InfiniBand 200 Gb/s (25 GB/s) per A100, NDR 400 Gb/s (50 GB/s) per
  H100/H200; NCCL reaches 85-96 % of the NIC line rate (NVIDIA/nccl-tests#119: 85-96 GB/s
  busbw on 4 HDR NICs per node): 0.9 x line rate.
* ``S0`` (half-bandwidth message size): **estimate**, 4 MB inside an A100 node, 8 MB inside
  an H100/H200 node and between nodes: the message sizes at which published all_reduce_perf
  tables of 8-GPU NVLink nodes reach about half their peak bus bandwidth (e.g. the curve in
  NVIDIA/nccl#583); not measured by fxpipe.
* ``matmul_efficiency``: **estimate**, 0.80 (A100) and 0.70 (H100/H200) of the dense 16-bit peak
  for large GEMMs: cuBLAS reaches about 250 TFLOP/s on large A100 GEMMs and about 650-750 on
  H100 SXM (which throttles its clock under sustained tensor-core load); NVIDIA's "Matrix
  Multiplication Background User's Guide" (DU-09799-001, 2023) shows the shape dependence. ``matmul_fixed_us``: **estimate**, 8 us (A100) / 6 us (H100):
  a 1024^3 GEMM reaches about half the large-GEMM rate on A100.
* ``flash_efficiency``: FlashAttention-2 (Dao, 2023, arXiv:2307.08691) reaches 50-73 % of the
  A100 peak (forward and backward, the lower end for the backward); 0.55 used. On H100 the
  FlashAttention-2 kernel (which PyTorch's SDPA runs) reaches about 335 TFLOP/s of 989 in that
  paper: 0.33 used (FlashAttention-3's Hopper kernels are faster; not what torch runs).
* ``host_GBps``: **estimate**, device <-> host memory per GPU each way, for activation offload:
  PCIe Gen4 x16 (A100) 32 GB/s and Gen5 x16 (H100/H200) 64 GB/s line rate, of which pinned
  copies reach about 80 %, and in an 8-GPU HGX/DGX node two GPUs share one switch uplink to
  the CPU (DGX A100 / DGX H100 system guides): 12.5 and 25 GB/s per GPU when all offload at once.
* FP8 (``train.precision: fp8``): H100 SXM5 / H200 1,979 TFLOP/s dense FP8 (the datasheets'
  3,958 is with sparsity); A100 has no FP8 tensor cores. ``fp8_matmul_efficiency``:
  **derived**, 0.66, from torchtitan's Llama 3 8B on 8 H100s (docs/performance.md: FSDP,
  torch.compile, sequence 8,192, local batch 1; 6,667 tokens/s per GPU in bf16, 8,532 with
  Float8, 1.28x): at about 54.6 GFLOP per token (6 x 8.03e9 parameters + causal attention) the
  bf16 step is 150 us per token, of which the weight matmuls (48 GFLOP) take 69 us at this
  model's bf16 rate (0.70 x 989); if everything else stays (81 us), Float8's 117 us leave 37
  us for the matmuls, 1,311 TFLOP/s: 0.66 of the FP8 peak with the casts and scales
  included.
* ``hbm_efficiency``: **estimate**, 0.85: bandwidth-bound copy kernels (STREAM-like) reach
  about 85-90 % of the HBM datasheet figure on A100/H100; fused norm/softmax kernels less.

"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GpuProfile", "PROFILES", "GPU_NAMES", "DEFAULT_CURVES", "profile", "link_curve"]


@dataclass(frozen=True)
class GpuProfile:
    """One GPU type (module doc for every source).

    Attributes:
        name: as ``cluster.gpu`` spells it.
        bf16_tflops / tf32_tflops / fp32_tflops: dense peaks, 10^12 FLOP/s.
        hbm_GBps: datasheet HBM bandwidth; memory_gb: device memory (10^9 bytes).
        nvlink_busbw_GBps: NCCL bus bandwidth of rings inside a node (reduce-scatter,
            all-gather, ring all-reduce, p2p); nvlink_allreduce_busbw_GBps: of an all-reduce
            inside a node (NVLink SHARP where there is one).
        nic_busbw_GBps: NCCL bus bandwidth of one GPU's NIC between nodes.
        intra_half_MB / inter_half_MB: message size reaching half the bus bandwidth.
        matmul_efficiency: fraction of the 16-bit peak large GEMMs reach.
        matmul_fixed_us: fixed ramp-up/tail time per GEMM.
        flash_efficiency: fraction of the 16-bit peak flash attention reaches (fwd + bwd).
        hbm_efficiency: fraction of ``hbm_GBps`` memory-bound kernels reach.
        host_GBps: device <-> host memory bandwidth per GPU, each way, all GPUs copying.
        fp8_tflops: dense FP8 peak (None: no FP8 tensor cores); fp8_matmul_efficiency: the
            fraction of it a float8 training matmul reaches, its casts and scaling included.
    """

    name: str
    bf16_tflops: float
    tf32_tflops: float
    fp32_tflops: float
    hbm_GBps: float
    memory_gb: float
    nvlink_busbw_GBps: float
    nvlink_allreduce_busbw_GBps: float
    nic_busbw_GBps: float
    intra_half_MB: float
    inter_half_MB: float
    matmul_efficiency: float
    matmul_fixed_us: float
    flash_efficiency: float
    hbm_efficiency: float = 0.85
    host_GBps: float = 12.5
    fp8_tflops: float | None = None
    fp8_matmul_efficiency: float = 0.0

    def cluster_defaults(self) -> dict:
        """The ``cluster`` keys ``cluster.gpu`` fills when they are not given."""
        return {"device": "cuda", "device_tflops": self.bf16_tflops,
                "memory_GBps": self.hbm_GBps, "memory_gb": self.memory_gb,
                "links": {"intra_node_GBps": self.nvlink_busbw_GBps,
                          "inter_node_GBps": self.nic_busbw_GBps, "host_GBps": self.host_GBps}}


PROFILES: dict[str, GpuProfile] = {
    "A100-80GB": GpuProfile("A100-80GB", 312.0, 156.0, 19.5, 2039.0, 80.0,
                            nvlink_busbw_GBps=205.0, nvlink_allreduce_busbw_GBps=205.0,
                            nic_busbw_GBps=22.5, intra_half_MB=4.0, inter_half_MB=8.0,
                            matmul_efficiency=0.80, matmul_fixed_us=8.0,
                            flash_efficiency=0.55),
    "H100-80GB": GpuProfile("H100-80GB", 989.0, 494.5, 67.0, 3350.0, 80.0,
                            nvlink_busbw_GBps=370.0, nvlink_allreduce_busbw_GBps=480.0,
                            nic_busbw_GBps=45.0, intra_half_MB=8.0, inter_half_MB=8.0,
                            matmul_efficiency=0.70, matmul_fixed_us=6.0,
                            flash_efficiency=0.33, host_GBps=25.0,
                            fp8_tflops=1979.0, fp8_matmul_efficiency=0.66),
    "H200": GpuProfile("H200", 989.0, 494.5, 67.0, 4800.0, 141.0,
                       nvlink_busbw_GBps=370.0, nvlink_allreduce_busbw_GBps=480.0,
                       nic_busbw_GBps=45.0, intra_half_MB=8.0, inter_half_MB=8.0,
                       matmul_efficiency=0.70, matmul_fixed_us=6.0, flash_efficiency=0.33,
                       host_GBps=25.0, fp8_tflops=1979.0, fp8_matmul_efficiency=0.66),
}
#: the names ``cluster.gpu`` accepts
GPU_NAMES = tuple(PROFILES)
#: the curves ``device: cuda`` without ``cluster.gpu`` uses (on the spec's own numbers)
DEFAULT_CURVES = "H100-80GB"


def profile(name: str | None) -> GpuProfile:
    """The profile named ``name`` (None: :data:`DEFAULT_CURVES`).

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    key = DEFAULT_CURVES if name is None else name
    if key not in PROFILES:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPU_NAMES)} (or leave "
                         "cluster.gpu out and give device_tflops, memory_GBps and links by hand)")
    return PROFILES[key]




def link_curve(device: str, gpu: str | None) -> dict:
    """The keywords :meth:`fxpipe.schedule.simulate.Links.from_cluster` takes for the cluster's
    devices: on CUDA one NIC per GPU (``rails``) and NCCL's message-size curve (``half_bytes``,
    the inter-node ``S0``); nothing on CPU."""
    if device != "cuda":
        return {}
    return {"rails": True, "half_bytes": profile(gpu).inter_half_MB * 1e6}
