"""Whole stages timed on the device: the check on a measured-cost plan's per-node sums.

The per-node profile (:mod:`fxpipe.partitioner.profile`) prices a stage as the sum of its
nodes. On this machine such sums were off by up to a third for a whole stage: runs of cheap
element-wise nodes were priced heavier than they run back to back, and a burst of load on a
shared machine during the profile's passes moves the times of all the nodes timed in it.
:func:`time_stages` times the stages of one or more cuts as the ranks run them: each stage's
``GraphModule`` (:func:`~fxpipe.partitioner.split.build_stage_module`), forward with grad
enabled on the previous stage's outputs (detached, as received), then one backward per stage to
its parameters and inputs from all-ones output gradients, last stage first (the loss is not
included; :mod:`fxpipe.partitioner.loss_cost` prices it). The weight gradients accumulate into
``.grad`` as over a step's micro-batches (adding a late convolution's gradient into ``.grad``
costs a stage with many parameters a millisecond the per-node profile, which accumulates
nothing, never saw), through the runtime's in-place accumulation where it will run
(``rewrite``: :func:`fxpipe.execution.grad_fusion.fuse_weight_grads`); the parameters' ``.grad``
are put back as they were afterwards. Rounds visit every stage of every cut
in turn, so load that comes and goes touches the cuts alike, and go on until at least
``min_rounds`` are timed and ``min_time_s`` has passed (a burst shorter than half of that moves
no median); a stage's time is its median over the rounds.

Ranks that share one CPU (``ranks`` given: the stage -> rank map) also share its memory
bandwidth and caches: the ranks of a 2-stage pipeline on this machine's two cores slowed a
memory-bound stage of LayerNorm+GELU layers more than a stage of matmuls, which a stage timed
alone in one process never sees. There the stages of a cut run side by side, one thread per
rank (each with the caller's intra-op thread count, one on a CPU, running its stages' forward
and backward in turn, on inputs made by one untimed forward of the cut), the ranks of one node
together and at most as many at once as this machine has cores, until every rank has run its
stages once; a rank that finishes first starts again, so every timed run had the other ranks
running beside it (a run still going when the last rank finishes is dropped). An interrupt
(Ctrl-C) stops and joins the threads before it leaves.

The timings are cached next to the profile (:class:`StageTimes`, keyed by the profile key),
cut by cut, so that planning the same spec again gives the same plan without timing anything,
and a changed spec (memory, links, the layout) re-solves with the same timings.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import threading
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn

from fxpipe.partitioner import profile as _profile
from fxpipe.partitioner.boundaries import GUARDS_FN, stage_boundaries
from fxpipe.partitioner.split import build_stage_module

__all__ = ["time_stages", "side_by_side_groups", "StageTimes", "stage_times_key",
           "STAGE_TIMING_FORMAT"]



def _leaf(v: Any) -> Any:
    """A received value: detached, a leaf that takes a gradient when it is a float tensor."""
    if isinstance(v, torch.Tensor):
        v = v.detach()
        if v.is_floating_point() or v.is_complex():
            v.requires_grad_(True)
    return v


def _timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    """``fn()``'s seconds (the device synchronised around it) and its result."""
    _profile._sync(device)
    t0 = _profile._clock()
    out = fn()
    _profile._sync(device)
    return _profile._clock() - t0, out


