"""Data named in the spec (issue 29): text files, JSON Lines, parquet, saved ``datasets``,
memory-mapped token files, local tokenizers, ``fxpipe prepare``, resumable streaming and
TensorBoard.

In process: the readers, the batch stream's determinism and epoch coverage, the vocabulary
check, every spec error with its line. One multi-process test: the corpus example (files +
a tokenizer trained here by ``tokenizers``) prepared into token files, trained through
``fxpipe run`` with TensorBoard, resumed at step 2 under another data-parallel degree with the
same batches and losses as the uninterrupted run.
"""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from fxpipe.data.batches import check_vocabulary, make_batches
from fxpipe.data.text_sources import expand, file_documents, spec_tokens
from fxpipe.data.token_batches import TokenBatches
from fxpipe.data.tokenizer import load_tokenizer
from fxpipe.errors import SpecError
from fxpipe.examples.gpt import CharGPT
from fxpipe.specs.loader import load_spec

try:
    from cli_helpers import fxpipe_cli, fxpipe_in_process
    from tolerances import bound
except ImportError:  # tests/ collected as a package
    from tests.cli_helpers import fxpipe_cli, fxpipe_in_process
    from tests.tolerances import bound

MODEL = ('model: {factory: "fxpipe.examples.gpt:CharGPT", args: {vocab_size: VOCAB, '
         'block_size: 16, n_layer: 2, n_head: 2, n_embd: 32}}\n')


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FXPIPE_CACHE_DIR", str(tmp_path / "cache"))


def _spec(folder: Path, data: str, vocab: int = 256, extra: str = "") -> Path:
    p = folder / "spec.yaml"
    p.write_text(MODEL.replace("VOCAB", str(vocab)) + f"data: {data}\n" + extra)
    return p


def _corpus(folder: Path) -> Path:
    docs = folder / "docs"
    docs.mkdir(parents=True)
    rng = np.random.default_rng(0)
    words = "pipeline tensor data stage replica bubble schedule gradient".split()
    for i in range(3):
        (docs / f"d{i}.txt").write_text(" ".join(rng.choice(words, 400)))
    with open(docs / "notes.jsonl", "w") as f:
        for i in range(20):
            f.write(json.dumps({"body": " ".join(rng.choice(words, 30)), "id": i}) + "\n")
    return docs


