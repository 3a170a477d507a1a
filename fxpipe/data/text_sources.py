"""Text named in the spec (``data.files``, ``data.hf_dataset``) read as documents and
tokenised into token arrays: the same arrays :mod:`fxpipe.data.token_batches` reads from token
files.

* ``files``: globs (``**`` recursive), sorted, every rank the same order. ``.jsonl`` / ``.json``:
  one JSON object per line, its ``data.text_field``; ``.parquet``: the ``text_field`` column
  (pyarrow); anything else: the file is one UTF-8 document.
* ``hf_dataset``: a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``
  (``data.split`` picks the split of a dict), or ``{path: json|csv|parquet|text, data_files}``
  built from local files. The ``datasets`` library is an optional extra; a name that is not a
  local folder (a Hub dataset) is refused, since fxpipe downloads nothing.

Tokenising a corpus is done once per (files, their sizes and modification times, text field,
tokenizer): the arrays are cached under ``$FXPIPE_CACHE_DIR/tokens`` (default
``~/.cache/fxpipe``), so the launcher's planning pass writes them and the ranks memory-map
them. ``fxpipe prepare`` writes the same arrays as token files into a folder of your choice.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Iterator

import numpy as np

from fxpipe.data.tokenizer import Tokenizer, load_tokenizer
from fxpipe.errors import SpecError

#: the local builders of ``datasets`` that read files (no network)
LOCAL_BUILDERS = ("json", "csv", "parquet", "text", "arrow")


def cache_root() -> Path:
    """``$FXPIPE_CACHE_DIR/tokens`` (default ``~/.cache/fxpipe/tokens``)."""
    return Path(os.environ.get("FXPIPE_CACHE_DIR") or Path.home() / ".cache" / "fxpipe") / "tokens"


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest token-file dtype that holds ids below ``vocab_size``."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


# ----------------------------------------------------------------------------- files
def expand(patterns: str | list[str], key: str) -> list[Path]:
    """The files the globs name, sorted and without repeats.

    Raises:
        SpecError: a pattern matches no file.
    """
    out: list[Path] = []
    for pat in [patterns] if isinstance(patterns, str) else patterns:
        found = sorted(Path(p) for p in glob.glob(os.path.expanduser(pat), recursive=True)
                       if Path(p).is_file())
        if not found:
            raise SpecError(f"{key}: {pat!r} matches no file; give a path or a glob such as "
                            "'corpus/**/*.txt' (relative paths are relative to the spec file)")
        out += [f for f in found if f not in out]
    return out


def file_documents(path: Path, text_field: str, key: str) -> Iterator[str]:
    """The documents of one file (see the module doc).

    Raises:
        SpecError: a JSON line that is not an object with ``text_field``, a parquet file
            without the column, a file that is not UTF-8.
    """
    suffix = path.suffix.lower()
    try:
        if suffix in (".jsonl", ".json"):
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise SpecError(f"{key}: {path}:{n}: not a JSON object per line "
                                        f"({e.msg}); write JSON Lines") from None
                    if not isinstance(row, dict) or not isinstance(row.get(text_field), str):
                        raise SpecError(f"{key}: {path}:{n}: no text field {text_field!r} "
                                        f"(keys: {', '.join(row) if isinstance(row, dict) else '-'}"
                                        "); set data.text_field")
                    yield row[text_field]
        elif suffix == ".parquet":
            try:
                import pyarrow.parquet as pq
            except ImportError:
                raise SpecError(f"{key}: reading {path} needs pyarrow: pip install "
                                "'fxpipe[data]'") from None
            table = pq.read_table(path)
            if text_field not in table.column_names:
                raise SpecError(f"{key}: {path} has no column {text_field!r} (columns: "
                                f"{', '.join(table.column_names)}); set data.text_field")
            yield from (t for t in table.column(text_field).to_pylist() if t)
        else:
            yield path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise SpecError(f"{key}: {path} is not UTF-8 text; give text, JSON Lines or parquet "
                        "files") from None


def _tokenise_file(args: tuple[str, str, str, str]) -> np.ndarray:
    path, text_field, tokenizer, key = args
    tok = load_tokenizer(tokenizer)
    ids: list[int] = []
    for doc in file_documents(Path(path), text_field, key):
        ids += tok.encode_document(doc)
    return np.asarray(ids, dtype=token_dtype(tok.vocab_size))


def tokenise_files(files: list[Path], text_field: str, tokenizer: str, key: str,
                   workers: int = 1, progress=None) -> np.ndarray:
    """The files' documents tokenised and concatenated in file order, in ``workers``
    processes (one file each at a time); ``progress(n_done)`` after each file."""
    jobs = [(str(f), text_field, tokenizer, key) for f in files]
    parts = []
    if workers <= 1 or len(jobs) <= 1:
        for i, job in enumerate(jobs):
            parts.append(_tokenise_file(job))
            if progress:
                progress(i + 1)
    else:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            for i, arr in enumerate(pool.map(_tokenise_file, jobs)):  # in file order
                parts.append(arr)
                if progress:
                    progress(i + 1)
    dtype = token_dtype(load_tokenizer(tokenizer).vocab_size)
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)


# ----------------------------------------------------------------------------- datasets
def check_hf_source(source, key: str = "data.hf_dataset") -> None:
    """``data.hf_dataset`` names something on this machine.

    Raises:
        SpecError: a string that is not a folder (a Hub name: it would need the network), a
            builder that is not one of :data:`LOCAL_BUILDERS`.
    """
    if isinstance(source, str):
        if not Path(source).is_dir():
            raise SpecError(f"{key}: {source!r} is not a folder saved with save_to_disk; a Hub "
                            "dataset name would need the network, and fxpipe downloads nothing. "
                            "Save it once with dataset.save_to_disk(folder) and give the folder, "
                            "or use {path: json, data_files: ...} over local files")
    elif source.path not in LOCAL_BUILDERS:
        raise SpecError(f"{key}.path: {source.path!r} is not one of the local builders "
                        f"({', '.join(LOCAL_BUILDERS)}); a Hub dataset would need the "
                        "network, and fxpipe downloads nothing")


def hf_documents(source, split: str, text_field: str, key: str) -> Iterator[str]:
    """The documents of ``data.hf_dataset`` (a saved folder or a local builder).

    Raises:
        SpecError: ``datasets`` missing, a name that would need the network, no such split or
            text field.
    """
    try:
        import datasets
    except ImportError:
        raise SpecError(f"{key}: reading a Hugging Face dataset needs the 'datasets' package: "
                        "pip install 'fxpipe[data]'") from None
    if isinstance(source, str):
        check_hf_source(source, key)
        try:
            ds = datasets.load_from_disk(source)
        except Exception as e:
            raise SpecError(f"{key}: {source} cannot be read with datasets.load_from_disk "
                            f"({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise SpecError(f"{key}: {source} has no split {split!r} (it has "
                                f"{', '.join(ds)}); set data.split / data.val_split")
            ds = ds[split]
    else:
        check_hf_source(source, key)
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        try:
            ds = datasets.load_dataset(source.path, data_files=source.data_files, split=split)
        except Exception as e:
            raise SpecError(f"{key}: datasets.load_dataset({source.path!r}, data_files=...) "
                            f"failed ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
                            ) from None
    if text_field not in ds.column_names:
        raise SpecError(f"{key}: the dataset has no column {text_field!r} (columns: "
                        f"{', '.join(ds.column_names)}); set data.text_field")
    for row in ds.select_columns([text_field]):
        if row[text_field]:
            yield row[text_field]


def tokenise_documents(docs, tok: Tokenizer) -> np.ndarray:
    """Documents tokenised and concatenated (each followed by the end-of-text id)."""
    ids: list[int] = []
    for doc in docs:
        ids += tok.encode_document(doc)
    return np.asarray(ids, dtype=token_dtype(tok.vocab_size))


# ----------------------------------------------------------------------------- the spec's text
def _fingerprint(data, which: str) -> str:
    """What the cached tokens of ``which`` (``train`` / ``val``) depend on."""
    if data.hf_dataset is not None:
        check_hf_source(data.hf_dataset)
    h = hashlib.sha256()
    h.update(json.dumps([which, data.tokenizer, data.text_field, data.split, data.val_split,
                         str(data.hf_dataset)], default=str).encode())
    paths: list[Path] = []
    if data.files is not None:
        paths = expand(data.files, "data.files")
        if data.val_files is not None:
            paths += expand(data.val_files, "data.val_files")
    elif isinstance(data.hf_dataset, str):
        paths = sorted(p for p in Path(data.hf_dataset).rglob("*") if p.is_file())
    elif data.hf_dataset is not None:
        files = data.hf_dataset.data_files
        flat = files if isinstance(files, list) else list(files.values()) \
            if isinstance(files, dict) else [files]
        for f in flat:
            paths += expand(f, "data.hf_dataset.data_files")
    tok = Path(data.tokenizer)
    if tok.is_dir():
        paths += sorted(p for p in tok.iterdir() if p.is_file())
    for p in paths:
        st = p.stat()
        h.update(f"{p.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:24]


def spec_tokens(data, workers: int = 1, progress=None) -> tuple[np.ndarray, np.ndarray | None]:
    """The training tokens and the validation tokens (None: held out by ``val_fraction``) of
    a ``files`` / ``hf_dataset`` spec, tokenised once and memory-mapped from the cache."""
    root = cache_root()
    out = []
    for which in ("train", "val"):
        if which == "val" and data.val_files is None and data.val_split is None:
            out.append(None)
            continue
        tok = load_tokenizer(data.tokenizer)
        dtype = token_dtype(tok.vocab_size)
        path = root / f"{_fingerprint(data, which)}.{dtype.name}"
        if not path.exists():
            arr = _tokenise(data, which, tok, workers, progress)
            root.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            arr.tofile(tmp)
            os.replace(tmp, path)  # atomic: ranks never read half a file
        out.append(np.memmap(path, dtype=dtype, mode="r") if path.stat().st_size
                   else np.zeros(0, dtype))
    return out[0], out[1]


def _tokenise(data, which: str, tok: Tokenizer, workers: int, progress) -> np.ndarray:
    if data.files is not None:
        key = "data.files" if which == "train" else "data.val_files"
        files = expand(data.files if which == "train" else data.val_files, key)
        return tokenise_files(files, data.text_field, data.tokenizer, key, workers, progress)
    split = data.split if which == "train" else data.val_split
    return tokenise_documents(hf_documents(data.hf_dataset, split, data.text_field,
                                           "data.hf_dataset"), tok)
