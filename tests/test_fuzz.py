"""Property-based fuzzing (hypothesis) of the two files users hand fxpipe: the YAML spec and
plan.json. Whatever the input, the answer is a spec / plan or a clean error (SpecError /
ValueError with a message), never another exception."""

from __future__ import annotations

import copy
import json
import math

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fxpipe.errors import FxpipeError, SpecError
from fxpipe.plans.plan import Plan
from fxpipe.specs.loader import load_spec

FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

VALID = {
    "model": {"factory": "fxpipe.examples.gpt:CharGPT",
              "args": {"vocab_size": 256, "block_size": 32, "n_layer": 2, "n_head": 2,
                       "n_embd": 32}},
    "data": {"batch_size": 8, "seq_len": 32},
    "parallel": {"pipeline": 2, "data": 1, "microbatches": 2, "schedule": "1f1b"},
    "cluster": {"devices_per_node": 2, "memory_gb": 2, "device_tflops": 0.05,
                "links": {"intra_node_GBps": 100, "latency_s": 1e-5}},
    "train": {"steps": 4, "lr": 1e-3, "timeout_s": 20, "checkpoint": {"every": 2},
              "lr_schedule": {"warmup_steps": 1, "decay": "cosine"}},
}

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.sampled_from(["auto", "1f1b", "zb-v", "cpu", "cuda", "../x", "/abs", "a:b", "", "0"]))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)


def _paths(d, prefix=()):
    for k, v in d.items():
        yield (*prefix, k)
        if isinstance(v, dict):
            yield from _paths(v, (*prefix, k))


SPEC_PATHS = list(_paths(VALID))


@st.composite
def mutated_specs(draw):
    """The valid spec with a few keys replaced, removed or added."""
    spec = copy.deepcopy(VALID)
    for _ in range(draw(st.integers(1, 4))):
        path = draw(st.sampled_from(SPEC_PATHS))
        parent = spec
        for k in path[:-1]:
            parent = parent.get(k) if isinstance(parent, dict) else None
            if not isinstance(parent, dict):
                break
        if not isinstance(parent, dict):
            continue
        action = draw(st.sampled_from(["set", "drop", "add"]))
        if action == "set":
            parent[path[-1]] = draw(values)
        elif action == "drop":
            parent.pop(path[-1], None)
        else:
            parent[draw(st.text(min_size=1, max_size=10))] = draw(values)
    return spec


def _load_text(tmp_path, text: str):
    path = tmp_path / "fuzz.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogateescape")
    return load_spec(path)


def _clean(fn):
    """``fn()``'s value, or its FxpipeError, which must carry a one-paragraph message."""
    try:
        return fn()
    except FxpipeError as e:
        assert str(e).strip(), "an error without a message"
        assert "Traceback (most recent call last)" not in str(e)  # (a key may be named Traceback)
        return e


@FUZZ
@given(spec=mutated_specs())
def test_mutated_specs_load_or_fail_cleanly(tmp_path, spec):
    try:
        text = yaml.safe_dump(spec, allow_unicode=True)
    except yaml.YAMLError:
        return
    got = _clean(lambda: _load_text(tmp_path, text))
    if isinstance(got, SpecError):
        assert str(tmp_path / "fuzz.yaml") in str(got), str(got)
    elif not isinstance(got, Exception):  # accepted: every number in it is finite
        t = got.train
        assert math.isfinite(t.lr) and math.isfinite(t.timeout_s) and t.lr > 0


@FUZZ
@given(text=st.text(max_size=300))
def test_arbitrary_text_is_a_spec_or_a_spec_error(tmp_path, text):
    got = _clean(lambda: _load_text(tmp_path, text))
    assert not isinstance(got, Exception) or isinstance(got, SpecError)


yaml_tokens = st.sampled_from(["model:", "data:", "train:", " ", "\n", "  ", "- ", "[", "]",
                               "{", "}", ": ", "&a ", "*a ", "!!python/object:os.system ",
                               "<<: ", "'", '"', "#", "---\n", "...", "1e400", ".nan", "~",
                               "!!binary ", "%TAG ", "? ", "|\n", ">\n", "\t", "\x00", "é"])


@FUZZ
@given(parts=st.lists(yaml_tokens, max_size=40))
def test_yaml_fragments_are_a_spec_or_a_spec_error(tmp_path, parts):
    got = _clean(lambda: _load_text(tmp_path, "".join(parts)))
    assert not isinstance(got, Exception) or isinstance(got, SpecError)


# ------------------------------------------------------------------------------ plan.json
@pytest.fixture(scope="module")
def plan_dict():
    from fxpipe.partitioner.driver import plan_from_spec

    plan, _ = plan_from_spec(load_spec(VALID))
    return plan.to_dict()


def _json_paths(d, prefix=()):
    if isinstance(d, dict):
        for k, v in d.items():
            yield (*prefix, k)
            yield from _json_paths(v, (*prefix, k))
    elif isinstance(d, list):
        for i, v in enumerate(d):
            yield (*prefix, i)
            yield from _json_paths(v, (*prefix, i))


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**66, max_value=2**66),
              st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=8)


def _show(data) -> object:
    """What `fxpipe show` does with a plan.json: load, then print the summary."""
    def go():
        try:
            plan = Plan.from_dict(json.loads(json.dumps(data)))
        except ValueError as e:  # the CLI prints it as "cannot read this plan: ..."
            assert str(e).strip()
            return e
        return plan.summary()
    return _clean(go)


@FUZZ
@given(data=st.data())
def test_mutated_plans_load_or_fail_cleanly(plan_dict, data):
    plan = copy.deepcopy(plan_dict)
    paths = list(_json_paths(plan))
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(paths))
        parent = plan
        try:
            for k in path[:-1]:
                parent = parent[k]
            if data.draw(st.booleans()) and isinstance(parent, dict):
                parent.pop(path[-1], None)
            else:
                parent[path[-1]] = data.draw(json_values)
        except (KeyError, IndexError, TypeError):
            continue
    got = _show(plan)
    assert isinstance(got, (str, ValueError, FxpipeError)), repr(got)
