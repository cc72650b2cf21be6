"""First use, the way Celery's "First steps with Django" guide sets a project up.

``django-admin startproject proj``, ``proj/celery.py`` as the guide writes it (``Celery('proj')``,
``config_from_object('django.conf:settings', namespace='CELERY')``, ``autodiscover_tasks()``),
``proj/__init__.py`` importing the app, an app ``demoapp`` whose ``tasks.py`` holds a
``@shared_task``, and the settings README gives, pasted as they are (its Redis URL pointed at
the test server). Each step runs in a fresh Python process, so nothing is imported ahead: the
admin's process is a web process that never ran a worker, where Celery's autodiscovery has not
happened.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests import settings as test_settings
from tests.e2e.harness import E2E_REDIS_DB
from tests.skip_guard import configuration
from tests.support.admin_forms import form_data
from tests.support.first_use import (
    DEMO_TASKS,
    GUIDE_CELERY,
    GUIDE_INIT,
    README_REDIS,
    readme_block,
)

#: A module of ``CELERY_IMPORTS`` (Celery's ``imports``), which autodiscovery does not find.
DEMO_JOBS = """\
from celery import shared_task


@shared_task
def cleanup():
    return "clean"
"""
#: Appended to startproject's settings after README's: the app, a broker, a task module of
#: CELERY_IMPORTS, a beat_schedule (one name misspelt), the project's time zone.
SETTINGS = """
INSTALLED_APPS += ["demoapp"]
CELERY_BROKER_URL = "memory://"
CELERY_IMPORTS = ["demoapp.jobs"]
CELERY_BEAT_SCHEDULE = {
    "tick-every-minute": {"task": "demoapp.tasks.tick", "schedule": 60.0},
    "misspelt": {"task": "demoapp.tasks.tock", "schedule": 60.0},
}
TIME_ZONE = "Europe/Paris"
"""

ADD = "/admin/celery_driftsafe/periodictask/add/"
TASKS = "/admin/celery_driftsafe/periodictask/"

#: What the admin's process does, with Django's test client; prints one JSON document.
ADMIN_SCRIPT = """\
import json, sys
import django

django.setup()
from django.test.utils import setup_test_environment

setup_test_environment()
from django.contrib.auth.models import User
from django.test import Client
from celery_driftsafe.models import PeriodicTask

add, tasks, data = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
out = {"imported_before": sorted(m for m in ("demoapp.tasks", "demoapp.jobs") if m in sys.modules)}
PeriodicTask.objects.all().delete()  # each run starts afresh
admin = User.objects.filter(username="admin").first()
client = Client()
client.force_login(admin or User.objects.create_superuser("admin", "admin@example.com", "pw"))
page = client.get(add)
out["add_status"] = page.status_code
out["page"] = page.content.decode()
out["initial_timezone"] = page.context["adminform"].form["timezone"].value()
saved = client.post(add, data)
out["save_status"] = saved.status_code
if saved.status_code == 200:
    out["errors"] = {k: list(v) for k, v in saved.context["adminform"].form.errors.items()}
