"""Synchronous all-reduce vs asynchronous parameter-server updates with one replica slowed.

The main job's model and data (the bundled ``gpt-char`` spec: byte-level CharGPT with tied
embeddings on the Python standard library's source, 2 pipeline stages x 2 replicas, 1F1B, AdamW)
trained three ways, replica 1 slowed by a sleep after every backward (a straggler):

* ``sync``: all-reduce, every replica steps together (the straggler gates every step);
* ``async S=0``: one parameter server, ``max_staleness: 0`` (the same training as sync, through
  the servers);
* ``async S=2``: ``max_staleness: 2``: the fast replica goes on with weights at most 2 updates
  stale, and does more of the steps (the ticket pool is ``steps x replicas`` replica-steps).

Every configuration sees the same number of samples (``steps`` global batches). Reported:
training wall time, throughput (global batches/s, samples/s), the replica-steps each replica
ran, the staleness the servers logged, and the training loss against global batches consumed
and against wall time (mean over a window). Written into ``BENCHMARKS.md`` (section
``async-updates``); ``--plot PNG`` also draws loss against batches and against seconds.

Take the lock first (other timing benchmarks share the machine)::

    flock /tmp/fxpipe-bench.lock python benchmarks/bench_async_updates.py
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._report import BENCHMARKS_MD, markdown_table, write_section  # noqa: E402

SECTION = "async-updates"


@dataclass
class Result:
    """One configuration's run: per-step records ``(wall_s, samples, loss)`` in time order."""

    name: str
    wall_s: float
    samples: int
    batch: int
    steps_per_replica: dict[int, int]
    updates: int
    max_staleness_seen: int
    records: list[tuple[float, int, float]] = field(default_factory=list)
    #: loss of global batch c (sync), or ``losses.csv``'s row c (async: the mean of the
    #: replicas' c-th steps)
    step_losses: list[float] = field(default_factory=list)

    @property
    def batches_per_s(self) -> float:
        return self.samples / self.batch / self.wall_s

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s

    def loss_near_batches(self, k: float, window: float) -> float:
        """Mean loss of the steps whose cumulative global batches lie in ``(k - window, k]``."""
        xs = [loss for _, n, loss in self.records if k - window < n / self.batch <= k + 1e-9]
        return sum(xs) / len(xs) if xs else float("nan")

    def loss_near_time(self, t: float, window: float) -> float:
        xs = [loss for w, _, loss in self.records if t - window < w <= t]
        return sum(xs) / len(xs) if xs else float("nan")


# ------------------------------------------------------------------------------ the spec
def _spec(args, mode: str, staleness: int | None):
    from fxpipe.specs.loader import load_spec

    base = load_spec("gpt-char").model_dump(mode="json")
    base["model"]["args"].update(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head,
                                 block_size=args.seq_len)
    base["data"].update(batch_size=args.batch, seq_len=args.seq_len)
    base["parallel"].update(microbatches=args.microbatches)
    train = base["train"]
    train.update(steps=args.steps, log_every=10 ** 6, checkpoint={"dir": "checkpoint",
                                                                 "every": 0})
    if mode == "async":
        base["cluster"].update(devices_per_node=5, parameter_servers=1)
        train.update(updates="async", max_staleness=staleness)
    return load_spec(base)


def _plan(spec, folder: Path) -> Path:
    from fxpipe.partitioner.driver import plan_from_spec

    plan, _ = plan_from_spec(spec)
    folder.mkdir(parents=True, exist_ok=True)
    plan.save(folder / "plan.json")
    return folder / "plan.json"


# ------------------------------------------------------------------------------ the ranks
def _sleep_replica_1(sleep_s: float, replica: int, step: int) -> None:
    if replica == 1:
        time.sleep(sleep_s)


