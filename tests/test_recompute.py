"""Activation recomputation on one stage (issue 36): the second forward runs once, before B,
from the first one's random-number state, and leaves the buffers as the first forward wrote
them; full and selective recomputation give the gradients of a stage that keeps everything,
under one whole backward and split into B then W, on a stage that sends its output and on
the stage that computes the loss."""

from __future__ import annotations

import contextlib
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpipe
from fxpipe.errors import PlanError, RuntimeFailure, ScheduleError
from fxpipe.execution.selective import keeps_op, ridge_of
from fxpipe.plans.plan import StagePlan
from fxpipe.plans.values import ValueInfo
from fxpipe.runtime.stage import StageWork

try:
    from shared_models import planned_chargpt as _plan
except ImportError:  # tests/ collected as a package
    from tests.shared_models import planned_chargpt as _plan

B, D = 8, 16
#: keeps the linear layers' outputs (FLOPs per byte = input width / 2 in fp32 = 8)
RIDGE = 4.0


class Noisy(nn.Module):
    """Linear -> BatchNorm -> dropout -> GELU -> LayerNorm -> linear; counts its forwards."""

    def __init__(self):
        super().__init__()
        self.a, self.bn, self.ln, self.b = nn.Linear(D, D), nn.BatchNorm1d(D), nn.LayerNorm(D), \
            nn.Linear(D, D)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = F.gelu(F.dropout(self.bn(self.a(x)), 0.3, training=True))
        return (self.b(self.ln(h)),)


class WritesInPlace(nn.Module):
    """Linear layers whose outputs are written in place afterwards: ``nn.ReLU(inplace=True)``
    and a write through a view; counts its forwards."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.act = nn.Linear(D, D), nn.Linear(D, D), nn.ReLU(inplace=True)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = self.a(x)
        h.view(-1)[::3].mul_(2.0)
        return (self.act(self.b(self.act(h))),)


def _stage(mode: str, split: bool, loss: bool, make=Noisy) -> tuple[StageWork, nn.Module]:
    torch.manual_seed(0)
    mod = make()
    sp = StagePlan(index=0, nodes=[], params=[], buffers=[], inputs=["x"], outputs=["y"],
                   fwd_flops=0, bwd_flops=0, bwd_weight_flops=0, param_bytes=0,
                   activation_bytes=0, recv_bytes=0, send_bytes=0, compute_time_s=0,
                   comm_time_s=0, time_s=0, memory_bytes=0,
                   recompute=mode in ("full", "selective"),
                   keep_ridge=RIDGE if mode == "selective" else None,
                   offload_bytes=1 if mode == "offload" else 0)
    values = {"y": ValueInfo("y", 0, [] if loss else [1], [B, D], "float32", B * D * 4)}
    work = StageWork(sp, mod, values, {} if loss else {"y": [1]}, split,
                     contextlib.nullcontext, lambda i: f"micro-batch {i}",
                     loss_input="y" if loss else None)
    return work, mod


def _send(work: StageWork, i: int, name: str = "y") -> weakref.ref:
    """Send output ``name`` of micro-batch ``i`` as the executor does (the send keeps a
    detached alias, here dropped at once: a send completed and reaped) and let the stage
    release it; a weak reference to the output's storage."""
    alias = work.output(i, name).detach()
    storage = weakref.ref(alias.untyped_storage())
    work.sent(i, name)
    with pytest.raises(ScheduleError, match="sent to each of its 1 consumer stages already"):
        work.output(i, name)
    return storage


def _backward_all(work: StageWork, loss: bool, split: bool) -> list[torch.Tensor]:
    """B (and W under ``split``) of micro-batches 0..2, each output's gradient 0.1 x (i + 1)
    where the stage sends it; the input gradients."""
    in_grads = []
    for i in range(3):
        if not loss:
            work.add_output_grad(i, "y", torch.full((B, D), 0.1 * (i + 1)))
        in_grads.append(work.backward(i)[0][1])
        if split:
            work.weight(i)
    return in_grads


