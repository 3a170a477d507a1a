"""Measured costs: time every node's forward, input-gradient and weight-gradient on the device.

``fxpipe profile SPEC`` (and ``cluster.costs: measured``) builds the spec's model with real
weights on ``cluster.device``, traces it as the planner does, and runs the graph node by node on
one real micro-batch of the spec's dataset (:func:`profile_graph`). Forwards are timed in
sequence, as training runs them: ``warmup`` passes over the whole graph, then the median of
``repeats`` timed passes, activations kept and grad enabled, the clock around each op call
only (a node timed on its own runs with warm caches and recycled memory: the sum fell 15-35%
short of the graph's forward). Backwards are timed per node, its activation inputs detached so
that autograd stops at the node: one backward to the activation inputs and parameters together
(what the stage runs), split between B (input gradients) and W (weight gradients) in the ratio
of a backward to each alone. The device is synchronised around every timing. The times are
cached as JSON under ``$FXPIPE_CACHE_DIR`` (default ``~/.cache/fxpipe``), keyed by the graph's
code, the input shapes and dtypes, the device, the torch version and :data:`PROFILE_FORMAT`, so
a spec is profiled once per machine kind. The loss (:mod:`fxpipe.partitioner.loss_cost`) is
timed by :func:`profile_loss` and cached next to it.

:class:`SendCost` is what a point-to-point message costs the pipeline (gloo on CPU copies the
bytes in the sender's thread and in the receiver's, on the CPUs the ranks compute on; NCCL hands
them to the device): measured by ``fxpipe profile`` between two busy local ranks
(:mod:`fxpipe.training.profiling`) and cached here; the simulator charges it to every send.

Size: over 600 lines because timing forward, input-gradient and weight-gradient per node needs its
own interpreter and timing harness."""

from __future__ import annotations

import contextlib
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
from fxpipe.execution.dtypes import autocast_dtype
from fxpipe.execution.host_memory import keep_freed_memory
from fxpipe.partitioner.boundaries import resolve_attr
from fxpipe.partitioner.timing import NodeTimes
from fxpipe.partitioner.trace import COMPUTE_OPS, TracedModel

__all__ = ["cache_dir", "profile_key", "profile_graph", "load_profile", "save_profile",
           "PROFILE_FORMAT", "profile_loss", "loss_key", "load_loss_profile", "save_loss_profile",
           "SEND_METHOD", "SendCost", "load_send_cost", "send_cost_path", "kept_state",
           "like_a_rank"]


def cache_dir() -> Path:
    """Where measured costs are cached: ``$FXPIPE_CACHE_DIR`` or ``~/.cache/fxpipe``."""
    return Path(os.environ.get("FXPIPE_CACHE_DIR") or Path.home() / ".cache" / "fxpipe")


#: what the cached times mean; part of every cache key, so that times measured another way are
#: measured again (2: forwards timed in sequence, one joint backward split between B and W)
PROFILE_FORMAT = "profile-v4"


def profile_key(traced: TracedModel, device: str, precision: str = "fp32") -> str:
    """Cache key of a traced graph's measured costs: its code, input shapes and dtypes, the
    parameters' and buffers' dtypes, the device, the precision it is timed in
    (``train.precision``: fp32, or bf16 / fp16 autocast), the torch version and
    :data:`PROFILE_FORMAT`."""
    h = hashlib.sha256()
    h.update(traced.gm.code.encode())
    for n in traced.gm.graph.nodes:
        if n.op == "placeholder":
            v = n.meta.get("val")
            h.update(f"{n.name}:{getattr(v, 'shape', None)}:{getattr(v, 'dtype', None)}".encode())
    for name, t in [*traced.gm.named_parameters(), *traced.gm.named_buffers()]:
        h.update(f"{name}:{t.dtype}".encode())
    h.update(f"{device}|{precision}|{torch.__version__}|{PROFILE_FORMAT}".encode())
    return h.hexdigest()[:24]


def _path(key: str) -> Path:
    return cache_dir() / "profiles" / f"{key}.json"


#: no single op of one micro-batch takes longer than this (seconds): a cached time past it is
#: damaged
MAX_OP_S = 3600.0


def _seconds(values) -> list[float]:
    """``values`` as seconds; ValueError unless every one is a number (not a boolean) in
    ``[0, MAX_OP_S]`` (a damaged or hand-edited cache entry is measured again, not planned
    with)."""
    if any(isinstance(v, bool) for v in values):
        raise ValueError("times are numbers, not booleans")
    out = [float(v) for v in values]
    if not all(0 <= v <= MAX_OP_S for v in out):  # NaN fails too
        raise ValueError(f"times must be in [0, {MAX_OP_S:g}] s")
    return out


