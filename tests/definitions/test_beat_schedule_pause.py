"""``pause_after_failures`` in a ``beat_schedule`` entry's ``options``: mirrored into the task,
changed and removed with the entry, a bad value named by its key."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from celery import Celery

from celery_driftsafe.definitions.beat_schedule import (
    entry_fields,
    entry_report,
    sync_beat_schedule,
)
from celery_driftsafe.models import PeriodicTask
from tests.support import T0

H = timedelta(hours=1)


def _entry(**options: Any) -> dict[str, Any]:
    return {"task": "tests.add", "schedule": 10.0, "args": (1, 2), "options": options}


@pytest.mark.django_db
def test_the_option_is_synced_changed_and_removed_with_the_entry(app: Celery) -> None:
    app.conf.beat_schedule = {"e": _entry(pause_after_failures=3, queue="q")}
    assert sync_beat_schedule(app, now=T0).created == ["e"]
    assert PeriodicTask.objects.get(name="e").pause_after_failures == 3
    assert sync_beat_schedule(app, now=T0 + H).unchanged == ["e"]
    app.conf.beat_schedule = {"e": _entry(pause_after_failures=5, queue="q")}
    assert sync_beat_schedule(app, now=T0 + 2 * H).updated == ["e"]
    assert PeriodicTask.objects.get(name="e").pause_after_failures == 5
    app.conf.beat_schedule = {"e": _entry(queue="q")}
    assert sync_beat_schedule(app, now=T0 + 3 * H).updated == ["e"]
    assert PeriodicTask.objects.get(name="e").pause_after_failures is None


@pytest.mark.django_db
@pytest.mark.parametrize("value", [-1, "3", 1.5, True])
def test_a_bad_value_is_an_error_naming_the_option(app: Celery, value: Any) -> None:
    app.conf.beat_schedule = {"bad": _entry(pause_after_failures=value), "good": _entry()}
    report = sync_beat_schedule(app, now=T0)
    assert report.created == ["good"]
    assert "options.pause_after_failures" in report.errors["bad"]
    assert "whole number of failed or missed runs in a row" in report.errors["bad"]
    assert not PeriodicTask.objects.filter(name="bad").exists()


def test_the_import_report_carries_the_option() -> None:
    entry = _entry(pause_after_failures=2, countdown=5)
    carried, dropped = entry_report(entry, entry_fields("e", entry))
    assert ("options.pause_after_failures", "pause_after_failures") in carried
    assert [key for key, _ in dropped] == ["options.countdown"]


@pytest.mark.django_db
def test_a_paused_task_stays_paused_when_its_beats_start_again(app: Celery) -> None:
    """A restart syncs the entries again: a task paused after failures keeps its pause, its
    reason and its count, edited entry or not (only re-enabling clears them)."""
    app.conf.beat_schedule = {"e": _entry(pause_after_failures=2)}
    sync_beat_schedule(app, now=T0)
    paused = {"enabled": False, "disabled_reason": "paused", "consecutive_failures": 2}
    PeriodicTask.objects.filter(name="e").update(**paused)
    sync_beat_schedule(app, now=T0 + H)
    app.conf.beat_schedule = {"e": _entry(pause_after_failures=2, queue="other")}
    assert sync_beat_schedule(app, now=T0 + 2 * H).updated == ["e"]
    task = PeriodicTask.objects.get(name="e")
    assert (task.enabled, task.disabled_reason, task.consecutive_failures) == (False, "paused", 2)