def _run(mode: str, split: bool, loss: bool, make=Noisy, release: bool = False):
    """Three micro-batches through one stage; ``release``: its output is sent after each
    forward and the stage keeps only its graph (``StageWork.sent``)."""
    work, mod = _stage(mode, split, loss, make)
    if release:
        work.release_after = {"y": 1}
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(B, D, generator=g).requires_grad_() for _ in range(3)]
    target = torch.randn(B, D, generator=g)
    torch.manual_seed(7)
    storages = []
    for i, x in enumerate(xs):
        work.forward(i, [x], F.mse_loss if loss else None, target if loss else None)
        if release:
            storages.append(_send(work, i))
    after_forwards = mod.calls
    held = [r() is not None for r in storages]  # after the sends, before the backward
    in_grads = _backward_all(work, loss, split)
    moved = (work.offload.out_bytes, work.offload.in_bytes) if work.offload else (0, 0)
    return dict(calls=(after_forwards, mod.calls), in_grads=in_grads, moved=moved, held=held,
                grads=[p.grad.clone() for p in mod.parameters()],
                buffers=[b.clone() for b in mod.buffers()], rng=torch.get_rng_state())


@pytest.mark.parametrize("loss", [False, True], ids=["sends", "loss"])
@pytest.mark.parametrize("split", [False, True], ids=["whole", "b-w"])
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recomputing_stage_equals_keeping_everything(mode, split, loss):
    ref, got = _run("off", split, loss), _run(mode, split, loss, release=not loss)
    assert ref["calls"] == (3, 3)
    assert got["calls"] == (3, 6), "one forward again per micro-batch, B and W included"
    # the same ops on the same values in the same order: equal to the last bit
    for a, b in zip(ref["in_grads"] + ref["grads"], got["in_grads"] + got["grads"]):
        assert torch.equal(a, b)
    for a, b in zip(ref["buffers"], got["buffers"]):  # running statistics updated once
        assert torch.equal(a, b)
    assert torch.equal(ref["rng"], got["rng"]), "the replay leaves the caller's RNG stream"


@pytest.mark.parametrize("loss", [False, True], ids=["sends", "loss"])
@pytest.mark.parametrize("split", [False, True], ids=["whole", "b-w"])
def test_offloading_stage_equals_keeping_everything(split, loss):
    """Activation offload: what autograd saves goes to host memory and comes back for the
    backward, unchanged (bit-equal), the forward run once; under a split backward W fetches
    what it reads again."""
    ref, got = _run("off", split, loss), _run("offload", split, loss, release=not loss)
    assert got["calls"] == (3, 3)
    assert not any(got["held"]), "the sent output's storage is freed once the send is done"
    for a, b in zip(ref["in_grads"] + ref["grads"] + ref["buffers"],
                    got["in_grads"] + got["grads"] + got["buffers"]):
        assert torch.equal(a, b)
    out, back = got["moved"]
    assert out > 0 and (back == out if not split else out < back <= 2 * out)


@pytest.mark.parametrize("split", [False, True], ids=["whole", "b-w"])
@pytest.mark.parametrize("mode", ["off", "full", "selective"])
def test_a_sent_output_is_released_and_b_runs_from_its_graph(mode, split):
    """Once sent, the stage holds no reference to its output's data (Megatron-LM's
    deallocate_output_tensor): with the send's alias gone the storage is freed, except under
    selective recomputation, whose cache keeps the last linear layer's output (the plan counts
    it among the kept bytes). B starts from the output's graph edge: bit-equal gradients,
    whole and split; a gradient of another shape than the plan's is refused by name."""
    ref, got = _run("off", split, False), _run(mode, split, False, release=True)
    assert got["held"] == [mode == "selective"] * 3
    for a, b in zip(ref["in_grads"] + ref["grads"] + ref["buffers"],
                    got["in_grads"] + got["grads"] + got["buffers"]):
        assert torch.equal(a, b)
    work, _ = _stage(mode, split, False)
    work.release_after = {"y": 1}
    work.forward(0, [torch.randn(B, D).requires_grad_()])
    _send(work, 0)
    with pytest.raises(RuntimeFailure, match=r"the gradient of 'y' is \(8, 8\) torch.float32 "
                                             r"but the plan says \(8, 16\) float32"):
        work.add_output_grad(0, "y", torch.ones(B, B))


