"""The gradient-reducer interface and where the runtime's process groups come from (issue 39).

* Reducers (one gloo world of 2 ranks, one replica each): the all-reduce
  (:class:`GradSynchronizer`), the sharded (:class:`DataSharding`), their composite (sharding
  with a tied parameter all-reduced) and :class:`NoGradSync`, each driven through the
  interface the executor uses (``stage_done`` / ``finish`` / ``pending`` / ``commit`` /
  ``take_bytes`` / ``reset`` / ``ensure_gathered``): the reduced gradients and the bytes counted
  equal hand-computed values (ring algorithms: an all-reduce of ``B`` bytes over 2 ranks sends
  ``B``, a reduce-scatter ``B / 2``, an all-gather of ``S`` bytes per rank ``S``).
* Process groups: every ``torch.distributed.new_group`` call of the runtime is made in
  ``fxpipe/runtime/mesh.py``, checked on the source and while two ranks compile pipelines with
  a tied embedding (replica groups), data sharding and a tensor group; the parameter servers'
  group (gloo on CUDA) is the mesh's.
* Tensor-parallel timing: the collectives report to the recorder the mesh passes with the
  tensor group, only while a sink listens (nested listeners all hear them).
"""

from __future__ import annotations

import ast
import sys
import types
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fxpipe.runtime.data_parallel import GradSynchronizer  # noqa: E402
from fxpipe.runtime.data_sharding import DataSharding  # noqa: E402
from fxpipe.runtime.grad_reducer import (CompositeReducer, GradReducer, NoGradSync,  # noqa: E402
                                         make_grad_reducer, sharding_of)
from fxpipe.runtime.local_ranks import run_ranks  # noqa: E402
from fxpipe.runtime.mesh import Mesh  # noqa: E402

try:
    from shared_models import SEQ, VOCAB, tiny_gpt
except ImportError:  # tests/ collected as a package
    from tests.shared_models import SEQ, VOCAB, tiny_gpt

T = 30.0


# ----------------------------------------------------------------------------- reducers
def _params():
    """``a`` (stage 0, 6 elements), ``b`` (stage 1, 2 x 2), ``c`` (tied: stages 0 and 1, 3)."""
    a, b, c = (nn.Parameter(torch.zeros(*s)) for s in ((6,), (2, 2), (3,)))
    return a, b, c, {0: [a, c], 1: [b, c]}, {id(c): ((0,), "c")}


def _grads(r: int, a, b, c) -> None:
    """Rank ``r``'s gradients; their means over the 2 ranks are :data:`MEAN`."""
    a.grad = torch.arange(6.0) + 10 * r
    b.grad = torch.full((2, 2), 1.0 + 2 * r)
    c.grad = torch.tensor([1.0, -2.0, 4.0]) * (r + 1)


MEAN = {"a": torch.arange(6.0) + 5, "b": torch.full((2, 2), 2.0),
        "c": torch.tensor([1.5, -3.0, 6.0])}


def _lists(ts) -> list:
    """Tensors as nested lists (tensors do not survive the trip back from a rank process)."""
    return [t.tolist() for t in ts]


def _run_step(red, timeout_s: float = T, applied: bool = True) -> dict:
    """One step through the interface, as the executor calls it."""
    red.ensure_gathered(timeout_s)
    red.stage_done(0)
    red.stage_done(1)
    red.finish(timeout_s)
    pending = _lists(red.pending())
    red.commit(applied)
    sent = red.take_bytes()
    again = red.take_bytes()
    red.reset()
    return {"pending": pending, "bytes": sent, "again": again}


