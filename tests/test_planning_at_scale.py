"""Measured and roofline costs, and planning at scale: ops without FLOPs cost their bytes and
launches, ``fxpipe profile`` measures and caches per-node times the planner then uses, deep
models plan as blocks in seconds, the search prunes, recomputes activations where memory runs
out, answers an impossible spec with what would fit, places groups on nodes by their traffic and
gives slower nodes less work."""

from __future__ import annotations

import functools
import time

import pytest
import torch
import torch.nn as nn

import fxpipe
from fxpipe.errors import PlanError
from fxpipe.examples.gpt import CharGPT

try:
    from cli_helpers import fxpipe_in_process
except ImportError:  # collected as a package
    from tests.cli_helpers import fxpipe_in_process


class Probe(nn.Module):
    """4 Linear layers, then 24 LayerNorm + GELU layers (no matmul work at all)."""

    def __init__(self, width: int = 256):
        super().__init__()
        self.lin = nn.ModuleList([nn.Linear(width, width) for _ in range(4)])
        self.norm = nn.ModuleList([nn.LayerNorm(width) for _ in range(24)])

    def forward(self, x):
        for layer in self.lin:
            x = layer(x)
        for norm in self.norm:
            x = torch.nn.functional.gelu(norm(x))
        return x


def _spec(**cluster):
    return {"model": {"factory": "x:y"}, "data": {"batch_size": 64},
            "parallel": {"pipeline": 2, "data": 1, "microbatches": 4},
            "cluster": {"devices_per_node": 2, "device_tflops": 0.02, **cluster},
            "train": {"loss": "mse"}}


def _norms_per_stage(plan) -> list[int]:
    if plan.folded:  # the 24 norms are a run of blocks (each with the parent's GELU as glue)
        assert plan.folded["run"]["path"] == "norm" and plan.folded["run"]["glue"] == 1
        return [plan.folded["blocks"].count(s) for s in range(plan.num_stages)]
    return [sum(1 for n in st.nodes if n.startswith("layer_norm")) for st in plan.stages]


def test_ops_without_flops_are_priced_by_their_bytes_and_launches():
    flops_only = fxpipe.plan(Probe(), _spec(memory_GBps=1e9, op_overhead_us=0, device_tflops=0.1),
                             (torch.randn(16, 256),))
    assert _norms_per_stage(flops_only) == [0, 24]  # FLOPs alone: the norms cost nothing
    roofline = fxpipe.plan(Probe(), _spec(device_tflops=0.1), (torch.randn(16, 256),))
    assert 0 < _norms_per_stage(roofline)[0] < 24  # their bytes and launches count