def load_profile(key: str) -> dict[str, NodeTimes] | None:
    """Cached times for ``key``, or None (also when the entry is damaged: a missing field, a
    time that :func:`_seconds` refuses)."""
    path = _path(key)
    try:
        data = json.loads(path.read_text())
        return {k: NodeTimes(*_seconds(v)) for k, v in data["nodes"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError,
            OverflowError):
        return None


def save_profile(key: str, times: dict[str, NodeTimes], meta: dict[str, Any]) -> Path:
    """Write the cache entry atomically, and drop the stage timings made with the profile it
    replaces (:mod:`fxpipe.partitioner.stage_timing`); returns its path."""
    path = _path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"meta": {**meta, "format": PROFILE_FORMAT}, "nodes": {
        k: [t.fwd_s, t.bwd_input_s, t.bwd_weight_s] for k, t in times.items()}}))
    tmp.replace(path)
    for old in path.parent.glob(f"stages-{key}-*.json"):  # timed with the old profile's cut
        old.unlink(missing_ok=True)
    return path


#: the clock every timing reads (seconds)
_clock = time.perf_counter


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def like_a_rank(device: torch.device, precision: str = "fp32"):
    """The ``with`` block runs as every worker rank runs (:mod:`fxpipe.training.worker`,
    :func:`fxpipe.runtime.mesh.init_distributed`): under ``torch.autocast`` in the precision's
    dtype (``train.precision`` bf16 / fp16; fp32: none), and on a CPU with one intra-op thread
    (then as before) and glibc's malloc keeping freed memory
    (:func:`fxpipe.execution.host_memory.keep_freed_memory`; process-wide, it stays). A time
    taken otherwise is not the time a rank will see. (The ranks run only the forward and the
    loss under autocast; a backward run inside it computes the same: autograd replays the
    forward's dtypes.)"""
    before = torch.get_num_threads()
    amp = autocast_dtype(precision)
    if device.type == "cpu":
        keep_freed_memory()
        torch.set_num_threads(1)
    try:
        with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
            yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


@contextlib.contextmanager
def kept_state(module: torch.nn.Module, device: torch.device):
    """``module``'s buffers (BatchNorm's running statistics and batch count) and the random
    number generators (dropout) as they were before the ``with`` block: timing runs training
    forwards, which would move them in the user's model."""
    bufs = [(b, b.detach().clone()) for b in module.buffers()]
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            with torch.no_grad():
                for b, v in bufs:
                    b.copy_(v)


def _median_time(fn: Callable[[], Any], device: torch.device, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(1, repeats)):
        _sync(device)
        t0 = _clock()
        fn()
        _sync(device)
        times.append(_clock() - t0)
    return statistics.median(times)


def _node_error(n: torch.fx.Node, e: Exception) -> PlanError:
    return PlanError(f"profiling node {n.name!r} ({n.target}) failed on the example batch with "
                     f"{type(e).__name__}: {' '.join(str(e).split())[:300]}; check that the "
                     "dataset's batches fit the model (vocabulary, shapes)")


def _op(gm: torch.fx.GraphModule, n: torch.fx.Node) -> Callable[..., Any]:
    """What node ``n`` calls, as ``fn(*args, **kwargs)``."""
    if n.op == "call_module":
        return gm.get_submodule(n.target)
    if n.op == "call_method":
        return lambda self, *a, **kw: getattr(self, n.target)(*a, **kw)
    return n.target


