"""Your own training loop on fxpipe: a byte-level GPT on 2 pipeline stages x 2 replicas.

    torchrun --nproc-per-node 4 examples/train_torchrun.py --steps 40 --out runs/example

``fxpipe.compile`` returns this rank's share of the model; everything else is the loop you
would write for one process: AdamW with weight decay on the weight matrices only, a warm-up +
cosine learning-rate schedule, gradient clipping, gradient accumulation, held-out evaluation,
and torch.distributed.checkpoint (DCP) checkpoints of the model and the optimizer that a later
run resumes from (``--resume``). The final weights load into the plain model in one process:
``fxpipe.training.checkpoint.load_into_model(model, OUT/"model")``.

Every rank feeds the same GLOBAL batch (the pipeline slices each replica's part and feeds the
first stage the inputs and the last stage the targets), so the data loader only has to be
deterministic: here ``ByteBatches`` over the Python standard library's sources.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)

import fxpipe
from fxpipe.examples.data import ByteBatches, python_source_text
from fxpipe.examples.gpt import CharGPT

BATCH, SEQ = 16, 64  # global batch: 2 replicas x 4 micro-batches x 2 samples
SPEC = {
    "model": {"factory": "fxpipe.examples.gpt:CharGPT"},
    "data": {"batch_size": BATCH, "seq_len": SEQ},
    "parallel": {"pipeline": 2, "data": 2, "microbatches": 4, "schedule": "1f1b"},
    "cluster": {"nodes": 1, "devices_per_node": 4, "device": "cpu", "memory_gb": 4,
                "device_tflops": 0.02},
    "train": {"loss": "cross_entropy", "timeout_s": 120},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40, help="optimizer steps")
    ap.add_argument("--accum", type=int, default=2, help="batches per optimizer step")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--out", type=Path, default=Path("runs/example"))
    ap.add_argument("--resume", action="store_true", help="continue from OUT/state")
    ap.add_argument("--stop-after", type=int, default=None,
                    help="save OUT/state and stop after this many steps (resume with --resume)")
    args = ap.parse_args()
    torch.set_num_threads(1)

    torch.manual_seed(0)
    model = CharGPT(vocab_size=256, block_size=SEQ, n_layer=4, n_head=4, n_embd=64)
    data = ByteBatches(python_source_text(), batch_size=BATCH, seq_len=SEQ, seed=0)
    example, _ = data.get(0)
    # plans on rank 0 (joining torchrun's process group), builds this rank's stages
    pipe = fxpipe.compile(model, SPEC, example_inputs=(example[:1],),
                          grad_accumulation=args.accum)
    rank0 = dist.get_rank() == 0
    print(f"rank {pipe.rank}: pipeline rank {pipe.pipe_rank}, replica {pipe.replica}, stages "
          f"{list(pipe.stages)}, {sum(p.numel() for p in pipe.parameters())} parameters",
          flush=True)

    named = list(pipe.named_parameters())  # original names: "h.0.fc.weight", "wte.weight", ...
    opt = torch.optim.AdamW([
        {"params": [p for n, p in named if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for n, p in named if p.dim() < 2], "weight_decay": 0.0}], lr=args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup)
                                              * 0.5 * (1 + math.cos(math.pi * s / args.steps)))

    flat = StateDictOptions(flatten_optimizer_state_dict=True)  # keyed by parameter name
    start = 0
    if args.resume:
        state = {"model": pipe.state_dict(), "optim": get_optimizer_state_dict(pipe.module, opt,
                                                                               options=flat),
                 "step": torch.zeros((), dtype=torch.int64)}
        dcp.load(state, checkpoint_id=str(args.out / "state"))
        pipe.load_state_dict(state["model"])
        set_optimizer_state_dict(pipe.module, opt, state["optim"], options=flat)
        start = int(state["step"])
        for _ in range(start):
            sched.step()

    end = args.steps if args.stop_after is None else min(args.steps, args.stop_after)
    for step in range(start, end):
        loss = 0.0
        for j in range(args.accum):
            x, y = data.get(step * args.accum + j)
            loss += pipe.step(x, y) / args.accum  # forward, backward, all-reduce; no update
        norm = pipe.clip_grad_norm_(1.0)  # over every stage and replica
        lr = sched.get_last_lr()[0]
        opt.step()
        sched.step()
        pipe.zero_grad()
        if rank0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss:.4f}  grad norm {float(norm):.3f}  lr {lr:.2e}",
                  flush=True)
        if (step + 1) % args.eval_every == 0 or step == args.steps - 1:
            pipe.eval()
            val = sum(pipe.evaluate(*data.get(k, "val")) for k in range(2)) / 2
            pipe.train()
            if rank0:
                print(f"step {step:4d}  held-out loss {val:.4f}", flush=True)

    # the plain model's checkpoint (loads into CharGPT in one process), and the resumable state
    def writer(name: str) -> dcp.FileSystemWriter:
        return dcp.FileSystemWriter(str(args.out / name), overwrite=True)

    dcp.save(pipe.state_dict(), storage_writer=writer("model"))
    dcp.save({"model": pipe.state_dict(),
              "optim": get_optimizer_state_dict(pipe.module, opt, options=flat),
              "step": torch.tensor(end)}, storage_writer=writer("state"))
    if rank0:
        print(f"saved {args.out / 'model'} (fxpipe.training.checkpoint.load_into_model) and "
              f"{args.out / 'state'} (--resume)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
