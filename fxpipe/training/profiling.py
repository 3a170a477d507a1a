"""``fxpipe profile SPEC``: measure the spec's costs on this machine, for ``cluster.costs: measured``.

Builds the spec's model with real weights on ``cluster.device``, traces it at the spec's
micro-batch size, times every node's forward, input-gradient and weight-gradient
(:func:`fxpipe.partitioner.profile.profile_graph`: warm-up, repeats, median) and the loss on the
model's output (:mod:`fxpipe.partitioner.loss_cost`), caches the times (keyed by graph, shapes,
dtype, device, torch version), measures what a send costs two busy local
ranks (CPU: gloo), and prints the slowest modules and the totals. Later
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
from fxpipe.partitioner.driver import as_spec
from fxpipe.partitioner.units import tracing_model
from fxpipe.runtime.threads import set_rank_threads
from fxpipe.partitioner.loss_cost import measured_loss_times
from fxpipe.partitioner.profile import (SEND_METHOD, SendCost, profile_graph, profile_key,
                                        save_profile, send_cost_path)
from fxpipe.partitioner.trace import module_path_of, trace
from fxpipe.specs.loader import build_model, spec_location
from fxpipe.units import human_bytes, ms

__all__ = ["profile_spec", "measure_send_cost"]


#: the receives a rank of the send-cost measurement keeps posted ahead, and how many
#: iterations later it waits for one (so a late peer costs no wait: only the CPU counts)
_LAG = 3


def _busy_compute(a: torch.Tensor) -> torch.Tensor:
    """About 2 ms of one-thread work: what a rank does between its messages."""
    x = a
    for _ in range(24):
        x = torch.tanh(x @ a)
    return x


def _send_worker(rank: int, sizes: list[int], iters: int, rounds: int) -> list[float]:
    """Both ranks compute and exchange one message of each size per iteration, as two pipeline
    ranks do; per size, the median over ``rounds`` of the extra seconds per iteration over the
    same compute alone (timed just before, so slow drift of the machine cancels)."""
    import torch.distributed as dist

    peer = 1 - rank
    a = torch.randn(128, 128, generator=torch.Generator().manual_seed(rank))
    warm = torch.zeros(1024, dtype=torch.float32)  # the first send sets the connection up
    for _ in range(3):
        r = dist.irecv(torch.empty_like(warm), peer)
        dist.isend(warm, peer).wait()
        r.wait()
    for _ in range(10):
        _busy_compute(a)
    out = []
    for n in sizes:
        payload = torch.zeros(max(1, n // 4), dtype=torch.float32)
        ring = [torch.empty_like(payload) for _ in range(_LAG + 2)]
        extra = []
        for _ in range(rounds):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                _busy_compute(a)
            alone = time.perf_counter() - t0
            dist.barrier()
            t0 = time.perf_counter()
            recvs, sends = [], []
            for i in range(iters):
                recvs.append(dist.irecv(ring[i % len(ring)], peer, tag=i))
                _busy_compute(a)
                sends.append(dist.isend(payload, peer, tag=i))
                if i >= _LAG:
                    recvs[i - _LAG].wait()
                    sends[i - _LAG].wait()
            for w in recvs[max(0, iters - _LAG):] + sends[max(0, iters - _LAG):]:
                w.wait()
            extra.append((time.perf_counter() - t0 - alone) / iters)
        out.append(statistics.median(extra))
    return out


def _non_decreasing(ys: list[float]) -> list[float]:
    """The least-squares non-decreasing fit of ``ys`` (pool adjacent violators): a bigger
    message never costs less; the measured medians wobble by a few tens of microseconds."""
    blocks: list[list[float]] = []  # [mean, count]
    for y in ys:
        blocks.append([y, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, c1), (m2, c2) = blocks.pop(-2), blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    return [m for m, c in blocks for _ in range(int(c))]


#: message sizes the send cost is measured at, bytes (4 KiB .. 16 MiB)
SEND_SIZES = [1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24]


def measure_send_cost(device: str = "cpu", sizes: list[int] | None = None, iters: int = 16,
                      rounds: int = 7) -> SendCost:
    """Measure what one message costs two busy gloo ranks (CPU): both ranks compute and, every
    iteration, send the other a message and receive one, as neighbouring pipeline ranks do; the
    cost of a size is the extra time per iteration over the same compute alone (the sender's
    thread staging the bytes, the receiver's gloo thread reading them, both taking the CPU from
    the compute), the mean of the two ranks. Per message it is what one send costs the pipeline
    (its sender and its receiver together), the figure the simulator charges to each send:
    a pipeline rank sends and receives the same messages of an edge, so per rank the sum comes
    out the same. A ping-pong with an idle receiver saw a quarter to a half of it. Measured at
    4 KiB .. 16 MiB (a non-decreasing fit of the medians; the planner interpolates between the
    points, beyond the last ``overhead + bytes / rate`` of the last two) and cached. On CUDA
    (NCCL) the sending thread only enqueues work: cost 0.

    Args:
        device: ``cluster.device``; sizes: message bytes (default :data:`SEND_SIZES`); iters:
            messages per round; rounds: rounds per size (the median is kept).

    Raises:
        RuntimeFailure: the two ranks failed or did not finish within 300 s.
    """
    if device != "cpu":
        return SendCost(0.0, float("inf"))
    from fxpipe.runtime.local_ranks import run_ranks

    sizes = sorted(sizes or SEND_SIZES)
    per_rank = run_ranks(_send_worker, 2, sizes, iters, rounds, timeout_s=300)
    secs = _non_decreasing([max(0.0, (x + y) / 2) for x, y in zip(*per_rank)])
    slope = ((secs[-1] - secs[-2]) / (sizes[-1] - sizes[-2]) if len(sizes) > 1 else 0.0)
    rate = 1.0 / max(slope, 1e-13)
    cost = SendCost(secs[0], rate, list(zip(sizes, secs)), method=SEND_METHOD)
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
    set_rank_threads()  # as on a worker rank
    # on the device before tracing_model: profiled for real, never as a fake copy
    model = build_model(spec).to(device)
    batch = example_microbatch(spec)
    model, args, kwargs, _ = tracing_model(model, batch.args, batch.kwargs, device)
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
        pts = ", ".join(f"{human_bytes(b)} {ms(t)} ms" for b, t in cost.points or [])
        lines.append(f"what one send costs two busy ranks (sender and receiver): {pts or 'none'} "
                     f"(cached in {send_cost_path(device)})")
    lines.append("plans of this spec with cluster.costs: measured use these times")
    return "\n".join(lines)
