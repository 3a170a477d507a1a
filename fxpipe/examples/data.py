"""Real data that every machine has, with no download.

``python_source_text`` reads the Python standard library's own ``*.py`` sources (a few MiB of
real text) as bytes; ``ByteBatches`` cuts it into next-byte-prediction batches.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

from fxpipe.errors import SpecError


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

    Raises:
        SpecError (a ``ValueError``): the corpus is empty, or shorter than ``2 * seq_len + 4``
            bytes (both the training part and the held-out part must hold one sample of
            ``seq_len + 1`` bytes plus one start position); the message says which
            ``data.seq_len`` would fit.
    """

    def __init__(self, text: bytes, batch_size: int, seq_len: int, seed: int = 0):
        n = len(text)
        if n == 0:
            raise SpecError("the text corpus is empty (0 bytes); make data.dataset return a "
                            "non-empty corpus (bytes or str)")
        need = 2 * seq_len + 4  # smallest n with n > max(n // 20, seq_len + 2) + seq_len + 1
        if n < need:
            fit = (n - 4) // 2
            fix = (f"or lower data.seq_len to at most {fit}" if fit >= 1 else
                   "(this corpus is too short for any seq_len)")
            raise SpecError(
                f"corpus of {n} bytes is too small for seq_len={seq_len}: it needs at least "
                f"{need} bytes (one sample of seq_len + 1 bytes for training and one held out "
                f"for validation); give data.dataset a larger corpus {fix}"
            )
        data = torch.frombuffer(bytearray(text), dtype=torch.uint8).to(torch.int64)
        n_val = max(len(data) // 20, seq_len + 2)
        self.train, self.val = data[:-n_val], data[-n_val:]
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed

    def get(self, step: int, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        """Batch ``step`` of ``split`` (``"train"``/``"val"``): int64 ``x, y`` ``[batch, seq_len]``."""
        data = self.train if split == "train" else self.val
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step + (0 if split == "train" else 7919))
        starts = torch.randint(0, len(data) - self.seq_len - 1, (self.batch_size,), generator=g)
        idx = starts[:, None] + torch.arange(self.seq_len + 1)[None, :]
        chunk = data[idx]
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()


class ImageBatches:
    """Deterministic labelled images for the CNN examples: class ``k`` is a fixed random template
    (the same for every seed, so the task never changes) plus Gaussian noise of std ``noise``.

    ``get(step, split)`` returns ``(x, y)``: ``x`` float32 ``[batch_size, channels, image_size,
    image_size]``, ``y`` int64 ``[batch_size]`` in ``[0, num_classes)``. Batch ``k`` is the same
    on every rank (seeded by ``seed`` and ``step``); ``split="val"`` draws from another stream.
    """

    def __init__(self, batch_size: int, seed: int = 0, num_classes: int = 10, channels: int = 1,
                 image_size: int = 8, noise: float = 0.5):
        g = torch.Generator().manual_seed(20240601)
        self.templates = torch.randn(num_classes, channels, image_size, image_size, generator=g)
        self.batch_size, self.seed, self.noise = batch_size, seed, noise

    def get(self, step: int, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        """Batch ``step`` of ``split``: float32 images ``[batch, 1, 8, 8]``, int64 labels ``[batch]``."""
        stream = 0 if split == "train" else 1  # even seeds: train, odd: validation
        g = torch.Generator().manual_seed(2 * (self.seed * 1_000_003 + step) + stream)
        y = torch.randint(0, self.templates.shape[0], (self.batch_size,), generator=g)
        x = self.templates[y] + self.noise * torch.randn(
            (self.batch_size, *self.templates.shape[1:]), generator=g)
        return x, y


def synthetic_images(batch_size: int = 32, seed: int = 0) -> ImageBatches:
    """1-channel 8x8 images in 10 classes (the shapes of ``SkipCNN``'s defaults); see
    :class:`ImageBatches`."""
    return ImageBatches(batch_size, seed=seed)


class LMBatches:
    """Padded language-model batches as transformers models take them, over a byte corpus.

    ``get(step, split)`` returns a dict of int64 ``[batch_size, seq_len]`` tensors:
    ``input_ids`` (bytes, padded with 0 after each row's length), ``attention_mask`` (1 on real
    tokens) and ``labels`` (``input_ids`` with ``-100`` on padding: a causal LM shifts them
    itself). Row lengths vary from ``seq_len // 2`` to ``seq_len``, so micro-batches hold
    different numbers of tokens that count. Deterministic per ``(seed, step, split)``.
    """

    def __init__(self, text: bytes, batch_size: int, seq_len: int, seed: int = 0):
        self.inner = ByteBatches(text, batch_size, seq_len, seed)
        self.seq_len = seq_len

    def get(self, step: int, split: str = "train") -> dict[str, torch.Tensor]:
        """Batch ``step`` of ``split`` (``"train"``/``"val"``) as a dict of named tensors."""
        x, _ = self.inner.get(step, split)
        g = torch.Generator().manual_seed(self.inner.seed * 7_000_003 + step * 2
                                          + (0 if split == "train" else 1))
        lengths = torch.randint(max(1, self.seq_len // 2), self.seq_len + 1, (x.shape[0],),
                                generator=g)
        mask = (torch.arange(self.seq_len)[None, :] < lengths[:, None]).to(torch.int64)
        ids = x * mask
        return {"input_ids": ids, "attention_mask": mask,
                "labels": ids.masked_fill(mask == 0, -100)}


def python_source_lm(batch_size: int = 16, seq_len: int = 128, seed: int = 0) -> LMBatches:
    """The standard library's sources as padded transformers-style LM batches; see
    :class:`LMBatches`."""
    return LMBatches(python_source_text(), batch_size, seq_len, seed)


class LabelledBatches:
    """Next-byte batches as a dict for a model that computes its own loss from aligned labels
    (``fxpipe.examples.moe:MoEGPT`` with ``train.loss: model``): ``{"idx": bytes, "labels":
    the next bytes}``, both int64 ``[batch_size, seq_len]``; the batches of
    :class:`ByteBatches`."""

    def __init__(self, text: bytes, batch_size: int, seq_len: int, seed: int = 0):
        self.inner = ByteBatches(text, batch_size, seq_len, seed)

    def get(self, step: int, split: str = "train") -> dict[str, torch.Tensor]:
        x, y = self.inner.get(step, split)
        return {"idx": x, "labels": y}


def python_source_labelled(batch_size: int = 16, seq_len: int = 128, seed: int = 0
                           ) -> LabelledBatches:
    """The standard library's sources as ``{"idx", "labels"}`` batches; see
    :class:`LabelledBatches`."""
    return LabelledBatches(python_source_text(), batch_size, seq_len, seed)
