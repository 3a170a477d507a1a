"""Real models as users bring them: transformers classes named in YAML, local pretrained folders,
dict batches, ModelOutput outputs, the model's own loss, graphs that match between planner and
workers, values rebuilt in each stage, and the smaller defects (a stage without parameters, a
changed sequence length, outputs that do not exist) as clean errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fxpipe
from fxpipe.data.batches import as_batch
from fxpipe.errors import PlanError, RuntimeFailure, SpecError, TraceError
from fxpipe.partitioner.split import trace_for_plan
from fxpipe.plans.values import MODEL_INPUT
from fxpipe.specs import build_model, load_spec

try:
    import real_models as zoo
except ImportError:  # tests/ collected as a package
    from tests import real_models as zoo

pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parents[1]


def _run(*args, pythonpath=(), timeout=300):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), *map(str, pythonpath)]),
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env.pop("FXPIPE_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "fxpipe", *args], capture_output=True,
                          text=True, cwd=REPO, env=env, timeout=timeout)


def _plan(name: str, pipeline: int = 2, data: int = 2, microbatches: int = 2, **over):
    """fxpipe's plan under 1F1B, ``over``: ``section__field=value`` spec changes (planned once
    per configuration: real_models.plan)."""
    return zoo.plan(name, pipeline, data, microbatches, "1f1b", **over)


# ------------------------------------------------------------------ models named in YAML
def test_transformers_model_from_yaml_config(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text("model:\n  hf: transformers:GPT2LMHeadModel\n"
                    "  config: {vocab_size: 64, n_positions: 16, n_embd: 16, n_layer: 1, "
                    "n_head: 2}\n")
    model = build_model(load_spec(path))
    assert type(model).__name__ == "GPT2LMHeadModel" and model.config.n_embd == 16
    assert model.config.use_cache is False
    again = build_model(load_spec(path))  # seeded: the same weights on every rank
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))


@pytest.mark.parametrize("model, needle", [
    ("{hf: GPT2LMHeadModl}", "did you mean GPT2LMHeadModel"),
    ("{hf: GPT2LMHeadModel, config: {n_layers: 2}}", "did you mean 'n_layer'"),
    ("{hf: GPT2LMHeadModel, args: {n_layer: 2}}", "model.args goes with model.factory"),
    ("{factory: 'x.y:Z', hf: GPT2LMHeadModel}", "exactly one of model.factory"),
    ("{hf: GPT2LMHeadModel, pretrained: /nowhere/at/all}", "local folder"),
])
def test_bad_transformers_model_is_a_spec_error(tmp_path, model, needle):
    path = tmp_path / "spec.yaml"
    path.write_text(f"model: {model}\n")
    with pytest.raises(SpecError) as e:
        build_model(load_spec(path))
    assert str(e.value).startswith(f"{path}:1: model") and needle in str(e.value), str(e.value)


def test_pretrained_local_folder_loads_its_weights(tmp_path):
    saved = zoo.build("gpt2")
    with torch.no_grad():
        saved.lm_head.weight.mul_(2.0)
    saved.save_pretrained(tmp_path / "ckpt")
    spec = load_spec({"model": {"hf": "GPT2LMHeadModel", "pretrained": str(tmp_path / "ckpt")}})
    loaded = build_model(spec)
    assert torch.equal(loaded.lm_head.weight, saved.lm_head.weight)
    with torch.device("meta"):
        shell = build_model(spec, load_weights=False)  # planning: the config is enough
    assert shell.config.n_embd == saved.config.n_embd


# ------------------------------------------------------------------ batches as users have them
def test_dict_and_pair_batches():
    ids = torch.zeros(4, 3, dtype=torch.long)
    b = as_batch({"input_ids": ids, "labels": ids}, model_loss=True)
    assert b.args == () and set(b.kwargs) == {"input_ids", "labels"} and b.target is None
    b = as_batch({"input_ids": ids, "labels": ids}, model_loss=False)  # labels: the target
    assert set(b.kwargs) == {"input_ids"} and b.target is ids
    b = as_batch(({"input_ids": ids}, ids), model_loss=False)
    assert b.kwargs["input_ids"] is ids and b.target is ids
    assert as_batch((ids, ids), model_loss=False).args == (ids,)
    for raw, needle in [({"input_ids": ids}, "without 'labels'"), ((ids, None), "no target"),
                        ([ids], "not a pair"), ({"x": ids, "labels": ids[:2]}, "first dimensions"),
                        ((ids, "y"), "target")]:
        with pytest.raises(SpecError, match=needle):
            as_batch(raw, model_loss=False)


def test_labels_reach_the_loss_stage_from_the_data_loader():
    plan = _plan("gpt2")
    labels = plan.values["labels"]
    assert labels.producer == MODEL_INPUT and labels.consumers == [plan.num_stages - 1]
    assert plan.input_kwargs == ["input_ids", "attention_mask", "labels"]
    assert plan.values[plan.model_output].shape == []  # the model's own loss, a scalar


def test_model_output_is_chosen_by_name():
    plan = _plan("t5", train__loss="cross_entropy", model__output="logits")
    assert plan.values[plan.model_output].shape[-1] == zoo.V
    with pytest.raises(TraceError, match="'logits', 'encoder_last_hidden_state'.*'nope' is not"):
        _plan("t5", model__output="nope")


# ------------------------------------------------------------------ one graph everywhere
def test_workers_trace_the_planned_graph_with_default_attention():
    plan = _plan("llama")  # sdpa on meta adds `contiguous` nodes: planned on fake CPU tensors
    assert plan.traced_on == "cpu"
    traced = trace_for_plan(plan, zoo.build("llama"))
    planned = set(plan.stage_of_node())
    assert {n.name for n in traced.compute_nodes()} == planned


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_graph_traced_elsewhere_names_the_cause_and_the_fix():
    plan = _plan("llama", cluster__device="cuda")  # no CUDA here: traced on meta
    assert plan.traced_on == "meta"
    with pytest.raises(PlanError) as e:
        trace_for_plan(plan, zoo.build("llama"))
    msg = str(e.value)
    assert "traced on meta" in msg and "contiguous" in msg and "attn_implementation" in msg


def test_shared_values_are_rebuilt_not_sent():
    plan = _plan("llama", 4, 1, 4)
    assert plan.recomputed, "the causal mask and rotary tables are rebuilt in each stage"
    crossing = [v for v in plan.values.values()
                if v.producer >= 0 and any(c != v.producer for c in v.consumers)]
    assert crossing and all(v.dtype != "bool" for v in crossing)  # no mask crosses a cut
    assert not {v.name for v in crossing} & set(plan.recomputed)
    assert any("recomputed in each stage" in line for line in plan.explain)


def test_deep_model_is_planned_as_blocks_and_resolved_on_the_worker():
    from fxpipe.partitioner.blocks import find_block_run

    with torch.device("meta"):
        assert find_block_run(zoo.build("gpt2_deep")).count == 8
        assert find_block_run(zoo.build("gpt2")) is None  # 2 blocks: node by node
    plan = _plan("gpt2_deep", 4, 1, 4)
    assert plan.folded and not any(st.nodes for st in plan.stages)
    assert any("planned as blocks: 8 identical transformer.h.* blocks" in e for e in plan.explain)
    again = fxpipe.Plan.from_dict(plan.to_dict())  # through plan.json
    traced = trace_for_plan(again, zoo.build("gpt2_deep"))
    assert not again.folded and all(st.nodes for st in again.stages)
    assert {n.name for n in traced.compute_nodes()} <= set(again.stage_of_node())
    for st in again.stages[1:]:
        assert st.inputs and all(again.values[n].producer < st.index or
                                 again.values[n].producer == MODEL_INPUT for n in st.inputs)


def test_batchnorm_statistics_are_said_to_be_per_microbatch():
    plan = _plan("resnet")
    assert any("BatchNorm" in line and "each micro-batch" in line
               for line in plan.explain)
    assert "BatchNorm" in plan.summary()


# ------------------------------------------------------------------ smaller defects
def test_changed_sequence_length_is_a_clean_shape_error():
    from fxpipe.runtime.executor import PipelineExecutor
    from fxpipe.schedule.lowering import schedule_for_plan
    from fxpipe.execution.losses import cross_entropy

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10)

        def forward(self, idx):
            return self.head(self.emb(idx))

    spec = {"model": {"factory": "x:y"}, "data": {"batch_size": 2, "seq_len": 6},
            "parallel": {"pipeline": 1, "data": 1, "microbatches": 2}}
    net = Net()
    plan = fxpipe.plan(net, spec, (torch.zeros(1, 6, dtype=torch.long),))
    mesh = type("M", (), dict(pipeline=1, dp=1, rank=0, pipe_rank=0, dp_rank=0, world_size=1,
                              device=torch.device("cpu"), dp_group=None,
                              replica_group=lambda self, key: None,
                              global_rank=lambda self, r, d=None: r))()
    from fxpipe.partitioner.split import materialize_stages

    ex = PipelineExecutor(plan, schedule_for_plan(plan), materialize_stages(plan, net, [0]), mesh,
                          cross_entropy, None)
    idx = torch.zeros(2, 7, dtype=torch.long)
    with pytest.raises(RuntimeFailure, match=r"'idx' is \(7,\) int64 per sample but the plan was "
                                             r"made for \(6,\) int64.*data.seq_len"):
        ex.step({"idx": idx}, torch.zeros(2, 7, dtype=torch.long))


LONE_ACTIVATION = '''
import torch
import fxpipe


class Net(torch.nn.Module):
    """Linear | ReLU alone (no parameter) | Linear: the middle stage has nothing to train."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 8), torch.nn.Linear(8, 5)

    def forward(self, x):
        h = self.a(x)
        fxpipe.pipe_split()
        h = torch.relu(h)
        fxpipe.pipe_split()
        return self.b(h)


