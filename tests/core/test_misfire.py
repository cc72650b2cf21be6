"""Misfire policies as pure functions: counts after a simulated outage."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_driftsafe.core.misfire import MissedSpan, plan_claim
from celery_driftsafe.core.schedules import Crontab, Interval, OneOff, Solar
from celery_driftsafe.core.stored_names import MisfirePolicy
from tests.support.misfire import count_walks

T0 = datetime(2026, 3, 1, tzinfo=UTC)
EVERY_SECOND = Interval(timedelta(seconds=1), T0)
DAY = timedelta(days=1)
GRACE = timedelta(seconds=60)


def test_nothing_due_keeps_next_slot() -> None:
    plan = plan_claim(EVERY_SECOND, T0 + timedelta(seconds=5), T0 + timedelta(seconds=4))
    assert plan.fire == [] and plan.missed == [] and plan.next_slot == T0 + timedelta(seconds=5)


def test_slot_exactly_at_now_is_due() -> None:
    plan = plan_claim(EVERY_SECOND, T0, T0)
    assert plan.fire == [T0]
    assert plan.next_slot == T0 + timedelta(seconds=1)


def test_late_slots_within_grace_all_fire() -> None:
    now = T0 + timedelta(seconds=2.5)
    plan = plan_claim(EVERY_SECOND, T0, now, policy="skip")
    assert plan.fire == [T0, T0 + timedelta(seconds=1), T0 + timedelta(seconds=2)]
    assert plan.missed == []
    assert plan.next_slot == T0 + timedelta(seconds=3)


@pytest.mark.parametrize("policy", ["fire_once", "fire_all", "skip"])
def test_one_day_outage_of_one_second_task_is_one_span(policy: str) -> None:
    """After a day down, on-time slots (the last 60 s) fire under every policy; the policy
    decides the 86,340 older ones, and the ones that do not fire are one span row."""
    now = T0 + DAY
    plan = plan_claim(EVERY_SECOND, T0, now, policy=policy, grace=GRACE, fire_all_max=100)
    on_time = [now - timedelta(seconds=s) for s in range(60, -1, -1)]
    missed_total = 86_400 - 60  # slots in [T0, now - 60 s)
    assert plan.fire[-61:] == on_time
    assert plan.next_slot == now + timedelta(seconds=1)
    fired_missed = 100 if policy == "fire_all" else 0  # fire_once: on-time slots fire anyway
    assert len(plan.fire) == 61 + fired_missed
    if policy == "fire_all":
        assert plan.fire[:100] == [now - GRACE - timedelta(seconds=s) for s in range(100, 0, -1)]
    assert plan.missed == []
    span = plan.missed_span
    assert span is not None
    assert span.first == T0 and span.last == plan.fire[0] - timedelta(seconds=1)  # no gap
    # every slot in the outage is accounted for exactly once
    assert span.count == missed_total - fired_missed == plan.missed_count


def test_a_few_missed_slots_get_a_row_each() -> None:
    hourly = Interval(timedelta(hours=1), T0)
    now = T0 + timedelta(hours=3, minutes=30)
    plan = plan_claim(hourly, T0, now, policy="fire_once", grace=GRACE, record_max=3)
    assert plan.fire == [T0 + timedelta(hours=3)]
    assert plan.missed == [T0 + timedelta(hours=h) for h in range(3)]
    assert plan.missed_span is None


def test_fire_once_fires_latest_missed_when_nothing_is_on_time() -> None:
    hourly = Interval(timedelta(hours=1), T0)
    now = T0 + timedelta(hours=5, minutes=30)
    plan = plan_claim(hourly, T0, now, policy="fire_once", grace=GRACE, record_max=10)
    assert plan.fire == [T0 + timedelta(hours=5)]
    assert plan.missed == [T0 + timedelta(hours=h) for h in range(5)]
    assert plan.missed_span is None
    assert plan.next_slot == T0 + timedelta(hours=6)
    spanned = plan_claim(hourly, T0, now, policy="fire_once", grace=GRACE, record_max=3)
    assert spanned.fire == plan.fire and spanned.missed == []
    assert spanned.missed_span == MissedSpan(T0, T0 + timedelta(hours=4), 5)


def test_skip_fires_nothing_missed() -> None:
    hourly = Interval(timedelta(hours=1), T0)
    now = T0 + timedelta(hours=5, minutes=30)
    plan = plan_claim(hourly, T0, now, policy="skip", grace=GRACE, record_max=10)
    assert plan.fire == []
    assert len(plan.missed) == 6
    assert plan.next_slot == T0 + timedelta(hours=6)
    spanned = plan_claim(hourly, T0, now, policy="skip", grace=GRACE)
    assert spanned.missed_span == MissedSpan(T0, T0 + timedelta(hours=5), 6)


def test_fire_all_is_bounded() -> None:
    hourly = Interval(timedelta(hours=1), T0)
    now = T0 + timedelta(hours=5, minutes=30)
    plan = plan_claim(
        hourly, T0, now, policy="fire_all", grace=GRACE, fire_all_max=2, record_max=10
    )
    assert plan.fire == [T0 + timedelta(hours=4), T0 + timedelta(hours=5)]
    assert plan.missed == [T0 + timedelta(hours=h) for h in range(4)]
    spanned = plan_claim(hourly, T0, now, policy="fire_all", grace=GRACE, fire_all_max=2)
    assert spanned.fire == plan.fire
    assert spanned.missed_span == MissedSpan(T0, T0 + timedelta(hours=3), 4)


def test_crontab_outage_is_counted_into_one_span() -> None:
    every_minute = Crontab.from_expression("* * * * *", "Europe/Berlin")
    now = T0 + timedelta(hours=3)
    plan = plan_claim(every_minute, T0, now, policy="fire_once", grace=GRACE)
    assert plan.fire == [now - timedelta(minutes=1), now]
    assert plan.missed == []
    assert plan.missed_span == MissedSpan(T0, now - timedelta(minutes=2), 179)


@pytest.mark.parametrize("policy", ["fire_once", "fire_all", "skip"])
def test_a_slot_late_from_load_fires_under_every_policy(policy: str) -> None:
    """The beats have been claiming without a break since before the slot fell due: its only
    due slot is late because of a backlog, not missed, however far past the grace."""
    minutely = Interval(timedelta(minutes=1), T0)
    now = T0 + timedelta(seconds=59)
    plan = plan_claim(
        minutely,
        T0,
        now,
        policy=policy,
        grace=timedelta(seconds=10),
        busy_since=T0 - timedelta(seconds=1),
    )
    assert plan.fire == [T0] and plan.late_from_load
    assert plan.missed == [] and plan.missed_span is None
    assert plan.next_slot == T0 + timedelta(minutes=1)


def test_a_task_a_whole_period_behind_gets_its_policy_even_when_busy() -> None:
    minutely = Interval(timedelta(minutes=1), T0)
    now = T0 + timedelta(seconds=61)
    plan = plan_claim(
        minutely,
        T0,
        now,
        policy="skip",
        grace=timedelta(seconds=10),
        busy_since=T0 - timedelta(seconds=1),
    )
    assert not plan.late_from_load
    assert plan.fire == [T0 + timedelta(minutes=1)] and plan.missed == [T0]


def test_a_slot_that_fell_due_before_the_beats_were_busy_is_missed() -> None:
    minutely = Interval(timedelta(minutes=1), T0)
    now = T0 + timedelta(seconds=59)
    plan = plan_claim(
        minutely,
        T0,
        now,
        policy="skip",
        grace=timedelta(seconds=10),
        busy_since=T0 + timedelta(seconds=30),
    )
    assert not plan.late_from_load and plan.fire == [] and plan.missed == [T0]


def test_after_downtime_fire_once_fires_once_however_recent_the_slots() -> None:
    """A task every 3 s, the beats down for 8 minutes: the first round after them (their
    stretch of claiming starts now) fires the latest slot only. The 160 others, 20 of them
    within the grace, fell due while no beat was claiming: one span of missed slots."""
    every_3s = Interval(timedelta(seconds=3), T0)
    now = T0 + timedelta(minutes=8, seconds=1)
    plan = plan_claim(every_3s, T0, now, grace=GRACE, busy_since=now)
    latest = T0 + timedelta(minutes=8)
    assert plan.fire == [latest]
    assert plan.missed == []
    assert plan.missed_span == MissedSpan(T0, latest - timedelta(seconds=3), 160)
    assert plan.next_slot == latest + timedelta(seconds=3)


@pytest.mark.parametrize(("policy", "fired"), [("fire_once", 1), ("fire_all", 100), ("skip", 1)])
def test_a_day_down_then_a_beat_claims(policy: str, fired: int) -> None:
    """A task every second, a day down: fire_once and skip fire the latest slot (half a second
    old), fire_all its latest ``fire_all_max``; every other slot of the day is one span,
    accounted for exactly once."""
    now = T0 + DAY + timedelta(seconds=0.5)
    plan = plan_claim(
        EVERY_SECOND, T0, now, policy=policy, grace=GRACE, fire_all_max=100, busy_since=now
    )
    assert plan.fire == [T0 + DAY - timedelta(seconds=s) for s in range(fired - 1, -1, -1)]
    assert plan.missed == []
    span = plan.missed_span
    assert span == MissedSpan(T0, plan.fire[0] - timedelta(seconds=1), 86_401 - fired)
    assert plan.next_slot == T0 + DAY + timedelta(seconds=1)


def test_skip_fires_the_latest_slot_of_a_downtime_only_within_the_grace() -> None:
    hourly = Interval(timedelta(hours=1), T0)
    now = T0 + timedelta(hours=5, seconds=30)
    plan = plan_claim(hourly, T0, now, policy="skip", grace=GRACE, busy_since=now, record_max=10)
    assert plan.fire == [T0 + timedelta(hours=5)]
    assert plan.missed == [T0 + timedelta(hours=h) for h in range(5)]
    later = now + timedelta(minutes=30)
    plan = plan_claim(hourly, T0, later, policy="skip", grace=GRACE, busy_since=later)
    assert plan.fire == [] and plan.missed_span == MissedSpan(T0, T0 + timedelta(hours=5), 6)


@pytest.mark.parametrize("policy", ["fire_once", "fire_all", "skip"])
def test_slots_late_from_a_slow_round_all_fire(policy: str) -> None:
    """The beats have been claiming all along and a round took 2.5 s: the three slots of a
    task every second that fell due meanwhile are late, not missed, under every policy."""
    now = T0 + timedelta(seconds=2.5)
    plan = plan_claim(EVERY_SECOND, T0, now, policy=policy, busy_since=T0 - timedelta(hours=1))
    assert plan.fire == [T0, T0 + timedelta(seconds=1), T0 + timedelta(seconds=2)]
    assert plan.missed == [] and plan.missed_span is None


@pytest.mark.parametrize(
    ("policy", "fired"), [("fire_once", [6, 7, 8]), ("fire_all", range(9)), ("skip", [6, 7, 8])]
)
def test_slots_of_a_downtime_give_way_to_the_slots_due_since(policy: str, fired: Any) -> None:
    """A beat began claiming at T0 + 6 s, and a wave kept it from this task every second
    until T0 + 8.5 s. The slots since T0 + 6 s (that one included) fell due while it claimed:
    they fire. Under fire_once and skip the six of the downtime are all missed, none fired for
    them: the task fires anyway; fire_all fires them too."""
    now = T0 + timedelta(seconds=8.5)
    busy_since = T0 + timedelta(seconds=6)
    plan = plan_claim(EVERY_SECOND, T0, now, policy=policy, grace=GRACE, busy_since=busy_since)
    assert plan.fire == [T0 + timedelta(seconds=s) for s in fired]
    assert plan.missed_count == 9 - len(plan.fire)
    assert plan.next_slot == T0 + timedelta(seconds=9)


def test_unknown_policy_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown misfire policy 'sometimes'"):
        plan_claim(EVERY_SECOND, T0, T0, policy="sometimes")


@settings(max_examples=400, deadline=None)
@given(
    every=st.integers(min_value=1, max_value=7200),
    kind=st.sampled_from(["interval", "crontab", "one-off"]),
    behind_us=st.integers(min_value=0, max_value=3 * 3600 * 10**6),
    grace_s=st.integers(min_value=0, max_value=3600),
    policy=st.sampled_from(["fire_once", "fire_all", "skip"]),
    busy_us=st.one_of(st.none(), st.integers(min_value=-3600 * 10**6, max_value=3 * 3600 * 10**6)),
)
def test_the_on_time_shortcut_plans_as_the_walk_does(
    every: int, kind: str, behind_us: int, grace_s: int, policy: str, busy_us: int | None
) -> None:
    """A slot on time takes a shortcut (no walk over the schedule's slots); a jitter of zero
    takes the walk and plans the same instants: the two plans must be equal, whatever the
    schedule, how far behind, the grace, the policy."""
    from celery_driftsafe.core.misfire import Jitter

    schedule: Any = {
        "interval": Interval(timedelta(seconds=every), T0),
        "crontab": Crontab(minute=f"*/{every % 59 + 1}", timezone="Europe/Berlin"),
        "one-off": OneOff(T0 + timedelta(seconds=every)),
    }[kind]
    slot = schedule.first_at_or_after(T0 + timedelta(seconds=every))
    assert slot is not None
    now = slot + timedelta(microseconds=behind_us)
    options: dict[str, Any] = {
        "policy": policy,
        "grace": timedelta(seconds=grace_s),
        "busy_since": None if busy_us is None else slot + timedelta(microseconds=busy_us),
    }
    walked = plan_claim(schedule, slot, now, jitter=Jitter("t", timedelta(0)), **options)
    assert plan_claim(schedule, slot, now, **options) == walked


def test_more_slots_on_time_than_a_plan_takes_fire_over_the_next_rounds() -> None:
    """A grace wider than ``on_time_max`` slots (a task every second with a grace of hours):
    a plan fires the first ``on_time_max`` on-time slots and leaves the next one as its next
    slot, due already, so the following plans fire the rest; none is skipped unrecorded (the
    plan used to jump to the first slot after now)."""
    every = Interval(timedelta(seconds=1), anchor=T0)
    now = T0 + timedelta(seconds=24)
    fired: list[datetime] = []
    next_slot: datetime | None = T0
    plans = 0
    while next_slot is not None and next_slot <= now:
        plan = plan_claim(every, next_slot, now, grace=timedelta(hours=1), on_time_max=10)
        assert not plan.missed and plan.missed_span is None
        fired += plan.fire
        next_slot = plan.next_slot
        plans += 1
    assert fired == [T0 + timedelta(seconds=k) for k in range(25)]
    assert plans == 3 and next_slot == now + timedelta(seconds=1)


@settings(max_examples=400, deadline=None)
@given(
    every_ms=st.integers(min_value=1, max_value=7_200_000),
    behind_us=st.integers(min_value=0, max_value=48 * 3600 * 10**6),
    grace_ms=st.integers(min_value=0, max_value=3_600_000),
    policy=st.sampled_from(["fire_once", "fire_all", "skip"]),
    record_max=st.integers(min_value=0, max_value=5),
    fire_all_max=st.integers(min_value=1, max_value=5),
    on_time_max=st.integers(min_value=1, max_value=5),
    busy_us=st.one_of(st.none(), st.integers(min_value=-3600 * 10**6, max_value=48 * 3600 * 10**6)),
)
def test_an_interval_counted_on_its_grid_plans_as_the_walk_does(
    every_ms: int,
    behind_us: int,
    grace_ms: int,
    policy: str,
    record_max: int,
    fire_all_max: int,
    on_time_max: int,
    busy_us: int | None,
) -> None:
    """An interval without jitter is planned by arithmetic on its slots' indices (a task back
    after an outage); a jitter of zero walks the slots: both must plan the same, whatever the
    step, how far behind, the grace, since when the beats have been claiming, the policy and
    the bounds on rows, catch-ups and slots on time."""
    from celery_driftsafe.core.misfire import Jitter

    schedule = Interval(timedelta(milliseconds=every_ms), T0)
    slot = T0 + timedelta(milliseconds=every_ms * 3)
    now = slot + timedelta(microseconds=behind_us)
    options: dict[str, Any] = {
        "policy": policy,
        "grace": timedelta(milliseconds=grace_ms),
        "record_max": record_max,
        "fire_all_max": fire_all_max,
        "on_time_max": on_time_max,
        "busy_since": None if busy_us is None else slot + timedelta(microseconds=busy_us),
    }
    walked = plan_claim(schedule, slot, now, jitter=Jitter("t", timedelta(0)), **options)
    assert plan_claim(schedule, slot, now, **options) == walked


#: Zones with a 1-hour DST shift, a 30-minute one, none, and one whose spring gap crosses
#: midnight (Havana: 00:00 -> 01:00).
COUNTED_ZONES = ["Europe/Berlin", "America/New_York", "Australia/Lord_Howe", "Asia/Kolkata", "UTC"]


def _cron_field(low: int, high: int) -> st.SearchStrategy[str]:
    value = st.integers(min_value=low, max_value=high)
    return st.one_of(
        st.just("*"),
        value.map(str),
        st.integers(min_value=2, max_value=high - low + 1).map(lambda step: f"*/{step}"),
        st.lists(value, min_size=1, max_size=3).map(lambda items: ",".join(map(str, items))),
    )


@st.composite
def _counted_crontabs(draw: st.DrawFn, dense: bool) -> Crontab:
    zone = draw(st.sampled_from([*COUNTED_ZONES, "America/Havana"]))
    while True:
        # A long range is walked in the test: keep its slots to a few a day there.
        minute = draw(_cron_field(0, 59)) if dense else str(draw(st.integers(0, 59)))
        hour = draw(st.one_of(st.just("*"), _cron_field(0, 23)))
        second = draw(st.sampled_from(["0", "*/20", "15,45"])) if dense else "0"
        try:
            return Crontab(
                minute=minute,
                hour=hour,
                day_of_month=draw(_cron_field(1, 31)),
                month_of_year=draw(_cron_field(1, 12)),
                day_of_week=draw(_cron_field(0, 6)),
                timezone=zone,
                second=second,
            )
        except ValueError:  # ScheduleError: a combination that never fires
            continue


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    # Around 2020-2026: DST changes each spring and autumn, Havana's gap at midnight.
    start_s=st.integers(min_value=0, max_value=6 * 365 * 86_400),
    long=st.booleans(),
)
def test_a_crontab_counted_by_days_and_years_counts_as_the_walk_does(
    data: st.DataObject, start_s: int, long: bool
) -> None:
    """A crontab's slots between two instants are counted a day (and a whole year) at a time,
    never listed: the count, and the start of the last few slots that a plan records, must be
    those of the walk, on zones with 1-hour, 30-minute and no DST, across the transitions,
    for ranges of seconds to over two years."""
    from celery_driftsafe.core.misfire import _count_and_tail_start, _walk

    crontab = data.draw(_counted_crontabs(dense=not long))
    start = datetime(2020, 1, 1, tzinfo=UTC) + timedelta(seconds=start_s)
    length = data.draw(st.integers(min_value=0, max_value=(900 if long else 3) * 86_400 * 10**6))
    end = start + timedelta(microseconds=length)
    keep = data.draw(st.integers(min_value=1, max_value=5))
    assert crontab.count_between(start, end) == sum(1 for _ in crontab.slots_between(start, end))
    counted, tail_start = _count_and_tail_start(crontab, start, end, keep)
    walked, walked_tail_start = _walk(crontab, start, end, keep)
    assert counted == walked
    tail = list(crontab.slots_between(tail_start, end))
    assert tail == list(crontab.slots_between(walked_tail_start, end))[-keep:]
    assert len(tail) == min(keep, walked)


def test_a_crontab_decades_behind_is_one_span_counted_exactly() -> None:
    """A ``next_slot_at`` in 1900 on an every-minute crontab (written behind ``save()``) plans
    one run and one span of every other minute since: counted, not listed (listing them took
    over six minutes); the count is the minutes between, less the one that fires."""
    every_minute = Crontab()
    first = datetime(1900, 1, 1, tzinfo=UTC)
    now = datetime(2026, 12, 4, 18, 0, 30, tzinfo=UTC)
    plan = plan_claim(every_minute, first, now, busy_since=now - timedelta(seconds=5))
    minutes = (datetime(2026, 12, 4, 18, 0, tzinfo=UTC) - first) // timedelta(minutes=1) + 1
    assert plan.fire == [datetime(2026, 12, 4, 18, 0, tzinfo=UTC)]
    assert plan.missed_span == MissedSpan(
        first=first, last=datetime(2026, 12, 4, 17, 59, tzinfo=UTC), count=minutes - 1
    )
    assert plan.next_slot == datetime(2026, 12, 4, 18, 1, tzinfo=UTC)


@settings(max_examples=60, deadline=None)
@given(
    event=st.sampled_from(
        ["sunrise", "sunset", "solar_noon", "dawn_civil", "dusk_nautical", "dusk_astronomical"]
    ),
    latitude=st.floats(min_value=-80, max_value=80),
    longitude=st.floats(min_value=-180, max_value=180),
    start_s=st.integers(min_value=0, max_value=3 * 365 * 86_400),
    length_s=st.integers(min_value=0, max_value=400 * 86_400),
    keep=st.integers(min_value=1, max_value=5),
)
def test_a_solar_schedule_counted_by_days_counts_as_the_walk_does(
    event: str, latitude: float, longitude: float, start_s: int, length_s: int, keep: int
) -> None:
    """A solar schedule has at most one slot a day: away from the poles, where every day has
    the event, it is counted from the days of its first and last slots, not listed; the count
    and the last slots must be those of the walk (near the poles, a day at a time)."""
    from celery_driftsafe.core.misfire import _count_and_tail_start, _walk

    solar = Solar(event, latitude, longitude)
    start = datetime(2022, 1, 1, tzinfo=UTC) + timedelta(seconds=start_s)
    end = start + timedelta(seconds=length_s)
    counted, tail_start = _count_and_tail_start(solar, start, end, keep)
    walked, walked_tail_start = _walk(solar, start, end, keep)
    assert counted == walked
    assert (
        list(solar.slots_between(tail_start, end))
        == list(solar.slots_between(walked_tail_start, end))[-keep:]
    )


# -- the planner's choice: the grid and the walk make the same plans ----------------------------


def test_without_arithmetic_plans_walk(monkeypatch: pytest.MonkeyPatch) -> None:
    """``arithmetic`` is the caller's choice (the core holds no switch): on, a slot on time
    takes the shortcut and an interval behind is counted on its grid; off, both walk."""
    walks = count_walks(monkeypatch)
    minutely = Interval(timedelta(minutes=1), T0)
    second = timedelta(seconds=1)
    on_time = plan_claim(minutely, T0, T0 + second)
    behind = plan_claim(minutely, T0, T0 + timedelta(hours=2))
    assert walks == []
    assert plan_claim(minutely, T0, T0 + second, arithmetic=False) == on_time
    assert plan_claim(minutely, T0, T0 + timedelta(hours=2), arithmetic=False) == behind
    assert len(walks) == 2


@settings(max_examples=300, deadline=None)
@given(
    every_ms=st.integers(1, 7_200_000),
    anchor_us=st.integers(-(10**9), 10**9),
    behind_us=st.integers(-(10**9), 4 * 10**10),
    grace_s=st.integers(0, 600),
    busy_us=st.none() | st.integers(-4 * 10**10, 10**9),
    policy=st.sampled_from(list(MisfirePolicy)),
    fire_all_max=st.integers(1, 20),
    record_max=st.integers(0, 5),
    on_time_max=st.integers(1, 50),
)
def test_plans_by_arithmetic_are_the_walks_plans(
    every_ms: int,
    anchor_us: int,
    behind_us: int,
    grace_s: int,
    busy_us: int | None,
    policy: MisfirePolicy,
    fire_all_max: int,
    record_max: int,
    on_time_max: int,
) -> None:
    """The walk is the oracle: with the shortcut and the count on the grid, every plan of a
    plain interval is the one the walk makes (from a slot of the schedule, as a task's next
    slot is: ``plan_claim`` trusts it to be one)."""
    schedule = Interval(timedelta(milliseconds=every_ms), T0 + timedelta(microseconds=anchor_us))
    next_slot = schedule.first_at_or_after(T0)
    assert next_slot is not None
    now = T0 + timedelta(microseconds=behind_us)
    options: dict[str, Any] = {
        "policy": policy,
        "grace": timedelta(seconds=grace_s),
        "fire_all_max": fire_all_max,
        "record_max": record_max,
        "on_time_max": on_time_max,
        "busy_since": None if busy_us is None else now + timedelta(microseconds=busy_us),
    }
    planned = plan_claim(schedule, next_slot, now, **options)
    walked = plan_claim(schedule, next_slot, now, arithmetic=False, **options)
    assert planned == walked