class WritesSavedOutput(nn.Module):
    """A sigmoid's output (which its backward reads) written in place afterwards: plain
    PyTorch refuses the backward."""

    def __init__(self):
        super().__init__()
        self.a, self.calls = nn.Linear(D, D), 0

    def forward(self, x):
        self.calls += 1
        h = torch.sigmoid(self.a(x))
        h.mul_(2.0)
        return (h,)


@pytest.mark.parametrize("mode", ["off", "offload"])
def test_an_in_place_write_autograd_refuses_is_refused_under_offload_too(mode):
    """Offload moves the sigmoid's saved output to the host before the write: its backward
    still fails with autograd's message rather than training on the unwritten copy."""
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _run(mode, False, False, WritesSavedOutput)


@pytest.mark.parametrize("split", [False, True], ids=["whole", "b-w"])
def test_selective_keeps_what_an_op_wrote_over_in_place_as_it_was(split):
    """A kept linear output that a later op writes in place (in-place ReLU, a write through a
    view): the recomputation reads the value the linear layer produced, not the written one."""
    ref, got = _run("off", split, False, WritesInPlace), _run("selective", split, False,
                                                                WritesInPlace)
    assert got["calls"] == (3, 6)
    for a, b in zip(ref["in_grads"] + ref["grads"], got["in_grads"] + got["grads"]):
        assert torch.equal(a, b)


def test_the_rule_reads_autocast_outputs_at_the_width_the_plan_priced():
    """Under bf16 autocast a matmul's output is half the bytes of the float32 trace the planner
    priced: the rule counts it at float32 width, so a matmul just under the ridge in fp32
    bytes (FLOPs per byte K/2 = 32) is recomputed at run time too, and one over it kept."""
    k = 64
    a, b = torch.randn(8, k), torch.randn(k, 16)
    mm = torch.ops.aten.mm.default
    for ridge, kept in ((0.75 * k, False), (0.25 * k, True)):
        assert keeps_op(mm, (a, b), {}, mm(a, b), ridge) is kept
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = torch.mm(a, b)
            assert out.dtype == torch.bfloat16
            assert keeps_op(mm, (a.bfloat16(), b.bfloat16()), {}, out, ridge) is kept
        # a model in bf16 itself (no autocast) is traced in bf16: its own bytes
        assert keeps_op(mm, (a.bfloat16(), b.bfloat16()), {}, out, 0.75 * k) is True


def test_selective_rule_keeps_matmuls_and_recomputes_the_rest():
    """The rule of :mod:`fxpipe.execution.selective`: FLOPs per output byte against the
    ridge point. A linear layer of input width w (fp32) has w / 2 FLOPs per output byte, an
    attention score matrix ``q @ k^T`` head dimension / 2; element-wise ops none."""
    aten = torch.ops.aten
    x, w = torch.randn(64, 512), torch.randn(512, 512)
    out = x @ w
    assert keeps_op(aten.mm.default, (x, w), {}, out, ridge=200.0)  # 256 FLOP/byte
    assert not keeps_op(aten.mm.default, (x, w), {}, out, ridge=300.0)
    q = torch.randn(4, 128, 64)
    scores = torch.bmm(q, q.transpose(1, 2))
    a100 = ridge_of(312e12, 2.039e12)  # ~153 FLOP/byte
    assert not keeps_op(aten.bmm.default, (q, q.transpose(1, 2)), {}, scores, a100)
    assert not keeps_op(aten.gelu.default, (out,), {}, F.gelu(out), ridge=0.0)
    with pytest.raises(ValueError, match="must be > 0"):
        ridge_of(0.0, 1e9)


