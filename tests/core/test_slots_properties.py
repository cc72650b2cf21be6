"""Property-based tests of slot arithmetic against independent references.

* A brute-force reference, written here from the DESIGN.md rules: enumerate every UTC minute
  of a window, read its wall time with zoneinfo, decide whether it fires. Windows are mostly
  placed around DST transitions, in zones with 1-hour, 30-minute and no shifts.
* croniter, away from DST transitions (its DST handling is not ours).
* Internal consistency of ``first_at_or_after``, ``next_after`` and ``slots_between``.
* Interval slots do not depend on where a search starts or which anchor represents them.

Expressions are generated together with the value sets they mean (computed here, not by the
parser under test), so the reference is independent of the implementation.
"""

from __future__ import annotations

import warnings
from datetime import UTC, datetime, timedelta
from itertools import pairwise
from zoneinfo import ZoneInfo

from croniter import croniter
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from celery_driftsafe.core.schedules import Interval
from tests.support.slot_reference import (
    BRUTE_FORCE_ZONES,
    MICROSECOND,
    QUICK,
    ZONES,
    Spec,
    instants,
    offset_constant,
    reference_slots,
    specs,
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), specs(), st.sampled_from(BRUTE_FORCE_ZONES))
def test_matches_brute_force_reference(data: st.DataObject, spec: Spec, zone: str) -> None:
    start = data.draw(instants(zone, near_transition=90))
    end = start + timedelta(hours=30)
    expected = reference_slots(spec, zone, start, end)
    event("no slot in window" if not expected else "slots in window")
    if not offset_constant(zone, start, end):
        event("window has an offset change")
    assert list(spec.crontab(zone).slots_between(start, end)) == expected


def croniter_next(spec: Spec, zone: str, instant: datetime) -> datetime:
    with warnings.catch_warnings():
        # croniter has deprecated parts of its API over time; nothing of ours is under test here.
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"croniter\b.*")
        iterator = croniter(spec.expression, instant.astimezone(ZoneInfo(zone)), day_or=spec.day_or)
        result = iterator.get_next(datetime)
    assert isinstance(result, datetime)
    return result.astimezone(UTC)


@settings(max_examples=250, deadline=None)
@given(st.data(), specs(for_croniter=True), st.sampled_from(ZONES))
def test_agrees_with_croniter_away_from_transitions(
    data: st.DataObject, spec: Spec, zone: str
) -> None:
    # croniter turns a day field that allows every value ('1-31', '1,*') into '*' before it
    # applies the OR rule; Vixie cron (and we) look at the text. Not a case worth comparing.
    assume(spec.texts[2] == "*" or len(spec.days) < 31)
    assume(spec.texts[4] == "*" or len(spec.weekdays) < 7)
    instant = data.draw(instants(zone, near_transition=0))
    ours = spec.crontab(zone).next_after(instant)
    theirs = croniter_next(spec, zone, instant)
    assert ours is not None
    latest = max(ours, theirs)
    assume(latest - instant < timedelta(days=800))
    assume(offset_constant(zone, instant - timedelta(days=1), latest + timedelta(days=1)))
    assert ours == theirs


@QUICK
@given(st.data(), specs(), st.sampled_from(BRUTE_FORCE_ZONES))
def test_next_after_is_consistent(data: st.DataObject, spec: Spec, zone: str) -> None:
    start = data.draw(instants(zone))
    schedule = spec.crontab(zone)
    slots: list[datetime] = []
    current = start
    for _ in range(25):
        following = schedule.next_after(current)
        assert following is not None
        assert following > current
        assert following.tzinfo is UTC
        assert (following.second, following.microsecond) == (0, 0)  # whole-minute offsets
        assert schedule.first_at_or_after(following) == following
        assert schedule.first_at_or_after(current + MICROSECOND) == following
        assert schedule.next_after(following - MICROSECOND) == following
        slots.append(following)
        current = following
    assert list(schedule.slots_between(start + MICROSECOND, slots[-1] + MICROSECOND)) == slots
    assert schedule.first_at_or_after(start + MICROSECOND) == slots[0]


@QUICK
@given(
    every=st.integers(1, 10 * 86_400_000_000).map(lambda us: timedelta(microseconds=us)),
    anchor=st.datetimes(
        datetime(1990, 1, 1), datetime(2050, 1, 1), timezones=st.sampled_from(ZONES).map(ZoneInfo)
    ),
    first=st.datetimes(datetime(2000, 1, 1), datetime(2040, 1, 1), timezones=st.just(UTC)),
    second=st.datetimes(datetime(2000, 1, 1), datetime(2040, 1, 1), timezones=st.just(UTC)),
    shift=st.integers(-1000, 1000),
)
def test_interval_slots_do_not_depend_on_the_starting_instant(
    every: timedelta, anchor: datetime, first: datetime, second: datetime, shift: int
) -> None:
    interval = Interval(every, anchor)
    for instant in (first, second):
        slot = interval.first_at_or_after(instant)
        assert slot is not None and slot.tzinfo is UTC
        assert (slot - anchor) % every == timedelta(0)
        assert slot - every < instant <= slot
        assert interval.next_after(slot - MICROSECOND) == slot
        assert interval.next_after(slot) == slot + every
    # The same set of slots, whichever of its members is called the anchor.
    # (Shift in UTC: adding a timedelta to a datetime in a DST zone is wall-clock arithmetic.)
    same = Interval(every, anchor.astimezone(UTC) + shift * every)
    assert same.first_at_or_after(first) == interval.first_at_or_after(first)
    low, high = sorted((first, second))
    listed = list(interval.slots_between(low, min(high, low + 50 * every)))
    assert all(later - earlier == every for earlier, later in pairwise(listed))
    if listed:
        assert listed[0] == interval.first_at_or_after(low)
