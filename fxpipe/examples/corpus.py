"""A small text corpus and a local tokenizer, made on this machine (nothing downloaded): the
second quick start, training through ``data.files`` and ``data.tokenizer``.

``python -m fxpipe.examples.corpus FOLDER`` writes

* ``FOLDER/docs/*.txt``: a few hundred KB of the Python standard library's own sources, one
  module per file, and ``FOLDER/docs/val/*.txt`` (held-out modules) for validation;
* ``FOLDER/docs/notes.jsonl``: the modules' docstrings as JSON Lines (``{"text": ...}``);
* ``FOLDER/tokenizer/tokenizer.json``: a byte-level BPE tokenizer (vocabulary 512) trained on
  those files with the ``tokenizers`` library;
* ``FOLDER/spec.yaml``: the bundled GPT over them (``data.files``, ``val_files``, the
  tokenizer, ``train.log: [csv, tensorboard]`` when the tensorboard package is there).

Then ``fxpipe run FOLDER/spec.yaml`` trains on it (tokenised once, cached), or
``fxpipe prepare FOLDER/spec.yaml --out FOLDER/tokens`` writes token files first.
"""

from __future__ import annotations

import argparse
import ast
import json
import sysconfig
from pathlib import Path

#: modules of the standard library the corpus takes (sorted; about 400 KB)
TRAIN_BYTES = 360_000
VAL_BYTES = 40_000
VOCAB = 512

SPEC = """\
# made by python -m fxpipe.examples.corpus: the bundled GPT on a folder of text files
model:
  factory: "fxpipe.examples.gpt:CharGPT"
  args: {{vocab_size: {vocab}, block_size: 64, n_layer: 4, n_head: 4, n_embd: 64}}
data:
  files: ["docs/*.txt", "docs/*.jsonl"]   # relative to this file
  val_files: "docs/val/*.txt"
  text_field: text                          # the JSON Lines field
  tokenizer: tokenizer                      # a local Hugging Face tokenizer folder
  batch_size: 16
  seq_len: 64
parallel: {{pipeline: 2, data: 1, microbatches: 4, schedule: 1f1b}}
cluster: {{nodes: 1, devices_per_node: 2}}
train: {{steps: {steps}, lr: 1.0e-3, eval_batches: 4, log: {log}}}
output: {{dir: runs/corpus}}
"""


def _modules(limit: int, skip: int = 0) -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))
    if not files:
        raise FileNotFoundError(f"no Python sources under {stdlib}")
    out, total = [], 0
    for f in files[skip:]:
        size = f.stat().st_size
        if size > limit // 4:  # many small modules rather than a few large ones
            continue
        out.append(f)
        total += size
        if total >= limit:
            break
    return out


def make_corpus(folder: str | Path, steps: int = 200) -> Path:
    """Write the corpus, the tokenizer and the spec into ``folder``; returns the spec's path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = Path(folder)
    docs, val = root / "docs", root / "docs" / "val"
    val.mkdir(parents=True, exist_ok=True)
    train_files = _modules(TRAIN_BYTES)
    val_files = _modules(VAL_BYTES, skip=len(train_files) + 1)
    notes = []
    for f in train_files:
        text = f.read_text(encoding="utf-8", errors="replace")
        (docs / f"{f.stem}.txt").write_text(text, encoding="utf-8")
        try:
            doc = ast.get_docstring(ast.parse(text))
        except SyntaxError:
            doc = None
        if doc:
            notes.append(json.dumps({"text": doc, "module": f.stem}))
    (docs / "notes.jsonl").write_text("\n".join(notes) + "\n", encoding="utf-8")
    for f in val_files:
        (val / f"{f.stem}.txt").write_text(f.read_text(encoding="utf-8", errors="replace"),
                                           encoding="utf-8")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train([str(docs / f"{f.stem}.txt") for f in train_files], trainer)
    (root / "tokenizer").mkdir(exist_ok=True)
    tok.save(str(root / "tokenizer" / "tokenizer.json"))
    try:
        import tensorboard  # noqa: F401

        log = "[csv, tensorboard]"
    except ImportError:
        log = "[csv]"
    spec = root / "spec.yaml"
    spec.write_text(SPEC.format(vocab=tok.get_vocab_size(), steps=steps, log=log))
    return spec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", help="where to write docs/, tokenizer/ and spec.yaml")
    ap.add_argument("--steps", type=int, default=200, help="train.steps of the spec")
    args = ap.parse_args(argv)
    spec = make_corpus(args.folder, args.steps)
    print(f"wrote {spec}; train with: fxpipe run {spec}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
