"""Gradient compression and 16-bit stage messages on the main job (issue 10).

The README's default job (bundled spec ``gpt-char``: CharGPT with tied embeddings on the Python
standard library's source text, 2 pipeline stages x 2 replicas, 1F1B, AdamW) is trained from
the same initial weights on the same batches once per configuration, in one gloo group of 4
spawned ranks, through :func:`fxpipe.compile` (which reads ``train.grad_compression``,
``train.compression`` and ``train.precision`` from the spec, as ``fxpipe run`` does):

* ``none`` (exact fp32 all-reduce), ``fp16`` (16-bit payload), ``powersgd`` (rank ``--rank``)
  and ``topk`` (ratio ``--ratio``), both with error feedback and ``--warmup`` exact steps first;
* ``bf16 messages``: ``train.precision: bf16`` with the exact all-reduce, for the stage-message
  bytes (activations and their gradients between the stages) against fp32.

Figures, each from the run: data-parallel bytes sent per step (the executor's
``step_bytes_sent``, i.e. what the buckets put on the wire under the ring algorithms) next to
the bytes the formula of each method gives for this model's parameter shapes (written here
independently of the reducers), the median step time, the loss every ``--log-every`` steps, the
final loss and the held-out loss against ``none``; the stage-message bytes per step fp32 vs
bf16 next to the plan's cut bytes. Written to the ``compression`` section of ``BENCHMARKS.md``
(:func:`benchmarks._report.write_section`).

Run (a few minutes; take the lock, other timing benchmarks share the machine)::

    flock /tmp/fxpipe-bench.lock python benchmarks/bench_compression.py
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import statistics
import sys
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._report import BENCHMARKS_MD, markdown_table, write_section  # noqa: E402
from benchmarks._runtime_bench import load_average, machine_note, run_group  # noqa: E402
from fxpipe.specs.schema import low_rank_view  # noqa: E402

__all__ = ["Config", "configs", "main_spec", "tiny_spec", "expected_gradient_bytes",
           "expected_message_bytes", "run", "report", "main"]

SECTION = "compression"
BASE_SPEC = "gpt-char"
#: the link bandwidths the figures' "time at" column prices the measured bytes at (GB/s):
#: the bundled spec's inter-node link (1 GB/s, a slow network) and 10 GB/s
PRICE_GBPS = (1.0, 10.0)
WORLD = 4  # 2 stages x 2 replicas


@dataclass(frozen=True)
class Config:
    """One training run: ``train.grad_compression`` (+ ``train.compression``) and precision."""

    name: str
    grad_compression: str = "none"
    precision: str = "fp32"
    compression: tuple = ()  # ((key, value), ...) of train.compression

    def spec(self, base: dict) -> dict:
        """``base`` (a spec dict) with this run's ``train`` settings."""
        train = dict(base["train"], grad_compression=self.grad_compression,
                     precision=self.precision)
        train.pop("compression", None)
        if self.compression:
            train["compression"] = dict(self.compression)
        return dict(base, train=train)


def configs(rank: int, ratio: float, warmup: int) -> list[Config]:
    return [Config("none"), Config("fp16", "fp16"),
            Config("powersgd", "powersgd", compression=(("rank", rank),
                                                        ("warmup_steps", warmup))),
            Config("topk", "topk", compression=(("ratio", ratio), ("warmup_steps", warmup))),
            Config("bf16 messages", "none", "bf16")]


def _bundled(name: str) -> dict:
    path = resources.files("fxpipe.specs").joinpath("examples", f"{name}.yaml")
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def main_spec(steps: int) -> dict:
    """The bundled default spec with ``steps`` steps, no checkpoints, logging off."""
    s = _bundled(BASE_SPEC)
    s["train"] = {k: v for k, v in s["train"].items() if k not in ("checkpoint", "log_every")}
    s["train"]["steps"] = steps
    return s


def tiny_spec(steps: int) -> dict:
    """The main job shrunk for the smoke test (2 layers of width 32, sequences of 32)."""
    s = main_spec(steps)
    s["model"] = dict(s["model"], args=dict(s["model"]["args"], n_layer=2, n_head=2, n_embd=32,
                                             block_size=32))
    s["data"] = dict(s["data"], batch_size=8, seq_len=32)
    s["parallel"] = dict(s["parallel"], microbatches=2)
    return s


