"""The package layout (README, Layout): imports between fxpipe's packages point one way, down
the data flow (issue 39, item 6). Every import is counted, at module level or inside a
function: a package may import only the packages listed below, and the packages form no
cycle. Nothing in the partitioner imports the runtime or training, nothing in the runtime the
partitioner or training."""

from __future__ import annotations

import ast
import collections
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1] / "fxpipe"

#: package -> the packages it may import (besides itself)
ALLOWED = {
    "errors": set(), "units": set(),
    "specs": {"errors", "units"},
    "examples": {"errors", "units"},
    "execution": {"errors", "specs"},
    "tensor": {"errors", "execution"},
    "experts": {"errors", "execution", "tensor"},
    "context": {"errors", "tensor"},
    "data": {"errors", "units", "specs", "examples"},
    "plans": {"errors", "units", "specs", "tensor"},
    "schedule": {"errors", "units", "specs", "plans"},
    "reports": {"errors", "units", "specs", "plans", "schedule"},
    "partitioner": {"errors", "units", "specs", "data", "execution", "tensor", "experts",
                    "context", "plans", "schedule", "examples"},
    "runtime": {"errors", "units", "specs", "execution", "tensor", "experts", "context",
                "plans", "schedule"},
    "training": {"errors", "units", "specs", "data", "execution", "tensor", "experts",
                 "context", "plans", "schedule", "partitioner", "runtime", "reports",
                 "examples"},
}


def _imports() -> dict[str, dict[str, list[str]]]:
    """package -> imported package -> the files importing it."""
    out: dict[str, dict[str, list[str]]] = collections.defaultdict(
        lambda: collections.defaultdict(list))
    for f in ROOT.rglob("*.py"):
        rel = f.relative_to(ROOT)
        if len(rel.parts) == 1:
            continue  # __init__, __main__, cli and the loose modules: the top, may use all
        pkg = rel.parts[0]
        for n in ast.walk(ast.parse(f.read_text())):
            names = ([n.module] if isinstance(n, ast.ImportFrom) and n.module and n.level == 0
                     else [a.name for a in n.names] if isinstance(n, ast.Import) else [])
            for m in names:
                parts = m.split(".")
                if parts[0] == "fxpipe" and len(parts) > 1 and parts[1] != pkg:
                    out[pkg][parts[1].removesuffix(".py")].append(str(rel))
    return out


def test_packages_import_only_what_lies_below_them():
    bad = [f"{pkg} imports {dep} ({files[0]})" for pkg, deps in _imports().items()
           for dep, files in deps.items() if dep not in ALLOWED.get(pkg, set())]
    assert not bad, bad


def test_the_package_graph_has_no_cycle():
    g = nx.DiGraph([(p, d) for p, deps in _imports().items() for d in deps])
    assert nx.is_directed_acyclic_graph(g), list(nx.simple_cycles(g))
    assert set(ALLOWED) >= {p for p in g.nodes if (ROOT / p).is_dir()}