class Data:
    def get(self, step, split="train"):
        g = torch.Generator().manual_seed(step)
        return torch.randn(8, 6, generator=g), torch.randint(0, 5, (8,), generator=g)


def data():
    return Data()
'''


@pytest.mark.distributed
def test_stage_without_parameters_trains(tmp_path):
    (tmp_path / "lone.py").write_text(LONE_ACTIVATION)
    spec = tmp_path / "spec.yaml"
    spec.write_text("model: {factory: 'lone:Net'}\ndata: {dataset: 'lone:data', batch_size: 8}\n"
                    "parallel: {pipeline: 3, data: 1, microbatches: 2, schedule: 1f1b}\n"
                    "cluster: {devices_per_node: 3}\n"
                    "train: {steps: 2, optimizer: sgd, lr: 0.1, timeout_s: 60, eval_batches: 1}\n")
    r = _run("run", str(spec), "--out", str(tmp_path / "run"), "--no-report",
             pythonpath=[tmp_path])
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "run" / "eval.json").exists()


@pytest.mark.distributed
def test_transformers_model_trains_through_fxpipe_run(tmp_path):
    """The bundled hf-gpt2 spec: dict batches with padding, the model's own loss, default sdpa
    attention; plan on fake CPU tensors, workers trace the same graph, held-out evaluation of a
    ModelOutput."""
    out = tmp_path / "run"
    r = _run("run", "hf-gpt2", "--steps", "2", "--out", str(out), "--no-report")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "validation loss" in r.stdout and (out / "eval.json").exists()
    assert "recomputed in each stage" in (out / "summary.txt").read_text()


def test_gpt2s_own_loss_runs_under_bf16_autocast():
    """GPT-2's loss casts its logits to float; torch.export records that as a dtype check of the
    float32 trace, which a stage computing in bf16 would fail. fxpipe's trace drops the checks."""
    from fxpipe.partitioner.trace import trace, trace_kwargs

    model = zoo.build("gpt2")
    _, kw, _ = zoo.batch("gpt2", 0)
    kw = {k: v[:2] for k, v in kw.items()}
    tr = trace(model, (), example_kwargs=kw, output="loss")
    assert not [n for n in tr.gm.graph.nodes
                if n.target is torch.ops.aten._assert_tensor_metadata.default]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = tr.gm(**trace_kwargs(model, kw))  # the keywords as traced (use_cache off)
    loss = out[0] if isinstance(out, (tuple, list)) else out
    assert torch.isfinite(loss.float()).all()
