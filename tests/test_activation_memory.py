"""Activation memory measured = planned (issue 36): what a stage's forward holds per
micro-batch in flight, read from the live heap (glibc ``mallinfo2``) as
``benchmarks/bench_activation_memory.py`` measures it (CharGPT 4 x 128, pipeline 2, each stage
running 4 forwards as a rank does), against the plan's ``activation_bytes``, under no, selective,
full and partial recomputation.

The plan's figure plus the model output the loss stage holds until B (listed apart by the
benchmark) must match the heap growth within :data:`MODEL_SLACK`: the pricer counts each ATen
op's saved tensors on fake tensors (autograd may save a view another op saved too, and a
selective stage's kept model output is the output itself), and the allocator adds a header per
block; neither depends on the machine's arithmetic, so the bound is the same everywhere.
"""

from __future__ import annotations

import pytest

pytest.importorskip("ctypes")

from benchmarks import bench_activation_memory as bam  # noqa: E402
from fxpipe.execution.host_memory import keep_freed_memory  # noqa: E402

#: the pricer's per-op saved-tensor model against autograd's, relative (see the module doc)
MODEL_SLACK = 0.10


@pytest.fixture(scope="module")
def live():
    reader = bam._live_bytes_reader()
    if reader is None:
        pytest.skip("glibc mallinfo2 is not available here")
    keep_freed_memory()
    return reader


@pytest.mark.parametrize("recompute, layers", [("off", None), ("selective", None),
                                               ("full", None), ("full", 1)],
                         ids=["none", "selective", "full", "partial"])
def test_a_stage_holds_the_activation_bytes_its_plan_counts(live, recompute, layers):
    rows = bam.measure(recompute, "off", live, layers)
    assert len(rows) == 2
    want = {"off": "off", "selective": "selective", "full": "partial" if layers else "full"}
    for r in rows:
        assert r["how"] == want[recompute], r
        planned = r["predicted"] + r["outputs"]
        assert planned > 0 and r["measured"] > 0, r
        assert abs(planned - r["measured"]) <= MODEL_SLACK * r["measured"], r