# ----------------------------------------------------------------------------- readers
def test_files_of_every_kind_become_one_token_stream(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = _corpus(tmp_path)
    pq.write_table(pa.table({"body": ["alpha beta", "gamma"]}), docs / "t.parquet")
    files = expand(str(docs / "*"), "data.files")
    assert [f.name for f in files] == ["d0.txt", "d1.txt", "d2.txt", "notes.jsonl", "t.parquet"]
    assert list(file_documents(docs / "t.parquet", "body", "k")) == ["alpha beta", "gamma"]
    assert len(list(file_documents(docs / "notes.jsonl", "body", "k"))) == 20
    spec = load_spec(_spec(tmp_path, '{files: "docs/*", text_field: body, batch_size: 4, '
                                     'seq_len: 16}'))
    assert spec.data.files == str(docs / "*")  # relative to the spec file
    train, val = spec_tokens(spec.data)
    text = "".join(d for f in files for d in file_documents(f, "body", "k"))
    assert val is None and len(train) == len(text.encode())  # bytes: one id per byte
    assert bytes(np.asarray(train).astype(np.uint8)).decode() == text
    # cached: the second read maps the same file
    again, _ = spec_tokens(spec.data)
    assert isinstance(again, np.memmap) and np.array_equal(again, train)


def test_the_stream_is_a_function_of_the_step_and_covers_each_window_once_per_epoch():
    tokens = np.arange(1, 1 + 16 * 50 + 1, dtype=np.uint16)  # 50 windows of 16 (+1)
    b = TokenBatches(tokens, tokens[:100], batch_size=7, seq_len=16, seed=3)
    s = b.windows()
    assert s == 50
    starts = np.concatenate([b.starts(k) for k in range(50)])  # 350 samples: 7 epochs
    for e in range(7):
        epoch = starts[e * 50:(e + 1) * 50]
        assert sorted(epoch.tolist()) == [i * 16 for i in range(50)]  # a permutation
    assert not np.array_equal(starts[:50], starts[50:100])  # a new order each epoch
    x, y = b.get(5)
    again = TokenBatches(tokens, tokens[:100], 7, 16, seed=3).get(5)  # another rank, restarted
    assert torch.equal(x, again[0]) and torch.equal(y, again[1])
    assert torch.equal(x[:, 1:], y[:, :-1]) and x.dtype == torch.int64
    other_seed = TokenBatches(tokens, tokens[:100], 7, 16, seed=4).get(5)[0]
    assert not torch.equal(x, other_seed)
    with pytest.raises(SpecError, match="not below the vocabulary size 40"):
        TokenBatches(tokens, None, 2, 16, vocab_size=40).get(0)


def test_a_token_file_is_memory_mapped_and_held_out_by_fraction(tmp_path):
    ids = (np.arange(5000) % 300).astype(np.uint16)
    ids.tofile(tmp_path / "train.bin")
    spec = load_spec(_spec(tmp_path, "{tokens: train.bin, batch_size: 4, seq_len: 16, "
                                     "val_fraction: 0.1}", vocab=300))
    b = make_batches(spec)
    assert isinstance(b.train, np.memmap) and len(b.train) == 4500 and len(b.val) == 500
    x, y = b.get(0, "val")
    assert int(x[0, 0]) == 4500 % 300 and torch.equal(y[0], x[0] + 1)
    (tmp_path / "odd.bin").write_bytes(b"\0" * 7)
    with pytest.raises(SpecError, match="not a whole number of uint16 tokens"):
        make_batches(load_spec(_spec(tmp_path, "{tokens: odd.bin}")))
    with pytest.raises(SpecError, match="spec.yaml:2.*no token file"):
        make_batches(load_spec(_spec(tmp_path, "{tokens: missing.bin}")))


def test_saved_and_local_hf_datasets_and_a_hub_name_refused(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = {"text": [f"row {i} " * 20 for i in range(40)]}
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows),
                          "test": datasets.Dataset.from_dict(rows)}).save_to_disk(
        tmp_path / "saved")
    spec = load_spec(_spec(tmp_path, "{hf_dataset: saved, split: train, val_split: test, "
                                     "batch_size: 2, seq_len: 16}"))
    train, val = spec_tokens(spec.data)
    assert len(train) == len(val) == sum(len(t) for t in rows["text"])
    with open(tmp_path / "rows.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in rows["text"])
    spec = load_spec(_spec(tmp_path, "{hf_dataset: {path: json, data_files: rows.jsonl}, "
                                     "batch_size: 2, seq_len: 16}"))
    assert len(spec_tokens(spec.data)[0]) == len(train)
    with pytest.raises(SpecError, match="would need the network"):
        make_batches(load_spec(_spec(tmp_path, '{hf_dataset: "roneneldan/TinyStories"}')))
    with pytest.raises(SpecError, match="not one of the local builders"):
        make_batches(load_spec(_spec(tmp_path, "{hf_dataset: {path: wikitext, data_files: x}}")))


def test_tokenizers_and_the_vocabulary_check(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    docs = _corpus(tmp_path)
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train([str(p) for p in docs.glob("*.txt")],
              trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]", "<|endoftext|>"],
                                  show_progress=False))
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    t = load_tokenizer(str(tmp_path / "tok"))
    assert t.eos_id == tok.token_to_id("<|endoftext|>") and t.vocab_size == tok.get_vocab_size()
    assert t.encode_document("pipeline stage")[-1] == t.eos_id
    assert load_tokenizer("bytes").encode("é") == [195, 169]
    spec = load_spec(_spec(tmp_path, '{files: "docs/*.txt", tokenizer: tok}', vocab=32))
    with pytest.raises(SpecError, match=r"spec.yaml:\d+: data.tokenizer: .* has \d+ tokens but "
                                        r"the model's embedding has 32 rows"):
        check_vocabulary(CharGPT(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=8),
                         spec)
    check_vocabulary(CharGPT(vocab_size=t.vocab_size, block_size=16, n_layer=1, n_head=2,
                             n_embd=8), spec)  # fits: no error
    with pytest.raises(SpecError, match="neither 'bytes', 'tiktoken:NAME' nor a folder"):
        load_tokenizer(str(tmp_path / "nope"))
    with pytest.raises(SpecError, match="tiktoken has no encoding 'nope'"):
        pytest.importorskip("tiktoken")
        load_tokenizer("tiktoken:nope")


def test_spec_errors_name_the_line(tmp_path):
    cases = {
        '{dataset: "fxpipe.examples.data:python_source_text", files: "*.txt"}':
            "data names 2 sources",
        "{val_files: a.txt}": "data.val_files goes with data.files",
        "{tokens: t.bin, text_field: body}": "data.text_field goes with data.files or",
        "{tokenizer: tok}": "data.tokenizer goes with data.files",
        "{tokens: t.bin, dtype: int8}": "dtype",
        "{files: []}": "",
    }
    for data, msg in cases.items():
        p = _spec(tmp_path, data)
        if msg:
            with pytest.raises(SpecError, match=msg):
                load_spec(p)
    (tmp_path / "s.yaml").write_text(MODEL.replace("VOCAB", "256") + "train: {log: [tensorboard]}\n")
    with pytest.raises(SpecError, match=r"s.yaml:2: train.log.*csv always"):
        load_spec(tmp_path / "s.yaml")
    r = fxpipe_in_process("prepare", _spec(tmp_path, "{batch_size: 4}"), "--out", tmp_path / "o")
    assert r.returncode == 2 and "tokenises data.files or data.hf_dataset" in r.stderr
    r = fxpipe_in_process("run", _spec(tmp_path, '{files: "nothing/*.txt"}'), "--out",
                          tmp_path / "run")
    assert r.returncode == 2 and "matches no file" in r.stderr and "Traceback" not in r.stderr


