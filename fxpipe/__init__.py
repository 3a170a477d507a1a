"""fxpipe: a declarative pipeline- and data-parallel compiler for PyTorch.

    import fxpipe
    spec = fxpipe.load_spec("gpt-char")                   # bundled name or a YAML path
    plan = fxpipe.plan(model, spec, example_inputs=(x,))  # trace, price, partition
    plan.dump("out/")

See README.md for the CLI (``fxpipe plan|run|simulate|show``).
"""

from fxpipe.plan_data import Plan

# INTEGRATION-PENDING: the lead adds annotate, pipe_split, plan, load_spec exports here.
__all__ = ["Plan"]
__version__ = "0.1.0"