def test_planner_prices_selective_between_none_and_full_and_auto_weighs_it():
    """Selective recomputation keeps the matmuls' outputs: less memory per micro-batch than
    keeping everything, a shorter backward than full recomputation (only the element-wise
    ops, norms and the like run again). On a device where the balanced cut does not fit
    without recomputation, ``auto`` weighs selective against the cut that fits without it
    and recomputes selectively where that is faster, and says so."""
    roomy = {m: _plan(m, 16.0) for m in ("off", "selective", "full")}
    for j in range(2):
        off, sel, full = (roomy[m].stages[j] for m in ("off", "selective", "full"))
        assert (off.recompute_mode, sel.recompute_mode, full.recompute_mode) == \
            ("off", "selective", "full")
        assert sel.keep_ridge == pytest.approx(0.05e12 / 20e9) and full.keep_ridge is None
        assert full.activation_bytes < sel.activation_bytes < off.activation_bytes
        assert off.bwd_input_time_s < sel.bwd_input_time_s < full.bwd_input_time_s
        assert sel.fwd_time_s == off.fwd_time_s == full.fwd_time_s
    steps = {m: p.predicted.step_time_s for m, p in roomy.items()}
    assert steps["off"] < steps["selective"] < steps["full"]
    assert _plan("auto", 16.0).predicted.step_time_s == steps["off"]  # it fits: nothing
    tight = _plan("auto", 0.021)
    assert "selective" in [st.recompute_mode for st in tight.stages]
    forced = {}
    for m in ("off", "selective", "full"):
        try:
            forced[m] = _plan(m, 0.021).predicted.step_time_s
        except PlanError:  # keeping everything does not fit
            assert m == "off"
    assert tight.predicted.step_time_s <= min(forced.values())
    assert any(line.startswith("selective recomputation on stage") for line in tight.explain)


@pytest.mark.parametrize("memory_gb", [0.018, 0.015])
def test_auto_weighs_the_full_cut_against_the_selective_one(memory_gb):
    """Where nothing fits without recomputation, the selective cut keeps more bytes per stage
    and may have to be less balanced than the full one: ``auto`` is no slower than either
    forced, and where it recomputes selectively it says what the same cut would take with
    full recomputation there."""
    auto = _plan("auto", memory_gb)
    forced = []
    for m in ("selective", "full"):
        try:
            forced.append(_plan(m, memory_gb).predicted.step_time_s)
        except Exception as e:  # a forced mode that does not fit says what would
            assert "full activation recomputation fits" in str(e)
    assert forced and auto.predicted.step_time_s <= min(forced) * (1 + 1e-9)
    n_sel = [st.recompute_mode for st in auto.stages].count("selective")
    lines = [x for x in auto.explain if x.startswith("selective recomputation chosen on")]
    assert len(lines) == (1 if n_sel else 0)
    if n_sel:
        full_ms = float(lines[0].split("would take ")[1].split(" ms")[0].replace(",", ""))
        assert full_ms > auto.predicted.step_time_s * 1e3


def test_recompute_accepts_yaml_booleans():
    """YAML 1.1 reads unquoted ``on`` / ``off`` as booleans: they mean on and off."""
    import yaml

    from fxpipe.specs.schema import TrainSpec

    for text, want in (("off", "off"), ("on", "on"), ("false", "off"), ('"full"', "full")):
        got = TrainSpec(**yaml.safe_load(f"activation_recompute: {text}"))
        assert got.activation_recompute == want


