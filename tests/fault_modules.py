"""User code that misbehaves, named by the fault tests' specs (``tests.fault_modules:...``)."""

from __future__ import annotations

import sys


class _GetRaisesLater:
    """A dataset whose ``get`` works for the first steps, then raises (a shard gone bad)."""

    def __init__(self, batch_size: int, seq_len: int, fail_at: int):
        self.batch_size, self.seq_len, self.fail_at = batch_size, seq_len, fail_at

    def get(self, step: int, split: str = "train"):
        import torch

        if split == "train" and step >= self.fail_at:
            raise OSError(f"shard {step} is unreadable")
        g = torch.Generator().manual_seed(step + (10_000 if split == "val" else 0))
        x = torch.randint(0, 256, (self.batch_size, self.seq_len + 1), generator=g)
        return x[:, :-1], x[:, 1:]


def fails_mid_run(batch_size: int, seq_len: int, fail_at: int = 3):
    """``data.dataset`` whose ``get(step)`` raises from batch ``fail_at`` on."""
    return _GetRaisesLater(batch_size, seq_len, fail_at)


def exits(**kwargs):
    """A model factory (or dataset) that calls ``sys.exit``."""
    sys.exit(3)
