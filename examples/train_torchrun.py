"""Your own training loop on fxpipe: a byte-level GPT on 2 pipeline stages x 2 replicas.

    torchrun --nproc-per-node 4 examples/train_torchrun.py --steps 40 --out runs/example

``fxpipe.compile`` returns this rank's share of the model; everything else is the loop you
would write for one process: AdamW with weight decay on the weight matrices only, a warm-up +
cosine learning-rate schedule, gradient clipping, gradient accumulation, held-out evaluation,
and checkpoints (``fxpipe.training.checkpoint``: torch.distributed.checkpoint keyed by parameter
name, atomic, validated on load) of the model, the optimizer, the schedule and the RNG that a
later run resumes from (``--resume``), under this plan or another. The final weights load into
the plain model in one process: ``fxpipe.training.checkpoint.load_into_model(model, OUT/"ckpt")``.

Every rank feeds the same GLOBAL batch (the pipeline slices each replica's part and feeds the
first stage the inputs and the last stage the targets), so the data loader only has to be
deterministic: here ``ByteBatches`` over the Python standard library's sources.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist

import fxpipe
from fxpipe.examples.data import ByteBatches, python_source_text
from fxpipe.examples.gpt import CharGPT
from fxpipe.training.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint

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
    ap.add_argument("--resume", action="store_true", help="continue from OUT/ckpt")
    ap.add_argument("--stop-after", type=int, default=None,
                    help="save a checkpoint and stop after this many steps (resume with --resume)")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))  # torchrun: 1

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

    ckpt = args.out / "ckpt"
    start = 0
    if args.resume and latest_checkpoint(ckpt) is not None:
        state = load_checkpoint(pipe.module, ckpt, optimizer=opt)  # model, optimizer, RNG
        sched.load_state_dict(state["schedule"])
        start = state["step"]

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

    # one checkpoint: loads into CharGPT in one process, and --resume continues from it
    path = save_checkpoint(pipe.module, ckpt, end, optimizer=opt,
                           train_state={"schedule": sched.state_dict()})
    if rank0:
        print(f"saved {path} (fxpipe.training.checkpoint.load_into_model; --resume)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
