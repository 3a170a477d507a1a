"""Tensor parallelism: what it moves, what the planner picks at scale, what it costs on a CPU.

Writes the ``tensor-parallel`` section of BENCHMARKS.md:

1. **Collective bytes, measured vs predicted.** Small models trained through ``fxpipe.compile``
   at tensor 2 (with and without sequence parallelism, alone and beside a pipeline): the bytes
   of every collective the tensor group ran in one training step (every rank reports each
   collective's whole-tensor bytes to the mesh's recorder, ``Mesh.tp_recorder``), against
   the plan's prediction (each stage's ``tensor_bytes`` per micro-batch x micro-batches).
2. **Auto picks at scale.** GPT shapes from 1.7B to 1T parameters (the shapes, batches and
   device counts of Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
   Clusters Using Megatron-LM", SC'21, Table 1; vocabulary 51,200, sequence 2,048, bf16, AdamW)
   on nodes of 8 A100-80GB and of 8 H100-80GB, planned with every parallel field ``auto``
   (tensor included), beside the paper's own layout (its tensor x pipeline, the rest of the
   devices data-parallel) planned and priced by the same cost model. Predicted step times are
   the GPU cost model's (``cluster.gpu``): not measured.
3. **CPU step time, tensor 1 vs 2.** The same GPT trained on 2 gloo ranks of this machine as 2
   data-parallel replicas or as one tensor group of 2: the median step. Gloo over loopback on
   2 shared cores: tensor parallelism communicates in every layer and gains nothing here; it
   exists to split models that do not fit one device.

``python benchmarks/bench_tensor_parallel.py [--tiny] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import fxpipe  # noqa: E402
from benchmarks import _report  # noqa: E402
from fxpipe.errors import FxpipeError  # noqa: E402
from fxpipe.examples.gpt import CharGPT  # noqa: E402
from fxpipe.plans.plan import Plan  # noqa: E402
from fxpipe.runtime.local_ranks import run_ranks  # noqa: E402
from fxpipe.units import human_bytes  # noqa: E402

SECTION = "tensor-parallel"

#: GPU nodes: the ``cluster.gpu`` profiles (fxpipe/specs/gpus.py: dense bf16 peak, HBM, NCCL
#: bus bandwidth of NVLink and of one GPU's NIC, and the GPU cost model's efficiency curves)
GPUS = {"A100-80GB": {"gpu": "A100-80GB"}, "H100-80GB": {"gpu": "H100-80GB"}}
#: (name, layers, width, heads, global batch, GPUs, the paper's tensor, pipeline)
SHAPES = [("1.7B", 24, 2304, 24, 512, 32, 1, 1), ("7.5B", 36, 4096, 32, 512, 128, 4, 1),
          ("39.1B", 48, 8192, 64, 1536, 512, 8, 2), ("145.6B", 80, 12288, 96, 2304, 1536, 8, 8),
          ("1T", 128, 25600, 160, 3072, 3072, 8, 64)]
TINY_SHAPES = [("tiny", 8, 256, 8, 64, 16, 2, 2)]


# ----------------------------------------------------------------------------- 1. bytes
def _model(vocab=64, layers=2, width=32, heads=4):
    torch.manual_seed(0)
    return CharGPT(vocab_size=vocab, block_size=16, n_layer=layers, n_head=heads, n_embd=width)


def _spec(p: int, d: int, t: int, sp: bool, m: int = 2, layers: int = 2) -> dict:
    return {"model": {"factory": "fxpipe.examples.gpt:CharGPT",
                      "args": {"vocab_size": 64, "block_size": 16, "n_layer": layers,
                               "n_head": 4, "n_embd": 32}},
            "data": {"batch_size": 4 * d * m, "seq_len": 16},
            "parallel": {"pipeline": p, "data": d, "tensor": t, "microbatches": m,
                         "schedule": "1f1b", "sequence_parallel": sp},
            "cluster": {"devices_per_node": p * d * t},
            "train": {"optimizer": "sgd", "timeout_s": 120}}


def _bytes_worker(rank: int, plan_dict: dict, steps: int) -> dict:
    plan = Plan.from_dict(plan_dict)
    pipe = fxpipe.compile(_model(), plan)
    seen: list[tuple[str, int]] = []

    def count(kind, nbytes, t0, t1):
        seen.append((kind, nbytes))

    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 64, (plan.dp * plan.microbatches * plan.microbatch_size, 16),
                      generator=g)
    pipe.step(x, x)  # warm-up (the same collectives)
    times = []
    with pipe.mesh.tp_recorder.to(count):  # besides the executor's timeline
        for _ in range(steps):
            t0 = time.perf_counter()
            pipe.step(x, x)
            times.append(time.perf_counter() - t0)
    return {"stages": list(pipe.stages), "count": len(seen) / steps,
            "bytes": sum(b for _, b in seen) / steps, "step_s": statistics.median(times)}


def collective_bytes(configs) -> list[dict]:
    rows = []
    for p, d, t, sp in configs:
        plan = fxpipe.plan(_model(), _spec(p, d, t, sp), (torch.zeros(1, 16, dtype=torch.long),))
        res = run_ranks(_bytes_worker, p * d * t, plan.to_dict(), 2, timeout_s=300)
        for r in res[:p * t:t]:  # tensor rank 0 of one replica: the others repeat it
            pred_n = sum(plan.stages[s].tensor_collectives for s in r["stages"]) * plan.microbatches
            pred_b = sum(sum(plan.stages[s].tensor_bytes) for s in r["stages"]) * plan.microbatches
            rows.append(dict(layout=f"tp={t} pp={p} dp={d}" + (" SP" if sp else ""),
                             stages=r["stages"], measured_n=r["count"], predicted_n=pred_n,
                             measured=r["bytes"], predicted=pred_b))
    return rows


# ----------------------------------------------------------------------------- 2. picks
def _gpt_spec(layers, width, heads, batch, gpus, gpu, tensor="auto", pipeline="auto",
              data="auto") -> dict:
    return {"model": {"factory": "fxpipe.examples.gpt:CharGPT",
                      "args": {"vocab_size": 51200, "block_size": 2048, "n_layer": layers,
                               "n_head": heads, "n_embd": width}},
            "data": {"batch_size": batch, "seq_len": 2048},
            "parallel": {"pipeline": pipeline, "data": data, "tensor": tensor,
                         "microbatches": "auto", "schedule": "auto"},
            "cluster": {"nodes": gpus // 8, "devices_per_node": 8, "device": "cuda",
                        "memory_gb": 80, **GPUS[gpu]},
            "train": {"optimizer": "adamw", "precision": "bf16"}}


def _layout(plan: Plan) -> str:
    rc = sum(st.recompute for st in plan.stages)
    return (f"tp={plan.tensor} pp={plan.pipeline} dp={plan.dp} m={plan.microbatches} "
            f"{plan.schedule}" + (f", recompute {rc}/{plan.num_stages}" if rc else ""))


def picks(shapes, gpus=tuple(GPUS), log=print) -> list[dict]:
    rows = []
    for name, layers, width, heads, batch, n, t, p in shapes:
        with torch.device("meta"):
            model = CharGPT(vocab_size=51200, block_size=2048, n_layer=layers, n_head=heads,
                            n_embd=width)
        x = torch.zeros(1, 2048, dtype=torch.long, device="meta")
        params = sum(q.numel() for q in model.parameters())
        for gpu in gpus:
            row = dict(name=name, params=params, gpus=n, gpu=gpu, batch=batch)
            t0 = time.perf_counter()
            try:
                auto = fxpipe.plan(model, _gpt_spec(layers, width, heads, batch, n, gpu), (x,))
                row.update(auto=_layout(auto), auto_s=auto.predicted.step_time_s,
                           plan_s=time.perf_counter() - t0)
            except FxpipeError as e:
                row.update(auto=f"no plan: {str(e).splitlines()[0][:60]}", auto_s=None,
                           plan_s=time.perf_counter() - t0)
            try:
                hand = fxpipe.plan(model, _gpt_spec(layers, width, heads, batch, n, gpu, t, p,
                                                    n // (t * p)), (x,))
                row.update(hand=_layout(hand), hand_s=hand.predicted.step_time_s)
            except FxpipeError as e:
                row.update(hand=f"tp={t} pp={p}: no plan ({str(e).splitlines()[0][:50]})",
                           hand_s=None)
            log(row)
            rows.append(row)
    return rows


# ----------------------------------------------------------------------------- 3. CPU steps
def cpu_steps(rounds: int, layers: int = 4) -> list[dict]:
    out = []
    for p, d, t in ((1, 2, 1), (1, 1, 2)):
        spec = _spec(p, d, t, False, m=2, layers=layers)
        spec["model"]["args"].update(n_embd=128, n_layer=layers)
        model = CharGPT(vocab_size=64, block_size=16, n_layer=layers, n_head=4, n_embd=128)
        plan = fxpipe.plan(model, spec, (torch.zeros(1, 16, dtype=torch.long),))
        times = [r["step_s"] for r in run_ranks(_cpu_worker, p * d * t, plan.to_dict(), rounds,
                                                layers, timeout_s=300)]
        out.append(dict(layout=f"tp={t} dp={d}", step_s=max(times)))
    return out


def _cpu_worker(rank: int, plan_dict: dict, steps: int, layers: int) -> dict:
    plan = Plan.from_dict(plan_dict)
    torch.manual_seed(0)
    pipe = fxpipe.compile(CharGPT(vocab_size=64, block_size=16, n_layer=layers, n_head=4,
                                  n_embd=128), plan)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 64, (plan.dp * plan.microbatches * plan.microbatch_size, 16),
                      generator=g)
    pipe.step(x, x)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        pipe.step(x, x)
        times.append(time.perf_counter() - t0)
    return {"step_s": statistics.median(times)}


# ----------------------------------------------------------------------------- report
def _ms(s):
    return "-" if s is None else f"{s * 1e3:,.0f}"


def report(bytes_rows, pick_rows, cpu_rows, note: str) -> str:
    lines = [f"Written by `benchmarks/bench_tensor_parallel.py` ({note}).", "",
             "**Collectives of the tensor group, one training step, per rank: measured vs "
             "the plan's prediction** (bundled GPT, 2 layers x 32, 2 micro-batches of 4 x 16 "
             "tokens, fp32; bytes are whole tensors, as the plan counts them; SP: sequence "
             "parallelism):", ""]
    lines += _report.markdown_table(
        ["layout", "rank's stages", "collectives measured", "predicted", "bytes measured",
         "predicted"],
        [[r["layout"], ", ".join(map(str, r["stages"])), f"{r['measured_n']:g}",
          f"{r['predicted_n']:g}", human_bytes(r["measured"]), human_bytes(r["predicted"])]
         for r in bytes_rows]).splitlines()
    lines += ["", "**Auto picks and predicted steps at scale** (every parallel field `auto`, "
              "tensor included, beside the layout of Narayanan et al., SC'21, Table 1, planned "
              "by the same model: GPT, vocabulary 51,200, sequence 2,048, bf16, AdamW; nodes "
              "of 8 GPUs, 80 GB each, `cluster.gpu: A100-80GB` / `H100-80GB`: the GPU cost "
              "model of `fxpipe/partitioner/gpu_model.py`, flash attention). The times are "
              "that model's predictions, not measurements (`published-runs` compares it with "
              "published A100 runs); planning time on this machine in the last column.", ""]
    lines += _report.markdown_table(
        ["model", "GPUs", "batch", "GPU", "auto pick", "predicted ms/step", "hand layout",
         "predicted ms/step", "plan s"],
        [[r["name"], str(r["gpus"]), str(r["batch"]), r["gpu"], r["auto"], _ms(r["auto_s"]),
          r["hand"], _ms(r["hand_s"]), f"{r['plan_s']:.1f}"] for r in pick_rows]).splitlines()
    if cpu_rows:
        base = cpu_rows[0]["step_s"]
        lines += ["", "**CPU step, tensor 1 vs 2** (bundled GPT 4 layers x 128, 2 gloo ranks "
                  "on this machine's 2 shared cores, median step of the slowest rank). Gloo "
                  "over loopback: the tensor group's collectives run in every layer on the "
                  "same cores that compute, so tensor parallelism only costs here; it is for "
                  "models that do not fit a device.", ""]
        lines += _report.markdown_table(
            ["layout", "ms/step", "vs tp=1 dp=2"],
            [[r["layout"], f"{r['step_s'] * 1e3:.1f}", f"{r['step_s'] / base:.2f}x"]
             for r in cpu_rows]).splitlines()
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None, out: Path | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="small shapes, seconds (smoke test)")
    ap.add_argument("--out", type=Path, default=out or _report.BENCHMARKS_MD)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    configs = [(1, 1, 2, False), (1, 1, 2, True)] if args.tiny else [
        (1, 1, 2, False), (1, 1, 2, True), (2, 1, 2, False), (2, 1, 2, True), (1, 2, 2, False)]
    bytes_rows = collective_bytes(configs)
    pick_rows = picks(TINY_SHAPES if args.tiny else SHAPES,
                      gpus=("A100-80GB",) if args.tiny else tuple(GPUS))
    cpu_rows = cpu_steps(2 if args.tiny else 20, layers=2 if args.tiny else 4)
    note = f"{'--tiny, ' if args.tiny else ''}{time.perf_counter() - t0:.0f} s"
    _report.write_section(SECTION, report(bytes_rows, pick_rows, cpu_rows, note), args.out)
    print(f"wrote section '{SECTION}' of {args.out}")
    return {"bytes": bytes_rows, "picks": pick_rows, "cpu": cpu_rows}


if __name__ == "__main__":
    main()
