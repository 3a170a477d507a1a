"""Which positions of a sequence each rank of a context group holds.

A sequence of ``S`` positions is cut into ``2N`` chunks of ``S/2N``; rank ``r`` of ``N`` holds
chunk ``r`` (the head) and chunk ``2N-1-r`` (the mirrored tail), in that order. Under causal
attention a query at position ``i`` reads ``i+1`` keys, so a rank holding only early positions
would have little work and one holding late positions much: head plus mirrored tail gives every
rank the same number of (query, key) pairs (the load balancing of Megatron-LM's and
torchtitan's context parallelism).
"""

from __future__ import annotations

import torch


def check(seq: int, n: int) -> str | None:
    """Why ``n`` ranks cannot split a sequence of ``seq`` positions, or None."""
    if n > 1 and seq % (2 * n):
        return (f"each sequence is cut into 2 x {n} = {2 * n} equal chunks (a head and a "
                f"mirrored tail per rank, which balances causal attention), but it has {seq} "
                f"positions; use a context degree n with {seq} divisible by 2n, or a sequence "
                f"length divisible by {2 * n}")
    return None


def positions(rank: int, n: int, seq: int, device=None) -> torch.Tensor:
    """The positions rank ``rank`` of ``n`` holds, in the order it holds them (int64)."""
    h = seq // (2 * n)
    head = torch.arange(rank * h, (rank + 1) * h, device=device)
    tail = torch.arange((2 * n - 1 - rank) * h, (2 * n - rank) * h, device=device)
    return torch.cat([head, tail])


def gathered_order(n: int, seq: int, device=None) -> torch.Tensor:
    """Where each position lies in the ranks' parts concatenated in rank order: index
    ``order[i]`` of that concatenation is position ``i``."""
    held = torch.cat([positions(r, n, seq) for r in range(n)])
    order = torch.empty_like(held)
    order[held] = torch.arange(seq)
    return order.to(device) if device is not None else order


def causal_mask(rank: int, n: int, seq: int, device=None) -> torch.Tensor:
    """``[S/n, S]`` bool: this rank's query positions (rows) against every key position,
    True where the key is not after the query (what ``is_causal`` means on the whole
    sequence)."""
    q = positions(rank, n, seq, device)
    return q[:, None] >= torch.arange(seq, device=device)[None, :]
