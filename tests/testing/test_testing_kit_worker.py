"""The testing kit with a worker: the ``driftsafe`` beat publishes through pytest-celery's
``celery_app`` (Celery's in-process test app, on its in-memory broker) and Celery's in-process
worker (``start_worker``) executes what it publishes, as ``DriftSafeTask`` runs, on the fake
clock the kit installed for the whole process. An in-process worker is enough here: the test is
about the kit's messages being real, complete messages, not about processes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from celery.contrib.testing.worker import start_worker
from celery.signals import task_postrun

# celery_driftsafe.testing.beat is imported here, at collection, rather than by the ``driftsafe``
# fixture with the worker's thread already running: pytest parses the package's modules (to
# rewrite their asserts) as they are imported, and CPython 3.11 (3.11.7 here) can fail a parse
# beside another thread's with "SystemError: AST constructor recursion depth mismatch"
# (python/cpython#106905), as this test did here.
import celery_driftsafe.testing.beat  # noqa: F401
from celery_driftsafe.models import PeriodicTask, RunStatus
from celery_driftsafe.task import DriftSafeTask
from tests import settings as test_settings
from tests.skip_guard import configuration
from tests.support.factories import real_deadlock

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]


@pytest.fixture
def driftsafe_publish_app(celery_app: Any) -> Any:
    """The kit's beat publishes through pytest-celery's in-process test app."""
    return celery_app


@pytest.fixture
def executed(celery_app: Any, redis_client: Any) -> Iterator[list[str]]:
    """Register ``kit.tick`` (a DriftSafeTask recording its Celery task id), run an in-process
    worker for the test, and close the database connections of the worker's thread."""
    from django.db import connections

    seen: list[str] = []

    @celery_app.task(name="kit.tick", base=DriftSafeTask, bind=True, shared=False)
    def tick(self: Any) -> str:
        seen.append(self.request.id)
        return "ticked"

    def close_connections(**kwargs: Any) -> None:
        if threading.current_thread() is not threading.main_thread():
            connections.close_all()

    task_postrun.connect(close_connections, weak=False, dispatch_uid="kit-close-postrun")
    try:
        with start_worker(celery_app, pool="solo", perform_ping_check=False, loglevel="WARNING"):
            yield seen
    finally:
        task_postrun.disconnect(dispatch_uid="kit-close-postrun")


def _tick_every_ten_minutes(driftsafe: Any) -> None:
    """The task ``tick`` (``kit.tick``) every 10 minutes, from 2026-03-29 00:00 UTC on the
    stepped beat's clock."""
    driftsafe.clock.set(datetime(2026, 3, 29, 0, 0, tzinfo=UTC))
    PeriodicTask.objects.create(
        name="tick",
        task="kit.tick",
        schedule_kind="interval",
        interval_every=10,
        interval_unit="minutes",
    )


def test_what_the_stepped_beat_publishes_runs_once_per_slot_on_a_worker(
    driftsafe: Any, executed: list[str]
) -> None:
    _tick_every_ten_minutes(driftsafe)
    driftsafe.advance(timedelta(hours=1))
    published = driftsafe.messages("tick")
    assert [m.slot for m in published] == [
        datetime(2026, 3, 29, 0, 10 * k, tzinfo=UTC) for k in range(1, 6)
    ] + [datetime(2026, 3, 29, 1, 0, tzinfo=UTC)]
    runs = driftsafe.runs("tick")
    deadline = time.monotonic() + 30
    while set(runs.values_list("status", flat=True)) != {RunStatus.SUCCEEDED}:
        assert time.monotonic() < deadline, list(runs.values_list("slot", "status", "error"))
        time.sleep(0.1)
    assert sorted(executed) == sorted(m.task_id for m in published)  # each once
    # The worker's clock in this process is the fake one: the runs started at fake times.
    assert {run.started_at.date() for run in runs} == {datetime(2026, 3, 29).date()}


@pytest.mark.skipif(
    test_settings.TEST_DB == "sqlite", reason=configuration("SQLite has no deadlocks")
)
def test_a_round_the_database_rolls_back_for_a_concurrent_transaction_runs_again(
    driftsafe: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A round's transaction chosen as a deadlock's victim (MariaDB's claim beside a worker
    recording an outcome, seen in CI: the user's test failed on it) changed nothing: the
    stepped beat runs the round again, as a beat does, and the slot fires once. An error the
    database did not roll back for a concurrent transaction still reaches the test."""
    from django.db import DatabaseError

    deadlock = real_deadlock()
    _tick_every_ten_minutes(driftsafe)
    scheduler = driftsafe.scheduler
    original = scheduler.run_round
    failures = [deadlock, deadlock]

    def run_round() -> float:
        if failures:
            raise failures.pop()
        result: float = original()
        return result

    monkeypatch.setattr(scheduler, "run_round", run_round)
    driftsafe.advance(timedelta(minutes=10))
    assert not failures
    assert driftsafe.fired("tick") == [datetime(2026, 3, 29, 0, 10, tzinfo=UTC)]
    failures.append(DatabaseError("not rolled back"))
    with pytest.raises(DatabaseError, match="not rolled back"):
        driftsafe.advance(timedelta(minutes=10))
    failures.extend([deadlock] * 4)  # one more than a beat runs again in a row
    with pytest.raises(DatabaseError):
        driftsafe.advance(timedelta(minutes=10))
