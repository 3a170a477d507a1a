"""One pricing rule (issue 39, item 3): every candidate the layout search scores is scored
exactly as the Plan assembled from it is predicted, across tensor degrees, data sharding,
gradient compression, activation recomputation (selective, full) and offload, on models with tied weights (shared across stages), values rebuilt per
stage (a transformers Llama's masks and rotary tables) and repeated blocks (planned folded)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from fxpipe.partitioner import layout_search
from fxpipe.partitioner.assemble import assemble, assemble_folded, finish_plan
from fxpipe.partitioner.units import PricedUnits
from fxpipe.schedule.plan_price import predict
from fxpipe.specs.loader import load_spec

try:
    import real_models as zoo
    from shared_models import tiny_gpt
except ImportError:  # collected as a package
    from tests import real_models as zoo
    from tests.shared_models import tiny_gpt


def _spec(model: dict, batch: int, seq: int, **train) -> dict:
    # data sharding reduce-scatters: not with a low-rank or sparse compression
    lossy = train.get("grad_compression") in ("powersgd", "topk")
    return {"model": model, "data": {"batch_size": batch, "seq_len": seq},
            "parallel": {"pipeline": "auto", "data": 2, "tensor": "auto", "microbatches": 4,
                         "schedule": "auto", "data_sharding": "none" if lossy else "auto"},
            "cluster": {"nodes": 2, "devices_per_node": 4, "memory_gb": 4, "device_tflops": 0.02,
                        "host_memory_gb": 64,
                        "links": {"intra_node_GBps": 5, "inter_node_GBps": 0.5}},
            "train": {"optimizer": "adamw", "loss": train.pop("loss", "cross_entropy"),
                      **train}}


def _gpt():
    x = torch.randint(0, 64, (1, 16))
    return tiny_gpt(), (x,), {}, {"factory": "shared_models:tiny_gpt"}, 16


def _llama():
    _, kw, _ = zoo.batch("llama", 0)
    return (zoo.build("llama"), (), {k: v[:1] for k, v in kw.items()}, zoo.hf_spec("llama"),
            zoo.T)


def _deep():  # 8 identical blocks: planned as blocks (folded)
    torch.manual_seed(0)
    from fxpipe.examples.gpt import CharGPT

    model = CharGPT(vocab_size=64, block_size=16, n_layer=8, n_head=2, n_embd=32)
    return model, (torch.randint(0, 64, (1, 16)),), {}, {"factory": "x:y"}, 16


CASES = [(_gpt, {}), (_gpt, {"grad_compression": "fp16"}),
         (_gpt, {"grad_compression": "powersgd", "compression": {"rank": 2}}),
         (_gpt, {"grad_compression": "topk", "compression": {"ratio": 0.05}}),
         (_llama, {"loss": "model"}), (_deep, {"grad_compression": "powersgd"}),
         (_gpt, {"activation_recompute": "selective"}),
         (_deep, {"activation_recompute": "selective"}), (_deep, {"activation_recompute": "on"}),
         (_gpt, {"activation_offload": "on"}), (_deep, {"activation_offload": "on"})]


@pytest.mark.parametrize("make, train", CASES, ids=["gpt", "gpt-fp16", "gpt-powersgd",
                                                    "gpt-topk", "llama", "blocks-powersgd",
                                                    "gpt-selective", "blocks-selective",
                                                    "blocks-full", "gpt-offload",
                                                    "blocks-offload"])
def test_every_scored_candidate_is_priced_as_its_plan_predicts(make, train, monkeypatch):
    model, args, kwargs, model_spec, seq = make()
    spec = load_spec(_spec(model_spec, 2 * 4 * 2, seq, **train))
    scored = []
    real = layout_search.simulate_cut

    def spy(pr, prefix, problem, result, cand, spec_, scale, recompute=None, steps=None):
        res = real(pr, prefix, problem, result, cand, spec_, scale, recompute, steps)
        scored.append((pr, result, cand, scale, res.step_time_s))
        return res

    monkeypatch.setattr(layout_search, "simulate_cut", spy)
    units = PricedUnits(model, args, kwargs, spec)
    layout_search.search_layouts(lambda t: units.at(2, t), spec, prune=False)
    assert len(scored) >= 4
    seen = {"tensor": set(), "sharding": set()}
    for pr, result, cand, scale, score in scored:
        assert scale == 1.0  # data and micro-batches fixed: the traced micro-batch size
        seen["tensor"].add(cand.tensor)
        seen["sharding"].add(cand.sharding)
        # the plan this candidate would give (assembling rewrites the graph: on a copy)
        mine = dataclasses.replace(pr, traced=dataclasses.replace(
            pr.traced, gm=copy.deepcopy(pr.traced.gm)))
        mine.table = pr.table
        folded = pr.table.folding is not None
        plan = (assemble_folded if folded else assemble)(mine, result, cand, spec, 2, [])
        finish_plan(plan, mine, spec, model, kwargs, "cpu")
        assert plan.predicted.step_time_s == pytest.approx(score, rel=1e-12, abs=0), cand.label()
        if train.get("activation_recompute") in ("selective", "on"):
            mode = "full" if train["activation_recompute"] == "on" else "selective"
            assert all(st.recompute_mode == mode for st in plan.stages)
        if train.get("activation_offload") == "on":
            assert not any(st.recompute for st in plan.stages)  # (a stage of views saves
            assert sum(st.offload_bytes for st in plan.stages) > 0  # nothing to offload)
        # the plan path prices it again the same way (`fxpipe simulate`, the report's
        # timeline), a plan of blocks too: its stage edges are the cut's
        assert predict(plan).step_time_s == plan.predicted.step_time_s
        if folded:
            fwd, _ = plan.edge_bytes()
            # a chain: each stage sends to the next, unless a stage reads only values it
            # rebuilds itself (deep interleaving cuts the embeddings into stages of their own)
            assert fwd and set(fwd) <= {(j, j + 1) for j in range(plan.num_stages - 1)}, (
                cand.label(), sorted(fwd))
            assert all(n > 0 for n in fwd.values())
    assert seen["tensor"] == {1, 2} and "none" in seen["sharding"], seen
    if spec.parallel.data_sharding == "auto":
        assert len(seen["sharding"]) > 1, seen


@pytest.mark.parametrize("name, sp, schedule", [("gpt", False, "1f1b"), ("gpt", True, "zb-v"),
                                                ("gpt2", True, "1f1b"), ("llama", True, "1f1b"),
                                                ("deep", False, "1f1b"), ("deep", True, "1f1b"),
                                                ("deep", True, "zb-v")])
def test_a_cut_prices_the_tensor_collectives_each_stage_runs(name, sp, schedule):
    """Item 4: the plan's per-stage tensor collectives (what its cut was priced with) are those
    the runtime's per-stage analysis gives the stages a worker builds (with sequence
    parallelism a value split where a cut falls is gathered there: not in the traced graph's
    own collectives)."""
    import fxpipe
    from fxpipe.partitioner.split import materialize_stages
    from fxpipe.runtime.tensor_parallel import plan_stage_sharding

    if name in ("gpt", "deep"):  # deep: planned as blocks, each stage priced from two
        model, args, kwargs, model_spec, seq = (_gpt if name == "gpt" else _deep)()
        spec = _spec(model_spec, 8, seq)
    else:
        model, args, kwargs = zoo.build(name), (), {k: v[:1] for k, v in zoo.batch(name, 0)[1]
                                                    .items()}
        spec = _spec(zoo.hf_spec(name), 8, zoo.T, loss="model")
    spec["parallel"] = {"pipeline": 2, "data": 1, "tensor": 2, "microbatches": 2,
                        "schedule": schedule, "sequence_parallel": sp}
    spec["cluster"] = {"devices_per_node": 4, "memory_gb": 4}
    plan = fxpipe.plan(model, spec, args, kwargs)
    assert bool(plan.folded) == (name == "deep")
    resolved = copy.deepcopy(plan)  # as a worker has it (a plan of blocks: resolved to nodes)
    mods = materialize_stages(resolved, model, list(range(plan.num_stages)))
    loss = None if spec["train"]["loss"] == "model" else spec["train"]["loss"]
    gathered = 0
    for st in plan.stages:
        comms = [c for ns in plan_stage_sharding(resolved, st.index, mods[st.index], loss)[0]
                 .nodes.values() for c in ns.comm]
        assert st.tensor_collectives == len(comms), st.index
        assert st.tensor_bytes == [float(sum(c.nbytes for c in comms if c.phase == p))
                                   for p in ("fwd", "bwd")], st.index
        gathered += st.tensor_collectives
    assert gathered > 0
