"""Compiled stages (spec ``train.compile``): each stage's module run through ``torch.compile``.

A stage is already an FX graph of aten ops, which is what TorchDynamo and inductor want: the
executor compiles each stage module in place (``nn.Module.compile``: its parameters keep their
names, checkpoints and the optimizer see the same objects) with static shapes (a stage's
micro-batch shapes are fixed by the plan), so every (stage, micro-batch shape, grad mode) is
compiled once, before the first step (:mod:`fxpipe.runtime.compile_warmup`: one replica per
host first, the others from inductor's cache), and every micro-batch and step reuses it (the
tests count compilations). Under ``auto`` a stage whose compilation fails runs eagerly, the
log saying why; under ``stages`` the error stops the run. AOTAutograd compiles the backward
with it; the zero-bubble schedules' split backward takes the weight gradients from B's call of the compiled region
(:mod:`fxpipe.runtime.backward_split`). The tensor-parallel collectives stay outside the
compiled regions (``torch.compiler.disable`` in :mod:`fxpipe.tensor.collectives`: their
timing and error reporting are Python), so a tensor-parallel stage compiles as the regions
between them; identical regions (the blocks of one stage) share inductor's compiled code.

What composes: full recomputation (the first forward's saved tensors are dropped at the
compiled region's boundary, the replay runs the same compiled graph), activation offload (the
region's saved tensors go to the host), mixed precision (autocast is traced), data
parallelism and data sharding (the gradient hooks are on the parameters, outside), tensor
parallelism, ``fxpipe.compile``. What runs eagerly, said once per run: a stage under
selective or partial recomputation (their per-op caching and per-block split are eager
dispatch mechanisms) or gathering its parameters per block (its saved-tensor hooks tokenise
parameters). Gradient-accumulation fusion (:mod:`fxpipe.execution.grad_fusion`) is off on a
compiled stage: inductor fuses the backward itself.

Compile time goes to the run's log (the first step's extra seconds, and inductor's FX-graph
cache hits and misses: the cache, on by default, keeps compiled code across runs in
``$TORCHINDUCTOR_CACHE_DIR``, so a second run of the same stages skips inductor).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from fxpipe.errors import UsageError  # (execution/ imports only torch and fxpipe.errors)

__all__ = ["CompileSetting", "compile_problem", "compile_report", "compile_stages",
           "compile_counters", "compiled_rewrite", "eager_reason", "rank_compile_state",
           "resolve_compile"]


@dataclass(frozen=True)
class CompileSetting:
    """What ``train.compile`` / ``train.cuda_graphs`` resolved to on this device.

    Attributes:
        on: stages are compiled.
        cuda_graphs: compiled stages replay CUDA graphs (inductor's ``reduce-overhead``).
        note: one line for the run's log saying what was chosen and why.
    """

    on: bool
    cuda_graphs: bool = False
    note: str = ""
    #: ``auto``: a stage whose compilation fails runs eagerly (the log says so); ``stages``:
    #: the failure stops the run
    fallback: bool = False

    @property
    def mode(self) -> str | None:
        return "reduce-overhead" if self.cuda_graphs else None


def compile_problem(device: torch.device) -> str | None:
    """Why torch.compile's inductor cannot build kernels on ``device`` (None: it can): on CPU
    it needs a C++ compiler, on CUDA Triton."""
    if device.type == "cpu":
        try:
            from torch._inductor.cpp_builder import get_cpp_compiler

            cc = get_cpp_compiler()
        except Exception as e:  # noqa: BLE001 - inductor's own search failed: say why
            return f"inductor found no C++ compiler for CPU kernels ({e})"
        if not (shutil.which(cc) or shutil.which(cc.split()[0])):
            return f"inductor's C++ compiler {cc!r} is not on the PATH"
        return None
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        return None if has_triton() else "Triton is not installed (inductor's GPU kernels)"
    return f"fxpipe compiles stages on cpu and cuda only, not {device.type}"


def resolve_compile(mode: str, cuda_graphs: bool, device: torch.device) -> CompileSetting:
    """``train.compile`` (``none`` | ``stages`` | ``auto``) and ``train.cuda_graphs`` on this
    device. ``auto`` compiles on CUDA, where op-by-op launches cost the most (eager small
    stages are host-bound), and leaves CPU eager: there the first step pays tens of seconds
    of C++ compilation that the runs fxpipe makes on CPU (tests, examples) do not win back
    (BENCHMARKS.md, compiled stages). ``cuda_graphs`` needs no check of dynamic shapes: a
    plan fixes every stage's shapes per micro-batch, and the runtime refuses a batch of other
    shapes with the planned ones.

    Raises:
        UsageError: ``stages`` where inductor cannot compile, or ``cuda_graphs`` off CUDA or
            without compilation.
    """
    problem = compile_problem(device)
    if cuda_graphs and device.type != "cuda":
        raise UsageError(f"train.cuda_graphs: true needs a CUDA device; this run is on "
                         f"{device.type}: set cuda_graphs: false")
    if mode == "none":
        if cuda_graphs:
            raise UsageError("train.cuda_graphs: true captures the compiled stages' kernels, "
                             "but train.compile is none: set compile: stages (or auto)")
        return CompileSetting(False, note="stages run eagerly (train.compile: none)")
    if mode == "stages":
        if problem is not None:
            raise UsageError(f"train.compile: stages cannot compile here: {problem}; install "
                             "one or set compile: none")
        return CompileSetting(True, cuda_graphs, "stages compiled with torch.compile "
                              "(train.compile: stages)" + (", CUDA graphs" if cuda_graphs
                                                            else ""))
    if mode != "auto":
        raise UsageError(f"train.compile must be none, stages or auto, not {mode!r}")
    if device.type != "cuda":  # (cuda_graphs off CUDA: refused above)
        return CompileSetting(False, note="stages run eagerly (train.compile: auto is eager "
                              "on CPU; compile: stages compiles them)")
    if problem is not None:
        if cuda_graphs:
            raise UsageError(f"train.cuda_graphs: true needs compiled stages, which cannot be "
                             f"built here: {problem}")
        return CompileSetting(False, note=f"stages run eagerly: {problem} (train.compile: auto)")
    return CompileSetting(True, cuda_graphs, "stages compiled with torch.compile "
                          "(train.compile: auto on CUDA)" + (", CUDA graphs" if cuda_graphs
                                                             else ""), fallback=True)


def eager_reason(stage_plan, block_gather: bool) -> str | None:
    """Why a stage runs eagerly even when stages are compiled (None: it compiles)."""
    if block_gather:
        return "it gathers its parameters per block (param_gather: block)"
    if stage_plan.recompute and stage_plan.keep_ridge is not None:
        return "selective recomputation caches ops one by one"
    if stage_plan.recompute and stage_plan.recompute_blocks > 0:
        return "partial recomputation splits it by blocks"
    return None


@dataclass
class CompiledStages:
    """The stages this rank compiled, and those it left eager with the reason."""

    compiled: list[int] = field(default_factory=list)
    eager: dict[int, str] = field(default_factory=dict)

    def uncompile(self, stage: int, module: nn.Module, why: str) -> None:
        """Run ``stage`` eagerly from now on (its compilation failed under ``auto``)."""
        module._compiled_call_impl = None  # what nn.Module.compile set
        if stage in self.compiled:
            self.compiled.remove(stage)
        self.eager[stage] = why

    def lines(self) -> list[str]:
        out = []
        if self.compiled:
            out.append(f"compiled stages {self.compiled}")
        out += [f"stage {s} runs eagerly: {why}" for s, why in sorted(self.eager.items())]
        return out


def compile_stages(modules: dict[int, nn.Module], reasons: dict[int, str | None],
                   setting: CompileSetting, split_backward: bool = False) -> CompiledStages:
    """Compile ``modules`` in place (those whose reason is None) under ``setting``.
    ``split_backward``: B keeps the autograd graph for W (``retain_graph``), which a compiled
    backward that donates its saved buffers refuses; so this process's compiled backwards
    donate none from here on (``torch._functorch.config.donated_buffer``, part of inductor's
    cache key: no cached backward that donates is reused)."""
    if split_backward:
        import torch._functorch.config as functorch_config

        functorch_config.donated_buffer = False
    done = CompiledStages()
    for s, m in modules.items():
        why = reasons.get(s)
        if why is not None:
            done.eager[s] = why
            continue
        m.compile(dynamic=False, mode=setting.mode)
        done.compiled.append(s)
    return done


def compiled_rewrite(setting: CompileSetting):
    """A stage-module rewrite (as :func:`fxpipe.execution.grad_fusion.fuse_weight_grads`
    returns one: ``(module, 0)``) that compiles the module in place under ``setting``: the
    planner's stage timings (``cluster.measure_stages``) time what the ranks run."""
    def rewrite(module: nn.Module) -> tuple[nn.Module, int]:
        module.compile(dynamic=False, mode=setting.mode)
        return module, 0
    return rewrite


def compile_counters() -> dict[str, int]:
    """Process-wide compilation counters: graphs Dynamo compiled (``graphs``; one per region,
    recompilations included) and inductor's FX-graph cache ``hits`` / ``misses``."""
    from torch._dynamo.utils import counters

    return {"graphs": int(counters["stats"]["unique_graphs"]),
            "hits": int(counters["inductor"]["fxgraph_cache_hit"]),
            "misses": int(counters["inductor"]["fxgraph_cache_miss"])}


def compile_report(ranks: list[dict], step_times_s: list[float]) -> list[str]:
    """Lines for the run's log: which stages compiled (or stayed eager, and why), the first
    step's extra seconds (compilation), inductor's cache hits / misses and graphs compiled
    after the first step (recompilations: none expected) over ``ranks`` (one
    :func:`rank_compile_state` each); ``step_times_s``: rank 0's step times."""
    if not any(r["compiled"] or r["eager"] for r in ranks):
        return []
    out = []
    eager = {s: why for r in ranks for s, why in r["eager"].items()}
    compiled = sorted({s for r in ranks for s in r["compiled"]})
    if compiled:
        first, later = step_times_s[0], sorted(step_times_s[1:])
        typical = later[len(later) // 2] if later else 0.0
        after = sum(r["after_first"]["graphs"] for r in ranks)
        out.append(
            f"compiled stages {compiled}: {sum(r['first']['graphs'] for r in ranks)} graphs "
            f"over {len(ranks)} ranks in the first step ({first:.1f} s"
            + (f" against {typical:.3f} s for a later one: compilation ~{first - typical:.1f} s"
               if later else "") + f"); inductor's cache (a forward and a backward entry per "
            f"graph): {sum(r['first']['hits'] for r in ranks)} hits, "
            f"{sum(r['first']['misses'] for r in ranks)} misses; "
            + ("no recompilation after it" if not after
               else f"{after} graphs compiled after it (shapes or grad mode changed)"))
    out += [f"stage {s} runs eagerly: {why}" for s, why in sorted(eager.items())]
    return out


def rank_compile_state(compiled: CompiledStages | None, before: dict[str, int],
                       first: dict[str, int], end: dict[str, int]) -> dict:
    """One rank's share of :func:`compile_report`: :func:`compile_counters` before the first
    step, after it and at the end."""
    if compiled is None:
        return {"compiled": [], "eager": {}}
    return {"compiled": list(compiled.compiled), "eager": dict(compiled.eager),
            "first": {k: first[k] - before[k] for k in first},
            "after_first": {k: end[k] - first[k] for k in end}}
