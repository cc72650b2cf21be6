"""The package's layout stays readable: every module importable in a fresh interpreter, and
the code map lists each. The layers and the absence of import cycles (every import counted) are
import-linter's contracts (``lint-imports``, pyproject.toml's ``[tool.importlinter]``), checked
in the lint step."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "celery_driftsafe"

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


def _only_a_docstring(path: Path) -> bool:
    """A subpackage's ``__init__.py`` that only says what the subpackage holds."""
    body = ast.parse(path.read_text()).body
    return path.name == "__init__.py" and all(
        isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) for node in body
    )


def test_the_code_map_has_one_line_for_each_module() -> None:
    """docs/explanation/code-map.md follows the tree: one line per module, none left over."""
    text = (PACKAGE.parent / "docs" / "explanation" / "code-map.md").read_text()
    listed = re.findall(r"^- `([\w/]+\.py)`:", text, re.MULTILINE)
    commands = re.search(r"^`management/commands/`: (.+)$", text, re.MULTILINE)
    assert commands is not None
    listed += [f"management/commands/{name}" for name in re.findall(r"`(\w+\.py)`", commands[1])]
    assert len(listed) == len(set(listed)), "a module is listed twice"
    modules = {
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if "migrations" not in path.parts and not _only_a_docstring(path)
    }
    assert set(listed) - modules == set(), "listed, but no such module"
    assert modules - set(listed) == set(), "not in the code map"


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
    """The names the claim and the worker read are the very classes the models store, with
    the labels and choices Django's fields and forms read."""
    from celery_driftsafe import models
    from celery_driftsafe.core import stored_names as names

    assert models.RunStatus is names.RunStatus
    assert models.RunKind is names.RunKind
    assert models.MisfirePolicy is names.MisfirePolicy
    assert models.OverlapPolicy is names.OverlapPolicy
    assert models.RunStatus.RETRYING.label == "Retry scheduled"
    assert models.RunStatus("failed") is models.RunStatus.FAILED
    status = models.Run._meta.get_field("status")
    assert status.choices == [(member.value, member.label) for member in names.RunStatus]
    policy = models.PeriodicTask._meta.get_field("misfire_policy")
    assert [value for value, _ in policy.choices] == ["", *names.MisfirePolicy]
    assert set(names.PRE_START) | set(names.FINISHED) | {names.RunStatus.STARTED} == set(
        names.RunStatus
    )


def test_no_test_module_imports_another() -> None:
    """What several test modules share lives in ``tests/support`` (or a conftest.py): a test
    module imported by another runs its tests' module-level setup twice and ties two files'
    fixtures together, so none imports a ``test_*`` module."""
    tests = PACKAGE.parent / "tests"
    found = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            found += [
                f"{path.relative_to(tests.parent)} imports {name}"
                for name in names
                if name.startswith("tests.") and name.rsplit(".", 1)[-1].startswith("test_")
            ]
    assert found == []
