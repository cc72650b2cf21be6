"""Shared fixtures. Tests that use no database are marked ``pure`` automatically, so the
PostgreSQL and MariaDB passes of ``tests/run.sh`` (``-m "not pure"``) run only what depends on
the database; a test that reaches the database through a fixture without the ``django_db``
marker stops the collection, naming it (it would otherwise never run on those passes).

No test skips silently (``tests/skip_guard.py``): a test that skips because something it
needs is missing (libfaketime, RabbitMQ, ``redis-server``, ``openssl``, root, a browser) *fails*,
with the skip's reason saying what to install, unless ``DRIFTSAFE_ALLOW_SKIPS=1`` is set (the
run's header and summary then say so). The skips that are deliberate by configuration (a
PostgreSQL-only test in the SQLite pass, a database feature another database lacks) give their
reason through ``skip_guard.configuration()`` and stay skips. Soak runs are not tests: they are
``python -m benchmarks soak`` (``benchmarks/README.md``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_driftsafe.testing import FakeClock
from tests import settings as test_settings
from tests.skip_guard import (  # noqa: F401  (the hooks)
    pytest_make_collect_report,
    pytest_report_header,
    pytest_runtest_makereport,
    pytest_terminal_summary,
)
from tests.support import BROKER_URL, QUEUE, T0, empty_redis, forget_queue


def pytest_sessionstart(session: pytest.Session) -> None:
    """Stop at once, saying why, when this process's Redis databases are past the server's
    ``databases`` (a fresh server has 16): every Redis test would fail on its own otherwise."""
    import redis

    top = test_settings.REDIS_DB + test_settings.REDIS_DBS_PER_PROCESS - 1
    try:
        with redis.Redis.from_url(test_settings.REDIS_SERVER, socket_timeout=2) as client:
            databases = int(client.config_get("databases")["databases"])
    except (redis.RedisError, KeyError, ValueError):
        return  # unreachable, or CONFIG disabled: the Redis tests say so themselves
    if top >= databases:
        raise pytest.UsageError(
            f"the test Redis has {databases} databases, but this test process needs "
            f"{test_settings.REDIS_DB}..{top} (DRIFTSAFE_TEST_REDIS_DB, five per pytest-xdist "
            "worker, see tests/settings.py): set a lower DRIFTSAFE_TEST_REDIS_DB or run fewer "
            "workers (DRIFTSAFE_TEST_WORKERS / -n)"
        )


def pytest_configure(config: pytest.Config) -> None:
    if test_settings.TEST_DB == "postgres":
        _flush_with_delete()


def _flush_with_delete() -> None:
    """Django empties every table after each transactional test. On PostgreSQL it does so with
    one ``TRUNCATE`` of them all, which gives each table and index a new file: about 0.25 s a
    test here, more than most tests' own time, against about 10 ms to DELETE the few rows a
    test leaves. Django's foreign keys there are ``DEFERRABLE INITIALLY DEFERRED`` and the
    flush runs in one transaction, so the order of the DELETEs does not matter. A flush that
    resets sequences or cascades keeps Django's statement."""
    from django.db.backends.postgresql.operations import DatabaseOperations

    truncate = DatabaseOperations.sql_flush

    def sql_flush(
        self: DatabaseOperations,
        style: Any,
        tables: list[str],
        *,
        reset_sequences: bool = False,
        allow_cascade: bool = False,
    ) -> list[str]:
        if reset_sequences or allow_cascade:
            return truncate(
                self, style, tables, reset_sequences=reset_sequences, allow_cascade=allow_cascade
            )
        return [f"DELETE FROM {self.quote_name(table)};" for table in tables]

    DatabaseOperations.sql_flush = sql_flush  # type: ignore[method-assign]


