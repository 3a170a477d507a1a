"""Turn pydantic validation errors on a spec into plain ``FILE:LINE: key.path: problem; fix`` lines.

Each pydantic error carries a ``loc`` tuple (``("parallel", "pipeline", "constrained-int")``:
section, key, then the union member that failed). The key part of ``loc`` is found in the data,
its line in the :class:`~fxpipe.specs.source.SourceMap`, and the expected value is described from
the schema's own type annotations, so a union such as ``PositiveInt | 'auto'`` yields one message
("a positive integer or 'auto'") instead of one per member.
"""

from __future__ import annotations

import difflib
import typing
from types import UnionType
from typing import Any, Sequence

import annotated_types
from pydantic import BaseModel, ValidationError

from fxpipe.specs.schema import CrossSectionError
from fxpipe.specs.source import SourceMap


def _field(model: type[BaseModel], path: Sequence[Any]):
    """The pydantic FieldInfo at ``path`` below ``model`` (``None`` when the path leaves the
    schema) and the model class that owns it."""
    owner, info = model, None
    for i, name in enumerate(path):
        fields = getattr(owner, "model_fields", None)
        if not fields or name not in fields:
            return None, None
        info = fields[name]
        if i < len(path) - 1:
            owner = info.annotation
    return info, owner


def _section(model: type[BaseModel], path: Sequence[Any]) -> type[BaseModel] | None:
    """The pydantic model class of the mapping at ``path`` (``()``: the top level)."""
    if not path:
        return model
    info, _ = _field(model, path)
    ann = info.annotation if info is not None else None
    return ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None


def describe(tp: Any, metadata: Sequence[Any] = ()) -> str:
    """Plain words for what a type annotation accepts, e.g. ``Union[PositiveInt, Literal['auto']]``
    -> ``"a positive integer or 'auto'"``."""
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        base, *extra = typing.get_args(tp)
        flat = []
        for m in extra:  # Field(ge=...) inside Annotated carries its bounds as metadata
            flat.extend(getattr(m, "metadata", None) or [m])
        return describe(base, [*flat, *metadata])
    if origin in (typing.Union, UnionType):
        literals, others = [], []
        args = [a for a in typing.get_args(tp) if a is not type(None)]  # None: not given
        for arg in args:
            if typing.get_origin(arg) is typing.Literal:
                literals.extend(typing.get_args(arg))
            else:
                others.append(describe(arg, metadata))
        if literals:
            others.append(describe(typing.Literal[tuple(literals)]))
        return " or ".join(others)
    if origin in (list, tuple):
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        return f"a list, each item {describe(args[0])}" if args else "a list"
    if origin is typing.Literal:
        values = [repr(v) for v in typing.get_args(tp)]
        return values[0] if len(values) == 1 else "one of " + ", ".join(values)
    if origin is dict or tp is dict:
        return "a mapping (key: value pairs)"
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return "a mapping with keys " + ", ".join(tp.model_fields)
    words = {int: "integer", float: "number", str: "string", bool: "boolean (true/false)"}
    if tp in words:
        noun = words[tp]
        art = "an" if noun[0] in "aeiou" else "a"
        low = high = ""
        for m in metadata:
            if isinstance(m, annotated_types.Gt) and m.gt == 0:
                low = f"a positive {noun}"
            elif isinstance(m, annotated_types.Ge):
                low = f"{art} {noun} >= {m.ge:g}" if isinstance(m.ge, float) else \
                    f"{art} {noun} >= {m.ge}"
            elif isinstance(m, annotated_types.Gt):
                low = f"{art} {noun} > {m.gt}"
            elif isinstance(m, annotated_types.Le):
                high = f"at most {m.le:g}" if isinstance(m.le, float) else f"at most {m.le}"
            elif isinstance(m, annotated_types.Lt):
                high = f"below {m.lt}"
        low = low or f"{art} {noun}"
        return f"{low}, {high}" if high else low
    if tp is Any:
        return "any value"
    return getattr(tp, "__name__", str(tp))


