"""fxpipe: a declarative pipeline- and data-parallel compiler for PyTorch.

    import fxpipe
    spec = fxpipe.load_spec("gpt-char")                   # bundled name or a YAML path
    plan = fxpipe.plan(model, spec, example_inputs=(x,))  # trace, price, partition
    plan.dump("out/")

See README.md for the CLI (``fxpipe plan|run|simulate|show``).
"""

from fxpipe.annotations import annotate, pipe_split
from fxpipe.api import plan
from fxpipe.plan_data import Plan
from fxpipe.specs.loader import load_spec

__all__ = ["Plan", "annotate", "load_spec", "pipe_split", "plan"]
__version__ = "0.1.0"

