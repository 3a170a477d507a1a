"""Data loading never holds back a step: batches per second of the token-file reader and of
on-the-fly tokenisation, against the main job's step rate.

Writes the ``data-loading`` section of BENCHMARKS.md:

* **token file** (:class:`fxpipe.data.token_batches.TokenBatches` over a memory-mapped
  ``uint16`` file of ``--tokens`` tokens written here): global batches per second at the main
  job's shape (16 x 128) and at a GPU-sized one (512 x 2,048), read cold (first pass over a file
  just written: the page cache may hold it) and warm;
* **on-the-fly tokenisation**: the corpus example's files (``fxpipe.examples.corpus``, a BPE
  tokenizer trained here by ``tokenizers``) tokenised from text, as ``fxpipe run`` does once
  before caching, expressed as the batches of 16 x 128 tokens per second it produces; and the
  bytes tokenizer on the same text;
* **the main job**: ``fxpipe run gpt-char`` (the README's first command, 4 gloo ranks on this
  machine's 2 cores), its median step after the first, as steps per second.

``python benchmarks/bench_data_loading.py [--tiny] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import _report  # noqa: E402
from fxpipe.data.text_sources import expand, file_documents  # noqa: E402
from fxpipe.data.token_batches import TokenBatches, read_token_file  # noqa: E402
from fxpipe.data.tokenizer import load_tokenizer  # noqa: E402
from fxpipe.specs.loader import load_spec  # noqa: E402

SECTION = "data-loading"
SHAPES = [(16, 128), (512, 2048)]


def reader_rates(folder: Path, n_tokens: int, shapes, seconds: float) -> list[dict]:
    rng = np.random.default_rng(0)
    path = folder / "train.bin"
    rng.integers(0, 50_000, n_tokens, dtype=np.uint16).tofile(path)
    tokens = read_token_file(str(path), "uint16", "data.tokens")
    rows = []
    for b, t in shapes:
        src = TokenBatches(tokens, tokens[:t * 4], b, t, seed=0)
        for phase in ("cold", "warm"):
            step0 = 0 if phase == "cold" else 10_000
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                src.get(step0 + n)
                n += 1
            rate = n / (time.perf_counter() - t0)
            rows.append(dict(what=f"token file, {phase}", shape=f"{b} x {t}", batches_s=rate,
                             tokens_s=rate * b * t))
    return rows


def tokenise_rates(folder: Path, seconds: float) -> list[dict]:
    from fxpipe.examples.corpus import make_corpus

    spec = load_spec(make_corpus(folder / "corpus", steps=10))
    files = expand(spec.data.files, "data.files")
    text = "".join(d for f in files for d in file_documents(f, "text", "data.files"))
    rows = []
    for name in (spec.data.tokenizer, "bytes"):
        tok = load_tokenizer(name)
        n, t0, ids = 0, time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds or n == 0:
            ids += len(tok.encode(text))
            n += 1
        rate = ids / (time.perf_counter() - t0)
        label = "BPE (tokenizers, vocabulary 512)" if name != "bytes" else "bytes"
        rows.append(dict(what=f"tokenising text on the fly, {label}", shape="16 x 128",
                         batches_s=rate / (16 * 128), tokens_s=rate))
    return rows


def main_job_rate(folder: Path, steps: int, run: Path | None = None) -> dict:
    """Steps per second of ``fxpipe run gpt-char`` (or of the finished run folder ``run``)."""
    out = run or folder / "run"
    if run is None:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        r = subprocess.run([sys.executable, "-m", "fxpipe", "run", "gpt-char", "--steps",
                            str(steps), "--out", str(out), "--no-report"], capture_output=True,
                           text=True, cwd=ROOT, env=env, timeout=900)
        if r.returncode:
            raise RuntimeError(f"fxpipe run gpt-char failed: {r.stderr[-1000:]}")
    with open(out / "losses.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    times = [float(r["step_time_s"]) for r in rows[1:]] or [float(rows[0]["step_time_s"])]
    step = statistics.median(times)
    label = "main job: fxpipe run gpt-char (4 ranks)" if run is None else f"the run in {run.name}"
    return dict(what=label, shape="16 x 128", batches_s=1 / step, tokens_s=16 * 128 / step)


def report(rows, main, note) -> str:
    lines = [f"Written by `benchmarks/bench_data_loading.py` ({note}).", "",
             "Global batches per second each way of getting data, against the steps per second "
             "of the README's main job on this machine. Every rank reads its batch itself "
             "(a function of the step), so a reader needs to outpace the step rate only once, "
             "not once per rank.", ""]
    lines += _report.markdown_table(
        ["source", "batch x seq", "batches/s", "tokens/s", "vs main job's steps/s"],
        [[r["what"], r["shape"], f"{r['batches_s']:,.0f}", f"{r['tokens_s']:,.0f}",
          f"{r['batches_s'] / main['batches_s']:,.0f}x"] for r in rows + [main]]).splitlines()
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="small file, short timings (smoke test)")
    ap.add_argument("--out", type=Path, default=_report.BENCHMARKS_MD)
    ap.add_argument("--main-run", type=Path, default=None,
                    help="a finished run folder whose step rate stands for the main job's "
                         "(default: run gpt-char here)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        os.environ["FXPIPE_CACHE_DIR"] = str(folder / "cache")
        rows = reader_rates(folder, 2_000_000 if args.tiny else 100_000_000,
                            SHAPES[:1] if args.tiny else SHAPES, 0.2 if args.tiny else 2.0)
        rows += tokenise_rates(folder, 0.2 if args.tiny else 2.0)
        main_row = main_job_rate(folder, 3 if args.tiny else 12, args.main_run)
    note = f"{'--tiny, ' if args.tiny else ''}{time.perf_counter() - t0:.0f} s"
    _report.write_section(SECTION, report(rows, main_row, note), args.out)
    print(f"wrote section '{SECTION}' of {args.out}")
    return {"rows": rows, "main": main_row}


if __name__ == "__main__":
    main()
