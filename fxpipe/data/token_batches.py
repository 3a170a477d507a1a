"""Language-model batches streamed from token arrays: a memory-mapped token file
(``data.tokens``, nanoGPT's ``train.bin``) or the cached tokens of ``data.files`` /
``data.hf_dataset`` (:mod:`fxpipe.data.text_sources`).

The training tokens are cut into ``S = (N - 1) // seq_len`` windows of ``seq_len + 1`` tokens
(consecutive windows share one token: each token is a target once per epoch). Global sample
``g = step x batch_size + row`` is window ``perm_e(g mod S)`` of epoch ``e = g // S``, where
``perm_e(i) = (a_e i + b_e) mod S`` with ``a_e`` coprime to ``S``: a permutation of the windows
drawn from ``(seed, e)``, so every epoch visits every window once in a new order, in O(1)
memory whatever the corpus size. A batch is a function of ``(seed, step, split)`` alone: every
rank computes the same global batch (each data-parallel replica trains on its rows, every
pipeline rank of a replica on the same ones), and a run resumed at step ``k`` (under any
pipeline or data-parallel degree) continues with exactly the batches an uninterrupted run
would have seen. Only the ``batch_size x (seq_len + 1)`` tokens of a batch are read: a corpus
larger than memory streams from the page cache.

Validation: ``val`` tokens when given, else the last ``val_fraction`` of the training tokens
(held out from training); batch ``k`` of it is windows ``k x batch_size ...`` in order.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from fxpipe.errors import SpecError


class TokenBatches:
    """Deterministic next-token batches over token arrays (see the module doc).

    ``get(step, split)`` returns ``(x, y)``: int64 ``[batch_size, seq_len]`` each, ``y`` is
    ``x`` shifted by one token.

    Raises:
        SpecError: too few tokens for one window of training and one of validation.
    """

    def __init__(self, train: np.ndarray, val: np.ndarray | None, batch_size: int,
                 seq_len: int, seed: int = 0, val_fraction: float = 0.05,
                 vocab_size: int | None = None, what: str = "data"):
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self.vocab_size, self.what = vocab_size, what
        need = seq_len + 2
        if val is None:
            n_val = max(int(len(train) * val_fraction), need)
            if len(train) - n_val < need:
                raise SpecError(
                    f"{what}: {len(train):,} tokens are too few for seq_len={seq_len}: training "
                    f"and the held-out {val_fraction:g} each need at least {need} tokens; give "
                    "a larger corpus or a separate validation set, or lower data.seq_len")
            train, val = train[:len(train) - n_val], train[len(train) - n_val:]
        for name, arr in (("training", train), ("validation", val)):
            if len(arr) < need:
                raise SpecError(f"{what}: the {name} tokens ({len(arr):,}) are too few for "
                                f"seq_len={seq_len}: one sample needs {need}; give more text or "
                                "lower data.seq_len")
        self.train, self.val = train, val
        self._perm: dict[int, tuple[int, int]] = {}

    def windows(self, split: str = "train") -> int:
        """Windows of ``seq_len + 1`` tokens in ``split``."""
        return (len(self.train if split == "train" else self.val) - 1) // self.seq_len

    def _affine(self, epoch: int, s: int) -> tuple[int, int]:
        if epoch not in self._perm:
            rng = np.random.default_rng([self.seed & 0xFFFFFFFF, epoch])
            a = 1
            if s > 2:
                a = int(rng.integers(1, s))
                while math.gcd(a, s) != 1:
                    a = a % (s - 1) + 1
            self._perm[epoch] = (a, int(rng.integers(0, s)))
        return self._perm[epoch]

    def starts(self, step: int, split: str = "train") -> np.ndarray:
        """Start offsets (in tokens) of the batch's ``batch_size`` windows."""
        s = self.windows(split)
        g = step * self.batch_size + np.arange(self.batch_size, dtype=np.int64)
        if split != "train":
            return (g % s) * self.seq_len
        idx = np.empty_like(g)
        for e in np.unique(g // s):
            a, b = self._affine(int(e), s)
            sel = g // s == e
            idx[sel] = (a * (g[sel] % s) + b) % s
        return idx * self.seq_len

    def get(self, step: int, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        """Batch ``step`` of ``split`` (``"train"`` / ``"val"``): int64 ``x, y``
        ``[batch_size, seq_len]``.

        Raises:
            SpecError: a token id at or above the vocabulary (the model's embedding).
        """
        data = self.train if split == "train" else self.val
        rows = np.stack([np.asarray(data[o:o + self.seq_len + 1]) for o in self.starts(step, split)])
        chunk = torch.from_numpy(rows.astype(np.int64))
        if self.vocab_size is not None:
            top = int(chunk.max())
            if top >= self.vocab_size:
                raise SpecError(f"{self.what}: token id {top} in {split} batch {step} is not "
                                f"below the vocabulary size {self.vocab_size}; tokenise with the "
                                "model's tokenizer (or widen its embedding)")
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()


def read_token_file(path: str, dtype: str, key: str) -> np.ndarray:
    """A token file memory-mapped (nothing read until a batch needs it).

    Raises:
        SpecError: no such file, a size that is not a whole number of tokens.
    """
    from pathlib import Path

    p = Path(path)
    if not p.is_file():
        raise SpecError(f"{key}: no token file {path}; write one with `fxpipe prepare SPEC` (or "
                        "numpy: ids.astype(np.uint16).tofile(path))")
    item = np.dtype(dtype).itemsize
    size = p.stat().st_size
    if size % item:
        raise SpecError(f"{key}: {path} has {size:,} bytes, not a whole number of {dtype} "
                        f"tokens ({item} bytes each); is data.dtype right?")
    if size == 0:
        raise SpecError(f"{key}: {path} is empty")
    return np.memmap(p, dtype=np.dtype(dtype), mode="r")
