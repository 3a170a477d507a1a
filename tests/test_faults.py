"""Bad input and faults end in one clean line (exit code 2), with nothing lost: hostile specs and
plan files, user code that exits or parses the command line, unwritable or blocked checkpoint
folders, a dataset failing mid-run, rendezvous ports held by programs that never answer, and
single-node runs listening on the loopback only."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fxpipe.errors import SpecError
from fxpipe.specs.loader import build_model, load_spec

try:
    from cli_helpers import REPO, cli_env, fxpipe_cli, fxpipe_in_process
except ImportError:  # collected as a package
    from tests.cli_helpers import REPO, cli_env, fxpipe_cli, fxpipe_in_process

SPEC = """model:
  factory: "fxpipe.examples.gpt:CharGPT"
  args: {vocab_size: 256, block_size: 32, n_layer: 2, n_head: 2, n_embd: 32}
data: {batch_size: 8, seq_len: 32}
parallel: {pipeline: 2, data: 1, microbatches: 2, schedule: 1f1b}
cluster: {devices_per_node: 2, memory_gb: 2}
train: {steps: 4, lr: 1.0e-3, log_every: 1, timeout_s: 20, eval_batches: 0}
"""


def spec_file(tmp_path: Path, text: str = SPEC, name: str = "spec.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def clean_failure(r, *words: str) -> str:
    """Assert exit code 2, no traceback or C++ frames, and ``words`` in stderr."""
    err = r.stderr
    assert r.returncode == 2, (r.returncode, r.stdout[-2000:], err[-2000:])
    assert "Traceback" not in err and "frame #" not in err, err[-3000:]
    for w in words:
        assert w in err, err[-3000:]
    return err


# ------------------------------------------------------------------------- hostile specs
@pytest.mark.parametrize("text, words", [
    ("model: " + "[" * 100_000 + "]" * 100_000 + "\n", "nested"),
    ("model: " + "{a: " * 20_000 + "1" + "}" * 20_000 + "\n", "nested"),
])
def test_deeply_nested_yaml_is_a_spec_error(tmp_path, text, words):
    with pytest.raises(SpecError, match=words):
        load_spec(spec_file(tmp_path, text))


def test_alias_bomb_is_refused_before_it_expands(tmp_path):
    """Nine levels of ten aliases each under model.args: 10**9 values once expanded."""
    bomb = ['a: &a ["x","x","x","x","x","x","x","x","x","x"]']
    for i in range(1, 9):
        prev, name = chr(ord("a") + i - 1), chr(ord("a") + i)
        bomb.append(f"{name}: &{name} [{', '.join(['*' + prev] * 10)}]")
    text = SPEC.replace("  args: {vocab_size: 256,",
                        "  args: {bomb: {" + ", ".join(bomb) + "}, vocab_size: 256,")
    with pytest.raises(SpecError, match="expands to more than 100000 values"):
        load_spec(spec_file(tmp_path, text))


@pytest.mark.parametrize("old, new, words", [
    ("lr: 1.0e-3", "lr: .inf", "train.lr"),
    ("lr: 1.0e-3", "lr: .nan", "train.lr"),
    ("memory_gb: 2", "memory_gb: 2, device_tflops: 1.0e-310", "cluster.device_tflops"),
    ("eval_batches: 0", "eval_batches: 0, checkpoint: {dir: /tmp/elsewhere}", "checkpoint.dir"),
    ("eval_batches: 0", "eval_batches: 0, checkpoint: {dir: ../up}", "checkpoint.dir"),
    ("eval_batches: 0", "eval_batches: 0, checkpoint: {dir: .}", "checkpoint.dir"),
    ("eval_batches: 0", "eval_batches: 0, nan_policy: ignore", "train.nan_policy"),
    ("eval_batches: 0", "eval_batches: 0, max_restarts: -1", "train.max_restarts"),
])
def test_wrong_values_are_spec_errors_with_file_and_line(tmp_path, old, new, words):
    path = spec_file(tmp_path, SPEC.replace(old, new))
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert f"{path}:" in str(info.value) and words in str(info.value)


ARGV_MODULE = """
import argparse
ap = argparse.ArgumentParser()
ap.add_argument("--data", required=True)
ARGS = ap.parse_args()