def test_selective_on_a_model_without_matmuls_says_it_recomputes_everything():
    """A policy that keeps nothing: element-wise ops only, so selective recomputation is full
    recomputation; the plan says so in one line, and prices it as full."""
    import fxpipe

    class Elementwise(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(D))
            self.norm = nn.LayerNorm(D)

        def forward(self, x):
            for _ in range(4):
                x = torch.tanh(self.norm(x) * self.scale) + x
            return x

    spec = {"model": {"factory": "x:y"}, "data": {"batch_size": 8, "seq_len": 1},
            "parallel": {"pipeline": 1, "data": 1, "microbatches": 2, "schedule": "1f1b"},
            "cluster": {"nodes": 1, "devices_per_node": 1},
            "train": {"loss": "mse", "activation_recompute": "selective"}}
    x = torch.randn(4, D)
    sel = fxpipe.plan(Elementwise(), spec, x)
    full = fxpipe.plan(Elementwise(), dict(spec, train={"loss": "mse",
                                                        "activation_recompute": "full"}), x)
    lines = [line for line in sel.explain if "keeps no op's outputs" in line]
    assert len(lines) == 1 and "stage 0" in lines[0]
    assert sel.stages[0].bwd_input_time_s == pytest.approx(full.stages[0].bwd_input_time_s)
    assert sel.stages[0].activation_bytes == full.stages[0].activation_bytes


def test_gpt3_on_1024_a100s_picks_selective_recomputation_and_says_what_full_costs():
    """The issue's case: GPT-3 175B as Megatron-LM trained it (attention written out, dropout
    0.1, sequence 2,048, bf16) on 1,024 A100-80GB, every layout field ``auto``: the attention
    scores, softmax and dropout masks are what fill the memory and cost few FLOPs, so the plan
    recomputes selectively and says how much longer full recomputation would take."""
    import fxpipe
    from fxpipe.examples.gpt import CharGPT

    shape = dict(vocab_size=51200, block_size=2048, n_head=96, n_embd=12288, n_layer=96,
                 dropout=0.1, fused_attention=False)
    with torch.device("meta"):
        model = CharGPT(**shape)
    auto = {k: "auto" for k in ("pipeline", "data", "tensor", "microbatches", "schedule",
                                "data_sharding")}
    spec = {"model": {"factory": "fxpipe.examples.gpt:CharGPT", "args": shape},
            "data": {"batch_size": 1536, "seq_len": 2048}, "parallel": auto,
            "cluster": {"nodes": 128, "devices_per_node": 8, "gpu": "A100-80GB",
                        "attention": "math"},
            "train": {"optimizer": "adamw", "precision": "bf16"}}
    plan = fxpipe.plan(model, spec, torch.zeros(1, 2048, dtype=torch.long, device="meta"))
    modes = [st.recompute_mode for st in plan.stages]
    assert modes.count("selective") > len(modes) // 2 and "off" not in modes[:2], modes
    line = next(x for x in plan.explain if x.startswith("selective recomputation chosen"))
    full_ms = float(line.split("would take ")[1].split(" ms")[0].replace(",", ""))
    assert full_ms > plan.predicted.step_time_s * 1e3


def _offload_plan(recompute: str, offload: str, memory_gb: float, host_GBps: float = 20.0,
                  host_memory_gb: float = 1.0, schedule: str = "1f1b", device: str = "cpu"):
    import fxpipe
    from fxpipe.examples.gpt import CharGPT

    torch.manual_seed(0)
    model = CharGPT(n_layer=4, n_embd=128, n_head=4, block_size=128)
    spec = {"model": {"factory": "fxpipe.examples.gpt:CharGPT"},
            "data": {"batch_size": 32, "seq_len": 128},
            "parallel": {"pipeline": 2, "data": 1, "microbatches": 8, "schedule": schedule},
            "cluster": {"nodes": 1, "devices_per_node": 2, "memory_gb": memory_gb,
                        "device": device, "device_tflops": 0.05, "memory_GBps": 20.0,
                        "host_memory_gb": host_memory_gb, "links": {"host_GBps": host_GBps}},
            "train": {"activation_recompute": recompute, "activation_offload": offload}}
    return fxpipe.plan(model, spec, torch.randint(0, 256, (4, 128)))


