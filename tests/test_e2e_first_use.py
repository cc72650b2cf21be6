"""End to end: first use, the way Celery's Django guide sets a project up.

``django-admin startproject proj`` (SQLite), the guide's ``proj/celery.py``, and the settings
README's "Use it in your project" gives, pasted as they are (the Redis URL pointed at the test
server). Then what a new user types: ``manage.py check`` and ``migrate`` say nothing about this
package, and ``celery -A proj beat -S driftsafe`` (the short name, from the
``celery.beat_schedulers`` entry points), or ``celery -A proj beat`` with README's
``CELERY_BEAT_SCHEDULER = "driftsafe"``, starts, claims and publishes. The time authority is
``auto``: Redis' clock with README's ``REDIS_URL``; without it, this machine's clock, which the
beat says in one line at its start, once.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import redis

from celery_driftsafe.conf import default_key_prefix
from celery_driftsafe.testing.processes import Children
from tests import settings as test_settings
from tests.e2e.harness import BROKER_DB, E2E_REDIS_DB

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        test_settings.TEST_DB != "sqlite", reason="a new project's database is SQLite"
    ),
]

#: Celery's "First steps with Django": proj/celery.py and proj/__init__.py.
CELERY_PY = """\
import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")

app = Celery("proj")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@app.task(bind=True, ignore_result=True)
def debug_task(self):
    print(f"Request: {self.request!r}")
"""
INIT_PY = """\
from .celery import app as celery_app

__all__ = ("celery_app",)
"""
#: The line the beat writes when ``auto`` is this machine's clock (log action local-authority).
LOCAL_LINE = "TIME_AUTHORITY 'auto' is this machine's clock"
README_REDIS = "redis://127.0.0.1:6379/0"
README = Path(__file__).resolve().parent.parent / "README.md"


def readme_block() -> str:
    text = README.read_text()
    section = text[text.index("## Use it in your project") :]
    start = section.index("```python\n") + len("```python\n")
    return section[start : section.index("```", start)]


def make_project(root: Path, *, queue: str, with_redis: bool) -> None:
    """``startproject proj``, the guide's Celery app, README's settings pasted at the end."""
    subprocess.run(
        [sys.executable, "-m", "django", "startproject", "proj", str(root)],
        check=True,
        capture_output=True,
    )
    (root / "proj" / "celery.py").write_text(CELERY_PY)
    (root / "proj" / "__init__.py").write_text(INIT_PY)
    pasted = readme_block()
    assert README_REDIS in pasted, "README's settings no longer name the Redis this test swaps"
    redis_url = f"{test_settings.REDIS_SERVER}/{E2E_REDIS_DB}"
    settings = (root / "proj" / "settings.py").read_text()
    settings += "\n" + pasted.replace(README_REDIS, redis_url)
    if not with_redis:  # the user leaves out the optional line
        settings += 'DRIFTSAFE.pop("REDIS_URL")\n'
    settings += (
        f'CELERY_BROKER_URL = "{test_settings.REDIS_SERVER}/{BROKER_DB}"\n'
        f'CELERY_TASK_DEFAULT_QUEUE = "{queue}"\n'
        'CELERY_BEAT_SCHEDULE = {"debug": {"task": "proj.celery.debug_task", "schedule": 0.5}}\n'
    )
    (root / "proj" / "settings.py").write_text(settings)


def manage(root: Path, env: dict[str, str], *args: str) -> str:
    result = subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    return output


@pytest.mark.parametrize("with_redis", [True, False], ids=["redis-url", "no-redis"])
def test_a_new_project_with_readme_settings(tmp_path: Path, with_redis: bool) -> None:
    assert 'CELERY_BEAT_SCHEDULER = "driftsafe"' in readme_block()
    root = tmp_path / "site"
    root.mkdir()
    queue = f"first-use-{uuid.uuid4().hex[:8]}"
    make_project(root, queue=queue, with_redis=with_redis)
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}

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
