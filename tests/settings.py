"""Django settings for the test suite.

``DRIFTSAFE_TEST_DB`` picks the database: ``sqlite`` (default) or ``postgres`` (PostgreSQL on
``DRIFTSAFE_TEST_PG_HOST``:``DRIFTSAFE_TEST_PG_PORT``, user ``DRIFTSAFE_TEST_PG_USER``; the test
runner creates and drops its own database). Redis tests use db ``DRIFTSAFE_TEST_REDIS_DB``
(default 11) of ``DRIFTSAFE_TEST_REDIS_URL``'s server and the key prefix ``driftsafe-test``;
the suite also uses the next four databases (broker, e2e broker, locks, e2e runs).

Under pytest-xdist each worker gets five databases of its own: worker ``gw<i>`` starts at
``DRIFTSAFE_TEST_REDIS_DB + 5 * i``. Without the variable the workers take the top of a
16-database Redis (a fresh server's count), ``16 - 5 * workers`` .. 15: 11..15 for one
process, as before; 6..15 for two workers; 1..15 for three. Test databases are named per
process, so workers never share one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import django

BASE_DIR = Path(__file__).resolve().parent
TEST_DB = os.environ.get("DRIFTSAFE_TEST_DB", "sqlite")
REDIS_SERVER = os.environ.get("DRIFTSAFE_TEST_REDIS_URL", "redis://127.0.0.1:6379")
#: Redis databases one test process uses: REDIS_DB .. REDIS_DB + 4; the run's workers use
#: FIRST_REDIS_DB .. FIRST_REDIS_DB + 5 * workers - 1.
REDIS_DBS_PER_PROCESS = 5
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or "1")
_WORKER = int((os.environ.get("PYTEST_XDIST_WORKER") or "gw0").removeprefix("gw"))
FIRST_REDIS_DB = int(
    os.environ.get("DRIFTSAFE_TEST_REDIS_DB") or 16 - REDIS_DBS_PER_PROCESS * _WORKERS
)
if _WORKER >= _WORKERS:
    # pytest-xdist names a worker that replaces a crashed one gw<N>, gw<N+1>...: which range
    # it may take over is unknown (tests/run.sh runs with --max-worker-restart 0).
    raise RuntimeError(
        f"test worker gw{_WORKER} of {_WORKERS} replaces a crashed one, and its Redis databases "
        "are unknown: run with --max-worker-restart 0 and see why the worker crashed"
    )
if FIRST_REDIS_DB < 0:
    raise RuntimeError(
        f"{_WORKERS} test workers need {REDIS_DBS_PER_PROCESS * _WORKERS} Redis databases, more "
        "than a default server's 16 hold: set DRIFTSAFE_TEST_REDIS_DB to the first of a free range "
        "(and raise the server's `databases`), or run fewer workers"
    )
REDIS_DB = FIRST_REDIS_DB + REDIS_DBS_PER_PROCESS * _WORKER
REDIS_URL = f"{REDIS_SERVER}/{REDIS_DB}"

SECRET_KEY = "tests-only-not-secret"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
ROOT_URLCONF = "tests.urls"
ALLOWED_HOSTS = ["*"]
STATIC_URL = "/static/"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django_celery_results",
    "celery_driftsafe",
]
# The admin tests' superusers: Django's default hasher (a million PBKDF2 rounds) took most
# of a second a test here.
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

DATABASES: dict[str, dict[str, Any]]
if TEST_DB == "postgres":
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": os.environ.get("DRIFTSAFE_TEST_PG_NAME", "driftsafe"),
            "USER": os.environ.get("DRIFTSAFE_TEST_PG_USER", "postgres"),
            "HOST": os.environ.get("DRIFTSAFE_TEST_PG_HOST", "127.0.0.1"),
            "PORT": os.environ.get("DRIFTSAFE_TEST_PG_PORT", "5432"),
            # one test database per run, so concurrent runs on one server never collide
            "TEST": {
                "NAME": os.environ.get("DRIFTSAFE_TEST_PG_TEST_NAME")
                or f"test_driftsafe_{os.getpid()}"
            },
        }
    }
elif TEST_DB == "mysql":
    # MySQL 8 / MariaDB 10.6+ (needs mysqlclient): not part of tests/run.sh yet.
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.mysql",
            "NAME": os.environ.get("DRIFTSAFE_TEST_MYSQL_NAME", "driftsafe"),
            "USER": os.environ.get("DRIFTSAFE_TEST_MYSQL_USER", "root"),
            "HOST": os.environ.get("DRIFTSAFE_TEST_MYSQL_HOST", "127.0.0.1"),
            "PORT": os.environ.get("DRIFTSAFE_TEST_MYSQL_PORT", "3306"),
            "TEST": {"NAME": f"test_driftsafe_{os.getpid()}"},
        }
    }
elif TEST_DB == "sqlite":
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": str(BASE_DIR / "driftsafe-tests.sqlite3"),
            # A file, not SQLite's shared-cache memory database: that one has table locks
            # that ignore the busy timeout, and beat subprocesses could not open it.
            "TEST": {
                "NAME": os.environ.get("DRIFTSAFE_TEST_SQLITE_NAME")
                or str(BASE_DIR / f"test-driftsafe-{os.getpid()}.sqlite3")
            },
            "OPTIONS": {"timeout": 30},
        }
    }
    if django.VERSION >= (5, 1):
        # Take the write lock at BEGIN: no lock-upgrade deadlocks between claiming beats.
        DATABASES["default"]["OPTIONS"]["transaction_mode"] = "IMMEDIATE"
else:
    raise RuntimeError(f"DRIFTSAFE_TEST_DB={TEST_DB!r}: use 'sqlite', 'postgres' or 'mysql'")

DRIFTSAFE = {
    "REDIS_URL": REDIS_URL,
    "KEY_PREFIX": "driftsafe-test",
    "TIME_AUTHORITY": "redis" if TEST_DB == "sqlite" else "database",
    # A beat's claim process (a spawned interpreter) would make in-process rounds depend on
    # when it gets ready: tests/test_claim_process.py turns it on and waits for it.
    "CLAIM_PROCESS": False,
}

CELERY_BROKER_URL = "memory://"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