# --------------------------------------------------------------------------- expected bytes
def _ring_allreduce(nbytes: int, n: int) -> float:
    return 2 * (n - 1) / n * nbytes if n > 1 else 0.0


def expected_gradient_bytes(buckets: list[tuple[list[tuple[int, ...]], int]], cfg: Config,
                            compressed: bool = True) -> int:
    """Bytes one rank sends per step for its buckets (``(parameter shapes, group size)``) under
    ``cfg`` (``compressed=False``: a warm-up step, all-reduced exactly in fp32).

    * fp32 ring all-reduce of ``S`` bytes over ``n`` ranks: ``2 (n-1)/n x S``; fp16/bf16:
      ``S / 2``.
    * PowerSGD rank ``r``: a matrix (``rows x cols``: first dimension x the rest) is compressed
      when ``2 (rows + cols) r < rows x cols``; round 1 all-reduces the other entries exactly
      plus ``P`` (``rows x r`` per matrix), round 2 ``Q`` (``cols x r``), fp32.
    * top-k ratio ``q``: ``k = ceil(q N)`` (value, index) pairs of 4 + 4 bytes per bucket of
      ``N`` entries, all-gathered: ``(n-1) x 8k``.
    """
    opts = dict(cfg.compression)
    total = 0.0
    for shapes, n in buckets:
        numel = sum(math.prod(s) for s in shapes)
        method = cfg.grad_compression if compressed else "none"
        if method == "none":
            total += _ring_allreduce(4 * numel, n)
        elif method in ("fp16", "bf16"):
            total += _ring_allreduce(2 * numel, n)
        elif method == "powersgd":
            r = opts.get("rank", 4)
            exact, p_size, q_size = 0, 0, 0
            for s in shapes:
                view = low_rank_view(s)
                if view is not None and 2 * (view[0] + view[1]) * r < view[0] * view[1]:
                    p_size += view[0] * r
                    q_size += view[1] * r
                else:
                    exact += math.prod(s)
            if p_size == 0:  # nothing worth compressing: one exact all-reduce
                total += _ring_allreduce(4 * numel, n)
            else:
                total += _ring_allreduce(4 * (exact + p_size), n) + _ring_allreduce(4 * q_size, n)
        elif method == "topk":
            k = max(1, min(numel, math.ceil(opts.get("ratio", 0.01) * numel)))
            total += (n - 1) * 8 * k
    return round(total)


def expected_message_bytes(plan, pipe_rank: int, precision: str) -> int:
    """Bytes pipeline rank ``pipe_rank`` sends to other ranks per step: per micro-batch, the
    values on the plan's stage edges leaving its stages (forward) and the gradients of those
    entering them (backward), fp32 values halved under bf16 / fp16, times the micro-batches of
    a replica."""
    ranks = plan.stage_ranks()
    mine = {sp.index for sp in plan.stages if ranks[sp.index] == pipe_rank}
    half = precision in ("bf16", "fp16")

    def size(name: str) -> int:
        v = plan.values[name]
        return v.nbytes // 2 if half and v.dtype == "float32" else v.nbytes

    total = 0
    for (a, b), names in plan.stage_edges().items():
        if a in mine and b not in mine:  # activations forward
            total += sum(size(n) for n in names)
        if b in mine and a not in mine:  # their gradients backward
            total += sum(size(n) for n in names if plan.values[n].requires_grad)
    return total * plan.microbatches


# --------------------------------------------------------------------------------- worker
def _buckets_of(pipe, plan, mesh) -> list[tuple[list[tuple[int, ...]], int]]:
    """This rank's buckets as (shapes, group size), from the plan: the stage's own parameters
    over the data-parallel group, each set of shared (tied) parameters over every rank holding
    them in every replica."""
    aliases, stage_rank = plan.param_aliases, plan.stage_ranks()
    own, shared, seen = [], {}, set()
    for s in sorted(pipe.executor.modules):
        for name, p in pipe.executor.modules[s].named_parameters(remove_duplicate=False):
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            fqn = aliases.get(name, name)
            if fqn in plan.shared_params:
                ranks = tuple(sorted({stage_rank[t] for t in plan.shared_params[fqn]}))
                shared.setdefault(ranks, []).append((fqn, tuple(p.shape)))
            else:
                own.append(tuple(p.shape))
    out = [(own, mesh.dp)] if own else []
    out += [([s for _, s in sorted(v)], len(k) * mesh.dp) for k, v in sorted(shared.items())]
    return out


