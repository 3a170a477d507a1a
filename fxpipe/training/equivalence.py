"""How far a pipelined run may be from single-process training, and what makes it farther.

The tolerances of ``fxpipe check`` (:mod:`fxpipe.training.check`), derived from what is compared
(the reasoning of the project's exactness tests, kept here in product code). The two runs
compute the same function and differ only in the order of floating-point sums: the pipeline
cuts the batch into micro-batches and adds their gradients one by one, all-reduces the
replicas' gradients, sums a tied weight's gradient over the stages holding it, and runs every
kernel on micro-batch shapes. Reordering a sum of ``n`` terms moves it by at most about
``n x eps x`` the sum of the terms' magnitudes (Higham, *Accuracy and Stability of Numerical
Algorithms*, section 4.2); the sums the two runs order differently run over the samples of the
global batch, and a step carries an earlier difference forward and adds its own, so

    bound = eps x terms x steps x magnitude

with ``eps`` the precision's machine epsilon (fp32 2^-23; bf16 2^-7 and fp16 2^-10: autocast
rounds the activations and matmul outputs to them), ``terms`` the samples per optimizer step and ``magnitude``
the size of what is compared (the largest loss, the largest parameter, the largest update).

AdamW divides by ``sqrt(v) + 1e-8``: an entry whose gradient is (almost) zero turns rounding
noise into an update of up to ``lr``. Its bound is therefore per entry, from the reference
run's own second moments (:class:`AdamBound`): a gradient difference ``d`` moves an update by
about ``2 d / (sqrt(v_hat) + eps)`` (at most 2: each run's update is about ``lr`` at most),
times the step's learning rate, summed over the steps.

:func:`likely_causes` names what makes a pipeline differ beyond rounding: BatchNorm statistics
per micro-batch, dropout without a shared generator, a loss that is not a mean, hooks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

#: machine epsilon (the gap after 1.0, ``torch.finfo(dtype).eps``) of each ``train.precision``'s
#: compute dtype: fp32 2^-23, bf16 2^-7, fp16 2^-10 (twice the unit roundoff, as for fp32)
EPS = {"fp32": torch.finfo(torch.float32).eps, "bf16": torch.finfo(torch.bfloat16).eps,
       "fp16": torch.finfo(torch.float16).eps,
       "fp8": torch.finfo(torch.float8_e4m3fn).eps}  # (the matmuls' operands: 2^-3)


def bound(magnitude: float, terms: int, steps: int, eps: float) -> float:
    """``eps x terms x steps x magnitude``: the largest difference rounding explains between
    two runs that reorder sums of ``terms`` terms of about ``magnitude`` over ``steps`` steps."""
    return eps * max(1, int(terms)) * max(1, int(steps)) * float(magnitude)


def loss_tolerance(ref_losses: list[float], terms: int, step: int, eps: float) -> float:
    """Tolerance on the loss of step ``step`` (0-based): the largest reference loss so far,
    reordered over ``terms`` samples, over ``step + 1`` steps."""
    finite = [abs(x) for x in ref_losses[:step + 1] if x == x and abs(x) != float("inf")]
    return bound(max(finite, default=0.0), terms, step + 1, eps)


class AdamBound:
    """Per-entry parameter tolerance of an AdamW (or Adam) run, accumulated from the reference
    optimizer's state after each step (see the module doc)."""

    def __init__(self, named: dict[str, torch.Tensor]):
        self.acc = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in named.items()}

    def update(self, optimizer: torch.optim.Optimizer, named: dict[str, nn.Parameter],
               grad_magnitude: float, terms: int, step: int, eps: float) -> None:
        """After optimizer step ``step`` (0-based): add this step's share. ``grad_magnitude``:
        the largest gradient entry of the step (before clipping)."""
        d = bound(grad_magnitude, terms, step + 1, eps)
        for group in optimizer.param_groups:
            lr, (_, b2), adam_eps = group["lr"], group["betas"], group["eps"]
            for p in group["params"]:
                state = optimizer.state.get(p)
                name = next((n for n, q in named.items() if q is p), None)
                if not state or name is None or "exp_avg_sq" not in state:
                    continue
                t = float(state["step"])
                v_hat = state["exp_avg_sq"].double() / (1 - b2 ** t)
                move = (2 * d / (v_hat.sqrt() + adam_eps)).clamp(max=2.0)
                self.acc[name] += float(lr) * move

    def tolerance(self, name: str) -> torch.Tensor:
        return self.acc[name]


