"""The prepared device check: what fxpipe measures and predicts on one CUDA GPU, in one run.

Run on a machine with one GPU (under 5 minutes on an H100/H200)::

    python benchmarks/gpu_check.py --out OUT [--write-benchmarks]

It writes ``OUT/gpu_check.json`` (every figure, and for every part its error if it failed) and
``OUT/gpu_check.md`` (the tables); ``--write-benchmarks`` also puts the tables into the
``gpu-check`` section of ``BENCHMARKS.md``. ``--dry-run`` runs the same code on the CPU with
tiny shapes (well under a minute; tested in CI by ``tests/test_gpu_check_dry_run.py``, so the
script cannot rot); its figures mean nothing and never go into ``BENCHMARKS.md``.

Parts (each in its own ``try``: one that fails records its error and the others still run;
each is skipped once the time budget, ``--budget-s``, is spent):

* ``profile_gpt`` / ``profile_hf_gpt2``: ``fxpipe profile`` (:func:`fxpipe.training.profiling.
  profile_spec`, measured costs per FX node) of the bundled CharGPT and of a Hugging Face
  GPT-2 built from a ``GPT2Config`` (random weights, no download).
* ``stages_fp32`` / ``stages_bf16``: the CharGPT planned into 2 stages with ``cluster.device``
  the device under test, once with ``cluster.costs: analytic`` and once with ``measured``; each
  plan's stages are then run forward and backward on the device (the loss on the last stage,
  under autocast for bf16) and their measured seconds set beside the plan's predicted ones.
  The memory of the analytic plan's stages is measured too: the stage's parameters, plus the
  allocator's peak (``torch.cuda.max_memory_allocated``; not available on a CPU) over the
  resident model while the stage holds its planned in-flight micro-batches, runs their
  backwards and an AdamW step; and, on any device, the bytes autograd saves per micro-batch
  (``saved_tensors_hooks``), beside the plan's ``activation_bytes``.
* ``mfu_block``: one GPT block of width 4,096 (32 heads) in bf16 autocast, micro-batch
  8 x 2,048: forward + backward seconds and model FLOP utilisation against the GPU's dense
  bf16 peak (989 TFLOP/s on H100/H200; ``--peak-tflops`` otherwise). FLOPs: Megatron-LM's
  ``72 B T d^2 (1 + T / 6d)`` per training pass, and what ``FlopCounterMode`` counts.
* ``fast_stages`` (issue 37): a Llama-style model of about 1 B parameters (Llama 3.2 1B's
  widths, 8 layers) trained on one rank: a plain PyTorch loop (eager; torch.compile per
  transformer block, torchtitan's recipe; and with torchao float8) beside ``fxpipe.compile``
  (pipeline 1; ``train.compile`` none / stages; ``precision: fp8``): tokens/s over the steps
  after the warm-up ones, MFU (6 x matmul parameters + attention FLOPs per token, against the
  dense bf16 peak), fxpipe / plain, each variant in a process of its own. The fp8 variants run
  only on FP8 tensor cores (compute capability 8.9+).
* ``pipeline_2rank``: a 2-rank 1F1B pipeline (:class:`~fxpipe.runtime.executor.
  PipelineExecutor`) with both ranks on the one GPU: gloo with CUDA tensors, then NCCL (which
  refuses two ranks on one device); each outcome, loss or error, is recorded as it is.

Units in the JSON: seconds and bytes; the tables show ms and MiB.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._report import BENCHMARKS_MD, markdown_table, write_section  # noqa: E402

SECTION = "gpu-check"
#: the parts, in the order they run (:func:`run_check`; ``--only`` picks among them)
PARTS = ("profile_gpt", "profile_hf_gpt2", "stages_fp32", "stages_bf16", "mfu_block",
         "pipeline_2rank", "fast_stages")
#: ``cluster.gpu`` (:mod:`fxpipe.specs.gpus`) by what CUDA calls the device: the analytic plans
#: price the stages with the GPU model a user of that GPU gets
GPU_PROFILES = {"H200": "H200", "H100": "H100-80GB", "A100": "A100-80GB"}
#: what BENCHMARKS.md says until a real run fills the section
PENDING = """## GPU check (CUDA): no figures yet

**No CUDA figure exists for fxpipe yet.** No run in this repository's history has had a GPU;
every measured figure above comes from CPUs (gloo), the others from the cost model. `benchmarks/gpu_check.py` is the prepared check
that will fill this section on one lent GPU (`python benchmarks/gpu_check.py --out OUT
--write-benchmarks`, under 5 minutes on an H100/H200). It will measure:

- `fxpipe profile` (measured per-node costs) of the bundled CharGPT and of a Hugging Face
  GPT-2 on CUDA;
- a 2-stage plan of the CharGPT, fp32 and bf16: each stage's forward and backward seconds on the
  GPU beside what the analytic cost model and the measured cost model predicted for it;
- model FLOP utilisation of one GPT block of width 4,096 (bf16, micro-batch 8 x 2,048);
- predicted vs `torch.cuda.max_memory_allocated` peak memory per stage;
- tokens/s and MFU of a ~1 B Llama-style model on one GPU: a plain PyTorch loop (eager,
  compiled per block, + torchao float8) beside fxpipe (eager, compiled stages, + fp8);
- whether a 2-rank pipeline runs with both ranks on the one GPU (gloo with CUDA tensors; NCCL,
  which refuses two ranks on one device), with the loss against one process.

