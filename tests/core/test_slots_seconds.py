"""Crontabs with a seconds field (six fields, seconds first, as Quartz and Hangfire write them):
hand-written DST cases, croniter (``second_at_beginning=True``) away from transitions, and a
per-second brute-force reference of the DESIGN.md rules around transitions."""

from __future__ import annotations

import warnings
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from croniter import croniter
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from celery_driftsafe.core.schedules import Crontab
from celery_driftsafe.exceptions import ScheduleError
from tests.support.slot_reference import (
    DST_YEARS,
    ZONES,
    Spec,
    instants,
    offset_constant,
    reference_slots,
    specs,
    transitions,
)

BERLIN = "Europe/Berlin"
SECOND = timedelta(seconds=1)


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)  # type: ignore[misc]


# --------------------------------------------------------------------------- by hand


def test_six_fields_put_the_seconds_first() -> None:
    every_15 = Crontab.from_expression("*/15 * * * * *")
    assert list(every_15.slots_between(utc(2024, 1, 1, 0, 0, 50), utc(2024, 1, 1, 0, 1, 20))) == [
        utc(2024, 1, 1, 0, 1, 0),
        utc(2024, 1, 1, 0, 1, 15),
    ]
    assert every_15.second == "*/15" and every_15.expression == "*/15 * * * * *"
    assert every_15.describe() == "every 15 seconds (UTC)"
    five = Crontab.from_expression("0 9 * * *")
    assert five.second == "0" and five.expression == "0 9 * * *"
    assert five == Crontab.from_expression("0 0 9 * * *")
    nine = Crontab.from_expression("30 0 9 * * mon-fri", BERLIN)
    assert nine.describe() == "at 09:00:30 on Mon-Fri (Europe/Berlin)"
    assert nine.next_after(utc(2024, 1, 1, 8, 0, 30)) == utc(2024, 1, 2, 8, 0, 30)


@pytest.mark.parametrize(
    ("alias", "five"),
    [
        ("@yearly", "0 0 1 1 *"),
        ("@annually", "0 0 1 1 *"),
        ("@monthly", "0 0 1 * *"),
        ("@weekly", "0 0 * * 0"),
        ("@daily", "0 0 * * *"),
        ("@midnight", "0 0 * * *"),
        ("@hourly", "0 * * * *"),
        (" @Daily ", "0 0 * * *"),
    ],
)
def test_aliases(alias: str, five: str) -> None:
    assert Crontab.from_expression(alias, BERLIN) == Crontab.from_expression(five, BERLIN)


def test_every_ten_seconds_runs_on_through_both_transitions() -> None:
    every_10 = Crontab.from_expression("*/10 * * * * *", BERLIN)
    # spring forward: 02:00 CET -> 03:00 CEST at 01:00 UTC; slots stay 10 real seconds apart
    spring = list(every_10.slots_between(utc(2024, 3, 31, 0, 59, 40), utc(2024, 3, 31, 1, 0, 30)))
    assert spring == [utc(2024, 3, 31, 0, 59, 40) + k * 10 * SECOND for k in range(5)]
    # fall back: the repeated hour fires again
    autumn = list(every_10.slots_between(utc(2024, 10, 27, 0, 0), utc(2024, 10, 27, 2, 0)))
    assert len(autumn) == 720


def test_fixed_time_with_seconds_follows_the_dst_rules() -> None:
    at = Crontab.from_expression("15 30 2 * * *", BERLIN)
    # 02:30:15 does not exist on 2024-03-31: once, at the end of the gap (03:00 CEST)
    assert at.next_after(utc(2024, 3, 30, 12)) == utc(2024, 3, 31, 1, 0, 0)
    # 02:30:15 happens twice on 2024-10-27: once, at the first (CEST, 00:30:15 UTC)
    assert list(at.slots_between(utc(2024, 10, 26, 12), utc(2024, 10, 27, 12))) == [
        utc(2024, 10, 27, 0, 30, 15)
    ]