@pytest.mark.parametrize("schedule", ["1f1b", "zb-v"])
def test_offload_is_priced_at_the_host_link(schedule):
    """An offloading stage keeps only its inputs on the device; the bytes its backward reads
    cross the host link out after F and back before B (and again before W under a split
    backward), priced at ``links.host_GBps`` in the stage's times."""
    keep = _offload_plan("off", "off", 16.0, schedule=schedule)
    off = _offload_plan("off", "on", 16.0, schedule=schedule)
    host = 20e9
    moves_w = 1 if schedule == "zb-v" else 0
    same = 0
    for a, b in zip(keep.stages, off.stages):
        assert b.offload_bytes > 0 and b.recompute_mode == "off"
        assert b.activation_bytes < a.activation_bytes  # the stage's inputs only
        if a.nodes == b.nodes:  # the same cut: what goes out is what the stage kept (its
            same += 1  # outputs, held until B either way, aside)
            outs = sum(keep.values[o].nbytes for o in a.outputs if keep.values[o].consumers)
            assert b.offload_bytes == a.activation_bytes - outs
            t = b.offload_bytes / host
            assert b.fwd_time_s == pytest.approx(a.fwd_time_s + t, rel=1e-9)
            assert b.bwd_input_time_s == pytest.approx(a.bwd_input_time_s + t, rel=1e-9)
            assert b.bwd_weight_time_s == pytest.approx(a.bwd_weight_time_s + moves_w * t,
                                                        rel=1e-9)
    assert same, "no stage cut alike with and without offload: nothing compared"
    assert off.predicted.step_time_s > keep.predicted.step_time_s
    assert any(line.startswith("activation offload on every stage") for line in off.explain)


def test_auto_offloads_where_the_host_link_beats_recomputation():
    """Where the activations do not fit: over a fast host link auto offloads (and says what
    full recomputation of the same cut would take); over a slow one it recomputes."""
    fast = _offload_plan("auto", "auto", 0.018, host_GBps=200.0, device="cuda")
    assert any(st.offload_bytes for st in fast.stages)
    line = next(x for x in fast.explain if x.startswith("activation offload chosen on"))
    full_ms = float(line.split("would take ")[1].split(" ms")[0].replace(",", ""))
    assert full_ms > fast.predicted.step_time_s * 1e3
    slow = _offload_plan("auto", "auto", 0.018, host_GBps=0.01, device="cuda")
    # on a CPU host and device memory are one: auto does not offload there
    assert not any(st.offload_bytes for st in _offload_plan(
        "auto", "auto", 0.018, host_GBps=200.0).stages)
    assert not any(st.offload_bytes for st in slow.stages)
    assert any(st.recompute for st in slow.stages)


def test_offload_bad_input_says_what_is_missing():
    """Offload without host memory, offload and forced recomputation together, and host
    memory too small for what would go there: one clear line each."""
    from fxpipe.errors import PlanError, SpecError
    from fxpipe.specs.loader import load_spec

    base = {"model": {"factory": "a:b"}, "cluster": {"nodes": 1, "devices_per_node": 1}}
    with pytest.raises(SpecError, match="needs cluster.host_memory_gb"):
        load_spec({**base, "train": {"activation_offload": "on"}})
    with pytest.raises(SpecError, match="a stage either offloads them or recomputes them"):
        load_spec({**base, "cluster": {"host_memory_gb": 64.0},
                   "train": {"activation_offload": "on", "activation_recompute": "full"}})
    with pytest.raises(PlanError, match="activation offload: rank 0 holds .* host memory") as e:
        _offload_plan("off", "on", 16.0, host_memory_gb=0.001)
    assert "more host memory for the offloaded activations" in str(e.value)


