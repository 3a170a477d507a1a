"""Intra-op threads of one rank: ``OMP_NUM_THREADS`` when it is set, else 1.

Several ranks share a host's cores, so each rank computes on one thread unless told otherwise
(torchrun sets ``OMP_NUM_THREADS=1`` for its workers by default too). Setting it, e.g.
``OMP_NUM_THREADS=4 fxpipe run ...`` on a machine with 4 cores per rank, gives every rank (the
workers, :func:`fxpipe.runtime.local_ranks.run_ranks`' ranks, ``fxpipe profile``) that many.
"""

from __future__ import annotations

import os

ENV = "OMP_NUM_THREADS"


def rank_threads() -> int:
    """``OMP_NUM_THREADS`` as a positive integer, 1 when unset or not a positive integer."""
    try:
        n = int(os.environ.get(ENV, "1"))
    except ValueError:
        return 1
    return max(1, n)


def set_rank_threads() -> int:
    """Give torch :func:`rank_threads` intra-op threads; returns that number."""
    import torch

    n = rank_threads()
    torch.set_num_threads(n)
    return n
