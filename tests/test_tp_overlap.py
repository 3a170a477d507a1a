"""Overlapped tensor-parallel communication (issue 37, ``parallel.tp_overlap``), in process.

* The sites (:func:`fxpipe.tensor.overlap.find_sites`) on traced models: each block's two
  row-parallel matmuls and the two values its column-parallel matmuls read (Llama's q, k, v
  reading one), Megatron's four collectives per block; under sequence parallelism the
  reduce-scatters and the gathers; none where no token dimension divides by the chunks.
* The chunk layout is exact: chunks put back give the tensor; a gathered chunk is every rank's
  chunk in rank order.
* The price: :func:`exposed_seconds` against a chunk-by-chunk simulation of compute and
  communication on two resources; with wide matmuls a plan with overlap predicts a shorter step
  by what it says it saved; with small ones chunking is priced slower (launches, copies,
  per-message latency) and ``auto`` keeps 1.
* Bad input: ``tp_overlap`` without tensor parallelism, 0, above 64, not a number.

Exactness on ranks (losses and parameters like one process) is in tests/test_tensor_parallel.py
(GPT-2 under ZB-V with sequence parallelism; Llama) and the compiled form in
tests/test_compiled_stages.py's settings.
"""

from __future__ import annotations

import re

import pytest
import torch

import fxpipe
from fxpipe.errors import SpecError
from fxpipe.examples.gpt import CharGPT
from fxpipe.tensor.overlap import assemble, exposed_seconds, find_sites, take

try:
    import test_tensor_parallel as tp
except ImportError:  # tests/ collected as a package
    from tests import test_tensor_parallel as tp


@pytest.mark.parametrize("name,blocks", [("gpt", 4), ("llama", 2)])
def test_each_block_has_megatrons_four_sites(name, blocks):
    _, sh = tp._traced(name, 2)
    tr, _ = tp._trace_of(name)
    sites = find_sites(tr.gm, sh, 2)
    kinds = [s.kind for s in sites.values()]
    assert kinds.count("reduce") == 2 * blocks  # attention output, MLP output
    inputs = [s for s in sites.values() if s.kind == "input"]
    # the blocks' two column-parallel inputs (+ the vocabulary-parallel head's input)
    assert 2 * blocks <= len(inputs) <= 2 * blocks + 1
    assert {s.collective for s in inputs} == {"copy_to"}
    if name == "llama":  # q, k, v share one chunked input; gate and up another
        assert sorted(len(s.matmuls) for s in inputs)[-2 * blocks:] == [2] * blocks + [3] * blocks
    for site in sites.values():  # the site's collectives are those its carrier was priced with
        carried = sh.nodes[site.carrier].comm
        assert all(c in carried for c in site.comms), (site, carried)
    _, sp = tp._traced(name, 2, sp=True)
    on_sp = find_sites(tr.gm, sp, 2)
    assert {s.collective for s in on_sp.values()} >= {"reduce_scatter", "gather_rs"}
    assert find_sites(tr.gm, sh, 1) == {}
    assert find_sites(tr.gm, sh, 3) == {}  # batch 2 x sequence 16: nothing divides by 3


@pytest.mark.parametrize("blocks,k,dim", [(1, 2, 0), (1, 4, 1), (2, 2, 1), (4, 2, 0)])
def test_chunks_put_back_give_the_tensor(blocks, k, dim):
    x = torch.arange(16 * 8 * 3, dtype=torch.float32).reshape(16, 8, 3)
    if x.shape[dim] % (blocks * k):
        pytest.skip("does not divide")
    parts = [take(x, dim, blocks, k, c) for c in range(k)]
    assert torch.equal(assemble(parts, dim, blocks), x)
    if blocks > 1:  # rank r's slice, chunked plainly, gathered in rank order = a strided chunk
        local = x.chunk(blocks, dim=dim)
        for c in range(k):
            gathered = torch.cat([take(p, dim, 1, k, c) for p in local], dim=dim)
            assert torch.equal(gathered, parts[c])


