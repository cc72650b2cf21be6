"""The preview of a task's next slots (``core/preview.py``, ``definitions/changes.preview``),
and that it matches what a beat then fires."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from celery_driftsafe.core.bounds import Limits, bounded
from celery_driftsafe.core.jitter import due_instant
from celery_driftsafe.core.preview import SlotRow, instant_text, upcoming_slots
from celery_driftsafe.core.schedules import Crontab, Interval, OneOff
from celery_driftsafe.definitions import changes
from celery_driftsafe.models import PeriodicTask
from tests.support.factories import crontab_task

BERLIN = ZoneInfo("Europe/Berlin")
HOUR = timedelta(hours=1)
#: Noon UTC, two days before Berlin's clocks go forward (2026-03-29, 02:00 CET -> 03:00 CEST).
BEFORE_SPRING = datetime(2026, 3, 27, 12, 0, tzinfo=UTC)
#: Noon UTC, the day before they go back (2026-10-25, 03:00 CEST -> 02:00 CET).
BEFORE_AUTUMN = datetime(2026, 10, 24, 12, 0, tzinfo=UTC)


def berlin(*fields: int) -> datetime:
    return datetime(*fields, tzinfo=BERLIN)


# -- the pure function ----------------------------------------------------------------------


def test_a_crontab_at_half_past_two_across_the_spring_gap() -> None:
    schedule = Crontab(minute="30", hour="2", timezone="Europe/Berlin")
    first = schedule.next_after(BEFORE_SPRING)
    preview = upcoming_slots(schedule, first, Limits("nightly"), zone="Europe/Berlin", count=4)
    assert [row.slot for row in preview.rows] == [
        berlin(2026, 3, 28, 2, 30),
        berlin(2026, 3, 29, 3, 0),  # 02:30 does not exist that night: the gap's end
        berlin(2026, 3, 30, 2, 30),
        berlin(2026, 3, 31, 2, 30),
    ]
    assert [row.local.strftime("%H:%M %z") for row in preview.rows] == [
        "02:30 +0100",
        "03:00 +0200",
        "02:30 +0200",
        "02:30 +0200",
    ]
    assert all(row.slot.tzinfo is UTC for row in preview.rows)
    assert [row.offset_change for row in preview.rows] == [None, (HOUR, 2 * HOUR), None, None]
    assert not any(row.jittered for row in preview.rows)
    assert preview.end is None


def test_an_hourly_crontab_across_the_autumn_repeat() -> None:
    schedule = Crontab(minute="0", hour="*", timezone="Europe/Berlin")
    start = datetime(2026, 10, 24, 23, 30, tzinfo=UTC)  # 01:30 CEST
    preview = upcoming_slots(
        schedule, schedule.next_after(start), Limits("hourly"), zone="Europe/Berlin", count=4
    )
    # 02:00 happens twice (CEST, then CET): an hourly crontab fires both.
    assert [row.slot for row in preview.rows] == [
        datetime(2026, 10, 25, hour, 0, tzinfo=UTC) for hour in (0, 1, 2, 3)
    ]
    assert [row.local.strftime("%H:%M %z") for row in preview.rows] == [
        "02:00 +0200",
        "02:00 +0100",
        "03:00 +0100",
        "04:00 +0100",
    ]
    assert [row.offset_change for row in preview.rows] == [None, (2 * HOUR, HOUR), None, None]


def test_jitter_gives_each_slot_the_claims_due_instant() -> None:
    schedule = Interval(timedelta(minutes=5), BEFORE_SPRING)
    limits = Limits("spread", jitter_seconds=30)
    preview = upcoming_slots(schedule, BEFORE_SPRING, limits, count=10)
    assert len(preview.rows) == 10
    for row in preview.rows:
        assert row.due == due_instant("spread", row.slot, 30)
        assert row.slot <= row.due < row.slot + timedelta(seconds=30)
    assert any(row.jittered for row in preview.rows)
    assert [row.slot for row in preview.rows] == [
        BEFORE_SPRING + k * timedelta(minutes=5) for k in range(10)
    ]


def test_a_jitter_longer_than_the_period_fires_a_slot_with_the_one_before_when_that_is_later() -> (
    None
):
    """Interval 1 s, jitter 3 s: a slot whose own instant comes before the previous slot's
    is claimed with it (the claim takes a task's slots in order), so it fires at the later of
    its own instant and the previous slot's: the running maximum of the due instants."""
    schedule = Interval(timedelta(seconds=1), BEFORE_SPRING)
    preview = upcoming_slots(schedule, BEFORE_SPRING, Limits("tight", jitter_seconds=3), count=30)
    assert [row.slot for row in preview.rows] == [
        BEFORE_SPRING + k * timedelta(seconds=1) for k in range(30)
    ]
    latest = None
    for row in preview.rows:
        assert row.due == due_instant("tight", row.slot, 3)
        latest = row.due if latest is None else max(latest, row.due)
        assert row.fires_at == latest
        assert row.held == (row.fires_at > row.due)
    held = [row for row in preview.rows if row.held]
    assert held, "with a jitter three times the period some slot is held"
    assert max(row.fires_at - row.due for row in held) > timedelta(seconds=1)
    # Without a jitter a slot fires at itself.
    plain = upcoming_slots(schedule, BEFORE_SPRING, Limits("tight"), count=5)
    assert all(row.fires_at == row.due == row.slot and not row.held for row in plain.rows)


def test_the_texts_show_fractions_of_a_second_where_an_instant_has_them() -> None:
    start = BEFORE_SPRING + timedelta(microseconds=250_000)
    schedule = Interval(timedelta(microseconds=1_500_000), start)
    preview = upcoming_slots(schedule, start, Limits("fine", jitter_seconds=3), count=3)
    assert [instant_text(row.slot) for row in preview.rows] == [
        "2026-03-27 12:00:00.25",
        "2026-03-27 12:00:01.75",
        "2026-03-27 12:00:03.25",
    ]
    assert preview.rows[0].local_text == "2026-03-27 12:00:00.25 +00:00"
    row = preview.rows[0]
    assert row.due_text == instant_text(row.due, date=False)
    assert row.due_text.startswith("12:00:0") and "." in row.due_text
    assert instant_text(BEFORE_SPRING) == "2026-03-27 12:00:00"
    assert instant_text(BEFORE_SPRING + timedelta(microseconds=10), date=False) == "12:00:00.00001"
    late = SlotRow(
        BEFORE_SPRING,
        BEFORE_SPRING + timedelta(hours=13),
        BEFORE_SPRING + timedelta(hours=13),
        BEFORE_SPRING,
    )
    assert late.fires_text == "2026-03-28 01:00:00"  # on the next day: with its date


def test_valid_until_ends_the_list_with_the_reason() -> None:
    until = BEFORE_SPRING + timedelta(minutes=12)
    schedule = bounded(Interval(timedelta(minutes=5), BEFORE_SPRING), None, until)
    preview = upcoming_slots(schedule, BEFORE_SPRING, Limits("bounded", valid_until=until))
    assert [row.slot for row in preview.rows] == [
        BEFORE_SPRING + k * timedelta(minutes=5) for k in range(3)
    ]
    assert preview.end is not None and preview.end.startswith("valid until")


def test_valid_from_moves_the_first_slot() -> None:
    since = BEFORE_SPRING + timedelta(minutes=11)
    schedule = bounded(Interval(timedelta(minutes=5), BEFORE_SPRING), since, None)
    preview = upcoming_slots(schedule, BEFORE_SPRING, Limits("later", valid_from=since), count=2)
    assert [row.slot for row in preview.rows] == [
        BEFORE_SPRING + timedelta(minutes=15),
        BEFORE_SPRING + timedelta(minutes=20),
    ]


def test_max_runs_counts_the_runs_already_made() -> None:
    schedule = Interval(timedelta(minutes=5), BEFORE_SPRING)
    preview = upcoming_slots(schedule, BEFORE_SPRING, Limits("capped", max_runs=5, run_count=2))
    assert len(preview.rows) == 3
    assert preview.end == "max runs: it reached 5 runs"


def test_a_run_once_task_shows_its_one_slot() -> None:
    schedule = Interval(timedelta(minutes=5), BEFORE_SPRING)
    preview = upcoming_slots(schedule, BEFORE_SPRING, Limits("once", run_once=True))
    assert [row.slot for row in preview.rows] == [BEFORE_SPRING]
    assert preview.end == "run once: it fired its run"


def test_a_one_off_has_one_slot_then_none() -> None:
    preview = upcoming_slots(OneOff(BEFORE_SPRING), BEFORE_SPRING, Limits("one"))
    assert [row.slot for row in preview.rows] == [BEFORE_SPRING]
    assert preview.end == "the schedule has no slot left"
    assert upcoming_slots(OneOff(BEFORE_SPRING), None, Limits("one")).rows == []


# -- a row of the database, and what the beat then fires -------------------------------------


@pytest.mark.django_db
def test_an_unsaved_edit_previews_from_now_and_a_saved_task_from_its_next_slot(
    driftsafe_clock: Any, driftsafe: Any
) -> None:
    driftsafe_clock.set(BEFORE_SPRING)
    task = crontab_task("nightly", "30 2 * * *", "Europe/Berlin")
    saved = changes.preview(task, BEFORE_SPRING, count=2)
    assert [row.slot for row in saved.rows] == [
        berlin(2026, 3, 28, 2, 30),
        berlin(2026, 3, 29, 3, 0),
    ]
    task.crontab_hour = "4"  # edited, not saved
    edited = changes.preview(task, BEFORE_SPRING, count=2)
    assert [row.slot for row in edited.rows] == [
        berlin(2026, 3, 28, 4, 30),
        berlin(2026, 3, 29, 4, 30),
    ]
    assert PeriodicTask.objects.get(pk=task.pk).crontab_hour == "2"


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("start", "expression"),
    [
        (BEFORE_SPRING, "30 2 * * *"),
        (BEFORE_AUTUMN, "30 2 * * *"),
        (datetime(2026, 10, 24, 21, 30, tzinfo=UTC), "0 * * * *"),
    ],
)
def test_the_preview_is_what_the_beat_fires_across_a_dst_change(
    driftsafe_clock: Any, driftsafe: Any, start: datetime, expression: str
) -> None:
    driftsafe_clock.set(start)
    crontab_task("watched", expression, "Europe/Berlin", jitter_seconds=20, max_runs=8)
    task = PeriodicTask.objects.get(name="watched")
    preview = changes.preview(task, driftsafe_clock.now(), count=10)
    assert len(preview.rows) == 8
    assert preview.end == "max runs: it reached 8 runs"
    assert any(row.offset_change is not None for row in preview.rows)  # a DST change inside
    driftsafe.advance_to(preview.rows[-1].due + timedelta(days=3))
    assert driftsafe.fired("watched") == [row.slot for row in preview.rows]
    published = [message.published_at for message in driftsafe.messages("watched")]
    assert published == [row.due for row in preview.rows]  # each at its jittered instant
