"""Sharded data parallelism: the state a rank holds, the bytes it sends, what the planner picks.

Writes the ``data-sharding`` section of BENCHMARKS.md:

1. **Held state and collectives, measured vs predicted.** The bundled GPT (tied embedding on
   both stages) trained through ``fxpipe.compile`` at pipeline 2 x data 2 with AdamW, at every
   ``parallel.data_sharding`` level, on 4 gloo ranks: per rank, the storage bytes of
   parameters, gradients and optimizer state after a step and at the step's fullest, and the
   reduce-scatter + all-gather bytes of a step, against
   :func:`fxpipe.plans.state_bytes.held_state_bytes` and
   :func:`~fxpipe.plans.state_bytes.sharded_bytes_sent` of the plan.
2. **Auto picks at scale, with and without sharding.** The 96-layer GPT-3 shape on 1,024
   devices (128 nodes of 8, 80 GB, 400 TFLOP/s bf16, as ``bench_plan_scale``) and a 1T GPT
   (128 layers x 25,600, 160 heads) on 3,072 A100-80GB (as ``bench_tensor_parallel``), each
   planned with ``data_sharding: none`` and ``auto``, at tensor 1 and tensor ``auto``. The
   step times are the analytic cost model's predictions, not measurements.

``python benchmarks/bench_data_sharding.py [--tiny] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import fxpipe  # noqa: E402
from benchmarks import _report  # noqa: E402
from benchmarks.bench_tensor_parallel import GPUS  # noqa: E402
from fxpipe.errors import FxpipeError  # noqa: E402
from fxpipe.examples.gpt import CharGPT  # noqa: E402
from fxpipe.partitioner.bounds import SPLIT_BACKWARD  # noqa: E402
from fxpipe.plans.plan import Plan  # noqa: E402
from fxpipe.plans.state_bytes import held_state_bytes, sharded_bytes_sent  # noqa: E402
from fxpipe.runtime.local_ranks import run_ranks  # noqa: E402
from fxpipe.specs.schema import state_factor  # noqa: E402
from fxpipe.units import human_bytes  # noqa: E402

SECTION = "data-sharding"
LEVELS = ("none", "optimizer", "gradients", "full")
ADAMW_FIELDS = 2  # AdamW's state tensors per parameter (two moments)


# ----------------------------------------------------------------------------- 1. measured
def _model(layers: int, width: int) -> CharGPT:
    torch.manual_seed(0)
    return CharGPT(vocab_size=64, block_size=16, n_layer=layers, n_head=2, n_embd=width)


def _spec(level: str, layers: int, width: int) -> dict:
    return {"model": {"factory": "fxpipe.examples.gpt:CharGPT",
                      "args": {"vocab_size": 64, "block_size": 16, "n_layer": layers,
                               "n_head": 2, "n_embd": width}},
            "data": {"batch_size": 8, "seq_len": 16},
            "parallel": {"pipeline": 2, "data": 2, "microbatches": 2, "schedule": "1f1b",
                         "data_sharding": level},
            "cluster": {"devices_per_node": 4},
            "train": {"optimizer": "adamw", "timeout_s": 120}}


def _held_worker(rank: int, plans: list[dict], layers: int, width: int) -> list[dict]:
    from fxpipe.runtime.data_sharding import state_storage_bytes

    out = []
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 64, (8, 16), generator=g)
    for plan_dict in plans:
        plan = Plan.from_dict(plan_dict)
        pipe = fxpipe.compile(_model(layers, width), plan)
        opt = pipe.shard_optimizer(torch.optim.AdamW(pipe.parameters(), lr=1e-3))
        sharding = pipe.executor.sharding
        for _ in range(2):  # the second step holds what every later one does
            pipe.step(x, x)
            pipe.clip_grad_norm_(1.0)
            opt.step()
            if sharding is not None:
                held, peak = sharding.measure(), dict(sharding.at_reduce)
                sent = pipe.executor.step_bytes_sent[-1].gradients
            else:
                held, peak, sent = state_storage_bytes(pipe.parameters(), opt), {}, 0
            opt.zero_grad()
        out.append({"stages": list(pipe.executor.local_stages), "replica": pipe.replica,
                    "held": held, "peak": peak, "sent": sent})
    return out


def held_and_sent(layers: int, width: int) -> list[dict]:
    from fxpipe.runtime.compression import ring_allreduce_bytes

    x = (torch.zeros(1, 16, dtype=torch.long),)
    plans = [fxpipe.plan(_model(layers, width), _spec(level, layers, width), x)
             for level in LEVELS]
    results = run_ranks(_held_worker, 4, [p.to_dict() for p in plans], layers, width,
                        timeout_s=300)
    rows = []
    for i, plan in enumerate(plans):
        ranks = plan.stage_ranks()
        for r in results:
            got = r[i]
            want = held_state_bytes(plan, got["stages"], got["replica"], ADAMW_FIELDS)
            row = dict(level=plan.data_sharding, stages=got["stages"], replica=got["replica"],
                       held=sum(got["held"].values()), held_pred=sum(want.values()),
                       peak=None, peak_pred=None, sent=None, sent_pred=None)
            if plan.data_sharding != "none":
                peak = held_state_bytes(plan, got["stages"], got["replica"], ADAMW_FIELDS,
                                        peak=True)
                sent = sharded_bytes_sent(plan, got["stages"])
                tied = sum(ring_allreduce_bytes(
                    4 * int(torch.Size(plan.param_shapes[f]).numel()),
                    plan.dp * len({ranks[s] for s in users}))
                    for f, users in plan.shared_params.items()
                    if any(s in users for s in got["stages"]))
                row.update(peak=sum(got["peak"].values()), peak_pred=sum(peak.values()),
                           sent=got["sent"],
                           sent_pred=sent["reduce_scatter"] + sent["all_gather"] + tied)
            rows.append(row)
    return rows


# ----------------------------------------------------------------------------- 2. picks
#: (name, layers, width, heads, vocabulary, global batch, devices, cluster)
GPT3_CLUSTER = {"device_tflops": 400, "memory_GBps": 2039,
                "links": {"intra_node_GBps": 450, "inter_node_GBps": 50}}
SHAPES = [("GPT-3 175B (96 layers)", 96, 12288, 96, 50257, 1536, 1024, GPT3_CLUSTER),
          ("1T (128 layers)", 128, 25600, 160, 51200, 3072, 3072, GPUS["A100-80GB"])]
TINY_SHAPES = [("tiny", 8, 256, 8, 1000, 64, 16, GPT3_CLUSTER)]


def _gpt_spec(shape, tensor, sharding) -> dict:
    _, layers, width, heads, vocab, batch, devices, cluster = shape
    return {"model": {"factory": "fxpipe.examples.gpt:CharGPT",
                      "args": {"vocab_size": vocab, "block_size": 2048, "n_layer": layers,
                               "n_head": heads, "n_embd": width}},
            "data": {"batch_size": batch, "seq_len": 2048},
            "parallel": {"pipeline": "auto", "data": "auto", "tensor": tensor,
                         "microbatches": "auto", "schedule": "auto",
                         "data_sharding": sharding},
            "cluster": {"nodes": devices // 8, "devices_per_node": 8, "device": "cuda",
                        "memory_gb": 80, **cluster},
            "train": {"optimizer": "adamw", "precision": "bf16"}}


def _layout(plan: Plan) -> str:
    rc = sum(st.recompute for st in plan.stages)
    return (f"tp={plan.tensor} pp={plan.pipeline} dp={plan.dp} m={plan.microbatches} "
            f"{plan.schedule}, sharding {plan.data_sharding}"
            + (", gather block" if any(st.param_gather == "block" for st in plan.stages) else "")
            + (f", recompute {rc}/{plan.num_stages}" if rc else ""))


def _state_gb(plan: Plan) -> float:
    """The most training state (weights, gradients, optimizer) one rank holds during a step, in
    GB, as the planner's memory model counts it (``param_bytes x state_factor``; a stage
    gathering its parameters per block: its shards, the gathered blocks on top not counted)."""
    split = plan.schedule in SPLIT_BACKWARD
    per_rank: dict[int, float] = {}
    for s, r in enumerate(plan.stage_ranks()):
        st = plan.stages[s]
        factor = state_factor("adamw", plan.data_sharding, plan.dp, st.param_gather, split)
        per_rank[r] = per_rank.get(r, 0.0) + st.param_bytes * factor
    return max(per_rank.values()) / 1e9


def picks(shapes, log=print) -> list[dict]:
    rows = []
    for shape in shapes:
        name, layers, width, heads, vocab = shape[:5]
        with torch.device("meta"):
            model = CharGPT(vocab_size=vocab, block_size=2048, n_layer=layers, n_head=heads,
                            n_embd=width)
        x = torch.zeros(1, 2048, dtype=torch.long, device="meta")
        for tensor in (1, "auto"):
            for sharding in ("none", "auto"):
                row = dict(name=name, devices=shape[6], tensor=str(tensor), sharding=sharding)
                t0 = time.perf_counter()
                try:
                    plan = fxpipe.plan(model, _gpt_spec(shape, tensor, sharding), (x,))
                    row.update(layout=_layout(plan), step_s=plan.predicted.step_time_s,
                               state_gb=_state_gb(plan))
                except FxpipeError as e:
                    row.update(layout=f"no plan: {str(e).splitlines()[0][:70]}", step_s=None,
                               state_gb=None)
                row["plan_s"] = time.perf_counter() - t0
                log(row)
                rows.append(row)
    return rows


# ----------------------------------------------------------------------------- report
def _b(v) -> str:
    return "-" if v is None else human_bytes(v)


def report(held_rows, pick_rows, layers: int, width: int, note: str) -> str:
    lines = [f"Written by `benchmarks/bench_data_sharding.py` ({note}).", "",
             f"**What each rank holds and sends, measured vs predicted** (bundled GPT, {layers} "
             f"layers x {width}, embedding tied across the 2 stages, pipeline 2 x data 2, "
             "AdamW, fp32, 4 gloo ranks, the second step): storage bytes of parameters + "
             "gradients + optimizer state after the step and at its fullest (gradients "
             "computed, before their reduction), and the bytes sent by the step's "
             "reduce-scatters, all-gathers and the tied embedding's all-reduce, against "
             "`held_state_bytes` and `sharded_bytes_sent` of the plan.", ""]
    lines += _report.markdown_table(
        ["level", "rank's stages", "replica", "held", "predicted", "peak", "predicted",
         "sent", "predicted"],
        [[r["level"], ", ".join(map(str, r["stages"])), str(r["replica"]), _b(r["held"]),
          _b(r["held_pred"]), _b(r["peak"]), _b(r["peak_pred"]), _b(r["sent"]),
          _b(r["sent_pred"])] for r in held_rows]).splitlines()
    lines += ["", "**Auto picks with and without sharding** (every parallel field `auto` "
              "except those named; bf16 with fp32 master weights, AdamW, sequence 2,048; "
              "nodes of 8 devices of 80 GB; GPT-3: 400 TFLOP/s, NVLink 450 GB/s, 50 GB/s per "
              "device between nodes, the GPU cost model with the H100 curves; 1T: `cluster.gpu: A100-80GB`). Step "
              "times are the analytic cost model's predictions, not measurements; state: the "
              "most weights + gradients + optimizer state one rank holds, as the plan "
              "predicts it; planning time on this machine in the last column.", ""]
    lines += _report.markdown_table(
        ["model", "devices", "tensor", "data_sharding", "pick", "predicted s/step",
         "state per rank", "plan s"],
        [[r["name"], f"{r['devices']:,}", r["tensor"], r["sharding"], r["layout"],
          "-" if r["step_s"] is None else f"{r['step_s']:.2f}",
          "-" if r["state_gb"] is None else f"{r['state_gb']:.1f} GB", f"{r['plan_s']:.1f}"]
         for r in pick_rows]).splitlines()
    lines += ["", "What sharding bought:", ""] + [f"- {t}" for t in _bought(pick_rows)]
    return "\n".join(lines) + "\n"


def _bought(pick_rows) -> list[str]:
    """One line per model and tensor setting: the auto pick with sharding against without."""
    out = []
    for r in pick_rows:
        if r["sharding"] != "auto":
            continue
        plain = next(p for p in pick_rows if p["name"] == r["name"] and p["tensor"] == r["tensor"]
                     and p["sharding"] == "none")
        head = f"{r['name']}, tensor {r['tensor']}: "
        if r["step_s"] is None:
            out.append(head + "no plan either way (the model needs tensor parallelism)")
        elif plain["step_s"] is None:
            out.append(head + f"a plan only with sharding ({r['layout']})")
        else:
            out.append(head + f"{plain['layout']} -> {r['layout']}; predicted step "
                       f"{plain['step_s']:.2f} -> {r['step_s']:.2f} s "
                       f"({(r['step_s'] / plain['step_s'] - 1) * 100:+.1f}%)")
    return out


def main(argv: list[str] | None = None, out: Path | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="small shapes, seconds (smoke test)")
    ap.add_argument("--out", type=Path, default=out or _report.BENCHMARKS_MD)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    layers, width = (2, 16) if args.tiny else (4, 64)
    held_rows = held_and_sent(layers, width)
    pick_rows = picks(TINY_SHAPES if args.tiny else SHAPES)
    note = f"{'--tiny, ' if args.tiny else ''}{time.perf_counter() - t0:.0f} s"
    _report.write_section(SECTION, report(held_rows, pick_rows, layers, width, note), args.out)
    print(f"wrote section '{SECTION}' of {args.out}")
    return {"held": held_rows, "picks": pick_rows}


if __name__ == "__main__":
    main()
