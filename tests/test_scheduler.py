"""The scheduler in-process, against the real database and a real Redis broker, with a fake
clock as the authority so every instant is exact."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from celery.schedules import crontab

from celery_driftsafe.claim import celery_task_id
from celery_driftsafe.dispatch import HEADER_FENCING_TOKEN, HEADER_RUN_ID, HEADER_SLOT
from celery_driftsafe.models import BeatNode, PeriodicTask, Run, RunStatus
from celery_driftsafe.scheduler import DriftSafeScheduler
from celery_driftsafe.testing import FakeClock
from tests.conftest import drain
from tests.factories import interval_task

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
S = timedelta(seconds=1)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(T0)


@pytest.fixture
def scheduler(broker_app: Any, clock: FakeClock) -> Iterator[DriftSafeScheduler]:
    sched = DriftSafeScheduler(
        app=broker_app, clock=clock, authority=clock, install_signal_handlers=False
    )
    yield sched
    sched.close()


@pytest.mark.django_db(transaction=True)
def test_round_publishes_due_runs_with_deterministic_ids_and_headers(
    scheduler: DriftSafeScheduler, clock: FakeClock
) -> None:
    task = interval_task("add", 10, anchor=T0, next_slot_at=T0, args=[2, 3], queue="")
    wait = scheduler.run_round()
    messages = drain()
    assert len(messages) == 1
    msg = messages[0]
    run = Run.objects.get()
    assert msg["id"] == celery_task_id(task.pk, T0) == run.celery_task_id
    assert msg["task"] == "tests.add" and msg["args"] == [2, 3]
    assert msg[HEADER_RUN_ID] == run.pk
    assert msg[HEADER_SLOT] == T0.isoformat()
    assert msg[HEADER_FENCING_TOKEN] == 0
    assert run.status == RunStatus.DISPATCHED and run.dispatched_at == T0
    assert run.claimed_by == scheduler.node_id
    assert wait == pytest.approx(1.0)  # next slot in 10 s, capped by MAX_LOOP_INTERVAL_SECONDS
    # nothing more until the next slot, which fires exactly at its instant, not before
    clock.advance(10 * S - timedelta(microseconds=1))
    scheduler.run_round()
    assert drain() == []
    clock.advance(timedelta(microseconds=1))
    scheduler.run_round()
    assert [m[HEADER_SLOT] for m in drain()] == [(T0 + 10 * S).isoformat()]


@pytest.mark.django_db(transaction=True)
def test_wait_is_time_until_next_slot_by_authority(
    scheduler: DriftSafeScheduler, clock: FakeClock
) -> None:
    interval_task("add", 10, anchor=T0 + timedelta(milliseconds=300),
                  next_slot_at=T0 + timedelta(milliseconds=300))
    assert scheduler.run_round() == pytest.approx(0.3)
    assert drain() == []


@pytest.mark.django_db(transaction=True)
def test_unregistered_task_fails_the_run_and_beat_carries_on(
    scheduler: DriftSafeScheduler,
) -> None:
    interval_task("ghost", 10, anchor=T0, next_slot_at=T0, task="no.such.task")
    interval_task("real", 10, anchor=T0, next_slot_at=T0)
    scheduler.run_round()
    assert [m["task"] for m in drain()] == ["tests.add"]
    ghost = Run.objects.get(task_name="no.such.task")
    assert ghost.status == RunStatus.FAILED
    assert "'no.such.task' is not registered" in ghost.error


@pytest.mark.django_db(transaction=True)
def test_node_registered_and_stopped(scheduler: DriftSafeScheduler) -> None:
    node = BeatNode.objects.get(node_id=scheduler.node_id)
    assert node.started_at == T0 and node.stopped_at is None
    scheduler.run_round()
    scheduler.close()
    node.refresh_from_db()
    assert node.stopped_at == T0


@pytest.mark.django_db(transaction=True)
def test_beat_schedule_synced_once_by_several_beats(broker_app: Any, clock: FakeClock) -> None:
    broker_app.conf.beat_schedule = {
        "every-5": {"task": "tests.add", "schedule": 5.0, "args": (1, 2)},
        "nightly": {"task": "tests.add", "schedule": crontab(minute=30, hour=2)},
        "broken": {"task": "tests.add", "schedule": 0.5},
    }
    broker_app.conf.timezone = "Europe/Berlin"
    beats = [
        DriftSafeScheduler(app=broker_app, clock=clock, authority=clock,
                           install_signal_handlers=False)
        for _ in range(3)
    ]
    try:
        assert PeriodicTask.objects.count() == 2
        every5 = PeriodicTask.objects.get(name="every-5")
        assert every5.interval_every == 5 and every5.interval_anchor == T0
        assert every5.next_slot_at == T0 + 5 * S and every5.args == [1, 2]
        nightly = PeriodicTask.objects.get(name="nightly")
        assert (nightly.crontab_minute, nightly.crontab_hour) == ("30", "2")
        assert nightly.timezone == "Europe/Berlin"
        # a restart later does not move the anchor
        clock.advance(timedelta(hours=1))
        again = DriftSafeScheduler(app=broker_app, clock=clock, authority=clock,
                                   install_signal_handlers=False)
        again.close()
        every5.refresh_from_db()
        assert every5.interval_anchor == T0
    finally:
        for beat in beats:
            beat.close()
