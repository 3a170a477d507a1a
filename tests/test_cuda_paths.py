"""The CUDA paths that would break first, tested without a GPU.

No test here needs CUDA: ``torch.cuda`` and ``torch.distributed`` are replaced by mocks that
record their calls, and tensors that stand for a GPU's live on the meta device (shapes, dtypes
and devices propagate, nothing is computed, and an op that mixes them with CPU tensors fails as
it would on a GPU). Covered:

* NCCL group creation: ``init_distributed("cuda")`` picks NCCL on ``cuda:LOCAL_RANK`` (and gloo
  without a device on CPU); the mesh's groups inherit the default backend; the parameter
  servers' group is gloo on CUDA;
* device placement: receive buffers, input micro-batches, the loss-scaler's flag and the
  gradient reducers' buffers (exact, 16-bit, PowerSGD, top-k; on the meta device, where a CPU
  tensor mixed in fails as it would on CUDA) live on the rank's device;
* bf16 autocast: the executor and the planner's timings enter ``torch.autocast("cuda", ...)``
  on a CUDA rank, never ``"cpu"``.

Pinned host memory and CUDA streams are not used anywhere in fxpipe (README, "GPU status").
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import _runtime_bench as rb  # noqa: E402
from fxpipe.errors import RuntimeFailure  # noqa: E402
from fxpipe.runtime import compression, p2p, precision  # noqa: E402
from fxpipe.runtime.compression import Compression, make_reducer  # noqa: E402
from fxpipe.runtime.executor import PipelineExecutor  # noqa: E402
from fxpipe.runtime.mesh import Mesh, init_distributed  # noqa: E402
from fxpipe.runtime.parameter_server import wire_group  # noqa: E402
from fxpipe.schedule.actions import Op  # noqa: E402
from fxpipe.schedule.lowering import schedule_for_plan  # noqa: E402

CUDA1 = torch.device("cuda", 1)


class _Work:
    """A finished collective's Work handle."""

    def wait(self, timeout=None):
        return True


# ------------------------------------------------------------------ NCCL group creation
@pytest.fixture
def launcher_env(monkeypatch):
    for k, v in dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT="29500").items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)


def test_init_distributed_on_cuda_joins_nccl_on_the_local_rank_device(launcher_env):
    with mock.patch.object(torch.cuda, "is_available", return_value=True), \
            mock.patch.object(torch.cuda, "set_device") as set_device, \
            mock.patch.object(dist, "is_initialized", return_value=False), \
            mock.patch.object(dist, "init_process_group") as init:
        dev = init_distributed("cuda", timeout_s=12)
    assert dev == CUDA1
    set_device.assert_called_once_with(CUDA1)
    init.assert_called_once_with("nccl", timeout=datetime.timedelta(seconds=12),
                                 device_id=CUDA1)


def test_init_distributed_on_cpu_joins_gloo_without_a_device(launcher_env):
    with mock.patch.object(torch.cuda, "set_device") as set_device, \
            mock.patch.object(dist, "is_initialized", return_value=False), \
            mock.patch.object(dist, "init_process_group") as init:
        dev = init_distributed("cpu", timeout_s=5)
    assert dev == torch.device("cpu")
    set_device.assert_not_called()
    init.assert_called_once_with("gloo", timeout=datetime.timedelta(seconds=5))


def test_init_distributed_on_cuda_without_a_gpu_says_so(launcher_env):
    with mock.patch.object(torch.cuda, "is_available", return_value=False), \
            mock.patch.object(dist, "init_process_group") as init:
        with pytest.raises(RuntimeFailure, match="no CUDA device"):
            init_distributed("cuda")
    init.assert_not_called()


def test_init_distributed_reuses_an_existing_group_but_still_selects_the_device(launcher_env):
    with mock.patch.object(torch.cuda, "is_available", return_value=True), \
            mock.patch.object(torch.cuda, "set_device") as set_device, \
            mock.patch.object(dist, "is_initialized", return_value=True), \
            mock.patch.object(dist, "init_process_group") as init:
        assert init_distributed("cuda") == CUDA1
    set_device.assert_called_once_with(CUDA1)  # .cuda() tensors of NCCL flags land here
    init.assert_not_called()


def _fake_world(world: int, rank: int):
    groups = []

    def new_group(ranks=None, timeout=None, backend=None, **kw):
        groups.append((sorted(ranks) if ranks is not None else None, timeout, backend))
        return f"group{len(groups)}"
    return groups, [mock.patch.object(dist, "is_initialized", return_value=True),
                    mock.patch.object(dist, "get_world_size", return_value=world),
                    mock.patch.object(dist, "get_rank", return_value=rank),
                    mock.patch.object(dist, "new_group", side_effect=new_group)]


