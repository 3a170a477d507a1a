"""The partitioner: a model and a spec become a Plan.

Takes an ``nn.Module`` (real or on the meta device), a :class:`~fxpipe.specs.schema.ParallelSpec`
and one micro-batch of example inputs; gives a :class:`~fxpipe.plans.plan.Plan`. In data-flow
order: ``annotations`` (``pipe_split()``, ``annotate()``) -> ``trace`` (torch.export; failures
explained by ``trace_errors``) -> ``cost`` (fake-tensor FLOPs and bytes) -> ``graph`` (networkx
planning units) -> ``problem`` (the cut problem and its one cost function) -> ``solvers`` (exact
min-bottleneck cuts; ``baselines`` for comparison) -> ``search`` (the ``auto`` layouts) ->
``boundaries`` (stage inputs, outputs, parameters) -> ``driver`` (``fxpipe.plan()``). ``split``
builds stage modules from boundaries, also from a saved Plan on a worker; ``compare`` prices
every schedule on one plan (``fxpipe simulate``). It uses the schedule package's simulator to
rank layouts; the runtime never imports it.
"""