@dataclass
class ParamDiff:
    """One parameter's comparison: the largest ``|pipeline - reference|`` entry, the
    tolerance at that entry, and how many entries exceed their tolerance."""
    name: str
    stage: int | None
    diff: float
    tolerance: float
    beyond: int
    numel: int

    @property
    def ratio(self) -> float:
        return self.diff / self.tolerance if self.tolerance > 0 else (
            0.0 if self.diff == 0 else float("inf"))


def compare_params(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor],
                   tol: dict[str, "torch.Tensor | float"], stage_of: dict[str, int]
                   ) -> list[ParamDiff]:
    """Compare every parameter of ``ref`` (in its order) with ``got`` entry by entry."""
    out = []
    for name, r in ref.items():
        g = got[name].to(torch.float64)
        r = r.detach().to(torch.float64)
        t = tol[name]
        t = t if isinstance(t, torch.Tensor) else torch.full_like(r, float(t))
        diff = (g - r).abs()
        diff = torch.where(torch.isnan(diff), torch.full_like(diff, float("inf")), diff)
        over = diff > t
        if bool(over.any()):  # the worst entry relative to its tolerance
            i = int(torch.argmax(torch.where(over, diff / t.clamp(min=1e-300), 0 * diff)))
        else:
            i = int(torch.argmax(diff)) if diff.numel() else 0
        flat_d, flat_t = diff.reshape(-1), t.reshape(-1)
        out.append(ParamDiff(name, stage_of.get(name), float(flat_d[i]) if diff.numel() else 0.0,
                             float(flat_t[i]) if diff.numel() else 0.0, int(over.sum()),
                             r.numel()))
    return out


# ----------------------------------------------------------------------------- likely causes
_DROPOUT = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
            nn.FeatureAlphaDropout)


def _names(mods: list[str], limit: int = 3) -> str:
    shown = ", ".join(m or "(the model)" for m in mods[:limit])
    return shown + (f" and {len(mods) - limit} more" if len(mods) > limit else "")