def _shown(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if value is None:
        return "nothing (null)"
    if isinstance(value, str):
        return f"the string {value!r}"
    return repr(value)


def _data_path(data: Any, loc: Sequence[Any]) -> tuple[Any, ...]:
    """The leading part of ``loc`` that names keys present in ``data`` (drops the union member
    names pydantic appends, such as ``'constrained-int'`` or ``"literal['auto']"``)."""
    out, node = [], data
    for elem in loc:
        if isinstance(node, dict) and elem in node:
            node = node[elem]
        elif isinstance(node, list) and isinstance(elem, int) and 0 <= elem < len(node):
            node = node[elem]
        else:
            break
        out.append(elem)
    return tuple(out)


def _unknown_key(model, path, key) -> str:
    section = _section(model, path)
    names = list(section.model_fields) if section is not None else []
    near = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
    where = ".".join(map(str, path)) or "the top level"
    hint = f"did you mean {near[0]!r}? " if near else ""
    return (f"unknown key {key!r} in {where}; {hint}valid keys here: {', '.join(names)}. "
            f"Fix: rename or remove {key!r}")


def _literal_values(tp: Any) -> list[Any]:
    """Every value a ``Literal`` inside ``tp`` (through ``Union``/``Annotated``) allows."""
    if typing.get_origin(tp) is typing.Literal:
        return list(typing.get_args(tp))
    return [v for arg in typing.get_args(tp) for v in _literal_values(arg)]


def _only_literals(tp: Any) -> bool:
    """True when ``tp`` is a choice among fixed values (``Literal`` or a union of them)."""
    if typing.get_origin(tp) is typing.Literal:
        return True
    return typing.get_origin(tp) is typing.Union and all(map(_only_literals, typing.get_args(tp)))


def _bad_value(model, path, errors) -> str:
    info, _ = _field(model, path)
    if info is None:  # outside the schema (should not happen): fall back to pydantic's words
        return "; ".join(e["msg"] for e in errors)
    value = errors[0].get("input")
    expected = describe(info.annotation, info.metadata)
    types = {e["type"] for e in errors}
    name = str(path[-1]) if path else "value"
    example = ""
    if not info.is_required() and info.default_factory is None:
        example = (" (or leave it out)" if info.default is None
                   else f" (default {info.default!r})")
    choices = [str(v) for v in _literal_values(info.annotation)]
    if isinstance(value, str) and choices and _only_literals(info.annotation):
        near = difflib.get_close_matches(value, choices, n=1, cutoff=0.5)
        hint = f"did you mean {near[0]!r}? " if near else ""
        return f"unknown {name} {value!r}; {hint}Fix: use {expected}{example}"
    if types & {"less_than", "less_than_equal"} and isinstance(value, (int, float)) \
            and not isinstance(value, bool):
        return (f"{value!r} is too large, but it must be {expected}. Fix: set {name} to "
                f"{expected}{example}")
    if types & {"greater_than", "greater_than_equal"} and isinstance(value, (int, float)) \
            and not isinstance(value, bool):
        what = "zero" if value == 0 else "negative" if value < 0 else "too small"
        return (f"{value!r} is {what}, but it must be {expected}. Fix: set {name} to "
                f"{expected}{example}")
    return f"got {_shown(value)}, expected {expected}. Fix: set {name} to {expected}{example}"


def translate(err: ValidationError, data: Any, source: SourceMap,
              model: type[BaseModel]) -> list[tuple[int, str]]:
    """Plain messages for every error in ``err``.

    Args:
        err: raised by ``model.model_validate(data)``. data: the validated input.
        source: where the data came from. model: the top-level schema class.

    Returns:
        ``(line, message)`` pairs (line 0 when unknown), one per offending key, each message
        starting ``FILE[:LINE]: key.path:``.
    """
    groups: dict[tuple[Any, ...], list[dict]] = {}
    out: list[tuple[int, str]] = []

    def emit(path: Sequence[Any], text: str, at_key: bool = False) -> None:
        loc = source.find(path, at_key)
        where = f"{source.label}:{loc.line}" if loc.line is not None else source.label
        dotted = ".".join(map(str, path)) or "(top level)"
        out.append((loc.line or 0, f"{where}: {dotted}: {text}"))

    for e in err.errors():
        loc, kind = tuple(e["loc"]), e["type"]
        cross = e.get("ctx", {}).get("error")
        if isinstance(cross, CrossSectionError):
            for path, text in cross.problems:
                emit(path, text)
            continue
        if kind == "extra_forbidden":
            emit(loc, _unknown_key(model, loc[:-1], loc[-1]), at_key=True)
            continue
        if kind == "missing":
            path = loc
            info, _ = _field(model, path)
            need = describe(info.annotation, info.metadata) if info is not None else "a value"
            where = ".".join(map(str, path[:-1])) or "the top level"
            emit(path, f"required key {path[-1]!r} is missing in {where}. Fix: add "
                       f"'{path[-1]}:' with {need}")
            continue
        if kind in ("model_type", "model_attributes_type", "dict_type") and not loc:
            emit(loc, f"the spec must be a mapping of sections ({', '.join(model.model_fields)}), "
                      f"got {_shown(e.get('input'))}. Fix: write 'model:', 'parallel:' ... as "
                      "top-level keys")
            continue
        if kind == "value_error":  # a field validator of the schema: its words, plus the type
            path = _data_path(data, loc)
            info, _ = _field(model, path)
            text = str(e.get("msg", "")).removeprefix("Value error, ")
            if info is not None:
                text += f" (expected {describe(info.annotation, info.metadata)})"
            emit(path, text)
            continue
        groups.setdefault(_data_path(data, loc), []).append(e)
    for path, errors in groups.items():
        emit(path, _bad_value(model, path, errors))
    # one message per line, in file order
    seen, uniq = set(), []
    for item in sorted(out, key=lambda t: t[0]):
        if item[1] not in seen:
            seen.add(item[1])
            uniq.append(item)
    return uniq
