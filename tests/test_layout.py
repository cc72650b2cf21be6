"""The package's layout stays readable: no import cycle between its modules, every module
importable in a fresh interpreter.

The graph is read from the source: imports at module level (a function-level import is a
deliberate late binding, an ``if TYPE_CHECKING:`` import never runs), including the implicit
import of each parent package.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "celery_driftsafe"

pytestmark = pytest.mark.pure


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if "migrations" in path.parts:
            continue
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _top_level_imports(module: str, path: Path, known: set[str]) -> set[str]:
    """The package modules ``module`` imports when it is executed."""
    imported: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If):
                if not _is_type_checking(node):
                    visit(node.body)
                    visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)
            elif isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                imported.add(base)
                imported.update(f"{base}.{alias.name}" for alias in node.names)

    visit(ast.parse(path.read_text()).body)
    edges = set()
    for name in imported:
        # importing a.b.c runs a, a.b and a.b.c
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            candidate = ".".join(parts[:i])
            if candidate in known and candidate != module:
                edges.add(candidate)
    # a module's own parent packages run first, but they are not imports *by* it
    return {edge for edge in edges if not module.startswith(edge + ".")}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


def test_the_package_has_no_import_cycle() -> None:
    modules = _modules()
    graph = {name: _top_level_imports(name, path, set(modules)) for name, path in modules.items()}
    assert (
        "celery_driftsafe.claim.claimers" in graph["celery_driftsafe.scheduler"]
    )  # the graph is read
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_every_module_imports_in_a_fresh_interpreter() -> None:
    code = (
        "import importlib, os, sys\n"
        "os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'tests.settings')\n"
        "import django; django.setup()\n"
        "failed = []\n"
        "for name in sys.argv[1:]:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as exc:\n"
        "        failed.append(f'{name}: {type(exc).__name__}: {exc}')\n"
        "print('\\n'.join(failed)); sys.exit(1 if failed else 0)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, *_modules()],
        capture_output=True,
        text=True,
        check=False,
        cwd=PACKAGE.parent,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_models_store_the_names_defined_once() -> None:
    from celery_driftsafe import models
    from celery_driftsafe.core import stored_names as names

    assert set(models.RunStatus.values) == set(names.RunStatus)
    assert set(models.RunKind.values) == set(names.RunKind)
    assert set(models.MisfirePolicy.values) == {"", *names.MisfirePolicy}
    assert set(models.OverlapPolicy.values) == set(names.OverlapPolicy)
    assert set(names.PRE_START) | set(names.FINISHED) | {names.RunStatus.STARTED} == set(
        names.RunStatus
    )
