"""The runtime: one rank's share of a Plan, executed over torch.distributed.

Takes a Plan, its schedule (:mod:`fxpipe.schedule`) and this rank's stage modules; gives training
steps (loss, gradients, optimizer step) equal to single-process training. ``mesh`` (ranks ->
stage, replica; process groups), ``p2p`` (bounded sends and receives), ``precision`` (autocast,
loss scaling), ``data_parallel`` (per-stage all-reduce, tied parameters), ``backward_split``
(B and W without redoing work), ``stage`` (one stage's F / B / W state), ``checks`` (the
schedule fits the plan), ``executor`` (the action loop) and ``local_ranks`` (gloo ranks on this
machine with a hard deadline, for tests and benchmarks). It never imports the partitioner.
"""