#: pytest-django's fixtures that open the test database: a test using one without the
#: ``django_db`` marker would be marked ``pure`` and never run on the PostgreSQL or MariaDB pass.
DATABASE_FIXTURES = frozenset(
    {
        "db",
        "transactional_db",
        "django_db_reset_sequences",
        "django_db_serialized_rollback",
        "admin_client",
        "admin_user",
        "django_user_model",
        "django_username_field",
        "live_server",
    }
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unmarked = [
        f"{item.nodeid} (uses {', '.join(sorted(DATABASE_FIXTURES & set(item.fixturenames)))})"
        for item in items
        if isinstance(item, pytest.Function)
        and DATABASE_FIXTURES & set(item.fixturenames)
        and item.get_closest_marker("django_db") is None
    ]
    if unmarked:
        raise pytest.UsageError(
            "these tests use the database through a fixture but have no django_db marker, so "
            "the database passes would leave them out as pure: mark them "
            "@pytest.mark.django_db (transaction=True where they need it):\n  "
            + "\n  ".join(unmarked)
        )
    for item in items:
        if item.get_closest_marker("django_db") is None and item.get_closest_marker("e2e") is None:
            item.add_marker(pytest.mark.pure)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # In parallel (tests/run.sh: ``--maxschedchunk 1``, a test at a time to whichever worker
        # is free), the end-to-end runs go first: they take 10-60 s each, mostly waiting for
        # slots, and one started last would finish alone. Only those without a test database
        # move: pytest-django's order of the database tests (transactional ones last, as they
        # empty the tables) is kept, and the sort is stable.
        def runs_first(item: pytest.Item) -> bool:
            return bool(item.get_closest_marker("e2e")) and not item.get_closest_marker("django_db")

        items.sort(key=lambda item: not runs_first(item))


@pytest.fixture
def fake_clock() -> FakeClock:
    return FakeClock(T0)


@pytest.fixture
def needs_faketime() -> None:
    """Skip when libfaketime is missing (which fails the test, as said above), naming
    what to install."""
    from celery_driftsafe.testing.faketime import FaketimeUnavailable, libfaketime_path

    try:
        libfaketime_path()
    except FaketimeUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture
def redis_client() -> Iterator[Any]:
    """The test Redis database (this process's first), emptied before and after (on a Redis
    not of the run's own, only of the run's keys: :func:`tests.support.empty_redis`)."""
    import redis

    client = redis.Redis.from_url(test_settings.REDIS_URL)
    empty_redis(client)
    yield client
    empty_redis(client)
    client.close()


@pytest.fixture
def broker_app() -> Iterator[Celery]:
    """A Celery app publishing to a real Redis broker (db ``REDIS_DB + 1``), with registered
    tasks ``tests.add`` and ``tests.any`` (which takes any arguments). Messages land in the
    Redis list :data:`QUEUE`; :func:`drain` reads them."""
    import redis

    client = redis.Redis.from_url(BROKER_URL)
    client.delete(QUEUE)
    app = Celery("driftsafe-tests", broker=BROKER_URL, set_as_current=False)
    app.conf.broker_connection_retry_on_startup = False
    app.conf.task_default_queue = QUEUE

    @app.task(name="tests.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    @app.task(name="tests.any", shared=False)
    def any_arguments(*args: Any, **kwargs: Any) -> None:
        """Takes whatever it is given (the import tests' rows carry all sorts)."""

    yield app
    forget_queue(client, QUEUE)
    client.close()


@pytest.fixture
def calls() -> list[Any]:
    """What the ``record`` task's bodies were called with, in order."""
    return []


@pytest.fixture
def record(broker_app: Celery, calls: list[Any], redis_client: Any) -> Any:
    """A ``DriftSafeTask`` named ``tests.record`` on :func:`broker_app`: its body waits for its
    ``gate`` (set: it does not wait), appends its value to ``calls`` and raises for
    ``"boom"``."""
    import threading

    from celery_driftsafe.task import DriftSafeTask

    gate = threading.Event()
    gate.set()

    @broker_app.task(name="tests.record", base=DriftSafeTask, shared=False)
    def record(value: str) -> str:
        gate.wait(10)
        calls.append(value)
        if value == "boom":
            raise ValueError("boom")
        return value

    record.gate = gate
    return record


@pytest.fixture
def app(broker_app: Celery) -> Iterator[Celery]:
    """:func:`broker_app` installed as the package's Celery app (``DRIFTSAFE['CELERY_APP']``'s
    place): what the admin, run now and the commands validate task names against and publish
    through."""
    from celery_driftsafe import celery_app

    celery_app.set_celery_app(broker_app)
    yield broker_app
    celery_app.set_celery_app(None)


@pytest.fixture
def clock() -> FakeClock:
    """A fake clock at :data:`T0` (the same instant as :func:`fake_clock`), for the tests that
    drive a scheduler by hand."""
    return FakeClock(T0)


@pytest.fixture
def scheduler(broker_app: Any, clock: Any) -> Iterator[Any]:
    """A ``DriftSafeScheduler`` on the test broker whose authority is ``clock``; its rounds
    are run by the test (``run_round()``), not by a loop."""
    from celery_driftsafe.scheduler import DriftSafeScheduler

    sched = DriftSafeScheduler(
        app=broker_app, clock=clock, authority=clock, install_signal_handlers=False
    )
    yield sched
    sched.close()