def _enter(patches):
    for p in patches:
        p.start()


def test_mesh_on_cuda_builds_its_groups_with_the_default_backend_and_keeps_the_device():
    groups, patches = _fake_world(4, 3)
    _enter(patches)
    try:
        m = Mesh(2, 2, device=CUDA1, timeout_s=7)
    finally:
        mock.patch.stopall()
    assert m.device == CUDA1
    # pipeline-inner: rank = dp_rank * 2 + pipe_rank; dp groups first, then pipeline groups
    assert [g[0] for g in groups] == [[0, 2], [1, 3], [0, 1], [2, 3]]
    # no backend given: the groups are NCCL under an NCCL default group (a gloo group on a
    # CUDA rank would be handed CUDA tensors it cannot all-reduce fast, or at all)
    assert all(g[2] is None and g[1] == datetime.timedelta(seconds=7) for g in groups)
    assert (m.pipe_rank, m.dp_rank) == (1, 1) and m.dp_group == "group2"


def test_parameter_server_traffic_uses_a_gloo_group_on_cuda_only():
    with mock.patch.object(dist, "new_group", return_value="gloo-group") as new_group:
        assert wire_group("cpu", 5) is None
        new_group.assert_not_called()
        assert wire_group("cuda", 5) == "gloo-group"
    new_group.assert_called_once_with(backend="gloo", timeout=datetime.timedelta(seconds=5))


# ------------------------------------------------------------------ the executor on a device
def _executor(device, rank: int = 1, precision_name: str = "bf16") -> PipelineExecutor:
    """Pipeline rank ``rank`` of a 2-stage MLP pipeline whose mesh device is ``device`` (the
    world of 2 ranks mocked; the stage module stays on the CPU: no compute here)."""
    cfg = rb.StackConfig(width=8, mbs=2, blocks_per_rank=1)
    b, mods, _ = rb.equal_split(cfg, 2)
    plan = rb.make_plan(b, rb.RunSpec("1f1b", 2, 2), cfg.mbs)
    schedule = schedule_for_plan(plan)
    _, patches = _fake_world(2, rank)
    _enter(patches)
    try:
        m = Mesh(2, 1, device=device)
        return PipelineExecutor(plan, schedule, {rank: mods[rank]}, m, F.mse_loss, None,
                                precision=precision_name)
    finally:
        mock.patch.stopall()


def test_receive_buffers_are_allocated_on_the_rank_device():
    with mock.patch.object(dist, "irecv", return_value=_Work()) as irecv:
        pend = p2p.irecv([3, 4], torch.bfloat16, torch.device("meta"), 0, 7, "x", "ctx", 1.0)
    assert pend.tensor.device.type == "meta" and pend.tensor.dtype == torch.bfloat16
    assert irecv.call_args.args == (pend.tensor, 0) and irecv.call_args.kwargs == {"tag": 7}


def test_executor_receives_activations_and_gradients_on_its_device_in_the_wire_dtype():
    ex = _executor(torch.device("meta"))
    recv_f = next(a for a in ex.schedule.actions[1] if a.op is Op.RECV_F)
    with mock.patch.object(dist, "irecv", return_value=_Work()) as irecv:
        (name, pend), = ex._post_recv(recv_f)
    info = ex.plan.values[name]
    assert pend.tensor.device.type == "meta" and list(pend.tensor.shape) == info.shape
    assert pend.tensor.dtype == torch.bfloat16  # fp32 activations travel in bf16 under bf16
    assert irecv.call_args.args[1] == 0  # from pipeline rank 0's global rank
    back = ex._from_wire(name, pend.tensor)
    assert back.device.type == "meta" and back.dtype == torch.float32
    # rank 0 receives the gradient of the same value from rank 1, also on its device
    ex0 = _executor(torch.device("meta"), rank=0)
    recv_b = next(a for a in ex0.schedule.actions[0] if a.op is Op.RECV_B)
    with mock.patch.object(dist, "irecv", return_value=_Work()):
        (gname, gpend), = ex0._post_recv(recv_b)
    assert gname == name and gpend.tensor.device.type == "meta"


def test_executor_moves_host_batches_to_its_device():
    ex = _executor(torch.device("meta"), rank=0)
    chunks = ex._chunk("x", torch.randn(4, 8))
    assert len(chunks) == 2 and all(c.device.type == "meta" and c.shape == (2, 8)
                                    for c in chunks)


