"""Schedule edits: next slot recomputed once, re-enabling never catches up, beats are woken."""

from __future__ import annotations

import threading
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.conf import settings
from django.test import override_settings

from celery_driftsafe.definitions import changes
from celery_driftsafe.models import PeriodicTask, ScheduleKind
from tests import settings as test_settings

T0 = datetime(2026, 3, 1, 12, 0, 0, 500000, tzinfo=UTC)
S = timedelta(seconds=1)

pytestmark = pytest.mark.django_db(transaction=True)


def _save(task: PeriodicTask, now: datetime) -> PeriodicTask:
    task.driftsafe_now = now  # type: ignore[attr-defined]
    task.save()
    task.refresh_from_db()
    return task


def _interval(every: int = 10) -> PeriodicTask:
    return PeriodicTask(
        name="t",
        task="tests.add",
        schedule_kind=ScheduleKind.INTERVAL,
        interval_every=every,
        interval_unit="seconds",
    )


def test_new_interval_task_anchored_at_authority_now_first_slot_after() -> None:
    task = _save(_interval(), T0)
    assert task.interval_anchor == T0
    assert task.next_slot_at == T0 + 10 * S


def test_new_crontab_task_starts_at_first_slot_after_now() -> None:
    task = PeriodicTask(
        name="c",
        task="tests.add",
        schedule_kind=ScheduleKind.CRONTAB,
        crontab_minute="*/15",
        timezone="Europe/Berlin",
    )
    task = _save(task, T0)
    assert task.next_slot_at == datetime(2026, 3, 1, 12, 15, tzinfo=UTC)


def test_one_off_in_the_past_keeps_its_instant_until_fired() -> None:
    task = PeriodicTask(
        name="o",
        task="tests.add",
        schedule_kind=ScheduleKind.ONE_OFF,
        one_off_at=T0 - timedelta(hours=1),
    )
    task = _save(task, T0)
    assert task.next_slot_at == T0 - timedelta(hours=1)


def test_unrelated_edit_does_not_move_next_slot() -> None:
    task = _save(_interval(), T0)
    task.args = [5, 6]
    task = _save(task, T0 + timedelta(hours=1))
    assert task.next_slot_at == T0 + 10 * S


def test_schedule_edit_recomputes_once_keeping_the_anchor() -> None:
    task = _save(_interval(10), T0)
    task.interval_every = 7
    task = _save(task, T0 + 100 * S)
    assert task.interval_anchor == T0
    assert task.next_slot_at == T0 + 105 * S  # anchor + 15 * 7, first after now


def test_reenabling_starts_after_now_without_catch_up() -> None:
    task = _save(_interval(10), T0)
    task.enabled = False
    task = _save(task, T0 + 5 * S)
    assert task.next_slot_at == T0 + 10 * S  # disabling leaves it; claims skip disabled rows
    task.enabled = True
    task = _save(task, T0 + timedelta(hours=2) + 3 * S)
    assert task.next_slot_at == T0 + timedelta(hours=2) + 10 * S
    assert task.disabled_reason == ""


def test_changes_wake_beats_through_redis(redis_client: Any) -> None:
    # A key prefix of the test's own: Redis channels ignore the database number, and another
    # test process publishing on the shared prefix would make this pass without our save.
    prefix = f"{test_settings.RUN_PREFIX}-{uuid.uuid4().hex[:12]}"
    pubsub = redis_client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(f"{prefix}:changes")
    received = threading.Event()

    def listen() -> None:
        for _ in range(50):
            if pubsub.get_message(timeout=0.1):
                received.set()
                return

    listener = threading.Thread(target=listen)
    listener.start()
    with override_settings(DRIFTSAFE={**settings.DRIFTSAFE, "KEY_PREFIX": prefix}):
        _save(_interval(), T0)
    listener.join()
    pubsub.close()
    assert received.is_set()


def test_reschedule_recomputes_from_authority_now() -> None:
    task = _save(_interval(10), datetime(2020, 1, 1, tzinfo=UTC))
    assert changes.reschedule([task]) == 1
    task.refresh_from_db()
    now = datetime.now(UTC)
    assert now < task.next_slot_at <= now + 11 * S


def test_one_look_schedules_every_task_written_without_save_batch_after_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Thousands of tasks from ``bulk_create``: a beat's look takes them a batch at a time, in
    its own thread, until none is left."""
    import time

    monkeypatch.setattr(changes, "UNSCHEDULED_BATCH", 3)
    idle = changes.BackgroundUnscheduled(monotonic=time.monotonic)
    assert not idle.maybe_start(T0)  # nothing to schedule: no thread
    PeriodicTask.objects.bulk_create(
        PeriodicTask(
            name=f"bulk{i}",
            task="tests.add",
            schedule_kind=ScheduleKind.INTERVAL,
            interval_every=60,
            interval_unit="seconds",
        )
        for i in range(7)
    )
    look = changes.BackgroundUnscheduled(monotonic=time.monotonic)
    assert look.maybe_start(T0)
    look.join(10)
    assert look.scheduled == 7
    assert not PeriodicTask.objects.filter(due_at__isnull=True).exists()
    anchors = PeriodicTask.objects.values_list("interval_anchor", flat=True)
    assert all(T0 <= anchor < T0 + timedelta(seconds=10) for anchor in anchors)  # ~ now
    assert not look.maybe_start(T0)  # the next look comes an interval later