def _worker(rank: int, plan, cfgs: list[Config], steps: int, val_batches: int) -> list[dict]:
    """Build every configuration's pipeline (same seed: same initial weights), then train them
    in rounds: step ``k`` of every configuration (in an order rotated each round) before step
    ``k + 1`` of any, so the machine's load drifting over the run is shared by all of them."""
    import torch.distributed as dist

    from fxpipe.data.batches import get_batch, make_batches
    from fxpipe.specs.loader import build_model, load_spec
    from fxpipe.training.compiled import compile

    torch.set_num_threads(1)
    runs = []
    for cfg in cfgs:
        spec = load_spec(cfg.spec(plan.spec.model_dump(mode="json")))
        t = spec.train
        torch.manual_seed(t.seed)
        pipe = compile(build_model(spec), dataclasses.replace(plan, spec=spec))
        params = list(pipe.parameters())
        opt = (torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay)
               if params else None)
        runs.append(dict(cfg=cfg, spec=spec, pipe=pipe, opt=opt, batches=make_batches(spec),
                         losses=[], times=[]))
    dist.barrier()
    for step in range(steps):
        k = step % len(runs)
        for r in runs[k:] + runs[:k]:
            batch = get_batch(r["batches"], r["spec"], step)
            t0 = time.perf_counter()
            r["losses"].append(r["pipe"].step(batch))
            if r["opt"] is not None:
                r["opt"].step()
            r["pipe"].zero_grad()
            r["times"].append(time.perf_counter() - t0)
    out = []
    for r in runs:
        pipe = r["pipe"]
        pipe.eval()
        val = statistics.fmean(pipe.evaluate(get_batch(r["batches"], r["spec"], i, "val"))
                               for i in range(val_batches))
        ex = pipe.executor
        out.append(dict(name=r["cfg"].name, pipe_rank=pipe.mesh.pipe_rank,
                        dp_rank=pipe.mesh.dp_rank, losses=r["losses"], times=r["times"],
                        val=val, messages=[b.messages for b in ex.step_bytes_sent],
                        gradients=[b.gradients for b in ex.step_bytes_sent],
                        buckets=_buckets_of(pipe, plan, pipe.mesh)))
    dist.barrier()
    return out


# --------------------------------------------------------------------------------- driver
def run(spec: dict, cfgs: list[Config], steps: int, val_batches: int,
        timeout_s: float = 1200.0) -> tuple:
    """Plan ``spec`` once and train every configuration; returns (plan, results by
    configuration name: one dict per rank)."""
    from fxpipe.partitioner.driver import plan_from_spec

    plan = plan_from_spec(spec)[0]
    ranks = run_group(_worker, WORLD, plan, cfgs, steps, val_batches, timeout_s=timeout_s)
    by_name: dict[str, list[dict]] = {c.name: [] for c in cfgs}
    for per_rank in ranks:
        for r in per_rank:
            by_name[r["name"]].append(r)
    return plan, by_name


def _summary(plan, cfgs: list[Config], res: dict, warmup: int) -> dict:
    """Per configuration: measured and expected bytes, step time, losses."""
    out = {}
    for cfg in cfgs:
        rows = res[cfg.name]
        steps = len(rows[0]["losses"])
        lossy = cfg.grad_compression in ("powersgd", "topk")
        first = min(warmup, steps - 1) if lossy else 0  # steady state: after the warm-up
        measured = [sum(r["gradients"][i] for r in rows) for i in range(steps)]
        expect = [sum(expected_gradient_bytes(r["buckets"], cfg, not lossy or i >= warmup)
                      for r in rows) for i in range(steps)]
        # the global step time: the slowest rank's wall time of that step
        step_s = [max(r["times"][i] for r in rows) for i in range(steps)]
        msgs = [sum(r["messages"][i] for r in rows) for i in range(steps)]
        msg_expect = sum(expected_message_bytes(plan, r["pipe_rank"], cfg.precision)
                         for r in rows)
        out[cfg.name] = dict(
            cfg=cfg, losses=rows[0]["losses"], val=rows[0]["val"],
            agree=len({tuple(r["losses"]) for r in rows}) == 1,
            bytes=statistics.median(measured[first:]), bytes_expected=expect[first],
            bytes_match=measured == expect, bytes_all=measured,
            step_s=statistics.median(step_s[max(first, 2):] or step_s),
            messages=statistics.median(msgs), messages_expected=msg_expect,
            messages_match=all(m == msg_expect for m in msgs))
    return out