def _forward_in_sequence(gm: torch.fx.GraphModule, given: dict[str, Any], device: torch.device,
                         record: dict[str, list[float]] | None) -> dict[str, Any]:
    """One forward pass over the graph, node by node, as training runs it (grad enabled, every
    activation kept and connected to the autograd graph); with ``record``, each compute node's
    seconds (around its op call only) appended to ``record[name]``. Returns the values.

    On a CPU each op is timed between synchronisations; on CUDA between two events on the
    stream with nothing synchronised in the pass (:func:`_stamp`), as a stage runs: an op's
    time is its kernels', or the host's time to issue them where the GPU waits on the host
    (short kernels), and no synchronisation's own latency is counted per node."""
    env: dict[str, Any] = {}
    stamps: list[tuple[str, Any, Any]] = []  # (node, before, after), read once synchronised

    def fetch(a: torch.fx.Node) -> Any:
        return env[a.name]

    for n in gm.graph.nodes:
        if n.op == "placeholder":
            env[n.name] = given.get(n.name)
            continue
        if n.op == "get_attr":
            env[n.name] = resolve_attr(gm, str(n.target))
            continue
        if n.op not in COMPUTE_OPS:
            continue
        fn = _op(gm, n)
        args = pytree.tree_map_only(torch.fx.Node, fetch, n.args)
        kwargs = pytree.tree_map_only(torch.fx.Node, fetch, n.kwargs)
        t0 = _stamp(device)
        try:
            out = fn(*args, **kwargs)
        except Exception as e:  # the model cannot run this input (e.g. a token id too large)
            raise _node_error(n, e) from None
        t1 = _stamp(device)
        env[n.name] = out
        if record is not None:
            stamps.append((n.name, t0, t1))
    if stamps:
        _sync(device)
        for name, t0, t1 in stamps:
            record[name].append(_between(t0, t1))
    return env


def engine_overhead_s(device: torch.device, warmup: int = 20, repeats: int = 101) -> float:
    """Seconds one ``torch.autograd.grad`` call costs beyond its nodes' work: the median of a
    call through one multiply of a single number. A node's backward timed on its own pays it
    once; a stage's backward pays it once for all its nodes."""
    x = torch.ones(1, device=device, requires_grad=True)
    with torch.enable_grad():
        y = x * 2.0
    g = torch.ones_like(y)
    return _median_time(lambda: torch.autograd.grad([y], [x], [g], retain_graph=True),
                        device, warmup, repeats)


#: a node's backward keeps at least this share of its own-call time after the engine's
#: per-call cost is taken off (timing noise can make the cost exceed a tiny node's time)
MIN_BACKWARD_SHARE = 0.05


def _split_joint(joint: float, b: float, w: float) -> tuple[float, float]:
    """The joint backward's seconds split between B and W in the ratio of their separate
    times (halves when both are 0)."""
    if b + w <= 0:
        return joint / 2, joint / 2
    return joint * b / (b + w), joint * w / (b + w)


def profile_graph(traced: TracedModel, inputs: list[torch.Tensor], device: torch.device | str,
                  *, warmup: int = 2, repeats: int = 5,
                  progress: Callable[[int, int], None] | None = None,
                  precision: str = "fp32") -> dict[str, NodeTimes]:
    """Measured :class:`NodeTimes` of every compute node of ``traced`` (a graph of a real model
    on ``device``), run on ``inputs`` (the values of its tensor inputs,
    ``traced.input_names``, in order). The model's buffers (BatchNorm's running statistics)
    and the random number generators are as before afterwards.

    Forwards: ``warmup`` untimed then ``repeats`` timed passes over the whole graph in order,
    node by node, as training runs it (grad enabled, activations kept); a node's forward is the
    median of its ``repeats`` times. Timed on its own (the same inputs again, the output freed)
    a node runs with warm caches and recycled memory, and the sum falls 15-35% short of the
    graph's forward, most for small element-wise ops; in sequence the sum is close.

    Backwards: per node on its own (its activation inputs detached, so autograd stops at the
    node): the median of one backward to the activation inputs and the parameters together
    (what the stage's backward runs), split between B (input gradients) and W (weight
    gradients) in the ratio of a backward to each alone. B + W is the joint time: two separate
    calls would each pay the autograd engine's per-call cost, and a fused backward kernel
    (layer norm's) would run twice. The joint time itself is measured in sequence too: after
    each timed forward pass, one backward through the whole graph (one engine call, as a stage
    runs it) with a hook on every node's output, and a node's backward is the time from its
    hook to the next (median over the passes). Node by node on their own, a graph's backward
    summed 8% under to 30% over its own on this machine's probes, not uniformly (a late conv
    under, an early one over). A node the whole backward does not reach (no hook fired) keeps
    its own-call time less the engine's per-call cost (:func:`engine_overhead_s`).

    Args:
        progress: called as ``progress(done, total)`` after each node's backward.
        precision: ``train.precision``: bf16 / fp16 time the graph under autocast, as the
            ranks run it.

    Raises:
        PlanError: a node fails on these inputs (the message names it).
    """
    device = torch.device(device)
    # the user's BatchNorm statistics, dropout's RNG; one thread on a CPU, as a rank
    with kept_state(traced.gm, device), like_a_rank(device, precision):
        return _profile_graph(traced, inputs, device, warmup, repeats, progress)


