"""Baseline partitions for benchmarks, priced by the same cost function as the exact planner.

Takes a :class:`~fxpipe.partitioner.problem.CutProblem` (and optionally the first unit of every
block, e.g. transformer layer); gives a :class:`~fxpipe.partitioner.problem.PartitionResult`
from :func:`~fxpipe.partitioner.problem.evaluate`:

* :func:`equal_layers_partition`: the same number of units (or blocks) per stage, what
  torchtitan's and GPipe's equal-layer splits do;
* :func:`param_balanced_partition`: balanced parameter bytes per stage, as DeepSpeed's
  ``PipelineModule(partition_method='parameters')`` does.

Neither honours pins, forced cuts or memory; breaches are listed in the result's ``violations``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from fxpipe.errors import PlanError
from fxpipe.partitioner.problem import CutProblem, PartitionResult, evaluate
from fxpipe.partitioner.solvers import SeparableSweep, index_bounds

__all__ = ["equal_layers_partition", "param_balanced_partition"]


def _blocks(problem: CutProblem, block_starts: Sequence[int] | None) -> np.ndarray:
    n, k = problem.n, problem.num_stages
    if block_starts is None:
        bs = np.arange(n, dtype=np.int64)
    else:
        bs = np.unique(np.asarray(list(block_starts), dtype=np.int64))
        if bs.size == 0 or bs[0] != 0 or bs[-1] >= n:
            raise PlanError(
                f"block_starts must start at 0 and stay below {n} (one entry per block's first unit); "
                f"got {list(block_starts)[:8]}"
            )
    if bs.size < k:
        raise PlanError(
            f"{bs.size} blocks cannot fill {k} stages; use at most {bs.size} stages or finer blocks"
        )
    return bs


def equal_layers_partition(problem: CutProblem, block_starts: Sequence[int] | None = None) -> PartitionResult:
    """Baseline: the same number of units (or of blocks, e.g. transformer layers) per stage.

    Stage ``j`` starts at block ``round(j * nblocks / k)``. Pins, forced cuts and memory are not
    honoured; breaches are listed in the result's ``violations``.

    Args:
        block_starts: first unit of every block (sorted, starting at 0); None = one unit per block.

    Raises:
        PlanError: fewer blocks than stages, or malformed ``block_starts``.
    """
    bs = _blocks(problem, block_starts)
    k, nb = problem.num_stages, bs.size
    idx = [int(math.floor(j * nb / k + 0.5)) for j in range(k)]
    return evaluate(problem, [int(bs[i]) for i in idx], method="equal_layers")


def param_balanced_partition(problem: CutProblem, block_starts: Sequence[int] | None = None) -> PartitionResult:
    """Baseline: balance parameter bytes per stage, as DeepSpeed's
    ``PipelineModule(partition_method='parameters')`` does (min-max of per-stage parameter bytes
    over contiguous splits of the blocks; exact, via the separable solver).

    Compute, communication and memory are ignored for the choice (priced afterwards by
    :func:`evaluate`). ``block_starts`` and the errors: as :func:`equal_layers_partition`.
    """
    bs = _blocks(problem, block_starts)
    k, nb = problem.num_stages, bs.size
    Pb = problem.P[np.append(bs, problem.n)]  # (nb+1,) parameter bytes before each block boundary
    bd = index_bounds(nb, k, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
    cuts = SeparableSweep(bd, [Pb] * k, [Pb] * k, [None] * k, base=Pb).solve(0.0)
    assert cuts is not None  # nb >= k: always feasible without constraints
    return evaluate(problem, [int(bs[i]) for i in cuts], method="param_balanced")