@pytest.mark.distributed
def test_profile_measures_caches_and_the_planner_uses_it(tmp_path, monkeypatch):
    # `fxpipe profile` and `fxpipe plan` start no workers: run in this process (one thread)
    # the send cost is measured for real between 2 busy gloo ranks, at 2 sizes x 4 messages x 2
    # rounds (as tests/test_send_cost.py does) instead of 7 x 16 x 7: what is under test here is
    # that the profile measures, caches and prints it and the plan uses the cache (its defaults
    # cost about 15 s of CPU on 2 cores)
    from fxpipe.training import profiling

    monkeypatch.setattr(profiling, "measure_send_cost", functools.partial(
        profiling.measure_send_cost, sizes=[1 << 12, 1 << 20], iters=4, rounds=2))
    spec = tmp_path / "spec.yaml"
    spec.write_text("model: {factory: 'fxpipe.examples.gpt:CharGPT', args: {vocab_size: 256, "
                    "block_size: 16, n_layer: 2, n_head: 2, n_embd: 32}}\n"
                    "data: {batch_size: 8, seq_len: 16}\n"
                    "parallel: {pipeline: 2, data: 1, microbatches: 4}\n"
                    "cluster: {devices_per_node: 2, costs: measured}\n")
    r = fxpipe_in_process("profile", spec, "--repeats", "3", FXPIPE_CACHE_DIR=str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "total" in r.stdout and "what one send costs two busy ranks" in r.stdout
    assert "loss cross_entropy on the model output" in r.stdout
    cached = list((tmp_path / "profiles").glob("*.json"))
    assert len(cached) == 3  # the node times, the loss and the send cost
    r = fxpipe_in_process("plan", spec, FXPIPE_CACHE_DIR=str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    files = [f.name for f in (tmp_path / "profiles").glob("*.json")]
    # planned from the cache, and the planned stages timed whole (cluster.measure_stages)
    assert len([f for f in files if not f.startswith("stages-")]) == 3
    assert len([f for f in files if f.startswith("stages-")]) == 1
    assert "cluster.measure_stages" in r.stdout
    assert "loss:         cross_entropy on stage 1" in r.stdout


def test_measured_costs_of_a_meta_model_need_a_profile(tmp_path, monkeypatch):
    monkeypatch.setenv("FXPIPE_CACHE_DIR", str(tmp_path))
    with torch.device("meta"):
        model = Probe()
    with pytest.raises(PlanError, match="fxpipe profile SPEC"):
        fxpipe.plan(model, _spec(costs="measured"), (torch.randn(16, 256, device="meta"),))
    if not torch.cuda.is_available():  # a CUDA spec on this machine: profile where its devices are
        spec = _spec(costs="measured")
        spec["cluster"]["device"] = "cuda"
        with pytest.raises(PlanError, match="on a machine with the spec's devices and copy"):
            fxpipe.plan(model, spec, (torch.randn(16, 256, device="meta"),))


def _all_auto_on_gpus(data: dict, nodes: int) -> dict:
    """Every parallel field auto on ``nodes`` x 8 CUDA devices of 80 GB, 400 TFLOP/s."""
    return {"model": {"factory": "x:y"}, "data": data,
            "parallel": {"pipeline": "auto", "data": "auto", "microbatches": "auto",
                         "schedule": "auto"},
            "cluster": {"nodes": nodes, "devices_per_node": 8, "device": "cuda",
                        "memory_gb": 80, "device_tflops": 400}}


def test_deep_model_plans_as_blocks_in_seconds():
    with torch.device("meta"):
        model = CharGPT(vocab_size=50257, block_size=512, n_layer=48, n_head=16, n_embd=1024)
    spec = _all_auto_on_gpus({"batch_size": 256, "seq_len": 512}, nodes=8)
    # CPU time of this process: a speed bound that other load on the machine cannot break
    t0 = time.process_time()
    plan = fxpipe.plan(model, spec, (torch.zeros(1, 512, dtype=torch.long, device="meta"),))
    took = time.process_time() - t0
    assert plan.folded and len(plan.folded["blocks"]) == 48
    assert plan.pipeline * plan.dp == 64
    assert any("pruned by a lower bound" in e for e in plan.explain)
    assert took < 30, took  # 96 layers x 12288 on 1024 devices: BENCHMARKS.md, plan-scale


def test_a_trillion_parameters_plan_with_tensor_parallelism():
    """The 1T GPT of Narayanan et al. (128 layers x 25,600, 160 heads, vocabulary 51,200,
    sequence 2,048) on 384 nodes of 8 A100-80GB, every field auto: without tensor parallelism
    nothing fits (AdamW's state alone needs 16 TB); with it the search splits each layer over
    the 8 devices of a node, within the README's 30 s."""
    with torch.device("meta"):
        model = CharGPT(vocab_size=51200, block_size=2048, n_layer=128, n_head=160,
                        n_embd=25600)
    spec = _all_auto_on_gpus({"batch_size": 3072, "seq_len": 2048}, nodes=384)
    spec["parallel"]["tensor"] = "auto"
    spec["cluster"].update(device_tflops=312, links={"intra_node_GBps": 300,
                                                     "inter_node_GBps": 25})
    spec["train"] = {"optimizer": "adamw", "precision": "bf16"}
    t0 = time.process_time()
    plan = fxpipe.plan(model, spec, (torch.zeros(1, 2048, dtype=torch.long, device="meta"),))
    took = time.process_time() - t0
    assert plan.tensor == 8 and plan.pipeline * plan.dp * plan.tensor == 3072
    assert plan.tensor_params["h.77.attn.qkv.weight"] == "S(0,3)"
    assert any("tensor 8 chosen" in e for e in plan.explain), plan.explain
    assert max(st.memory_bytes for st in plan.stages) <= 80e9
    assert took < 30, took


class _Residual(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.f = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, hidden), nn.GELU(),
                               nn.Linear(hidden, d))

    def forward(self, x):
        return x + self.f(x)


class _RunThenOthers(nn.Module):
    """Blocks 0..8 identical (the folded run), block 9 wider, blocks 10..13 like the run."""

    def __init__(self, d: int = 32, n: int = 14, odd: int = 9):
        super().__init__()
        self.blocks = nn.ModuleList(_Residual(d, 2 * d if i == odd else d) for i in range(n))
        self.head = nn.Linear(d, 10)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


@pytest.mark.parametrize("pipeline", [2, 3])
def test_a_folded_plan_names_the_blocks_after_the_run_as_the_model_does(pipeline):
    """The run is traced shortened to two blocks, which renumbers the blocks after it; the
    plan must still hold every parameter of the full model once, under its own name."""
    model = _RunThenOthers()
    spec = {"model": {"factory": "x:y"}, "data": {"batch_size": 8},
            "parallel": {"pipeline": pipeline, "data": 1, "microbatches": 2,
                         "schedule": "1f1b"},
            "cluster": {"devices_per_node": pipeline, "device": "cpu"}}
    plan = fxpipe.plan(model, spec, (torch.randn(4, 32),))
    assert plan.folded and plan.folded["run"]["count"] == 9
    held = [n for st in plan.stages for n in st.params]
    assert sorted(held) == sorted(n for n, _ in model.named_parameters())
    assert plan.shared_params == {}
    last = plan.stages[-1]
    assert {"blocks.13.f.3.weight", "head.weight"} <= set(last.params)
    assert "nodes after them" in " ".join(plan.explain)


class _ResidualOutside(nn.Module):
    """``for b in blocks: x = x + b(x)`` (``skip``: ``x = b(x) + previous x``, a value read two
    blocks later)."""

    def __init__(self, d: int = 32, n: int = 12, skip: bool = False):
        super().__init__()
        self.skip = skip
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.GELU(),
                                                  nn.Linear(d, d)) for _ in range(n))
        self.head = nn.Linear(d, 10)

    def forward(self, x):
        prev = x
        for b in self.blocks:
            x, prev = (b(x) + prev, x) if self.skip else (x + b(x), x)
        return self.head(x)