def _profile_graph(traced: TracedModel, inputs: list[torch.Tensor], device: torch.device,
                   warmup: int, repeats: int, progress) -> dict[str, NodeTimes]:
    gm = traced.gm
    given = dict(zip(traced.input_names, inputs))  # the tensor placeholders, in order
    computes = [n for n in gm.graph.nodes if n.op in COMPUTE_OPS]
    samples: dict[str, list[float]] = {n.name: [] for n in computes}
    env: dict[str, Any] = {}
    in_seq: dict[str, list[float]] = {n.name: [] for n in computes}
    with torch.enable_grad():
        for p in range(max(0, warmup) + max(1, repeats)):
            env = {}  # free the last pass's activations first
            timed = p >= warmup
            env = _forward_in_sequence(gm, given, device, samples if timed else None)
            _backward_in_sequence(gm, env, device, in_seq if timed else None)
    fwd = {k: statistics.median(v) for k, v in samples.items()}
    bwd_seq = {k: statistics.median(v) for k, v in in_seq.items() if v}
    for n in gm.graph.nodes:  # the backward runs on detached values of the last pass
        if n.op in COMPUTE_OPS:
            env[n.name] = pytree.tree_map_only(torch.Tensor, lambda t: t.detach(), env[n.name])
    out_times: dict[str, NodeTimes] = {}
    engine_s: float | None = None  # measured when a node needs it (the whole backward missed it)

    def fetch(a):
        return env[a.name] if isinstance(a, torch.fx.Node) else a

    for k, n in enumerate(computes):
        args = pytree.tree_map_only(torch.fx.Node, fetch, n.args)
        kwargs = pytree.tree_map_only(torch.fx.Node, fetch, n.kwargs)
        params = [env[a.name] for a in n.all_input_nodes if a.op == "get_attr"
                  and isinstance(env[a.name], torch.nn.Parameter) and env[a.name].requires_grad]
        if n.op == "call_module":
            params += [p for p in gm.get_submodule(n.target).parameters() if p.requires_grad]
        params = list({id(p): p for p in params}.values())
        pids = {id(p) for p in params}
        # parameters and buffers (BatchNorm's running statistics: no gradient) stay as they are
        pids |= {id(env[a.name]) for a in n.all_input_nodes if a.op == "get_attr"}
        swap: dict[int, torch.Tensor] = {}
        for v in pytree.tree_leaves((args, kwargs)):
            if (isinstance(v, torch.Tensor) and id(v) not in pids and id(v) not in swap
                    and (v.is_floating_point() or v.is_complex())):
                swap[id(v)] = v.detach().requires_grad_(True)
        acts = list(swap.values())
        fn = _op(gm, n)
        try:
            with torch.enable_grad():
                try:
                    l_args, l_kwargs = pytree.tree_map_only(
                        torch.Tensor, lambda v: swap.get(id(v), v), (args, kwargs))
                    out = fn(*l_args, **l_kwargs)
                except RuntimeError:  # an in-place op on a leaf: give it a copy to write
                    l_args, l_kwargs = pytree.tree_map_only(
                        torch.Tensor, lambda v: swap[id(v)].clone() if id(v) in swap else v,
                        (args, kwargs))
                    out = fn(*l_args, **l_kwargs)
        except Exception as e:
            raise _node_error(n, e) from None
        leaves = [o for o in pytree.tree_leaves(out)
                  if isinstance(o, torch.Tensor) and o.requires_grad]
        bi = bw = 0.0
        if leaves and (acts or params):
            grads = [torch.ones_like(o) for o in leaves]

            def grad_of(wrt):
                return lambda: torch.autograd.grad(leaves, wrt, grads, retain_graph=True,
                                                   allow_unused=True)
            try:
                if n.name in bwd_seq:  # in the whole graph's backward: the ratio only
                    joint = bwd_seq[n.name]
                else:
                    joint = _median_time(grad_of(acts + params), device, warmup, repeats)
                    if engine_s is None:
                        engine_s = engine_overhead_s(device)
                    joint = max(joint - engine_s, MIN_BACKWARD_SHARE * joint)
                if acts and params:  # the ratio only: fewer repeats, the joint runs warmed up
                    few = max(1, (repeats + 1) // 2)
                    bi, bw = _split_joint(joint, _median_time(grad_of(acts), device, 1, few),
                                          _median_time(grad_of(params), device, 1, few))
                elif acts:
                    bi = joint
                else:
                    bw = joint
            except RuntimeError:  # an op without a derivative: no backward to time
                bi = bw = 0.0
        out_times[n.name] = NodeTimes(fwd[n.name], bi, bw)
        if progress is not None:
            progress(k + 1, len(computes))
    return out_times


def _backward_in_sequence(gm: torch.fx.GraphModule, env: dict[str, Any], device: torch.device,
                          record: dict[str, list[float]] | None) -> float | None:
    """One backward through a pass's whole autograd graph (``env``, from
    :func:`_forward_in_sequence`), from all-ones gradients of its float outputs to every
    parameter and float input, as a stage's backward runs (one engine call); nothing is
    accumulated into ``.grad``. With ``record``, each compute node's share is appended to
    ``record[name]``: a hook on the node's output fires just before the engine runs the
    node's backward, and the time until the next such hook is that backward's (on CUDA
    between events the hooks record on the stream, :func:`_stamp`: the host's clock there
    put a backward's time on whichever later node happened to wait for the GPU). Returns the
    whole backward's seconds, or None when the outputs have no gradient."""
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    outs = [v for v in pytree.tree_leaves(pytree.tree_map_only(
        torch.fx.Node, lambda a: env.get(a.name), out_node.args))
        if isinstance(v, torch.Tensor) and v.requires_grad]
    wrt = [p for p in gm.parameters() if p.requires_grad]
    wrt += [v for n in gm.graph.nodes if n.op == "placeholder"
            for v in [env.get(n.name)] if isinstance(v, torch.Tensor) and v.requires_grad]
    if not outs or not wrt:
        return None
    grads = [torch.ones_like(o) for o in outs]
    events: list[tuple[float, str]] = []
    handles = []
    if record is not None:
        for n in gm.graph.nodes:
            if n.op not in COMPUTE_OPS:
                continue
            for v in pytree.tree_leaves(env.get(n.name)):
                if isinstance(v, torch.Tensor) and v.grad_fn is not None:
                    handles.append(v.register_hook(
                        lambda g, name=n.name: events.append((_stamp(device), name))))
    _sync(device)
    t0 = _clock()
    try:
        torch.autograd.grad(outs, wrt, grads, allow_unused=True)
        last = _stamp(device)
        _sync(device)
    except RuntimeError:  # an op without a derivative
        return None
    finally:
        for h in handles:
            h.remove()
    end = _clock()
    if record is not None:
        got: dict[str, float] = {}
        for (t, name), (t_next, _) in zip(events, events[1:] + [(last, "")]):
            got[name] = got.get(name, 0.0) + _between(t, t_next)
        for name, dt in got.items():
            record[name].append(dt)
    return end - t0


def _stamp(device: torch.device) -> Any:
    """A point in time as the device sees it: the host clock on a CPU (ops run as they are
    called); on CUDA an event recorded on the current stream, as the host's clock only tells
    when a kernel was queued (the host runs ahead of the GPU until something waits on it)."""
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return _clock()


def _between(a: Any, b: Any) -> float:
    """Seconds from stamp ``a`` to stamp ``b`` (:func:`_stamp`; events once synchronised)."""
    if isinstance(a, float):
        return b - a
    return a.elapsed_time(b) * 1e-3


def loss_key(profile: str, loss: str, output: torch.Tensor, target: torch.Tensor) -> str:
    """Cache key of a loss's measured times: the graph's :func:`profile_key` (device, dtype and
    torch version included), the loss's name and the output's and target's shapes and dtypes."""
    h = hashlib.sha256()
    h.update(f"{PROFILE_FORMAT}|{profile}|{loss}|{tuple(output.shape)}:{output.dtype}|"
             f"{tuple(target.shape)}:{target.dtype}".encode())
    return h.hexdigest()[:24]


def _loss_path(key: str) -> Path:
    return cache_dir() / "profiles" / f"loss-{key}.json"


def load_loss_profile(key: str) -> NodeTimes | None:
    """Cached loss times for ``key`` (forward, backward to the output), or None."""
    try:
        data = json.loads(_loss_path(key).read_text())
        return NodeTimes(*_seconds([data["fwd_s"], data["bwd_s"]]), 0.0)
    except (OSError, ValueError, KeyError, TypeError, RecursionError, OverflowError):
        return None


def save_loss_profile(key: str, times: NodeTimes, meta: dict[str, Any]) -> Path:
    """Write the loss's cache entry atomically; returns its path."""
    path = _loss_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"meta": meta, "fwd_s": times.fwd_s, "bwd_s": times.bwd_input_s}))
    tmp.replace(path)
    return path


