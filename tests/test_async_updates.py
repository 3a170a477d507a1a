"""Asynchronous parameter-server updates (``train.updates: async``, issue 10 item 3).

* Spec: every combination async updates cannot serve is a SpecError naming FILE:LINE of the key
  (the rules of :mod:`fxpipe.specs.updates`), read from YAML.
* Rules (plain Python, :class:`RoundBook`): over random arrival orders of 3 replicas, no applied
  gradient is ever more than ``max_staleness`` updates stale, with S = 0 every update averages
  one step of every replica, and every pushed step is applied once.
* Training (one gloo world of 6 ranks: CharGPT with tied embeddings, 2 stages x 2 replicas + 2
  parameter servers sharing the parameters), through the worker ``fxpipe run`` starts
  (:func:`fxpipe.training.worker.train_async`):
  - ``max_staleness: 0`` equals single-process training (hence sync): ``losses.csv`` and the
    final checkpoint (the servers' weights) within the float32 bounds of their reordered sums
    (tests/tolerances.py), SGD (AdamW would magnify float32 rounding of zero gradients to the
    learning rate; the other runs use AdamW);
  - ``max_staleness: 2``, ZB-H1, replica 1 slowed by a sleep after each backward: the staleness
    in both servers' logs never exceeds 2 and is reached, the fast replica runs more steps;
  - a trainer rank that dies mid-run: every other rank ends with a RuntimeFailure naming what it
    waited for, within ``train.timeout_s``, no hang.
"""

from __future__ import annotations

import csv
import math
import os
import random
import textwrap
import time
from pathlib import Path

import pytest
import torch

from fxpipe.errors import FxpipeError, SpecError
from fxpipe.runtime.local_ranks import run_ranks
from fxpipe.runtime.parameter_server import RoundBook

try:
    from shared_models import exact_bounds
except ImportError:  # tests/ collected as a package
    from tests.shared_models import exact_bounds

P, DP, SERVERS = 2, 2, 2
STEPS = 5
MODEL = ('{factory: "fxpipe.examples.gpt:CharGPT", args: {vocab_size: 256, block_size: 16, '
         'n_layer: 2, n_head: 2, n_embd: 32}}')
SLOW_S = 0.15      # seconds replica 1 sleeps after each backward in the staleness case


# ----------------------------------------------------------------------------- spec
def _spec_text(cluster: str = "", train: str = "", parallel: str = "") -> str:
    return textwrap.dedent(f"""\
        model: {MODEL}
        data: {{dataset: "fxpipe.examples.data:python_source_text", batch_size: 8, seq_len: 16}}
        parallel: {{pipeline: {P}, data: {DP}, microbatches: 2, schedule: 1f1b{parallel}}}
        cluster:
          nodes: 1
        """) + textwrap.indent(textwrap.dedent(cluster), "  ") + "train:\n" + textwrap.indent(
        textwrap.dedent(train), "  ")


ASYNC = "devices_per_node: 5\nparameter_servers: 1\n"
OK_TRAIN = "updates: async\nmax_staleness: 1\ncheckpoint: {dir: checkpoint, every: 0}\n"


def _load(tmp_path, text):
    from fxpipe.specs.loader import load_spec

    path = tmp_path / "spec.yaml"
    path.write_text(text)
    return path, load_spec(path)


def _line_of(path: Path, key: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1)
                if line.strip().startswith(key))


def test_async_spec_loads_with_servers_counted_in_the_cluster(tmp_path):
    _, spec = _load(tmp_path, _spec_text(ASYNC, OK_TRAIN))
    assert spec.train.updates == "async" and spec.train.max_staleness == 1
    assert spec.cluster.parameter_servers == 1 and spec.cluster.trainers == P * DP
    _, spec = _load(tmp_path, _spec_text("devices_per_node: 4\n", "steps: 3\n"))
    assert spec.train.updates == "sync" and spec.cluster.parameter_servers == 0  # the default
    # every schedule is served (each replica runs its schedule; only the step's end differs)
    for schedule in ("gpipe", "zb-h1", "zb-v", "interleaved"):
        _load(tmp_path, _spec_text(ASYNC, OK_TRAIN).replace("1f1b", schedule))


