"""The package's import graph: no circles, between modules or between subpackages, no ``X = Any`` alias
standing in for a type, and no production import of test helpers.

Edges come from every ``import`` statement anywhere in a module (``ast``): inside functions and under
``if TYPE_CHECKING:`` too, since a circle that only a type checker follows is still one a reader has to
untangle. ``from P import name`` points at ``P.name`` when that is a module and at ``P`` otherwise. An alias
such as ``Transport = Any`` would hide the import it replaces, and with it a circle, so none is allowed: a
module that needs a type for its annotations imports it under ``TYPE_CHECKING`` (and the graph sees it)."""

from __future__ import annotations

import ast
from pathlib import Path

import aqsgd

ROOT = Path(aqsgd.__file__).parent
TEST_HELPERS = {"aqsgd.comm.testing"}  # helpers for the test suite, shipped for users' tests too
ANY_ALIASES_ALLOWED: set[str] = set()  # "module.Name" of an ``X = Any`` alias that may stay (none may)


def _modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = _modules(root)
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


def _subpackage(module: str) -> str:
    """``aqsgd.comm.launch.local`` -> ``aqsgd.comm``; a module at the top (``aqsgd.errors``) is its own."""
    return ".".join(module.split(".")[:2])


def _subpackage_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {_subpackage(m): set() for m in graph}
    for m, deps in graph.items():
        out[_subpackage(m)].update(_subpackage(d) for d in deps if _subpackage(d) != _subpackage(m))
    return out


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


def _is_any(node: ast.expr | None) -> bool:
    """``Any`` or ``typing.Any`` (as written; a renamed ``typing`` is not followed)."""
    return (isinstance(node, ast.Name) and node.id == "Any") or (
        isinstance(node, ast.Attribute) and node.attr == "Any" and isinstance(node.value, ast.Name)
        and node.value.id in ("typing", "typing_extensions"))


def _module_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """The statements of a module's body, those inside its ``if``/``try``/``with`` blocks included (not those
    of its functions and classes)."""
    out = []
    for node in body:
        out.append(node)
        for field in ("body", "orelse", "finalbody"):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.extend(_module_level(getattr(node, field, None) or []))
        for handler in getattr(node, "handlers", None) or []:
            out.extend(_module_level(handler.body))
    return out


def _any_aliases(source: str) -> list[str]:
    """The names a module binds to ``typing.Any`` at module level: ``X = Any``, ``X: TypeAlias = Any``,
    ``type X = Any`` and ``from typing import Any as X``."""
    names = []
    for node in _module_level(ast.parse(source).body):
        if isinstance(node, ast.Assign) and _is_any(node.value):
            names += [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and _is_any(node.value) and isinstance(node.target, ast.Name):
            annotation = node.annotation
            if (isinstance(annotation, ast.Name) and annotation.id == "TypeAlias") or (
                    isinstance(annotation, ast.Attribute) and annotation.attr == "TypeAlias"):
                names.append(node.target.id)
        elif type(node).__name__ == "TypeAlias" and _is_any(getattr(node, "value", None)):  # Python >= 3.12
            names.append(node.name.id)
        elif isinstance(node, ast.ImportFrom) and node.module in ("typing", "typing_extensions"):
            names += [a.asname for a in node.names if a.name == "Any" and a.asname not in (None, "Any")]
    return names


# ---------------------------------------------------------------------------- the package
def test_no_import_circles():
    assert _cycles(_graph()) == []


def test_no_circles_between_subpackages():
    """A subpackage that imports another is below it: no two subpackages (``aqsgd.bench`` and ``aqsgd.cli``,
    say) import each other, through any of their modules."""
    graph = _graph()
    cycles = _cycles(_subpackage_graph(graph))
    members = {p for c in cycles for p in c}
    edges = sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps
                   if {_subpackage(m), _subpackage(d)} <= members and _subpackage(m) != _subpackage(d))
    assert cycles == [], edges  # the imports that join the circling subpackages


def test_no_any_alias_stands_for_a_type():
    found = sorted(f"{m}.{n}" for m, path in _modules().items() for n in _any_aliases(path.read_text()))
    assert [a for a in found if a not in ANY_ALIASES_ALLOWED] == []


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


# ---------------------------------------------------------------------------- the checks themselves
def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for name, text in {"__init__.py": "", **files}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_an_import_only_type_checkers_see_closes_a_circle(tmp_path):
    root = _package(tmp_path, {
        "a.py": "from pkg.b import B\n",
        "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\nB = 1\n",
    })
    assert _cycles(_graph(root)) == [["pkg.a", "pkg.b"]]


def test_subpackages_in_a_circle_through_different_modules(tmp_path):
    """Neither module imports back the one that imports it, but their subpackages circle."""
    root = _package(tmp_path, {
        "low/__init__.py": "", "low/tool.py": "", "low/main.py": "import pkg.high.cli\n",
        "high/__init__.py": "", "high/cli.py": "from pkg.low import tool\n",
    })
    graph = _graph(root)
    assert _cycles(graph) == []
    assert _cycles(_subpackage_graph(graph)) == [["pkg.high", "pkg.low"]]


def test_every_form_of_an_any_alias_is_found():
    source = ("import typing\nfrom typing import Any, TypeAlias\nfrom typing import Any as Hidden\n"
              "A = Any\nB: TypeAlias = Any\nC = typing.Any\nD: typing.TypeAlias = typing.Any\n"
              "if typing.TYPE_CHECKING:\n    from x import E\nelse:\n    E = Any\n"
              "try:\n    import y\nexcept ImportError:\n    F = Any\n")
    assert sorted(_any_aliases(source)) == ["A", "B", "C", "D", "E", "F", "Hidden"]


def test_annotations_and_local_names_are_not_aliases():
    source = ("from typing import Any\nx: Any = None\ny: dict[str, Any] = {}\n"
              "def f():\n    T = Any\n    return T\nclass K:\n    T = Any\n")
    assert _any_aliases(source) == []
