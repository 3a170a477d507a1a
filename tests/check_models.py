"""Models and losses that a pipeline cannot train like one process, named by the specs of
tests/test_check.py (``tests.check_models:...``)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class _Features:
    """Deterministic random features and class labels: ``get(step)`` -> ``(x, y)``."""

    def __init__(self, batch_size: int, dim: int = 8, classes: int = 4):
        self.batch_size, self.dim, self.classes = batch_size, dim, classes

    def get(self, step: int, split: str = "train"):
        g = torch.Generator().manual_seed(step + (10_000 if split == "val" else 0))
        x = torch.randn(self.batch_size, self.dim, generator=g)
        return x, torch.randint(0, self.classes, (self.batch_size,), generator=g)


def features(batch_size: int, seq_len: int = 0, dim: int = 8, classes: int = 4):
    """``data.dataset``: :class:`_Features`."""
    return _Features(batch_size, dim, classes)


class BatchNormMLP(nn.Module):
    """Two linear blocks, the first normalised by BatchNorm1d (batch statistics)."""

    def __init__(self, dim: int = 8, hidden: int = 16, classes: int = 4):
        super().__init__()
        self.fc1, self.bn = nn.Linear(dim, hidden), nn.BatchNorm1d(hidden)
        self.fc2, self.out = nn.Linear(hidden, hidden), nn.Linear(hidden, classes)

    def forward(self, x):
        return self.out(torch.relu(self.fc2(torch.relu(self.bn(self.fc1(x))))))


class DropoutMLP(nn.Module):
    """Three linear layers with dropout after each of the first two (in both stages of a
    two-stage plan: each rank draws its masks from its own generator)."""

    def __init__(self, dim: int = 8, hidden: int = 16, classes: int = 4, p: float = 0.5):
        super().__init__()
        self.fc1, self.drop = nn.Linear(dim, hidden), nn.Dropout(p)
        self.fc2, self.out = nn.Linear(hidden, hidden), nn.Linear(hidden, classes)

    def forward(self, x):
        return self.out(self.drop(torch.relu(self.fc2(self.drop(torch.relu(self.fc1(x)))))))


def summed_cross_entropy(output, target):
    """A loss that is a sum over the batch, not a mean."""
    return F.cross_entropy(output, target, reduction="sum")
