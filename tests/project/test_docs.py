"""Every Python sample in the tutorial and the how-to/reference pages runs, as written."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.support.docs import DOCS, samples


def test_tutorial_settings_sample_is_valid_configuration() -> None:
    from celery.utils.imports import load_extension_class_names, symbol_by_name

    from celery_driftsafe import checks

    (sample,) = samples("tutorial.md")
    namespace: dict[str, Any] = {"INSTALLED_APPS": ["django.contrib.admin"]}
    exec(sample, namespace)
    assert "celery_driftsafe" in namespace["INSTALLED_APPS"]
    # resolved as Celery's beat resolves it: by path, or by a name in celery.beat_schedulers
    aliases = dict(load_extension_class_names("celery.beat_schedulers"))
    scheduler = symbol_by_name(namespace["CELERY_BEAT_SCHEDULER"], aliases=aliases)
    assert scheduler.__name__ == "DriftSafeScheduler"
    from django.test import override_settings

    with override_settings(DRIFTSAFE=namespace["DRIFTSAFE"]):
        assert checks.check_settings() == []


@pytest.mark.django_db(transaction=True)
def test_fake_clock_samples_run(broker_app: Any) -> None:
    from celery_driftsafe.scheduler import DriftSafeScheduler

    first, second, third, processes = samples("howto/test-with-fake-clock.md")
    namespace: dict[str, Any] = {}
    exec(first, namespace)
    namespace.update(app=broker_app, DriftSafeScheduler=DriftSafeScheduler)
    try:
        exec(second, namespace)
    finally:
        namespace["scheduler"].close()
    assert "skewed_env" in third  # the faketime sample starts a real process: not run here
    # the end-to-end sample starts real processes too: it compiles, and its imports exist
    compile(processes, "test-with-fake-clock.md", "exec")
    exec(
        "\n".join(line for line in processes.splitlines() if line.startswith(("import ", "from "))),
        {},
    )


@pytest.mark.django_db(transaction=True)
def test_task_reference_samples_run(broker_app: Any) -> None:
    from celery_driftsafe.models import Run

    definition, call = samples("reference/task.md")
    namespace: dict[str, Any] = {"app": broker_app}
    exec(definition.replace("@app.task(", "@app.task(shared=False, "), namespace)
    exec(call, namespace)
    assert Run.objects.get(idempotency_key="invoices-2026-11").task_name.endswith("send_invoices")


@pytest.mark.django_db(transaction=True)
def test_locks_reference_sample_runs(redis_client: Any) -> None:
    written: list[int] = []
    (sample,) = samples("reference/locks.md")
    exec(sample, {"write_export": lambda fencing_token: written.append(fencing_token)})
    assert written == [1]


@pytest.mark.django_db
def test_solar_howto_samples_run() -> None:
    from celery_driftsafe.models import PeriodicTask

    create, shell = samples("howto/solar-schedules.md")
    exec(create, {"PeriodicTask": PeriodicTask})
    task = PeriodicTask.objects.get(name="lights-on")
    assert task.next_slot_at is not None and task.schedule.describe().startswith("at sunset")
    _doctest(shell, "solar-schedules")


def _doctest(text: str, name: str) -> None:
    """Run the ``>>>`` examples of ``text``: every one must pass, and there must be some (a
    sample that lost its prompts would otherwise pass having checked nothing)."""
    import doctest

    test = doctest.DocTestParser().get_doctest(text, {}, name, None, 0)
    assert test.examples, f"{name}: the sample has no >>> examples to check"
    runner = doctest.DocTestRunner()
    runner.run(test)
    summary = runner.summarize(verbose=False)
    assert summary.failed == 0 and summary.attempted == len(test.examples)


@pytest.mark.django_db
def test_bounds_howto_sample_runs() -> None:
    from celery_driftsafe.models import PeriodicTask

    (create,) = samples("howto/bounds-and-limits.md")
    exec(create, {"PeriodicTask": PeriodicTask})
    task = PeriodicTask.objects.get(name="campaign-reminder")
    assert task.max_runs == 20 and task.valid_from is not None and task.valid_until is not None
    assert task.next_slot_at is not None and task.valid_from <= task.next_slot_at


@pytest.mark.django_db
def test_jitter_howto_samples_run() -> None:
    import celery_driftsafe.definitions.changes
    from celery_driftsafe.core.jitter import offset
    from celery_driftsafe.models import PeriodicTask

    update, shell = samples("howto/jitter.md")
    task = PeriodicTask(
        name="nightly-1",
        task="reports.nightly",
        schedule_kind="crontab",
        crontab_minute="0",
        crontab_hour="0",
    )
    task.save()
    exec(update, {"PeriodicTask": PeriodicTask, "celery_driftsafe": celery_driftsafe})
    task.refresh_from_db()
    assert task.next_slot_at is not None and task.jitter_seconds == 30
    assert task.due_at == task.next_slot_at + offset("nightly-1", task.next_slot_at, 30)
    _doctest(shell, "jitter")


def test_crontab_seconds_howto_sample_runs() -> None:
    (shell,) = samples("howto/crontab-seconds-and-aliases.md")
    _doctest(shell, "crontab-seconds-and-aliases")


def test_every_log_action_is_listed_in_the_docs() -> None:
    """Each ``extra={"action": ...}`` name the package uses appears in the log-actions page."""
    package = Path(__file__).resolve().parents[2] / "celery_driftsafe"
    page = (package.parent / "docs" / "reference" / "log-actions.md").read_text()
    listed = set(re.findall(r"`([a-z][a-z-]*)`", page))
    pattern = re.compile(
        r"\"action\": \"([a-z_-]+)\"|\baction=\"([a-z_-]+)\"|_log_extra\(\"([a-z_-]+)\""
    )
    used = set()
    for path in package.rglob("*.py"):
        for match in pattern.finditer(path.read_text()):
            used.add(next(group for group in match.groups() if group))
    used -= {"store_true", "append"}  # argparse, not log actions
    assert len(used) > 40  # the scan finds them
    assert sorted(used - listed) == []
    assert all("_" not in action for action in used), "one style: words joined by hyphens"


#: A test a page names: ``tests/<path>.py`` and, after ``::``, a class, a test, or both.
TEST_REFERENCE = re.compile(r"`(tests/[\w/]+\.py)((?:::\w+)*)(\[[^\]`]*\])?`?")


def _defined(module: Path, names: list[str]) -> bool:
    """Whether ``module`` defines the class or function path ``names`` (Class, test_x)."""
    import ast

    scope: list[ast.stmt] = ast.parse(module.read_text()).body
    for name in names:
        found = next(
            (
                node
                for node in scope
                if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                and node.name == name
            ),
            None,
        )
        if found is None:
            return False
        scope = found.body
    return True


@pytest.mark.parametrize(
    "page",
    [
        *sorted(str(page.relative_to(DOCS)) for page in DOCS.rglob("*.md")),
        "../README.md",
        "../CONTRIBUTING.md",
    ],
)
def test_every_test_a_page_names_exists(page: str) -> None:
    """The tests a page cites as its evidence (``tests/<layer>/test_x.py::test_y``) are there:
    the file, and the class and test it names. A test renamed or moved fails this until the
    page follows it."""
    root = DOCS.parent
    text = (DOCS / page).read_text()
    cited = TEST_REFERENCE.findall(text)
    if page == "explanation/drift-safety.md":
        assert len(cited) >= 20, "the guarantees index names its tests as tests/<path>::<test>"
    missing = [
        f"{path}{names}"
        for path, names, _ in cited
        if not (root / path).is_file() or not _defined(root / path, names.split("::")[1:])
    ]
    assert not missing, f"{page} names tests that do not exist: {missing}"


def _public_modules() -> set[str]:
    """The modules docs/reference/public-api.md names, in backticks: whole (with or without
    ``:name``), or as ``.sibling`` after a whole one on the same line."""
    found: set[str] = set()
    for line in (DOCS / "reference" / "public-api.md").read_text().splitlines():
        whole = re.findall(r"`(celery_driftsafe(?:\.\w+)*)", line)
        found.update(whole)
        if whole:
            parent = whole[0].rsplit(".", 1)[0]
            found.update(f"{parent}.{name}" for name in re.findall(r"`\.(\w+)`", line))
    return found


def _imports(text: str) -> set[str]:
    return set(re.findall(r"^\s*(?:>>> )?from (celery_driftsafe[\w.]*) import", text, re.M))


def test_the_docs_and_the_example_project_import_only_the_public_api() -> None:
    """What the guides show and the example project does, a project may copy: every import
    of the package they make names a module the public API lists (the names at the top of the
    package among them), not an internal one that may move."""
    public = _public_modules()
    assert {"celery_driftsafe", "celery_driftsafe.models", "celery_driftsafe.testing"} <= public
    assert "celery_driftsafe.testing.recording" in public  # a sibling named after a module
    root = DOCS.parent
    sources = [*DOCS.rglob("*.md"), root / "README.md", *(root / "example_project").rglob("*.py")]
    found = {
        (str(path.relative_to(root)), module)
        for path in sources
        if "_build" not in path.parts
        for module in _imports(path.read_text())
    }
    assert found, "no import of the package found: the pattern is wrong"
    internal = sorted((where, module) for where, module in found if module not in public)
    assert internal == [], internal


def _table_keys(text: str) -> list[str]:
    """The keys in the first column of the first Markdown table in ``text``."""
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = []
    for line in lines[first + 2 :]:
        if not line.startswith("|"):
            break
        table.append(line)
    return [line.split("`")[1] for line in table]


def test_the_settings_page_documents_every_setting_in_its_place() -> None:
    """The page opens with the settings a project sets (at most twelve), then the tuning
    ones, and lists every former key under "Renamed or removed": each where the code has it."""
    from celery_driftsafe import conf

    page = (DOCS / "reference" / "settings.md").read_text()
    first = _table_keys(page)
    assert len(first) <= 12
    assert first == list(conf.PROJECT_SETTINGS)
    tuning = _table_keys(page.split("\n## Tuning\n", 1)[1])
    assert tuning == list(conf.TUNING_SETTINGS)
    former = _table_keys(page.split("\n## Renamed or removed\n", 1)[1])
    assert sorted(former) == sorted(conf.DEPRECATED_SETTINGS)