def _pipelined(comm: float, compute: float, k: int, comm_first: bool) -> float:
    """Two resources, ``k`` chunks: chunk ``c``'s communication after its compute (or before,
    ``comm_first``), each resource one chunk at a time; the exposed communication."""
    a, b = (comm / k, compute / k) if comm_first else (compute / k, comm / k)
    end_a = end_b = 0.0
    for _ in range(k):
        end_a += a
        end_b = max(end_b, end_a) + b
    return end_b - compute


@pytest.mark.parametrize("comm,compute", [(1.0, 4.0), (4.0, 1.0), (2.0, 2.0), (3.0, 0.0)])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_exposed_seconds_is_the_chunk_pipeline(comm, compute, k):
    for first in (False, True):
        assert exposed_seconds(comm, compute, k) == pytest.approx(
            _pipelined(comm, compute, k, first), rel=1e-12, abs=1e-15)
    assert 0.0 <= exposed_seconds(comm, compute, k) <= comm


def _gpu_plan(overlap, width: int, seq: int, micro: int, sp: bool = False):
    with torch.device("meta"):
        model = CharGPT(vocab_size=1024, block_size=seq, n_layer=2, n_head=16, n_embd=width)
    spec = {"model": {"factory": "fxpipe.examples.gpt:CharGPT"},
            "data": {"batch_size": 8, "seq_len": seq},
            "parallel": {"pipeline": 1, "data": 1, "tensor": 4, "microbatches": micro,
                         "schedule": "1f1b", "tp_overlap": overlap, "sequence_parallel": sp},
            "cluster": {"nodes": 1, "devices_per_node": 4, "gpu": "H100-80GB"},
            "train": {"precision": "bf16"}}
    return fxpipe.plan(model, spec, (torch.zeros(1, seq, dtype=torch.long, device="meta"),))


@pytest.mark.parametrize("sp", [False, True])
def test_a_plan_with_overlap_predicts_what_it_saves(sp):
    """Wide matmuls (4096; 8 x 2,048 tokens per micro-batch): 2 chunks hide communication and the
    step is shorter by what the plan says it saved, every micro-batch (1F1B, one stage)."""
    plain, over = (_gpu_plan(k, 4096, 2048, 1, sp) for k in (1, 2))
    assert plain.tp_overlap == 1 and over.tp_overlap == 2
    assert over.predicted.step_time_s < plain.predicted.step_time_s
    line = next(e for e in over.explain if e.startswith("parallel.tp_overlap 2"))
    saved, total = map(float, re.search(r"saving (\S+) ms of the (\S+) ms", line).groups())
    assert 0 < saved <= total
    step_saved = plain.predicted.step_time_s - over.predicted.step_time_s
    assert step_saved == pytest.approx(over.microbatches * saved / 1e3, rel=0.01)


def test_chunks_that_cost_more_than_they_hide_are_priced_so_and_auto_declines():
    """Small matmuls (512 tokens of width 1024 per micro-batch, host-bound): each chunk's
    launches and messages cost more than the overlap hides, more so with more chunks; auto
    keeps 1 and says why."""
    steps = {k: _gpu_plan(k, 1024, 512, 4).predicted.step_time_s for k in (1, 2, 8)}
    assert steps[1] < steps[2] < steps[8], steps
    auto = _gpu_plan("auto", 1024, 512, 4)
    assert auto.tp_overlap == 1 and auto.predicted.step_time_s == pytest.approx(steps[1])
    assert any(e.startswith("parallel.tp_overlap auto: 1") for e in auto.explain)
    wide = _gpu_plan("auto", 4096, 2048, 1)
    assert wide.tp_overlap > 1


def test_tp_overlap_needs_tensor_parallelism():
    with pytest.raises(SpecError, match="tp_overlap overlaps tensor-parallel collectives"):
        fxpipe.load_spec({"model": {"factory": "x:y"}, "parallel": {"tp_overlap": 2}})
    for bad in (0, 65, "two"):
        with pytest.raises(SpecError, match="tp_overlap"):
            fxpipe.load_spec({"model": {"factory": "x:y"}, "cluster": {"devices_per_node": 2},
                              "parallel": {"tensor": 2, "tp_overlap": bad}})
