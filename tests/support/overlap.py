"""What the in-process tests of the overlap policies share: a run of a slot, the request a
worker builds for its delivery, a delivery in a thread of its own (a worker elsewhere), and the
two ways a worker goes (its path, where it takes its locks), as fixtures. A test module
imports the fixtures it uses (``path``, ``locks``)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

import pytest
from celery.exceptions import Ignore

from celery_driftsafe.models import PeriodicTask, Run, RunKind, RunStatus
from tests import settings as test_settings
from tests.support import wait_until

#: The package's Redis keys in these tests start with it (the tests' KEY_PREFIX).
PREFIX = test_settings.DRIFTSAFE["KEY_PREFIX"]


def slot_run(periodic: PeriodicTask, second: int, **fields: Any) -> Run:
    return Run.objects.create(
        periodic_task=periodic,
        kind=RunKind.SCHEDULED,
        task_name="tests.record",
        slot=datetime(2026, 3, 1, 0, 0, second, tzinfo=UTC),
        status=fields.pop("status", RunStatus.DISPATCHED),
        celery_task_id=str(uuid.uuid4()),
        message={"args": ["x"], "kwargs": {}, "options": {}},
        **fields,
    )


@contextmanager
def delivery(task: Any, run: Run, token: int = 0, retries: int = 0) -> Iterator[None]:
    task.push_request(
        id=run.celery_task_id,
        retries=retries,
        hostname="worker-1",
        delivery_info={},
        args=[],
        kwargs={},
        driftsafe_run_id=run.pk,
        driftsafe_fencing_token=token,
        driftsafe_periodic_task_id=run.periodic_task_id,
    )
    try:
        yield
    finally:
        task.pop_request()


def deliver(task: Any, run: Run, value: str) -> None:
    """A delivery in a thread of its own (a worker elsewhere), its connections closed after."""
    from django.db import connections

    try:
        with delivery(task, run):
            task(value)
    except (Ignore, ValueError):
        pass
    finally:
        connections.close_all()


def running(task: Any, run: Run, value: str, redis_client: Any) -> threading.Thread:
    """``run``'s body running in a thread, held at the task's gate, once it holds the task's
    running lock."""
    task.gate.clear()
    worker = threading.Thread(target=deliver, args=(task, run, value))
    worker.start()
    # (the slow path takes the lock before the start, the fast path after it)
    wait_until(
        lambda: (
            held_for(redis_client, run) is not None
            and Run.objects.get(pk=run.pk).status == RunStatus.STARTED
        ),
        "the run started holding the task's running lock",
    )
    return worker


@pytest.fixture(params=["fast", "slow"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The worker's path: ``fast``, one conditional start, then the overlap policy (PostgreSQL,
    SQLite 3.35+); ``slow``, the run read, the policy applied, then the start (a database
    without ``UPDATE … RETURNING``: MySQL, an older SQLite)."""
    from celery_driftsafe.ledger.run_ledger import Ledger

    if request.param == "slow":
        original = Ledger.__init__

        def without_returning(self: Ledger) -> None:
            original(self)
            self.can_return = False

        monkeypatch.setattr(Ledger, "__init__", without_returning)
    return str(request.param)


def held_for(redis_client: Any, run: Run) -> str | None:
    """What the running lock of ``run``'s task holds, in Redis or (database locks) in its row:
    a holder's token, or the name of the run it was handed to; None: free."""
    from celery_driftsafe.models import Lock as LockRow

    value: bytes | None = redis_client.get(f"{PREFIX}:lock:task-running:{run.periodic_task_id}")
    if value is not None:
        return value.decode()
    row: str | None = (
        LockRow.objects.filter(name=f"task-running:{run.periodic_task_id}")
        .exclude(token="")
        .values_list("token", flat=True)
        .first()
    )
    return row


@pytest.fixture(params=["redis", "database"])
def locks(request: pytest.FixtureRequest) -> Iterator[str]:
    """Where the worker takes its locks: Redis (the tests' settings), or the database (no
    ``REDIS_URL``; the database is the time authority then)."""
    if request.param == "redis":
        yield "redis"
        return
    from django.test import override_settings

    without_redis = {**test_settings.DRIFTSAFE, "REDIS_URL": None, "TIME_AUTHORITY": "database"}
    from celery_driftsafe.models import Lock as LockRow

    with override_settings(DRIFTSAFE=without_redis):
        yield "database"
    assert LockRow.objects.filter(name__startswith="task-running:").exists(), "no database lock"