def profile_loss(loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 output: torch.Tensor, target: torch.Tensor, device: torch.device | str, *,
                 warmup: int = 3, repeats: int = 15, precision: str = "fp32") -> NodeTimes:
    """Measured seconds of ``loss_fn(output, target)`` (what the last stage runs on the model's
    output): the median forward as ``fwd_s`` and the median backward to ``output`` as
    ``bwd_input_s`` (a fresh leaf each run, as each micro-batch's output is)."""
    device = torch.device(device)
    f: list[float] = []
    b: list[float] = []
    grad = output.is_floating_point() or output.is_complex()
    with torch.enable_grad(), like_a_rank(device, precision):
        for i in range(max(0, warmup) + max(1, repeats)):
            o = output.detach().requires_grad_(grad)
            _sync(device)
            t0 = _clock()
            loss = loss_fn(o, target)
            _sync(device)
            t1 = _clock()
            if grad and isinstance(loss, torch.Tensor) and loss.requires_grad:
                torch.autograd.grad(loss, o, allow_unused=True)
            _sync(device)
            t2 = _clock()
            if i >= warmup:
                f.append(t1 - t0)
                b.append(t2 - t1)
    return NodeTimes(statistics.median(f), statistics.median(b), 0.0)


#: how the cached send cost was measured; a cache written another way is measured again
SEND_METHOD = "busy-pair-v1"
#: a cached send cost past these is damaged: no measured message (16 MiB at most) takes 10 s,
#: and none moves slower than 1 kB/s
MAX_SEND_S = 10.0
MIN_SEND_RATE_BPS = 1e3


