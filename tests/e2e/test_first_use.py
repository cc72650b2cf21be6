"""End to end: first use, the way Celery's Django guide sets a project up.

``django-admin startproject proj`` (SQLite), the guide's ``proj/celery.py``, and the settings
README's "Use it in your project" gives, pasted as they are (the Redis URL pointed at the test
server). Then what a new user types: ``manage.py check`` and ``migrate`` say nothing about this
package, and ``celery -A proj beat -S driftsafe`` (the short name, from the
``celery.beat_schedulers`` entry points), or ``celery -A proj beat`` with README's
``CELERY_BEAT_SCHEDULER = "driftsafe"``, starts, claims and publishes. The time authority is
``auto``: Redis' clock with README's ``REDIS_URL``; without it, this machine's clock, which the
beat says in one line at its start, once.

The package comes from a wheel built from this tree, not the editable checkout, and the project
has an app ``demoapp`` whose ``tasks.py`` holds a ``@shared_task`` (autodiscovered, so a web
process never imported it): the admin's add form offers that task and saves a periodic task for
it, and the samples of docs/howto/test-your-schedules.md pass as written beside a 1-s
``beat_schedule`` entry.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import redis

from celery_driftsafe.conf import default_key_prefix
from celery_driftsafe.testing.processes import Children
from tests import settings as test_settings
from tests.e2e.harness import BROKER_DB, E2E_REDIS_DB
from tests.skip_guard import configuration
from tests.support.first_use import (
    DEMO_TASKS,
    GUIDE_CELERY,
    GUIDE_INIT,
    README_REDIS,
    ROOT,
    readme_block,
)

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        test_settings.TEST_DB != "sqlite",
        reason=configuration("a new project's database is SQLite"),
    ),
]

#: The line the beat writes when ``auto`` is this machine's clock (log action local-authority).
LOCAL_LINE = "TIME_AUTHORITY 'auto' is this machine's clock"
PYTHON_FENCE = re.compile(r"```python\n(.*?)^ *```", re.S | re.M)


@pytest.fixture(scope="session")
def wheel_site(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Path:
    """The package as a user gets it: a wheel built from this tree, installed into a folder
    that comes first on the new project's path (before the editable checkout).

    Built once a run: the pytest-xdist workers of a run share one (the first to need it builds
    it under a lock, the others wait for it), as nothing writes to it once it is built; each
    build took 10-20 s here, and this module's tests go to whichever worker is free."""
    shared = tmp_path_factory.getbasetemp()
    if worker_id != "master":
        shared = shared.parent  # the run's base folder; each worker's is a folder in it
    out = shared / "first-use-wheel"
    site = out / "site"
    with (shared / "first-use-wheel.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "built").exists():
            shutil.rmtree(out, ignore_errors=True)  # a build that failed part way
            out.mkdir()
            pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
            subprocess.run(
                [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(ROOT)],
                check=True,
                capture_output=True,
            )
            [wheel] = out.glob("celery_driftsafe-*.whl")
            subprocess.run(
                [*pip, "install", "--no-deps", "--target", str(site), str(wheel)],
                check=True,
                capture_output=True,
            )
            (out / "built").touch()
    return site


def project_env(site: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    return env


def make_project(root: Path, *, queue: str, with_redis: bool, extra: str = "") -> None:
    """``startproject proj``, the guide's Celery app, an app ``demoapp`` with its tasks,
    README's settings pasted at the end."""
    subprocess.run(
        [sys.executable, "-m", "django", "startproject", "proj", str(root)],
        check=True,
        capture_output=True,
    )
    subprocess.run(
        [sys.executable, "-m", "django", "startapp", "demoapp"],
        check=True,
        capture_output=True,
        cwd=root,
    )
    (root / "proj" / "celery.py").write_text(GUIDE_CELERY)
    (root / "proj" / "__init__.py").write_text(GUIDE_INIT)
    (root / "demoapp" / "tasks.py").write_text(DEMO_TASKS)
    pasted = readme_block()
    assert README_REDIS in pasted, "README's settings no longer name the Redis this test swaps"
    redis_url = f"{test_settings.REDIS_SERVER}/{E2E_REDIS_DB}"
    settings = (root / "proj" / "settings.py").read_text()
    settings += "\n" + pasted.replace(README_REDIS, redis_url)
    if not with_redis:  # the user leaves out the optional line
        settings += 'DRIFTSAFE.pop("REDIS_URL")\n'
    settings += (
        'INSTALLED_APPS += ["demoapp"]\n'
        f'CELERY_BROKER_URL = "{test_settings.REDIS_SERVER}/{BROKER_DB}"\n'
        f'CELERY_TASK_DEFAULT_QUEUE = "{queue}"\n'
        'CELERY_BEAT_SCHEDULE = {"debug": {"task": "proj.celery.debug_task", "schedule": 0.5}}\n'
        + extra
    )
    (root / "proj" / "settings.py").write_text(settings)


def python(root: Path, env: dict[str, str], *args: str, timeout: float = 120) -> str:
    """Run ``python ARGS`` in the project as its user would; its output, which must end well."""
    result = subprocess.run(
        [sys.executable, *args],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    return output


def manage(root: Path, env: dict[str, str], *args: str) -> str:
    return python(root, env, "manage.py", *args)


@pytest.mark.parametrize("with_redis", [True, False], ids=["redis-url", "no-redis"])
def test_a_new_project_with_readme_settings(
    tmp_path: Path, wheel_site: Path, with_redis: bool
) -> None:
    assert 'CELERY_BEAT_SCHEDULER = "driftsafe"' in readme_block()
    root = tmp_path / "site"
    root.mkdir()
    queue = f"first-use-{uuid.uuid4().hex[:8]}"
    make_project(root, queue=queue, with_redis=with_redis)
    env = project_env(wheel_site)
    where = python(root, env, "-c", "import celery_driftsafe; print(celery_driftsafe.__file__)")
    assert where.startswith(str(wheel_site)), f"the project imports {where}, not the wheel"

    checked = manage(root, env, "check")
    assert "System check identified no issues" in checked, checked
    migrated = manage(root, env, "migrate")
    for said in (checked, migrated):
        assert not re.search(r"celery_driftsafe\.[EW]\d+|WARNINGS:", said), said
    assert "Applying celery_driftsafe." in migrated, migrated

    broker = redis.Redis.from_url(f"{test_settings.REDIS_SERVER}/{BROKER_DB}")
    children = Children(tmp_path, cwd=root)
    try:
        # `-S driftsafe` in one run; in the other the README's CELERY_BEAT_SCHEDULER alone
        scheduler = ["-S", "driftsafe"] if with_redis else []
        beat = children.start(
            "beat",
            ["-A", "proj", "beat", *scheduler, "--loglevel", "INFO", "-s", "beat-file"],
            env,
        )
        deadline = time.monotonic() + 90
        while broker.llen(queue) < 4 and beat.alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        published = broker.llen(queue)
        codes = children.stop(beat, timeout=60)
    finally:
        children.close()
        broker.delete(queue)
        broker.close()
        keys = redis.Redis.from_url(f"{test_settings.REDIS_SERVER}/{E2E_REDIS_DB}")
        prefix = default_key_prefix(
            {"ENGINE": "django.db.backends.sqlite3", "NAME": str(root / "db.sqlite3")}
        )
        for key in keys.scan_iter(f"{prefix}:*"):
            keys.delete(key)
        keys.close()
    log = beat.log_text(tail=200_000)
    assert published >= 4, f"the beat published {published} messages\n{log[-5000:]}"
    assert codes == {"beat": 0}, log[-5000:]
    assert "Traceback" not in log, log[-5000:]
    expected = "redis" if with_redis else "local"
    assert f"time authority -> {expected} (auto)" in log, log[-5000:]  # the banner
    assert f"up (authority {expected})" in log, log[-5000:]
    # several rounds claimed (four slots half a second apart), one line about the local clock
    assert log.count(LOCAL_LINE) == (0 if with_redis else 1), log[-5000:]


#: The settings the testing how-to's samples assume (its first sample's app), beside a 1-s
#: entry: the kit must step only the tasks a test asks about.
HOWTO_SETTINGS = """\
from celery.schedules import crontab  # noqa: E402

CELERY_TIMEZONE = "Europe/Berlin"
CELERY_BEAT_SCHEDULE = {
    "tick-every-second": {"task": "demoapp.tasks.tick", "schedule": 1.0},
    "nightly-report": {
        "task": "reports.nightly",
        "schedule": crontab(minute=30, hour=2),
        "kwargs": {"format": "pdf"},
    },
}
"""


def test_the_admin_and_the_testing_kit_know_the_apps_tasks(
    tmp_path: Path, wheel_site: Path
) -> None:
    """The admin of a web process that never ran a worker offers and saves a task of
    ``demoapp/tasks.py`` (in the Celery app's time zone), and the testing how-to's samples pass
    as written in a project whose ``beat_schedule`` has a 1-s entry."""
    root = tmp_path / "site"
    root.mkdir()
    make_project(
        root, queue=f"first-use-{uuid.uuid4().hex[:8]}", with_redis=True, extra=HOWTO_SETTINGS
    )
    env = project_env(wheel_site)
    manage(root, env, "migrate")

    (root / "admin_add.py").write_text(ADMIN_SCRIPT)
    saved = python(root, env, "admin_add.py")
    assert "saved demoapp.tasks.tick in Europe/Berlin" in saved, saved

    page = (ROOT / "docs" / "howto" / "test-your-schedules.md").read_text()
    tests = [textwrap.dedent(b) for b in PYTHON_FENCE.findall(page) if "def test_" in b]
    count = sum(sample.count("def test_") for sample in tests)
    assert count >= 4, "the testing how-to lost its test samples"
    (root / "test_schedules.py").write_text("\n\n".join(tests))
    result = python(
        root,
        env,
        *("-m", "pytest", "-q", "-p", "no:cacheprovider", "--ds", "proj.settings"),
        *("-o", "timeout=120", "test_schedules.py"),
        timeout=300,
    )
    assert f"{count} passed" in result, result


#: The admin's add form as a browser submits it: every field's value as the page gives it,
#: then the few a user types; prints what was saved.
ADMIN_SCRIPT = """\
import os
from html.parser import HTMLParser

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")
django.setup()

from django.contrib.auth import get_user_model
from django.test import Client
from django.test.utils import setup_test_environment

from celery_driftsafe.models import PeriodicTask

ADD = "/admin/celery_driftsafe/periodictask/add/"


class Form(HTMLParser):
    def __init__(self):
        super().__init__()
        self.data, self.offered, self.select, self.textarea = {}, set(), None, None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        name = a.get("name")
        if tag == "input" and name and a.get("type") not in ("submit", "checkbox"):
            self.data[name] = a.get("value") or ""
        elif tag == "input" and name and "checked" in a:
            self.data[name] = "on"
        elif tag == "select" and name:
            self.select = name
            if "multiple" not in a:  # a browser sends nothing for a multiple select left empty
                self.data.setdefault(name, "")
        elif tag == "option" and self.select and "selected" in a:
            self.data[self.select] = a.get("value") or ""
        elif tag == "option" and not self.select and a.get("value"):
            self.offered.add(a["value"])  # a datalist's suggestions
        elif tag == "textarea" and name:
            self.textarea = name
            self.data[name] = ""

    def handle_endtag(self, tag):
        if tag == "select":
            self.select = None
        elif tag == "textarea":
            self.textarea = None

    def handle_data(self, data):
        if self.textarea:
            self.data[self.textarea] += data.strip("\\n")


setup_test_environment()  # the test client's host, "testserver", is allowed
get_user_model().objects.create_superuser("admin", "admin@example.com", "first-use")
client = Client()
assert client.login(username="admin", password="first-use")
page = client.get(ADD)
assert page.status_code == 200, page.status_code
form = Form()
form.feed(page.content.decode())
assert "demoapp.tasks.tick" in form.offered, sorted(n for n in form.offered if "." in n)
data = {**form.data, "name": "tick from the admin", "task": "demoapp.tasks.tick",
        "schedule_kind": "crontab", "crontab_minute": "*/5 * * * *", "_save": "Save"}
response = client.post(ADD, data)
if response.status_code != 302:
    raise SystemExit(f"not saved: {response.context['adminform'].form.errors}")
saved = PeriodicTask.objects.get(name="tick from the admin")
print("saved", saved.task, "in", saved.timezone)
"""
