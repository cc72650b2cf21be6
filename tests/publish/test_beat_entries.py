"""Code that wraps Celery beat's ``Scheduler.apply_entry`` (Sentry's ``CeleryIntegration``
does, for a trace per message and its Crons) runs for each run a driftsafe beat publishes,
with the run as Celery's beat's entry would be, and what it changes reaches the message
(:mod:`celery_driftsafe.publish.beat_entries`). The wrappers here are installed as Sentry
installs its own: a plain function put on ``celery.beat.Scheduler``.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from celery.beat import Scheduler
from celery.schedules import crontab, schedule, solar

from celery_driftsafe.core.headers import HEADER_RUN_ID
from celery_driftsafe.models import PeriodicTask, Run, RunStatus, ScheduleKind
from celery_driftsafe.publish.beat_entries import Unmapped, celery_schedule
from celery_driftsafe.scheduler import DriftSafeScheduler
from celery_driftsafe.testing import FakeClock
from tests.support import T0, drain
from tests.support.factories import interval_task

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def wrap_apply_entry(
    monkeypatch: pytest.MonkeyPatch,
) -> Callable[[Callable[..., Any]], list[Any]]:
    """Put ``around(original, scheduler, entry, producer)`` in place of Celery's
    ``Scheduler.apply_entry``, on the class; returns the entries it was handed."""

    def install(around: Callable[..., Any]) -> list[Any]:
        original = Scheduler.apply_entry
        seen: list[Any] = []

        def wrapped_apply_entry(*args: Any, **kwargs: Any) -> Any:
            scheduler, entry = args  # as Sentry's wrapper reads them: the producer by name
            seen.append(entry)
            return around(original, scheduler, entry, kwargs.get("producer"))

        monkeypatch.setattr(Scheduler, "apply_entry", wrapped_apply_entry)
        return seen

    return install


def add_header(original: Any, scheduler: Any, entry: Any, producer: Any) -> Any:
    """As Sentry's wrapper: the entry's headers taken out, one added, put back."""
    headers = entry.options.pop("headers", {})
    headers["wrapper-header"] = entry.name
    entry.options["headers"] = headers
    return original(scheduler, entry, producer=producer)


def crontab_task(name: str, **fields: Any) -> PeriodicTask:
    task = PeriodicTask(
        name=name,
        task="tests.add",
        schedule_kind=ScheduleKind.CRONTAB,
        args=[1, 2],
        **fields,
    )
    task.save()
    return task


def test_a_wrapped_apply_entry_gets_each_run_as_celerys_beat_entry(
    scheduler: DriftSafeScheduler,
    clock: FakeClock,
    wrap_apply_entry: Callable[[Callable[..., Any]], list[Any]],
) -> None:
    interval_task("minutely", 60, anchor=T0, next_slot_at=T0, args=[2, 3], queue="")
    interval_task("plain", 60, anchor=T0, next_slot_at=T0 + timedelta(minutes=5), args=[4, 5])
    assert not scheduler.dispatcher.entries.wrapped()  # type: ignore[union-attr]
    scheduler.run_round()
    assert [m.get("wrapper-header") for m in drain()] == [None]  # Celery's own: not handed

    seen = wrap_apply_entry(add_header)
    clock.advance(timedelta(minutes=5))
    scheduler.run_round()
    messages = sorted(drain(), key=lambda m: m["args"])
    runs = {run.pk: run for run in Run.objects.filter(slot=T0 + timedelta(minutes=5))}
    assert [m["wrapper-header"] for m in messages] == ["minutely", "plain"]
    assert {m[HEADER_RUN_ID] for m in messages} == set(runs)
    assert all(run.status == RunStatus.DISPATCHED for run in runs.values())
    entries = sorted(seen, key=lambda entry: entry.args)
    assert [(e.name, e.task, e.args, e.kwargs) for e in entries] == [
        ("minutely", "tests.add", [2, 3], {}),
        ("plain", "tests.add", [4, 5], {}),
    ]
    assert all(type(e.schedule) is schedule for e in entries)
    assert [e.schedule.run_every for e in entries] == [timedelta(minutes=1)] * 2
    # what the wrapper was handed is what the message says: the run's headers among them
    assert entries[0].options["headers"][HEADER_RUN_ID] == messages[0][HEADER_RUN_ID]


def test_a_wrapper_cannot_take_the_runs_headers_away(
    scheduler: DriftSafeScheduler, wrap_apply_entry: Callable[[Callable[..., Any]], list[Any]]
) -> None:
    def drop_headers(original: Any, scheduler: Any, entry: Any, producer: Any) -> Any:
        entry.options.pop("headers")
        entry.options["shadow"] = "shadowed.add"
        return original(scheduler, entry, producer=producer)

    wrap_apply_entry(drop_headers)
    interval_task("minutely", 60, anchor=T0, next_slot_at=T0, args=[2, 3])
    scheduler.run_round()
    (message,) = drain()
    assert message[HEADER_RUN_ID] == Run.objects.get().pk
    assert message["shadow"] == "shadowed.add"  # what else it changed goes out


def test_a_publish_that_fails_inside_apply_entry_is_recorded_not_lost(
    scheduler: DriftSafeScheduler, wrap_apply_entry: Callable[[Callable[..., Any]], list[Any]]
) -> None:
    """Celery's ``apply_entry`` logs a publish's error and returns; the run must not then
    count as published. Arguments that do not fit the task fail it, as without a wrapper."""
    wrap_apply_entry(add_header)
    interval_task("misfit", 60, anchor=T0, next_slot_at=T0, args=[1])
    scheduler.run_round()
    assert drain() == []
    run = Run.objects.get()
    assert run.status == RunStatus.FAILED
    assert "the arguments do not fit the task's signature" in run.error


def test_a_wrapper_that_does_not_publish_leaves_the_run_to_be_tried_again(
    scheduler: DriftSafeScheduler, wrap_apply_entry: Callable[[Callable[..., Any]], list[Any]]
) -> None:
    def swallow(original: Any, scheduler: Any, entry: Any, producer: Any) -> None:
        return None

    seen = wrap_apply_entry(swallow)
    interval_task("minutely", 60, anchor=T0, next_slot_at=T0, args=[2, 3])
    scheduler.run_round()
    assert drain() == [] and len(seen) == 1
    run = Run.objects.get()
    assert (run.status, run.dispatched_at) == (RunStatus.CLAIMED, None)
    assert "apply_entry did not publish the run" in run.error
    assert run.retry_at is not None  # tried again, with backoff


def test_nothing_is_built_ahead_while_runs_go_through_apply_entry(
    scheduler: DriftSafeScheduler,
    wrap_apply_entry: Callable[[Callable[..., Any]], list[Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fast path's messages built ahead (while nothing is due) would never be used."""
    interval_task("later", 60, anchor=T0, next_slot_at=T0 + timedelta(seconds=30), args=[1, 2])
    wrap_apply_entry(add_header)
    scheduler.run_round()
    assert scheduler._prebuilder.built == 0
    monkeypatch.undo()  # Celery's own apply_entry again: built ahead
    scheduler.run_round()
    assert scheduler._prebuilder.built == 1


