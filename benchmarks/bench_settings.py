"""Django settings of the side-by-side benchmark (``benchmarks/compare.py``).

django-celery-beat and celery_driftsafe are installed together, so every scheduler runs from
the same project, the same Celery app and the same PostgreSQL server. Everything specific to
one trial comes from the environment, set by :mod:`benchmarks.peers`:

``BENCH_DB``              the trial's own PostgreSQL database
``BENCH_STORE_URL``       Redis for RedBeat's schedule and celery_driftsafe's locks/wake-ups
``BENCH_BROKER_URL``      the broker (a Redis database no test uses)
``BENCH_PREFIX``          key prefix of the trial (RedBeat keys, driftsafe keys)
``BENCH_QUEUE``           the trial's queue: the recorder pops it
``BENCH_MAX_LOOP``        tuned runs only: ``beat_max_loop_interval`` (seconds)
``BENCH_REDBEAT_LOCK``    tuned runs only: ``redbeat_lock_timeout`` (seconds)
``DRIFTSAFE_BENCH_OFF``   celery_driftsafe's performance mechanisms switched off, by name,
                          comma-separated (:func:`benchmarks.switches.switched_off`), for
                          the ablation benchmark; inherited from the command's environment

celery_driftsafe's constants (batch sizes, the round interval, the claim process, the
performance mechanisms) are no project's to set: the benchmarks change them through
``DRIFTSAFE_INTERNALS``, the setting the package keeps for its own tests and benchmarks.

Nothing else is set, so each scheduler runs with its shipped defaults.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import unquote, urlsplit

from benchmarks.switches import switched_off

SECRET_KEY = "benchmark-only-not-secret"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "django_celery_beat",
    "celery_driftsafe",
]
# The PostgreSQL server, as the tests take it (DRIFTSAFE_TEST_POSTGRES_URL): no server is assumed;
# `eval "$(bash tests/services.sh up)"` starts one of the checkout's own and sets it.
_PG_URL = os.environ.get("DRIFTSAFE_TEST_POSTGRES_URL")
if not _PG_URL:
    raise RuntimeError(
        "DRIFTSAFE_TEST_POSTGRES_URL is not set: the benchmarks need PostgreSQL. Start servers "
        'of the checkout\'s own with eval "$(bash tests/services.sh up)", or set it to yours '
        "(postgresql://user@host:port)"
    )
_PG = urlsplit(_PG_URL)
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": os.environ.get("BENCH_DB", "driftsafe_bench"),
        "USER": unquote(_PG.username or "postgres"),
        "PASSWORD": unquote(_PG.password or ""),
        "HOST": _PG.hostname,
        "PORT": str(_PG.port or 5432),
    }
}
_PREFIX = os.environ.get("BENCH_PREFIX", "dsbench")
_STORE = os.environ.get("BENCH_STORE_URL", "")
if not _STORE:  # never a server of the machine's by default
    raise RuntimeError(
        "BENCH_STORE_URL is not set: benchmarks.bench_settings is the settings module of a "
        "benchmark trial's processes, which benchmarks/trial.py starts with it set (a Redis "
        "database of the run's own)"
    )

DRIFTSAFE: dict[str, Any] = {
    "REDIS_URL": _STORE,
    "KEY_PREFIX": f"{_PREFIX}:driftsafe",
    "TIME_AUTHORITY": "database",
}
DRIFTSAFE_INTERNALS: dict[str, Any] = {}
# DRIFTSAFE_BENCH_CLAIM_PROCESS=0: our beats claim in a thread only (the claim process off),
# to measure what it adds; it is inherited from the command's environment.
if os.environ.get("DRIFTSAFE_BENCH_CLAIM_PROCESS") == "0":
    DRIFTSAFE_INTERNALS["CLAIM_PROCESS"] = False
# DRIFTSAFE_BENCH_CLAIM_BATCH_SIZE=N: our beats claim N tasks a batch (default 500).
if os.environ.get("DRIFTSAFE_BENCH_CLAIM_BATCH_SIZE"):
    DRIFTSAFE_INTERNALS["CLAIM_BATCH_SIZE"] = int(os.environ["DRIFTSAFE_BENCH_CLAIM_BATCH_SIZE"])
# DRIFTSAFE_BENCH_OFF=prebuild,fast_publish: those mechanisms off (the ablation benchmark).
_public, _internal = switched_off(os.environ.get("DRIFTSAFE_BENCH_OFF", ""))
DRIFTSAFE.update(_public)
DRIFTSAFE_INTERNALS.update(_internal)

CELERY_BROKER_URL = os.environ.get("BENCH_BROKER_URL", _STORE)
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("BENCH_QUEUE", f"{_PREFIX}:queue")
CELERY_TIMEZONE = "UTC"
CELERY_REDBEAT_REDIS_URL = _STORE
CELERY_REDBEAT_KEY_PREFIX = f"{_PREFIX}:redbeat:"
if os.environ.get("BENCH_MAX_LOOP"):
    CELERY_BEAT_MAX_LOOP_INTERVAL = int(os.environ["BENCH_MAX_LOOP"])
if os.environ.get("BENCH_REDBEAT_LOCK"):
    CELERY_REDBEAT_LOCK_TIMEOUT = int(os.environ["BENCH_REDBEAT_LOCK"])
