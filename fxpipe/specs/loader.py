"""Load a YAML parallelism spec (a file, a bundled name, or a dict) into a :class:`ParallelSpec`.

The YAML is read with PyYAML's safe loader only (:mod:`fxpipe.specs.source`); validation is
pydantic's, with every error turned into a plain ``FILE:LINE: key.path: problem. Fix: ...`` line
(:mod:`fxpipe.specs.messages`). Bundled specs live in ``fxpipe/specs/examples/*.yaml`` and are
read through :mod:`importlib.resources`, so they work from a wheel or a zip too.
"""

from __future__ import annotations

import difflib
from importlib import resources
from pathlib import Path

from pydantic import ValidationError

from fxpipe.errors import SpecError
from fxpipe.specs.messages import translate
from fxpipe.specs.resolve import build_model, resolve_callable
from fxpipe.specs.schema import ParallelSpec
from fxpipe.specs.source import SourceMap, location, read_yaml, remember

__all__ = ["load_spec", "list_bundled_specs", "spec_location", "resolve_callable", "build_model"]

_SUFFIXES = (".yaml", ".yml")


def _bundled_dir():
    return resources.files("fxpipe.specs").joinpath("examples")


def list_bundled_specs() -> list[str]:
    """Names of the specs shipped in ``fxpipe/specs/examples`` (file names without ``.yaml``),
    sorted; each is accepted by :func:`load_spec`."""
    return sorted(p.name.rsplit(".", 1)[0] for p in _bundled_dir().iterdir()
                  if p.name.endswith(_SUFFIXES))


def _read_source(source: str | Path) -> tuple[str, str]:
    """``(text, label)`` for a file path or a bundled spec name."""
    path = Path(source)
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8"), str(path)
        except (OSError, UnicodeDecodeError) as err:
            raise SpecError(f"{path}: cannot read the spec ({err}); give a readable UTF-8 YAML "
                            "file") from None
    if path.is_dir():
        raise SpecError(f"{path}: is a directory; give a YAML file or a bundled spec name "
                        f"({', '.join(list_bundled_specs())})")
    name = str(source)
    for suffix in _SUFFIXES:
        name = name.removesuffix(suffix)
    names = list_bundled_specs()
    if isinstance(source, str) and name in names:
        res = _bundled_dir().joinpath(f"{name}.yaml")
        return res.read_text(encoding="utf-8"), str(res)
    near = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    hint = f" Did you mean the bundled spec {near[0]!r}?" if near else ""
    raise SpecError(f"{source}: no such file and no bundled spec of that name.{hint} Give a path "
                    f"to a YAML file or one of the bundled names: {', '.join(names)}")


def load_spec(source: str | Path | dict | ParallelSpec) -> ParallelSpec:
    """Read and validate a parallelism spec.

    Args:
        source: a YAML file path (``str`` or ``Path``); or the name of a bundled spec such as
            ``"gpt-char"`` (see :func:`list_bundled_specs`), used when no file of that name
            exists; or a plain ``dict`` with the same structure as the YAML; or a
            :class:`ParallelSpec` (returned as it is).

    Returns:
        The frozen, validated :class:`ParallelSpec`. Its source lines stay available through
        :func:`spec_location`.

    Raises:
        SpecError: no such file or bundled spec; an empty file, a YAML syntax error, several
        documents, a non-safe tag (``!!python/...``), duplicate keys, a top level that is not a
        mapping; or any schema violation (unknown keys with "did you mean", wrong types, zero or
        negative sizes, unknown schedule names, pipeline x data != world size, a batch that does
        not split into data x microbatches micro-batches, virtual stages without the
        interleaved schedule, a schedule whose constraints the concrete values break: interleaved
        with microbatches not a multiple of pipeline, interleaved / zb-v with pipeline 1). One line per problem, each ``FILE:LINE: key.path: problem``
        followed by the fix (``<dict>`` in place of ``FILE:LINE`` for dict input).
    """
    if isinstance(source, ParallelSpec):  # validated already (a Plan's typed spec)
        return source
    if isinstance(source, dict):
        data, smap = source, SourceMap("<dict>")
    elif isinstance(source, (str, Path)):
        text, label = _read_source(source)
        data, smap = read_yaml(text, label)
    else:
        raise SpecError(f"load_spec got a {type(source).__name__}; pass a YAML path, a bundled "
                        f"spec name ({', '.join(list_bundled_specs())}) or a dict")
    if not isinstance(data, dict):
        kind = "a list" if isinstance(data, list) else f"a {type(data).__name__}"
        raise SpecError(f"{smap.where()}: the spec must be a mapping of sections "
                        f"({', '.join(ParallelSpec.model_fields)}), got {kind}; write the "
                        "sections as top-level keys, e.g. 'model:' on its own line")
    try:
        spec = ParallelSpec.model_validate(data)
    except ValidationError as err:
        lines = [m for _, m in translate(err, data, smap, ParallelSpec)]
        head = (f"invalid spec {smap.label} ({len(lines)} problems):\n" if len(lines) > 1
                else "")
        raise SpecError(head + "\n".join(lines)) from None
    if isinstance(source, (str, Path)):
        spec = _absolute_data_paths(spec, Path(smap.label).resolve().parent)
    remember(spec, smap)
    return spec


def _absolute_data_paths(spec: ParallelSpec, base: Path) -> ParallelSpec:
    """``spec`` with the relative paths of its ``data`` section (files, tokens, a saved
    dataset, a tokenizer folder) made absolute against ``base``, the spec file's folder: the
    plan carries the spec to the workers, whose working folder may differ."""
    def fix(v):
        if isinstance(v, str):
            return v if Path(v).expanduser().is_absolute() else str(base / v)
        if isinstance(v, list):
            return [fix(x) for x in v]
        if isinstance(v, dict):
            return {k: fix(x) for k, x in v.items()}
        return v

    d = spec.data
    update = {k: fix(getattr(d, k)) for k in ("files", "val_files", "tokens", "val_tokens")
              if getattr(d, k) is not None}
    if isinstance(d.hf_dataset, str):
        update["hf_dataset"] = fix(d.hf_dataset)
    elif d.hf_dataset is not None:
        update["hf_dataset"] = d.hf_dataset.model_copy(
            update={"data_files": fix(d.hf_dataset.data_files)})
    if d.tokenizer != "bytes" and not d.tokenizer.startswith("tiktoken:"):
        update["tokenizer"] = fix(d.tokenizer)
    if not update:
        return spec
    return spec.model_copy(update={"data": d.model_copy(update=update)})


def spec_location(spec: ParallelSpec, key_path: str = "") -> str:
    """``"FILE:LINE"`` of ``key_path`` (dotted, e.g. ``"parallel.pipeline"``) in the YAML
    ``spec`` was loaded from (the deepest key present when the key was left at its default);
    ``"<dict>"`` for dict input; ``""`` for a spec not made by :func:`load_spec`. For error
    messages of later stages (planner, runtime) that concern a spec value."""
    return location(spec, key_path)