class _Cut:
    """The stage modules of one cut of ``gm``, ready to run."""

    def __init__(self, gm: fx.GraphModule, node_stage: dict[str, int], num_stages: int,
                 rewrite: Callable[[nn.Module], tuple[nn.Module, int]] | None):
        self.bounds = stage_boundaries(gm, node_stage, num_stages)
        self.mods = [build_stage_module(gm, self.bounds, j) for j in range(num_stages)]
        if rewrite is not None:
            self.mods = [rewrite(m)[0] for m in self.mods]
        self.params = [[p for p in m.parameters() if p.requires_grad] for m in self.mods]

    def forward(self, given: dict[str, Any], j: int, vals: dict[str, Any], device) -> tuple:
        sb = self.bounds.stages[j]
        ins = [_leaf(vals[n]) if n in vals else given[n] for n in sb.inputs]
        with torch.enable_grad():
            dt, outs = _timed(lambda: self.mods[j](*ins), device)
        vals.update(zip(sb.outputs, outs))
        return dt, (ins, outs)

    def feeds(self, given: dict[str, Any], device) -> list[dict[str, Any]]:
        """Every stage's inputs from earlier stages (name -> value, detached), from one untimed
        forward of the cut."""
        vals: dict[str, Any] = {}
        for j in range(len(self.mods)):
            self.forward(given, j, vals, device)
        det = {n: v.detach() if isinstance(v, torch.Tensor) else v for n, v in vals.items()}
        return [{n: det[n] for n in sb.inputs if n in det} for sb in self.bounds.stages]

    def run(self, given: dict[str, Any], j: int, feed: dict[str, Any], device
            ) -> tuple[float, float]:
        """Stage ``j``'s forward (on the model's inputs ``given`` and the earlier stages'
        outputs ``feed``) and backward: their seconds."""
        f, live = self.forward(given, j, dict(feed), device)
        return f, self.backward(j, live, device)

    def backward(self, j: int, live: tuple, device) -> float:
        ins, outs = live
        outs = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
        wrt = self.params[j] + [v for v in ins if isinstance(v, torch.Tensor) and v.requires_grad]
        if not outs or not wrt:
            return 0.0
        grads = [torch.ones_like(o) for o in outs]
        # accumulates into .grad, as the step's later micro-batches do
        return _timed(lambda: torch.autograd.backward(outs, grads, inputs=wrt), device)[0]


def time_stages(gm: fx.GraphModule, assignments: list[dict[str, int]], num_stages: int,
                inputs: dict[str, Any], device: torch.device | str, *, warmup: int = 2,
                min_rounds: int = 7, max_rounds: int = 31, min_time_s: float = 0.5,
                rewrite: Callable[[nn.Module], tuple[nn.Module, int]] | None = None,
                ranks: list[int] | None = None, nodes: list[int] | None = None,
                cores: int | None = None, precision: str = "fp32"
                ) -> list[list[tuple[float, float]]]:
    """Seconds of every stage's forward and backward for each cut in ``assignments``
    (compute-node name -> stage, as :func:`~fxpipe.partitioner.boundaries.stage_boundaries`
    takes it) of ``gm``, run on ``inputs`` (placeholder name -> value). Returns, per cut,
    ``[(forward, backward), ...]`` per stage (medians over the timed rounds). The parameters'
    ``.grad``, the buffers (BatchNorm's running statistics) and the random number generators
    are as before afterwards. On a CPU it runs as a rank does (one intra-op thread, freed
    memory kept: :func:`~fxpipe.partitioner.profile.like_a_rank`).
    ``ranks`` (stage -> rank): a cut's stages run side by side, one thread per rank, the ranks
    of each node (``nodes``: rank -> node, None: one node) together, at most ``cores`` at once
    (:func:`side_by_side_groups`; the module doc); None: one stage after another.
    ``precision``: ``train.precision`` (bf16 / fp16: under autocast, as the ranks run).

    Raises:
        SplitError: an assignment is not a valid cut of ``gm``.
    """
    device = torch.device(device)
    cuts = [_Cut(gm, {n: s for n, s in a.items() if n != GUARDS_FN}, num_stages, rewrite)
            for a in assignments]
    saved = [(p, p.grad) for p in gm.parameters()]
    for p, _ in saved:  # accumulate into fresh tensors: the caller's .grad stay untouched
        p.grad = None
    try:
        with _profile.kept_state(gm, device), _profile.like_a_rank(device, precision):
            if ranks is not None and len(set(ranks)) > 1:
                if len(ranks) != num_stages:
                    raise ValueError(f"ranks: {len(ranks)} stages, not {num_stages}")
                groups = side_by_side_groups(ranks, nodes, cores)
                feeds = [cut.feeds(inputs, device) for cut in cuts]

                def visit(c: int) -> list[list[tuple[float, float]]]:
                    got: list[list[tuple[float, float]]] = [[] for _ in ranks]
                    for group in groups:
                        _side_by_side(cuts[c], inputs, feeds[c], group, device, got)
                    return got
            else:
                def visit(c: int) -> list[list[tuple[float, float]]]:
                    return _in_turn(cuts[c], inputs, device)
            return _rounds(cuts, visit, warmup, min_rounds, max_rounds, min_time_s)
    finally:
        for p, g in saved:
            p.grad = g


