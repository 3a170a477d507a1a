"""What the plan says about the memory levers (partial recomputation, per-block gathering,
selective recomputation, activation offload) where a fresh-eyes user found it wrong or
silent: sharding that saves nothing, ``param_gather: block`` forced where it costs more,
``recompute_layers`` that does nothing, host memory (not device memory) short, the search
summary's counts, the ``fxpipe check`` header. Tiny CharGPTs planned in process."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
import yaml

import fxpipe
from fxpipe.errors import PlanError, SpecError
from fxpipe.examples.gpt import CharGPT


def _spec(parallel: dict | None = None, train: dict | None = None,
          cluster: dict | None = None) -> dict:
    par = {"pipeline": 2, "data": 2, "microbatches": 2, "schedule": "1f1b"}
    cl = {"nodes": 1, "devices_per_node": 4, "device": "cpu", "memory_gb": 4,
          "device_tflops": 0.02, "links": {"intra_node_GBps": 5, "inter_node_GBps": 1}}
    return {"model": {"factory": "fxpipe.examples.gpt:CharGPT",
                      "args": {"vocab_size": 256, "block_size": 32, "n_layer": 4, "n_head": 2,
                               "n_embd": 32}},
            "data": {"dataset": "fxpipe.examples.data:python_source_text", "batch_size": 8,
                     "seq_len": 32},
            "parallel": {**par, **(parallel or {})}, "cluster": {**cl, **(cluster or {})},
            "train": {"optimizer": "adamw", "activation_recompute": "auto", **(train or {})}}


def _plan(spec: dict):
    torch.manual_seed(0)
    model = CharGPT(vocab_size=256, block_size=32, n_layer=4, n_head=2, n_embd=32)
    return fxpipe.plan(model, spec, torch.randint(0, 256, (2, 32)))


def _line(plan, start: str) -> str:
    got = [e for e in plan.explain if e.startswith(start)]
    assert len(got) == 1, plan.explain
    return got[0]


def test_block_forced_under_auto_sharding_says_it_fixed_full_not_that_bounds_pruned():
    """``param_gather: block`` leaves ``data_sharding: auto`` only full: the explanation says
    that, not that the unsharded layouts were pruned (the search had none)."""
    plan = _plan(_spec({"data_sharding": "auto", "param_gather": "block"}))
    line = _line(plan, "data sharding full")
    assert "pruned by their step-time bounds" not in line
    assert ("data_sharding: auto settles on full because parallel.param_gather: block" in line
            and "no unsharded layout was weighed" in line), line


def test_full_sharding_over_two_replicas_says_why_it_saves_nothing():
    """AdamW under full sharding gathering whole stages: at 2 replicas the master and
    gradient slices take back the halved optimizer state; the line says so and from how many
    replicas it saves, instead of 'X instead of X'."""
    plan = _plan(_spec({"data_sharding": "full", "param_gather": "stage"}))
    line = _line(plan, "data sharding full over 2 replicas")
    got = re.search(r"state (\S+ \S+) per rank on average instead of (\S+ \S+)", line)
    assert got and got.group(1) == got.group(2), line
    assert "no saving at 2 replicas" in line and "it saves from 3 replicas on with adamw" in line
    # over 4 replicas it saves: no such clause
    four = _plan(_spec({"pipeline": 1, "data": 4, "data_sharding": "full",
                        "param_gather": "stage"}))
    assert "no saving" not in _line(four, "data sharding full over 4 replicas")


@pytest.mark.parametrize("recompute", ["auto", "off"])
def test_forced_block_says_it_costs_memory_and_time_against_gathering_whole_stages(recompute):
    """At 2 replicas of the tiny model, gathering block by block holds more on the fullest
    stage and runs slower than gathering whole stages: a spec forcing it is told, with the
    whole-stage plan's own step time (also where no auto search runs: recomputation off)."""
    block = _plan(_spec({"data_sharding": "full", "param_gather": "block"},
                        {"activation_recompute": recompute}))
    stage = _plan(_spec({"data_sharding": "full", "param_gather": "stage"},
                        {"activation_recompute": recompute}))
    line = _line(block, "param_gather: block (parameters gathered block by block")
    assert "makes this plan worse than gathering whole stages" in line, line
    assert "its fullest stage holds" in line and "more (at 2 replicas" in line
    assert (f"its step takes {block.predicted.step_time_s * 1e3:.2f} ms against "
            f"{stage.predicted.step_time_s * 1e3:.2f} ms gathering whole stages") in line, line
    assert block.predicted.step_time_s > stage.predicted.step_time_s


def test_search_summary_counts_layouts_and_says_why_more_cuts_than_layouts():
    """One candidate layout simulated with and without recomputation: '1 candidate layout,
    1 simulated (as 2 cuts: ...)', not '1 candidates, 2 simulated'."""
    plan = _plan(_spec(cluster={"memory_gb": 0.00088}))
    head = _line(plan, "auto search: ")
    rows = [e for e in plan.explain if re.match(r"\s+\d+\. pp=", e)]
    got = re.match(r"auto search: (\d+) candidate layouts?, (\d+) simulated", head)
    assert got, head
    n, sim = int(got.group(1)), int(got.group(2))
    assert sim <= n and "candidates" not in head
    assert head.startswith("auto search: 1 candidate layout, 1 simulated (as 2 cuts: ")
    assert len(rows) == 2, plan.explain


