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
(``rewrite``: :func:`fxpipe.runtime.grad_fusion.fuse_weight_grads`); the parameters' ``.grad``
are put back as they were afterwards. Rounds visit every stage of every cut
in turn, so load that comes and goes touches the cuts alike, and go on until at least
``min_rounds`` are timed and ``min_time_s`` has passed (a burst shorter than half of that moves
no median); a stage's time is its median over the rounds.

The outcome of a refinement (:mod:`fxpipe.partitioner.refine`) is cached next to the profile,
keyed by the profile key and the layout, so that planning the same spec again gives the same
plan without timing anything.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn

from fxpipe.partitioner import profile as _profile
from fxpipe.partitioner.boundaries import GUARDS_FN, stage_boundaries
from fxpipe.partitioner.split import build_stage_module

__all__ = ["time_stages", "refine_key", "load_refined", "save_refined"]


def _leaf(v: Any) -> Any:
    """A received value: detached, a leaf that takes a gradient when it is a float tensor."""
    if isinstance(v, torch.Tensor):
        v = v.detach()
        if v.is_floating_point() or v.is_complex():
            v.requires_grad_(True)
    return v


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
        _profile._sync(device)
        t0 = _profile._clock()
        with torch.enable_grad():
            outs = self.mods[j](*ins)
        _profile._sync(device)
        dt = _profile._clock() - t0
        vals.update(zip(sb.outputs, outs))
        return dt, (ins, outs)

    def backward(self, j: int, live: tuple, device) -> float:
        ins, outs = live
        outs = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
        wrt = self.params[j] + [v for v in ins if isinstance(v, torch.Tensor) and v.requires_grad]
        if not outs or not wrt:
            return 0.0
        grads = [torch.ones_like(o) for o in outs]
        _profile._sync(device)
        t0 = _profile._clock()
        torch.autograd.backward(outs, grads, inputs=wrt)  # accumulates into .grad
        _profile._sync(device)
        return _profile._clock() - t0


def time_stages(gm: fx.GraphModule, assignments: list[dict[str, int]], num_stages: int,
                inputs: list[Any], device: torch.device | str, *, warmup: int = 2,
                min_rounds: int = 7, max_rounds: int = 31, min_time_s: float = 0.5,
                rewrite: Callable[[nn.Module], tuple[nn.Module, int]] | None = None
                ) -> list[list[tuple[float, float]]]:
    """Seconds of every stage's forward and backward for each cut in ``assignments``
    (compute-node name -> stage, as :func:`~fxpipe.partitioner.boundaries.stage_boundaries`
    takes it) of ``gm``, run on ``inputs`` (its placeholders' values, in order). Returns, per
    cut, ``[(forward, backward), ...]`` per stage (medians over the timed rounds).

    Raises:
        SplitError: an assignment is not a valid cut of ``gm``.
    """
    device = torch.device(device)
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    given = dict(zip(placeholders, inputs))
    cuts = [_Cut(gm, {n: s for n, s in a.items() if n != GUARDS_FN}, num_stages, rewrite)
            for a in assignments]
    saved = [(p, p.grad) for p in gm.parameters()]
    for p, _ in saved:  # accumulate into fresh tensors: the caller's .grad stay untouched
        p.grad = None
    try:
        return _rounds(cuts, given, num_stages, device, warmup, min_rounds, max_rounds,
                       min_time_s)
    finally:
        for p, g in saved:
            p.grad = g


def _rounds(cuts: list[_Cut], given: dict[str, Any], num_stages: int, device: torch.device,
            warmup: int, min_rounds: int, max_rounds: int, min_time_s: float
            ) -> list[list[tuple[float, float]]]:
    fwd = [[[] for _ in range(num_stages)] for _ in cuts]
    bwd = [[[] for _ in range(num_stages)] for _ in cuts]
    t_start = None
    r = 0
    while r < warmup + max_rounds:
        timed = r >= warmup
        if timed and t_start is None:
            t_start = _profile._clock()
        order = range(len(cuts)) if r % 2 == 0 else reversed(range(len(cuts)))
        for c in order:
            cut, vals, live = cuts[c], {}, []
            for j in range(num_stages):
                dt, lv = cut.forward(given, j, vals, device)
                live.append(lv)
                if timed:
                    fwd[c][j].append(dt)
            for j in reversed(range(num_stages)):
                dt = cut.backward(j, live[j], device)
                live[j] = None
                if timed:
                    bwd[c][j].append(dt)
        r += 1
        if (timed and r - warmup >= min_rounds
                and _profile._clock() - t_start >= min_time_s):
            break
    return [[(statistics.median(f), statistics.median(b)) for f, b in zip(fwd[c], bwd[c])]
            for c in range(len(cuts))]


#: how stages are timed; part of every refinement's cache key
STAGE_TIMING_FORMAT = "stages-v2"  # 2: weight gradients accumulate into .grad


def refine_key(profile: str, layout: str, first_cuts: list[int]) -> str:
    """Cache key of one refinement: the model's profile key, the layout (schedule, stages,
    micro-batches, micro-batch size, recomputation, gradient accumulation) and the cut it
    started from."""
    h = hashlib.sha256(json.dumps([profile, layout, list(first_cuts),
                                   STAGE_TIMING_FORMAT]).encode())
    return h.hexdigest()[:24]


def _path(key: str):
    return _profile.cache_dir() / "profiles" / f"refined-{key}.json"


def load_refined(key: str) -> dict | None:
    """A cached refinement (``{"cuts": [...], "factors": [[f, b], ...], "rounds": [...]}``)."""
    p = _path(key)
    if not p.exists():
        return None
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    if data.get("format") != _profile.PROFILE_FORMAT or not isinstance(data.get("result"), dict):
        return None
    return data["result"]


def save_refined(key: str, result: dict) -> None:
    """Cache a refinement (written whole, then renamed, so a reader never sees half)."""
    p = _path(key)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"format": _profile.PROFILE_FORMAT, "result": result}))
    tmp.replace(p)
