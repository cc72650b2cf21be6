"""What the package index gets: the sdist and the wheel, built as a release builds them.

``python -m build`` (with the project's backend, hatchling, from the test group; no download)
builds the sdist, then the wheel *from the sdist*, so a wheel that builds is the first proof the
sdist holds what the package needs. Then: one version, from ``celery_driftsafe/__init__.py``;
Celery's beat finds ``-S driftsafe`` in the wheel's entry points; the extras published to users
are the user extras only (the project's own test and demo needs are dependency groups); the
classifiers name what CI tests; the sdist holds no file that needs what it leaves out.
"""

from __future__ import annotations

import configparser
import email
import email.message
import os
import re
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import pytest

import celery_driftsafe

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
#: The extras users get; anything else in the published metadata is a leak of the project's own.
USER_EXTRAS = {"postgres", "mysql", "results", "admin", "metrics"}
#: What the sdist leaves out (the tests, and what only they and the demo use).
LEFT_OUT = ("tests", "example_project", "benchmarks")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("dist")
    result = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    return {"sdist": sdist, "wheel": wheel}


def wheel_file(wheel: Path, name: str) -> str:
    with zipfile.ZipFile(wheel) as archive:
        (member,) = [n for n in archive.namelist() if n.endswith(f".dist-info/{name}")]
        return archive.read(member).decode()


def metadata(wheel: Path) -> email.message.Message:
    return email.message_from_string(wheel_file(wheel, "METADATA"))


def sdist_members(sdist: Path) -> dict[str, bytes]:
    """The sdist's files, by path inside its top folder."""
    with tarfile.open(sdist) as archive:
        files = {}
        for member in archive.getmembers():
            if member.isfile():
                handle = archive.extractfile(member)
                assert handle is not None
                files[member.name.split("/", 1)[1]] = handle.read()
        return files


def test_one_version_from_the_package(built: dict[str, Path]) -> None:
    version = celery_driftsafe.__version__
    assert version == "0.2.0"
    assert "version" in PYPROJECT["project"]["dynamic"]
    assert "version" not in PYPROJECT["project"]
    assert PYPROJECT["tool"]["hatch"]["version"]["path"] == "celery_driftsafe/__init__.py"
    assert metadata(built["wheel"])["Version"] == version
    assert built["wheel"].name == f"celery_driftsafe-{version}-py3-none-any.whl"
    assert built["sdist"].name == f"celery_driftsafe-{version}.tar.gz"
    assert f"Version: {version}\n" in sdist_members(built["sdist"])["PKG-INFO"].decode()
    # The changelog's latest release is this version; its top section is "Unreleased".
    changelog = (ROOT / "CHANGELOG.md").read_text()
    headings = re.findall(r"^## (.+)$", changelog, re.MULTILINE)
    assert headings[0] == "Unreleased"
    assert headings[1].split(" — ")[0] == version
    # Nothing else names the package's version: code and configuration read the one source.
    repeated = []
    for path in ROOT.rglob("*"):
        if path.suffix not in {".py", ".toml", ".ini", ".cfg", ".txt"} or any(
            part.startswith(".") or part in {"_build", "node_modules"}
            for part in path.relative_to(ROOT).parts
        ):
            continue
        if path in (ROOT / "celery_driftsafe" / "__init__.py", Path(__file__).resolve()):
            continue  # the source, and this test, which asserts the release
        if re.search(rf"""["']{re.escape(version)}["']""", path.read_text(errors="replace")):
            repeated.append(str(path.relative_to(ROOT)))
    assert repeated == []


def test_the_wheel_registers_the_beat_scheduler_short_name(built: dict[str, Path]) -> None:
    parser = configparser.ConfigParser()
    parser.read_string(wheel_file(built["wheel"], "entry_points.txt"))
    assert parser["celery.beat_schedulers"]["driftsafe"] == (
        "celery_driftsafe.scheduler:DriftSafeScheduler"
    )
    assert parser["pytest11"]["driftsafe"] == "celery_driftsafe.testing.pytest_plugin"


def test_celery_beat_resolves_the_short_name_as_installed() -> None:
    """The way ``celery beat -S driftsafe`` resolves it: ``beat.Service.get_scheduler``."""
    from celery import Celery
    from celery.beat import Service

    from celery_driftsafe.scheduler import DriftSafeScheduler

    app = Celery("resolve", broker="memory://", set_as_current=False)
    scheduler = Service(app, scheduler_cls="driftsafe").get_scheduler(lazy=True)
    assert type(scheduler) is DriftSafeScheduler


