"""Exact resume, resharding, export, a killed rank under train.max_restarts, non-finite losses:
``fxpipe run`` end to end (4 gloo workers, a tiny GPT)."""

from __future__ import annotations

import csv
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fxpipe.examples.gpt import CharGPT

try:
    from cli_helpers import cli_env, fxpipe_cli, fxpipe_in_process
    from tolerances import bound
except ImportError:  # collected as a package
    from tests.cli_helpers import cli_env, fxpipe_cli, fxpipe_in_process
    from tests.tolerances import bound

pytestmark = pytest.mark.distributed

#: 8 steps (warm-up 2, then cosine): a resume at step 2 or 4 still lands after the warm-up,
#: mid-decay, with checkpoints every 2 steps before and after it
STEPS = 8
SPEC = """
model:
  factory: "fxpipe.examples.gpt:CharGPT"
  args: {{vocab_size: 256, block_size: 32, n_layer: 2, n_head: 2, n_embd: 32}}
data: {{batch_size: 8, seq_len: 32}}
parallel: {{{parallel}}}
cluster: {{devices_per_node: {devices}, memory_gb: 2}}
train: {{steps: {steps}, optimizer: adamw, lr: {lr}, weight_decay: 0.01, seed: 0, log_every: 1,
        timeout_s: 60, grad_accumulation: 2, grad_clip: 1.0, eval_batches: 0,
        checkpoint: {{every: {every}}}, max_restarts: {restarts}, nan_policy: {nan},
        lr_schedule: {{warmup_steps: 2, decay: cosine, min_lr: 1.0e-4}}}}
output: {{dir: run}}
"""
TWO_BY_TWO = "pipeline: 2, data: 2, microbatches: 2, schedule: 1f1b"
TWO_STAGES = "pipeline: 2, data: 1, microbatches: 2, schedule: 1f1b"


def write_spec(path: Path, parallel: str = TWO_BY_TWO, devices: int = 4, steps: int = STEPS,
               lr: str = "2.0e-3", every: int = 2, restarts: int = 0, nan: str = "stop") -> Path:
    path.write_text(SPEC.format(parallel=parallel, devices=devices, steps=steps, lr=lr,
                                every=every, restarts=restarts, nan=nan))
    return path


def losses(run: Path) -> list[tuple[int, str]]:
    """(step, loss text) of losses.csv: the loss is written at full precision."""
    with open(run / "losses.csv", newline="") as f:
        return [(int(r["step"]), r["loss"]) for r in csv.DictReader(f)]


