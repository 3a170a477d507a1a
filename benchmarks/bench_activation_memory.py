"""Activation memory per micro-batch in flight: the plan's figure against what a stage holds.

Writes the ``activation-memory`` section of BENCHMARKS.md. The bundled GPT (4 layers x 128,
sequence 128, micro-batch 4, fp32) is planned on 2 CPU devices at pipeline 2, 1F1B, with
``train.activation_recompute`` off, selective and full, full with ``recompute_layers: 1``
(partial: each stage recomputes the first of its 2 blocks), and with ``activation_offload: on``.
Each stage of each plan runs its forward on 4 micro-batches in one process, as a rank does
(:class:`fxpipe.runtime.stage.StageWork`, no backward), and the live heap bytes (glibc's
``mallinfo2``: bytes in use, freed memory kept in the process as the ranks keep it) grow by
what the stage holds per micro-batch in flight until its backward: set beside the plan's
``activation_bytes``. Each micro-batch's outputs are sent as the executor sends them: the
stage lets go of their data (``StageWork.sent``) and the send's alias holds it; on CPU (gloo)
until the consumer's gradient arrives, before B, so the plan counts them per micro-batch in
flight. Then the sends finish (the aliases dropped, as NCCL's completed sends are reaped
during the step) and the heap is read again: set beside the plan's figure under the CUDA rule
(``fxpipe.partitioner.cutting.sends_released``: the outputs only other ranks read left out).
The model's output, on the loss stage, is listed apart: the runtime holds it until B, and
the plan does not count it. Offload on a
CPU moves the bytes within the same memory, so there the bytes the hooks moved are set beside
the plan's ``offload_bytes`` instead.

``python benchmarks/bench_activation_memory.py [--out FILE]``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import fxpipe  # noqa: E402
from benchmarks import _report  # noqa: E402
from fxpipe.examples.gpt import CharGPT  # noqa: E402
from fxpipe.execution.host_memory import keep_freed_memory  # noqa: E402
from fxpipe.partitioner.split import materialize_stages  # noqa: E402
from fxpipe.runtime.stage import StageWork  # noqa: E402

SECTION = "activation-memory"
IN_FLIGHT = 4
SHAPE = dict(n_layer=4, n_embd=128, n_head=4, block_size=128)
MBS, SEQ = 4, 128


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                               "usmblks", "fsmblks", "uordblks", "fordblks",
                                               "keepcost")]


def _live_bytes_reader():
    """A function returning the heap bytes in use (glibc ``mallinfo2``), or None."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        fn = libc.mallinfo2
    except (OSError, AttributeError, TypeError):
        return None
    fn.restype = _Mallinfo2

    def live() -> int:
        m = fn()
        return int(m.uordblks + m.hblkhd)

    return live


def _spec(recompute: str, offload: str, layers: int | None = None) -> dict:
    return {"model": {"factory": "fxpipe.examples.gpt:CharGPT", "args": SHAPE},
            "data": {"batch_size": MBS * 8, "seq_len": SEQ},
            "parallel": {"pipeline": 2, "data": 1, "microbatches": 8, "schedule": "1f1b"},
            "cluster": {"nodes": 1, "devices_per_node": 2, "host_memory_gb": 1.0},
            "train": {"activation_recompute": recompute, "activation_offload": offload,
                      **({"recompute_layers": layers} if layers else {})}}


def measure(recompute: str, offload: str, live, layers: int | None = None) -> list[dict]:
    """Per stage of the plan: predicted and measured bytes per micro-batch in flight
    (``layers``: ``train.recompute_layers``)."""
    torch.manual_seed(0)
    model = CharGPT(**SHAPE)
    plan = fxpipe.plan(model, _spec(recompute, offload, layers),
                       torch.randint(0, 256, (MBS, SEQ)))
    mods = materialize_stages(plan, model, list(range(plan.num_stages)))
    consumers: dict[str, list[int]] = {}
    for name, v in plan.values.items():
        for c in v.consumers:
            consumers.setdefault(name, []).append(c)
    rows = []
    for j, st in enumerate(plan.stages):
        last = j == plan.num_stages - 1
        work = StageWork(st, mods[j], plan.values, consumers, False, contextlib.nullcontext,
                         str, loss_input=plan.model_output if last else None)
        # pipeline 2, one stage a rank: every reader of a stage's output is on the other rank
        work.release_after = {o: len(set(consumers[o])) for o in st.outputs if consumers.get(o)}
        g = torch.Generator().manual_seed(j)
        ins = [torch.randint(0, 256, tuple(plan.values[n].shape), generator=g)
               if plan.values[n].dtype == "int64"
               else torch.randn(tuple(plan.values[n].shape), generator=g)
               for n in st.inputs]
        target = torch.randint(0, 256, (MBS, SEQ), generator=g)

        def loss_fn(o, t):
            return F.cross_entropy(o.flatten(0, 1), t.flatten())

        def fresh():
            return [t.clone().requires_grad_() if t.is_floating_point() else t for t in ins]

        for i in range(2):  # warm-up: the allocator settles
            work.forward(i, fresh(), loss_fn if last else None, target if last else None)
        work.reset()
        inputs = [fresh() for _ in range(IN_FLIGHT)]
        sends = []  # what the sends hold (p2p.isend's detached alias) until they finish
        before = live()
        moved0 = work.offload.out_bytes if work.offload else 0
        for i in range(IN_FLIGHT):
            work.forward(i, inputs[i], loss_fn if last else None, target if last else None)
            for o, n in work.release_after.items():
                for _ in range(n):
                    sends.append(work.output(i, o).detach())
                    work.sent(i, o)
        held = (live() - before) / IN_FLIGHT
        sends.clear()  # the sends finished
        reaped = (live() - before) / IN_FLIGHT
        moved = ((work.offload.out_bytes - moved0) / IN_FLIGHT) if work.offload else 0.0
        work.reset()
        outs = sum(plan.values[o].nbytes for o in st.outputs  # the model's output: B starts
                   if o in plan.values and not plan.values[o].consumers)  # from it
        sent = sum(plan.values[o].nbytes for o in work.release_after)
        mode = offload == "on" and "offload" or recompute
        rows.append(dict(mode=f"{mode}, recompute_layers {layers}" if layers else mode, stage=j,
                         how=("offload" if st.offload_bytes else st.recompute_mode),
                         predicted=st.activation_bytes, measured=held, outputs=outs,
                         cuda_pred=st.activation_bytes - sent, reaped=reaped,
                         offload_pred=st.offload_bytes, offload_moved=moved))
    return rows