Its `--dry-run` (the same code on the CPU with tiny shapes) runs in the tests
(`tests/test_gpu_check_dry_run.py`); its figures are not device figures and are not shown here.
"""


# ------------------------------------------------------------------------------------- sizes
@dataclass(frozen=True)
class Sizes:
    """Shapes of every part (one set for the GPU, a tiny one for ``--dry-run``)."""

    gpt: dict                       # CharGPT arguments
    gpt_mbs: int                    # samples per micro-batch
    microbatches: int
    hf: dict                        # GPT2Config arguments
    hf_mbs: int
    hf_seq: int
    block: tuple[int, int, int, int]  # width, heads, batch, sequence
    pipe: tuple[int, int, int]      # MLPStack width, micro-batch size, blocks per rank
    warmup: int = 3
    repeats: int = 10
    llama: dict | None = None       # LlamaConfig arguments (fast_stages)
    llama_batch: int = 1
    llama_seq: int = 32
    fast_timeout_s: float = 120.0   # one variant of fast_stages, compilation included

    @property
    def gpt_seq(self) -> int:
        return self.gpt["block_size"]


GPU = Sizes(gpt=dict(vocab_size=256, block_size=1024, n_layer=8, n_head=16, n_embd=1024),
            gpt_mbs=8, microbatches=4,
            hf=dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=4, n_head=12),
            hf_mbs=4, hf_seq=512, block=(4096, 32, 8, 2048), pipe=(1024, 32, 4),
            # Llama 3.2 1B's widths (hidden 2,048, 32 heads, 8 key-value heads, MLP 8,192,
            # vocabulary 128,256) over 8 layers, untied: 1.0 B parameters
            llama=dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                       num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=8,
                       max_position_embeddings=2048),
            llama_batch=4, llama_seq=2048, fast_timeout_s=300.0)
DRY = Sizes(gpt=dict(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64),
            gpt_mbs=2, microbatches=2,
            hf=dict(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=2),
            hf_mbs=2, hf_seq=32, block=(64, 2, 2, 32), pipe=(32, 4, 2), warmup=1, repeats=3,
            llama=dict(vocab_size=256, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=32),
            llama_batch=2, llama_seq=32, fast_timeout_s=180.0)


# ------------------------------------------------------------------------------------- tools
def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def median_s(fn: Callable[[], Any], dev: torch.device, warmup: int, repeats: int) -> float:
    """Median seconds of ``fn()``, the device synchronised before and after each call."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        sync(dev)
        t0 = time.perf_counter()
        fn()
        sync(dev)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def autocast(dev: torch.device, precision: str):
    """The executor's autocast for ``precision`` on ``dev`` (off for fp32)."""
    from fxpipe.execution.dtypes import autocast_dtype

    amp = autocast_dtype(precision)
    return torch.autocast(dev.type, dtype=amp or torch.float32, enabled=amp is not None)


def gpu_profile(dev: torch.device) -> str | None:
    """The ``cluster.gpu`` of ``dev`` (None on a CPU); a GPU fxpipe has no profile of is priced
    as ``device: cuda`` without one (the H100-80GB curves)."""
    if dev.type != "cuda":
        return None
    name = torch.cuda.get_device_name(dev)
    return next((v for k, v in GPU_PROFILES.items() if k in name), None)


def gpt_spec(sz: Sizes, device: str, precision: str, costs: str,
             gpu: str | None = None) -> dict:
    """The CharGPT on 2 pipeline stages of ``device`` (1F1B), priced with ``costs``: on CUDA
    with the GPU model of ``gpu`` (:func:`gpu_profile`), on a CPU with the spec's defaults."""
    if device == "cuda":
        hw = {"gpu": gpu} if gpu else {"memory_gb": 80}
    else:
        hw = {"memory_gb": 16}
    return {"model": {"factory": "fxpipe.examples.gpt:CharGPT", "args": dict(sz.gpt)},
            "data": {"dataset": "fxpipe.examples.data:python_source_text",
                     "batch_size": sz.gpt_mbs * sz.microbatches, "seq_len": sz.gpt_seq},
            "parallel": {"pipeline": 2, "data": 1, "microbatches": sz.microbatches,
                         "schedule": "1f1b"},
            "cluster": {"nodes": 1, "devices_per_node": 2, "device": device, **hw,
                        "costs": costs, "measure_stages": False},
            "train": {"steps": 1, "optimizer": "adamw", "precision": precision, "seed": 0}}


