"""``fxpipe prepare SPEC``: tokenise the spec's ``data.files`` / ``data.hf_dataset`` once into
token files (``train.bin``, ``val.bin``: ids end to end, ``uint16`` when the vocabulary fits,
else ``uint32``), in parallel over files, with a progress bar; training then reads tokens
(``data: {tokens: DIR/train.bin, val_tokens: DIR/val.bin, dtype: ...}``), not text.

Without ``val_files`` / ``val_split`` the last ``data.val_fraction`` of the tokens becomes
``val.bin`` (the split training would hold out from the text itself).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from fxpipe.data.text_sources import (expand, hf_documents, token_dtype, tokenise_documents,
                                      tokenise_files)
from fxpipe.data.tokenizer import load_tokenizer
from fxpipe.errors import SpecError


def _bar(total: int, label: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=label, unit="file", disable=None)


def _tokens(spec, which: str, workers: int) -> np.ndarray | None:
    d = spec.data
    tok = load_tokenizer(d.tokenizer)
    if d.files is not None:
        pats = d.files if which == "train" else d.val_files
        if pats is None:
            return None
        key = "data.files" if which == "train" else "data.val_files"
        files = expand(pats, key)
        with _bar(len(files), f"tokenising {which} ({len(files)} files)") as bar:
            return tokenise_files(files, d.text_field, d.tokenizer, key, workers,
                                  progress=lambda n: bar.update(n - bar.n))
    split = d.split if which == "train" else d.val_split
    if split is None:
        return None
    return tokenise_documents(hf_documents(d.hf_dataset, split, d.text_field, "data.hf_dataset"),
                              tok)


def prepare(spec, out: Path, workers: int | None = None) -> dict:
    """Write ``out/train.bin`` and ``out/val.bin`` for ``spec`` (see the module doc).

    Returns:
        ``{"train": path, "val": path, "dtype": name, "train_tokens": n, "val_tokens": n,
        "seconds": s}``.

    Raises:
        SpecError: the spec's data is not ``files`` / ``hf_dataset``; see
            :mod:`fxpipe.data.text_sources` for the rest.
    """
    d = spec.data
    if d.source not in ("files", "hf_dataset"):
        raise SpecError(f"fxpipe prepare tokenises data.files or data.hf_dataset; this spec's "
                        f"data comes from data.{d.source}"
                        + (" (already tokens)" if d.source == "tokens" else ""))
    t0 = time.perf_counter()
    workers = workers or max(1, min(os.cpu_count() or 1, 8))
    train = _tokens(spec, "train", workers)
    val = _tokens(spec, "val", workers)
    if val is None:
        n_val = max(int(len(train) * d.val_fraction), d.seq_len + 2)
        if len(train) - n_val < d.seq_len + 2:
            raise SpecError(f"data: {len(train):,} tokens are too few to hold out "
                            f"{d.val_fraction:g} for validation at seq_len={d.seq_len}")
        train, val = train[:-n_val], train[-n_val:]
    dtype = token_dtype(load_tokenizer(d.tokenizer).vocab_size)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, arr in (("train", train), ("val", val)):
        path = out / f"{name}.bin"
        tmp = path.with_suffix(".bin.tmp")
        np.asarray(arr, dtype=dtype).tofile(tmp)
        os.replace(tmp, path)
        paths[name] = path
    return {"train": paths["train"], "val": paths["val"], "dtype": dtype.name,
            "train_tokens": int(len(train)), "val_tokens": int(len(val)),
            "seconds": time.perf_counter() - t0}