def _mb(x: float) -> str:
    return f"{x / 1e6:.2f}"


def report(rows: list[dict], note: str) -> str:
    table = _report.markdown_table(
        ["asked", "stage", "stage does", "plan: activation MB / micro-batch",
         "measured MB / micro-batch", "measured / plan",
         "model output held MB (not in the plan)",
         "plan + model output / measured",
         "CUDA rule: plan MB (sent outputs left out)", "measured, sends finished MB",
         "CUDA rule: plan + model output / measured",
         "offload: plan MB", "offload: moved MB"],
        [[r["mode"], str(r["stage"]), r["how"], _mb(r["predicted"]), _mb(r["measured"]),
          f"{r['measured'] / r['predicted']:.2f}"
          if r["predicted"] >= 0.01 * r["measured"] and not r["offload_pred"] else "-",
          _mb(r["outputs"]),
          f"{(r['predicted'] + r['outputs']) / r['measured']:.2f}"
          if r["measured"] and not r["offload_pred"] else "-",
          _mb(r["cuda_pred"]), _mb(r["reaped"]),
          f"{(r['cuda_pred'] + r['outputs']) / r['reaped']:.2f}"
          if r["reaped"] >= 0.1e6 and not r["offload_pred"] else "-",
          _mb(r["offload_pred"]) if r["offload_pred"] else "-",
          _mb(r["offload_moved"]) if r["offload_pred"] else "-"] for r in rows])
    return (f"Written by `benchmarks/bench_activation_memory.py` ({note}).\n\n"
            f"**Activation memory per micro-batch in flight, plan against a stage's forward.** "
            f"CharGPT {SHAPE['n_layer']} x {SHAPE['n_embd']}, sequence {SEQ}, micro-batch {MBS}, "
            "fp32, pipeline 2, 1F1B on 2 CPU devices; each stage runs its forward on "
            f"{IN_FLIGHT} micro-batches as a rank does, and the live heap (glibc `mallinfo2`) "
            "grows by what it holds until their backward. Each micro-batch's outputs are "
            "sent as the executor sends them: the stage lets go of their data and the send "
            "holds it, on CPU (gloo) until the consumer's gradient arrives, before B (the plan "
            "on CPU counts them per micro-batch in flight); with the sends finished, as NCCL's "
            "are during the step, the heap is read again and set beside the plan under the "
            "CUDA rule, which leaves the outputs only other ranks read out "
            "(`cutting.sends_released`). The model's output on the loss stage is listed apart. "
            "On a CPU offload moves bytes within "
            "the same memory (so its heap growth includes the host copies); its row sets the "
            "bytes the hooks moved beside the plan's instead.\n\n" + table + "\n")


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=_report.BENCHMARKS_MD)
    args = ap.parse_args(argv)
    live = _live_bytes_reader()
    if live is None:
        print("glibc mallinfo2 is not available here: nothing measured", file=sys.stderr)
        return []
    keep_freed_memory()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    rows = []
    for rec, off, layers in (("off", "off", None), ("selective", "off", None),
                             ("full", "off", None), ("full", "off", 1), ("off", "on", None)):
        rows += measure(rec, off, live, layers)
        for r in rows[-2:]:
            print(r, flush=True)
    _report.write_section(SECTION, report(rows, f"{time.perf_counter() - t0:.0f} s, "
                                                f"torch {torch.__version__}"), args.out)
    return rows


if __name__ == "__main__":
    main()
