"""Tensor (intra-layer) parallelism over the traced graph: which parameters to shard
(:mod:`~fxpipe.tensor.choose`), how every node then runs and what it communicates
(:mod:`~fxpipe.tensor.analysis`), the collectives (:mod:`~fxpipe.tensor.collectives`) and the
rewrite of a stage onto this rank's shards (:mod:`~fxpipe.tensor.rewrite`)."""
