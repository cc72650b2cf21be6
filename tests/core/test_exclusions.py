"""Excluded dates and wall times (``core/exclusions.py``) against a brute-force reference: the
inner schedule's slots, each read in the zone and dropped when its date is listed or its wall
time matches an exclusion crontab (matched here from the value sets the generated expression
means, not by the parser under test). Windows sit mostly around DST transitions."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from zoneinfo import ZoneInfo

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from celery_driftsafe.core.bounds import Bounded, Limits
from celery_driftsafe.core.exclusions import (
    MAX_CONSECUTIVE_EXCLUSIONS,
    Excluding,
    excluding,
    is_excluding,
    parse_crontab,
    parse_dates,
)
from celery_driftsafe.core.misfire import plan_claim
from celery_driftsafe.core.preview import upcoming_slots
from celery_driftsafe.core.schedules import Crontab, Interval, Schedule
from tests.support.slot_reference import BRUTE_FORCE_ZONES, MICROSECOND, Spec, instants, specs

S = timedelta(seconds=1)
T0 = datetime(2026, 3, 2, 12, 0, tzinfo=UTC)  # a Monday


def reference(
    inner: Schedule,
    zone: str,
    dates: frozenset[date],
    rules: list[tuple[Spec, frozenset[int] | None]],
    start: datetime,
    end: datetime,
) -> list[datetime]:
    """The inner slots in ``[start, end)`` that are not excluded; a rule's seconds None: it
    matches whole minutes."""
    tz = ZoneInfo(zone)
    kept = []
    for slot in inner.slots_between(start, end):
        wall = slot.astimezone(tz)
        if wall.date() in dates:
            continue
        if any(
            spec.matches(wall) and (seconds is None or wall.second in seconds)
            for spec, seconds in rules
        ):
            continue
        kept.append(slot)
    return kept


second_sets = st.one_of(
    st.none(),
    st.integers(2, 7).map(lambda n: (f"*/{n}", frozenset(range(0, 60, n)))),
    st.integers(1, 59).map(lambda n: (f"{n}-59", frozenset(range(n, 60)))),
)


@st.composite
def inner_schedules(draw: st.DrawFn, zone: str, start: datetime) -> Schedule:
    if draw(st.booleans()):
        every = draw(st.integers(1, 3 * 3600)) * S + draw(st.integers(0, 999_999)) * MICROSECOND
        every = max(every, 30 * S)
        return Interval(every, start - draw(st.integers(0, 10**9)) * MICROSECOND)
    spec = draw(specs())
    return spec.crontab(zone)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), st.sampled_from(BRUTE_FORCE_ZONES))
def test_excluding_matches_the_brute_force_reference(data: st.DataObject, zone: str) -> None:
    start = data.draw(instants(zone, near_transition=80))
    end = start + timedelta(hours=data.draw(st.integers(1, 30)))
    inner = data.draw(inner_schedules(zone, start))
    local_days = sorted({(start + timedelta(hours=h)).astimezone(ZoneInfo(zone)).date()
                         for h in range(-24, 76)})  # fmt: skip
    dates = frozenset(data.draw(st.lists(st.sampled_from(local_days), max_size=3)))
    rules: list[tuple[Spec, frozenset[int] | None]] = []
    crontabs = []
    for _ in range(data.draw(st.integers(0, 2))):
        spec = data.draw(specs())
        seconds = data.draw(second_sets)
        if seconds is None:
            crontabs.append(spec.crontab("UTC"))  # its own zone is not the one read in
            rules.append((spec, None))
        else:
            crontabs.append(Crontab(*spec.texts, timezone="UTC", second=seconds[0]))
            rules.append((spec, seconds[1]))
    schedule = Excluding(inner, dates, zone, tuple(crontabs))
    expected = reference(inner, zone, dates, rules, start, end)
    everything = reference(inner, zone, dates, rules, start, end + timedelta(days=1))
    event("some slots excluded" if len(expected) < sum(1 for _ in inner.slots_between(start, end))
          else "nothing excluded in the window")  # fmt: skip

    assert list(schedule.slots_between(start, end)) == expected
    assert schedule.count_between(start, end) == len(expected)
    # first_at_or_after and next_after at a probe, and at each kept slot
    probe = start + (end - start) * data.draw(st.floats(0, 1))
    later = [s for s in everything if s >= probe]
    if later:
        assert schedule.first_at_or_after(probe) == later[0]
    following = [s for s in everything if s > probe]
    if following:
        assert schedule.next_after(probe) == following[0]
    for slot in expected[:20]:
        assert schedule.first_at_or_after(slot) == slot
        assert schedule.next_after(slot - MICROSECOND) == slot
    # counted from any instant inside the window
    middle = data.draw(st.sampled_from([start, probe, end]))
    assert schedule.count_between(middle, end) == len([s for s in expected if s >= middle])


@settings(max_examples=100, deadline=None)
@given(
    every=st.integers(1, 120),
    lag_hours=st.integers(1, 24 * 40),
    policy=st.sampled_from(["fire_once", "fire_all", "skip"]),
    data=st.data(),
)
def test_a_catch_up_over_excluded_dates_fires_and_records_only_slots_that_are_not_excluded(
    every: int, lag_hours: int, policy: str, data: st.DataObject
) -> None:
    """The misfire planner counts through the wrapper: an excluded slot is neither fired nor
    counted missed, whether the planner walks or counts."""
    zone = "Europe/Berlin"
    dates = frozenset(
        data.draw(st.lists(st.dates(date(2026, 3, 1), date(2026, 4, 15)), max_size=10))
    )
    weekend = Crontab.from_expression("* * * * sat,sun")
    inner = Interval(every * 60 * S, T0)
    schedule = Excluding(inner, dates, zone, (weekend,) if data.draw(st.booleans()) else ())
    now = T0 + timedelta(hours=lag_hours)
    kept = list(schedule.slots_between(T0, now + MICROSECOND))
    start = schedule.first_at_or_after(T0)
    assert start is not None
    for arithmetic in (True, False):
        plan = plan_claim(
            schedule, start, now, policy=policy, fire_all_max=5, arithmetic=arithmetic
        )
        accounted = plan.fire + plan.missed
        assert all(not schedule.excludes(s) for s in accounted)
        assert len(plan.fire) + plan.missed_count == len([s for s in kept if s >= start])
        assert plan.next_slot is not None and not schedule.excludes(plan.next_slot)
        assert plan.next_slot == schedule.next_after(now)


def test_every_weekday_at_seven_except_public_holidays_across_dst() -> None:
    zone = "Europe/Berlin"
    inner = Crontab.from_expression("0 7 * * mon-fri", zone)
    holidays = frozenset({date(2026, 3, 27), date(2026, 3, 30)})  # a Friday, a Monday
    schedule = excluding(inner, holidays, zone)
    slots = list(
        schedule.slots_between(datetime(2026, 3, 26, tzinfo=UTC), datetime(2026, 4, 2, tzinfo=UTC))
    )
    local = [s.astimezone(ZoneInfo(zone)) for s in slots]
    assert [(w.date().isoformat(), w.hour) for w in local] == [
        ("2026-03-26", 7),  # Thursday, +01:00
        ("2026-03-31", 7),  # Tuesday, after the change to +02:00
        ("2026-04-01", 7),
    ]
    assert [s.hour for s in slots] == [6, 5, 5]
    assert (
        schedule.describe() == "at 07:00 on Mon-Fri (Europe/Berlin), except 2 dates (Europe/Berlin)"
    )


def test_a_repeated_hour_is_excluded_in_both_of_its_occurrences() -> None:
    zone = "Europe/Berlin"
    inner = Interval(15 * 60 * S, datetime(2026, 10, 24, tzinfo=UTC))
    schedule = excluding(inner, (), zone, [Crontab.from_expression("* 2 * * *")])
    start, end = datetime(2026, 10, 24, 23, tzinfo=UTC), datetime(2026, 10, 25, 3, tzinfo=UTC)
    # 02:00-03:00 local happens twice: 00:00-01:00 and 01:00-02:00 UTC
    assert [s.strftime("%H:%M") for s in schedule.slots_between(start, end)] == [
        "23:00", "23:15", "23:30", "23:45", "02:00", "02:15", "02:30", "02:45"
    ]  # fmt: skip
    assert schedule.count_between(start, end) == 8


def test_excluding_every_slot_ends_the_schedule_instead_of_spinning() -> None:
    everything = Excluding(
        Interval(S, T0), frozenset(), "UTC", (Crontab.from_expression("* * * * *"),)
    )
    assert everything.next_after(T0) is None
    assert everything.first_at_or_after(T0) is None
    assert list(everything.slots_between(T0, T0 + 10 * S)) == []
    # every other second excluded, slots every two seconds on the excluded ones
    aligned = Excluding(
        Interval(2 * S, T0), frozenset(), "UTC", (Crontab.from_expression("*/2 * * * * *"),)
    )
    assert aligned.next_after(T0) is None
    assert MAX_CONSECUTIVE_EXCLUSIONS >= 43_200  # a day of per-second stretches still passes
    # a year of excluded dates in a row is one stretch a day
    year = frozenset(date(2026, 1, 1) + timedelta(days=n) for n in range(365))
    slot = Excluding(Interval(S, T0), year, "UTC").next_after(T0)
    assert slot == datetime(2027, 1, 1, tzinfo=UTC)


def test_per_second_exclusion() -> None:
    schedule = excluding(Interval(S, T0), (), "UTC", [Crontab.from_expression("*/3 * * * * *")])
    assert [s.second for s in schedule.slots_between(T0, T0 + 10 * S)] == [1, 2, 4, 5, 7, 8]
    assert schedule.count_between(T0, T0 + 86_400 * S) == 57_600


def test_without_exclusions_the_schedule_is_itself_and_bounds_see_through() -> None:
    inner = Interval(S, T0)
    assert excluding(inner) is inner
    assert not is_excluding(inner)
    wrapped = excluding(inner, [date(2026, 3, 3)])
    assert is_excluding(wrapped) and is_excluding(Bounded(wrapped, T0, None))


def test_stored_dates_and_crontabs_are_read_with_errors_naming_the_field() -> None:
    assert parse_dates(["2026-12-25", date(2026, 12, 26)], "excluded_dates") == (
        [date(2026, 12, 25), date(2026, 12, 26)],
        [],
    )
    _, problems = parse_dates(["2026-12-25", "25.12.2026", 7], "excluded_dates")
    assert [p.field for p in problems] == ["excluded_dates"]
    assert "'25.12.2026', 7 are no dates" in problems[0].message
    _, problems = parse_dates("2026-12-25", "dates")
    assert problems[0].field == "dates" and "must be a list" in problems[0].message
    assert parse_crontab("", "UTC", "crontab") == (None, [])
    crontab, problems = parse_crontab("* * * * sun,sat", "Europe/Berlin", "crontab")
    assert crontab is not None and not problems
    _, problems = parse_crontab("* * *", "UTC", "crontab")
    assert problems[0].field == "crontab" and "needs 5 fields" in problems[0].message


def test_the_preview_skips_excluded_slots() -> None:
    schedule = excluding(Interval(86_400 * S, T0), [date(2026, 3, 3), date(2026, 3, 5)])
    start = schedule.first_at_or_after(T0)
    preview = upcoming_slots(schedule, start, Limits("t"), count=3)
    assert [row.slot.day for row in preview.rows] == [2, 4, 6]
    assert preview.excluded == 2 and preview.end is None
    everything = excluding(Interval(S, T0), (), "UTC", [Crontab.from_expression("* * * * *")])
    preview = upcoming_slots(everything, T0, Limits("t"), count=3)
    assert preview.rows == [] and preview.end is not None
    assert preview.end.startswith("excluded dates: every slot left is excluded")