from fxpipe.examples.gpt import CharGPT as Model
"""
EXIT_MODULE = "import sys\nsys.exit(3)\n"


@pytest.mark.parametrize("source, words", [
    (ARGV_MODULE, None),  # parses sys.argv at import: sees no fxpipe flags, fails cleanly
    (EXIT_MODULE, "called sys.exit(3)"),
])
def test_module_that_exits_or_parses_argv_at_import(tmp_path, monkeypatch, source, words):
    (tmp_path / "fxpipe_fault_user.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = load_spec(spec_file(tmp_path, SPEC.replace("fxpipe.examples.gpt:CharGPT",
                                                      "fxpipe_fault_user:Model")))
    with pytest.raises(SpecError) as info:
        build_model(spec)
    msg = str(info.value)
    assert "model.factory" in msg and "sys.exit(2)" in msg if words is None else words in msg


def test_factory_that_exits_is_a_spec_error(tmp_path):
    spec = load_spec(spec_file(tmp_path, SPEC.replace("fxpipe.examples.gpt:CharGPT",
                                                      "tests.fault_modules:exits")))
    with pytest.raises(SpecError, match=r"called sys.exit\(3\)"):
        build_model(spec)


# ------------------------------------------------------------------------- hostile plan files
@pytest.fixture(scope="module")
def plan_json(tmp_path_factory) -> str:
    """The text of the plan.json `fxpipe plan` writes for SPEC (planned once for the module)."""
    tmp = tmp_path_factory.mktemp("plan")
    r = fxpipe_in_process("plan", spec_file(tmp), "--out", tmp / "p")
    assert r.returncode == 0, r.stderr
    return (tmp / "p" / "plan.json").read_text()


@pytest.mark.parametrize("mutate, words", [
    (lambda d: d.update(num_stages=d["num_stages"] + 1), "num_stages"),
    (lambda d: d.update(microbatches=0), "microbatches"),
    (lambda d: d["stages"].pop(), "num_stages"),
])
@pytest.mark.distributed
def test_inconsistent_plan_json_is_refused(tmp_path, plan_json, mutate, words):
    data = json.loads(plan_json)
    mutate(data)
    (tmp_path / "bad.json").write_text(json.dumps(data))
    clean_failure(fxpipe_cli("show", tmp_path / "bad.json"), words, "bad.json")


@pytest.mark.distributed
def test_deeply_nested_plan_json_is_refused(tmp_path):
    (tmp_path / "deep.json").write_text('{"stages": ' + "[" * 100_000 + "]" * 100_000 + "}")
    clean_failure(fxpipe_cli("show", tmp_path / "deep.json"), "nested too deeply")


# ------------------------------------------------------------------------- output folders
def test_out_dot_is_refused(tmp_path):
    spec = spec_file(tmp_path)
    (tmp_path / "keep.txt").write_text("mine")
    for args in (["--out", "."], ["--out", ".", "--overwrite"], ["--out", ".."]):
        clean_failure(fxpipe_in_process("run", spec, *args, cwd=tmp_path), "current folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt", "spec.yaml"]


def test_blocked_checkpoint_folder_fails_before_training(tmp_path):
    spec = spec_file(tmp_path, SPEC.replace("eval_batches: 0",
                                            "eval_batches: 0, checkpoint: {dir: ckpt/inner}"))
    out = tmp_path / "run"
    out.mkdir()
    (out / "ckpt").write_text("a file in the way")
    clean_failure(fxpipe_in_process("run", spec, "--out", out), "cannot write checkpoints to")
    assert not (out / "losses.csv").exists()  # nothing trained, nothing thrown away
    assert (out / "ckpt").read_text() == "a file in the way"
    spec = spec_file(tmp_path, SPEC.replace("eval_batches: 0",
                                            "eval_batches: 0, checkpoint: {dir: ckpt}"))
    clean_failure(fxpipe_in_process("run", spec, "--out", out), "is a file")


@pytest.mark.distributed
def test_dataset_failing_mid_run_keeps_what_was_done(tmp_path):
    spec = spec_file(tmp_path, SPEC.replace(
        "data: {batch_size: 8, seq_len: 32}",
        'data: {batch_size: 8, seq_len: 32, dataset: "tests.fault_modules:fails_mid_run"}'
        ).replace(
        "eval_batches: 0", "eval_batches: 0, checkpoint: {every: 2}, max_restarts: 1"))
    out = tmp_path / "run"
    r = fxpipe_cli("run", spec, "--out", out, "--no-report", timeout=300)
    err = clean_failure(r, "step 3:", "shard 3 is unreadable", "it would meet it again")
    assert err.count("shard 3 is unreadable") == 1  # said once, by the launcher
    rows = (out / "losses.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in rows[1:]] == ["0", "1", "2"]  # every finished step
    assert (out / "checkpoint" / "latest").read_text().strip() == "step_000002"


# ------------------------------------------------------------------------- rendezvous
class Squatter:
    """A program holding a port: it accepts and then never answers (``mode="silent"``) or
    closes at once (``"close"``)."""

    def __init__(self, mode: str):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port, self.mode, self.held = self.sock.getsockname()[1], mode, []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if self.mode == "close":
                conn.close()
            else:
                self.held.append(conn)

    def close(self):
        self.sock.close()
        for c in self.held:
            c.close()


@pytest.fixture(scope="module")
def held_port_runs(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, float, int]]:
    """``fxpipe run`` of two nodes whose rendezvous endpoint is held by a program that never
    answers (``silent``) or closes every connection (``close``).

    Each run is a child process (a hang is killed at its deadline) that spends most of its time
    waiting on the port, so the two start together and overlap; each is timed from its own
    start to its own exit. Returns, per case, (the finished process, those seconds, the port).
    """
    tmp = tmp_path_factory.mktemp("held-ports")
    multi = spec_file(tmp, SPEC.replace("cluster: {devices_per_node: 2",
                                        "cluster: {nodes: 2, devices_per_node: 1").replace(
        "timeout_s: 20", "timeout_s: 5"), name="multi.yaml")
    cases = {"silent": ("silent", multi, ["--nnodes", "2"]),
             "close": ("close", multi, ["--nnodes", "2"])}
    started = {}
    try:
        for case, (mode, spec, extra) in cases.items():
            squat = Squatter(mode)
            logs = [open(tmp / f"{case}.{s}", "w+") for s in ("out", "err")]
            proc = subprocess.Popen(
                [sys.executable, "-m", "fxpipe", "run", str(spec), "--out", str(tmp / case),
                 *extra, "--rdzv-endpoint", f"127.0.0.1:{squat.port}"],
                stdout=logs[0], stderr=logs[1], text=True, cwd=REPO, env=cli_env())
            started[case] = (proc, time.monotonic(), squat, logs)
        took: dict[str, float] = {}
        deadline = time.monotonic() + 120
        while len(took) < len(started) and time.monotonic() < deadline:
            for case, (proc, t0, _, _) in started.items():
                if case not in took and proc.poll() is not None:
                    took[case] = time.monotonic() - t0
            time.sleep(0.02)
    finally:
        for proc, _, squat, _ in started.values():
            if proc.poll() is None:  # past the deadline: the test of that case fails
                proc.kill()
                proc.wait()
            squat.close()
    runs = {}
    for case, (proc, t0, squat, logs) in started.items():
        for f in logs:
            f.seek(0)
        out, err = (f.read() for f in logs)
        for f in logs:
            f.close()
        if case not in took:
            err += "\n(test: killed, not finished within 120 s)"
        runs[case] = (subprocess.CompletedProcess(proc.args, proc.returncode, out, err),
                      took.get(case, math.inf), squat.port)
    return runs


def test_single_node_endpoint_on_a_taken_port(tmp_path):
    """A `run` error found before the launch (no waiting on the port, nothing to time), so in
    this process (cli_helpers.fxpipe_in_process: the exit code and stderr of `fxpipe run`; a run
    that got as far as starting workers would fail the test). The port is held by a socket that
    listens and never answers (the kernel completes connections nobody accepts): no thread in
    this process, so the launcher's fork server forks from it rather than starting a Python."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(16)
        port = holder.getsockname()[1]
        r = fxpipe_in_process("run", spec_file(tmp_path), "--out", tmp_path / "taken",
                              "--rdzv-endpoint", f"127.0.0.1:{port}")
    clean_failure(r, f"port {port} is taken")