def hf_spec(sz: Sizes, device: str) -> dict:
    """A transformers GPT-2 from a config (random weights, no download), computing its loss."""
    cfg = dict(sz.hf, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return {"model": {"hf": "GPT2LMHeadModel", "config": cfg},
            "data": {"dataset": "fxpipe.examples.data:python_source_lm",
                     "batch_size": sz.hf_mbs, "seq_len": sz.hf_seq},
            "parallel": {"pipeline": 1, "data": 1, "microbatches": 1, "schedule": "1f1b"},
            "cluster": {"nodes": 1, "devices_per_node": 1, "device": device, "costs": "measured"},
            "train": {"steps": 1, "optimizer": "adamw", "loss": "model", "seed": 0}}


# ------------------------------------------------------------------------------------- parts
def part_profile(spec: dict, sz: Sizes, cache: Path) -> dict:
    """``fxpipe profile`` of ``spec``: totals of the measured per-node times (cached under
    ``cache``, where the measured plans of :func:`part_stages` find them)."""
    from fxpipe.training.profiling import profile_spec

    os.environ["FXPIPE_CACHE_DIR"] = str(cache)
    def stamps() -> dict[Path, int]:
        return {p: p.stat().st_mtime_ns for p in (cache / "profiles").glob("*.json")}
    before = stamps() if (cache / "profiles").is_dir() else {}
    text = profile_spec(spec, send=False)  # fxpipe profile's defaults (median of 5 after 2)
    files = [p for p, t in stamps().items() if before.get(p) != t
             and "nodes" in json.loads(p.read_text())]
    if len(files) != 1:
        raise RuntimeError(f"expected one new profile under {cache}, found {len(files)}")
    nodes = json.loads(files[0].read_text())["nodes"]
    tot = [sum(v[i] for v in nodes.values()) for i in range(3)]
    return {"nodes": len(nodes), "fwd_s": tot[0], "bwd_input_s": tot[1], "bwd_weight_s": tot[2],
            "report": text.splitlines()}


def _stage_inputs(plan, sp, tokens: torch.Tensor, dev: torch.device) -> Callable[[], list]:
    """A maker of stage ``sp``'s inputs: the model's tokens, random floats for activations
    (requiring grad as planned), zeros for other integer values."""
    from fxpipe.plans.values import MODEL_INPUT

    def make():
        out = []
        for name in sp.inputs:
            v = plan.values[name]
            dtype = getattr(torch, v.dtype)
            if name in plan.model_inputs or v.producer == MODEL_INPUT:
                out.append(tokens)
            elif dtype.is_floating_point:
                out.append(torch.randn(v.shape, dtype=dtype, device=dev)
                           .requires_grad_(v.requires_grad))
            else:
                out.append(torch.zeros(v.shape, dtype=dtype, device=dev))
        return out
    return make


def _run_stage(plan, sp, mod, make_inputs, target, dev, precision
               ) -> tuple[Callable, Callable, dict]:
    """``(forward, backward, state)`` of one stage: forward (and the loss on the loss stage)
    under the precision's autocast, leaving ``state["roots"]`` and ``state["grads"]``; backward
    from them (the loss, or random output gradients)."""
    state: dict = {}

    def fwd():
        inputs = make_inputs()
        with autocast(dev, precision):
            outs = mod(*inputs)
            outs = outs if isinstance(outs, (tuple, list)) else (outs,)
            if plan.model_output in sp.outputs:
                logits = outs[sp.outputs.index(plan.model_output)]
                state["roots"] = [F.cross_entropy(logits.flatten(0, 1).float(),
                                                  target.flatten())]
                state["grads"] = None
            else:
                roots = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
                state["roots"], state["grads"] = roots, [torch.randn_like(o) for o in roots]

    def bwd():
        torch.autograd.backward(state.pop("roots"), state.pop("grads"))
        mod.zero_grad(set_to_none=True)
    return fwd, bwd, state


def _time_stage(fwd, bwd, dev, warmup, repeats) -> tuple[float, float]:
    f, b = [], []
    for i in range(warmup + repeats):
        sync(dev)
        t0 = time.perf_counter()
        fwd()
        sync(dev)
        t1 = time.perf_counter()
        bwd()
        sync(dev)
        if i >= warmup:
            f.append(t1 - t0)
            b.append(time.perf_counter() - t1)
    return statistics.median(f), statistics.median(b)


def _kernel_seconds(fwd, bwd, dev) -> tuple[float | None, float | None]:
    """Seconds the GPU spent in kernels (and copies) during one forward and one backward
    (``torch.profiler``, CUDA activity only): beside the wall-clock seconds they tell a
    host-bound stage (Python and launch overhead between short kernels) from a slow kernel.
    None on a CPU."""
    if dev.type != "cuda":
        return None, None
    from torch.profiler import ProfilerActivity, profile

    def busy(fn) -> float:
        sync(dev)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            sync(dev)
        return sum(getattr(e, "self_device_time_total", None) or
                   getattr(e, "self_cuda_time_total", 0) for e in prof.key_averages()) * 1e-6
    return busy(fwd), busy(bwd)


def _saved_bytes(fwd, params: set[int]) -> int:
    """Bytes autograd saves for backward in one forward (distinct storages, parameters and
    their autocast copies' sources excluded)."""
    seen: dict[int, int] = {}

    def pack(t):
        if isinstance(t, torch.Tensor) and t.data_ptr() not in params and t.device.type != "meta":
            st = t.untyped_storage()
            seen.setdefault(st.data_ptr(), st.nbytes())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fwd()
    return sum(seen.values())


def _stage_memory(plan, s, sp, mod, fwd, bwd, state, dev, inflight: int) -> dict:
    """The stage's parameter bytes + the allocator's peak over the resident model while it
    holds ``inflight`` micro-batches, runs their backwards and an AdamW step (CUDA only), and
    the bytes saved for backward per micro-batch (any device)."""
    params = list({id(p): p for p in mod.parameters() if p.requires_grad}.values())
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    saved = _saved_bytes(fwd, {p.data_ptr() for p in params})
    bwd()
    opt = torch.optim.AdamW(params, lr=1e-4)
    peak = None
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    held = []
    for _ in range(inflight):  # the in-flight micro-batches' activations, held together
        fwd()
        held.append((state.pop("roots"), state.pop("grads")))
    for roots, grads in held:
        torch.autograd.backward(roots, grads)
    opt.step()
    if dev.type == "cuda":
        sync(dev)
        peak = torch.cuda.max_memory_allocated(dev) - base + param_bytes
    opt.zero_grad(set_to_none=True)
    del opt, held
    return {"stage": s, "inflight": inflight, "predicted_bytes": int(
        plan.predicted.peak_memory_bytes[s] if plan.predicted else sp.memory_bytes),
            "param_bytes": param_bytes, "allocator_peak_bytes": peak,
            "predicted_activation_bytes": int(sp.activation_bytes), "saved_bytes": saved}



def part_stages(sz: Sizes, dev: torch.device, precision: str, cache: Path) -> dict:
    """Plan the CharGPT (analytic and measured costs) and time / weigh its stages."""
    import fxpipe
    from fxpipe.examples.gpt import CharGPT
    from fxpipe.partitioner.split import build_stages, trace_for_plan

    os.environ["FXPIPE_CACHE_DIR"] = str(cache)
    torch.manual_seed(0)
    model = CharGPT(**sz.gpt).to(dev)
    vocab = sz.gpt["vocab_size"]
    tokens = torch.randint(0, vocab, (sz.gpt_mbs, sz.gpt_seq), device=dev)
    target = torch.randint(0, vocab, (sz.gpt_mbs, sz.gpt_seq), device=dev)
    rows, memory = [], []
    for costs in ("analytic", "measured"):
        t0 = time.perf_counter()
        plan = fxpipe.plan(model, gpt_spec(sz, dev.type, precision, costs, gpu_profile(dev)),
                            example_inputs=(tokens,))
        plan_s = time.perf_counter() - t0
        traced = trace_for_plan(plan, model, dev)
        mods = build_stages(plan, traced, list(range(plan.num_stages)))
        for sp in plan.stages:
            make = _stage_inputs(plan, sp, tokens, dev)
            fwd, bwd, state = _run_stage(plan, sp, mods[sp.index], make, target, dev,
                                         precision)
            f, b = _time_stage(fwd, bwd, dev, sz.warmup, sz.repeats)
            kf, kb = _kernel_seconds(fwd, bwd, dev)
            rows.append({"costs": costs, "stage": sp.index, "nodes": len(sp.nodes),
                         "plan_s": plan_s,
                         "predicted_fwd_s": sp.fwd_time_s,
                         "predicted_bwd_s": sp.bwd_input_time_s + sp.bwd_weight_time_s,
                         "predicted_compute_s": sp.compute_time_s,
                         "predicted_loss_s": sp.loss_time_s,
                         "measured_fwd_s": f, "measured_bwd_s": b,
                         "kernel_fwd_s": kf, "kernel_bwd_s": kb})
            if costs == "analytic":
                inflight = (plan.predicted.peak_inflight[sp.index]
                            if plan.predicted and plan.predicted.peak_inflight
                            else min(plan.pipeline - sp.index, plan.microbatches))
                memory.append(_stage_memory(plan, sp.index, sp, mods[sp.index], fwd, bwd,
                                            state, dev, inflight))
        del mods, traced
    return {"precision": precision, "stages": rows, "memory": memory}


def part_mfu(sz: Sizes, dev: torch.device, peak_flops: float, peak_note: str) -> dict:
    """One GPT block, bf16 autocast: forward + backward seconds, FLOPs and MFU."""
    from torch.utils.flop_counter import FlopCounterMode

    from fxpipe.examples.gpt import Block
    from fxpipe.partitioner.cost import EXTRA_FORMULAS

    d, h, b, t = sz.block
    torch.manual_seed(0)
    blk = Block(d, h).to(dev)
    x = torch.randn(b, t, d, device=dev, requires_grad=True)

    def step():
        with autocast(dev, "bf16"):
            y = blk(x)
        y.float().sum().backward()
        blk.zero_grad(set_to_none=True)
        x.grad = None
    counter = FlopCounterMode(display=False, custom_mapping=EXTRA_FORMULAS)
    with counter:
        step()
    counted = float(counter.get_total_flops())
    secs = median_s(step, dev, sz.warmup, sz.repeats)
    formula = 72.0 * b * t * d * d * (1 + t / (6 * d))
    return {"width": d, "heads": h, "batch": b, "seq": t, "seconds": secs,
            "flops_formula": formula, "flops_counted": counted,
            "achieved_flops_per_s": formula / secs, "peak_flops_per_s": peak_flops,
            "peak_note": peak_note, "mfu": formula / secs / peak_flops}


def _pipe_worker(rank: int, mode: str, device: str, pipe: tuple[int, int, int], m: int,
                 steps: int, port: int) -> dict:
    """One rank of the 2-rank pipeline (both ranks on ``device``): ``mode`` ``gloo`` keeps the
    default gloo group (CUDA tensors on it when ``device`` is CUDA), ``nccl`` replaces it with
    an NCCL group on ``device``."""
    import torch.distributed as dist

    from benchmarks._runtime_bench import RunSpec, StackConfig, batch, equal_split, make_plan
    from fxpipe.runtime.executor import PipelineExecutor
    from fxpipe.runtime.mesh import Mesh
    from fxpipe.schedule.lowering import schedule_for_plan

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if mode == "nccl":
        dist.destroy_process_group()
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=2, device_id=dev,
                                timeout=datetime.timedelta(seconds=30))
    width, mbs, blocks = pipe
    cfg = StackConfig(width=width, mbs=mbs, blocks_per_rank=blocks)
    spec = RunSpec("1f1b", 2, m)
    bnd, mods, model = equal_split(cfg, 2)
    x, y = batch(cfg, m)
    x, y = x.to(dev), y.to(dev)
    model.to(dev)  # the stage modules share its parameters
    with torch.no_grad():
        ref = float(F.mse_loss(model(x), y))
    plan = make_plan(bnd, spec, cfg.mbs)
    schedule = schedule_for_plan(plan)
    mesh = Mesh(2, 1, device=dev)
    local = {s: mods[s].to(dev) for s in schedule.stages_of_rank(mesh.pipe_rank)}
    ex = PipelineExecutor(plan, schedule, local, mesh, F.mse_loss, None, 30.0)
    inputs = {plan.model_inputs[0]: x}
    losses, times = [], []
    for _ in range(steps):
        sync(dev)
        t0 = time.perf_counter()
        losses.append(ex.step(inputs, y))
        sync(dev)
        times.append(time.perf_counter() - t0)
    grads = {n: p.grad for mod in local.values() for n, p in mod.named_parameters()}
    return {"backend": dist.get_backend(), "losses": losses, "reference_loss": ref,
            "step_s": times, "grad_device": sorted({str(g.device) for g in grads.values()
                                                    if g is not None})}


