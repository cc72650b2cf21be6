"""Django settings for the test suite.

The servers come from the environment, one URL a service; ``tests/run.sh`` starts servers of
its own (``tests/services.sh``) and sets them, and ``eval "$(bash tests/services.sh up)"`` does
the same for a pytest run by hand. Nothing falls back to a server of the machine:

* ``DRIFTSAFE_TEST_REDIS_URL`` (``redis://host:port``): always needed. Under pytest-xdist each
  worker takes five databases of its own (locks, broker, e2e broker, e2e runs): worker
  ``gw<i>`` starts at ``DRIFTSAFE_TEST_REDIS_DB + 5 * i`` (default 0). The Redis of the run's
  own (``DRIFTSAFE_TEST_REDIS_PRIVATE``, set by ``tests/services.sh``, names it) may be emptied
  (:data:`REDIS_IS_PRIVATE`); on any other Redis the suite touches only keys under
  :data:`RUN_PREFIX` and never flushes a database.
* ``DRIFTSAFE_TEST_DB`` picks the database: ``sqlite`` (default, a file here), ``postgres``
  (``DRIFTSAFE_TEST_POSTGRES_URL``, ``postgresql://user[:password]@host:port``) or ``mysql``
  (``DRIFTSAFE_TEST_MARIADB_URL``, ``mysql://user[:password]@host:port``). The test runner
  creates and drops databases of its own there, named per process.
* ``DRIFTSAFE_TEST_RABBITMQ_URL`` (``amqp://user:password@host:port/vhost``): the tests that
  use RabbitMQ as the broker read :data:`RABBITMQ_URL`.
* ``DRIFTSAFE_TEST_RUN_ID``: names the run (:data:`RUN_PREFIX`); ``tests/services.sh`` makes one.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import django
from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent
TEST_DB = os.environ.get("DRIFTSAFE_TEST_DB", "sqlite")

#: What to do when a server's URL is not set (the suite never guesses the machine's own).
SERVICES_HINT = (
    "Run the tests with `bash tests/run.sh` (it starts servers of its own), or start them for "
    'pytest with `eval "$(bash tests/services.sh up)"` (`bash tests/services.sh down` stops '
    "them), or set {variable} to a server of yours (see README.md, Run the tests)"
)


def _service_url(variable: str, what: str) -> str:
    value = os.environ.get(variable, "")
    if not value:
        raise ImproperlyConfigured(
            f"{variable} is not set: the tests need {what}, and never use the machine's own. "
            + SERVICES_HINT.format(variable=variable)
        )
    return value


def _server(variable: str, what: str, schemes: tuple[str, ...], user: str) -> dict[str, str]:
    """``NAME``, ``HOST``, ``PORT``, ``USER`` and ``PASSWORD`` of Django's ``DATABASES`` from a
    URL (``NAME`` is only where Django connects first: it makes its test databases beside it)."""
    url = urlsplit(_service_url(variable, what))
    if url.scheme not in schemes or not url.hostname or not url.port:
        raise ImproperlyConfigured(
            f"{variable}={url.geturl()!r}: give {schemes[0]}://user@host:port (the port too)"
        )
    return {
        "NAME": unquote(url.path.strip("/")) or "driftsafe",
        "HOST": url.hostname,
        "PORT": str(url.port),
        "USER": unquote(url.username or user),
        "PASSWORD": unquote(url.password or ""),
    }


def postgres_server() -> dict[str, str]:
    """The test PostgreSQL (``DRIFTSAFE_TEST_POSTGRES_URL``): ``NAME``, ``HOST``, ``PORT``,
    ``USER``, ``PASSWORD``, as in ``DATABASES``."""
    return _server(
        "DRIFTSAFE_TEST_POSTGRES_URL", "PostgreSQL", ("postgresql", "postgres"), "postgres"
    )


def mariadb_server() -> dict[str, str]:
    """The test MariaDB (``DRIFTSAFE_TEST_MARIADB_URL``), as :func:`postgres_server`."""
    return _server("DRIFTSAFE_TEST_MARIADB_URL", "MariaDB", ("mysql", "mariadb"), "root")


#: The run's name (lower-case letters and digits): keys of the run's own on a Redis start with
#: :data:`RUN_PREFIX`, and its test databases' names hold it.
RUN_ID = os.environ.get("DRIFTSAFE_TEST_RUN_ID") or f"pid{os.getpid()}"
if not re.fullmatch(r"[a-z0-9]{1,16}", RUN_ID):
    raise ImproperlyConfigured(
        f"DRIFTSAFE_TEST_RUN_ID={RUN_ID!r}: use 1 to 16 lower-case letters and digits"
    )
#: The run's key prefix (the package's ``KEY_PREFIX`` here): on a Redis not of the run's own the
#: suite touches nothing else.
RUN_PREFIX = f"driftsafe-test-{RUN_ID}"
#: The Redis server, without a database: ``redis://host:port``.
REDIS_SERVER = _service_url("DRIFTSAFE_TEST_REDIS_URL", "a Redis server").rstrip("/")
#: Whether the Redis server is the run's own (started by tests/services.sh): then a test may empty
#: its databases. On any other server a test deletes only keys under :data:`RUN_PREFIX`.
REDIS_IS_PRIVATE = os.environ.get("DRIFTSAFE_TEST_REDIS_PRIVATE", "").rstrip("/") == REDIS_SERVER
if urlsplit(REDIS_SERVER).path.strip("/"):
    raise ImproperlyConfigured(
        f"DRIFTSAFE_TEST_REDIS_URL={REDIS_SERVER!r}: give the server without a database "
        "(redis://host:port); DRIFTSAFE_TEST_REDIS_DB picks the first database"
    )
#: RabbitMQ (``amqp://...``) for the tests that use it as the broker, or None when not set: such
#: a test fails with :data:`RABBITMQ_MISSING`.
RABBITMQ_URL = os.environ.get("DRIFTSAFE_TEST_RABBITMQ_URL") or None
RABBITMQ_MISSING = (
    "DRIFTSAFE_TEST_RABBITMQ_URL is not set: this test needs RabbitMQ. "
    + SERVICES_HINT.format(variable="DRIFTSAFE_TEST_RABBITMQ_URL")
)

#: Redis databases one test process uses: REDIS_DB .. REDIS_DB + 4; the run's workers use
#: FIRST_REDIS_DB .. FIRST_REDIS_DB + 5 * workers - 1.
REDIS_DBS_PER_PROCESS = 5
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or "1")
_WORKER = int((os.environ.get("PYTEST_XDIST_WORKER") or "gw0").removeprefix("gw"))
FIRST_REDIS_DB = int(os.environ.get("DRIFTSAFE_TEST_REDIS_DB") or "0")
if _WORKER >= _WORKERS:
    # pytest-xdist names a worker that replaces a crashed one gw<N>, gw<N+1>...: which range
    # it may take over is unknown (tests/run.sh runs with --max-worker-restart 0).
    raise RuntimeError(
        f"test worker gw{_WORKER} of {_WORKERS} replaces a crashed one, and its Redis databases "
        "are unknown: run with --max-worker-restart 0 and see why the worker crashed"
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
            **postgres_server(),
            # one test database per process, so concurrent runs on one server never collide
            "TEST": {
                "NAME": os.environ.get("DRIFTSAFE_TEST_PG_TEST_NAME")
                or f"test_driftsafe_{RUN_ID}_{os.getpid()}"
            },
        }
    }
elif TEST_DB == "mysql":
    # MariaDB 10.6+ / MySQL 8 (needs mysqlclient, the mysql extra)
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.mysql",
            **mariadb_server(),
            "TEST": {"NAME": f"test_driftsafe_{RUN_ID}_{os.getpid()}"},
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
    "KEY_PREFIX": RUN_PREFIX,
    "TIME_AUTHORITY": "redis" if TEST_DB == "sqlite" else "database",
}
# Constants the tests change (celery_driftsafe.conf.internal_settings; no project sets this).
DRIFTSAFE_INTERNALS = {
    # A beat's claim process (a spawned interpreter) would make in-process rounds depend on
    # when it gets ready: tests/claim/test_claim_process.py turns it on and waits for it.
    "CLAIM_PROCESS": False,
}

CELERY_BROKER_URL = "memory://"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