def test_a_subclass_that_overrides_apply_entry_gets_the_runs_too(
    broker_app: Any, clock: FakeClock
) -> None:
    names: list[str] = []

    class Counting(DriftSafeScheduler):
        def apply_entry(self, entry: Any, producer: Any = None) -> None:
            names.append(entry.name)
            super().apply_entry(entry, producer)

    sched = Counting(app=broker_app, clock=clock, authority=clock, install_signal_handlers=False)
    try:
        interval_task("minutely", 60, anchor=T0, next_slot_at=T0, args=[2, 3])
        sched.run_round()
    finally:
        sched.close()
    assert names == ["minutely"]
    assert [m["args"] for m in drain()] == [[2, 3]]


def test_each_schedule_is_the_celery_schedule_celerys_beat_would_hold() -> None:
    every = interval_task("every", 90, anchor=T0)
    assert type(celery_schedule(every)) is schedule
    assert celery_schedule(every).run_every == timedelta(seconds=90)
    cron = crontab_task(
        "cron",
        crontab_minute="*/5",
        crontab_hour="9-17",
        crontab_day_of_week="1-5",
        timezone="Europe/Paris",
    )
    mapped = celery_schedule(cron)
    assert isinstance(mapped, crontab)
    assert mapped == crontab(minute="*/5", hour="9-17", day_of_week="1-5")
    assert (mapped._orig_minute, mapped._orig_hour, mapped._orig_day_of_week) == (
        "*/5",
        "9-17",
        "1-5",
    )
    assert mapped.tz == ZoneInfo("Europe/Paris")
    sun = PeriodicTask(
        name="sun",
        task="tests.add",
        schedule_kind=ScheduleKind.SOLAR,
        solar_event="sunset",
        solar_latitude=48.85,
        solar_longitude=2.35,
    )
    assert isinstance(celery_schedule(sun), solar)
    # no Celery class: a crontab with seconds, a one-off instant
    seconds = crontab_task("seconds", crontab_second="*/10")
    once = PeriodicTask(
        name="once", task="tests.add", schedule_kind=ScheduleKind.ONE_OFF, one_off_at=T0
    )
    assert isinstance(celery_schedule(seconds), Unmapped)
    assert isinstance(celery_schedule(once), Unmapped)