@pytest.mark.parametrize("name,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16),
                                        ("fp32", None)])
def test_executor_autocast_targets_cuda_on_a_cuda_rank(name, dtype):
    ex = _executor(torch.device("cuda", 0), precision_name=name)
    with mock.patch.object(torch, "autocast") as autocast:
        ex._autocast()
    autocast.assert_called_once_with("cuda", dtype=dtype or torch.float32,
                                     enabled=dtype is not None)


def test_planner_timings_autocast_on_cuda_like_a_cuda_rank():
    from fxpipe.partitioner.profile import like_a_rank

    with mock.patch.object(torch, "autocast") as autocast, \
            mock.patch.object(torch, "set_num_threads") as threads:
        with like_a_rank(torch.device("cuda", 0), "bf16"):
            pass
    autocast.assert_called_once_with("cuda", dtype=torch.bfloat16, enabled=True)
    threads.assert_not_called()  # the CPU rank's one-thread rule is not applied to a GPU


def test_loss_scaler_flag_is_reduced_on_the_rank_device():
    seen = []

    def all_reduce(t, op=None, async_op=False):
        seen.append(t)
        raise RuntimeError("stop here: a meta flag has no value to read")
    with mock.patch.object(dist, "all_reduce", side_effect=all_reduce):
        with pytest.raises(RuntimeFailure, match="stop here"):
            precision.found_nonfinite([torch.ones(2)], torch.device("meta"), world_size=2)
    assert seen[0].device.type == "meta"  # NCCL all-reduces CUDA tensors only


# ------------------------------------------------------------------ gradient reducers on CUDA
@pytest.fixture
def fake_group():
    """Two ranks; every collective returns at once, leaving its buffers as they are."""
    calls = []

    def record(name):
        def fn(*args, **kw):
            calls.append((name, [a for a in args if isinstance(a, torch.Tensor)]))
            return _Work()
        return fn
    with mock.patch.object(dist, "get_world_size", return_value=2), \
            mock.patch.object(dist, "all_reduce", side_effect=record("all_reduce")), \
            mock.patch.object(compression, "_ALL_GATHER", side_effect=record("all_gather")):
        yield calls


SHAPES = [torch.Size([16, 8]), torch.Size([8])]


@pytest.mark.parametrize("method", ["none", "bf16", "fp16", "powersgd", "topk"])
@pytest.mark.parametrize("steps", [1, 2])  # PowerSGD's second step starts from its kept Q
def test_gradient_reducers_keep_every_buffer_on_the_gradients_device(method, steps, fake_group):
    """On the meta device (a CPU buffer mixed in fails, as on CUDA): every buffer a collective
    reads or writes, the result and the error memory stay on the gradients' device."""
    comp = Compression(method=method, rank=2, ratio=0.25, warmup_steps=0)
    red = make_reducer(comp, SHAPES, group="dp", divisor=2.0)
    for _ in range(steps):
        flat = torch.randn(16 * 8 + 8, device="meta")
        red.launch(flat)
        red.progress(1.0)
        out = red.result(1.0)
        red.end_step(True)
        assert out.device.type == "meta" and out.shape == flat.shape
        assert out.dtype == flat.dtype
    residual = red.residual()
    for name, tensors in fake_group:
        assert all(t.device.type == "meta" for t in tensors), (method, name)
    assert fake_group, "no collective was launched"
    if method in ("powersgd", "topk"):  # error feedback: kept where the gradients are
        assert residual.device.type == "meta" and residual.shape == flat.shape
    else:
        assert residual is None


def test_backward_in_sequence_times_cuda_nodes_between_stream_events(monkeypatch):
    """``costs: measured`` on CUDA: a node's share of the whole backward is the time between
    events the output hooks record on the stream; the host's clock would time the queueing of
    kernels and put their work on whichever later node waits for the GPU."""
    from fxpipe.partitioner import profile

    class Event:
        recorded = 0

        def __init__(self, enable_timing=False):
            assert enable_timing
            self.ms = None

        def record(self):
            Event.recorded += 1
            self.ms = 0.25 * Event.recorded

        def elapsed_time(self, other):
            return other.ms - self.ms

    monkeypatch.setattr(torch.cuda, "Event", Event)
    first, second = (profile._stamp(torch.device("cuda")) for _ in range(2))
    assert isinstance(first, Event) and Event.recorded == 2
    assert profile._between(first, second) == pytest.approx(0.25e-3)
    t = profile._stamp(torch.device("cpu"))
    assert isinstance(t, float) and profile._between(t, t + 0.5) == pytest.approx(0.5)