@pytest.mark.parametrize("cluster, train, parallel, key, words", [
    ("devices_per_node: 4\n", "updates: async\nmax_staleness: 1\n", "", "updates:",
     "names none"),
    (ASYNC, "updates: async\ncheckpoint: {dir: checkpoint, every: 0}\n", "", "updates:",
     "max_staleness"),
    ("devices_per_node: 5\nparameter_servers: 1\n", "steps: 3\n", "", "parameter_servers:",
     "async only"),
    ("devices_per_node: 4\n", "max_staleness: 2\n", "", "max_staleness:", "applies to"),
    ("devices_per_node: 3\nparameter_servers: 1\n", OK_TRAIN, "", "parallel:", "data: 1"),
    (ASYNC, OK_TRAIN + "precision: fp16\n", "", "precision:", "loss scaling"),
    (ASYNC, OK_TRAIN + "grad_compression: fp16\n", "", "grad_compression:", "fp32"),
    (ASYNC, OK_TRAIN + "grad_clip: 1.0\n", "", "grad_clip:", "no rank sees"),
    (ASYNC, "updates: async\nmax_staleness: 1\ncheckpoint: {dir: checkpoint, every: 5}\n", "",
     "checkpoint:", "final checkpoint"),
    (ASYNC, OK_TRAIN + "max_restarts: 1\n", "", "max_restarts:", "periodic checkpoint"),
    ("devices_per_node: 4\nparameter_servers: 4\n", OK_TRAIN, "", "parameter_servers:",
     "leaves none"),
    ("devices_per_node: 4\nparameter_servers: 1\n", OK_TRAIN, "", "parallel:",
     "minus 1 parameter servers"),
    (ASYNC, "updates: async\nmax_staleness: -1\n", "", "max_staleness:", "negative"),
])
def test_async_spec_errors_name_file_and_line(tmp_path, cluster, train, parallel, key, words):
    text = _spec_text(cluster, train, parallel)
    if "data: 1" in words:
        text = text.replace(f"data: {DP}, microbatches", "data: 1, microbatches")
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    from fxpipe.specs.loader import load_spec

    with pytest.raises(SpecError) as err:
        load_spec(path)
    msg = str(err.value)
    assert f"{path}:{_line_of(path, key)}" in msg, msg
    assert words in msg, msg


# ----------------------------------------------------------------------------- the rules
def _simulate(replicas: int, s: int, steps: int, seed: int, slow: int | None = None):
    """Drive a RoundBook as ParameterServer does, one contributor per replica, arrivals in a
    random order (``slow``: that replica acts only one time in four). Returns the applied rounds
    and each replica's step count."""
    rng = random.Random(seed)
    book = RoundBook(replicas, 1, s)
    state = ["idle"] * replicas  # idle -> waiting (pulled) -> running (granted) -> idle
    step = [0] * replicas
    tickets = steps * replicas
    rounds = []

    def advance():
        while True:
            granted = book.grant()
            for _, r, _ in granted:
                state[r] = "running"
            rnd = book.close()
            if rnd is not None:
                rounds.append([(r, e.step, st) for r, e, st in rnd])
            if not granted and rnd is None:
                return

    for _ in range(100_000):
        movable = [r for r in range(replicas) if state[r] in ("idle", "running")]
        if not movable:
            break
        weights = [0.25 if r == slow else 1.0 for r in movable]
        r = rng.choices(movable, weights)[0]
        if state[r] == "idle":
            mine = step[r] < steps if s == 0 else tickets > 0
            if mine:
                tickets -= 1
                book.pull(r, r, step[r])
                state[r] = "waiting"
            else:
                book.leave(r, r)
                state[r] = "left"
        else:
            book.push(r, r, step[r])
            step[r] += 1
            state[r] = "idle"
        advance()
    assert book.finished() and all(x == "left" for x in state), (state, book.describe())
    return rounds, step


@pytest.mark.parametrize("s", [0, 1, 2, 3])
def test_round_book_never_exceeds_the_staleness_bound(s):
    for seed in range(20):
        rounds, steps = _simulate(3, s, 8, seed, slow=seed % 3)
        applied = [(r, c) for rnd in rounds for r, c, _ in rnd]
        assert sorted(applied) == sorted((r, c) for r in range(3) for c in range(steps[r]))
        assert max(st for rnd in rounds for _, _, st in rnd) <= s
        if s == 0:  # lockstep: every update holds one step of every replica, all fresh
            assert all(sorted(r for r, _, _ in rnd) == [0, 1, 2] for rnd in rounds)
            assert steps == [8, 8, 8]
    if s >= 2:  # the bound is used: a slow replica does not hold the fast ones back
        rounds, steps = _simulate(3, s, 8, 0, slow=0)
        assert steps[0] < steps[1] and max(st for rnd in rounds for _, _, st in rnd) >= 1