def part_pipeline(sz: Sizes, dev: torch.device) -> dict:
    """The 2-rank pipeline with both ranks on ``dev``: gloo, then NCCL (CUDA only)."""
    from benchmarks import gpu_check as me  # importable by name in the spawned ranks
    from fxpipe.runtime.local_ranks import free_port, run_ranks

    device = "cuda:0" if dev.type == "cuda" else "cpu"
    out = {}
    for mode in ("gloo", "nccl"):
        if mode == "nccl" and dev.type != "cuda":
            out[mode] = {"ran": False, "outcome": "not tried: NCCL needs CUDA"}
            continue
        t0 = time.perf_counter()
        try:
            ranks = run_ranks(me._pipe_worker, 2, mode, device, sz.pipe, sz.microbatches, 3,
                              free_port(), timeout_s=90, dist_timeout_s=30)
            r = ranks[-1]  # the last rank holds the loss
            err = abs(r["losses"][-1] - r["reference_loss"])
            out[mode] = {"ran": True, "backend": r["backend"], "device": device,
                         "loss": r["losses"][-1], "reference_loss": r["reference_loss"],
                         "abs_error": err, "step_s": statistics.median(r["step_s"]),
                         "grad_devices": sorted({d for x in ranks for d in x["grad_device"]}),
                         "outcome": f"ran on {device} with {r['backend']}",
                         "seconds": time.perf_counter() - t0}
        except Exception as e:  # the outcome, recorded as it is
            out[mode] = {"ran": False, "device": device, "outcome": _short(e),
                         "seconds": time.perf_counter() - t0}
    if dev.type == "cpu" and not out["gloo"]["ran"]:  # on a CPU gloo must run: a real failure
        raise RuntimeError(f"gloo did not run the 2-rank pipeline: {out['gloo']['outcome']}")
    return out  # on one GPU, either backend refusing is a finding, recorded as it is


