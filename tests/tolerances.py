"""How far a pipelined run may be from single-process training, derived from what is compared.

The two runs compute the same function and differ only in the order of floating-point sums:
the pipeline cuts the batch into micro-batches and adds their gradients one by one, all-reduces
the replicas' gradients, sums a tied weight's gradient over the stages holding it, and runs every
kernel on micro-batch shapes, whose reductions the CPU blocks by its vector width (AVX2,
AVX-512) and thread count. Reordering a sum of ``n`` terms moves it by at most about
``n x eps x`` the sum of the terms' magnitudes (Higham, *Accuracy and Stability of Numerical
Algorithms*, 2nd ed., section 4.2; ``eps`` the dtype's machine epsilon). The reductions that
the two runs order differently run over the samples of the global batch (the loss's mean, every
weight gradient), so ``terms`` below is the global batch's sample count; a training step carries
an earlier difference forward (scaled by about ``1 + lr x curvature``, near 1 at these learning
rates) and adds its own, so differences grow at most linearly with the steps:

    bound = eps x terms x steps x magnitude

with ``magnitude`` the size of what is compared (the largest loss, the largest parameter).
Measured differences on one machine sit 10-100x below these bounds; another CPU's kernels or
another thread count change the rounding, never the bound.

AdamW is the exception: its update ``m / (sqrt(v) + adam_eps)`` has slope up to
``1 / adam_eps`` at a zero gradient, so an entry whose true gradient is 0 (a key bias under
softmax) moves by up to ``lr x`` (its rounding noise ``/ adam_eps``) per step. In float32 that
noise (about 1e-9) is not small against ``adam_eps = 1e-8`` and the bound would be ``lr`` itself;
in float64 the noise is about 1e-17 and the bound stays tight (:func:`adamw_param_bound`). So
the AdamW exactness checks train in float64 and the SGD ones in float32.
"""

from __future__ import annotations

import torch

FP32_EPS = torch.finfo(torch.float32).eps  # 2**-23
FP64_EPS = torch.finfo(torch.float64).eps  # 2**-52


def bound(magnitude: float, terms: int, steps: int = 1, dtype: torch.dtype = torch.float32
          ) -> float:
    """The largest difference rounding explains between two runs that reorder sums of
    ``terms`` terms of about ``magnitude`` over ``steps`` training steps in ``dtype``:
    ``eps x terms x steps x magnitude`` (see the module doc)."""
    eps = torch.finfo(dtype).eps
    return eps * max(1, int(terms)) * max(1, int(steps)) * float(magnitude)


def adamw_param_bound(lr_sum: float, grad_magnitude: float, param_magnitude: float, terms: int,
                      steps: int, adam_eps: float = 1e-8,
                      dtype: torch.dtype = torch.float64) -> float:
    """The largest difference rounding explains between the parameters of two AdamW runs:
    each step's gradient may differ by ``bound(grad_magnitude, terms, steps)``, which moves
    Adam's update by at most that ``/ adam_eps`` (its steepest slope), times the learning rate,
    summed over the steps (``lr_sum``); plus the rounding of the parameters themselves."""
    grad = bound(grad_magnitude, terms, steps, dtype)
    return lr_sum * grad / adam_eps + bound(param_magnitude, terms, steps, dtype)


def max_abs(tensors) -> float:
    """The largest absolute entry over ``tensors`` (tensors or arrays)."""
    return max(float(torch.as_tensor(t).abs().max()) for t in tensors)