def test_blocks_whose_residual_add_is_the_parents_plan_as_blocks():
    with torch.device("meta"):
        model = _ResidualOutside(d=1024, n=48)
    spec = _all_auto_on_gpus({"batch_size": 512}, nodes=64)
    t0 = time.process_time()
    plan = fxpipe.plan(model, spec, (torch.zeros(1, 1024, device="meta"),))
    assert time.process_time() - t0 < 30
    assert plan.folded["run"] == {"path": "blocks", "start": 0, "count": 48, "glue": 1}
    spec = {"model": {"factory": "x:y"}, "data": {"batch_size": 8},
            "parallel": {"pipeline": 2, "data": 1, "microbatches": 2, "schedule": "1f1b"},
            "cluster": {"devices_per_node": 2, "device": "cpu"}}
    skip = fxpipe.plan(_ResidualOutside(skip=True), spec, (torch.randn(4, 32),))
    assert not skip.folded
    assert any(e.startswith("not planned as blocks: 12 identical blocks.*") for e in skip.explain)


class _Irregular(_ResidualOutside):
    """Repeats for the first two blocks (all the shortened trace sees), then does not."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how

    def forward(self, x):
        seen = [x]
        for i, b in enumerate(self.blocks):
            x = x + b(x)
            if self.how == "late glue" and i == 5:
                x = x * 2  # the parent's code after block 5 only
            if self.how == "late skip" and i >= 2:
                x = x + seen[-2]  # a value of two blocks back, from block 2 on
            seen.append(x)
        return self.head(x + (seen[2] if self.how == "early value" else 0))


@pytest.mark.parametrize("how, why", [
    ("late glue", "the parent's code after block blocks.5 differs"),
    ("late skip", "reads a value of"),
    ("early value", "in the code after the blocks reads a value of"),
])
def test_a_run_that_repeats_only_in_the_shortened_trace_is_planned_node_by_node(how, why):
    """The two traced blocks fold, but the full model does not repeat: checked by running it
    once (a plan made as blocks would fail on every worker when resolved)."""
    spec = {"model": {"factory": "x:y"}, "data": {"batch_size": 8},
            "parallel": {"pipeline": 2, "data": 1, "microbatches": 2, "schedule": "1f1b"},
            "cluster": {"devices_per_node": 2, "device": "cpu"}}
    model = _Irregular(how)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = fxpipe.plan(model, spec, (torch.randn(4, 32),))
    assert not plan.folded and all(st.nodes for st in plan.stages)
    note = next(e for e in plan.explain if e.startswith("not planned as blocks"))
    assert why in note, note
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_a_batch_no_replica_count_divides_names_the_batch_sizes_that_would_work():
    with torch.device("meta"):
        model = CharGPT(vocab_size=256, block_size=64, n_layer=8, n_head=2, n_embd=64)
    spec = _all_auto_on_gpus({"batch_size": 999, "seq_len": 64}, nodes=50)
    x = (torch.zeros(1, 64, dtype=torch.long, device="meta"),)
    with pytest.raises(PlanError) as e:
        fxpipe.plan(model, spec, x)
    text = str(e.value)
    assert "data.batch_size 999 on 400 devices" in text and "pipeline <=" not in text
    good = int(text.split("e.g. data.batch_size ")[1].split(")")[0])
    spec["data"]["batch_size"] = good
    plan = fxpipe.plan(model, spec, x)
    assert plan.pipeline * plan.dp == 400 and good % plan.dp == 0


def test_profiling_for_cuda_without_cuda_is_one_clean_error():
    from fxpipe.training.profiling import profile_spec
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    spec = {"model": {"factory": "fxpipe.examples.gpt:CharGPT",
                      "args": {"vocab_size": 64, "block_size": 16, "n_layer": 1, "n_head": 1,
                               "n_embd": 16}},
            "data": {"batch_size": 4, "seq_len": 16},
            "parallel": {"pipeline": 1, "data": 1, "microbatches": 1, "schedule": "gpipe"},
            "cluster": {"device": "cuda", "devices_per_node": 1, "costs": "measured"}}
    with pytest.raises(PlanError, match="no CUDA device.*cluster.device: cpu"):
        profile_spec(spec, send=False)


def _meta_gpt(n_layer: int) -> tuple[nn.Module, tuple]:
    """A CharGPT of width 256 on the meta device and a micro-batch of 4 x 256 tokens."""
    with torch.device("meta"):
        model = CharGPT(vocab_size=256, block_size=256, n_layer=n_layer, n_head=4, n_embd=256)
    return model, (torch.zeros(4, 256, dtype=torch.long, device="meta"),)


def test_activations_that_do_not_fit_are_recomputed_or_answered_with_what_fits():
    model, x = _meta_gpt(4)
    spec = {"model": {"factory": "x:y"}, "data": {"batch_size": 16, "seq_len": 256},
            "parallel": {"pipeline": 2, "data": 1, "microbatches": 4, "schedule": "gpipe"},
            "cluster": {"devices_per_node": 2, "memory_gb": 0.15}}
    plan = fxpipe.plan(model, spec, x)
    assert all(st.recompute for st in plan.stages) and "recomputation" in " ".join(plan.explain)
    assert all(st.memory_bytes <= 0.15e9 for st in plan.stages)
    spec["train"] = {"activation_recompute": "off"}
    with pytest.raises(PlanError) as e:
        fxpipe.plan(model, spec, x)
    assert "what would fit" in str(e.value) and "activation recomputation" in str(e.value)
    spec["cluster"]["memory_gb"] = 0.001
    with pytest.raises(PlanError, match="at least .* pipeline stages"):
        fxpipe.plan(model, dict(spec, train={}), x)


def test_recomputation_is_chosen_per_stage():
    # 1F1B keeps 2 micro-batches in flight on stage 0 and 1 on stage 1: at 0.06 GB only stage 0
    # must drop its activations; stage 1 keeps them and skips the second forward
    model, x = _meta_gpt(4)
    spec = {"model": {"factory": "x:y"}, "data": {"batch_size": 16, "seq_len": 256},
            "parallel": {"pipeline": 2, "data": 1, "microbatches": 4, "schedule": "1f1b"},
            "cluster": {"devices_per_node": 2, "memory_gb": 0.06}}
    plan = fxpipe.plan(model, spec, x)
    first, last = plan.stages
    assert first.recompute and not last.recompute
    assert all(st.memory_bytes <= 0.06e9 for st in plan.stages)
    # a recomputing stage holds its input per micro-batch in flight, the other everything
    assert 0 < first.activation_bytes < last.activation_bytes
    # priced per stage: only stage 0's backward runs its forward again
    assert first.bwd_input_time_s > first.fwd_time_s
    every = fxpipe.plan(model, dict(spec, train={"activation_recompute": "on"}), x)
    assert all(st.recompute for st in every.stages)
    assert every.stages[1].bwd_input_time_s > last.bwd_input_time_s
    assert plan.predicted.step_time_s < every.predicted.step_time_s
    # (the fewest first blocks that fit, or selective above the ridge point: fewer ops kept,
    # here 1.37 s against partial recomputation's 1.43 s)
    assert first.recompute_mode in ("full", "partial", "selective")
    if first.recompute_mode == "selective":
        assert first.keep_ridge > 0.05e12 / 20e9 * (1 + 1e-9)  # above the ridge point
    name = {"partial": "partial", "full": "activation"}.get(first.recompute_mode, "selective")
    assert any(f"{name} recomputation on stage 0:" in line for line in plan.explain)
    # a roomier device: no stage recomputes
    roomy = fxpipe.plan(model, {**spec, "cluster": {"devices_per_node": 2, "memory_gb": 1}}, x)
    assert not any(st.recompute for st in roomy.stages)


@pytest.mark.parametrize("schedule, pipeline, memory_gb", [
    ("interleaved", 2, 0.065), ("interleaved", 4, 0.1), ("zb-v", 3, 0.1), ("interleaved", 2, 0.04)])
def test_a_rank_that_holds_several_stages_holds_them_all(schedule, pipeline, memory_gb):
    # interleaved and ZB-V put two stages on each rank: the rank's device holds both
    model, x = _meta_gpt(8)
    par = {"pipeline": pipeline, "data": 1, "microbatches": 8, "schedule": schedule}
    if schedule == "interleaved":
        par["virtual_stages"] = 2
    spec = {"model": {"factory": "x:y"}, "data": {"batch_size": 32, "seq_len": 256},
            "parallel": par, "cluster": {"devices_per_node": pipeline, "memory_gb": memory_gb}}
    try:
        plan = fxpipe.plan(model, spec, x)
    except PlanError as e:  # the parameters of two stages alone fill a 40 MB device
        assert memory_gb == 0.04 and "holds stages 0, 2, which need" in str(e)
        return
    from fxpipe.schedule.actions import Op
    from fxpipe.schedule.lowering import schedule_for_plan

    # walk each rank's actions: its stages' static bytes plus, after every F, B and W, the
    # micro-batches in flight on each stage times the stage's bytes per micro-batch
    sched = schedule_for_plan(plan)
    done = Op.W if sched.split_backward else Op.B
    for r in range(pipeline):
        mine = sched.stages_of_rank(r)
        assert len(mine) == 2
        static = sum(plan.stages[j].memory_bytes - plan.predicted.peak_inflight[j]
                     * plan.stages[j].activation_bytes for j in mine)
        held, peak = dict.fromkeys(mine, 0), 0
        for a in sched.actions[r]:
            if a.op is Op.F:
                held[a.stage] += 1
            elif a.op is done:
                held[a.stage] -= 1
            peak = max(peak, sum(n * plan.stages[j].activation_bytes for j, n in held.items()))
        assert static + peak <= memory_gb * 1e9, (r, static, peak)


def test_what_would_fit_asks_for_more_stages_than_were_tried():
    model, x = _meta_gpt(8)
    spec = {"model": {"factory": "x:y"}, "data": {"batch_size": 32, "seq_len": 256},
            "parallel": {"pipeline": 3, "data": 1, "microbatches": 8, "schedule": "gpipe"},
            "cluster": {"devices_per_node": 3, "memory_gb": 0.04}}
    with pytest.raises(PlanError) as e:  # 3 x 40 MB hold the 103 MB of state, not the units
        fxpipe.plan(model, spec, x)
    assert "more than 3 pipeline stages" in str(e.value)
    assert "at least 3 pipeline stages" not in str(e.value)


def _two_node_spec(**cluster):
    return {"model": {"factory": "x:y"}, "data": {"batch_size": 32, "seq_len": 64},
            "parallel": {"pipeline": "auto", "data": "auto", "microbatches": "auto",
                         "schedule": "1f1b"},
            "cluster": {"nodes": 2, "devices_per_node": 4, "device_tflops": 1,
                        "links": {"intra_node_GBps": 100, "inter_node_GBps": 1}, **cluster}}


def test_placement_keeps_the_heavy_traffic_inside_a_node():
    with torch.device("meta"):
        model = CharGPT(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=256)
    plan = fxpipe.plan(model, _two_node_spec(),
                       (torch.zeros(1, 64, dtype=torch.long, device="meta"),))
    note = next(e for e in plan.explain if e.startswith("placement "))
    assert plan.placement in note and "cross nodes" in note
    if plan.pipeline > 1 and plan.dp > 1:  # the all-reduce of the big stage stays inside
        assert plan.placement == "data-inner"


def test_slower_nodes_get_less_work():
    with torch.device("meta"):
        model = Probe()
    spec = _spec(node_tflops=[0.02, 0.005])
    spec["cluster"]["nodes"], spec["cluster"]["devices_per_node"] = 2, 1
    plan = fxpipe.plan(model, spec, (torch.randn(16, 256, device="meta"),))
    same = fxpipe.plan(model, _spec(), (torch.randn(16, 256, device="meta"),))
    assert _norms_per_stage(plan)[1] < _norms_per_stage(same)[1]
    note = next(e for e in plan.explain if e.startswith("placement"))
    assert "sit on nodes 0, 1" in note and "node speeds 0.02, 0.005 TFLOP/s" in note


def test_a_pin_that_cannot_hold_is_not_blamed_on_memory():
    """Pinning the first layer to the last stage fails for the pin, not for memory: the answer
    says so and gives no memory advice (it said 'nothing fits device memory')."""
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    fxpipe.annotate(model[0], stage=1)
    spec = {"model": {"factory": "x:y"}, "data": {"batch_size": 8},
            "parallel": {"pipeline": 2, "data": 1, "microbatches": 2, "schedule": "1f1b"},
            "cluster": {"devices_per_node": 2}}
    with pytest.raises(PlanError) as e:
        fxpipe.plan(model, spec, (torch.randn(4, 64),))
    text = str(e.value)
    assert "pinned to stage 1" in text and "memory" not in text and "what would fit" not in text


class _Marked(nn.Module):
    """10 identical blocks; ``pipe_split()`` after block ``after``, or (None) a head and the
    marker after it."""

    def __init__(self, after):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(10))
        self.head = nn.Linear(64, 8)
        self.after = after

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = torch.relu(layer(x))
            if i == self.after:
                fxpipe.pipe_split()
        if self.after is None:
            x = self.head(x)
            fxpipe.pipe_split()
        return x


@pytest.mark.parametrize("after", [1, None])
def test_the_two_block_trace_warns_only_about_the_model(after):
    """A marker after block 1 is 'after the last computation' of the two blocks traced to fold
    the run, not of the model: no warning (there was one, and the marker was honoured). A
    marker after the model's last computation is still said to be ignored."""
    import warnings
    spec = {"model": {"factory": "x:y"}, "data": {"batch_size": 8},
            "parallel": {"pipeline": 2, "data": 1, "microbatches": 2, "schedule": "1f1b"},
            "cluster": {"devices_per_node": 2}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = fxpipe.plan(_Marked(after), spec, (torch.randn(4, 64),))
    said = [str(w.message) for w in caught if "after the last computation" in str(w.message)]
    if after == 1:
        assert said == [] and "honoured 1 pipe_split() marker" in " ".join(plan.explain)
        assert plan.stages[0].params == ["layers.0.weight", "layers.0.bias",
                                         "layers.1.weight", "layers.1.bias"]
    else:
        assert said, "the ignored marker after the head is not reported"
