"""Data: the dataset a spec names, as deterministic global batches.

Takes the spec's ``data`` section (``data.dataset`` names a callable returning a text corpus or an
object with ``get(step, split) -> (inputs, target)``); gives :func:`~fxpipe.data.batches.make_batches`
(every rank builds the same batches from the same seed) and one checked micro-batch of example
inputs and targets for the planner and the launcher's pre-flight checks. Both the partitioner
and the training side read it; it reads only the specs.
"""
