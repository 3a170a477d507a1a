"""The auto search's pruning is exact: its lower bounds never exceed the simulated step time
of a cut, so the pruned search picks what simulating every candidate picks; the placement
shortcuts (O(devices per node), not O(dp)) agree with looking at every replica; the
incremental ZB-V list scheduler gives the same order as re-examining every rank."""

from __future__ import annotations

import pytest
import torch

import fxpipe.partitioner.driver as D
from fxpipe.examples.gpt import CharGPT
from fxpipe.partitioner import bounds, cut_price, cutting, layout_search, pricing
from fxpipe.partitioner.search import candidates, stage_inflight
from fxpipe.partitioner.solvers import optimal_partition
from fxpipe.plans.placement import (global_rank, node_of, pair_crosses_nodes, ring_crosses_nodes,
                                    server_link_crosses_nodes, stage_to_rank)
from fxpipe.schedule.generators import _list_schedule
from fxpipe.schedule.lowering import build_schedule
from fxpipe.schedule.simulate import Links, StageCosts, simulate
from fxpipe.specs.loader import load_spec

try:
    from schedule_reference import list_schedule_definition
except ImportError:  # collected as a package
    from tests.schedule_reference import list_schedule_definition


def _spec(nodes, per_node, batch, schedule="auto", tensor=1):
    return load_spec({
        "model": {"factory": "x:y"}, "data": {"batch_size": batch, "seq_len": 64},
        "parallel": {"pipeline": "auto", "data": "auto", "microbatches": "auto",
                     "schedule": schedule, "tensor": tensor},
        "cluster": {"nodes": nodes, "devices_per_node": per_node, "device": "cuda",
                    "memory_gb": 80, "device_tflops": 1,
                    "links": {"intra_node_GBps": 100, "inter_node_GBps": 1}},
        "train": {"optimizer": "adamw"}})


@pytest.fixture(scope="module")
def priced():
    with torch.device("meta"):
        model = CharGPT(vocab_size=512, block_size=64, n_layer=8, n_head=2, n_embd=64)
    x = (torch.zeros(1, 64, dtype=torch.long, device="meta"),)
    spec = _spec(2, 4, 32)
    return D.plan_with_graph(model, spec, x, units_only=True)[0]


@pytest.mark.parametrize("nodes,per_node,batch,schedule,tensor", [
    (2, 4, 32, "auto", 1), (1, 8, 32, "auto", 1), (4, 2, 16, "auto", 1), (2, 4, 64, "zb-h1", 1),
    (2, 4, 32, "auto", "auto")])
def test_pruned_search_picks_what_exhaustive_search_picks(priced, monkeypatch, nodes, per_node,
                                                          batch, schedule, tensor):
    """Also over the tensor degrees (tensor: auto): every degree's units priced."""
    spec = _spec(nodes, per_node, batch, schedule, tensor)
    sims, real = [], cut_price.simulate_cut

    def sim(pr, prefix, problem, result, cand, spec_, scale, recompute=None):
        res = real(pr, prefix, problem, result, cand, spec_, scale, recompute)
        rc = cutting.recompute_stages(pr, spec_, cand, result.cuts, scale)[0]
        assert recompute is None or recompute[0] == rc
        sims.append((bounds.cut_bound(prefix, result, cand, spec_, scale, problem.slow, rc),
                     res.step_time_s, cand.label()))
        return res

    monkeypatch.setattr(layout_search, "simulate_cut", sim)
    at = {}

    def priced_at(t):
        return at.setdefault(t, pricing.at_degree(priced, spec, t))

    every = layout_search.search_layouts(priced_at, spec, prune=False)
    assert sims and all(lb <= t * (1 + 1e-12) for lb, t, _ in sims), \
        [s for s in sims if s[0] > s[1]]  # every candidate that fits was simulated
    pruned = layout_search.search_layouts(priced_at, spec)
    assert (pruned[0], pruned[1].cuts, pruned[2]) == (every[0], every[1].cuts, every[2])
    assert "pruned by a lower bound" in pruned[3][0]


def test_candidate_bound_is_below_every_simulated_cut(priced):
    import numpy as np
    spec = _spec(2, 4, 32)
    prefix = pricing.unit_prefix(priced)
    total, params = float(prefix[:, -1].sum()), float(sum(priced.table.params))
    biggest = float(np.diff(prefix.sum(axis=0)).max())
    seen = 0
    for cand in candidates(spec, max_stages=len(priced.table.names)):
        mbs = spec.data.batch_size // (cand.dp * cand.microbatches)
        scale = mbs / priced.batch
        problem = cutting.cut_problem(priced, spec, cand, scale)
        result = optimal_partition(problem, explain=False)
        t = cut_price.simulate_cut(priced, prefix, problem, result, cand, spec, scale).step_time_s
        assert bounds.candidate_bound(cand, scale, spec, total, params, biggest, 1.0) <= t, cand
        seen += 1
    assert seen > 50


def test_cut_bound_leaves_zb_h1_trailing_weight_gradients_out():
    """ZB-H1 runs its last W's while earlier ranks drain: its step is shorter than fill +
    m x (F+B+W) + drain of the last rank (an earlier bound said otherwise and pruned it)."""
    p, m = 4, 8
    t = simulate(build_schedule("zb-h1", p, m), StageCosts([1.0] * p, [1.0] * p, [1.0] * p))
    assert t.step_time_s < (p - 1) + m * 3 + (p - 1)