# ----------------------------------------------------------------------------- partial
class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.a, self.b = nn.LayerNorm(D), nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        return x + self.b(F.dropout(F.gelu(self.a(self.ln(x))), 0.2, training=True))


class _Blocks(nn.Module):
    """A linear layer, three blocks (dropout in each), a final linear layer."""

    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(D, D), nn.Linear(D, D)
        self.h = nn.ModuleList(_Block() for _ in range(3))

    def forward(self, x):
        x = self.inp(x)
        for blk in self.h:
            x = blk(x)
        return self.out(x)


def _run_blocks(blocks: int | None, split: bool, loss: bool, release: bool = False):
    """Three micro-batches through the traced :class:`_Blocks` as one stage, keeping
    everything (``blocks`` None) or recomputing its first ``blocks`` blocks."""
    from fxpipe.partitioner.trace import trace

    torch.manual_seed(0)
    gm = trace(_Blocks(), (torch.zeros(B, D),)).gm
    inputs = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    sp = StagePlan(index=0, nodes=[], params=[], buffers=[], inputs=inputs, outputs=["y"],
                   fwd_flops=0, bwd_flops=0, bwd_weight_flops=0, param_bytes=0,
                   activation_bytes=0, recv_bytes=0, send_bytes=0, compute_time_s=0,
                   comm_time_s=0, time_s=0, memory_bytes=0, recompute=blocks is not None,
                   recompute_blocks=blocks or 0)
    values = {"y": ValueInfo("y", 0, [] if loss else [1], [B, D], "float32", B * D * 4)}
    work = StageWork(sp, gm, values, {} if loss else {"y": [1]}, split,
                     contextlib.nullcontext, lambda i: f"micro-batch {i}",
                     loss_input="y" if loss else None)
    if release:
        work.release_after = {"y": 1}
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(B, D, generator=g).requires_grad_() for _ in range(3)]
    target = torch.randn(B, D, generator=g)
    torch.manual_seed(7)
    for i, x in enumerate(xs):
        work.forward(i, [x], F.mse_loss if loss else None, target if loss else None)
        if release:  # the send done: nothing else holds the output's storage
            assert _send(work, i)() is None
    in_grads = _backward_all(work, loss, split)
    return dict(in_grads=in_grads, grads={n: p.grad.clone() for n, p in gm.named_parameters()},
                rng=torch.get_rng_state(), work=work, gm=gm)


@pytest.mark.parametrize("loss", [False, True], ids=["sends", "loss"])
@pytest.mark.parametrize("split", [False, True], ids=["whole", "b-w"])
def test_partial_recomputation_equals_keeping_everything(split, loss):
    """The first block (with the layer before it) recomputes, the other two keep their
    activations: the head runs again once before B from the first forward's random-number
    state (its dropout masks repeat), the tail's backward feeds the head's; the gradients
    are a stage's that keeps everything, to the last bit (the same ops on the same values);
    the two halves hold the stage's own Parameter objects under the stage's names. With 3
    or more blocks the head runs through the last block (the final layer kept)."""
    ref = _run_blocks(None, split, loss)
    for blocks in (1, 3):
        got = _run_blocks(blocks, split, loss, release=not loss)
        for a, b in zip(ref["in_grads"], got["in_grads"]):
            assert torch.equal(a, b)
        assert ref["grads"].keys() == got["grads"].keys()
        for n, a in ref["grads"].items():
            assert torch.equal(a, got["grads"][n]), n
        assert torch.equal(ref["rng"], got["rng"])
        part = got["work"].partial
        head = dict(part.head.named_parameters())
        tail = dict(part.tail.named_parameters())
        mine = dict(got["gm"].named_parameters())
        assert not head.keys() & tail.keys() and head.keys() | tail.keys() == mine.keys()
        assert all(p is mine[n] for n, p in [*head.items(), *tail.items()])
        assert ("h.1.a.weight" in head) == (blocks == 3) and "out.weight" in tail


