"""Seconds per node: forward, input-gradient and weight-gradient time of every priced FX node.

Two sources, chosen by ``cluster.costs``:

* ``analytic`` (default): a roofline per node. An op takes the longer of its arithmetic
  (FLOPs / ``device_tflops``) and its memory traffic (bytes read and written /
  ``memory_GBps``), so element-wise ops, norms, softmax, the loss, pooling and copies, which do
  no matmul work, still cost what moving their bytes costs, plus a fixed launch cost per op
  (``op_overhead_us``: eager dispatch, kernel launch). Views move nothing. The backward
  reads the output gradient and the saved inputs and writes the input gradient (about the
  forward's bytes again), and the weight gradient reads the output gradient and the inputs and
  writes the parameters' gradients.
* ``measured``: the times :mod:`fxpipe.partitioner.profile` measured on the device (median of
  repeats after warm-up), cached per model, shapes, dtype, device and torch version.

Both give :class:`NodeTimes` per node name; units and stages sum them. The loss ``train.loss``
runs on the model's output outside the graph; :mod:`fxpipe.partitioner.loss_cost` prices it (in
the same two ways) on the node that produces that output.
"""

from __future__ import annotations

from dataclasses import dataclass

from fxpipe.partitioner.cost import NodeCost

__all__ = ["NodeTimes", "analytic_times", "sum_times"]


@dataclass(frozen=True)
class NodeTimes:
    """Seconds of one node for one micro-batch: forward, input gradients, weight gradients."""

    fwd_s: float = 0.0
    bwd_input_s: float = 0.0
    bwd_weight_s: float = 0.0

    @property
    def total_s(self) -> float:
        """Forward plus the whole backward."""
        return self.fwd_s + self.bwd_input_s + self.bwd_weight_s

    def scaled(self, factor: float) -> "NodeTimes":
        """These times for a micro-batch ``factor`` times larger (work grows linearly)."""
        return NodeTimes(self.fwd_s * factor, self.bwd_input_s * factor,
                         self.bwd_weight_s * factor)


def roofline(flops: float, nbytes: float, flops_per_s: float, bytes_per_s: float) -> float:
    """The longer of compute and memory traffic, seconds."""
    return max(flops / flops_per_s, nbytes / bytes_per_s)


def analytic_times(costs: dict[str, NodeCost], flops_per_s: float, bytes_per_s: float,
                   op_overhead_s: float = 0.0) -> dict[str, NodeTimes]:
    """Roofline :class:`NodeTimes` of every priced node (see the module doc), plus
    ``op_overhead_s`` for launching each forward op and each backward of one."""
    out = {}
    o = op_overhead_s
    for name, c in costs.items():
        moved = (c.in_bytes + c.out_bytes) if c.moves_memory else 0
        fwd = o + roofline(c.fwd_flops, moved, flops_per_s, bytes_per_s)
        bi = (o + roofline(c.bwd_input_flops, moved, flops_per_s, bytes_per_s)
              if c.input_grad else 0.0)
        bw = (o + roofline(c.bwd_weight_flops, c.in_bytes + c.out_bytes, flops_per_s,
                           bytes_per_s) if c.weight_grad else 0.0)
        out[name] = NodeTimes(fwd, bi, bw)
    return out


def sum_times(times: dict[str, NodeTimes], names) -> NodeTimes:
    """The sum over ``names`` (names without a time count 0)."""
    f = bi = bw = 0.0
    for n in names:
        t = times.get(n)
        if t is not None:
            f, bi, bw = f + t.fwd_s, bi + t.bwd_input_s, bw + t.bwd_weight_s
    return NodeTimes(f, bi, bw)