@pytest.mark.parametrize("mode, words", [
    ("silent", "did not answer within 5 s"),
    ("close", "is not reachable or is not an fxpipe/torch store"),
])
@pytest.mark.distributed
def test_multi_node_endpoint_held_by_another_program_ends_in_bounded_time(held_port_runs, mode,
                                                                            words):
    r, took, _ = held_port_runs[mode]
    clean_failure(r, words)
    assert took < 60  # train.timeout_s + the stated probe margin + planning


def test_comm_errors_lose_their_cpp_locations_and_say_the_peer_went_away():
    """gloo's messages carry C++ source paths and advice paragraphs; the one line a rank prints
    says what happened without them."""
    from fxpipe.errors import comm_error_text, first_line

    reset = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537]"
                         " Read error [127.0.0.1]:8629: Connection reset by peer. This may "
                         "indicate a possible application crash on rank 0. GLHF!")
    assert comm_error_text(reset) == "the peer closed the connection (it stopped or failed)"
    assert first_line(reset) == "RuntimeError: the peer closed the connection (it stopped or " \
                                "failed)"
    slow = RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out "
                        "waiting 5000ms for recv operation to complete\nException raised from "
                        "x at y.cpp:1 (most recent call first):\nframe #0: foo")
    assert comm_error_text(slow) == "Timed out waiting 5000ms for recv operation to complete"
    assert first_line(ValueError("plain words")) == "ValueError: plain words"


