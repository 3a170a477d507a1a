"""``fxpipe profile SPEC``: measure the spec's costs on this machine, for ``cluster.costs: measured``.

Builds the spec's model with real weights on ``cluster.device``, traces it at the spec's
micro-batch size, times every node's forward, input-gradient and weight-gradient
(:func:`fxpipe.partitioner.profile.profile_graph`: warm-up, repeats, median) and the loss on the
model's output (:mod:`fxpipe.partitioner.loss_cost`), caches the times (keyed by graph, shapes,
dtype, device, torch version), measures what a send costs the sending
rank over two local ranks (CPU: gloo), and prints the slowest modules and the totals. Later
plans of the spec with ``cluster.costs: measured`` read the cache.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections import defaultdict

import torch

from fxpipe.data.batches import example_microbatch
from fxpipe.errors import PlanError
from fxpipe.partitioner.driver import as_spec, tracing_model
from fxpipe.partitioner.loss_cost import measured_loss_times
from fxpipe.partitioner.profile import (SendCost, profile_graph, profile_key, save_profile,
                                        send_cost_path)
from fxpipe.partitioner.trace import module_path_of, trace
from fxpipe.specs.loader import build_model, spec_location
from fxpipe.units import human_bytes, ms

__all__ = ["profile_spec", "measure_send_cost"]


def _send_worker(rank: int, sizes: list[int], repeats: int) -> list[float]:
    import torch.distributed as dist

    out = []
    warm = torch.zeros(1024, dtype=torch.float32)  # the first send sets the connection up
    for _ in range(3):
        dist.barrier()
        if rank == 0:
            dist.isend(warm, 1).wait()
        else:
            dist.recv(warm, 0)
    for n in sizes:
        buf = torch.zeros(max(1, n // 4), dtype=torch.float32)
        samples = []
        for _ in range(repeats):
            dist.barrier()
            if rank == 0:
                t0 = time.perf_counter()
                dist.isend(buf, 1).wait()
                samples.append(time.perf_counter() - t0)
            else:
                dist.recv(buf, 0)
        out.append(statistics.median(samples) if samples else 0.0)
    return out


def measure_send_cost(device: str = "cpu", repeats: int = 7) -> SendCost:
    """Measure the sender-side cost of a send between two local ranks (gloo on CPU) for
    4 KiB .. 16 MiB messages (after a warm-up send), keep the measured points (the planner
    interpolates between them: the cost is far from linear in the size) and, for sizes past
    them, ``overhead + bytes / rate`` fitted by least squares; cache it. On CUDA (NCCL) the
    sending thread only enqueues work: cost 0."""
    if device != "cpu":
        return SendCost(0.0, float("inf"))
    from fxpipe.runtime.local_ranks import run_ranks

    sizes = [1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24]
    secs = run_ranks(_send_worker, 2, sizes, repeats, timeout_s=120)[0]
    n = len(sizes)
    mx, my = sum(sizes) / n, sum(secs) / n
    slope = (sum((x - mx) * (y - my) for x, y in zip(sizes, secs))
             / max(1e-30, sum((x - mx) ** 2 for x in sizes)))
    slope = max(slope, 1e-13)
    cost = SendCost(max(0.0, my - slope * mx), 1.0 / slope, list(zip(sizes, secs)))
    path = send_cost_path(device)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cost.to_dict()))
    return cost


def profile_spec(spec, *, repeats: int = 5, warmup: int = 2, send: bool = True) -> str:
    """Profile the spec's model (see the module doc); returns the printed report."""
    spec = as_spec(spec)
    device = spec.cluster.device
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        where = spec_location(spec, "cluster.device")
        raise PlanError(
            f"{where + ': ' if where else ''}cluster.device is {device!r} but this machine has no "
            f"CUDA device (torch {torch.__version__}"
            f"{'' if torch.version.cuda else ', built without CUDA'}): profile where the spec's "
            "devices are (the cache is keyed by the device), or set cluster.device: cpu to "
            "measure this machine")
    torch.set_num_threads(1)  # as on a worker rank
    model = build_model(spec)
    batch = example_microbatch(spec)
    model, args, kwargs, _ = tracing_model(model, batch.args, batch.kwargs, device)
    model.to(device)
    traced = trace(model, tuple(args), spec.model.tracer, example_kwargs=kwargs,
                   output=spec.loss_output)
    inputs = [*args, *(v for v in kwargs.values() if isinstance(v, torch.Tensor))]
    tty = sys.stderr.isatty()
    t0 = time.perf_counter()

    def progress(done: int, total: int) -> None:
        if tty and (done == total or done % 25 == 0):
            print(f"\rprofiling {done}/{total} nodes", end="" if done < total else "\n",
                  file=sys.stderr, flush=True)

    precision = spec.train.precision
    times = profile_graph(traced, inputs, device, warmup=warmup, repeats=repeats,
                          precision=precision,
                          progress=progress)
    path = save_profile(profile_key(traced, device, precision), times,
                        {"model": traced.model_name, "device": device, "precision": precision,
                         "microbatch_size": batch.size})
    loss = measured_loss_times(traced, spec.train.loss, device, precision=precision,
                               ignore_index=spec.train.ignore_index, target=lambda: batch.target)
    per_module: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for n in traced.compute_nodes():
        t = times[n.name]
        row = per_module[module_path_of(n) or "(root)"]
        row[0] += t.fwd_s
        row[1] += t.bwd_input_s
        row[2] += t.bwd_weight_s
    total = [sum(r[i] for r in per_module.values()) for i in range(3)]
    lines = [f"fxpipe profile: {traced.model_name} on {device}, micro-batch of {batch.size}, "
             f"{len(times)} nodes timed in {time.perf_counter() - t0:.1f} s "
             f"(median of {repeats} after {warmup} warm-up runs)",
             f"{'module':40s} {'fwd ms':>9s} {'B ms':>9s} {'W ms':>9s}"]
    for name, r in sorted(per_module.items(), key=lambda kv: -sum(kv[1]))[:15]:
        lines.append(f"{name[:40]:40s} {ms(r[0]):>9s} {ms(r[1]):>9s} {ms(r[2]):>9s}")
    lines.append(f"{'total':40s} {ms(total[0]):>9s} {ms(total[1]):>9s} {ms(total[2]):>9s}")
    if loss.total_s > 0:
        lines.append(f"loss {spec.train.loss} on the model output (the last stage runs it): "
                     f"fwd {ms(loss.fwd_s)} ms, backward {ms(loss.bwd_input_s)} ms")
    lines.append(f"cached in {path}")
    if send:
        cost = measure_send_cost(device)
        lines.append(f"send cost on the sending rank: {cost.overhead_s * 1e6:.1f} us + bytes at "
                     f"{human_bytes(cost.rate_Bps, decimal=True)}/s (cached in "
                     f"{send_cost_path(device)})")
    lines.append("plans of this spec with cluster.costs: measured use these times")
    return "\n".join(lines)
