"""Celery's ``beat_schedule`` mirrored into rows (what every beat does at start), called
directly against the real database: each entry is checked on its own, a bad one is skipped
with a log line naming the entry and its key at fault, and the others sync."""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import pytest
from celery import Celery

from celery_driftsafe.definitions.beat_schedule import sync_beat_schedule
from celery_driftsafe.models import PeriodicTask
from tests.support import T0

GOOD = {"task": "tests.add", "schedule": 10.0, "args": (1, 2)}


def _deep(levels: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(levels - 1):
        value = [value]
    return value


#: One bad shape each: (what the entry sets, the key named, a piece of the reason).
BAD_ENTRIES = {
    # arguments the registered task cannot take: every slot would fail at publish
    "args-unfit": ({"args": (1, 2, 3)}, "args", "takes 2 positional arguments but 3 were given"),
    "kwargs-unfit": ({"kwargs": {"z": 1}}, "args", "unexpected keyword argument 'z'"),
    "args-int": ({"args": 5}, "args", "must be a list or tuple of arguments, not int 5"),
    # a string is not an argument list (it was sent as ['a', 'b', 'c'])
    "args-text": ({"args": "abc"}, "args", "not the string 'abc'"),
    "kwargs-list": ({"kwargs": [1, 2]}, "kwargs", "must be a dict, not list [1, 2]"),
    "kwargs-nan": ({"kwargs": {"a": math.nan}}, "kwargs", "holds nan, which is not a finite"),
    "kwargs-key": ({"kwargs": {1: "a"}}, "kwargs", "keys must be text"),
    "args-deep": ({"args": _deep(100)}, "args", "nests deeper than 64 levels"),
    "args-object": ({"args": (object(),)}, "args", "is not a JSON value"),
    "options-int": ({"options": 5}, "options", "must be a dict, not int 5"),
    "headers-int": ({"options": {"headers": 5}}, "options.headers", "must be a dict, not int"),
    "headers-inf": (
        {"options": {"headers": {"x": math.inf}}},
        "options.headers",
        "holds inf",
    ),
    "expires-inf": ({"options": {"expires": math.inf}}, "options.expires", "finite number"),
    "overlap-unknown": (
        {"options": {"overlap_policy": "buffer_two"}},
        "options.overlap_policy",
        "unknown policy 'buffer_two'; use one of allow, skip, buffer_one, buffer_all, replace",
    ),
    "schedule-inf": ({"schedule": math.inf}, "schedule", "interval inf s must be a finite"),
    "schedule-nan": ({"schedule": math.nan}, "schedule", "interval nan s must be a finite"),
    "schedule-huge": ({"schedule": 1e20}, "schedule", "up to 3155760000 (a hundred years)"),
    "schedule-timedelta": (
        {"schedule": timedelta(days=999_999_999)},
        "schedule",
        "up to 3155760000",
    ),
    "task-int": ({"task": 5}, "task", "must be a task name, not int 5"),
    "schedule-none": ({"schedule": None}, "schedule", "NoneType schedules are not supported"),
    "dates-text": (
        {"options": {"excluded_dates": "2026-12-25"}},
        "options.excluded_dates",
        "must be a list of dates",
    ),
    "dates-bad": (
        {"options": {"excluded_dates": ["2026-12-25", "xmas"]}},
        "options.excluded_dates",
        "'xmas' is no",
    ),
    "calendars-text": (
        {"options": {"calendars": "holidays"}},
        "options.calendars",
        "must be a list of calendar",
    ),
    "calendars-unknown": (
        {"options": {"calendars": ["no such"]}},
        "options.calendars",
        "no calendar named 'no such'",
    ),
}


@pytest.mark.django_db
@pytest.mark.parametrize("bad", list(BAD_ENTRIES))
def test_a_bad_entry_is_skipped_by_name_and_field_and_the_others_sync(
    app: Celery, bad: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Each of these aborted the whole sync with a traceback (the entries after it never
    synced), or was written wrong (``"abc"`` as three arguments), or was dropped as
    "unchanged" (NaN, which the database refused)."""
    overrides, field, reason = BAD_ENTRIES[bad]
    app.conf.beat_schedule = {"first": GOOD, bad: {**GOOD, **overrides}, "last": GOOD}
    with caplog.at_level("ERROR", logger="celery_driftsafe.beat_schedule"):
        report = sync_beat_schedule(app, now=T0)
    assert report.created == ["first", "last"] and report.unchanged == []
    assert list(report.errors) == [bad]
    assert f"beat_schedule[{bad!r}] {field}: " in report.errors[bad]
    assert reason in report.errors[bad]
    assert sorted(PeriodicTask.objects.values_list("name", flat=True)) == ["first", "last"]
    assert PeriodicTask.objects.get(name="last").args == [1, 2]
    [record] = caplog.records
    assert record.action == "sync" and record.task == bad  # type: ignore[attr-defined]
    message = record.getMessage()
    assert message.startswith(f"beat_schedule entry {bad!r} skipped, nothing of it written: ")
    assert f"{field}: " in message and reason in message


@pytest.mark.django_db
def test_an_entry_sets_its_tasks_overlap_policy_and_without_it_the_rows_own_stays(
    app: Celery,
) -> None:
    """``options["overlap_policy"]`` sets the task's overlap policy (``buffer_all``,
    ``replace``); an entry without it leaves the row's policy as it is (set in the admin,
    say), and a restart changes nothing."""
    app.conf.beat_schedule = {
        "queued": {**GOOD, "options": {"overlap_policy": "buffer_all", "queue": "slow"}},
        "replacing": {**GOOD, "options": {"overlap_policy": "replace"}},
        "plain": GOOD,
    }
    assert sync_beat_schedule(app, now=T0).created == ["queued", "replacing", "plain"]
    assert PeriodicTask.objects.get(name="queued").overlap_policy == "buffer_all"
    assert PeriodicTask.objects.get(name="replacing").overlap_policy == "replace"
    assert PeriodicTask.objects.get(name="queued").queue == "slow"
    PeriodicTask.objects.filter(name="plain").update(overlap_policy="skip")  # the admin's
    report = sync_beat_schedule(app, now=T0 + timedelta(hours=1))
    assert report.unchanged == ["queued", "replacing", "plain"]
    assert PeriodicTask.objects.get(name="plain").overlap_policy == "skip"
    app.conf.beat_schedule = {"queued": {**GOOD, "options": {"overlap_policy": "skip"}}}
    assert sync_beat_schedule(app, now=T0 + timedelta(hours=2)).updated == ["queued"]
    assert PeriodicTask.objects.get(name="queued").overlap_policy == "skip"


@pytest.mark.django_db
def test_an_entry_that_is_not_a_dict_or_misses_a_key_is_named(app: Celery) -> None:
    app.conf.beat_schedule = {
        "text": "tests.add every 10 s",
        "no-task": {"schedule": 10.0},
        "no-schedule": {"task": "tests.add"},
        "fine": GOOD,
    }
    report = sync_beat_schedule(app, now=T0)
    assert report.created == ["fine"]
    assert report.errors == {
        "text": "beat_schedule['text'] entry: must be a dict with 'task' and 'schedule', not "
        "the string 'tests.add every 10 s'",
        "no-task": "beat_schedule['no-task'] task: is missing: an entry needs 'task' and "
        "'schedule'",
        "no-schedule": "beat_schedule['no-schedule'] schedule: is missing: an entry needs "
        "'task' and 'schedule'",
    }


@pytest.mark.django_db
def test_an_entry_that_turns_bad_keeps_its_row_as_it_was(app: Celery) -> None:
    """An entry synced before and broken since: its row is left whole (not half updated),
    and it is reported, not counted unchanged."""
    app.conf.beat_schedule = {"kept": {**GOOD, "task": "tests.any", "kwargs": {"a": 1}}}
    sync_beat_schedule(app, now=T0)
    before = PeriodicTask.objects.values().get(name="kept")
    app.conf.beat_schedule = {
        "kept": {"task": "tests.mul", "schedule": 20.0, "kwargs": {"a": math.nan}}
    }
    report = sync_beat_schedule(app, now=T0 + timedelta(hours=1))
    assert (report.updated, report.unchanged, list(report.errors)) == ([], [], ["kept"])
    assert "kwargs: holds nan" in report.errors["kept"]
    assert PeriodicTask.objects.values().get(name="kept") == before


@pytest.mark.django_db
def test_an_entry_the_model_refuses_names_the_model_field(app: Celery) -> None:
    app.conf.beat_schedule = {
        "reserved": {**GOOD, "options": {"headers": {"id": "another"}}},
        "fine": GOOD,
    }
    report = sync_beat_schedule(app, now=T0)
    assert report.created == ["fine"]
    assert report.errors["reserved"].startswith("headers: must not set id")


@pytest.mark.django_db
def test_tuples_inside_arguments_are_stored_as_lists_and_a_restart_changes_nothing(
    app: Celery,
) -> None:
    app.conf.beat_schedule = {
        "pairs": {**GOOD, "task": "tests.any", "args": ((1, 2), (3, 4)), "kwargs": {"p": (5,)}}
    }
    assert sync_beat_schedule(app, now=T0).created == ["pairs"]
    task = PeriodicTask.objects.get(name="pairs")
    assert (task.args, task.kwargs) == ([[1, 2], [3, 4]], {"p": [5]})
    again = sync_beat_schedule(app, now=T0 + timedelta(hours=1))
    assert (again.unchanged, again.updated) == (["pairs"], [])


@pytest.mark.django_db(transaction=True)
def test_excluded_dates_and_calendars_of_an_entry(app: Celery) -> None:
    from datetime import date

    from celery_driftsafe.models import Calendar

    Calendar.objects.create(name="holidays DE", dates=["2026-12-25", "2026-12-26"])
    Calendar.objects.create(name="shutdown", dates=["2026-12-28"])
    app.conf.beat_schedule = {
        "report": {
            **GOOD,
            "options": {
                "excluded_dates": [date(2026, 12, 31), "2026-12-24", "2026-12-24"],
                "calendars": ["holidays DE", "shutdown"],
            },
        }
    }
    assert sync_beat_schedule(app).created == ["report"]
    task = PeriodicTask.objects.get(name="report")
    assert task.excluded_dates == ["2026-12-24", "2026-12-31"]
    assert sorted(task.calendars.values_list("name", flat=True)) == ["holidays DE", "shutdown"]
    assert task.calendar_exclusions == {
        "dates": ["2026-12-25", "2026-12-26", "2026-12-28"],
        "crontabs": [],
    }
    # a restart with the same entry changes nothing; one calendar fewer is an update
    assert sync_beat_schedule(app).unchanged == ["report"]
    app.conf.beat_schedule["report"]["options"]["calendars"] = ["shutdown"]
    assert sync_beat_schedule(app).updated == ["report"]
    task.refresh_from_db()
    assert task.calendar_exclusions == {"dates": ["2026-12-28"], "crontabs": []}
