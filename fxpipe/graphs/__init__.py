"""FX graph modules as every stage of the data flow rebuilds them (the tracer, the
tensor-parallel rewrite, gradient fusion, eval copies): :func:`~fxpipe.graphs.rebuild.rebuilt`
puts a new graph in a module that holds exactly the tensors, and the same ``state_dict()``
keys, as the module it came from. Imports only torch."""
