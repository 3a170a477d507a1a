"""fxpipe: a declarative pipeline- and data-parallel compiler for PyTorch.

    import fxpipe
    spec = fxpipe.load_spec("gpt-char")                   # bundled name or a YAML path
    plan = fxpipe.plan(model, spec, example_inputs=(x,))  # trace, price, partition
    plan.dump("out/")
    pipe = fxpipe.compile(model, plan)                    # in a torchrun script: this rank's share
    loss = pipe.step(x, y)                                # one global batch, gradients all-reduced

See README.md for the CLI (``fxpipe plan|run|simulate|show``).
"""

from fxpipe.plans.plan import Plan

__all__ = ["Plan", "annotate", "compile", "load_spec", "pipe_split", "plan"]
__version__ = "0.1.0"

# The rest loads torch: imported on first use, so `python -m fxpipe.training.worker` (a worker)
# and the CLI start without it and a Ctrl-C during start-up lands in code that handles it.
_LAZY = {"annotate": "fxpipe.partitioner.annotations",
         "pipe_split": "fxpipe.partitioner.annotations",
         "plan": "fxpipe.partitioner.driver", "load_spec": "fxpipe.specs.loader",
         "compile": "fxpipe.training.compiled"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fxpipe' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

