"""Django settings for beat/worker subprocesses started by the end-to-end tests.

Everything specific to one run comes from the environment (set by :mod:`tests.e2e.harness`):
``DRIFTSAFE_E2E_DB`` (``postgresql:<name>`` or ``sqlite:<path>``), ``DRIFTSAFE_E2E_BROKER``,
``DRIFTSAFE_E2E_REDIS``, ``DRIFTSAFE_E2E_PREFIX``, ``DRIFTSAFE_E2E_AUTHORITY`` and
``DRIFTSAFE_E2E_BEAT_SCHEDULE`` (JSON: name -> seconds).
"""

from __future__ import annotations

import json
import os

import django

from tests.settings import INSTALLED_APPS, SECRET_KEY, TEMPLATES, postgres_server  # noqa: F401

_kind, _, _name = os.environ["DRIFTSAFE_E2E_DB"].partition(":")
if _kind == "postgresql":
    # The test PostgreSQL (DRIFTSAFE_TEST_POSTGRES_URL, as tests/settings.py reads it); a run
    # may send a process elsewhere with DRIFTSAFE_E2E_PG_HOST / _PORT / _USER, say through
    # PgBouncer (tests/e2e/test_pgbouncer.py).
    _server = postgres_server()
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": _name,
            "USER": os.environ.get("DRIFTSAFE_E2E_PG_USER") or _server["USER"],
            "PASSWORD": _server["PASSWORD"],
            "HOST": os.environ.get("DRIFTSAFE_E2E_PG_HOST") or _server["HOST"],
            "PORT": os.environ.get("DRIFTSAFE_E2E_PG_PORT") or _server["PORT"],
        }
    }
else:
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": _name,
            "OPTIONS": {"timeout": 30},
        }
    }
    if django.VERSION >= (5, 1):
        DATABASES["default"]["OPTIONS"]["transaction_mode"] = "IMMEDIATE"
TIME_ZONE = "UTC"
# A run may turn time zone support off, to see a beat refuse to start (check E010).
USE_TZ = os.environ.get("DRIFTSAFE_E2E_USE_TZ", "true") == "true"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
DRIFTSAFE = {
    "REDIS_URL": os.environ["DRIFTSAFE_E2E_REDIS"],
    "KEY_PREFIX": os.environ["DRIFTSAFE_E2E_PREFIX"],
    "TIME_AUTHORITY": os.environ.get("DRIFTSAFE_E2E_AUTHORITY", "database"),
    "NODE_DEAD_AFTER_SECONDS": float(os.environ.get("DRIFTSAFE_E2E_DEAD_AFTER", "30.0")),
    "CELERY_APP": "tests.e2e.celery_app:app",
    "MISFIRE_GRACE_SECONDS": float(os.environ.get("DRIFTSAFE_E2E_MISFIRE_GRACE", "30.0")),
}
# Constants shortened so that a run takes seconds (celery_driftsafe.conf.internal_settings).
DRIFTSAFE_INTERNALS = {
    "LEASE_SECONDS": float(os.environ.get("DRIFTSAFE_E2E_LEASE", "5.0")),
    "HEARTBEAT_INTERVAL_SECONDS": 1.0,
}
# The loop's longest wait is Celery's own setting.
CELERY_BEAT_MAX_LOOP_INTERVAL = float(os.environ.get("DRIFTSAFE_E2E_MAX_LOOP", "1.0"))
for _name in (
    "RECONCILE_INTERVAL_SECONDS",  # test_e2e_task.py
    "RESULT_LOOKUP_SECONDS",
    "DEADLINE_CHECK_INTERVAL_SECONDS",  # test_e2e_deadlines.py
):
    if os.environ.get(f"DRIFTSAFE_E2E_{_name}"):
        DRIFTSAFE_INTERNALS[_name] = float(os.environ[f"DRIFTSAFE_E2E_{_name}"])
if os.environ.get("DRIFTSAFE_E2E_BACKFILL_MAX_SLOTS"):  # tests/test_e2e_backfill.py
    DRIFTSAFE["BACKFILL_MAX_SLOTS"] = int(os.environ["DRIFTSAFE_E2E_BACKFILL_MAX_SLOTS"])
if os.environ.get("DRIFTSAFE_E2E_CLAIM_BATCH_SIZE"):  # tests/test_e2e_claim_process.py
    DRIFTSAFE_INTERNALS["CLAIM_BATCH_SIZE"] = int(os.environ["DRIFTSAFE_E2E_CLAIM_BATCH_SIZE"])
if os.environ.get("DRIFTSAFE_E2E_METRICS_PORT"):  # tests/test_e2e_metrics.py
    DRIFTSAFE["METRICS_PORT"] = int(os.environ["DRIFTSAFE_E2E_METRICS_PORT"])
    DRIFTSAFE["METRICS_ADDRESS"] = "127.0.0.1"
if os.environ.get("DRIFTSAFE_E2E_WORKER_METRICS_PORT"):
    DRIFTSAFE["WORKER_METRICS_PORT"] = int(os.environ["DRIFTSAFE_E2E_WORKER_METRICS_PORT"])
    DRIFTSAFE["METRICS_ADDRESS"] = "127.0.0.1"
CELERY_BROKER_URL = os.environ["DRIFTSAFE_E2E_BROKER"]
# One queue per run, so concurrent runs on one Redis never read each other's messages.
CELERY_TASK_DEFAULT_QUEUE = os.environ["DRIFTSAFE_E2E_QUEUE"]
CELERY_BEAT_SCHEDULE = {
    name: {"task": "e2e.tick", "schedule": float(seconds)}
    for name, seconds in json.loads(os.environ.get("DRIFTSAFE_E2E_BEAT_SCHEDULE", "{}")).items()
}
CELERY_TIMEZONE = "UTC"