#: Sentry Crons' monitors, for a driftsafe task's schedule and for Celery's beat's entry of the
#: same schedule, read by Sentry's own code. In a process of its own: importing Sentry's Celery
#: integration imports eventlet, which then warns at every fork of this one.
SENTRY_MONITORS = """
import json
from datetime import UTC, datetime, timedelta

import django

django.setup()
from celery import Celery
from celery.schedules import crontab, schedule
from sentry_sdk.integrations.celery.beat import _get_monitor_config

from celery_driftsafe.models import PeriodicTask
from celery_driftsafe.publish.beat_entries import celery_schedule

app = Celery("crons", set_as_current=False)
paris = Celery("crons-paris", set_as_current=False)
paris.conf.timezone = "Europe/Paris"
hourly = PeriodicTask(
    name="hourly", task="t", schedule_kind="interval", interval_every=3600,
    interval_unit="seconds", interval_anchor=datetime(2026, 3, 1, tzinfo=UTC),
)
cron = PeriodicTask(
    name="cron", task="t", schedule_kind="crontab", crontab_minute="30", crontab_hour="4",
    timezone="Europe/Paris",
)
print(json.dumps({
    "hourly": [
        _get_monitor_config(celery_schedule(hourly), app, "hourly"),
        _get_monitor_config(schedule(timedelta(hours=1)), app, "hourly"),
    ],
    "cron": [
        _get_monitor_config(celery_schedule(cron), app, "cron"),
        _get_monitor_config(crontab(minute="30", hour="4", app=paris), paris, "cron"),
    ],
}))
"""


def test_sentry_crons_reads_the_schedules_as_from_celerys_beat() -> None:
    """Sentry's own reading of an entry's schedule is the oracle: the monitor it would set up
    for the driftsafe task is the one for Celery's beat's entry of the same schedule."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings"}
    done = subprocess.run(
        [sys.executable, "-c", SENTRY_MONITORS], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    monitors = json.loads(done.stdout.splitlines()[-1])
    assert (
        monitors["hourly"]
        == [{"schedule": {"type": "interval", "value": 1, "unit": "hour"}, "timezone": "UTC"}] * 2
    )
    assert (
        monitors["cron"]
        == [{"schedule": {"type": "crontab", "value": "30 4 * * *"}, "timezone": "Europe/Paris"}]
        * 2
    )
