"""What the in-process tests of the overlap policies share: a run of a slot, the request a
worker builds for its delivery, a delivery in a thread of its own (a worker elsewhere), and the
a beat's recovery pass. The two ways a worker goes (its path, where it takes its locks) are
fixtures of ``tests/worker/conftest.py``."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

from celery.exceptions import Ignore

from celery_driftsafe.models import PeriodicTask, Run, RunKind, RunStatus
from tests import settings as test_settings
from tests.support import wait_until
from tests.support.factories import interval_task

#: The package's Redis keys in these tests start with it (the tests' KEY_PREFIX).
PREFIX = test_settings.DRIFTSAFE["KEY_PREFIX"]


def overlap_task(name: str, policy: str, **fields: Any) -> PeriodicTask:
    """A periodic task of ``tests.record`` every second under overlap policy ``policy`` (and
    ``fields``)."""
    return interval_task(
        name,
        1,
        anchor=datetime(2026, 3, 1, tzinfo=UTC),
        task="tests.record",
        overlap_policy=policy,
        **fields,
    )


def recover(app: Any) -> None:
    """A beat's recovery pass, now (it publishes waiting runs whose turn came)."""
    from celery_driftsafe.beat.recovery import recover as recovery_pass
    from celery_driftsafe.conf import get_settings
    from celery_driftsafe.publish.dispatcher import Dispatcher
    from celery_driftsafe.store.clock import authority_clock

    clock = authority_clock()
    recovery_pass(clock.now(), "beat-1", get_settings(), Dispatcher(app, clock))


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


@contextmanager
def body_running(task: Any, run: Run, value: str, redis_client: Any) -> Iterator[threading.Thread]:
    """``run``'s body running in a thread, held at the task's gate (:func:`running`) while the
    block runs; let go, and the thread joined, as it ends."""
    worker = running(task, run, value, redis_client)
    try:
        yield worker
    finally:
        task.gate.set()
        worker.join()


def deliver_published(task: Any, run: Run, value: str) -> Any:
    """The one message published, ``run``'s, delivered under the fencing token it carries
    (the lock handed to the run it released is taken with it): what the body returned."""
    from tests.support import drain

    [message] = drain()
    assert message["id"] == run.celery_task_id
    with delivery(task, run, token=message["driftsafe_fencing_token"]):
        return task(value)


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