def batchnorm_modules(model: nn.Module) -> list[str]:
    """Names of the BatchNorm modules that normalise with batch statistics in training."""
    return [n for n, m in model.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def dropout_modules(model: nn.Module) -> list[str]:
    """Names of the dropout modules with ``p > 0``."""
    return [n for n, m in model.named_modules() if isinstance(m, _DROPOUT) and m.p > 0]


def hooked_modules(model: nn.Module) -> list[str]:
    """Names of the modules with forward, forward-pre or backward hooks (and ``*`` for global
    module hooks)."""
    from torch.nn.modules import module as mm

    kinds = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    out = [n for n, m in model.named_modules() if any(getattr(m, k, None) for k in kinds)]
    if any(getattr(mm, g, None) for g in ("_global_forward_hooks", "_global_forward_pre_hooks",
                                          "_global_backward_hooks",
                                          "_global_backward_pre_hooks")):
        out.append("* (global module hooks)")
    return out


def loss_not_a_mean(loss_fn, output: torch.Tensor, target: torch.Tensor, parts: int,
                    weights: list[float], eps: float) -> tuple[float, float] | None:
    """``(loss on the whole batch, weighted sum of the loss on its ``parts`` equal chunks)``
    when they differ beyond rounding (the pipeline computes the second), else None.
    ``weights``: each chunk's share of the batch's counted targets."""
    with torch.no_grad():
        whole = float(loss_fn(output, target))
        n = output.shape[0] // parts
        chunks = [float(loss_fn(output[i * n:(i + 1) * n], target[i * n:(i + 1) * n]))
                  for i in range(parts)]
    pieces = sum(w * c for w, c in zip(weights, chunks))
    tol = bound(max(abs(whole), abs(pieces)), output.shape[0], 1, eps)
    return None if abs(whole - pieces) <= tol else (whole, pieces)


@dataclass
class Cause:
    title: str
    detail: str
    suggestion: str

    def text(self) -> str:
        return f"- {self.title}: {self.detail}. {self.suggestion}"


def likely_causes(model: nn.Module, *, microbatches: int, dp: int, mbs: int,
                  loss_check: tuple[float, float] | None, loss_name: str,
                  compression: str = "none", warmup_steps: int = 0) -> list[Cause]:
    """What in ``model`` and the recipe makes a pipeline differ from single-process training
    beyond rounding. ``loss_check``: :func:`loss_not_a_mean`'s answer on the first batch;
    ``compression`` / ``warmup_steps``: the spec's gradient compression and its exact steps."""
    causes = []
    if compression != "none" and dp > 1:
        warm = warmup_steps if compression in ("powersgd", "topk") else 0
        causes.append(Cause(
            "gradient compression",
            f"train.grad_compression {compression!r} sends the {dp} replicas' gradients "
            "compressed (lossy by design: " + {"fp16": "rounded to 16 bits",
                                                "bf16": "rounded to 16 bits",
                                                "powersgd": "a low-rank approximation",
                                                "topk": "only the largest entries"
                                                }.get(compression, "approximated")
            + f") from step {warm + 1} on, so the averaged gradients are not one process's",
            "Check with grad_compression: none" + (" (or compression.warmup_steps at least "
                                                   "the steps checked)" if warm or compression
                                                   in ("powersgd", "topk") else "")
            + "; the compression's effect on training is what "
            "benchmarks/bench_compression.py measures"))
    parts = microbatches * dp
    bn = batchnorm_modules(model)
    if bn and parts > 1:
        causes.append(Cause(
            "BatchNorm statistics per micro-batch",
            f"BatchNorm {_names(bn)} normalises with the mean and variance of the batch it sees: "
            f"{mbs} samples per micro-batch in the pipeline ({parts} micro-batches per step), "
            "the whole batch in one process (and their running statistics differ too)",
            "Use a per-sample normalisation (LayerNorm, GroupNorm), or freeze BatchNorm "
            "(eval mode, running statistics), or plan with parallel.microbatches: 1 and "
            "parallel.data: 1"))
    drop = dropout_modules(model)
    if drop:
        causes.append(Cause(
            "dropout without a fixed generator",
            f"dropout {_names(drop)} (p = {_p(model, drop[0]):g}) draws its masks from each rank's "
            "own random generator, per micro-batch: the pipeline drops other units than one "
            "process does",
            "Check with dropout off (p: 0, e.g. resid_pdrop/embd_pdrop/attn_pdrop: 0.0 in a "
            "transformers config), or make the masks a function of the data (a fixed "
            "generator seeded per sample) so every layout draws the same ones"))
    if loss_check is not None:
        whole, pieces = loss_check
        causes.append(Cause(
            "a loss that is not a mean",
            f"train.loss {loss_name!r} gives {whole:.6g} on the first batch but "
            f"{pieces:.6g} as the weighted mean of its {parts} micro-batches; the pipeline "
            "adds micro-batch losses weighted by their share of the batch, which equals the "
            "whole batch's loss only for a mean",
            "Return the mean over the targets (e.g. reduction='mean'), not a sum or a "
            "statistic of the whole batch"))
    hooks = hooked_modules(model)
    if hooks:
        causes.append(Cause(
            "a hook with side effects",
            f"hooks on {_names(hooks)}: the traced pipeline runs what a "
            "hook computed while tracing, not the hook itself, so a hook that counts, "
            "records or changes state per call acts differently",
            "Remove the hooks for training, or do their work in forward() itself"))
    return causes


def _p(model: nn.Module, name: str) -> float:
    return float(model.get_submodule(name).p)
