"""Specs: a YAML file (or dict) becomes a validated, typed ParallelSpec.

Takes YAML text, a path, a bundled spec name or a dict; gives a frozen
:class:`~fxpipe.specs.schema.ParallelSpec`, or a SpecError with FILE:LINE, the key path and the
fix. The schema also owns the rules every later step shares: the schedule names and how many
stages each puts on a rank, the optimizer's state bytes, the link defaults.

    from fxpipe.specs import load_spec, list_bundled_specs, build_model
    spec = load_spec("gpt-char")        # a bundled name, a YAML path, or a dict
    model = build_model(spec)           # seeded with train.seed

Modules: ``schema`` (pydantic models), ``source`` (safe YAML reading, key path -> FILE:LINE),
``messages`` (pydantic errors -> plain messages), ``loader`` (load_spec), ``resolve``
("package.module:attr" strings, build_model).
"""

from fxpipe.specs.loader import (build_model, list_bundled_specs, load_spec, resolve_callable,
                                 spec_location)
from fxpipe.specs.schema import ParallelSpec

__all__ = ["ParallelSpec", "build_model", "list_bundled_specs", "load_spec", "resolve_callable",
           "spec_location"]