def test_a_rank_that_lost_its_peer_is_not_named_as_where_the_failure_began(tmp_path, capsys,
                                                                             monkeypatch):
    """A rank killed without a word (SIGKILL, out of memory) makes the others fail with a lost
    connection, and torchrun reports whichever rank exited first: the worker records the lost
    peer and says so without "please report it", and the launcher names the silent rank."""
    from types import SimpleNamespace

    from fxpipe.training import worker
    from fxpipe.training.launch import _first_failure

    def lost(*_args):
        raise RuntimeError("[../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:8629: "
                           "Connection closed by peer")

    monkeypatch.setattr(worker, "train", lost)
    for rank in ("0", "2", "3"):
        monkeypatch.setenv("RANK", rank)
        assert worker.main(["--plan", "p.json", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("lost contact with another rank: it ended first") == 3, err
    assert "please report" not in err and "pair.cc" not in err
    assert worker.lost_peer_ranks(tmp_path) == {0, 2, 3}

    def failed(**codes):  # torchrun's failures: rank -> exit code, timestamps in rank order
        return {int(r[1:]): SimpleNamespace(exitcode=c, timestamp=i)
                for i, (r, c) in enumerate(codes.items())}

    said = _first_failure(failed(r0=2), tmp_path, world=4)
    assert said.startswith("rank 1 ended first") and "lost contact with it" in said
    # more ranks unaccounted for (another node's): the first to exit is not blamed
    said = _first_failure(failed(r0=2), tmp_path, world=8)
    assert said.startswith("rank 0 exited first, having lost contact")
    # a rank torchrun saw die of a signal, and a rank that failed on its own, are named as such
    assert _first_failure(failed(r1=-9), tmp_path, world=4) == \
        "first failure: rank 1, exit code -9 (SIGKILL)"
    assert _first_failure(failed(r1=2, r0=2), tmp_path, world=4) == \
        "first failure: rank 1, exit code 2"
    worker.clear_exit_records(tmp_path)
    assert worker.lost_peer_ranks(tmp_path) == set()


def test_a_peer_that_closed_its_connection_is_not_called_a_timeout():
    """The survivors of a killed rank fail at once: their message says "failed", not "failed
    or timed out after 300 s"; a real timeout keeps the limit it ran into."""
    from fxpipe.errors import failed_how

    gone = RuntimeError("[../gloo/transport/tcp/pair.cc:537] Connection closed by peer")
    assert failed_how(gone, 300) == "failed"
    slow = RuntimeError("[../unbound_buffer.cc:81] Timed out waiting 5000ms for recv")
    assert failed_how(slow, 5) == "failed or timed out after 5 s"


def test_skipping_stops_once_the_weights_themselves_are_not_finite(tmp_path):
    """train.nan_policy: skip drops an update whose loss is not finite, but weights that are
    already NaN cannot recover: the worker's check sees them on any rank (one all-reduce)."""
    import torch
    import torch.distributed as dist

    from fxpipe.training.worker import _weights_finite

    class Pipe:
        def __init__(self, *tensors):
            self.tensors = tensors

        def parameters(self):
            return iter(self.tensors)

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        assert _weights_finite(Pipe(torch.ones(3), torch.zeros(2)))
        assert not _weights_finite(Pipe(torch.ones(3), torch.tensor([1.0, float("nan")])))
        assert not _weights_finite(Pipe(torch.tensor([float("inf")])))
    finally:
        dist.destroy_process_group()


def test_a_failed_collective_names_the_other_ranks_not_a_placeholder():
    """The loss all-reduce at a step's end talks to every other rank: its failure names them
    (it said "rank -1" when a node died there)."""
    from fxpipe.runtime.p2p import _failure

    err = RuntimeError("Connection closed by peer")
    many = str(_failure("loss all-reduce", [1, 2, 3], "rank 0 end of step", 10, err))
    assert "with ranks 1, 2, 3 failed" in many and "the logs of ranks 1, 2, 3" in many
    assert "-1" not in many
    one = str(_failure("loss all-reduce", [1], "rank 0 end of step", 10, err))
    assert "with rank 1 failed" in one and "rank 1's log" in one
    assert "with rank 4 failed" in str(_failure("send", 4, "ctx", 10, err))


def test_a_failed_gradient_all_reduce_names_its_peers():
    """A shared parameter's all-reduce between two pipeline ranks that fails (a node died at the
    step's end) names the other rank, as a failed send does."""
    from fxpipe.runtime.data_parallel import GradBucket

    bucket = GradBucket("shared parameters ['head.weight']", [], None, 1.0)
    bucket.peers = [1]
    text = str(bucket._failed(RuntimeError("Connection closed by peer"), 10))
    assert "with rank 1 failed" in text and "rank 1's log" in text
