"""Parallelism specs: the typed schema, the YAML loader and the bundled example specs.

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
