"""Where things are in a YAML spec: safe reading and key path -> ``FILE:LINE``.

:func:`read_yaml` composes the YAML node tree with PyYAML's ``SafeLoader`` (no Python object
construction ever happens: a node whose tag the safe constructor does not know is refused before
anything is built), rejects duplicate keys, and returns the plain data together with a
:class:`SourceMap` that answers "which line holds ``parallel.pipeline``?".

:func:`remember` / :func:`location` keep the :class:`SourceMap` of each loaded spec object, so
later stages (model factory, dataset) can still cite the line of a bad value.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from fxpipe.errors import SpecError

_MERGE_TAG = "tag:yaml.org,2002:merge"

#: deepest nesting a spec may have (a real spec has 4 levels)
MAX_DEPTH = 64
#: most values a spec may hold once its aliases are expanded (no "billion laughs")
MAX_VALUES = 100_000


@dataclass
class Located:
    """Result of :meth:`SourceMap.find`: ``line`` (1-based) of the deepest node reached,
    ``found``: how many leading path elements exist in the YAML."""

    line: int | None
    found: int


class SourceMap:
    """Maps key paths of one YAML document to line numbers.

    Args:
        label: how messages name the source (a file path, ``<dict>``).
        root: the composed YAML node tree (``None`` for a plain dict: no line numbers).
    """

    def __init__(self, label: str, root: Node | None = None):
        self.label, self.root = label, root

    def find(self, path: Sequence[Any], at_key: bool = False) -> Located:
        """Walk ``path`` (mapping keys, sequence indices) down the node tree.

        Returns the 1-based line of the value node at the end of the path, or of its KEY when
        ``at_key`` (used for unknown keys). Where the path leaves the document (a key left at its
        default), the line of the deepest key that exists (line of the document start if none).
        """
        node = self.root
        if node is None:
            return Located(None, 0)
        key_line = value_line = node.start_mark.line + 1
        found = 0
        for elem in path:
            if isinstance(node, MappingNode):
                pair = next(((k, v) for k, v in reversed(node.value)
                             if isinstance(k, ScalarNode) and k.value == str(elem)), None)
                if pair is None:
                    break
                key, node = pair
                key_line = key.start_mark.line + 1
            elif (isinstance(node, SequenceNode) and isinstance(elem, int)
                  and 0 <= elem < len(node.value)):
                node = node.value[elem]
                key_line = node.start_mark.line + 1
            else:
                break
            value_line = node.start_mark.line + 1
            found += 1
        complete = found == len(path)
        return Located(value_line if complete and not at_key else key_line, found)

    def where(self, path: Sequence[Any] = (), at_key: bool = False) -> str:
        """``"FILE:LINE"`` for ``path`` (just ``"FILE"`` when there are no line numbers)."""
        loc = self.find(path, at_key)
        return f"{self.label}:{loc.line}" if loc.line is not None else self.label


def _yaml_error(label: str, err: yaml.YAMLError) -> SpecError:
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    where = f"{label}:{mark.line + 1}" if mark is not None else label
    col = f" (column {mark.column + 1})" if mark is not None else ""
    what = ": ".join(str(x) for x in (getattr(err, "context", None),
                                     getattr(err, "problem", None)) if x) or str(err)
    return SpecError(f"{where}: YAML syntax error{col}: {what}; fix the YAML at that line "
                     "(indentation, a missing ':' or an unclosed bracket or quote are the usual "
                     "causes)")


#: characters of one number in a spec (Python refuses to read integers of over 4,300 digits,
#: and no setting needs more than an int64)
MAX_NUMBER_CHARS = 40


def _check_nodes(label: str, root: Node) -> list[tuple[int, str]]:
    """Problems the safe constructor would hit or silently hide: unknown tags (e.g.
    ``!!python/object/apply``), duplicate keys (PyYAML keeps the last one without a word)."""
    problems: list[tuple[int, str]] = []
    stack: list[tuple[Node, str]] = [(root, "")]
    seen: set[int] = set()
    while stack:
        node, path = stack.pop()
        if id(node) in seen:  # aliases can share nodes
            continue
        seen.add(id(node))
        if node.tag not in yaml.SafeLoader.yaml_constructors:
            tag = node.tag.replace("tag:yaml.org,2002:", "!!")
            line = node.start_mark.line + 1
            problems.append((line, (
                f"{label}:{line}: {path or 'the document'}: tag {tag!r} is not allowed: fxpipe "
                "reads specs with YAML safe loading, which never builds Python objects; write a "
                "plain value (string, number, list or mapping) instead")))
            continue
        if isinstance(node, ScalarNode) and node.tag.endswith((":int", ":float")) \
                and len(node.value) > MAX_NUMBER_CHARS:
            line = node.start_mark.line + 1
            problems.append((line, (
                f"{label}:{line}: {path or 'the document'}: a number of {len(node.value)} "
                f"characters; a spec's numbers have at most {MAX_NUMBER_CHARS} (write it in "
                "exponent form, e.g. 1.0e+30, if you mean a huge value)")))
            continue
        if isinstance(node, MappingNode):
            first: dict[str, int] = {}
            for key, value in node.value:
                if key.tag == _MERGE_TAG:
                    stack.append((value, path))
                    continue
                name = key.value if isinstance(key, ScalarNode) else None
                sub = f"{path}.{name}" if path else str(name)
                if name is not None:
                    line = key.start_mark.line + 1
                    if name in first:
                        problems.append((line, (
                            f"{label}:{line}: {sub}: duplicate key {name!r} (first given at line "
                            f"{first[name]}); keep only one of them")))
                    else:
                        first[name] = line
                stack.append((key, sub))
                stack.append((value, sub))
        elif isinstance(node, SequenceNode):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(node.value))
    return sorted(problems)


def _size_and_depth(root: Node) -> tuple[int, int]:
    """Values (aliases expanded) and nesting depth of a node tree, in linear time (subtree
    figures memoised by node, so aliased subtrees are counted as often as they are used without
    being walked again)."""
    memo: dict[int, tuple[int, int]] = {}
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        if id(node) in memo:
            continue
        kids = ([x for kv in node.value for x in kv] if isinstance(node, MappingNode) else
                list(node.value) if isinstance(node, SequenceNode) else [])
        if not done:
            stack.append((node, True))
            stack.extend((k, False) for k in kids if id(k) not in memo)
            continue
        size = 1 + sum(memo[id(k)][0] for k in kids)
        depth = 1 + max((memo[id(k)][1] for k in kids), default=0)
        memo[id(node)] = (min(size, MAX_VALUES + 1), depth)
    return memo[id(root)]


def read_yaml(text: str, label: str) -> tuple[Any, SourceMap]:
    """Parse one YAML document safely.

    Args:
        text: the YAML source. label: the file name used in messages.

    Returns:
        ``(data, source_map)``: plain Python data (dicts, lists, str, int, float, bool, None,
        dates) and its :class:`SourceMap`.

    Raises:
        SpecError: empty document, YAML syntax error, several documents, a non-safe tag such as
        ``!!python/object/apply:os.system``, or a duplicate key. Messages start with
        ``FILE:LINE``.
    """
    try:
        loader = yaml.SafeLoader(text)
    except yaml.YAMLError as err:  # e.g. a control character (the reader checks first)
        raise _yaml_error(label, err) from None
    try:
        try:
            root = loader.get_single_node()
        except yaml.YAMLError as err:
            raise _yaml_error(label, err) from None
        except RecursionError:
            raise SpecError(f"{label}: the spec is nested too deeply to read (a spec has a few "
                            f"levels: sections, keys, values); fix its structure") from None
        if root is not None:
            size, depth = _size_and_depth(root)
            if depth > MAX_DEPTH:
                raise SpecError(f"{label}: the spec is nested {depth} levels deep; at most "
                                f"{MAX_DEPTH} are allowed (a spec has a few); fix its structure")
            if size > MAX_VALUES:
                raise SpecError(f"{label}: the spec expands to more than {MAX_VALUES} values "
                                "(its aliases repeat each other); write the values it needs "
                                "without aliases that multiply")
        if root is None:
            raise SpecError(f"{label}: the spec is empty; write at least a 'model:' section, e.g. "
                            "model: {factory: \"fxpipe.examples.gpt:CharGPT\"}")
        problems = _check_nodes(label, root)
        if problems:
            raise SpecError("\n".join(m for _, m in problems))
        try:
            data = loader.construct_document(root)
        except yaml.YAMLError as err:
            raise _yaml_error(label, err) from None
    finally:
        loader.dispose()
    return data, SourceMap(label, root)


_SOURCES: dict[int, SourceMap] = {}


def remember(obj: object, source: SourceMap) -> None:
    """Record where ``obj`` (a loaded spec) came from, for as long as ``obj`` lives."""
    key = id(obj)
    _SOURCES[key] = source
    weakref.finalize(obj, _SOURCES.pop, key, None)


def location(obj: object, path: Sequence[Any] | str = ()) -> str:
    """``"FILE:LINE"`` of ``path`` (a tuple or a dotted string such as ``"model.args"``) in the
    source ``obj`` was loaded from; ``""`` when ``obj`` did not come from :func:`load_spec`
    (e.g. a spec built directly in Python)."""
    source = _SOURCES.get(id(obj))
    if source is None:
        return ""
    if isinstance(path, str):
        path = tuple(path.split(".")) if path else ()
    return source.where(path)