@pytest.mark.parametrize("layout", ["pipeline-inner", "data-inner"])
def test_placement_shortcuts_agree_with_every_replica(layout):
    for p in (1, 2, 3, 5, 8, 12):
        for dp in (1, 2, 3, 7, 16, 40):
            for dpn in (1, 2, 3, 8):
                nodes = [[node_of(global_rank(r, d, p, dp, layout), dpn) for d in range(dp)]
                         for r in range(p)]
                for a in range(p):
                    assert ring_crosses_nodes(a, p, dp, dpn, layout) == (len(set(nodes[a])) > 1)
                    for b in range(p):
                        assert pair_crosses_nodes(a, b, p, dp, dpn, layout) == any(
                            x != y for x, y in zip(nodes[a], nodes[b]))
                    srv = p * dp
                    assert server_link_crosses_nodes(a, srv, p, dp, dpn, layout) == any(
                        x != node_of(srv, dpn) for x in nodes[a])
                links = Links.from_cluster(p, dp, max(1, p * dp // dpn), dpn, 100, 1,
                                           layout=layout)
                for a in range(p):
                    assert links.dp_rank_GBps[a] == (1 if len(set(nodes[a])) > 1 else 100)
                    for b in range(p):
                        if a != b:
                            assert links.pair_GBps[(a, b)] == (1 if any(
                                x != y for x, y in zip(nodes[a], nodes[b])) else 100)


def test_incremental_list_schedule_gives_the_reference_order():
    for p in (1, 2, 3, 4, 7):
        for m in (1, 2, 5, 9):
            for costs in ((1.0, 1.0, 1.0), (0.5, 1.3, 0.7), (2.0, 1.0, 0.1)):
                ref = list_schedule_definition(p, m, stage_to_rank("zb-v", p, 2 * p),
                                               2 * p, *costs)
                got = _list_schedule("zb-v", p, m, stage_to_rank("zb-v", p, 2 * p), 2 * p,
                                     *costs)
                assert got.actions == ref, (p, m, costs)


def test_recomputation_that_does_not_fit_names_the_device_memory():
    """The infeasibility answer gives the device's memory (80 GB), not what is left after the
    inputs kept for recomputation (once printed as 'the device has 1 B')."""
    import fxpipe
    from fxpipe.errors import PlanError

    with torch.device("meta"):
        model = CharGPT(vocab_size=50257, block_size=2048, n_layer=4, n_head=16, n_embd=4096)
    spec = {"model": {"factory": "x:y"}, "data": {"batch_size": 1536, "seq_len": 2048},
            "parallel": {"pipeline": 2, "data": 1, "microbatches": 1, "schedule": "1f1b"},
            "cluster": {"devices_per_node": 2, "device": "cuda", "memory_gb": 80,
                        "device_tflops": 400},
            "train": {"optimizer": "adamw", "precision": "bf16"}}
    with pytest.raises(PlanError) as e:
        fxpipe.plan(model, spec, (torch.zeros(1, 2048, dtype=torch.long, device="meta"),))
    text = str(e.value)
    assert "the device has 1 B" not in text
    assert "keeps its input for every micro-batch in flight" in text and "80 GB" in text


@pytest.mark.parametrize("schedule", ["1f1b", "zb-v"])
def test_sent_outputs_count_until_b_on_cpu_and_only_where_handed_over_on_cuda(priced,
                                                                               schedule):
    """A stage's outputs that only other ranks read: the runtime lets go of their data once
    sent (StageWork.sent). On CUDA (NCCL reaps a completed send during the step) they leave
    its bytes per micro-batch in flight; on CPU (gloo: held by the send until the consumer's
    gradient arrives, before B) they stay. The value a V schedule's turn hands over in memory
    (stage p-1 to stage p, one rank) stays on both."""
    from fxpipe.partitioner.search import Candidate

    cand = Candidate(pipeline=4, dp=1, microbatches=8, schedule=schedule, virtual_stages=1)
    on = {dev: load_spec({**_spec(1, 4, 32).model_dump(mode="json"),
                          "cluster": {"nodes": 1, "devices_per_node": 4, "device": dev,
                                      "memory_gb": 80, "device_tflops": 1}})
          for dev in ("cpu", "cuda")}
    scale = 32 / 8 / priced.batch
    result = optimal_partition(cutting.cut_problem(priced, on["cuda"], cand, scale),
                               explain=False)
    crossing = cutting.stage_outputs(priced, result.cuts, scale)
    rc = {dev: cutting.recompute_stages(priced, spec, cand, result.cuts, scale)
          for dev, spec in on.items()}
    k = cand.num_stages
    assert all(x > 0 for x in crossing[:-1]) and crossing[-1] == 0
    turn = cand.pipeline - 1 if schedule == "zb-v" else None
    assert rc["cpu"].sent == crossing
    assert rc["cuda"].sent == [crossing[j] if j == turn else 0.0 for j in range(k)]
    for j in range(k):
        gone = crossing[j] if j != turn else 0.0
        assert rc["cuda"].activation_bytes(j) == pytest.approx(
            rc["cpu"].activation_bytes(j) - gone, rel=1e-12, abs=1e-6)
        assert rc["cuda"].memory[j] == pytest.approx(
            rc["cpu"].memory[j] - stage_inflight(cand)[0][j] * gone, rel=1e-12)
