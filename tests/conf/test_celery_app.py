"""The project's Celery app as the admin and the commands see it: its task modules imported as a
worker imports them, its time zone, and how ``celery -A`` finds it."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_driftsafe import celery_app
from celery_driftsafe.exceptions import TaskModulesError

TASKS = """\
from celery import shared_task


@shared_task
def tick():
    return "tick"
"""


@pytest.fixture
def modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """Three task modules on ``sys.path``, under names of their own: a package whose
    ``tasks.py`` autodiscovery finds, a module for ``imports`` and one for ``include``.
    Forgotten by ``sys.modules`` afterwards."""
    tag = uuid.uuid4().hex[:8]
    names = {"package": f"auto_{tag}", "imports": f"imported_{tag}", "include": f"included_{tag}"}
    (tmp_path / names["package"]).mkdir()
    (tmp_path / names["package"] / "__init__.py").write_text("")
    (tmp_path / names["package"] / "tasks.py").write_text(TASKS)
    (tmp_path / f"{names['imports']}.py").write_text(TASKS)
    (tmp_path / f"{names['include']}.py").write_text(TASKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield names
    for name in list(sys.modules):
        if name.endswith(tag) or name.startswith(f"{names['package']}."):
            del sys.modules[name]


def _app(names: dict[str, str]) -> Celery:
    app = Celery("modules", include=[names["include"]], set_as_current=False)
    app.conf.imports = [names["imports"]]
    app.autodiscover_tasks([names["package"]])  # lazy, as in Celery's Django guide
    return app


def test_task_modules_are_loaded_as_a_worker_loads_them_once(modules: dict[str, str]) -> None:
    app = _app(modules)
    expected = [
        f"{modules['package']}.tasks.tick",
        f"{modules['imports']}.tick",
        f"{modules['include']}.tick",
    ]
    assert not set(expected) & set(celery_app.registered_task_names(app, load=False))
    assert set(expected) <= set(celery_app.registered_task_names(app))
    # Once per app and process: a second call imports nothing again.
    del sys.modules[modules["imports"]]
    celery_app.load_task_modules(app)
    assert modules["imports"] not in sys.modules


def test_a_module_that_fails_to_import_is_named_and_tried_again(
    modules: dict[str, str], tmp_path: Path
) -> None:
    tasks = tmp_path / modules["package"] / "tasks.py"
    tasks.write_text("import not_installed_anywhere\n")
    app = _app(modules)
    with pytest.raises(TaskModulesError) as raised:
        celery_app.load_task_modules(app)
    assert raised.value.module == repr(f"{modules['package']}.tasks")
    assert str(raised.value) == (
        f"importing the task module '{modules['package']}.tasks' failed: "
        "ModuleNotFoundError: No module named 'not_installed_anywhere'"
    )
    tasks.write_text(TASKS + "\n# fixed\n")
    assert f"{modules['package']}.tasks.tick" in celery_app.registered_task_names(app)


def test_a_missing_or_uncompilable_module_is_named(modules: dict[str, str], tmp_path: Path) -> None:
    app = Celery("missing", set_as_current=False)
    app.conf.imports = [f"{modules['imports']}_nowhere"]
    with pytest.raises(TaskModulesError, match=f"'{modules['imports']}_nowhere' failed"):
        celery_app.load_task_modules(app)
    (tmp_path / f"{modules['imports']}.py").write_text("def tick(:\n")
    app = Celery("uncompilable", set_as_current=False)
    app.conf.imports = [modules["imports"]]
    with pytest.raises(TaskModulesError) as raised:
        celery_app.load_task_modules(app)
    assert raised.value.module == f"at {tmp_path / modules['imports']}.py"
    assert "SyntaxError" in str(raised.value)


def test_the_app_s_time_zone_is_the_one_celery_evaluates_crontabs_in() -> None:
    app = Celery("zones", set_as_current=False)
    assert celery_app.app_time_zone(app) == "UTC"  # none set: Celery's UTC
    app.conf.timezone = "Asia/Kolkata"
    assert celery_app.app_time_zone(app) == "Asia/Kolkata"
    app.conf.timezone = "Mars/Olympus_Mons"
    assert celery_app.app_time_zone(app) == "UTC"  # unknown here: not offered


def test_the_celery_a_argument_names_the_app_only_where_celery_finds_it(
    settings: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    main = f"proj_{uuid.uuid4().hex[:8]}"
    (tmp_path / main).mkdir()
    (tmp_path / main / "__init__.py").write_text(
        f"from celery import Celery\n\napp = Celery({main!r}, set_as_current=False)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        found = __import__(main).app
        assert celery_app.app_argument(found) == main  # celery -A proj finds it
    finally:
        sys.modules.pop(main, None)
    assert celery_app.app_argument(Celery("not a module", set_as_current=False)) == (
        celery_app.APP_PLACEHOLDER
    )
    # A main name that leads to another app is not this app's.
    assert celery_app.app_argument(Celery("tests.admin.test_admin", set_as_current=False)) == (
        celery_app.APP_PLACEHOLDER
    )
    settings.DRIFTSAFE = {**settings.DRIFTSAFE, "CELERY_APP": "tests.admin.test_admin:DOTTED_APP"}
    assert celery_app.app_argument() == "tests.admin.test_admin:DOTTED_APP"


def test_a_web_process_s_logging_and_url_prefix_survive_the_loading(
    settings: Any, modules: dict[str, str]
) -> None:
    """Celery's Django fix-up calls ``django.setup()`` before the task modules are imported;
    in a process whose Django is set up, doing it again would configure logging anew (a
    ``disable_existing_loggers`` config silences every logger made since start-up) and reset
    the URL prefix of the request being served."""
    import logging

    from django.urls import get_script_prefix, set_script_prefix

    settings.LOGGING = {"version": 1, "disable_existing_loggers": True}
    made_since = logging.getLogger(f"driftsafe-test.made-since-start-up.{uuid.uuid4().hex}")
    loggers = [made_since, *logging.Logger.manager.loggerDict.values()]
    was_disabled = {id(lg): lg.disabled for lg in loggers if isinstance(lg, logging.Logger)}
    app = Celery("web", set_as_current=False, include=[modules["include"]])
    app.config_from_object("django.conf:settings", namespace="CELERY")
    set_script_prefix("/under/a/path/")
    try:
        celery_app.load_task_modules(app)
        assert f"{modules['include']}.tick" in app.tasks
        assert get_script_prefix() == "/under/a/path/"
        assert not made_since.disabled
    finally:
        set_script_prefix("/")
        for lg in loggers:  # should the set-up have run: every logger speaks again
            if isinstance(lg, logging.Logger):
                lg.disabled = was_disabled[id(lg)]
