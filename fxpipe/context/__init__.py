"""Context parallelism: every micro-batch's sequence split over ``parallel.context`` ranks
(:mod:`.layout` which positions a rank holds, :mod:`.analysis` how each node runs on them,
:mod:`.collectives` the all-gathers of keys and values, :mod:`.rewrite` a stage rewritten)."""