# ------------------------------------------------------------------- fast stages (issue 37)
#: the variants of :func:`part_fast_stages`, in the order they run: (name, runner, compile,
#: precision); ``plain`` is a PyTorch training loop of the same model (torchtitan's recipe:
#: torch.compile per transformer block, torchao float8 for fp8), ``fxpipe`` the same model
#: through ``fxpipe.compile`` on one rank (pipeline 1)
FAST_VARIANTS = (("plain eager", "plain", False, "bf16"),
                 ("plain compiled", "plain", True, "bf16"),
                 ("fxpipe eager", "fxpipe", False, "bf16"),
                 ("fxpipe compiled", "fxpipe", True, "bf16"),
                 ("plain compiled fp8", "plain", True, "fp8"),
                 ("fxpipe compiled fp8", "fxpipe", True, "fp8"))


def _llama_config(sz: Sizes) -> dict:
    return dict(sz.llama, attention_dropout=0.0, tie_word_embeddings=False)


def _llama_flops_per_token(cfg: dict, seq: int) -> float:
    """Training FLOPs per token: 6 x the matmul parameters (embedding excluded) plus causal
    attention's 6 x layers x seq x width (scores and values, forward + backward, half
    masked)."""
    d, L, ff = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]
    kv = d * cfg["num_key_value_heads"] // cfg["num_attention_heads"]
    per_layer = d * d * 2 + d * kv * 2 + 3 * d * ff
    matmul = L * per_layer + d * cfg["vocab_size"]  # + the head
    return 6.0 * matmul + 6.0 * L * seq * d


