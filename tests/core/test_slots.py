"""Hand-written cases for slot arithmetic: intervals, one-offs, crontab syntax and calendar.

DST cases live in test_slots_dst.py, property-based comparisons in test_slots_properties.py.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from celery_driftsafe.core.schedules import (
    Crontab,
    Interval,
    OneOff,
    Schedule,
    shared_crontab,
    shared_interval,
)
from celery_driftsafe.exceptions import ScheduleError

BERLIN = ZoneInfo("Europe/Berlin")


def utc(
    year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0
) -> datetime:
    return datetime(year, month, day, hour, minute, second, tzinfo=UTC)


def cron(expression: str, zone: str = "UTC") -> Crontab:
    return Crontab.from_expression(expression, zone)


def take(schedule: Schedule, after: datetime, count: int) -> list[datetime]:
    slots: list[datetime] = []
    current: datetime | None = after
    for _ in range(count):
        assert current is not None
        current = schedule.next_after(current)
        assert current is not None
        slots.append(current)
    return slots


# --------------------------------------------------------------------------- Interval


FIVE_MINUTES = Interval(timedelta(minutes=5), utc(2024, 1, 1, 0, 2))


def test_interval_slots_are_anchored() -> None:
    assert take(FIVE_MINUTES, utc(2024, 1, 1, 0, 0), 3) == [
        utc(2024, 1, 1, 0, 2),
        utc(2024, 1, 1, 0, 7),
        utc(2024, 1, 1, 0, 12),
    ]


def test_interval_has_slots_before_its_anchor() -> None:
    assert FIVE_MINUTES.first_at_or_after(utc(2023, 6, 1, 0, 0)) == utc(2023, 6, 1, 0, 2)
    assert FIVE_MINUTES.next_after(utc(2023, 12, 31, 23, 59)) == utc(2024, 1, 1, 0, 2)


def test_interval_sequence_does_not_depend_on_where_the_search_starts() -> None:
    early = list(FIVE_MINUTES.slots_between(utc(2023, 12, 31, 23, 0), utc(2024, 1, 1, 1, 0)))
    late = list(FIVE_MINUTES.slots_between(utc(2024, 1, 1, 0, 31), utc(2024, 1, 1, 1, 0)))
    assert late == [slot for slot in early if slot >= utc(2024, 1, 1, 0, 31)]
    assert len(early) == 24


def test_interval_boundaries() -> None:
    slot = utc(2024, 1, 1, 0, 7)
    assert FIVE_MINUTES.first_at_or_after(slot) == slot
    assert FIVE_MINUTES.next_after(slot) == utc(2024, 1, 1, 0, 12)
    just_before = slot - timedelta(microseconds=1)
    assert FIVE_MINUTES.first_at_or_after(just_before) == slot
    assert FIVE_MINUTES.next_after(just_before) == slot
    assert list(FIVE_MINUTES.slots_between(slot, slot)) == []
    assert list(FIVE_MINUTES.slots_between(slot, slot + timedelta(microseconds=1))) == [slot]
    assert list(FIVE_MINUTES.slots_between(slot + timedelta(hours=1), slot)) == []


def test_interval_returns_utc_whatever_the_zones_involved() -> None:
    interval = Interval(timedelta(hours=1), datetime(2024, 3, 31, 0, 30, tzinfo=BERLIN))
    slot = interval.first_at_or_after(datetime(2024, 3, 31, 3, 0, tzinfo=BERLIN))
    assert slot == utc(2024, 3, 31, 1, 30)
    assert slot is not None and slot.tzinfo is UTC


def test_interval_counts_real_time_across_dst() -> None:
    # Anchored at noon in Berlin the day before clocks go forward: the next slot is 24 real
    # hours later, 13:00 CEST, not "noon again".
    daily = Interval(timedelta(days=1), datetime(2024, 3, 30, 12, 0, tzinfo=BERLIN))
    assert daily.next_after(utc(2024, 3, 30, 11, 0)) == utc(2024, 3, 31, 11, 0)


def test_interval_arithmetic_is_exact_far_from_the_anchor() -> None:
    every = timedelta(days=1, microseconds=7)
    interval = Interval(every, utc(2024, 1, 1))
    k = 700_000  # about 1,917 years either way: floats would have lost the microseconds
    slot = utc(2024, 1, 1) + k * every
    assert interval.first_at_or_after(slot - timedelta(microseconds=1)) == slot
    assert interval.next_after(slot) == slot + every
    assert interval.first_at_or_after(utc(2024, 1, 1) - k * every) == utc(2024, 1, 1) - k * every


def test_interval_of_one_microsecond_and_odd_anchor() -> None:
    tiny = Interval(timedelta(microseconds=1), utc(2024, 1, 1))
    instant = datetime(2024, 5, 5, 5, 5, 5, 123_457, tzinfo=UTC)
    assert tiny.first_at_or_after(instant) == instant
    assert tiny.next_after(instant) == instant + timedelta(microseconds=1)
    odd = Interval(timedelta(seconds=7), datetime(2024, 1, 1, 0, 0, 0, 500_000, tzinfo=UTC))
    assert odd.first_at_or_after(utc(2024, 1, 1, 0, 0, 1)) == datetime(
        2024, 1, 1, 0, 0, 7, 500_000, tzinfo=UTC
    )


def test_interval_gives_none_past_the_end_of_time() -> None:
    end = datetime.max.replace(tzinfo=UTC)
    assert Interval(timedelta(days=1), utc(2024, 1, 1)).next_after(end - timedelta(hours=1)) is None


@pytest.mark.parametrize(
    ("every", "anchor", "field"),
    [
        (timedelta(0), utc(2024, 1, 1), "every"),
        (timedelta(seconds=-5), utc(2024, 1, 1), "every"),
        (5, utc(2024, 1, 1), "every"),
        (timedelta(seconds=5), datetime(2024, 1, 1), "anchor"),
        (timedelta(seconds=5), "2024-01-01T00:00:00Z", "anchor"),
    ],
)
def test_interval_rejects_bad_input(every: object, anchor: object, field: str) -> None:
    with pytest.raises(ScheduleError) as caught:
        Interval(every, anchor)  # type: ignore[arg-type]
    assert caught.value.field == field


@pytest.mark.parametrize(
    ("every", "text"),
    [
        (timedelta(minutes=5), "every 5 minutes"),
        (timedelta(minutes=1), "every minute"),
        (timedelta(hours=1, minutes=30), "every 1 hour 30 minutes"),
        (timedelta(days=2), "every 2 days"),
        (timedelta(seconds=90), "every 1 minute 30 seconds"),
        (timedelta(milliseconds=250), "every 0.25 seconds"),
    ],
)
def test_interval_describe(every: timedelta, text: str) -> None:
    assert Interval(every, utc(2024, 1, 1)).describe() == text


# --------------------------------------------------------------------------- OneOff


def test_one_off_before_at_and_after() -> None:
    at = datetime(2024, 5, 1, 14, 0, tzinfo=BERLIN)
    once = OneOff(at)
    assert once.first_at_or_after(utc(2024, 5, 1)) == utc(2024, 5, 1, 12, 0)
    assert once.first_at_or_after(at) == at
    assert once.next_after(at) is None
    assert once.next_after(at - timedelta(microseconds=1)) == at
    assert once.first_at_or_after(at + timedelta(microseconds=1)) is None
    assert list(once.slots_between(utc(2024, 1, 1), utc(2025, 1, 1))) == [at]
    assert list(once.slots_between(utc(2024, 1, 1), at)) == []
    result = once.first_at_or_after(utc(2024, 1, 1))
    assert result is not None and result.tzinfo is UTC
    assert once.describe() == "once at 2024-05-01 12:00 UTC"


def test_one_off_requires_an_aware_instant() -> None:
    with pytest.raises(ScheduleError) as caught:
        OneOff(datetime(2024, 5, 1))
    assert caught.value.field == "at"


NAIVE = datetime(2024, 1, 1)
ALL_KINDS: list[Schedule] = [FIVE_MINUTES, OneOff(utc(2024, 1, 1)), Crontab()]


@pytest.mark.parametrize("schedule", ALL_KINDS, ids=["interval", "one-off", "crontab"])
@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.first_at_or_after(NAIVE),
        lambda s: s.next_after(NAIVE),
        lambda s: s.slots_between(NAIVE, utc(2025, 1, 1)),
        lambda s: s.slots_between(utc(2023, 1, 1), NAIVE),
        lambda s: s.next_after("2024-01-01T00:00:00Z"),
    ],
    ids=["first_at_or_after", "next_after", "slots_between-start", "slots_between-end", "text"],
)
def test_every_schedule_rejects_naive_arguments(
    schedule: Schedule, call: Callable[[Schedule], object]
) -> None:
    assert isinstance(schedule, Schedule)
    with pytest.raises(ScheduleError) as caught:
        call(schedule)
    assert caught.value.field == "after"


# --------------------------------------------------------------------------- Crontab syntax


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("*/15 * * * *", [utc(2024, 1, 1, 0, 15), utc(2024, 1, 1, 0, 30)]),
        ("5/20 * * * *", [utc(2024, 1, 1, 0, 5), utc(2024, 1, 1, 0, 25)]),
        ("10-20/5 * * * *", [utc(2024, 1, 1, 0, 10), utc(2024, 1, 1, 0, 15)]),
        ("7,3,50-51 * * * *", [utc(2024, 1, 1, 0, 3), utc(2024, 1, 1, 0, 7)]),
        ("0 9-17/4 * * *", [utc(2024, 1, 1, 9), utc(2024, 1, 1, 13)]),
        ("0 0 1 jan-MAR/2 *", [utc(2024, 3, 1), utc(2025, 1, 1)]),
        ("0 0 1 feb,Aug *", [utc(2024, 2, 1), utc(2024, 8, 1)]),
        ("  0   12  *  *  *  ", [utc(2024, 1, 1, 12), utc(2024, 1, 2, 12)]),
    ],
)
def test_crontab_syntax(expression: str, expected: list[datetime]) -> None:
    assert take(cron(expression), utc(2024, 1, 1, 0, 0), 2) == expected


@pytest.mark.parametrize(
    "day_of_week",
    ["0", "7", "sun", "SUN", "Sun", "0,7", "7-7", "0-0", "*/7", "sun,7"],
)
def test_sunday_is_0_and_7(day_of_week: str) -> None:
    # 2024-01-07 and 2024-01-14 are Sundays.
    schedule = Crontab("0", "0", "*", "*", day_of_week)
    assert take(schedule, utc(2024, 1, 1), 2) == [utc(2024, 1, 7), utc(2024, 1, 14)]


def test_weekday_names_and_open_ranges() -> None:
    # 2024-01-05 is a Friday.
    assert take(cron("0 0 * * fri-7"), utc(2024, 1, 4), 4) == [
        utc(2024, 1, 5),
        utc(2024, 1, 6),
        utc(2024, 1, 7),
        utc(2024, 1, 12),
    ]
    assert take(cron("0 0 * * 1/2"), utc(2024, 1, 7), 4) == [
        utc(2024, 1, 8),
        utc(2024, 1, 10),
        utc(2024, 1, 12),
        utc(2024, 1, 15),
    ]
    assert take(cron("0 8 * * Mon-FRI"), utc(2024, 1, 5, 9), 2) == [
        utc(2024, 1, 8, 8),
        utc(2024, 1, 9, 8),
    ]


def test_macros() -> None:
    assert cron("@daily") == cron("0 0 * * *")
    assert cron("@HOURLY").next_after(utc(2024, 1, 1, 5, 1)) == utc(2024, 1, 1, 6)
    assert cron("@weekly").next_after(utc(2024, 1, 1)) == utc(2024, 1, 7)
    assert cron("@yearly").next_after(utc(2024, 1, 1)) == utc(2025, 1, 1)


def test_crontab_boundaries() -> None:
    schedule = cron("*/10 * * * *")
    slot = utc(2024, 1, 1, 0, 20)
    assert schedule.first_at_or_after(slot) == slot
    assert schedule.next_after(slot) == utc(2024, 1, 1, 0, 30)
    assert schedule.next_after(slot - timedelta(microseconds=1)) == slot
    assert schedule.first_at_or_after(slot + timedelta(microseconds=1)) == utc(2024, 1, 1, 0, 30)
    assert list(schedule.slots_between(slot, utc(2024, 1, 1, 0, 40))) == [
        slot,
        utc(2024, 1, 1, 0, 30),
    ]


def test_crontab_equality_and_expression() -> None:
    assert Crontab("0", "9") == cron("0 9 * * *")
    assert hash(Crontab("0", "9")) == hash(cron("0 9 * * *"))
    assert cron("0 9 * * *", "Europe/Berlin") != cron("0 9 * * *")
    assert cron(" 0  9 * * mon ").expression == "0 9 * * mon"


def _error(build: object) -> ScheduleError:
    assert callable(build)
    with pytest.raises(ScheduleError) as caught:
        build()
    return caught.value


@pytest.mark.parametrize(
    ("expression", "field", "message"),
    [
        ("61 * * * *", "minute", "minute: 61 is out of range 0-59 in '61'"),
        ("* 24 * * *", "hour", "hour: 24 is out of range 0-23 in '24'"),
        ("* * 0 * *", "day_of_month", "day_of_month: 0 is out of range 1-31 in '0'"),
        ("* * 32 * *", "day_of_month", "day_of_month: 32 is out of range 1-31 in '32'"),
        ("* * * 13 *", "month_of_year", "month_of_year: 13 is out of range 1-12 in '13'"),
        ("* * * * 8", "day_of_week", "day_of_week: 8 is out of range 0-7 in '8'"),
        ("*/0 * * * *", "minute", "minute: step 0 is not allowed in '*/0'"),
        ("5-3 * * * *", "minute", "minute: range 5-3 runs backwards in '5-3'"),
        ("1,,2 * * * *", "minute", "minute: has an empty list item in '1,,2'"),
        ("x * * * *", "minute", "minute: 'x' is not a number in 'x'"),
        ("* * * foo *", "month_of_year", None),
        ("* * * * monday", "day_of_week", None),
        ("* * * * fri-sun", "day_of_week", None),
        ("1- * * * *", "minute", "minute: a number is missing in '1-'"),
        ("-1 * * * *", "minute", None),
        ("+5 * * * *", "minute", None),
        ("*/x * * * *", "minute", "minute: step 'x' is not a number in '*/x'"),
        ("*/ * * * *", "minute", None),
        ("1/2/3 * * * *", "minute", None),
        ("* * L * *", "day_of_month", None),
        ("* * ? * *", "day_of_month", None),
        ("* * * * 5#2", "day_of_week", None),
        ("* * * * jan", "day_of_week", None),
        ("* * * mon *", "month_of_year", None),
        ("٣ * * * *", "minute", None),  # an Arabic-Indic digit is not a cron number
        ("0 0 31 2 *", "day_of_month", None),
        ("0 0 30,31 2 *", "day_of_month", None),
        ("0 0 31 4,jun,9,11 *", "day_of_month", None),
        ("0 0 31 2 */2", "day_of_month", None),
        ("* * * *", "expression", None),
        ("* * * * * * *", "expression", None),  # 5 fields, or 6 with seconds first
        ("", "expression", None),
        ("@reboot", "expression", None),
    ],
)
def test_crontab_rejects(expression: str, field: str, message: str | None) -> None:
    error = _error(lambda: Crontab.from_expression(expression))
    assert error.field == field
    assert isinstance(error, ValueError)
    if message is not None:
        assert str(error) == message


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"minute": ""}, "minute"),
        ({"hour": "   "}, "hour"),
        ({"minute": "1 2"}, "minute"),
        ({"minute": 5}, "minute"),
        ({"timezone": "Mars/Olympus_Mons"}, "timezone"),
        ({"timezone": ""}, "timezone"),
        ({"timezone": "Europe/Berlin "}, "timezone"),
        ({"timezone": "/etc/passwd"}, "timezone"),
        ({"timezone": "../zoneinfo/UTC"}, "timezone"),
        ({"timezone": "America"}, "timezone"),
        ({"timezone": None}, "timezone"),
    ],
)
def test_crontab_rejects_fields(kwargs: dict[str, object], field: str) -> None:
    assert _error(lambda: Crontab(**kwargs)).field == field  # type: ignore[arg-type]


def test_expression_must_be_text() -> None:
    assert _error(lambda: Crontab.from_expression(None)).field == "expression"  # type: ignore[arg-type]


def test_impossible_days_are_fine_when_another_rule_can_fire() -> None:
    # Vixie OR: any Monday of February.
    assert cron("0 0 31 2 mon").next_after(utc(2024, 1, 1)) == utc(2024, 2, 5)
    # The 31st exists in March.
    assert cron("0 0 31 2,3 *").next_after(utc(2024, 1, 1)) == utc(2024, 3, 31)
    # The 31st only in months that have one.
    assert take(cron("0 0 31 * *"), utc(2024, 1, 31), 3) == [
        utc(2024, 3, 31),
        utc(2024, 5, 31),
        utc(2024, 7, 31),
    ]


# --------------------------------------------------------------------------- calendar


def test_leap_day() -> None:
    leap = cron("0 0 29 2 *")
    assert take(leap, utc(2024, 3, 1), 2) == [utc(2028, 2, 29), utc(2032, 2, 29)]
    assert leap.first_at_or_after(utc(2024, 2, 29)) == utc(2024, 2, 29)
    # 2100 is not a leap year, 2000 was.
    assert leap.next_after(utc(2097, 1, 1)) == utc(2104, 2, 29)
    assert leap.next_after(utc(1997, 1, 1)) == utc(2000, 2, 29)
    # The last day of February, whatever the year, is a different question.
    assert take(cron("0 12 28-29 2 *"), utc(2023, 1, 1), 3) == [
        utc(2023, 2, 28, 12),
        utc(2024, 2, 28, 12),
        utc(2024, 2, 29, 12),
    ]


def test_rare_schedule_found_decades_ahead() -> None:
    # Day 29 of February *and* a Sunday (a day_of_week starting with '*' means AND).
    rare = Crontab("0", "0", "29", "2", "*/7")
    assert rare.next_after(utc(2004, 3, 1)) == utc(2032, 2, 29)
    assert rare.next_after(utc(2032, 3, 1)) == utc(2060, 2, 29)


def test_nothing_past_the_end_of_time() -> None:
    assert cron("0 0 29 2 *").next_after(utc(9996, 3, 1)) is None
    assert cron("* * * * *").next_after(datetime.max.replace(tzinfo=UTC)) is None
    assert cron("* * * * *").first_at_or_after(utc(9999, 12, 31, 23, 0)) is None
    assert cron("* * * * *").next_after(utc(9999, 12, 29)) == utc(9999, 12, 29, 0, 1)


def test_vixie_or_when_both_day_fields_are_restricted() -> None:
    # The 13th of any month OR any Friday (2024-09-06 is a Friday, 2024-10-13 a Sunday).
    assert take(cron("0 0 13 * fri"), utc(2024, 9, 1), 7) == [
        utc(2024, 9, 6),
        utc(2024, 9, 13),
        utc(2024, 9, 20),
        utc(2024, 9, 27),
        utc(2024, 10, 4),
        utc(2024, 10, 11),
        utc(2024, 10, 13),
    ]
    # Days 1-7 OR any Sunday, not "the first Sunday".
    assert take(cron("0 0 1-7 * sun"), utc(2024, 9, 7, 12), 3) == [
        utc(2024, 9, 8),
        utc(2024, 9, 15),
        utc(2024, 9, 22),
    ]


def test_vixie_and_when_a_day_field_starts_with_a_star() -> None:
    # Odd days AND Fridays: */2 starts with '*', so both must match.
    assert take(cron("0 0 */2 * fri"), utc(2024, 9, 1), 4) == [
        utc(2024, 9, 13),
        utc(2024, 9, 27),
        utc(2024, 10, 11),
        utc(2024, 10, 25),
    ]
    # Days 1-7 AND Sunday: the first Sunday of the month.
    assert take(cron("0 0 1-7 * */7"), utc(2024, 9, 2), 3) == [
        utc(2024, 10, 6),
        utc(2024, 11, 3),
        utc(2024, 12, 1),
    ]
    assert take(cron("0 0 * * fri"), utc(2024, 9, 1), 2) == [utc(2024, 9, 6), utc(2024, 9, 13)]
    assert take(cron("0 0 13 * *"), utc(2024, 9, 1), 2) == [utc(2024, 9, 13), utc(2024, 10, 13)]


@pytest.mark.parametrize(
    ("expression", "zone", "text"),
    [
        ("30 2 * * *", "Europe/Berlin", "at 02:30 (Europe/Berlin)"),
        ("*/15 * * * *", "UTC", "every 15 minutes (UTC)"),
        ("* * * * *", "UTC", "every minute (UTC)"),
        ("5 * * * *", "UTC", "every hour at :05 (UTC)"),
        ("0,20 * * * *", "UTC", "every hour at minute 0,20 (UTC)"),
        ("0 9 * * 1-5", "America/New_York", "at 09:00 on Mon-Fri (America/New_York)"),
        ("0 9,18 * * *", "UTC", "at 09:00, 18:00 (UTC)"),
        ("*/5 9-17 * * *", "UTC", "at minute */5 past hour 9-17 (UTC)"),
        ("0 0 1 jan,jul *", "UTC", "at 00:00 on day 1 of the month in Jan, Jul (UTC)"),
        ("0 0 13 * fri", "UTC", "at 00:00 on day 13 of the month or Fri (UTC)"),
        ("0 0 * * 0,6", "Asia/Kolkata", "at 00:00 on Sun, Sat (Asia/Kolkata)"),
    ],
)
def test_crontab_describe(expression: str, zone: str, text: str) -> None:
    assert cron(expression, zone).describe() == text


def test_schedules_are_values() -> None:
    schedule = cron("*/5 * * * *", "Europe/Berlin")
    with pytest.raises(AttributeError):
        schedule.minute = "1"  # type: ignore[misc]
    assert "Europe/Berlin" in repr(schedule)
    assert "_zone" not in repr(schedule)
    assert {schedule, cron("*/5 * * * *", "Europe/Berlin")} == {schedule}


def test_equal_schedules_share_one_instance_and_bad_ones_are_refused_each_time() -> None:
    fields = {
        "minute": "*/5",
        "hour": "8-18",
        "day_of_month": "*",
        "month_of_year": "*",
        "day_of_week": "1-5",
        "second": "0",
    }
    first = shared_crontab(fields, "Europe/Berlin")
    assert shared_crontab(dict(fields), "Europe/Berlin") is first
    assert first == Crontab(**fields, timezone="Europe/Berlin")
    assert shared_crontab(fields, "UTC") is not first
    assert shared_crontab({**fields, "minute": "*/10"}, "Europe/Berlin") is not first
    for _ in range(2):  # a refusal is not remembered as a schedule
        with pytest.raises(ScheduleError) as refused:
            shared_crontab({**fields, "minute": "61"}, "UTC")
        assert refused.value.field == "minute"
    with pytest.raises(ScheduleError):  # not text: built afresh, refused as before
        shared_crontab({**fields, "minute": 5}, "UTC")
    every, anchor = timedelta(minutes=1), utc(2026, 3, 1, 12)
    interval = shared_interval(every, anchor)
    assert shared_interval(timedelta(seconds=60), utc(2026, 3, 1, 12)) is interval
    assert shared_interval(every, anchor + timedelta(seconds=1)) is not interval
    # In a zone an equal wall time may be another instant (fold), so it is not shared.
    ambiguous = datetime(2026, 10, 25, 2, 30, tzinfo=BERLIN)
    seven = timedelta(minutes=7)  # an hour apart is not a multiple of it
    once, twice = shared_interval(seven, ambiguous), shared_interval(seven, ambiguous)
    assert once is not twice and once == Interval(seven, ambiguous)
    later = shared_interval(seven, ambiguous.replace(fold=1))
    assert later.next_after(ambiguous) != once.next_after(ambiguous)


def test_pure_core_imports_neither_django_nor_redis() -> None:
    import subprocess
    import sys

    code = (
        "import sys, celery_driftsafe.core.schedules, celery_driftsafe.core.misfire; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('django', 'redis', 'celery')); "
        "print(','.join(bad)); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, f"pure modules imported: {result.stdout}{result.stderr}"