# ----------------------------------------------------------------------------- end to end
def _losses(run: Path) -> list[float]:
    with open(run / "losses.csv", newline="") as f:
        return [float(r["loss"]) for r in csv.DictReader(f)]


@pytest.mark.distributed
def test_prepared_corpus_trains_logs_to_tensorboard_and_resumes_under_another_degree(tmp_path):
    from fxpipe.examples.corpus import make_corpus

    spec0 = make_corpus(tmp_path / "corpus", steps=4)
    tok = load_tokenizer(str(tmp_path / "corpus" / "tokenizer"))
    files = load_spec(spec0)
    # 1. prepare: token files holding exactly the text's tokens
    r = fxpipe_cli("prepare", spec0, "--out", tmp_path / "tokens", "--workers", "2")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "tokens: " in r.stdout and "dtype: uint16" in r.stdout
    want_train, want_val = spec_tokens(files.data)
    got_train = np.fromfile(tmp_path / "tokens" / "train.bin", dtype=np.uint16)
    assert np.array_equal(got_train, want_train)
    assert np.array_equal(np.fromfile(tmp_path / "tokens" / "val.bin", dtype=np.uint16), want_val)

    def spec(name, parallel, devices):
        return _spec_file(tmp_path / name, tmp_path / "tokens", tok.vocab_size, parallel, devices)

    # 2. train 4 steps (pipeline 2), a checkpoint every 2, TensorBoard on
    a = spec("a.yaml", "{pipeline: 2, data: 1, microbatches: 2}", 2)
    run = tmp_path / "run"
    r = fxpipe_cli("run", a, "--out", run, "--no-report", timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    ref = _losses(run)
    assert len(ref) == 4
    state = json.loads((run / "checkpoint" / "step_000002" / "train_state.json").read_text())
    assert state["data_position"] == 2
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ev = EventAccumulator(str(run / "tensorboard"))
    ev.Reload()
    tags = set(ev.Tags()["scalars"])
    assert {"train/loss", "train/step_time_s", "train/tokens_per_s", "train/lr",
            "pipeline/bubble", "pipeline/stage0_compute_s", "pipeline/stage1_compute_s",
            "eval/loss"} <= tags, tags
    assert [round(e.value, 5) for e in ev.Scalars("train/loss")] == [round(v, 5) for v in ref]
    assert [e.step for e in ev.Scalars("eval/loss")] == [0, 4]
    # 3. resume at step 2 under pipeline 1 x data 2: the next batches, the same losses up to
    # float32 rounding of the sums reordered over the batch's samples (tests/tolerances.py)
    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    for d in (resumed / "checkpoint").glob("step_*"):
        if int(d.name[5:]) > 2:
            shutil.rmtree(d)
    (resumed / "checkpoint" / "latest").write_text("step_000002\n")
    rows = (resumed / "losses.csv").read_text().splitlines()
    (resumed / "losses.csv").write_text("\n".join(rows[:3]) + "\n")
    b = spec("b.yaml", "{pipeline: 1, data: 2, microbatches: 2}", 2)
    r = fxpipe_cli("run", b, "--resume", resumed, "--no-report", timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    got = _losses(resumed)
    tol = bound(max(ref), 16, 4)
    assert len(got) == 4 and all(abs(x - y) < tol for x, y in zip(ref, got)), (ref, got, tol)


def _spec_file(path: Path, tokens: Path, vocab: int, parallel: str, devices: int) -> Path:
    path.write_text(
        f'model: {{factory: "fxpipe.examples.gpt:CharGPT", args: {{vocab_size: {vocab}, '
        'block_size: 16, n_layer: 2, n_head: 2, n_embd: 32}}\n'
        f"data: {{tokens: {tokens}/train.bin, val_tokens: {tokens}/val.bin, dtype: uint16, "
        "batch_size: 16, seq_len: 16}\n"
        f"parallel: {parallel}\n"
        f"cluster: {{nodes: 1, devices_per_node: {devices}}}\n"
        "train: {steps: 4, optimizer: sgd, lr: 0.05, eval_batches: 1, log: [csv, tensorboard], "
        "checkpoint: {every: 2}}\n")
    return path


@pytest.mark.distributed
def test_data_loading_benchmark_tiny(tmp_path, tiny_run):
    """The benchmark's readers against the step rate of the session's tiny run (conftest:
    one `fxpipe run` shared with the CLI and report tests) rather than a run of its own."""
    import sys
    from pathlib import Path as _P

    root = _P(__file__).resolve().parents[1]
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from benchmarks import bench_data_loading

    out = tmp_path / "B.md"
    _, run, r = tiny_run
    assert r.returncode == 0, r.stderr[-2000:]
    res = bench_data_loading.main(["--tiny", "--out", str(out), "--main-run", str(run)])
    assert "<!-- data-loading -->" in out.read_text()
    main = res["main"]["batches_s"]
    assert main > 0
    for r in res["rows"]:
        # the stream and the tokenisers each produce batches faster than the job uses them
        assert r["batches_s"] > main, (r, main)