# ----------------------------------------------------------------------------- training
def _make_plan(tmp_path: Path, name: str, schedule: str, staleness: int, timeout: int = 60,
               optimizer: str = "adamw", lr: str = "3.0e-3"):
    from fxpipe.partitioner.driver import plan_with_graph
    from fxpipe.specs.loader import build_model, load_spec

    path = tmp_path / f"{name}.yaml"
    path.write_text(_spec_text(
        f"devices_per_node: {P * DP + SERVERS}\nparameter_servers: {SERVERS}\n",
        f"steps: {STEPS}\noptimizer: {optimizer}\nlr: {lr}\nweight_decay: 0.01\nupdates: async\n"
        f"max_staleness: {staleness}\ntimeout_s: {timeout}\n"
        "checkpoint: {dir: checkpoint, every: 0}\n").replace("1f1b", schedule))
    spec = load_spec(path)
    with torch.device("meta"):
        model = build_model(spec, load_weights=False)
    from fxpipe.data.batches import example_microbatch

    plan = plan_with_graph(model, spec, example_microbatch(spec).args)[0]
    (tmp_path / name).mkdir()
    plan.save(tmp_path / name / "plan.json")
    return spec, plan


def _slow_replica_1(replica: int, step: int) -> None:
    if replica == 1:
        time.sleep(SLOW_S)


def _die_at_step_1(replica: int, step: int) -> None:
    if replica == 1 and step == 1 and int(os.environ["RANK"]) == P * 1 + 1:
        os._exit(0)  # a crash: the process is gone, its sockets closed (0: run_ranks gives None)


def _rank(rank: int, root: str) -> dict:
    from fxpipe.training.worker import train_async

    root = Path(root)
    out = {}
    for name, hook in (("lockstep", None), ("stale", _slow_replica_1)):
        train_async(root / name / "plan.json", root / name, after_backward=hook)
    t0 = time.perf_counter()
    try:
        train_async(root / "dies" / "plan.json", root / "dies", after_backward=_die_at_step_1)
        out["dies"] = ("finished", "", time.perf_counter() - t0)
    except FxpipeError as e:
        out["dies"] = (type(e).__name__, str(e), time.perf_counter() - t0)
    return out


