"""Specs: loading (file, bundled name, dict), safe YAML, error messages with FILE:LINE and key
paths, callable references and model building."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from fxpipe.errors import FxpipeError, SpecError
from fxpipe.specs import (
    ParallelSpec,
    build_model,
    list_bundled_specs,
    load_spec,
    resolve_callable,
    spec_location,
)
from fxpipe.specs.messages import describe
from fxpipe.specs.schema import SCHEDULES, V_SCHEDULES, ParallelSpec_

BASE = """\
model:
  factory: "fxpipe.examples.gpt:CharGPT"
  args: {vocab_size: 256, block_size: 16, n_layer: 1, n_head: 2, n_embd: 16}
data:
  batch_size: 16
  seq_len: 16
parallel:
  pipeline: 2
  data: 2
  microbatches: 4
  schedule: 1f1b
  virtual_stages: 1
cluster:
  nodes: 1
  devices_per_node: 4
train:
  lr: 1.0e-3
  seed: 3
"""


def write(tmp_path: Path, text: str, name: str = "spec.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def variant(tmp_path: Path, old: str, new: str) -> tuple[Path, int]:
    """BASE with the line holding ``old`` replaced by ``new``; returns (path, 1-based line)."""
    lines = BASE.splitlines()
    idx = next(i for i, line in enumerate(lines) if old in line)
    lines[idx] = lines[idx].replace(old, new)
    return write(tmp_path, "\n".join(lines) + "\n"), idx + 1


def spec_error(source) -> str:
    with pytest.raises(SpecError) as info:
        load_spec(source)
    return str(info.value)


# ---------------------------------------------------------------- bundled specs, inputs


def test_bundled_specs_all_load():
    names = list_bundled_specs()
    assert {"gpt-char", "cnn-skip", "gpt-auto"} <= set(names)
    for name in names:
        spec = load_spec(name)
        assert isinstance(spec, ParallelSpec)
        par = spec.parallel
        if isinstance(par.pipeline, int) and isinstance(par.data, int):
            assert par.pipeline * par.data == spec.cluster.world_size


def test_gpt_char_values_and_name_forms():
    spec = load_spec("gpt-char")
    assert (spec.parallel.pipeline, spec.parallel.data, spec.parallel.microbatches) == (2, 2, 4)
    assert spec.parallel.schedule == "1f1b" and spec.cluster.world_size == 4
    assert spec.model.factory == "fxpipe.examples.gpt:CharGPT"
    assert load_spec("gpt-char.yaml") == spec
    path = Path(spec_location(spec).rsplit(":", 1)[0])
    assert load_spec(path) == spec and load_spec(str(path)) == spec


def test_gpt_auto_leaves_layout_to_planner():
    par = load_spec("gpt-auto").parallel
    assert (par.pipeline, par.data, par.microbatches, par.schedule) == ("auto",) * 4
    assert load_spec("gpt-auto").cluster.world_size == 4


def test_unknown_name_lists_bundled_specs():
    msg = spec_error("gpt-chr")
    assert "did you mean the bundled spec 'gpt-char'" in msg.lower()
    assert "cnn-skip" in msg and "gpt-auto" in msg


def test_dict_input_equals_yaml(tmp_path):
    import yaml

    from_yaml = load_spec(write(tmp_path, BASE))
    from_dict = load_spec(yaml.safe_load(BASE))
    assert from_dict == from_yaml
    assert from_dict.train.seed == 3 and from_dict.data.dataset_ref.endswith("python_source_text")


def test_dict_errors_name_key_path():
    msg = spec_error({"model": {"factory": "a:b"}, "parallel": {"pipeline": 0}})
    assert msg.startswith("<dict>: parallel.pipeline:")
    assert "positive integer or 'auto'" in msg


def test_wrong_source_type():
    with pytest.raises(SpecError, match="YAML path"):
        load_spec(42)  # type: ignore[arg-type]


# ---------------------------------------------------------------- YAML-level errors


def test_empty_file(tmp_path):
    path = write(tmp_path, "# only a comment\n")
    assert spec_error(path).startswith(f"{path}: the spec is empty")


def test_yaml_syntax_error_has_line(tmp_path):
    path = write(tmp_path, 'model: {factory: "a:b"\nparallel: 3\n')
    msg = spec_error(path)
    assert msg.startswith(f"{path}:2: YAML syntax error")


def test_top_level_not_a_mapping(tmp_path):
    msg = spec_error(write(tmp_path, "- model\n- data\n"))
    assert ":1: the spec must be a mapping of sections" in msg and "got a list" in msg


def test_duplicate_keys(tmp_path):
    path, line = variant(tmp_path, "  data: 2", "  data: 2\n  pipeline: 4")
    msg = spec_error(path)
    assert msg.startswith(f"{path}:{line + 1}: parallel.pipeline: duplicate key 'pipeline'")
    assert "first given at line 8" in msg


def test_python_tags_refused_and_never_run(tmp_path):
    marker = tmp_path / "pwned"
    evil = f'model:\n  factory: !!python/object/apply:os.system ["touch {marker}"]\n'
    path = write(tmp_path, evil)
    msg = spec_error(path)
    assert msg.startswith(f"{path}:2: model.factory: tag '!!python/object/apply:os.system'")
    assert "safe loading" in msg
    assert not marker.exists()


def test_custom_tag_refused(tmp_path):
    msg = spec_error(write(tmp_path, "model: !include other.yaml\n"))
    assert ":1: model: tag '!include' is not allowed" in msg


# ---------------------------------------------------------------- schema errors with lines


def test_unknown_key_did_you_mean(tmp_path):
    path, line = variant(tmp_path, "microbatches: 4", "microbatchs: 4")
    msg = spec_error(path)
    assert msg.startswith(f"{path}:{line}: parallel.microbatchs: unknown key 'microbatchs'")
    assert "did you mean 'microbatches'?" in msg


def test_unknown_top_level_section(tmp_path):
    path = write(tmp_path, BASE + "outptu: {dir: x}\n")
    msg = spec_error(path)
    assert msg.startswith(f"{path}:{len(BASE.splitlines()) + 1}: outptu: unknown key")
    assert "did you mean 'output'?" in msg


def test_unknown_key_without_near_match_lists_valid_keys(tmp_path):
    path, line = variant(tmp_path, "seed: 3", "zzz: 3")
    msg = spec_error(path)
    assert f":{line}: train.zzz:" in msg and "did you mean" not in msg
    assert "valid keys here:" in msg and "seed" in msg


def test_wrong_type(tmp_path):
    path, line = variant(tmp_path, "nodes: 1", 'nodes: "two"')
    msg = spec_error(path)
    assert msg.startswith(f"{path}:{line}: cluster.nodes: got the string 'two', expected a "
                          "positive integer")


def test_yaml_booleans_are_not_numbers(tmp_path):
    path = write(tmp_path, BASE.replace("seed: 3", "seed: 3\n  steps: yes"))
    msg = spec_error(path)
    assert msg.startswith(f"{path}:19: train.steps: got true (a boolean)")
    assert "expected a positive integer" in msg
    ok = write(tmp_path, BASE.replace("n_embd: 16}", "n_embd: 16, flag: true}"), "ok.yaml")
    assert load_spec(ok).model.args["flag"] is True  # free-form args keep booleans


@pytest.mark.parametrize("value, words", [
    ("node_tflops: 0.02", "expected a list, each item a number >= 1e-06"),
    ("node_tflops: [true]", "got true (a boolean)"),
    ("memory_GBps: 0", "0 is zero, but it must be a number >= 1e-06"),
    ("op_overhead_us: -1", "-1 is negative, but it must be a number >= 0"),
])
def test_optional_and_list_numbers_are_described_in_words(tmp_path, value, words):
    path = write(tmp_path, BASE.replace("  nodes: 1\n", f"  nodes: 1\n  {value}\n"))
    line = 1 + path.read_text().splitlines().index(f"  {value}")
    msg = spec_error(path)
    assert msg.startswith(f"{path}:{line}: cluster.{value.split(':')[0]}: ") and words in msg
    assert "None" not in msg and "typing" not in msg and "float" not in msg


def test_section_of_wrong_type(tmp_path):
    path = write(tmp_path, BASE.replace("train:\n  lr: 1.0e-3\n  seed: 3\n", "train: 5\n"))
    msg = spec_error(path)
    line = path.read_text().splitlines().index("train: 5") + 1
    assert msg.startswith(f"{path}:{line}: train: got 5, expected a mapping with keys steps")


@pytest.mark.parametrize("old,new,key,word", [
    ("pipeline: 2", "pipeline: 0", "parallel.pipeline", "zero"),
    ("virtual_stages: 1", "virtual_stages: -1", "parallel.virtual_stages", "negative"),
    ("batch_size: 16", "batch_size: 0", "data.batch_size", "zero"),
    ("lr: 1.0e-3", "lr: -1.0e-3", "train.lr", "negative"),
    ("devices_per_node: 4", "devices_per_node: -4", "cluster.devices_per_node", "negative"),
])
def test_zero_or_negative_sizes(tmp_path, old, new, key, word):
    path, line = variant(tmp_path, old, new)
    msg = spec_error(path)
    assert msg.startswith(f"{path}:{line}: {key}: ")
    assert f"is {word}, but it must be a positive" in msg and "Fix:" in msg
    assert "\n" not in msg  # one problem, one line (the union's two failures are merged)


def test_unknown_schedule_lists_valid_ones(tmp_path):
    path, line = variant(tmp_path, "schedule: 1f1b", "schedule: zero-bubble")
    msg = spec_error(path)
    assert msg.startswith(f"{path}:{line}: parallel.schedule: unknown schedule 'zero-bubble'")
    for name in (*SCHEDULES, "auto"):
        assert repr(name) in msg


def test_schedule_typo_suggestion(tmp_path):
    path, _ = variant(tmp_path, "schedule: 1f1b", "schedule: gpip")
    assert "did you mean 'gpipe'?" in spec_error(path)


def test_pipeline_times_data_must_equal_world_size(tmp_path):
    path, _ = variant(tmp_path, "devices_per_node: 4", "devices_per_node: 8")
    msg = spec_error(path)
    line = BASE.splitlines().index("  pipeline: 2") + 1
    assert msg.startswith(f"{path}:{line}: parallel.pipeline: pipeline x data = 2 x 2 = 4")
    assert "8 devices" in msg


def test_world_size_from_nodes(tmp_path):
    two_nodes = BASE.replace("nodes: 1\n  devices_per_node: 4", "nodes: 2\n  devices_per_node: 2")
    assert load_spec(write(tmp_path, two_nodes)).cluster.world_size == 4
    path, _ = variant(tmp_path, "devices_per_node: 4", "devices_per_node: 2")
    assert "has 2 devices" in spec_error(path)


def test_auto_side_must_divide_world(tmp_path):
    text = BASE.replace("  data: 2\n", "  data: auto\n").replace("pipeline: 2", "pipeline: 3")
    path = write(tmp_path, text)
    msg = spec_error(path)
    assert f"{path}:8: parallel.pipeline: pipeline=3 does not divide the 4 devices" in msg


def test_batch_must_split_into_microbatches(tmp_path):
    path, line = variant(tmp_path, "batch_size: 16", "batch_size: 12")
    msg = spec_error(path)
    assert msg.startswith(f"{path}:{line}: data.batch_size: batch_size=12")
    assert "2 x 4 = 8 equal micro-batches" in msg and "divisible by 8" in msg


def test_batch_split_rule_points_at_section_when_batch_defaulted(tmp_path):
    # default batch 32 does not split into 2 x 3 micro-batches; data: has no batch_size key
    text = BASE.replace("  batch_size: 16\n", "").replace("microbatches: 4", "microbatches: 3")
    path = write(tmp_path, text)
    msg = spec_error(path)
    assert msg.startswith(f"{path}:4: data.batch_size: batch_size=32")  # line of 'data:'


def test_virtual_stages_need_interleaved(tmp_path):
    path, line = variant(tmp_path, "virtual_stages: 1", "virtual_stages: 2")
    msg = spec_error(path)
    assert msg.startswith(f"{path}:{line}: parallel.virtual_stages: virtual_stages=2 needs "
                          "schedule 'interleaved'")
    ok = write(tmp_path, BASE.replace("virtual_stages: 1", "virtual_stages: 2")
               .replace("schedule: 1f1b", "schedule: interleaved"), "ok.yaml")
    assert load_spec(ok).parallel.virtual_stages == 2


def test_missing_required_key(tmp_path):
    path = write(tmp_path, "data: {batch_size: 8}\nmodel:\n  args: {}\n")
    msg = spec_error(path)
    assert msg.startswith(f"{path}:3: model: name the model with exactly one of model.factory")
    path = write(tmp_path, "data: {batch_size: 8}\n")
    msg = spec_error(path)
    assert "model" in msg and "missing" in msg


def test_several_errors_one_per_line_in_file_order(tmp_path):
    text = (BASE.replace("pipeline: 2", "pipeline: -2").replace("schedule: 1f1b", "schedule: x")
            .replace("seed: 3", "sed: 3"))
    path = write(tmp_path, text)
    msg = spec_error(path)
    head, *lines = msg.splitlines()
    assert head == f"invalid spec {path} (3 problems):"
    assert [ln.split(": ", 2)[:2] for ln in lines] == [
        [f"{path}:8", "parallel.pipeline"], [f"{path}:11", "parallel.schedule"],
        [f"{path}:18", "train.sed"]]


def test_plain_wording_no_validator_jargon(tmp_path):
    path, _ = variant(tmp_path, "pipeline: 2", "pipeline: [1, 2]")
    msg = spec_error(path)
    assert "Input should" not in msg and "pydantic" not in msg.split(": ", 1)[1]
    assert "got a list, expected a positive integer or 'auto'" in msg


def test_spec_error_is_fxpipe_error():
    assert issubclass(SpecError, FxpipeError)


def test_describe_annotations():
    fields = ParallelSpec_.model_fields
    assert describe(fields["pipeline"].annotation) == "a positive integer or 'auto'"
    assert describe(fields["schedule"].annotation).startswith("one of 'gpipe', '1f1b'")
    assert describe(fields["virtual_stages"].annotation,
                    fields["virtual_stages"].metadata) == "a positive integer or 'auto'"


def test_spec_location(tmp_path):
    path = write(tmp_path, BASE)
    spec = load_spec(path)
    assert spec_location(spec, "parallel.schedule") == f"{path}:11"
    assert spec_location(spec, "output.dir") == f"{path}:1"  # absent section: the document
    assert spec_location(load_spec(yaml_dict()), "model") == "<dict>"
    assert spec_location(ParallelSpec(model={"factory": "a:b"}), "model") == ""


def yaml_dict() -> dict:
    import yaml

    return yaml.safe_load(BASE)


# ---------------------------------------------------------------- callables and models


def test_resolve_callable_ok():
    from fxpipe.examples.gpt import CharGPT

    assert resolve_callable("fxpipe.examples.gpt:CharGPT", "model.factory") is CharGPT
    assert resolve_callable("fxpipe.examples.data:ImageBatches.get", "x") is not None


@pytest.mark.parametrize("ref,needles", [
    ("fxpipe.examples.gpt.CharGPT", ["not of the form 'package.module:attr'",
                                     "did you mean 'fxpipe.examples.gpt:CharGPT'"]),
    ("fxpipe.examples.nope:Model", ["module 'fxpipe.examples.nope' not found"]),
    ("nopkg_xyz.models:Model", ["module 'nopkg_xyz.models' not found",
                                "no module named 'nopkg_xyz'"]),
    ("fxpipe.examples.gpt:CharGTP", ["has no attribute 'CharGTP'", "did you mean 'CharGPT'?"]),
    ("fxpipe.specs.schema:SCHEDULES", ["is a tuple, not a callable"]),
    (":x", ["not of the form"]),
])
def test_resolve_callable_errors(ref, needles):
    with pytest.raises(SpecError) as info:
        resolve_callable(ref, "model.factory")
    msg = str(info.value)
    assert msg.startswith("model.factory: ")
    for needle in needles:
        assert needle in msg


def test_resolve_callable_cites_spec_line(tmp_path):
    path, line = variant(tmp_path, '"fxpipe.examples.gpt:CharGPT"', '"fxpipe.examples.gpt:GPT"')
    spec = load_spec(path)  # the reference is only checked when resolved
    with pytest.raises(SpecError) as info:
        build_model(spec)
    assert str(info.value).startswith(f"{path}:{line}: model.factory: module 'fxpipe.examples.gpt'")
    assert "has no attribute 'GPT'" in str(info.value)


def test_build_model_is_seeded(tmp_path):
    spec = load_spec(write(tmp_path, BASE))
    a, b = build_model(spec), build_model(spec)
    assert type(a).__name__ == "CharGPT"
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name
    other = load_spec(write(tmp_path, BASE.replace("seed: 3", "seed: 4"), "s4.yaml"))
    c = build_model(other)
    assert not torch.equal(a.wpe.weight, c.wpe.weight)


def test_build_model_bad_args(tmp_path):
    path, line = variant(tmp_path, "n_layer: 1", "n_layers: 1")
    msg = str(pytest.raises(SpecError, build_model, load_spec(path)).value)
    assert msg.startswith(f"{path}:{line}: model.args: ")
    assert "'n_layers' -> 'n_layer'" in msg and "n_embd" in msg


def test_build_model_rejected_values(tmp_path):
    path, line = variant(tmp_path, "n_head: 2", "n_head: 3")  # 16 % 3 != 0: CharGPT raises
    msg = str(pytest.raises(SpecError, build_model, load_spec(path)).value)
    assert msg.startswith(f"{path}:{line}: model.args: ") and "divisible" in msg


def test_build_model_not_a_module():
    spec = load_spec({"model": {"factory": "fxpipe.examples.data:python_source_text",
                                "args": {"max_bytes": 10}}})
    with pytest.raises(SpecError, match="not a torch.nn.Module"):
        build_model(spec)


def test_cnn_spec_builds_and_its_data_fits():
    from fxpipe.examples.data import synthetic_images

    spec = load_spec("cnn-skip")
    model = build_model(spec)
    data = synthetic_images(spec.data.batch_size, seed=spec.train.seed)
    x, y = data.get(0)
    assert x.shape == (32, 1, 8, 8) and x.dtype == torch.float32
    assert y.shape == (32,) and y.dtype == torch.int64
    assert model(x).shape == (32, 10)
    x2, y2 = synthetic_images(32, seed=spec.train.seed).get(0)
    assert torch.equal(x, x2) and torch.equal(y, y2)  # same on every rank
    assert not torch.equal(data.get(1)[0], x) and not torch.equal(data.get(0, "val")[0], x)


# ---------------------------------------------------------------- user code failing at plan time
USER_HOOKS = '''
import torch

def boom_model(**kwargs):
    raise RuntimeError("checkpoint shard 3\\nis corrupt")

def boom_data(batch_size, seq_len):
    raise OSError("cannot open /data/corpus.txt")

def empty():
    return b""

def short(seq_len):
    return "x" * (2 * seq_len + 3)

def just_enough(seq_len):
    return "x" * (2 * seq_len + 4)

class _GetAttr:
    get = 3

def get_not_callable():
    return _GetAttr()

class _GetRaises:
    def get(self, step, split="train"):
        raise KeyError("shard")

def get_raises():
    return _GetRaises()
'''


@pytest.fixture()
def hooks(tmp_path_factory, monkeypatch):
    folder = tmp_path_factory.getbasetemp() / "user_hooks"
    folder.mkdir(exist_ok=True)
    (folder / "fxpipe_user_hooks.py").write_text(USER_HOOKS)
    monkeypatch.syspath_prepend(str(folder))
    return "fxpipe_user_hooks"


def with_dataset(tmp_path: Path, ref: str) -> tuple[Path, int]:
    """BASE with ``data.dataset: ref``; returns (path, line of the dataset key)."""
    text = BASE.replace("  batch_size: 16\n", f'  dataset: "{ref}"\n  batch_size: 16\n')
    line = text.splitlines().index(f'  dataset: "{ref}"') + 1
    return write(tmp_path, text), line


def test_build_model_factory_raising_is_a_spec_error(tmp_path, hooks):
    path, line = variant(tmp_path, '"fxpipe.examples.gpt:CharGPT"', f'"{hooks}:boom_model"')
    msg = str(pytest.raises(SpecError, build_model, load_spec(path)).value)
    assert msg.startswith(f"{path}:{line}: model.factory: ")
    assert "RuntimeError: checkpoint shard 3 is corrupt" in msg  # type and message, one line
    assert "\n" not in msg and "fix the factory" in msg


@pytest.mark.parametrize("func, needles", [
    ("boom_data", ["raised OSError: cannot open /data/corpus.txt", "batch_size=16",
                   "seq_len=16"]),
    ("empty", ["empty (0 bytes)", "non-empty corpus"]),
    ("short", ["corpus of 35 bytes is too small for seq_len=16", "at least 36 bytes",
               "lower data.seq_len to at most 15"]),
    ("get_not_callable", ["'get' is an int, not a method", "get(step, split)"]),
])
def test_dataset_problems_are_spec_errors(tmp_path, hooks, func, needles):
    from fxpipe.data.batches import make_batches

    path, line = with_dataset(tmp_path, f"{hooks}:{func}")
    msg = str(pytest.raises(SpecError, make_batches, load_spec(path)).value)
    assert msg.startswith(f"{path}:{line}: data.dataset: "), msg
    for needle in needles:
        assert needle in msg, msg


def test_dataset_just_long_enough_and_get_raising(tmp_path, hooks):
    from fxpipe.data.batches import example_microbatch, make_batches

    path, _ = with_dataset(tmp_path, f"{hooks}:just_enough")
    x, y = make_batches(load_spec(path)).get(0)
    assert x.shape == y.shape == (16, 16)
    path, line = with_dataset(tmp_path, f"{hooks}:get_raises")
    msg = str(pytest.raises(SpecError, example_microbatch, load_spec(path)).value)
    assert msg.startswith(f"{path}:{line}: data.dataset: ") and "KeyError" in msg


def test_bundled_corpus_missing_is_a_spec_error(tmp_path, monkeypatch):
    import fxpipe.examples.data as data
    from fxpipe.data.batches import make_batches

    monkeypatch.setattr(data.sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    path = write(tmp_path, BASE)
    msg = str(pytest.raises(SpecError, make_batches, load_spec(path)).value)
    assert msg.startswith(f"{path}:4: data.dataset: ")  # the 'data:' line (dataset defaulted)
    assert "FileNotFoundError" in msg and "point data.dataset at another corpus" in msg


# ---------------------------------------------------------------- schedule constraints at load
def test_interleaved_needs_microbatches_multiple_of_pipeline(tmp_path):
    text = (BASE.replace("schedule: 1f1b", "schedule: interleaved")
            .replace("microbatches: 4", "microbatches: 3").replace("batch_size: 16", "batch_size: 12"))
    path = write(tmp_path, text)
    line = text.splitlines().index("  microbatches: 3") + 1
    msg = spec_error(path)
    assert msg.startswith(f"{path}:{line}: parallel.microbatches: schedule 'interleaved'")
    assert "multiple of 2, got 3" in msg and "set parallel.microbatches to 2 or 4" in msg
    # the same numbers are fine for 1f1b, and 'auto' defers the check to the planner
    load_spec(write(tmp_path, text.replace("interleaved", "1f1b"), "ok.yaml"))
    load_spec(write(tmp_path, text.replace("microbatches: 3", "microbatches: auto"), "auto.yaml"))


@pytest.mark.parametrize("schedule", ["interleaved", "zb-v", "v-min", "dualpipev"])
def test_multi_stage_per_rank_schedules_need_two_ranks(tmp_path, schedule):
    text = (BASE.replace("schedule: 1f1b", f"schedule: {schedule}")
            .replace("pipeline: 2", "pipeline: 1").replace("data: 2", "data: 4")
            .replace("microbatches: 4", "microbatches: 2"))
    path = write(tmp_path, text)
    line = text.splitlines().index("  pipeline: 1") + 1
    msg = spec_error(path)
    assert msg.startswith(f"{path}:{line}: parallel.pipeline: schedule '{schedule}'")
    assert "pipeline >= 2" in msg


def test_spec_schedule_rules_agree_with_the_generators():
    """Every concrete (schedule, pipeline, microbatches) the spec accepts builds a schedule, and
    every one it rejects is rejected by the generators (or by the planner for pipeline 1)."""
    from fxpipe.errors import ScheduleError
    from fxpipe.schedule.generators import compute_schedule
    from fxpipe.specs.schema import _schedule_problems

    for s in SCHEDULES:
        for p in range(1, 5):
            for m in range(1, 9):
                par = ParallelSpec_(pipeline=p, microbatches=m, schedule=s, data=1)
                v = 2 if s == "interleaved" else 1
                try:
                    compute_schedule(s, p, m, v)
                    builds = not (p == 1 and (s == "interleaved" or s in V_SCHEDULES))
                except ScheduleError:
                    builds = False
                assert builds == (not _schedule_problems(par)), (s, p, m)