def _reducers_worker(rank: int) -> dict:
    out = {}
    mesh = Mesh(1, 2)  # two replicas of one stage-holding rank: the data-parallel group
    # all-reduce, exact: a after stage 0, b after stage 1, then the tied c (its own group)
    a, b, c, stage_params, shared = _params()
    red = make_grad_reducer(stage_params, shared, mesh, "none")
    _grads(rank, a, b, c)
    got = _run_step(red)
    out["allreduce"] = dict(got, kind=type(red).__name__, is_reducer=isinstance(red, GradReducer),
                            grads={n: p.grad.tolist() for n, p in zip("abc", (a, b, c))},
                            sharding=sharding_of(red) is not None)
    # all-reduce, fp16 payloads: half the bytes
    a, b, c, stage_params, shared = _params()
    red = make_grad_reducer(stage_params, shared, mesh, "fp16")
    _grads(rank, a, b, c)
    out["fp16"] = _run_step(red)
    # sharded (level optimizer) with the tied c all-reduced: a composite
    a, b, c, stage_params, shared = _params()
    red = make_grad_reducer(stage_params, shared, mesh, "none", data_sharding="optimizer")
    sharding = sharding_of(red)
    _grads(rank, a, b, c)
    got = _run_step(red)
    out["sharded"] = dict(got, kind=type(red).__name__,
                          parts=[type(p).__name__ for p in red.parts],
                          is_reducer=isinstance(red, GradReducer),
                          slices=_lists(sharding.grad_slices()),
                          a=a.grad.tolist(), b=b.grad.tolist(), c=c.grad.tolist())
    sharding.gather(T)  # what the sharded optimizer's step sends: counted at the next take
    out["gather_bytes"] = red.take_bytes()
    _grads(rank, a, b, c)  # a step whose gradients are dropped (an fp16 step skipped)
    out["dropped"] = dict(_run_step(red, applied=False),
                          slices=_lists(sharding.grad_slices()))
    # no gradient sync (asynchronous updates): nothing moves, nothing is sent
    a, b, c, stage_params, shared = _params()
    red = make_grad_reducer(stage_params, {}, mesh, "none", sync_gradients=False)
    _grads(rank, a, b, c)
    out["none"] = dict(_run_step(red), kind=type(red).__name__,
                       is_reducer=isinstance(red, GradReducer),
                       grads={n: p.grad.tolist() for n, p in zip("abc", (a, b, c))})
    return out


@pytest.fixture(scope="module")
def reducers():
    return run_ranks(_reducers_worker, 2, timeout_s=180)


@pytest.mark.distributed
def test_allreduce_reducer_averages_each_bucket_and_counts_its_ring_bytes(reducers):
    for r in reducers:
        got = r["allreduce"]
        assert got["kind"] == "GradSynchronizer" and got["is_reducer"]
        assert not got["sharding"]
        for n in "abc":
            assert got["grads"][n] == MEAN[n].tolist(), n
        # a 24 + b 16 + c 12 bytes of fp32, each all-reduced over 2 ranks: 2 (n-1)/n x = 1 x
        assert got["bytes"] == 24 + 16 + 12 and got["again"] == 0
        assert got["pending"] == []  # the averages are in .grad
        assert r["fp16"]["bytes"] == (24 + 16 + 12) // 2


@pytest.mark.distributed
def test_sharded_reducer_reduce_scatters_slices_and_all_reduces_the_tied_parameter(reducers):
    for rank, r in enumerate(reducers):
        got = r["sharded"]
        assert got["kind"] == "CompositeReducer" and got["is_reducer"]
        assert got["parts"] == ["GradSynchronizer", "DataSharding"]
        # slices: a (6 elements -> 3 per rank), b (4 -> 2 per rank), this rank's of the mean
        want = [MEAN["a"][3 * rank:3 * rank + 3].tolist(),
                MEAN["b"].reshape(-1)[2 * rank:2 * rank + 2].tolist()]
        assert got["slices"] == want and got["pending"] == want  # pending: before the commit
        # the whole gradients of sharded parameters are zeroed (level optimizer), c averaged
        assert got["a"] == [0.0] * 6 and got["b"] == [[0.0, 0.0], [0.0, 0.0]]
        assert got["c"] == MEAN["c"].tolist()
        # reduce-scatters: half of 24 and of 16 bytes; the tied c's all-reduce: 12
        assert got["bytes"] == 12 + 8 + 12 and got["again"] == 0
        # the all-gather of the parameters: 3 + 2 floats per rank, sent to the other rank
        assert r["gather_bytes"] == (3 + 2) * 4
        # a dropped step leaves the accumulated slices as they were, but its bytes were sent
        assert r["dropped"]["slices"] == want
        assert r["dropped"]["bytes"] == 32


@pytest.mark.distributed
def test_no_sync_reducer_leaves_every_gradient_and_sends_nothing(reducers):
    for rank, r in enumerate(reducers):
        got = r["none"]
        assert got["kind"] == "NoGradSync" and got["is_reducer"]
        assert got["bytes"] == 0 and got["pending"] == []
        a, b, c, _, _ = _params()
        _grads(rank, a, b, c)
        for n, p in zip("abc", (a, b, c)):
            assert got["grads"][n] == p.grad.tolist(), n


# ----------------------------------------------------------------------------- process groups
def _new_group_calls(tree_root: Path) -> list[str]:
    """``file:line`` of every call of ``new_group`` in the package's source."""
    out = []
    for f in sorted(tree_root.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call):
                fn = node.func
                name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
                if name == "new_group":
                    out.append(f"{f.relative_to(tree_root.parent).as_posix()}:{node.lineno}")
    return out