def _reference(spec):
    """Single-process training (the spec's optimizer) on the same global batches: losses,
    parameters and the ``(loss, parameter)`` bounds (:func:`shared_models.exact_bounds`)."""
    from fxpipe.data.batches import get_batch, make_batches
    from fxpipe.specs.loader import build_model
    from fxpipe.execution.losses import cross_entropy

    model = build_model(spec)
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    t = spec.train
    kind = torch.optim.SGD if t.optimizer == "sgd" else torch.optim.AdamW
    opt = kind(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
    batches = make_batches(spec)
    losses = []
    for c in range(t.steps):
        b = get_batch(batches, spec, c)
        loss = cross_entropy(model(*b.args), b.target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    final = model.state_dict()
    return losses, final, exact_bounds(losses, init, final, spec.data.batch_size, t.steps)


def _csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def world6(tmp_path_factory):
    root = tmp_path_factory.mktemp("async")
    plans = {"lockstep": _make_plan(root, "lockstep", "1f1b", 0, optimizer="sgd", lr="0.5"),
             "stale": _make_plan(root, "stale", "zb-h1", 2),
             "dies": _make_plan(root, "dies", "1f1b", 0, timeout=5)}
    results = run_ranks(_rank, P * DP + SERVERS, str(root), timeout_s=170, dist_timeout_s=60)
    return root, plans, results


@pytest.mark.distributed
def test_plan_shards_parameters_over_two_servers(world6):
    _, plans, _ = world6
    spec, plan = plans["lockstep"]
    assert plan.parameter_servers == [4, 5] and plan.world_size == 6
    assert set(plan.server_params.values()) == {0, 1}
    assert "+ 2 parameter servers = world size 6" in plan.summary()


@pytest.mark.distributed
def test_max_staleness_0_equals_single_process_training(world6):
    from fxpipe.specs.loader import build_model
    from fxpipe.training.checkpoint import load_into_model

    root, plans, _ = world6
    spec, _ = plans["lockstep"]
    ref_losses, ref_state, (loss_tol, param_tol) = _reference(spec)
    rows = _csv(root / "lockstep" / "losses.csv")
    assert [int(r["step"]) for r in rows] == list(range(STEPS))
    assert max(abs(float(r["loss"]) - x) for r, x in zip(rows, ref_losses)) < loss_tol
    assert ref_losses[-1] < ref_losses[0]  # it trains
    model = build_model(spec)
    load_into_model(model, root / "lockstep" / "checkpoint")  # the servers' final weights
    state = model.state_dict()
    worst = max((state[k] - ref_state[k]).abs().max().item() for k in ref_state)
    assert worst < param_tol, (worst, param_tol)
    for j in range(SERVERS):  # every update averaged one fresh step of each replica
        log = _csv(root / "lockstep" / f"parameter_server_{j}.csv")
        assert len(log) == STEPS * DP
        assert {int(r["staleness"]) for r in log} == {0} and {r["round_size"] for r in log} == {
            str(DP)}


@pytest.mark.distributed
def test_staleness_bound_holds_and_the_fast_replica_does_more(world6):
    root, _, _ = world6
    for j in range(SERVERS):
        log = _csv(root / "stale" / f"parameter_server_{j}.csv")
        stale = [int(r["staleness"]) for r in log]
        assert max(stale) <= 2, stale
        assert max(stale) >= 1, stale  # replica 1's sleep made the bound matter
        assert len(log) == STEPS * DP  # the ticket pool: steps x replicas in all
    steps = _csv(root / "stale" / "replica_losses.csv")
    per = {d: sum(1 for r in steps if int(r["replica"]) == d) for d in range(DP)}
    assert per[0] > per[1] and per[0] + per[1] == STEPS * DP, per
    assert all(torch.isfinite(torch.tensor(float(r["loss"]))) for r in steps)
    assert (root / "stale" / "checkpoint" / "latest").exists()


@pytest.mark.distributed
def test_a_dying_trainer_ends_every_rank_with_a_clear_error_in_time(world6):
    _, plans, results = world6
    timeout = plans["dies"][0].train.timeout_s
    dead = P * 1 + 1
    assert results[dead] is None  # the rank that died
    for rank, res in enumerate(results):
        if rank == dead:
            continue
        kind, msg, took = res["dies"]
        assert kind == "RuntimeFailure", (rank, kind, msg)
        assert "timed out" in msg or "failed" in msg, msg
        assert f"rank {rank}" in msg, msg  # names the waiting rank
        assert took < 3 * timeout + 15, (rank, took)


# ----------------------------------------------------------------------------- benchmark report
def test_benchmark_report_tables_from_runs():
    """benchmarks/bench_async_updates.py's figures from its per-step records (the runs
    themselves take minutes: in-process, synthetic records with known answers)."""
    import argparse
    import sys

    root = Path(__file__).resolve().parents[1]
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from benchmarks import bench_async_updates as bench

    sync = bench.Result("sync", 10.0, 40, 4, {0: 10, 1: 10}, 10, 0,
                        [(c + 1.0, 4 * (c + 1), 5.0 - 0.1 * c) for c in range(10)],
                        [5.0 - 0.1 * c for c in range(10)])
    lock = bench.Result("async S=0", 10.0, 40, 4, {0: 10, 1: 10}, 10, 0,
                        [(c / 2 + 0.5, 2 * (c + 1), 5.0) for c in range(20)],
                        [5.0 - 0.1 * c + 1e-7 for c in range(10)])
    stale = bench.Result("async S=2", 5.0, 40, 4, {0: 15, 1: 5}, 15, 2,
                         [(c / 4 + 0.25, 2 * (c + 1), 4.0) for c in range(20)], [4.0] * 15)
    assert sync.batches_per_s == 1.0 and stale.samples_per_s == 8.0
    assert sync.loss_near_batches(10, 2) == pytest.approx((4.1 + 4.2) / 2)
    assert sync.loss_near_time(3.0, 1.5) == pytest.approx((4.9 + 4.8) / 2)
    assert math.isnan(sync.loss_near_time(20.0, 1.0))
    args = argparse.Namespace(n_layer=4, n_embd=128, seq_len=128, batch=4, microbatches=4,
                              steps=10, sleep=0.3, window=2, time_window=1.0)
    text = bench.report([sync, lock, stale], args, 2)
    assert "| async S=2 | 5.0 | 2.00 | 8.0 | 15 / 5 | 15 | 2 | 4.000 |" in text, text
    assert "async S=2: 2.00x sync's throughput" in text and "at most 1.0e-07" in text
    assert "| async S=2 | 4.000 | 4.000 | done | done |" in text, text


# ----------------------------------------------------------------------------- fxpipe.compile
def test_public_compile_refuses_async_spec_and_plan(tmp_path):
    """A user's torchrun script cannot run async through fxpipe.compile (a server rank would get
    a ServerShare, trainer ranks would train alone): one clear error, before joining any
    process group, for a spec and for a plan with parameter servers."""
    import torch.distributed as dist

    import fxpipe
    from fxpipe.specs.loader import build_model
    from fxpipe.training.compiled import UsageError

    spec, plan = _make_plan(tmp_path, "user", "1f1b", 1)
    for source in (plan, tmp_path / "user" / "plan.json", tmp_path / "user.yaml"):
        with pytest.raises(UsageError, match=r"train.updates: async runs through `fxpipe run`"
                                             r".*fxpipe.compile trains with sync updates"):
            fxpipe.compile(build_model(spec), source)
        assert not dist.is_initialized()


@pytest.mark.distributed
def test_a_failed_run_keeps_the_rows_before_the_failure(world6):
    """The run whose trainer rank dies at step 1: the servers' logs, replica_losses.csv and
    losses.csv hold the steps done before (written row by row, flushed), not nothing."""
    root, _, _ = world6
    run = root / "dies"
    for j in range(SERVERS):  # step 0 of both replicas was applied before the death
        log = _csv(run / f"parameter_server_{j}.csv")
        assert {(int(r["round"]), int(r["replica"]), int(r["step"])) for r in log} >= {
            (0, 0, 0), (0, 1, 0)}, log
    steps = _csv(run / "replica_losses.csv")
    assert {(int(r["replica"]), int(r["step"])) for r in steps} >= {(0, 0), (1, 0)}, steps
    assert all(math.isfinite(float(r["loss"])) for r in steps)
    losses = _csv(run / "losses.csv")
    assert losses and int(losses[0]["step"]) == 0 and math.isfinite(float(losses[0]["loss"]))
    assert not (run / "checkpoint" / "latest").exists()  # it did fail


# ----------------------------------------------------------------------------- plan summary
@pytest.mark.parametrize("nodes", [1, 2])
def test_plan_summary_shows_each_servers_links_and_traffic(tmp_path, nodes):
    """Per server: its rank and node, per pipeline rank the link (intra-/inter-node, GB/s), the
    bytes of one push and one pull and their time on it, and the server cost the prediction
    priced (on 2 nodes of 3 devices the servers, ranks 4 and 5, sit on node 1)."""
    from fxpipe.data.batches import example_microbatch
    from fxpipe.partitioner.driver import plan_with_graph
    from fxpipe.plans.placement import node_of
    from fxpipe.plans.plan import Plan
    from fxpipe.schedule.plan_price import links_from_plan
    from fxpipe.specs.loader import build_model, load_spec
    from fxpipe.units import human_bytes, ms

    path = tmp_path / "s.yaml"
    path.write_text(_spec_text(
        f"devices_per_node: {(P * DP + SERVERS) // nodes}\nparameter_servers: {SERVERS}\n"
        "links: {intra_node_GBps: 400, inter_node_GBps: 12.5}\n",
        "updates: async\nmax_staleness: 1\n").replace("nodes: 1", f"nodes: {nodes}"))
    spec = load_spec(path)
    with torch.device("meta"):
        model = build_model(spec, load_weights=False)
    plan = plan_with_graph(model, spec, example_microbatch(spec).args)[0]
    text = plan.summary()
    ranks = plan.stage_ranks()
    links = links_from_plan(plan)
    home = 0 if nodes == 1 else 1
    for j, srank in enumerate(plan.parameter_servers):
        assert f"  server {j}: rank {srank}," in text, text
        assert all(node_of(srank, (P * DP + SERVERS) // nodes) == home for srank in
                   plan.parameter_servers)
        for r in range(P):
            b = sum(row[j] for pos, row in enumerate(plan.server_stage_bytes) if ranks[pos] == r)
            if b <= 0:
                continue
            # 2 nodes: replica 0's ranks are on node 0, the servers on node 1
            where, gbps = ("intra-node", 400) if nodes == 1 else ("inter-node", 12.5)
            one = ms(b / (gbps * 1e9) + links.latency_s)
            assert (f"    pipeline rank {r}: {where} link {gbps:g} GB/s; push {human_bytes(b)} "
                    f"and pull {human_bytes(b)}, {one} ms each") in text, text
    loads = [sum(row[j] for row in plan.server_stage_bytes) for j in range(SERVERS)]
    for r in range(P):
        priced = sum(links.push_pull_seconds(r, row, loads, plan.dp)
                     for pos, row in enumerate(plan.server_stage_bytes) if ranks[pos] == r)
        assert priced > 0 and f"rank {r} {ms(priced)} ms" in text.split("priced in the")[1]
    assert Plan.from_dict(plan.to_dict()).summary() == text  # the fields survive plan.json