def _rounds(cuts: list[_Cut], visit: Callable[[int], list[list[tuple[float, float]]]],
            warmup: int, min_rounds: int, max_rounds: int, min_time_s: float
            ) -> list[list[tuple[float, float]]]:
    """Rounds over the cuts (order reversed every other round); ``visit(c)`` runs cut ``c``
    once and returns per stage its ``(forward, backward)`` runs. Per cut and stage, the
    medians over the timed rounds' runs."""
    runs: list[list[list[tuple[float, float]]]] = [[] for _ in cuts]
    t_start = None
    r = 0
    while r < warmup + max_rounds:
        timed = r >= warmup
        if timed and t_start is None:
            t_start = _profile._clock()
        order = range(len(cuts)) if r % 2 == 0 else reversed(range(len(cuts)))
        for c in order:
            got = visit(c)
            if timed:
                runs[c].append(got)
        r += 1
        if (timed and r - warmup >= min_rounds
                and _profile._clock() - t_start >= min_time_s):
            break
    out = []
    for c, cut in enumerate(cuts):
        per_stage = []
        for j in range(len(cut.mods)):
            ts = [t for got in runs[c] for t in got[j]]
            per_stage.append((statistics.median(f for f, _ in ts),
                              statistics.median(b for _, b in ts)))
        out.append(per_stage)
    return out


def _in_turn(cut: _Cut, given: dict[str, Any], device: torch.device
             ) -> list[list[tuple[float, float]]]:
    """One visit of a cut, one stage after another: every forward in order, then every
    backward, last stage first."""
    vals: dict[str, Any] = {}
    fwd, live = [], []
    for j in range(len(cut.mods)):
        dt, lv = cut.forward(given, j, vals, device)
        fwd.append(dt)
        live.append(lv)
    bwd = [0.0] * len(cut.mods)
    for j in reversed(range(len(cut.mods))):
        bwd[j] = cut.backward(j, live[j], device)
        live[j] = None
    return [[(f, b)] for f, b in zip(fwd, bwd)]


def _side_by_side(cut: _Cut, given: dict[str, Any], feeds: list[dict[str, Any]],
                  groups: list[list[int]], device: torch.device,
                  out: list[list[tuple[float, float]]]) -> None:
    """One round of a cut's ranks (``groups``: the stages of each) run at once, one thread
    each; appends to ``out[stage]`` the ``(forward, backward)`` of every run that had all the
    other ranks running beside it."""
    start = threading.Barrier(len(groups))
    stop = threading.Event()
    lock = threading.Lock()
    left = [len(groups)]
    errors: list[BaseException] = []

    threads_per_rank = torch.get_num_threads()
    # autocast is per thread too: the ranks' threads run in the caller's (train.precision)
    amp = torch.is_autocast_enabled(device.type)
    amp_dtype = torch.get_autocast_dtype(device.type)

    def work(stages: list[int], finished: threading.Event) -> None:
        try:
            # a new thread starts at OpenMP's default thread count, not the caller's
            torch.set_num_threads(threads_per_rank)
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp):
                _work(stages)
        except threading.BrokenBarrierError:
            pass
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
            errors.append(e)
            stop.set()
            start.abort()
        finally:
            finished.set()

    def _work(stages: list[int]) -> None:
        start.wait()
        first = True
        while not stop.is_set():
            got = [(j, cut.run(given, j, feeds[j], device)) for j in stages]
            with lock:
                if stop.is_set():  # the last rank finished during this run: not beside it
                    return
                for j, t in got:
                    out[j].append(t)
                if first:
                    first = False
                    left[0] -= 1
                    if left[0] == 0:
                        stop.set()

    finished = [threading.Event() for _ in groups]
    threads = [threading.Thread(target=work, args=(g, f), daemon=True)
               for g, f in zip(groups, finished)]
    started = 0
    try:
        for t in threads:
            started += 1
            t.start()
        for t in threads:
            t.join()
    except BaseException:  # Ctrl-C: no thread may outlive this on the user's model
        stop.set()
        start.abort()
        # not join(): a join interrupted by Ctrl-C can take a running thread for finished
        for f in finished[:started]:
            f.wait()
        raise
    if errors:
        raise errors[0]