def _fmt_bytes(n: float) -> str:
    return f"{n / 1024:,.1f} KiB" if n < 1024 ** 2 else f"{n / 1024 ** 2:,.2f} MiB"


def report(plan, spec: dict, cfgs: list[Config], res: dict, args, wall_s: float,
           load_before: str) -> tuple[str, dict]:
    """The Markdown section and the summary it was made from."""
    warm = args.warmup
    s = _summary(plan, cfgs, res, warm)
    none = s["none"]
    steps = len(none["losses"])
    tail = max(1, min(args.log_every, steps))

    def final(x):  # mean loss over the last `tail` steps
        return statistics.fmean(x["losses"][-tail:])

    m = spec["model"]["args"]
    lines = [
        f"Main job: bundled spec `{BASE_SPEC}` (CharGPT {m['n_layer']} layers x {m['n_embd']}, "
        f"tied embeddings; batch {spec['data']['batch_size']} x {spec['data']['seq_len']} "
        f"bytes of Python standard-library source), {plan.num_stages} stages x {plan.dp} "
        f"replicas, {plan.microbatches} micro-batches, {plan.schedule}, AdamW lr "
        f"{spec['train']['lr']:g}; {steps} steps per configuration from the same initial weights "
        f"on the same batches, interleaved (step k of every configuration before step k+1 of "
        f"any), through `fxpipe.compile` (the spec's `train.grad_compression`, "
        f"`train.compression` and `train.precision`). PowerSGD rank {args.rank}, top-k ratio "
        f"{args.ratio:g}, both with error feedback and {warm} exact warm-up steps. Command: "
        f"`flock /tmp/fxpipe-bench.lock python benchmarks/bench_compression.py"
        + "".join(f" {a}" for a in args.argv) + "`.",
        "",
        "**Data-parallel bytes per step** (all 4 ranks together, measured by the executor from "
        "the buckets; steady state, after the warm-up for PowerSGD / top-k) next to the "
        "method's formula for this model's parameter shapes (`fp32`: `2(n-1)/n x 4N` per ring "
        "all-reduce; fp16: half; PowerSGD: `P` and `Q` of every matrix worth compressing plus "
        "the vectors exactly; top-k: `(n-1) x 8 ceil(ratio N)` all-gathered), the time those "
        "bytes would take on one link, the median step time and the loss:",
        "",
    ]
    header = ["grad_compression", "bytes / step", "formula", "vs none",
              *[f"at {g:g} GB/s" for g in PRICE_GBPS], "step time", "final loss",
              "vs none", "held-out loss", "vs none"]
    rows = []
    for cfg in cfgs:
        x = s[cfg.name]
        if cfg.precision != "fp32":
            continue
        rows.append([
            f"`{cfg.name}`" + (f" (rank {args.rank})" if cfg.name == "powersgd" else "")
            + (f" (ratio {args.ratio:g})" if cfg.name == "topk" else ""),
            _fmt_bytes(x["bytes"]),
            _fmt_bytes(x["bytes_expected"]) + ("" if x["bytes_match"] else " (differs)"),
            f"{x['bytes'] / none['bytes']:.3f}x",
            *[f"{x['bytes'] / (g * 1e9) / WORLD * 1e3:.2f} ms" for g in PRICE_GBPS],
            f"{x['step_s'] * 1e3:.0f} ms",
            f"{final(x):.4f}", f"{final(x) - final(none):+.4f}",
            f"{x['val']:.4f}", f"{x['val'] - none['val']:+.4f}"])
    lines += [markdown_table(header, rows), ""]
    every = args.log_every
    matches = ", ".join(f"{c.name} " + ("yes" if s[c.name]["bytes_match"] else "NO")
                        for c in cfgs)
    lines += [
        f"The \"at\" columns divide one rank's share of the bytes by the bandwidth (what the "
        f"all-reduce would cost on a link of that speed, ignoring latency). Final loss: mean "
        f"training loss over the last {tail} steps; held-out loss: mean over "
        f"{args.val_batches} validation batches after training. Every step's measured bytes "
        f"equal the formula (warm-up steps: the fp32 formula): {matches}.",
        "",
        f"**Loss curve** (training loss, mean over steps `[k, k+{every})`):",
        "",
    ]
    curve_cfgs = [c for c in cfgs if c.precision == "fp32"] + [c for c in cfgs
                                                                if c.precision != "fp32"]
    crow = []
    for k in range(0, steps, every):
        crow.append([str(k)] + [f"{statistics.fmean(s[c.name]['losses'][k:k + every]):.4f}"
                                for c in curve_cfgs])
    lines += [markdown_table(["steps from", *[c.name for c in curve_cfgs]], crow), ""]
    f32, b16 = s["none"], s.get("bf16 messages")
    if b16 is not None:
        lines += [
            "**Stage messages per step** (activations forward and their gradients backward "
            "between the 2 stages, all 4 ranks, measured by the executor) next to the plan's "
            "cut bytes x micro-batches (fp32 values halved in 16 bits):",
            "",
            markdown_table(
                ["precision", "message bytes / step", "plan", "vs fp32", "step time",
                 "final loss", "vs fp32"],
                [["`fp32`", _fmt_bytes(f32["messages"]), _fmt_bytes(f32["messages_expected"]),
                  "1.000x", f"{f32['step_s'] * 1e3:.0f} ms", f"{final(f32):.4f}", "+0.0000"],
                 ["`bf16`", _fmt_bytes(b16["messages"]), _fmt_bytes(b16["messages_expected"]),
                  f"{b16['messages'] / f32['messages']:.3f}x", f"{b16['step_s'] * 1e3:.0f} ms",
                  f"{final(b16):.4f}", f"{final(b16) - final(f32):+.4f}"]]),
            "",
            f"Measured equal to the plan's bytes every step: fp32 "
            f"{'yes' if f32['messages_match'] else 'NO'}, bf16 "
            f"{'yes' if b16['messages_match'] else 'NO'}. bf16 also computes in bf16 "
            "(autocast; master weights, gradients and AdamW state stay fp32), so its loss "
            "difference is that of bf16 training as a whole, not of the messages alone.",
            "",
        ]
    lines += [
        f"Machine: {machine_note(load_before)}. Total wall time {wall_s:.0f} s, "
        f"{datetime.date.today().isoformat()}. All four ranks share 2 cores with other jobs, "
        "and the all-reduces go over loopback (memory copies), so the step times show what "
        "compression costs in computation (PowerSGD's matrix products and orthogonalisation, "
        "top-k's selection and the sparse sum), not what it saves on a network: the bytes "
        "(and the \"at\" columns) are the portable figures. Step times are medians of the "
        "slowest rank per step and move by tens of percent between runs on this shared "
        "machine (see the load average); losses and bytes do not depend on timing "
        f"(ranks agree on every loss: "
        f"{'yes' if all(x['agree'] for x in s.values()) else 'NO'}).",
    ]
    return "\n".join(lines), s


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60, help="training steps per configuration")
    ap.add_argument("--log-every", type=int, default=10, help="loss table every N steps")
    ap.add_argument("--val-batches", type=int, default=4, help="held-out batches at the end")
    ap.add_argument("--rank", type=int, default=4, help="PowerSGD rank")
    ap.add_argument("--ratio", type=float, default=0.01, help="top-k ratio")
    ap.add_argument("--warmup", type=int, default=10, help="exact steps before compressing")
    ap.add_argument("--tiny", action="store_true", help="the shrunk model (smoke test)")
    ap.add_argument("--out", type=Path, default=BENCHMARKS_MD, help="report file")
    ap.add_argument("--no-write", action="store_true", help="print, do not write the report")
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    load_before = load_average()
    t0 = time.perf_counter()
    spec = tiny_spec(args.steps) if args.tiny else main_spec(args.steps)
    cfgs = configs(args.rank, args.ratio, args.warmup)
    plan, res = run(spec, cfgs, args.steps, args.val_batches)
    body, summary = report(plan, spec, cfgs, res, args, time.perf_counter() - t0, load_before)
    print(body)
    if not args.no_write:
        write_section(SECTION, body, args.out)
        print(f"wrote section {SECTION!r} of {args.out}")
    return summary


if __name__ == "__main__":
    main()
