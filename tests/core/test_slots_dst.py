"""DST boundaries, with the expected UTC instants worked out by hand.

The rules (DESIGN.md, "Policies"):

* fixed-time crontabs (hour field not ``*``): a repeated wall time fires once, at its first
  occurrence; a wall time that does not exist fires once, when the gap ends;
* hourly crontabs (hour field ``*``): every UTC instant whose wall time matches fires.

Transitions used (2024):

* Europe/Berlin: 31 Mar 01:00Z, 02:00 CET -> 03:00 CEST; 27 Oct 01:00Z, 03:00 CEST -> 02:00 CET.
* America/New_York: 10 Mar 07:00Z, 02:00 EST -> 03:00 EDT; 3 Nov 06:00Z, 02:00 EDT -> 01:00 EST.
* Australia/Lord_Howe (+10:30 / +11:00): 6 Apr 15:00Z, 02:00 -> 01:30 (local 7 Apr);
  5 Oct 15:30Z, 02:00 -> 02:30 (local 6 Oct).
* Asia/Kolkata: +05:30 all year. UTC: none.
* America/St_Johns (2010, -03:30 / -02:30): transitions at 00:01 local, see below.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from itertools import pairwise
from zoneinfo import ZoneInfo

import pytest

from celery_driftsafe.core.schedules import Crontab


def utc(
    year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0
) -> datetime:
    return datetime(year, month, day, hour, minute, second, tzinfo=UTC)


def between(expression: str, zone: str, start: datetime, end: datetime) -> list[datetime]:
    return list(Crontab.from_expression(expression, zone).slots_between(start, end))


CASES = [
    # ---- Europe/Berlin, fixed time
    pytest.param(
        "30 2 * * *", "Europe/Berlin", utc(2024, 3, 29), utc(2024, 4, 2),
        [utc(2024, 3, 29, 1, 30), utc(2024, 3, 30, 1, 30), utc(2024, 3, 31, 1, 0),
         utc(2024, 4, 1, 0, 30)],
        id="berlin-spring-gap-fires-at-gap-end",
    ),
    pytest.param(
        "0,30 2,3 * * *", "Europe/Berlin", utc(2024, 3, 30, 12), utc(2024, 3, 31, 12),
        [utc(2024, 3, 31, 1, 0), utc(2024, 3, 31, 1, 30)],
        id="berlin-spring-02:00-02:30-03:00-collapse",
    ),
    pytest.param(
        "30 2 * * *", "Europe/Berlin", utc(2024, 10, 26), utc(2024, 10, 29),
        [utc(2024, 10, 26, 0, 30), utc(2024, 10, 27, 0, 30), utc(2024, 10, 28, 1, 30)],
        id="berlin-autumn-repeated-fires-first-only",
    ),
    pytest.param(
        "0 0 * * *", "Europe/Berlin", utc(2024, 3, 29), utc(2024, 4, 2),
        [utc(2024, 3, 29, 23), utc(2024, 3, 30, 23), utc(2024, 3, 31, 22), utc(2024, 4, 1, 22)],
        id="berlin-midnight-across-spring",
    ),
    # ---- Europe/Berlin, hourly
    pytest.param(
        "*/15 * * * *", "Europe/Berlin", utc(2024, 3, 31, 0, 30), utc(2024, 3, 31, 1, 31),
        [utc(2024, 3, 31, 0, 30), utc(2024, 3, 31, 0, 45), utc(2024, 3, 31, 1, 0),
         utc(2024, 3, 31, 1, 15), utc(2024, 3, 31, 1, 30)],
        id="berlin-spring-every-15-real-minutes",
    ),
    pytest.param(
        "*/15 * * * *", "Europe/Berlin", utc(2024, 10, 27, 0, 0), utc(2024, 10, 27, 1, 31),
        [utc(2024, 10, 27, 0, 0), utc(2024, 10, 27, 0, 15), utc(2024, 10, 27, 0, 30),
         utc(2024, 10, 27, 0, 45), utc(2024, 10, 27, 1, 0), utc(2024, 10, 27, 1, 15),
         utc(2024, 10, 27, 1, 30)],
        id="berlin-autumn-every-15-real-minutes",
    ),
    pytest.param(
        "30 * * * *", "Europe/Berlin", utc(2024, 10, 26, 23), utc(2024, 10, 27, 3),
        [utc(2024, 10, 26, 23, 30), utc(2024, 10, 27, 0, 30), utc(2024, 10, 27, 1, 30),
         utc(2024, 10, 27, 2, 30)],
        id="berlin-autumn-hourly-repeats-02:30",
    ),
    pytest.param(
        "30 * * * *", "Europe/Berlin", utc(2024, 3, 31), utc(2024, 3, 31, 3),
        [utc(2024, 3, 31, 0, 30), utc(2024, 3, 31, 1, 30), utc(2024, 3, 31, 2, 30)],
        id="berlin-spring-hourly-skips-02:30",
    ),
    # ---- America/New_York
    pytest.param(
        "30 2 * * *", "America/New_York", utc(2024, 3, 9), utc(2024, 3, 12),
        [utc(2024, 3, 9, 7, 30), utc(2024, 3, 10, 7, 0), utc(2024, 3, 11, 6, 30)],
        id="new-york-spring-gap",
    ),
    pytest.param(
        "0 2,3 * * *", "America/New_York", utc(2024, 3, 10), utc(2024, 3, 11),
        [utc(2024, 3, 10, 7, 0)],
        id="new-york-spring-02:00-and-03:00-are-one-slot",
    ),
    pytest.param(
        "30 1 * * *", "America/New_York", utc(2024, 11, 2), utc(2024, 11, 5),
        [utc(2024, 11, 2, 5, 30), utc(2024, 11, 3, 5, 30), utc(2024, 11, 4, 6, 30)],
        id="new-york-autumn-first-occurrence",
    ),
    pytest.param(
        "*/30 * * * *", "America/New_York", utc(2024, 11, 3, 4, 30), utc(2024, 11, 3, 7, 1),
        [utc(2024, 11, 3, 4, 30), utc(2024, 11, 3, 5, 0), utc(2024, 11, 3, 5, 30),
         utc(2024, 11, 3, 6, 0), utc(2024, 11, 3, 6, 30), utc(2024, 11, 3, 7, 0)],
        id="new-york-autumn-hourly",
    ),
    pytest.param(
        "*/20 * * * *", "America/New_York", utc(2024, 3, 10, 6), utc(2024, 3, 10, 7, 41),
        [utc(2024, 3, 10, 6, 0), utc(2024, 3, 10, 6, 20), utc(2024, 3, 10, 6, 40),
         utc(2024, 3, 10, 7, 0), utc(2024, 3, 10, 7, 20), utc(2024, 3, 10, 7, 40)],
        id="new-york-spring-hourly",
    ),
    # ---- Australia/Lord_Howe: a 30-minute shift
    pytest.param(
        "15 2 * * *", "Australia/Lord_Howe", utc(2024, 10, 4), utc(2024, 10, 7),
        [utc(2024, 10, 4, 15, 45), utc(2024, 10, 5, 15, 30), utc(2024, 10, 6, 15, 15)],
        id="lord-howe-spring-gap",
    ),
    pytest.param(
        "45 1 * * *", "Australia/Lord_Howe", utc(2024, 4, 5), utc(2024, 4, 8),
        [utc(2024, 4, 5, 14, 45), utc(2024, 4, 6, 14, 45), utc(2024, 4, 7, 15, 15)],
        id="lord-howe-autumn-first-occurrence",
    ),
    pytest.param(
        "*/15 * * * *", "Australia/Lord_Howe", utc(2024, 4, 6, 14, 30), utc(2024, 4, 6, 15, 31),
        [utc(2024, 4, 6, 14, 30), utc(2024, 4, 6, 14, 45), utc(2024, 4, 6, 15, 0),
         utc(2024, 4, 6, 15, 15), utc(2024, 4, 6, 15, 30)],
        id="lord-howe-autumn-every-15-real-minutes",
    ),
    pytest.param(
        "0 * * * *", "Australia/Lord_Howe", utc(2024, 10, 5, 13), utc(2024, 10, 5, 17, 1),
        [utc(2024, 10, 5, 13, 30), utc(2024, 10, 5, 14, 30), utc(2024, 10, 5, 16, 0),
         utc(2024, 10, 5, 17, 0)],
        id="lord-howe-spring-hourly-no-02:00",
    ),
    pytest.param(
        "0 * * * *", "Australia/Lord_Howe", utc(2024, 4, 6, 13), utc(2024, 4, 6, 16, 31),
        [utc(2024, 4, 6, 13, 0), utc(2024, 4, 6, 14, 0), utc(2024, 4, 6, 15, 30),
         utc(2024, 4, 6, 16, 30)],
        id="lord-howe-autumn-hourly-repeated-half-hour-has-no-:00",
    ),
    pytest.param(
        "30 * * * *", "Australia/Lord_Howe", utc(2024, 4, 6, 13), utc(2024, 4, 6, 16, 1),
        [utc(2024, 4, 6, 13, 30), utc(2024, 4, 6, 14, 30), utc(2024, 4, 6, 15, 0),
         utc(2024, 4, 6, 16, 0)],
        id="lord-howe-autumn-hourly-01:30-twice",
    ),
    pytest.param(
        "30 1 * * *", "Australia/Lord_Howe", utc(2024, 4, 6), utc(2024, 4, 7),
        [utc(2024, 4, 6, 14, 30)],
        id="lord-howe-autumn-fixed-01:30-once",
    ),
    # ---- Asia/Kolkata: +05:30, no DST
    pytest.param(
        "30 2 * * *", "Asia/Kolkata", utc(2024, 1, 1), utc(2024, 1, 3),
        [utc(2024, 1, 1, 21, 0), utc(2024, 1, 2, 21, 0)],
        id="kolkata-winter",
    ),
    pytest.param(
        "30 2 * * *", "Asia/Kolkata", utc(2024, 7, 1), utc(2024, 7, 2),
        [utc(2024, 7, 1, 21, 0)],
        id="kolkata-summer-same-utc-time",
    ),
    pytest.param(
        "*/45 * * * *", "Asia/Kolkata", utc(2024, 3, 31, 18), utc(2024, 3, 31, 20),
        [utc(2024, 3, 31, 18, 15), utc(2024, 3, 31, 18, 30), utc(2024, 3, 31, 19, 15),
         utc(2024, 3, 31, 19, 30)],  # 23:45, 00:00, 00:45, 01:00 local
        id="kolkata-half-hour-offset-minutes",
    ),
    pytest.param(
        "0 0 1 * *", "Asia/Kolkata", utc(2024, 1, 1), utc(2024, 3, 1),
        [utc(2024, 1, 31, 18, 30), utc(2024, 2, 29, 18, 30)],
        id="kolkata-first-of-month-is-previous-utc-day",
    ),
    # ---- America/St_Johns in 2010: clocks went back at 00:01, so the repeated wall times
    # 23:01-00:00 straddle midnight (7 Nov 02:31Z: 00:01 NDT -> 23:01 NST on 6 Nov), and
    # forward at 00:01 (14 Mar 03:31Z: 00:01 NST -> 01:01 NDT).
    pytest.param(
        "0,30 * * * *", "America/St_Johns", utc(2010, 11, 7, 2), utc(2010, 11, 7, 4, 1),
        [utc(2010, 11, 7, 2, 0), utc(2010, 11, 7, 2, 30), utc(2010, 11, 7, 3, 0),
         utc(2010, 11, 7, 3, 30), utc(2010, 11, 7, 4, 0)],  # 23:30 00:00 23:30 00:00 00:30
        id="st-johns-hourly-repeat-across-midnight",
    ),
    pytest.param(
        "30 23 * * *", "America/St_Johns", utc(2010, 11, 6, 12), utc(2010, 11, 8, 12),
        [utc(2010, 11, 7, 2, 0), utc(2010, 11, 8, 3, 0)],
        id="st-johns-fixed-23:30-first-occurrence",
    ),
    pytest.param(
        "0 0 * * *", "America/St_Johns", utc(2010, 11, 7), utc(2010, 11, 8, 12),
        [utc(2010, 11, 7, 2, 30), utc(2010, 11, 8, 3, 30)],
        id="st-johns-fixed-midnight-before-the-repeat",
    ),
    pytest.param(
        "30 0 * * *", "America/St_Johns", utc(2010, 3, 13), utc(2010, 3, 15, 12),
        [utc(2010, 3, 13, 4, 0), utc(2010, 3, 14, 3, 31), utc(2010, 3, 15, 3, 0)],
        id="st-johns-spring-gap-ends-at-01:01",
    ),
    pytest.param(
        "30 * * * *", "America/St_Johns", utc(2010, 3, 14, 3), utc(2010, 3, 14, 5),
        [utc(2010, 3, 14, 3, 0), utc(2010, 3, 14, 4, 0)],  # 23:30 NST, 01:30 NDT; no 00:30
        id="st-johns-spring-hourly",
    ),
    # ---- UTC
    pytest.param(
        "30 2 * * *", "UTC", utc(2024, 3, 30), utc(2024, 4, 1),
        [utc(2024, 3, 30, 2, 30), utc(2024, 3, 31, 2, 30)],
        id="utc-unaffected",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("expression", "zone", "start", "end", "expected"), CASES)
def test_dst_boundaries(
    expression: str, zone: str, start: datetime, end: datetime, expected: list[datetime]
) -> None:
    assert between(expression, zone, start, end) == expected


@pytest.mark.parametrize(("expression", "zone", "start", "end", "expected"), CASES)
def test_dst_boundaries_one_step_at_a_time(
    expression: str, zone: str, start: datetime, end: datetime, expected: list[datetime]
) -> None:
    schedule = Crontab.from_expression(expression, zone)
    for slot in expected:
        assert schedule.first_at_or_after(slot) == slot
        assert schedule.next_after(slot - timedelta(microseconds=1)) == slot
        assert schedule.first_at_or_after(slot - timedelta(seconds=30)) == slot
    for previous, slot in pairwise(expected):
        assert schedule.next_after(previous) == slot


def test_gap_end_boundaries_berlin() -> None:
    schedule = Crontab.from_expression("30 2 * * *", "Europe/Berlin")
    gap_end = utc(2024, 3, 31, 1, 0)
    assert schedule.first_at_or_after(gap_end) == gap_end
    assert schedule.first_at_or_after(gap_end - timedelta(microseconds=1)) == gap_end
    assert schedule.next_after(gap_end) == utc(2024, 4, 1, 0, 30)
    # From inside the repeated hour: the second 02:30 is not a slot.
    assert schedule.first_at_or_after(utc(2024, 10, 27, 1, 15)) == utc(2024, 10, 28, 1, 30)


def test_the_zone_of_the_argument_does_not_matter() -> None:
    schedule = Crontab.from_expression("30 2 * * *", "Europe/Berlin")
    instant = utc(2024, 3, 30, 12)
    expected = schedule.next_after(instant)
    for zone in ("America/New_York", "Australia/Lord_Howe", "Asia/Kolkata", "Europe/Berlin"):
        assert schedule.next_after(instant.astimezone(ZoneInfo(zone))) == expected
    assert expected is not None and expected.tzinfo is UTC


def test_whole_day_skipped_by_samoa() -> None:
    # Pacific/Apia skipped 30 December 2011: 29 Dec 23:59:59 -10:00 was followed by
    # 31 Dec 00:00 +14:00, i.e. 2011-12-30T10:00Z.
    fixed = Crontab.from_expression("0 12 * * *", "Pacific/Apia")
    assert list(fixed.slots_between(utc(2011, 12, 29), utc(2011, 12, 31, 12))) == [
        utc(2011, 12, 29, 22, 0),  # 29 Dec 12:00 -10:00
        utc(2011, 12, 30, 10, 0),  # 30 Dec 12:00 never happened: fires at the gap end
        utc(2011, 12, 30, 22, 0),  # 31 Dec 12:00 +14:00
    ]
    hourly = Crontab.from_expression("0 * 30 12 *", "Pacific/Apia")
    assert list(hourly.slots_between(utc(2011, 12, 29), utc(2012, 1, 2))) == []