out["saved"] = list(PeriodicTask.objects.values_list("name", "task", "timezone"))
task = PeriodicTask.objects.create(
    name="by-code", task="demoapp.tasks.tick", schedule_kind="interval", interval_every=60
)
ran = client.post(tasks, {"action": "run_now", "_selected_action": [task.pk]}, follow=True)
out["run_now_status"] = ran.status_code
out["run_now_messages"] = [str(m) for m in ran.context["messages"]]
print(json.dumps(out))
"""


def _python(project: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "CELERY_"))}
    env["DJANGO_SETTINGS_MODULE"] = "proj.settings"
    return subprocess.run(
        [sys.executable, *args],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def guide_project(where: Path, *, tasks: str = DEMO_TASKS) -> Path:
    """A project in the guide's layout under ``where`` (``demoapp/tasks.py`` holds ``tasks``),
    migrated."""
    where.mkdir(parents=True, exist_ok=True)
    made = _python(where, "-m", "django", "startproject", "proj", str(where))
    assert made.returncode == 0, made.stderr
    app = _python(where, "manage.py", "startapp", "demoapp")
    assert app.returncode == 0, app.stderr
    (where / "proj" / "celery.py").write_text(GUIDE_CELERY)
    (where / "proj" / "__init__.py").write_text(GUIDE_INIT)
    (where / "demoapp" / "tasks.py").write_text(tasks)
    (where / "demoapp" / "jobs.py").write_text(DEMO_JOBS)
    readme = readme_block().replace(README_REDIS, f"{test_settings.REDIS_SERVER}/{E2E_REDIS_DB}")
    with (where / "proj" / "settings.py").open("a") as settings:
        settings.write("\n" + readme + SETTINGS)
    migrated = _python(where, "manage.py", "migrate", "--verbosity", "0")
    assert migrated.returncode == 0, migrated.stderr
    return where


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return guide_project(tmp_path_factory.mktemp("guide") / "site")


def _admin(project: Path, **fields: Any) -> dict[str, Any]:
    data = form_data(name="tick", task="demoapp.tasks.tick", args="[]", **fields)
    result = _python(project, "-c", ADMIN_SCRIPT, ADD, TASKS, json.dumps(data))
    assert result.returncode == 0, result.stdout + result.stderr
    out: dict[str, Any] = json.loads(result.stdout.splitlines()[-1])
    return out


def test_the_admin_knows_the_tasks_of_autodiscovered_and_imported_modules(project: Path) -> None:
    out = _admin(project, timezone="America/New_York")
    # The web process had imported neither module: Celery imports them in workers and beats.
    assert out["imported_before"] == []
    assert out["add_status"] == 200
    assert '<option value="demoapp.tasks.tick">' in out["page"]
    assert '<option value="demoapp.jobs.cleanup">' in out["page"]
    assert '<option value="proj.celery.debug_task">' in out["page"]
    assert out["save_status"] == 302, out.get("errors")
    assert ["tick", "demoapp.tasks.tick", "America/New_York"] in out["saved"]
    ran = out["run_now_messages"][-1]  # after the add's own message
    assert ran.startswith("Run now by-code") and ran.endswith(": dispatched"), ran


def test_a_new_crontab_task_starts_in_the_celery_app_s_time_zone(project: Path) -> None:
    # TIME_ZONE = "Europe/Paris" and no CELERY_TIMEZONE: Celery's app.conf.timezone is Paris.
    assert _admin(project)["initial_timezone"] == "Europe/Paris"


def test_a_broken_task_module_is_a_form_error_naming_it_not_a_server_error(
    tmp_path: Path,
) -> None:
    project = guide_project(tmp_path / "site", tasks="import not_installed_anywhere\n")
    out = _admin(project)
    assert out["add_status"] == 200  # the page still opens, suggesting what is registered
    assert '<option value="proj.celery.debug_task">' in out["page"]
    assert out["save_status"] == 200 and out["saved"] == []
    (error,) = out["errors"]["task"]
    assert "demoapp.tasks" in error and "not_installed_anywhere" in error, error
    assert out["run_now_status"] == 200
    (message,) = out["run_now_messages"]
    assert message.startswith("Cannot run now") and "demoapp.tasks" in message, message


def test_driftsafe_import_warns_only_about_names_no_module_registers(project: Path) -> None:
    result = _python(project, "manage.py", "driftsafe_import", "--dry-run", "--no-color")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "tick-every-minute (beat_schedule)" in result.stdout
    assert "'demoapp.tasks.tick' is not registered" not in result.stdout
    assert "warning: task 'demoapp.tasks.tock' is not registered" in result.stdout


def test_driftsafe_status_names_the_app_in_its_hint(project: Path) -> None:
    result = _python(project, "manage.py", "driftsafe_status", "--no-color")
    assert result.returncode == 2, result.stdout + result.stderr
    hint = "`celery -A proj beat -S driftsafe`"
    assert hint in result.stderr


@pytest.mark.e2e
@pytest.mark.skipif(
    test_settings.TEST_DB != "sqlite",
    reason=configuration("the guide's project runs on SQLite: once, there"),
)
def test_the_beat_banner_shows_the_node_that_registers_and_the_loop_s_interval(
    project: Path,
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "CELERY_"))}
    log = project / "beat.log"
    with log.open("wb") as out:
        beat = subprocess.Popen(
            [sys.executable, "-m", "celery", "--no-color", "-A", "proj", "beat", "-l", "info"],
            cwd=project,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        registered: list[str] = []
        while not registered and time.monotonic() < deadline and beat.poll() is None:
            time.sleep(0.2)
            with contextlib.closing(sqlite3.connect(project / "db.sqlite3", timeout=10)) as db:
                rows = db.execute("SELECT node_id FROM celery_driftsafe_beatnode").fetchall()
            registered = [row[0] for row in rows]
    finally:
        beat.send_signal(signal.SIGTERM)
        beat.wait(timeout=60)
    text = log.read_text()
    assert registered, text
    (node,) = registered
    assert f". driftsafe node -> {node}\n" in text, text
    assert ". maxinterval -> 1.00 second (1.0s)" in text, text
