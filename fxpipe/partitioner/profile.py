"""Measured costs: time every node's forward, input-gradient and weight-gradient on the device.

``fxpipe profile SPEC`` (and ``cluster.costs: measured``) builds the spec's model with real
weights on ``cluster.device``, traces it as the planner does, and runs the graph node by node on
one real micro-batch of the spec's dataset. Each compute node runs on its own (its activation
inputs detached, so autograd stops at the node): ``warmup`` runs, then the median of
``repeats`` timed runs of the forward, of the backward to the activation inputs (B) and of the
backward to the parameters (W), with the device synchronised around every timing. The times
are cached as JSON under ``$FXPIPE_CACHE_DIR`` (default ``~/.cache/fxpipe``), keyed by the
graph's code, the input shapes and dtypes, the device and the torch version, so a spec is
profiled once per machine kind.

:class:`SendCost` is what a point-to-point send costs the *sending* rank (gloo on CPU copies the
bytes in the sender's thread; NCCL hands them to the device): ``seconds = overhead + bytes /
rate``, measured by ``fxpipe profile`` over two local ranks (:mod:`fxpipe.training.profiling`)
and cached here; the simulator charges it to every send.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch.utils import _pytree as pytree

from fxpipe.errors import PlanError
from fxpipe.partitioner.timing import NodeTimes
from fxpipe.partitioner.trace import COMPUTE_OPS, TracedModel

__all__ = ["cache_dir", "profile_key", "profile_graph", "load_profile", "save_profile",
           "SendCost", "load_send_cost", "send_cost_path"]


def cache_dir() -> Path:
    """Where measured costs are cached: ``$FXPIPE_CACHE_DIR`` or ``~/.cache/fxpipe``."""
    return Path(os.environ.get("FXPIPE_CACHE_DIR") or Path.home() / ".cache" / "fxpipe")


def profile_key(traced: TracedModel, device: str, dtype: str = "float32") -> str:
    """Cache key of a traced graph's measured costs: its code, input shapes and dtypes, the
    device, the parameter dtype and the torch version."""
    h = hashlib.sha256()
    h.update(traced.gm.code.encode())
    for n in traced.gm.graph.nodes:
        if n.op == "placeholder":
            v = n.meta.get("val")
            h.update(f"{n.name}:{getattr(v, 'shape', None)}:{getattr(v, 'dtype', None)}".encode())
    h.update(f"{device}|{dtype}|{torch.__version__}".encode())
    return h.hexdigest()[:24]


def _path(key: str) -> Path:
    return cache_dir() / "profiles" / f"{key}.json"


def load_profile(key: str) -> dict[str, NodeTimes] | None:
    """Cached times for ``key``, or None."""
    path = _path(key)
    try:
        data = json.loads(path.read_text())
        return {k: NodeTimes(*map(float, v)) for k, v in data["nodes"].items()}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save_profile(key: str, times: dict[str, NodeTimes], meta: dict[str, Any]) -> Path:
    """Write the cache entry atomically; returns its path."""
    path = _path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"meta": meta, "nodes": {
        k: [t.fwd_s, t.bwd_input_s, t.bwd_weight_s] for k, t in times.items()}}))
    tmp.replace(path)
    return path


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn: Callable[[], Any], device: torch.device, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def profile_graph(traced: TracedModel, inputs: list[torch.Tensor], device: torch.device | str,
                  *, warmup: int = 2, repeats: int = 5,
                  progress: Callable[[int, int], None] | None = None) -> dict[str, NodeTimes]:
    """Measured :class:`NodeTimes` of every compute node of ``traced`` (a graph of a real model
    on ``device``), run on ``inputs`` (its placeholders' values, in order).

    Args:
        progress: called as ``progress(done, total)`` after each node.
    """
    device = torch.device(device)
    gm = traced.gm
    env: dict[str, Any] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for n, v in zip(placeholders, inputs):
        env[n.name] = v
    computes = [n for n in gm.graph.nodes if n.op in COMPUTE_OPS]
    out_times: dict[str, NodeTimes] = {}

    def fetch(a):
        return env[a.name] if isinstance(a, torch.fx.Node) else a

    for k, n in enumerate(computes):
        for a in n.all_input_nodes:
            if a.op == "get_attr" and a.name not in env:
                obj = gm
                for part in str(a.target).split("."):
                    obj = getattr(obj, part)
                env[a.name] = obj
            elif a.op == "placeholder" and a.name not in env:
                env[a.name] = None
        args = pytree.tree_map_only(torch.fx.Node, fetch, n.args)
        kwargs = pytree.tree_map_only(torch.fx.Node, fetch, n.kwargs)
        params = [env[a.name] for a in n.all_input_nodes if a.op == "get_attr"
                  and isinstance(env[a.name], torch.nn.Parameter) and env[a.name].requires_grad]
        pids = {id(p) for p in params}
        swap: dict[int, torch.Tensor] = {}
        for v in pytree.tree_leaves((args, kwargs)):
            if (isinstance(v, torch.Tensor) and id(v) not in pids and id(v) not in swap
                    and (v.is_floating_point() or v.is_complex())):
                swap[id(v)] = v.detach().requires_grad_(True)
        l_args, l_kwargs = pytree.tree_map_only(torch.Tensor, lambda v: swap.get(id(v), v),
                                                (args, kwargs))
        if n.op == "call_module":
            sub = gm.get_submodule(n.target)
            call = lambda: sub(*l_args, **l_kwargs)  # noqa: E731
        elif n.op == "call_method":
            call = lambda: getattr(l_args[0], n.target)(*l_args[1:], **l_kwargs)  # noqa: E731
        else:
            call = lambda: n.target(*l_args, **l_kwargs)  # noqa: E731
        try:
            with torch.enable_grad():
                fwd = _median_time(call, device, warmup, repeats)
                out = call()
        except Exception as e:  # the model cannot run this input (e.g. a token id too large)
            raise PlanError(f"profiling node {n.name!r} ({n.target}) failed on the example batch "
                            f"with {type(e).__name__}: {' '.join(str(e).split())[:300]}; check "
                            "that the dataset's batches fit the model (vocabulary, shapes)"
                            ) from None
        leaves = [o for o in pytree.tree_leaves(out)
                  if isinstance(o, torch.Tensor) and o.requires_grad]
        acts = list(swap.values())
        bi = bw = 0.0
        if leaves:
            grads = [torch.ones_like(o) for o in leaves]

            def grad_of(wrt):
                return lambda: torch.autograd.grad(leaves, wrt, grads, retain_graph=True,
                                                   allow_unused=True)
            try:
                if acts:
                    bi = _median_time(grad_of(acts), device, warmup, repeats)
                if params:
                    bw = _median_time(grad_of(params), device, warmup, repeats)
            except RuntimeError:  # an op without a derivative: no backward to time
                bi = bw = 0.0
        out_times[n.name] = NodeTimes(fwd, bi, bw)
        env[n.name] = pytree.tree_map_only(torch.Tensor, lambda t: t.detach(), out)
        if progress is not None:
            progress(k + 1, len(computes))
    return out_times


class SendCost:
    """Sender-side seconds of one point-to-point message: ``overhead_s + nbytes / rate_Bps``,
    or, where measured ``points`` (``[(bytes, seconds)]``, ascending bytes) are given, their
    piecewise-linear interpolation (the time of the smallest size below it; beyond the largest,
    its time plus the extra bytes at ``rate_Bps``). Gloo's sender cost is far from linear
    (about constant up to a few hundred KiB, then several times steeper): one straight line
    fitted to 4 KiB .. 16 MiB misprices the small messages a pipeline of small stages sends."""

    def __init__(self, overhead_s: float, rate_Bps: float,
                 points: list[tuple[float, float]] | None = None):
        self.overhead_s, self.rate_Bps = float(overhead_s), float(rate_Bps)
        self.points = sorted((float(b), float(t)) for b, t in points) if points else None

    def seconds(self, nbytes: float) -> float:
        """Sender-side seconds of one message of ``nbytes`` bytes (0 bytes: no message)."""
        if nbytes <= 0:
            return 0.0
        if not self.points:
            return self.overhead_s + nbytes / self.rate_Bps
        xs = [b for b, _ in self.points]
        ys = [t for _, t in self.points]
        if nbytes >= xs[-1]:
            return ys[-1] + (nbytes - xs[-1]) / self.rate_Bps
        return float(np.interp(nbytes, xs, ys))

    def to_dict(self) -> dict:
        d: dict = {"overhead_s": self.overhead_s, "rate_Bps": self.rate_Bps}
        if self.points:
            d["points"] = [list(p) for p in self.points]
        return d


def send_cost_path(device: str) -> Path:
    """Cache file of the measured send cost of ``device``'s backend."""
    return cache_dir() / "profiles" / f"send-{device}-{torch.__version__}.json"


def load_send_cost(device: str) -> SendCost | None:
    """The measured send cost (``fxpipe profile`` writes it), or None."""
    try:
        d = json.loads(send_cost_path(device).read_text())
        return SendCost(d["overhead_s"], d["rate_Bps"], d.get("points"))
    except (OSError, ValueError, KeyError, TypeError):
        return None