def test_only_the_mesh_creates_process_groups_in_the_source():
    calls = _new_group_calls(ROOT / "fxpipe")
    assert calls and all(c.startswith("fxpipe/runtime/mesh.py:") for c in calls), calls


def _spec(pipeline: int, data: int, **parallel) -> dict:
    return {"model": {"factory": "fxpipe.examples.gpt:CharGPT"},
            "data": {"batch_size": 4 * data, "seq_len": SEQ},
            "parallel": {"pipeline": pipeline, "data": data, "microbatches": 2,
                         "schedule": "1f1b", **parallel},
            "cluster": {"nodes": 1, "devices_per_node": 2, "memory_gb": 4},
            "train": {"loss": "cross_entropy", "timeout_s": 60}}


def _groups_worker(rank: int) -> dict:
    import fxpipe
    from fxpipe.runtime.executor import PipelineExecutor
    from fxpipe.tensor import collectives

    callers: list[str] = []
    real = dist.new_group

    def new_group(*args, **kwargs):
        callers.append(Path(sys._getframe(1).f_code.co_filename).as_posix())
        return real(*args, **kwargs)

    out = {}
    x = torch.randint(0, VOCAB, (8, SEQ), generator=torch.Generator().manual_seed(3))
    example = (torch.zeros(1, SEQ, dtype=torch.long),)
    with mock.patch.object(dist, "new_group", new_group):
        # pipeline 2: the tied embedding and head sum their gradient over a replica group
        pipe = fxpipe.compile(tiny_gpt(), _spec(2, 1), example_inputs=example)
        out["pipeline"] = dict(shared=sorted(n for _, n in
                                             pipe.executor.shared_param_ranks.values()),
                               reducer=type(pipe.executor.grad_reducer).__name__,
                               loss=pipe.step(x[:4], x[:4]))
        # data 2, sharded: the data-parallel group
        pipe = fxpipe.compile(tiny_gpt(), _spec(1, 2, data_sharding="optimizer"),
                              example_inputs=example)
        out["sharded"] = dict(reducer=type(pipe.executor.grad_reducer).__name__,
                              sharding=pipe.executor.sharding is not None,
                              loss=pipe.step(x, x))
        # a tensor group: its collectives report to the mesh's recorder while a sink listens
        mesh = Mesh(1, 1, tensor=2)
        seen = []
        y = torch.full((3,), float(rank + 1))
        quiet = collectives.reduce_from(y, mesh.tp_collectives)
        with mesh.tp_recorder.to(lambda kind, nbytes, t0, t1: seen.append((kind, nbytes))):
            loud = collectives.reduce_from(y, mesh.tp_collectives)
        collectives.reduce_from(y, mesh.tp_collectives)
        out["tensor"] = dict(seen=seen, quiet=quiet.tolist(), loud=loud.tolist())
        # no gradient sync: the no-op reducer, no stand-in mesh
        plan = pipe.executor.plan
        ex = PipelineExecutor(plan, pipe.executor.schedule, dict(pipe.executor.modules),
                              pipe.executor.mesh, F.cross_entropy, None, sync_gradients=False)
        out["async"] = dict(reducer=type(ex.grad_reducer).__name__, sharding=ex.sharding,
                            shared=ex.shared_param_ranks)
    out["callers"] = callers
    return out


@pytest.fixture(scope="module")
def groups():
    return run_ranks(_groups_worker, 2, timeout_s=300)


@pytest.mark.distributed
def test_every_process_group_of_a_run_comes_from_the_mesh(groups):
    for r in groups:
        assert r["callers"], "no process group was created"
        assert all(c.endswith("fxpipe/runtime/mesh.py") for c in r["callers"]), r["callers"]
        assert r["pipeline"]["shared"] and r["pipeline"]["reducer"] == "GradSynchronizer"
        assert r["sharded"]["reducer"] == "CompositeReducer" and r["sharded"]["sharding"]
        assert r["async"] == dict(reducer="NoGradSync", sharding=None, shared={})
    assert groups[0]["pipeline"]["loss"] == groups[1]["pipeline"]["loss"]
    assert groups[0]["sharded"]["loss"] == groups[1]["sharded"]["loss"]


@pytest.mark.distributed
def test_tensor_collectives_report_to_the_meshs_recorder_only_while_listened_to(groups):
    for r in groups:
        t = r["tensor"]
        assert t["seen"] == [("all-reduce", 3 * 4)]  # one of the three, whole-tensor bytes
        assert t["quiet"] == t["loud"] == [3.0, 3.0, 3.0]