def _sync_rank(rank: int, plan_path: str, sleep_s: float):
    """The sync training loop (fxpipe.compile, AdamW; what ``fxpipe run`` does), replica 1
    sleeping after every step's backward; rank 0 returns ``(wall_s, [(wall_s, loss)])``."""
    import torch

    from fxpipe.data.batches import get_batch, make_batches
    from fxpipe.plans.plan import Plan
    from fxpipe.specs.loader import build_model, load_spec
    from fxpipe.training.compiled import compile

    plan = Plan.load(plan_path)
    spec = load_spec(plan.spec)
    t = spec.train
    pipe = compile(build_model(spec), plan)
    opt = torch.optim.AdamW(list(pipe.parameters()), lr=t.lr, weight_decay=t.weight_decay)
    batches = make_batches(spec)
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    rows = []
    for c in range(t.steps):
        loss = pipe.step(get_batch(batches, spec, c))
        _sleep_replica_1(sleep_s, pipe.replica, c)
        opt.step()
        pipe.zero_grad()
        rows.append((time.perf_counter() - t0, loss))
    return (time.perf_counter() - t0, rows) if rank == 0 else None


def _async_rank(rank: int, plan_path: str, out: str, sleep_s: float):
    import functools

    from fxpipe.training.worker import train_async

    t0 = time.perf_counter()
    train_async(Path(plan_path), Path(out),
                after_backward=functools.partial(_sleep_replica_1, sleep_s))
    return time.perf_counter() - t0


def _csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def run_config(args, name: str, mode: str, staleness: int | None, work: Path) -> Result:
    from fxpipe.runtime.local_ranks import run_ranks

    spec = _spec(args, mode, staleness)
    folder = work / name.replace(" ", "_").replace("=", "")
    plan_path = _plan(spec, folder)
    batch = spec.data.batch_size
    if mode == "sync":
        res = run_ranks(_sync_rank, 4, str(plan_path), args.sleep, timeout_s=args.timeout,
                        dist_timeout_s=120)
        wall, rows = res[0]
        recs = [(w, (c + 1) * batch, loss) for c, (w, loss) in enumerate(rows)]
        return Result(name, wall, len(rows) * batch, batch, {0: len(rows), 1: len(rows)},
                      len(rows), 0, recs, [loss for _, loss in rows])
    run_ranks(_async_rank, 5, str(plan_path), str(folder), args.sleep, timeout_s=args.timeout,
              dist_timeout_s=120)
    steps = sorted(_csv(folder / "replica_losses.csv"), key=lambda r: float(r["wall_s"]))
    log = _csv(folder / "parameter_server_0.csv")
    per = batch // 2
    recs, seen = [], 0
    for r in steps:
        seen += per
        recs.append((float(r["wall_s"]), seen, float(r["loss"])))
    counts: dict[int, int] = {}
    for r in steps:
        counts[int(r["replica"])] = counts.get(int(r["replica"]), 0) + 1
    wall = max(w for w, _, _ in recs)
    merged = [float(r["loss"]) for r in _csv(folder / "losses.csv")]
    return Result(name, wall, seen, batch, counts, len({r["round"] for r in log}),
                  max(int(r["staleness"]) for r in log), recs, merged)


