"""The package's import graph: no circles (function-level imports included) and no production import of test
helpers. Edges come from every ``import`` statement anywhere in a module (``ast``), ``from P import name``
pointing at ``P.name`` when that is a module and at ``P`` otherwise."""

from __future__ import annotations

import ast
from pathlib import Path

import aqsgd

ROOT = Path(aqsgd.__file__).parent
TEST_HELPERS = {"aqsgd.comm.testing"}  # helpers for the test suite, shipped for users' tests too


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    assert _cycles(_graph()) == []


def test_no_production_module_imports_test_helpers():
    graph = _graph()
    offenders = sorted(m for m, deps in graph.items() if deps & TEST_HELPERS and m not in TEST_HELPERS)
    assert offenders == []


def test_models_sit_below_the_pipeline():
    """What a model is (its families, stages and recipes) is known without the pipeline: no module of
    aqsgd.models imports aqsgd.pipeline, at any level (the pipeline imports the models, not the reverse)."""
    graph = _graph()
    up = sorted(f"{m} -> {d}" for m, deps in graph.items() if m.startswith("aqsgd.models")
                for d in deps if d.startswith("aqsgd.pipeline"))
    assert up == []