def _fast_worker(rank: int, runner: str, compiled: bool, precision: str, sz: Sizes,
                 device: str) -> dict:
    """One variant of :func:`part_fast_stages` in a process of its own (a fresh compiler
    state and allocator): tokens/s over the timed steps after the warm-up ones."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = _llama_config(sz)
    torch.manual_seed(0)
    with dev:
        model = LlamaForCausalLM(LlamaConfig(**cfg))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg["vocab_size"], (sz.llama_batch, sz.llama_seq), generator=g)
    batch = {"input_ids": ids.to(dev), "labels": ids.to(dev)}
    t0 = time.perf_counter()
    if runner == "plain":
        if precision == "fp8":
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training

            convert_to_float8_training(
                model, config=Float8LinearConfig.from_recipe_name("tensorwise"),
                module_filter_fn=lambda mod, fqn: fqn != "lm_head")
        if compiled:
            for layer in model.model.layers:  # torchtitan: one compiled graph per block
                layer.compile()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        amp = torch.autocast(dev.type, dtype=torch.bfloat16)

        def step() -> float:
            with amp:
                loss = model(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(loss.detach())
    else:
        import fxpipe

        spec = {"model": {"hf": "LlamaForCausalLM", "config": cfg},
                "data": {"batch_size": sz.llama_batch, "seq_len": sz.llama_seq},
                "parallel": {"pipeline": 1, "data": 1, "microbatches": 1, "schedule": "1f1b"},
                "cluster": {"nodes": 1, "devices_per_node": 1, "device": dev.type,
                            **({"gpu": gpu_profile(dev)} if gpu_profile(dev) else
                               {"memory_gb": 16})},
                "train": {"optimizer": "adamw", "lr": 1e-4, "loss": "model",
                          "precision": precision, "compile": "stages" if compiled else "none"}}
        pipe = fxpipe.compile(model, spec, example_kwargs={k: v[:1] for k, v in batch.items()})
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-4)

        def step() -> float:
            loss = pipe.step(batch)
            opt.step()
            pipe.zero_grad()
            return loss
    losses = [step() for _ in range(sz.warmup)]  # compiles in the first
    warm = time.perf_counter() - t0
    times = []
    for _ in range(sz.repeats):
        sync(dev)
        t = time.perf_counter()
        losses.append(step())
        sync(dev)
        times.append(time.perf_counter() - t)
    s = statistics.median(times)
    return {"step_s": s, "tokens_per_s": sz.llama_batch * sz.llama_seq / s,
            "setup_and_warmup_s": warm, "losses": losses,
            "peak_bytes": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None}


def part_fast_stages(sz: Sizes, dev: torch.device, peak_flops: float, peak_note: str) -> dict:
    """A Llama-style model on one rank: tokens/s and MFU of a plain training loop and of
    fxpipe, eager, compiled and compiled + FP8 (the FP8 variants on FP8 tensor cores only)."""
    from benchmarks import gpu_check as me  # importable by name in the spawned ranks
    from fxpipe.execution.fp8 import fp8_problem
    from fxpipe.runtime.local_ranks import run_ranks

    device = "cuda:0" if dev.type == "cuda" else "cpu"
    cfg = _llama_config(sz)
    per_token = _llama_flops_per_token(cfg, sz.llama_seq)
    out: dict = {"config": cfg, "batch": sz.llama_batch, "seq": sz.llama_seq,
                 "flops_per_token": per_token, "peak_flops_per_s": peak_flops,
                 "peak_note": peak_note, "variants": {}}
    fp8_off = fp8_problem(dev)
    for name, runner, compiled, precision in FAST_VARIANTS:
        if precision == "fp8" and fp8_off is not None:
            out["variants"][name] = {"ran": False, "outcome": f"not run: {fp8_off}"}
            continue
        if compiled and dev.type == "cpu":  # the dry run: inductor's C++ build would take
            out["variants"][name] = {      # most of its budget (tests/test_compiled_stages.py
                "ran": False, "outcome": "not run in the dry run: compiling for a CPU takes "
                "longer than its budget (tests/test_compiled_stages.py compiles stages on "
                "CPU)"}
            continue
        t0 = time.perf_counter()
        try:
            r = run_ranks(me._fast_worker, 1, runner, compiled, precision, sz, device,
                          timeout_s=sz.fast_timeout_s, dist_timeout_s=60)[0]
            r.update(ran=True, seconds=time.perf_counter() - t0,
                     mfu=r["tokens_per_s"] * per_token / peak_flops)
            out["variants"][name] = r
        except Exception as e:  # recorded as it is
            out["variants"][name] = {"ran": False, "outcome": _short(e),
                                     "seconds": time.perf_counter() - t0}
    v = out["variants"]
    for mine, theirs in (("fxpipe eager", "plain eager"), ("fxpipe compiled", "plain compiled"),
                         ("fxpipe compiled fp8", "plain compiled fp8")):
        if v.get(mine, {}).get("ran") and v.get(theirs, {}).get("ran"):
            v[mine]["vs_plain"] = v[mine]["tokens_per_s"] / v[theirs]["tokens_per_s"]
    if not all(x.get("ran") for x in v.values() if "not run" not in x.get("outcome", "")):
        bad = {k: x.get("outcome") for k, x in v.items() if not x.get("ran")}
        if dev.type == "cpu":  # on a CPU every bf16 variant must run
            raise RuntimeError(f"fast_stages variants failed: {bad}")
    return out


def _short(e: BaseException, limit: int = 600) -> str:
    text = f"{type(e).__name__}: {e}"
    lines = [ln for ln in text.splitlines() if ln.strip()]
    key = [ln for ln in lines if "Error" in ln or "error" in ln]
    text = " | ".join((key or lines)[-3:])
    return text[:limit]


# ------------------------------------------------------------------------------------- driver
def environment(dev: torch.device, dry_run: bool) -> dict:
    env = {"device": str(dev), "dry_run": dry_run, "torch": torch.__version__,
           "cuda": torch.version.cuda or "", "python": platform.python_version(),
           "host": platform.node(), "started": datetime.datetime.now().isoformat(timespec="seconds")}
    if dev.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(dev)
        env["gpu_memory_bytes"] = torch.cuda.get_device_properties(dev).total_memory
    return env


def peak_for(dev: torch.device, given: float | None) -> tuple[float, str]:
    """Dense bf16 peak FLOP/s for the MFU and where it comes from."""
    if given:
        return given * 1e12, f"--peak-tflops {given:g}"
    if dev.type == "cuda":
        gpu = gpu_profile(dev)
        if gpu is None:
            raise RuntimeError(f"no bf16 peak known for {torch.cuda.get_device_name(dev)!r}; "
                               "pass --peak-tflops")
        from fxpipe.specs.gpus import profile

        return profile(gpu).bf16_tflops * 1e12, f"{gpu} dense bf16 datasheet"
    return 1e12, "nominal 1 TFLOP/s (CPU dry run: the MFU means nothing)"


def _analytic_model(dev: torch.device) -> str:
    gpu = gpu_profile(dev)
    if gpu:
        return f"cluster.gpu: {gpu} (fxpipe.partitioner.gpu_model)"
    if dev.type == "cuda":
        return "device: cuda without a GPU profile (the H100-80GB curves)"
    return "the CPU defaults of the spec"


def run_check(dev: torch.device, sz: Sizes, out: Path, budget_s: float,
              peak_tflops: float | None, only: list[str] | None = None) -> dict:
    """Every part in turn, each in its own try; returns the JSON document."""
    t_start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    cache = out / "cache"  # measured costs of this run only
    shutil.rmtree(cache, ignore_errors=True)
    result = {"environment": environment(dev, dev.type != "cuda"), "sizes": asdict(sz),
              "analytic_model": _analytic_model(dev), "budget_s": budget_s, "parts": {}}
    peak, note = peak_for(dev, peak_tflops) if dev.type == "cpu" or peak_tflops else (None, "")
    parts: dict[str, Callable[[], dict]] = {
        "profile_gpt": lambda: part_profile(gpt_spec(sz, dev.type, "fp32", "measured"), sz,
                                            cache),
        "profile_hf_gpt2": lambda: part_profile(hf_spec(sz, dev.type), sz, cache),
        "stages_fp32": lambda: part_stages(sz, dev, "fp32", cache),
        "stages_bf16": lambda: part_stages(sz, dev, "bf16", cache),
        "mfu_block": lambda: part_mfu(sz, dev, *(peak_for(dev, peak_tflops)
                                                 if peak is None else (peak, note))),
        "pipeline_2rank": lambda: part_pipeline(sz, dev),
        "fast_stages": lambda: part_fast_stages(sz, dev, *(peak_for(dev, peak_tflops)
                                                           if peak is None else (peak, note))),
    }
    for name in PARTS:  # the order and names --only checks against
        fn = parts[name]
        if only and name not in only:
            continue
        spent = time.perf_counter() - t_start
        if spent > budget_s:
            result["parts"][name] = {"ok": False, "error": f"skipped: the {budget_s:g} s budget "
                                     f"was spent ({spent:.0f} s)"}
            continue
        t0 = time.perf_counter()
        try:
            figures = fn()
            result["parts"][name] = {"ok": True, "seconds": time.perf_counter() - t0, **figures}
        except Exception as e:
            result["parts"][name] = {"ok": False, "seconds": time.perf_counter() - t0,
                                     "error": _short(e), "traceback": traceback.format_exc()}
        finally:
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        print(f"{name}: {'ok' if result['parts'][name]['ok'] else 'FAILED'} "
              f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
    result["seconds"] = time.perf_counter() - t_start
    return result


# ------------------------------------------------------------------------------------- report
def _ms(s: float | None) -> str:
    return "n/a" if s is None else f"{s * 1e3:.3f}"


def _mib(b: float | None) -> str:
    return "n/a" if b is None else f"{b / 2**20:.1f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "n/a" if not a or not b else f"{a / b:.2f}"


def markdown(res: dict) -> str:
    """The tables of one run (the body of the ``gpu-check`` section)."""
    env, parts = res["environment"], res["parts"]
    where = env.get("gpu") or "CPU"
    lines = [f"## GPU check on {where}" + (" (DRY RUN: tiny shapes on the CPU, figures mean "
                                           "nothing)" if env["dry_run"] else ""),
             "",
             f"Written by `python benchmarks/gpu_check.py`; torch {env['torch']}, CUDA "
             f"{env['cuda'] or 'none'}, {env['started']}, {res['seconds']:.0f} s in all. "
             f"Analytic cost model: {res['analytic_model']}.", ""]
    failed = [(k, v) for k, v in parts.items() if not v.get("ok")]
    for name in ("profile_gpt", "profile_hf_gpt2"):
        p = parts.get(name, {})
        if p.get("ok"):
            lines.append(f"- `{name}`: {p['nodes']} nodes, forward {_ms(p['fwd_s'])} ms, input "
                         f"gradients {_ms(p['bwd_input_s'])} ms, weight gradients "
                         f"{_ms(p['bwd_weight_s'])} ms per micro-batch (sum of node times).")
    rows, mem = [], []
    for prec in ("fp32", "bf16"):
        p = parts.get(f"stages_{prec}", {})
        if not p.get("ok"):
            continue
        for r in p["stages"]:
            meas = r["measured_fwd_s"] + r["measured_bwd_s"]
            rows.append([prec, r["costs"], r["stage"], r["nodes"], _ms(r["predicted_fwd_s"]),
                         _ms(r["measured_fwd_s"]), _ms(r["predicted_bwd_s"]),
                         _ms(r["measured_bwd_s"]), _ms(r["predicted_compute_s"]), _ms(meas),
                         _ratio(meas, r["predicted_compute_s"]),
                         _ms(r.get("kernel_fwd_s")), _ms(r.get("kernel_bwd_s"))])
        for m in p["memory"]:
            mem.append([prec, m["stage"], m["inflight"], _mib(m["predicted_bytes"]),
                        _mib(m["allocator_peak_bytes"]),
                        _ratio(m["allocator_peak_bytes"], m["predicted_bytes"]),
                        _mib(m["predicted_activation_bytes"]), _mib(m["saved_bytes"]),
                        _ratio(m["saved_bytes"], m["predicted_activation_bytes"])])
    if rows:
        lines += ["", "### Stage times: predicted (analytic / measured cost model) vs run on the "
                  "device, ms per micro-batch", "",
                  markdown_table(["precision", "costs", "stage", "nodes", "pred fwd", "fwd",
                                  "pred bwd", "bwd", "pred total", "total",
                                  "measured / pred", "GPU busy fwd", "GPU busy bwd"], rows),
                  "", "GPU busy: the seconds of kernels in one forward / backward (torch.profiler); "
                  "far below the wall-clock time, the stage waits on the host (Python, "
                  "dispatch, launches) rather than on its kernels."]
    if mem:
        lines += ["", "### Memory per stage (analytic plan), MiB: predicted peak vs the stage's "
                  "parameters + the allocator's peak above the resident model; activations "
                  "saved per micro-batch", "",
                  markdown_table(["precision", "stage", "in flight", "pred peak", "allocator peak",
                                  "alloc / pred", "pred act / mb", "saved / mb", "saved / pred"],
                                 mem)]
    p = parts.get("mfu_block", {})
    if p.get("ok"):
        lines += ["", f"### MFU: one GPT block, width {p['width']}, {p['heads']} heads, bf16, "
                  f"micro-batch {p['batch']} x {p['seq']}", "",
                  markdown_table(["fwd+bwd ms", "FLOPs (72BTd^2(1+T/6d))", "FLOPs counted",
                                  "TFLOP/s", "peak TFLOP/s", "MFU"],
                                 [[_ms(p["seconds"]), f"{p['flops_formula']:.3e}",
                                   f"{p['flops_counted']:.3e}",
                                   f"{p['achieved_flops_per_s'] / 1e12:.1f}",
                                   f"{p['peak_flops_per_s'] / 1e12:g} ({p['peak_note']})",
                                   f"{100 * p['mfu']:.1f}%"]])]
    p = parts.get("pipeline_2rank", {})
    if p.get("ok"):
        prow = []
        for mode in ("gloo", "nccl"):
            v = p.get(mode, {})
            prow.append([mode, "yes" if v.get("ran") else "no",
                         f"{v['abs_error']:.2e}" if v.get("ran") else "",
                         _ms(v.get("step_s")) if v.get("ran") else "", v.get("outcome", "")])
        lines += ["", "### 2-rank pipeline (1F1B) with both ranks on one device", "",
                  markdown_table(["backend", "ran", "loss error vs one process", "step ms",
                                  "outcome"], prow)]
    p = parts.get("fast_stages", {})
    if p.get("ok"):
        c = p["config"]
        frow = []
        for name, v in p["variants"].items():
            if v.get("ran"):
                frow.append([name, f"{v['tokens_per_s']:,.0f}", f"{100 * v['mfu']:.1f}%",
                             f"{v['vs_plain']:.3f}" if "vs_plain" in v else "",
                             f"{v['setup_and_warmup_s']:.0f}",
                             _mib(v.get("peak_bytes")) if v.get("peak_bytes") else ""])
            else:
                frow.append([name, "", "", "", "", v.get("outcome", "")])
        lines += ["", f"### Fast stages: a Llama-style model on one GPU ({c['num_hidden_layers']} "
                  f"layers x {c['hidden_size']}, vocabulary {c['vocab_size']}, batch "
                  f"{p['batch']} x {p['seq']}, AdamW, bf16 autocast): a plain PyTorch loop "
                  "(torch.compile per block, torchao float8) and fxpipe (pipeline 1)", "",
                  markdown_table(["variant", "tokens/s", f"MFU, {p['peak_note']}",
                                  "fxpipe / plain", "setup + warm-up s", "peak MiB / outcome"],
                                 frow)]
    if failed:
        lines += ["", "### Parts that failed", ""]
        lines += [f"- `{k}`: {v['error']}" for k, v in failed]
    return "\n".join(lines) + "\n"


def write_pending(path: Path = BENCHMARKS_MD) -> Path:
    """Put :data:`PENDING` (no CUDA figure yet) into the ``gpu-check`` section."""
    return write_section(SECTION, PENDING, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out",
                    help="folder for gpu_check.json and gpu_check.md (default $OUT)")
    ap.add_argument("--dry-run", action="store_true",
                    help="the same code on the CPU with tiny shapes (figures mean nothing)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="skip the parts that would start after this many seconds "
                         "(default 270 on a GPU, 120 in a dry run)")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="dense bf16 peak of the GPU for the MFU (known: H100, H200, A100)")
    ap.add_argument("--only", nargs="*", help="run only these parts")
    ap.add_argument("--write-benchmarks", action="store_true",
                    help=f"put the tables into the {SECTION!r} section of BENCHMARKS.md")
    args = ap.parse_args(argv)
    if args.dry_run and args.write_benchmarks:
        ap.error("--write-benchmarks refuses dry-run figures (they are not device figures)")
    unknown = sorted(set(args.only or ()) - set(PARTS))
    if unknown:
        ap.error(f"--only: no part named {', '.join(unknown)}; the parts: {', '.join(PARTS)}")
    if args.budget_s is not None and not args.budget_s > 0:
        ap.error(f"--budget-s must be a positive number of seconds (got {args.budget_s:g})")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        ap.error(f"--out {args.out} is a file; give a folder (it is created if missing)")
    if args.dry_run:
        dev, sz = torch.device("cpu"), DRY
        torch.set_num_threads(1)
    else:
        if not torch.cuda.is_available():
            ap.error("torch sees no CUDA device; run with --dry-run to check the script on a CPU")
        dev, sz = torch.device("cuda", 0), GPU
    budget = args.budget_s if args.budget_s is not None else (120.0 if args.dry_run else 270.0)
    out = Path(args.out)
    res = run_check(dev, sz, out, budget, args.peak_tflops, args.only)
    (out / "gpu_check.json").write_text(json.dumps(res, indent=1, default=str))
    md = markdown(res)
    (out / "gpu_check.md").write_text(md)
    print(md)
    if args.write_benchmarks:
        write_section(SECTION, md, BENCHMARKS_MD)
    return 0 if all(p.get("ok") for p in res["parts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