@pytest.mark.parametrize(
    ("expression", "field", "message"),
    [
        ("60 * * * * *", "second", "60 is out of range 0-59"),
        ("*/0 * * * * *", "second", "step 0 is not allowed"),
        ("x * * * * *", "second", "'x' is not a number"),
        ("0 0 * * * * *", "expression", "or 6 with the seconds first, got 7"),
        ("* * * *", "expression", "got 4"),
    ],
)
def test_bad_seconds_name_their_field(expression: str, field: str, message: str) -> None:
    with pytest.raises(ScheduleError) as caught:
        Crontab.from_expression(expression)
    assert caught.value.field == field and message in str(caught.value)


# --------------------------------------------------------------------------- properties


@st.composite
def second_fields(draw: st.DrawFn) -> tuple[str, frozenset[int]]:
    """A seconds field and the values it means (computed here, not by the parser)."""
    items: list[str] = []
    values: set[int] = set()
    for _ in range(draw(st.integers(1, 2))):
        kind = draw(st.sampled_from(["*", "*/n", "a", "a-b", "a-b/n", "a/n"]))
        step = draw(st.integers(1, 30))
        first = draw(st.integers(0, 58))
        last = draw(st.integers(first + 1, 59))  # croniter reads '5-5' as '*'
        text, allowed = {
            "*": ("*", range(60)),
            "*/n": (f"*/{step}", range(0, 60, step)),
            "a": (str(first), range(first, first + 1)),
            "a-b": (f"{first}-{last}", range(first, last + 1)),
            "a-b/n": (f"{first}-{last}/{step}", range(first, last + 1, step)),
            "a/n": (f"{first}/{step}", range(first, 60, step)),
        }[kind]
        items.append(text)
        values.update(allowed)
    return ",".join(items), frozenset(values)


def croniter_next(expression: str, zone: str, instant: datetime, day_or: bool) -> datetime:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"croniter\b.*")
        iterator = croniter(
            expression, instant.astimezone(ZoneInfo(zone)), day_or=day_or, second_at_beginning=True
        )
        result = iterator.get_next(datetime)
    assert isinstance(result, datetime)
    return result.astimezone(UTC)


@settings(max_examples=250, deadline=None)
@given(st.data(), second_fields(), specs(for_croniter=True), st.sampled_from(ZONES))
def test_agrees_with_croniter_away_from_transitions(
    data: st.DataObject, seconds: tuple[str, frozenset[int]], spec: Spec, zone: str
) -> None:
    assume(spec.texts[2] == "*" or len(spec.days) < 31)  # see test_slots_properties
    assume(spec.texts[4] == "*" or len(spec.weekdays) < 7)
    expression = f"{seconds[0]} {spec.expression}"
    instant = data.draw(instants(zone, near_transition=0))
    ours = Crontab.from_expression(expression, zone).next_after(instant)
    theirs = croniter_next(expression, zone, instant, spec.day_or)
    assert ours is not None
    latest = max(ours, theirs)
    assume(latest - instant < timedelta(days=800))
    assume(offset_constant(zone, instant - timedelta(days=1), latest + timedelta(days=1)))
    assert ours == theirs


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), second_fields(), specs(), st.sampled_from(sorted(DST_YEARS)))
def test_matches_per_second_reference_around_transitions(
    data: st.DataObject, seconds: tuple[str, frozenset[int]], spec: Spec, zone: str
) -> None:
    centre = data.draw(st.sampled_from(transitions(zone))).replace(microsecond=0)
    start = centre - timedelta(seconds=data.draw(st.integers(0, 2 * 3600)))
    end = start + timedelta(hours=3)
    expected = reference_slots(
        spec,
        zone,
        start,
        end,
        step=SECOND,
        matches=lambda wall: wall.second in seconds[1] and spec.matches(wall),
    )
    schedule = Crontab.from_expression(f"{seconds[0]} {spec.expression}", zone)
    assert list(schedule.slots_between(start, end)) == expected