def crash_after(run: Path, step: int) -> None:
    """Leave ``run`` as a crash right after the checkpoint of ``step`` leaves it: later
    checkpoints and loss rows gone, ``latest`` pointing at ``step``."""
    ckpt = run / "checkpoint"
    for d in ckpt.glob("step_*"):
        if int(d.name[5:]) > step:
            shutil.rmtree(d)
    (ckpt / "latest").write_text(f"step_{step:06d}\n")
    rows = (run / "losses.csv").read_text().splitlines()
    (run / "losses.csv").write_text("\n".join(rows[:1 + step + 1]) + "\n")  # a row past it too


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted run of STEPS steps (2 stages x 2 replicas, 1F1B, a checkpoint every 2
    steps, one restart allowed)."""
    d = tmp_path_factory.mktemp("ref")
    spec = write_spec(d / "spec.yaml", every=2, restarts=1)
    r = fxpipe_cli("run", spec, "--out", d / "run", "--no-report", timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return spec, d / "run", losses(d / "run")


#: where :func:`resumed_then_killed` resumes the reference (a crash right after this step's
#: checkpoint), and how many rows losses.csv holds when it kills a worker: steps 2 and 3 trained
#: by the resumed launch, the checkpoint of step 4 written or being written (the restart starts
#: from it or from step 2's), 4 steps left
RESUME_AT, KILL_AT_ROWS = 2, 4


@pytest.fixture(scope="module")
def resumed_then_killed(reference, tmp_path_factory):
    """One launch for two tests (the same spec and command): ``fxpipe run SPEC --resume RUN`` on
    a copy of the reference left as a crash right after its checkpoint of step RESUME_AT; once
    that launch has trained past the next checkpoint (KILL_AT_ROWS rows), one worker is
    SIGKILLed, and train.max_restarts restarts all four from the latest checkpoint. Returns
    (run folder, exit code, output, the killed pid, the addresses the launcher and its workers
    listened on just before the kill)."""
    spec, ref_run, _ = reference
    run = tmp_path_factory.mktemp("resumed") / "run"
    shutil.copytree(ref_run, run)
    crash_after(run, RESUME_AT)
    p = subprocess.Popen([sys.executable, "-m", "fxpipe", "run", str(spec), "--resume", str(run),
                          "--no-report"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=cli_env())
    deadline = time.monotonic() + 240
    killed, addresses = None, set()
    while killed is None and time.monotonic() < deadline and p.poll() is None:
        # the copied file holds RESUME_AT + 1 rows until the launch cuts it back to RESUME_AT
        rows = (run / "losses.csv").read_text().count("\n") - 1
        if rows >= KILL_AT_ROWS:
            workers = [_worker_pid(p.pid, r) for r in range(4)]
            # everything the launcher and its workers listen on is the loopback
            addresses = listening_addresses([p.pid, *filter(None, workers)])
            killed = workers[1]
            if killed:
                os.kill(killed, signal.SIGKILL)
        time.sleep(0.01)
    out, _ = p.communicate(timeout=300)
    return run, p.returncode, out, killed, addresses


def test_resume_continues_bit_for_bit(reference, resumed_then_killed):
    _, _, ref = reference
    assert len(ref) == STEPS and len({loss for _, loss in ref}) == STEPS
    run, code, out, _, _ = resumed_then_killed
    assert code == 0, out[-3000:]
    # the resume itself (the restart after the kill says "restart 1: resuming from")
    assert any(line.startswith("resuming from") and line.endswith(f"(step {RESUME_AT} of {STEPS})")
               for line in out.splitlines()), out[-3000:]
    # steps 0-1 kept, the row past the checkpoint dropped, 2-7 trained again: the same bits
    assert losses(run) == ref
    final = sorted((run / "checkpoint").glob("step_*"))[-1]
    assert final.name == f"step_{STEPS:06d}"


@pytest.mark.parametrize("parallel, devices", [
    ("pipeline: 4, data: 1, microbatches: 2, schedule: zb-h1", 4),  # 4 stages x 1
    ("pipeline: 1, data: 2, microbatches: 2, schedule: gpipe", 2),  # 1 stage x 2 replicas
    ("pipeline: 2, data: 1, tensor: 2, microbatches: 2, schedule: zb-h1", 4),  # layers split
])
def test_resume_under_another_plan(reference, tmp_path, parallel, devices):
    _, ref_run, ref = reference
    run = tmp_path / "run"
    shutil.copytree(ref_run, run)
    crash_after(run, 4)
    other = write_spec(tmp_path / "other.yaml", parallel=parallel, devices=devices)
    r = fxpipe_cli("run", other, "--resume", run, "--no-report", timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = losses(run)
    assert [s for s, _ in got] == list(range(STEPS))
    # the same training, another summation order: float32 rounding of sums reordered over the
    # 2 x 8 samples of an optimizer step, growing with the steps (tests/tolerances.py)
    tol = bound(max(float(w) for _, w in ref), 2 * 8, len(ref))
    for (_, want), (_, have) in zip(ref, got):
        assert abs(float(want) - float(have)) < tol, (want, have, tol)


def test_export_loads_into_the_plain_model_strictly(reference, tmp_path):
    _, ref_run, _ = reference
    r = fxpipe_in_process("export", ref_run, tmp_path / "model.pt")
    assert r.returncode == 0, r.stderr
    assert f"after step {STEPS}" in r.stdout
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    model = CharGPT(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32)
    model.load_state_dict(state, strict=True)
    from fxpipe.training.checkpoint import load_into_model

    same = CharGPT(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32)
    load_into_model(same, ref_run / "checkpoint")
    for (n, p), (_, q) in zip(model.state_dict().items(), same.state_dict().items()):
        assert torch.equal(p, q), n
    # errors: no run folder, a damaged checkpoint, a folder as the output
    assert "no plan.json" in fxpipe_in_process("export", tmp_path, tmp_path / "x.pt").stderr
    r = fxpipe_in_process("export", ref_run, tmp_path)
    assert r.returncode == 2 and "is a folder" in r.stderr and "Traceback" not in r.stderr


def test_no_report_leaves_the_pictures_to_fxpipe_report(reference, tmp_path):
    """The runs here pass --no-report: no pictures, no report.html; `fxpipe report` draws them
    all (the partition from plan.json) afterwards."""
    _, ref_run, _ = reference
    assert not list(ref_run.glob("*.png")) and not (ref_run / "report.html").exists()
    run = tmp_path / "run"
    shutil.copytree(ref_run, run)
    r = fxpipe_in_process("report", run)
    assert r.returncode == 0, r.stderr
    assert (run / "report.html").exists()
    for stem in ("partition", "timeline", "training"):
        assert (run / f"{stem}.svg").exists() and (run / f"{stem}.png").stat().st_size > 1000


def test_resume_errors_are_clean(reference, tmp_path):
    spec, ref_run, _ = reference
    r = fxpipe_in_process("run", spec, "--resume", ref_run)  # already at train.steps
    assert r.returncode == 2 and "nothing left to train" in r.stderr and "Traceback" not in r.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    r = fxpipe_in_process("run", spec, "--resume", empty)
    assert r.returncode == 2 and "holds no checkpoint" in r.stderr
    r = fxpipe_in_process("run", spec, "--resume", ref_run, "--out", tmp_path / "elsewhere")
    assert r.returncode == 2 and "drop --out" in r.stderr


def _worker_pid(launcher: int, rank: int) -> int | None:
    """The worker of ``rank`` under the ``fxpipe run`` process ``launcher``: named
    ``fxpipe-rank<R>`` and forked from the launcher's fork server."""
    def parent(pid: str) -> int:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])

    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == f"fxpipe-rank{rank}" \
                    and parent(str(parent(pid))) == launcher:
                return int(pid)
        except (OSError, ValueError, IndexError):
            continue
    return None


