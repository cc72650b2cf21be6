"""Small builders for test rows."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from celery_driftsafe.models import PeriodicTask, Run, RunKind, RunStatus, ScheduleKind
from tests.support import wait_until


def at_once(count: int, work: Callable[[int], Any], timeout: float = 60.0) -> list[Any]:
    """``work(0)`` … ``work(count - 1)`` in threads released together (a race), each closing
    its own database connections after; their results in order. Raises the first exception
    any of them raised, and when one is still running after ``timeout``."""
    from django.db import connections

    gate = threading.Barrier(count)
    results: list[Any] = [None] * count
    errors: list[BaseException] = []

    def run(n: int) -> None:
        try:
            gate.wait(timeout)
            results[n] = work(n)
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run, args=(n,)) for n in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    if errors:
        raise errors[0]
    assert not any(thread.is_alive() for thread in threads), "a racer did not finish"
    return results


def real_deadlock() -> Any:
    """The error of a real deadlock's victim (PostgreSQL or MySQL): two connections each
    update one of two new runs, then the other's, and the database rolls one back."""
    from django.db import DatabaseError, transaction

    from celery_driftsafe.models import Run

    first, second = (Run.objects.create(task_name="tests.add") for _ in range(2))
    holding = threading.Barrier(2, timeout=10)

    def lock(n: int) -> DatabaseError | None:
        mine, theirs = (first, second) if n == 0 else (second, first)
        try:
            with transaction.atomic():
                Run.objects.filter(pk=mine.pk).update(dispatch_attempts=1)
                holding.wait()
                Run.objects.filter(pk=theirs.pk).update(dispatch_attempts=1)
        except DatabaseError as exc:
            return exc
        return None

    errors = [error for error in at_once(2, lock, timeout=30) if error is not None]
    assert len(errors) == 1, errors
    return errors[0]


def _saved(name: str, fields: dict[str, Any]) -> PeriodicTask:
    """Validate and save; then force ``next_slot_at`` when the test gives one (the save itself
    computes it from the authority's now)."""
    next_slot = fields.pop("next_slot_at", None)
    fields.setdefault("task", "tests.add")
    fields.setdefault("args", [1, 2])
    task = PeriodicTask(name=name, **fields)
    task.full_clean()
    task.save()
    if next_slot is not None:
        PeriodicTask.objects.filter(pk=task.pk).update(next_slot_at=next_slot)
        task.next_slot_at = next_slot
    return task


def interval_task(name: str, every: int, anchor: datetime, **fields: Any) -> PeriodicTask:
    """An interval task saved with its anchor; ``next_slot_at`` as given or computed."""
    return _saved(
        name,
        {
            "schedule_kind": ScheduleKind.INTERVAL,
            "interval_every": every,
            "interval_unit": "seconds",
            "interval_anchor": anchor,
            **fields,
        },
    )


def many_interval_tasks(
    count: int,
    due: datetime,
    *,
    name: str = "t{i}",
    task: str = "tests.noop",
    numbered_kwargs: bool = False,
) -> None:
    """``count`` tasks every 60 s, all first due at ``due``, in bulk (no validation: what a
    burst or a benchmark needs). ``name`` is formatted with each task's number ``i``;
    ``numbered_kwargs`` gives each the arguments ``{"n": i}``."""
    PeriodicTask.objects.bulk_create(
        (
            PeriodicTask(
                name=name.format(i=i),
                task=task,
                schedule_kind=ScheduleKind.INTERVAL,
                interval_every=60,
                interval_anchor=due,
                next_slot_at=due,
                kwargs={"n": i} if numbered_kwargs else {},
            )
            for i in range(count)
        ),
        batch_size=5000,
    )


def crontab_task(name: str, expression: str, timezone: str = "UTC", **fields: Any) -> PeriodicTask:
    minute, hour, dom, month, dow = expression.split()
    return _saved(
        name,
        {
            "schedule_kind": ScheduleKind.CRONTAB,
            "crontab_minute": minute,
            "crontab_hour": hour,
            "crontab_day_of_month": dom,
            "crontab_month_of_year": month,
            "crontab_day_of_week": dow,
            "timezone": timezone,
            **fields,
        },
    )


def solar_task(
    name: str, event: str, latitude: float, longitude: float, **fields: Any
) -> PeriodicTask:
    return _saved(
        name,
        {
            "schedule_kind": ScheduleKind.SOLAR,
            "solar_event": event,
            "solar_latitude": latitude,
            "solar_longitude": longitude,
            **fields,
        },
    )


def finished(run: Run) -> Run:
    """Wait until the run has a final status; return it fresh."""

    def done() -> Run | None:
        fresh = Run.objects.get(pk=run.pk)
        return (
            fresh if fresh.status not in ("claimed", "dispatched", "started", "retrying") else None
        )

    result: Run = wait_until(done, what=f"run {run.pk} to finish")
    return result


def new_run(task_name: str, kind: str) -> Run:
    fields: dict[str, Any] = {}
    if kind == "scheduled":
        anchor = datetime(2026, 3, 1, tzinfo=UTC)
        fields = {
            "periodic_task": interval_task(
                f"p-{uuid.uuid4().hex[:6]}", 60, anchor=anchor, task=task_name
            ),
            "slot": anchor + timedelta(minutes=1),
            "kind": RunKind.SCHEDULED,
        }
    elif kind == "manual":
        fields = {"kind": RunKind.MANUAL, "claimed_by": "admin:tester"}
    else:
        fields = {"kind": RunKind.ADHOC}
    return Run.objects.create(
        task_name=task_name, status=RunStatus.DISPATCHED, celery_task_id=str(uuid.uuid4()), **fields
    )