# ------------------------------------------------------------------------------ report
def report(results: list[Result], args, cores: int) -> str:
    rows = [[r.name, f"{r.wall_s:.1f}", f"{r.batches_per_s:.2f}", f"{r.samples_per_s:.1f}",
             " / ".join(str(r.steps_per_replica.get(d, 0)) for d in (0, 1)), str(r.updates),
             str(r.max_staleness_seen), f"{r.loss_near_batches(args.steps, args.window):.3f}"]
            for r in results]
    main = markdown_table(["updates", "wall s", "global batches/s", "samples/s",
                           "replica-steps (replica 0 / 1)", "server updates",
                           "max staleness seen", f"loss at the end (last {args.window:g} batches)"],
                          rows)
    marks = sorted({max(1, round(args.steps * f)) for f in (0.25, 0.5, 0.75, 1.0)})
    by_steps = markdown_table(
        ["updates"] + [f"{k} batches" for k in marks],
        [[r.name] + [f"{r.loss_near_batches(k, args.window):.3f}" for k in marks]
         for r in results])
    longest = max(r.wall_s for r in results)
    times = sorted({round(longest * f, 1) for f in (0.25, 0.5, 0.75, 1.0)})
    by_time = markdown_table(
        ["updates"] + [f"{t:g} s" for t in times],
        [[r.name] + [(f"{r.loss_near_time(t, args.time_window):.3f}" if t <= r.wall_s + 1e-9
                      else "done") for t in times] for r in results])
    sync = next(r for r in results if r.name == "sync")
    fast = [r for r in results if r.name != "sync"]
    lock = next(r for r in results if r.name == "async S=0")
    same = max(abs(a - b) for a, b in zip(sync.step_losses, lock.step_losses))
    speed = "; ".join(f"{r.name}: {r.batches_per_s / sync.batches_per_s:.2f}x sync's throughput"
                      for r in fast)
    return "\n".join([
        f"`python benchmarks/bench_async_updates.py` (taken under `flock /tmp/fxpipe-bench.lock`): "
        f"the main job's CharGPT ({args.n_layer} layers x {args.n_embd}, sequences of "
        f"{args.seq_len}, global batch {args.batch}, {args.microbatches} micro-batches), 2 "
        f"stages x 2 replicas, 1F1B, AdamW, {args.steps} global batches per configuration; "
        f"replica 1 sleeps {args.sleep:g} s after every backward (a straggler). Async runs add "
        f"one parameter server rank (5 processes). CPU, gloo, {cores} cores shared with other "
        f"work: timings are noisy, compare the rows with each other.",
        "",
        main,
        "",
        f"Training loss against global batches consumed (mean over the last {args.window:g} "
        "batches' worth of steps; async: every replica-step counts half a batch):",
        "",
        by_steps,
        "",
        f"Training loss against wall time (mean of the steps finished in the {args.time_window:g} s "
        "before; \"done\": that run had finished):",
        "",
        by_time,
        "",
        f"Reading: {speed}. Sync and async S=0 wait for the straggler at every step, so both "
        "run at the slow replica's pace; S=0 is the same training as sync through the server "
        f"(per-step losses differ by at most {same:.1e}), and its extra "
        f"{lock.wall_s / args.steps - sync.wall_s / args.steps:+.2f} s per global batch is the "
        "server path's own cost here (a ticket, a pull of the weights and a push of the "
        "gradients per rank and step, all serialised through one server process, on cores "
        "the trainers share). " + " ".join(
            f"With {r.name} the fast replica ran {r.steps_per_replica.get(0, 0)} of "
            f"{sum(r.steps_per_replica.values())} replica-steps on weights at most "
            f"{r.name.split('=')[1]} updates stale, "
            + ("which beat sync's wall time: the straggler's wait saved more than the server "
               "path costs" if r.wall_s < sync.wall_s else
               "but the server path's cost outweighed the straggler's wait saved, so sync "
               "finished first on this machine (a slower straggler, or servers on their own "
               "cores, tip the balance)")
            + "." for r in fast if r is not lock)
        + " The lagging loss per batch is the price of gradients computed on older weights. "
        "Staleness never exceeded the bound (column 'max staleness seen', from the server's "
        "log).",
    ])


def plot(results: list[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    for r in results:
        xs = [n / r.batch for _, n, _ in r.records]
        a.plot(xs, [x for _, _, x in r.records], label=r.name, lw=1)
        b.plot([w for w, _, _ in r.records], [x for _, _, x in r.records], label=r.name, lw=1)
    a.set_xlabel("global batches consumed")
    b.set_xlabel("wall time (s)")
    for ax in (a, b):
        ax.set_ylabel("training loss")
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None, out: Path | None = BENCHMARKS_MD) -> list[Result]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40, help="global batches per configuration")
    ap.add_argument("--sleep", type=float, default=0.3, help="replica 1's sleep per step, s")
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--staleness", type=int, default=2, help="S of the second async run")
    ap.add_argument("--window", type=float, default=5, help="batches averaged per loss figure")
    ap.add_argument("--time-window", type=float, default=3.0, help="seconds per loss figure")
    ap.add_argument("--timeout", type=float, default=600, help="deadline per configuration, s")
    ap.add_argument("--plot", type=Path, default=None, help="also draw the loss curves here")
    ap.add_argument("--no-write", action="store_true", help="print, do not touch BENCHMARKS.md")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="fxpipe-async-bench-"))
    try:
        results = [run_config(args, "sync", "sync", None, work),
                   run_config(args, "async S=0", "async", 0, work),
                   run_config(args, f"async S={args.staleness}", "async", args.staleness, work)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = report(results, args, os.cpu_count() or 1)
    print(text)
    if args.plot is not None:
        plot(results, args.plot)
    if out is not None and not args.no_write:
        write_section(SECTION, text, out)
        print(f"wrote section {SECTION!r} of {out}")
    return results


if __name__ == "__main__":
    main()