def _fake_world(world: int, rank: int):
    calls = []

    def new_group(ranks=None, timeout=None, backend=None, **kw):
        calls.append((sorted(ranks) if ranks is not None else None, backend))
        return f"group{len(calls)}"
    return calls, [mock.patch.object(dist, "is_initialized", return_value=True),
                   mock.patch.object(dist, "get_world_size", return_value=world),
                   mock.patch.object(dist, "get_rank", return_value=rank),
                   mock.patch.object(dist, "new_group", side_effect=new_group)]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_parameter_servers_group_is_the_meshs(device):
    """2 replicas + 1 parameter server (rank 2): on CUDA the mesh adds a gloo group of every
    rank, which the client and the server use unless given another; on CPU the world group."""
    from fxpipe.runtime.parameter_server import ParameterClient, ParameterServer

    calls, patches = _fake_world(3, 0)
    for p in patches:
        p.start()
    try:
        mesh = Mesh(1, 2, device=torch.device(device, 0) if device == "cuda" else "cpu",
                    timeout_s=9, servers=1)
    finally:
        mock.patch.stopall()
    gloo = [c for c in calls if c[1] == "gloo"]
    if device == "cuda":
        assert gloo == [(None, "gloo")] and mesh.server_group == f"group{len(calls)}"
    else:
        assert gloo == [] and mesh.server_group is None
    plan = types.SimpleNamespace(parameter_servers=[2], stages=[], stage_ranks=lambda: [],
                                 param_aliases={}, server_params={}, dp=2, pipeline=1,
                                 placement="pipeline-inner")
    assert ParameterClient(plan, mesh, {}, 5.0).group == mesh.server_group
    mesh.rank = 2
    assert ParameterServer(plan, mesh, {}, None, 1, 0, 5.0).group == mesh.server_group
    assert ParameterClient(plan, mesh, {}, 5.0, group="other").group == "other"


def test_mesh_without_servers_creates_no_server_group():
    calls, patches = _fake_world(4, 1)
    for p in patches:
        p.start()
    try:
        mesh = Mesh(2, 2, timeout_s=3)
    finally:
        mock.patch.stopall()
    assert [c[0] for c in calls] == [[0, 2], [1, 3], [0, 1], [2, 3]]
    assert mesh.server_group is None and mesh.tp_collectives.group is None
    assert mesh.tp_collectives.recorder is mesh.tp_recorder


def test_composite_passes_every_call_to_its_parts_in_order():
    log = []

    class Part:
        def __init__(self, name):
            self.name = name

        def __getattr__(self, op):
            def call(*args):
                log.append((self.name, op) + args)
                return {"pending": [torch.zeros(1)], "take_bytes": 7}.get(op)
            return call

    red = CompositeReducer([Part("x"), Part("y")])
    red.stage_done(3)
    red.finish(1.0)
    assert len(red.pending()) == 2 and red.take_bytes() == 14
    red.commit(False)
    red.reset()
    red.ensure_gathered(2.0)
    calls = [("stage_done", 3), ("finish", 1.0), ("pending",), ("take_bytes",),
             ("commit", False), ("reset",), ("ensure_gathered", 2.0)]
    assert log == [(n,) + c for c in calls for n in "xy"]
    assert isinstance(NoGradSync(), GradReducer) and not isinstance(object(), GradReducer)
    assert GradSynchronizer and DataSharding  # the interface's implementations


def test_sharding_with_a_compression_a_reduce_scatter_cannot_send_is_refused():
    from fxpipe.errors import RuntimeFailure

    mesh = types.SimpleNamespace(dp=2, dp_group=None, dp_rank=0, replica_group=lambda k: None)
    a = nn.Parameter(torch.zeros(4))
    with pytest.raises(RuntimeFailure, match="does not fit it"):
        make_grad_reducer({0: [a]}, {}, mesh, "powersgd", data_sharding="optimizer")
    red = make_grad_reducer({0: [a]}, {}, mesh, "none", data_sharding="none")
    assert isinstance(red, GradSynchronizer)



def test_nested_listeners_of_a_recorder_all_hear_it():
    """A script counting collectives around a step and the executor's timeline inside it both
    get every report; leaving the inner block leaves the outer listener alone."""
    from fxpipe.tensor.collectives import CollectiveRecorder

    rec, outer, inner = CollectiveRecorder(), [], []
    assert rec.sink is None
    with rec.to(lambda *a: outer.append(a)):
        with rec.to(lambda *a: inner.append(a)):
            rec.sink("all-reduce", 8, 0.0, 1.0)
        rec.sink("all-gather", 4, 1.0, 2.0)
    assert rec.sink is None
    assert inner == [("all-reduce", 8, 0.0, 1.0)]
    assert outer == [("all-reduce", 8, 0.0, 1.0), ("all-gather", 4, 1.0, 2.0)]