class SendCost:
    """Seconds one point-to-point message costs the pipeline: ``overhead_s + nbytes / rate_Bps``,
    or, where measured ``points`` (``[(bytes, seconds)]``, ascending bytes) are given, their
    piecewise-linear interpolation (the time of the smallest size below it; beyond the largest,
    its time plus the extra bytes at ``rate_Bps``). Measured (``fxpipe profile``) it is what the
    sender staging the bytes and the receiver reading them take from two busy ranks' compute
    (gloo on CPU), far from linear in the size; the simulator charges it to the send. ``method``:
    how it was measured (:data:`SEND_METHOD`), None for a default."""

    def __init__(self, overhead_s: float, rate_Bps: float,
                 points: list[tuple[float, float]] | None = None, method: str | None = None):
        self.overhead_s, self.rate_Bps = float(overhead_s), float(rate_Bps)
        self.points = sorted((float(b), float(t)) for b, t in points) if points else None
        self.method = method

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
        if self.method:
            d["method"] = self.method
        return d


def send_cost_path(device: str) -> Path:
    """Cache file of the measured send cost of ``device``'s backend."""
    return cache_dir() / "profiles" / f"send-{device}-{torch.__version__}.json"


def load_send_cost(device: str) -> SendCost | None:
    """The measured send cost (``fxpipe profile`` writes it), or None (also for one measured
    another way, by an older fxpipe)."""
    try:
        d = json.loads(send_cost_path(device).read_text())
        if d.get("method") != SEND_METHOD:
            return None
        (overhead,) = _seconds([d["overhead_s"]])
        if isinstance(d["rate_Bps"], bool):
            raise ValueError("rate_Bps is a number")
        rate = float(d["rate_Bps"])
        if not rate >= MIN_SEND_RATE_BPS:  # inf: a backend whose sender only enqueues
            raise ValueError(f"rate_Bps must be >= {MIN_SEND_RATE_BPS:g}")
        points = sorted((float(b), *_seconds([t])) for b, t in d.get("points") or [])
        if not all(np.isfinite(b) and b >= 0 for b, _ in points):
            raise ValueError("points are (bytes, seconds)")
        times = [overhead] + [t for _, t in points]
        if max(times) > MAX_SEND_S or any(b1 <= b0 for (b0, _), (b1, _) in
                                          zip(points, points[1:])):
            raise ValueError("a send time past MAX_SEND_S, or a size measured twice")
        if any(t1 < t0 for (_, t0), (_, t1) in zip(points, points[1:])):
            raise ValueError("a bigger message that costs less (the profiler writes a "
                             "non-decreasing fit)")
        return SendCost(overhead, rate, points or None, SEND_METHOD)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError,
            OverflowError):
        return None