def listening_addresses(pids: list[int]) -> set[str]:
    """Local addresses of the TCP sockets the processes ``pids`` listen on (from /proc)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    found = set()
    for table, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            f = line.split()
            if f[3] != "0A" or f[9] not in inodes:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(f[1].split(":")[0])
            if width == 8:
                found.add(socket.inet_ntop(socket.AF_INET, raw[::-1]))
            else:  # four little-endian 32-bit words
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                found.add(socket.inet_ntop(socket.AF_INET6, words))
    return found


def test_killed_rank_restarts_from_the_latest_checkpoint(reference, resumed_then_killed):
    """SIGKILL one worker mid-run (of the resumed launch of :func:`resumed_then_killed`): with
    train.max_restarts the workers restart from the latest checkpoint and the run ends with the
    uninterrupted run's losses."""
    _, _, ref = reference
    run, code, out, killed, addresses = resumed_then_killed
    assert killed, "never found the worker to kill:\n" + out[-3000:]
    assert addresses and addresses <= {"127.0.0.1", "::ffff:127.0.0.1", "::1"}, addresses
    assert code == 0, out[-3000:]
    assert "restarting all 4 workers from the latest checkpoint (restart 1 of 1)" in out
    assert "restart 1: resuming from" in out
    assert "Traceback" not in out and "frame #" not in out
    assert losses(run) == ref  # every row, bit for bit
    assert not list((run / "checkpoint").glob(".step_*.partial"))


def test_non_finite_loss_stops_the_run_and_is_not_restarted(tmp_path):
    """On 2 stages (2 ranks): every rank sees the same (all-reduced) loss and decides alike."""
    spec = write_spec(tmp_path / "spec.yaml", lr="1.0e30", restarts=1, parallel=TWO_STAGES,
                      devices=2)
    r = fxpipe_cli("run", spec, "--out", tmp_path / "run", "--no-report", timeout=300)
    assert r.returncode == 2, r.stdout[-2000:]
    err = r.stderr
    assert "the loss is nan (not finite); training stopped" in err and "train.lr" in err
    assert "it would meet it again" in err and "Traceback" not in err
    # said once, by the launcher (the ranks record it: the first to exit ends the others)
    assert err.count("training stopped.") == 1
    assert len(losses(tmp_path / "run")) >= 1  # the rows before it are kept

    skip = write_spec(tmp_path / "skip.yaml", lr="1.0e30", nan="skip", steps=4,
                      parallel=TWO_STAGES, devices=2)
    r = fxpipe_cli("run", skip, "--out", tmp_path / "skip", "--no-report", timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "update skipped (train.nan_policy: skip)" in r.stdout