def _gpt_spec(**train) -> dict:
    return {"model": {"factory": "fxpipe.examples.gpt:CharGPT",
                      "args": {"n_layer": 4, "n_embd": 32, "n_head": 2, "block_size": 16}},
            "data": {"batch_size": 8, "seq_len": 16},
            "parallel": {"pipeline": 2, "data": 1, "microbatches": 4, "schedule": "1f1b"},
            "cluster": {"nodes": 1, "devices_per_node": 2}, "train": train}


def test_recompute_layers_plans_partial_stages_and_keeps_them_in_the_plan(tmp_path):
    """``recompute_layers: 1`` under full recomputation: each stage (CharGPT's 4 blocks,
    h.2 shared by the cut) recomputes its first block: less activation memory than keeping everything, more than
    full recomputation; B runs the head's forward again (more than none, less than full);
    the plan says so and its JSON keeps ``recompute_blocks``."""
    from fxpipe.examples.gpt import CharGPT
    from fxpipe.plans.param_blocks import block_of
    from fxpipe.plans.plan import Plan

    plans = {}
    for label, train in (("off", {"activation_recompute": "off"}),
                         ("full", {"activation_recompute": "full"}),
                         ("partial", {"activation_recompute": "full", "recompute_layers": 1}),
                         ("more", {"activation_recompute": "full", "recompute_layers": 2})):
        torch.manual_seed(0)
        model = CharGPT(n_layer=4, n_embd=32, n_head=2, block_size=16)
        plans[label] = fxpipe.plan(model, _gpt_spec(**train), torch.zeros(2, 16, dtype=torch.long))
    off, full, part, more = (plans[k] for k in ("off", "full", "partial", "more"))
    assert [st.recompute_mode for st in part.stages] == ["partial"] * 2
    assert [st.recompute_blocks for st in part.stages] == [1, 1]
    # a stage with N blocks or fewer recomputes whole (the cut shares block h.2)
    held = [len({block_of(p) for p in st.params} - {None}) for st in more.stages]
    assert [st.recompute_blocks for st in more.stages] == [2 if n > 2 else 0 for n in held]
    assert 0 in [st.recompute_blocks for st in more.stages]
    for a, b, c in zip(off.stages, part.stages, full.stages):
        assert c.activation_bytes < b.activation_bytes < a.activation_bytes
        assert a.bwd_input_time_s < b.bwd_input_time_s < c.bwd_input_time_s
        assert b.fwd_time_s == a.fwd_time_s
    assert any("partial recomputation on every stage" in e and "stage 0: 1 of 3" in e
               for e in part.explain), part.explain
    part.save(tmp_path / "p.json")
    assert [st.recompute_blocks for st in Plan.load(tmp_path / "p.json").stages] == [1, 1]


def test_recompute_layers_bad_input_is_one_clear_line():
    """recompute_layers with recomputation off or selective is a spec error naming the key;
    on a model without blocks a spec error saying so (file:line where the spec has one:
    tests/test_lever_explanations.py)."""
    from fxpipe.errors import SpecError
    from fxpipe.specs.loader import load_spec

    for mode in ("off", "selective"):
        with pytest.raises(SpecError, match=rf"recompute_layers.*activation_recompute is {mode}"):
            load_spec(_gpt_spec(activation_recompute=mode, recompute_layers=1))
    spec = _gpt_spec(activation_recompute="full", recompute_layers=1)
    spec["model"] = {"factory": "x:y"}
    spec["parallel"]["pipeline"], spec["cluster"]["devices_per_node"] = 1, 1
    with pytest.raises(SpecError, match="recompute_layers: 1 counts blocks.*has none"):
        fxpipe.plan(Noisy(), spec, torch.zeros(2, D))