def side_by_side_groups(ranks: list[int], nodes: list[int] | None = None,
                        cores: int | None = None) -> list[list[list[int]]]:
    """The runs of a side-by-side round: per run, the stages of each rank in it. ``ranks``:
    stage -> rank; ``nodes``: rank -> node (None: one node). The ranks of a node run together,
    at most ``cores`` at once (default: this machine's cores; more would time-slice here where
    each has a core of its own there); a rank alone runs alone."""
    if cores is None:
        cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                 else os.cpu_count() or 1)
    cores = max(1, int(cores))
    by_rank = {r: [j for j, q in enumerate(ranks) if q == r] for r in sorted(set(ranks))}
    node_of = (lambda r: 0) if nodes is None else (lambda r: nodes[r])
    runs = []
    for node in sorted({node_of(r) for r in by_rank}):
        here = [by_rank[r] for r in by_rank if node_of(r) == node]
        runs += [here[i:i + cores] for i in range(0, len(here), cores)]
    return runs


#: how stages are timed; part of every cache key of stage timings
STAGE_TIMING_FORMAT = "stages-v3"  # 2: weight gradients accumulate into .grad; 3: one thread


def stage_times_key(profile: str, units: list[str], setting: str) -> str:
    """Cache key of a model's stage timings: its profile key (graph, shapes, dtype, device,
    torch), its planning units and how the stages run (``setting``: e.g. the in-place gradient
    accumulation). The file name starts with the profile key, so re-profiling the model with
    ``fxpipe profile`` drops them too (:func:`fxpipe.partitioner.profile.save_profile`)."""
    h = hashlib.sha256(json.dumps([units, setting, STAGE_TIMING_FORMAT]).encode())
    return f"{profile}-{h.hexdigest()[:16]}"


def _path(key: str):
    return _profile.cache_dir() / "profiles" / f"stages-{key}.json"


def _times(v: Any, cut: Any) -> list[tuple[float, float]] | None:
    """``v`` as per-stage ``(forward, backward)`` seconds of the cut ``cut``, or None."""
    try:
        out = [(float(f), float(b)) for f, b in v]
        k = len(cut)
    except (TypeError, ValueError, OverflowError):
        return None
    return out if len(out) == k and all(0 <= f < math.inf and 0 <= b < math.inf
                                        for f, b in out) else None


def _cuts(sig: str) -> list[list[int]] | None:
    try:
        cuts = json.loads(sig)
        return [[int(i) for i in c] for c in cuts] if isinstance(cuts, list) else None
    except (TypeError, ValueError):
        return None


class StageTimes:
    """The cached stage timings of one model: ``alone[cut]`` (a cut timed by itself) and
    ``together[cuts]`` (cuts timed side by side, interleaved), per stage ``(forward,
    backward)`` seconds; a cut is its stage starts. Entries that do not parse are ignored."""

    def __init__(self, key: str):
        self.key = key
        self.alone: dict[str, list[tuple[float, float]]] = {}
        self.together: dict[str, list[list[tuple[float, float]]]] = {}
        try:
            data = json.loads(_path(key).read_text())
        except (OSError, ValueError, RecursionError):  # damaged (even nested past the limit)
            return
        if not isinstance(data, dict) or data.get("format") != STAGE_TIMING_FORMAT:
            return
        for sig, v in dict(data.get("alone") or {}).items():
            cuts = _cuts(sig)
            t = _times(v, cuts[0]) if cuts and len(cuts) == 1 else None
            if t is not None:
                self.alone[sig] = t
        for sig, vs in dict(data.get("together") or {}).items():
            cuts = _cuts(sig)
            ts = ([_times(v, c) for v, c in zip(vs, cuts)]
                  if cuts and isinstance(vs, list) and len(vs) == len(cuts) else [None])
            if all(t is not None for t in ts):
                self.together[sig] = ts

    @staticmethod
    def sig(cuts: list[list[int]]) -> str:
        return json.dumps([list(map(int, c)) for c in cuts])

    def save(self) -> None:
        """Written whole, then renamed, so a reader never sees half."""
        p = _path(self.key)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"format": STAGE_TIMING_FORMAT, "alone": self.alone,
                                   "together": self.together}))
        tmp.replace(p)
