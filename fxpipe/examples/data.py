"""Real data that every machine has, with no download.

``python_source_text`` reads the Python standard library's own ``*.py`` sources (a few MiB of
real text) as bytes; ``ByteBatches`` cuts it into next-byte-prediction batches.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch


def python_source_text(max_bytes: int = 8 << 20) -> bytes:
    """Concatenated top-level ``*.py`` files of the standard library (sorted by name, so the
    corpus is identical on every rank), at most ``max_bytes`` bytes.

    Raises:
        FileNotFoundError: the standard library sources are not installed.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))
    if not files:
        raise FileNotFoundError(
            f"no Python sources under {stdlib}; install the Python standard library sources "
            "or point data.dataset at another corpus"
        )
    out = bytearray()
    for f in files:
        out += f.read_bytes()
        if len(out) >= max_bytes:
            break
    return bytes(out[:max_bytes])


class ByteBatches:
    """Deterministic next-byte batches over a byte corpus.

    The last 5% of the corpus is held out for validation. Batch ``k`` is the same on every rank
    (seeded by ``seed + k``), so every stage of a pipeline and every replica agrees on the data.

    ``get(step, split)`` returns ``(x, y)``: int64 ``[batch_size, seq_len]`` each, ``y`` is ``x``
    shifted by one byte.
    """

    def __init__(self, text: bytes, batch_size: int, seq_len: int, seed: int = 0):
        data = torch.frombuffer(bytearray(text), dtype=torch.uint8).to(torch.int64)
        n_val = max(len(data) // 20, seq_len + 2)
        if len(data) <= n_val + seq_len + 1:
            raise ValueError(f"corpus of {len(data)} bytes is too small for seq_len={seq_len}")
        self.train, self.val = data[:-n_val], data[-n_val:]
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed

    def get(self, step: int, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        data = self.train if split == "train" else self.val
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step + (0 if split == "train" else 7919))
        starts = torch.randint(0, len(data) - self.seq_len - 1, (self.batch_size,), generator=g)
        idx = starts[:, None] + torch.arange(self.seq_len + 1)[None, :]
        chunk = data[idx]
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()