def test_recompute_layers_that_does_nothing_says_why():
    """1000 on a 4-layer model: every stage recomputes whole (it has that many blocks or
    fewer); under auto with nothing to recompute: no stage recomputes."""
    huge = _plan(_spec(train={"activation_recompute": "full", "recompute_layers": 1000}))
    assert all(st.recompute_mode == "full" for st in huge.stages)
    line = _line(huge, "train.recompute_layers: 1000 unused: ")
    assert "every stage has 1000 blocks or fewer (the most: 3), so each recomputes whole" in line
    idle = _plan(_spec(train={"activation_recompute": "auto", "recompute_layers": 1}))
    assert all(st.recompute_mode == "off" for st in idle.stages)
    assert "no stage recomputes" in _line(idle, "train.recompute_layers: 1 unused: ")


def test_partial_recomputation_wording_one_stage_and_a_block_split_by_the_cut():
    """One stage: 'it recomputes', not 'each'; two stages sharing a block (3 + 2 blocks of
    4): the count says the split block counts on both."""
    one = _plan(_spec({"pipeline": 1, "data": 1},
                      {"activation_recompute": "full", "recompute_layers": 3},
                      {"devices_per_node": 1}))
    line = _line(one, "partial recomputation on stage 0: ")
    assert line.startswith("partial recomputation on stage 0: it recomputes its first blocks")
    assert "split by a cut" not in line
    two = _plan(_spec(train={"activation_recompute": "full", "recompute_layers": 1}))
    line = _line(two, "partial recomputation on every stage: each recomputes")
    assert "stage 0: 1 of 3, stage 1: 1 of 2 blocks; a block split by a cut counts on both" \
        in line, line


class _Flat(nn.Module):
    """No module list (no numbered blocks)."""

    def __init__(self):
        super().__init__()
        self.emb, self.up = nn.Embedding(256, 16), nn.Linear(16, 64)
        self.down, self.head = nn.Linear(64, 16), nn.Linear(16, 256)

    def forward(self, idx):
        x = self.emb(idx)
        return self.head(x + self.down(torch.relu(self.up(x))))


def test_recompute_layers_on_a_model_without_blocks_is_a_spec_error_with_its_line(tmp_path):
    spec = _spec(train={"activation_recompute": "full", "recompute_layers": 1})
    path = tmp_path / "flat.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    line = next(i for i, t in enumerate(path.read_text().splitlines(), 1)
                if "recompute_layers" in t)
    with pytest.raises(SpecError) as e:
        fxpipe.plan(_Flat(), str(path), torch.randint(0, 256, (2, 32)))
    assert str(e.value).startswith(f"{path}:{line}: train.recompute_layers: 1 counts blocks")


def test_host_memory_short_is_said_as_host_memory_not_device_memory():
    """Offloading on with a sliver of host memory: the error says host memory is short and
    offers host_memory_gb / activation_offload, not more stages or cluster.memory_gb."""
    with pytest.raises(PlanError) as e:
        _plan(_spec(train={"activation_offload": "on"}, cluster={"host_memory_gb": 1e-6}))
    text = str(e.value)
    assert text.startswith("no feasible plan (the offloaded activations do not fit host "
                           "memory; device memory is not what is short)"), text
    advice = text.split("what would fit:")[1]
    assert "cluster.host_memory_gb" in advice and "train.activation_offload: auto" in advice
    assert "cluster.memory_gb" not in advice and "pipeline stages" not in advice


def test_offload_auto_turned_down_for_host_memory_is_said():
    """On CUDA with too little host memory, ``activation_offload: auto`` is weighed and
    turned down: the plan recomputes and says why it does not offload."""
    plan = _plan(_spec(train={"activation_offload": "auto"},
                       cluster={"device": "cuda", "memory_gb": 0.0008,
                                "host_memory_gb": 0.002}))
    assert not any(st.offload_bytes for st in plan.stages)
    line = _line(plan, "activation offload (train.activation_offload: auto) weighed and "
                 "turned down for host memory: ")
    assert "share of the node's host memory is 500 kB" in line and "recomputes instead" in line


def test_offload_auto_under_forced_recomputation_says_it_went_unused():
    plan = _plan(_spec(train={"activation_recompute": "full", "activation_offload": "auto"},
                       cluster={"device": "cuda", "host_memory_gb": 8}))
    assert "has every stage recompute" in _line(
        plan, "train.activation_offload: auto unused: train.activation_recompute: full")


def test_nothing_fits_advice_names_offload_and_block_gathering_where_they_apply():
    """With host memory given and offload off, and with unsharded replicas of a model with
    blocks, the 'what would fit' advice names activation_offload and param_gather: block."""
    with pytest.raises(PlanError) as e:
        _plan(_spec({"data_sharding": "none"}, {"activation_offload": "off"},
                    {"device": "cuda", "memory_gb": 0.0002, "host_memory_gb": 8}))
    advice = str(e.value).split("what would fit:")[1]
    assert "activation offload (train.activation_offload: auto)" in advice, advice
    assert "parallel.data_sharding: full with param_gather: block" in advice, advice
    # neither where it does not apply: no host memory given; block already tried
    with pytest.raises(PlanError) as e:
        _plan(_spec({"data_sharding": "full", "param_gather": "block"}, None,
                    {"memory_gb": 0.0002}))
    advice = str(e.value).split("what would fit:")[1]
    assert "activation_offload" not in advice and "param_gather" not in advice, advice


def test_check_header_names_the_memory_levers_the_plan_uses():
    from fxpipe.training.check import memory_levers

    plan = _plan(_spec({"data_sharding": "full", "param_gather": "block"},
                       {"activation_recompute": "full", "recompute_layers": 1}))
    assert memory_levers(plan) == ("partial recomputation (first 1 block) on every stage; "
                                   "data sharding full; param_gather: block on every stage")
    plain = _plan(_spec({"data_sharding": "none"}, {"activation_recompute": "off"}))
    assert memory_levers(plain) == "none (activations kept, parameters whole)"
