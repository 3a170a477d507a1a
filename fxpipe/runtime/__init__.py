"""The runtime: one rank's share of a Plan, executed over torch.distributed.

Takes a Plan, its schedule (:mod:`fxpipe.schedule`) and this rank's stage modules; gives training
steps (loss, gradients, optimizer step) equal to single-process training. ``mesh`` (ranks ->
stage, replica; every process group), ``p2p`` (bounded sends and receives), ``transfers`` (stage
values and their gradients between ranks), ``precision`` (autocast, loss scaling),
``grad_reducer`` (the one gradient-reducer interface: ``data_parallel``'s all-reduce with tied
parameters, ``data_sharding``'s reduce-scatter, none, or a composite), ``step_grads`` (loss-scale
unscaling, gradients kept over steps), ``backward_split`` (B and W without redoing work),
``stage`` (one stage's F / B / W state), ``checks`` (the schedule and batches fit the plan),
``executor`` (the action loop) and ``local_ranks`` (gloo ranks on this machine with a hard
deadline, for tests and benchmarks). It never imports the partitioner.
"""
