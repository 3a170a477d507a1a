"""Partial activation recomputation priced on a cut (``train.recompute_layers``): a stage
recomputes its first N blocks and keeps the activations of the rest.

The rule is the runtime's (:mod:`fxpipe.runtime.partial_recompute`), on the units: the *head*
of stage ``[a, b)`` is its units before the first unit of its block N+1 (its first N blocks
and what precedes them on the stage: an embedding, the nodes between block N and N+1); the
*tail* is the rest (later blocks, a final norm, the model's head). Only a stage with more than
N blocks recomputes partially: with N or more, partial recomputation would keep nothing but
what follows its last block, so the stage recomputes whole (``recompute_blocks`` 0).

Per micro-batch in flight the stage holds its inputs (kept for the head's second forward, as
full recomputation does), the head's values the tail reads (the tail's autograd leaves; those
the stage also sends are in its outputs, held until B anyway), the tail's saved activations,
and its outputs; its B runs the head's forward again first.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from fxpipe.errors import SpecError
from fxpipe.partitioner.pricing import Priced

__all__ = ["StagePartial", "block_starts", "partial_options", "check_has_blocks"]


def check_has_blocks(pr: Priced, n: int | None, where: str | None = None) -> None:
    """Raise SpecError when ``train.recompute_layers`` is set (``n``) but the model has no
    blocks (no module list of repeated layers) to count it in (``where``: the key's
    ``FILE:LINE`` in the spec, when known)."""
    if n is not None and not any(b is not None for b in pr.table.blocks):
        raise SpecError(
            f"{where + ': ' if where else ''}"
            f"train.recompute_layers: {n} counts blocks (the children of a module list, e.g. "
            "transformer.h.3), but the model has none; drop recompute_layers (the whole stage "
            "recomputes under activation_recompute: full)")


def block_starts(pr: Priced, a: int, b: int) -> list[int]:
    """Positions (units ``a .. b-1``) where each block of the stage begins, in order."""
    blocks = pr.table.blocks
    out, seen = [], set()
    for u in range(a, b):
        blk = blocks[u] if u < len(blocks) else None
        if blk is not None and blk not in seen:
            seen.add(blk)
            out.append(u)
    return out


@dataclass(frozen=True)
class StagePartial:
    """Stage ``[a, b)`` recomputing its first ``n`` blocks: the head is units ``a .. h-1``.

    Attributes:
        head_s: forward seconds of the head per traced micro-batch (unscaled, without the
            values the stage rebuilds: the caller adds them).
        kept: bytes per micro-batch the stage keeps besides its inputs and outputs: the
            head's values the tail reads and the tail's saved activations (per traced
            micro-batch here; :func:`scaled` for a candidate's).
    """

    n: int
    h: int
    head_s: float
    kept: float


def _fwd_prefix(pr: Priced) -> np.ndarray:
    if "partial_fwd" not in pr.cache:
        tb = pr.table
        pr.cache["partial_fwd"] = np.concatenate([[0.0], np.cumsum([t[0] for t in tb.times])])
        pr.cache["partial_saved"] = np.concatenate([[0.0], np.cumsum(tb.saved)])
        prod = np.asarray([v.producer for v in tb.values], dtype=np.int64)
        order = np.argsort(prod, kind="stable")
        at = (tb.value_saved_at if len(tb.value_saved_at) == len(tb.values)
              else [-1] * len(tb.values))
        pr.cache["partial_values"] = (prod[order], [(tb.values[i], at[i]) for i in order])
    return pr.cache["partial_fwd"]


def partial_options(pr: Priced, a: int, b: int, limit: int | None = None
                    ) -> Iterator[StagePartial]:
    """Stage ``[a, b)`` recomputing its first ``n`` blocks, for each ``n`` from 1 to one less
    than its blocks (at most ``limit``), in that order (more blocks recompute: more time, less
    memory), each worked out when asked for."""
    fwd = _fwd_prefix(pr)
    saved = pr.cache["partial_saved"]
    prod, values = pr.cache["partial_values"]
    starts = block_starts(pr, a, b)
    top = len(starts) - 1 if limit is None else min(limit, len(starts) - 1)
    if top < 1:
        return
    lo, hi = np.searchsorted(prod, a, "left"), np.searchsorted(prod, b, "left")
    inner = [(v, at) for v, at in values[lo:hi] if all(a <= u < b for u in v.users)]  # not sent
    for n in range(1, top + 1):
        h = starts[n]
        # the head's values the tail reads (its leaves), but for those the tail's saved
        # activations count already (a norm's input)
        crossing = sum(v.nbytes for v, at in inner
                       if v.producer < h and max(v.users) >= h and not h <= at < b)
        yield StagePartial(n, h, float(fwd[h] - fwd[a]),
                           float(saved[b] - saved[h]) + float(crossing))


def scaled(p: StagePartial | None, scale: float) -> StagePartial | None:
    """``p`` with its kept bytes at ``scale`` x the traced micro-batch."""
    return None if p is None else dataclasses.replace(p, kept=p.kept * scale)


def explicit(pr: Priced, cuts: Sequence[int], n: int) -> list[StagePartial | None]:
    """Per stage of a cut, ``n`` blocks recomputing (``train.recompute_layers``), or None where
    the stage has ``n`` blocks or fewer (it recomputes whole)."""
    ends = list(cuts[1:]) + [len(pr.table.names)]
    out = []
    for a, b in zip(cuts, ends):
        opts = list(partial_options(pr, a, b, n))
        out.append(opts[n - 1] if len(opts) >= n else None)
    return out