def test_only_user_extras_are_published(built: dict[str, Path]) -> None:
    published = set(metadata(built["wheel"]).get_all("Provides-Extra") or [])
    assert published == USER_EXTRAS
    assert set(PYPROJECT["project"]["optional-dependencies"]) == USER_EXTRAS


def test_the_test_group_installs_the_extras_the_suite_exercises() -> None:
    """The suite runs with ``pip install -e . --group dev``: its group names the user extras'
    requirements as the extras pin them (all but mysql, which its own pass installs)."""
    extras: dict[str, list[str]] = PYPROJECT["project"]["optional-dependencies"]
    test_group = [r for r in PYPROJECT["dependency-groups"]["test"] if isinstance(r, str)]
    for extra in USER_EXTRAS - {"mysql"}:
        for requirement in extras[extra]:
            assert requirement in test_group, f"{requirement} ({extra}) not in the test group"
    dev = PYPROJECT["dependency-groups"]["dev"]
    assert {"include-group": "test"} in dev


def _tested_matrix() -> tuple[set[str], set[str]]:
    """Python and Django versions tox.ini's envlist runs, e.g. ({'3.11'}, {'4.2'})."""
    parser = configparser.ConfigParser()
    parser.read(ROOT / "tox.ini")
    envlist = parser["tox"]["envlist"]
    pythons = {f"{m[0]}.{m[1:]}" for m in re.findall(r"py(3\d+)", envlist)}
    djangos: set[str] = set()
    for group in re.findall(r"django\{([^}]*)\}|django(\d+)", envlist):
        for version in (group[0] or group[1]).split(","):
            djangos.add(f"{version[0]}.{version[1:]}")
    return pythons, djangos


def test_classifiers_name_what_is_tested(built: dict[str, Path]) -> None:
    classifiers = metadata(built["wheel"]).get_all("Classifier") or []
    pythons = {c.rsplit(" :: ", 1)[1] for c in classifiers if re.match(r".*Python :: 3\.\d+$", c)}
    djangos = {c.rsplit(" :: ", 1)[1] for c in classifiers if re.match(r".*Django :: \d", c)}
    tested_pythons, tested_djangos = _tested_matrix()
    assert pythons == tested_pythons == {"3.11", "3.12"}
    assert djangos == tested_djangos == {"4.2", "5.2", "6.0"}
    assert any(c.startswith("Development Status :: ") for c in classifiers)
    # requires-python admits the oldest tested version
    assert PYPROJECT["project"]["requires-python"] == f">={min(tested_pythons)}"


def test_the_sdist_is_self_consistent(built: dict[str, Path]) -> None:
    files = sdist_members(built["sdist"])
    assert not [f for f in files if f.split("/")[0] in LEFT_OUT]
    for needed in ("pyproject.toml", "README.md", "CHANGELOG.md", "LICENSE", "PKG-INFO"):
        assert needed in files
    # Every package file of the wheel (which was built from this sdist) is in the sdist.
    with zipfile.ZipFile(built["wheel"]) as archive:
        packaged = {n for n in archive.namelist() if n.startswith("celery_driftsafe/")}
    assert packaged <= set(files)
    assert "celery_driftsafe/py.typed" in packaged
    assert any(n.startswith("celery_driftsafe/migrations/0001") for n in packaged)
    # No shipped file needs what the sdist leaves out.
    needs = re.compile(rf"^\s*(?:from|import)\s+({'|'.join(LEFT_OUT)})\b", re.MULTILINE)
    assert not [f for f, body in files.items() if f.endswith(".py") and needs.search(body.decode())]
    # The docs' relative links stay inside what is shipped.
    broken = []
    for name, body in files.items():
        if not name.endswith(".md"):
            continue
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", body.decode()):
            if re.match(r"[a-z]+:", target) or name == "README.md":
                continue
            resolved = os.path.normpath(os.path.join(os.path.dirname(name), target))
            if resolved not in files:
                broken.append(f"{name} -> {target}")
    assert broken == []


def test_readme_names_each_file_it_links(built: dict[str, Path]) -> None:
    """There is no public address for the repository yet, so README's links to its files are
    relative and do not resolve on a package index: each one names its file in its text, so the
    page still says where to look. The README is the wheel's long description."""
    readme = (ROOT / "README.md").read_text()
    assert metadata(built["wheel"]).get_payload().strip() == readme.strip()
    links: list[tuple[str, Any]] = re.findall(r"\[([^\]]+)\]\(([^)\s]+)\)", readme)
    relative = [(text, target) for text, target in links if not re.match(r"[a-z]+:", target)]
    assert relative, "README links no file (the test would check nothing)"
    for text, target in relative:
        named = text.strip("`")
        assert named.rstrip("/") in target, f"[{text}]({target}) does not name its target"
