"""Misfire policies as pure functions: counts after a simulated outage."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from celery_driftsafe.misfire import plan_claim
from celery_driftsafe.slots import Crontab, Interval

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
def test_one_day_outage_of_one_second_task(policy: str) -> None:
    """After a day down, on-time slots (the last 60 s) fire under every policy; the policy
    decides the 86,340 older ones, and rows are bounded by ``record_max``."""
    now = T0 + DAY
    plan = plan_claim(
        EVERY_SECOND, T0, now, policy=policy, grace=GRACE, fire_all_max=100, record_max=1000
    )
    on_time = [now - timedelta(seconds=s) for s in range(60, -1, -1)]
    missed_total = 86_400 - 60  # slots in [T0, now - 60 s)
    assert plan.fire[-61:] == on_time
    assert plan.next_slot == now + timedelta(seconds=1)
    if policy == "fire_all":
        assert len(plan.fire) == 61 + 100
        assert plan.fire[:100] == [now - GRACE - timedelta(seconds=s) for s in range(100, 0, -1)]
        recorded = 1000 - 100
    else:
        assert len(plan.fire) == 61  # fire_once: on-time slots already are the one firing
        recorded = 1000
    assert len(plan.missed) == recorded
    assert plan.missed[-1] == plan.fire[0] - timedelta(seconds=1)  # no gap, no overlap
    assert plan.unrecorded_missed == (T0, missed_total - 1000)
    # every slot in the outage is accounted for exactly once
    fired_missed = len([s for s in plan.fire if s < now - GRACE])
    assert fired_missed + len(plan.missed) + plan.unrecorded_missed[1] == missed_total


def test_fire_once_fires_latest_missed_when_nothing_is_on_time() -> None:
    hourly = Interval(timedelta(hours=1), T0)
    now = T0 + timedelta(hours=5, minutes=30)
    plan = plan_claim(hourly, T0, now, policy="fire_once", grace=GRACE)
    assert plan.fire == [T0 + timedelta(hours=5)]
    assert plan.missed == [T0 + timedelta(hours=h) for h in range(5)]
    assert plan.unrecorded_missed is None
    assert plan.next_slot == T0 + timedelta(hours=6)


def test_skip_fires_nothing_missed() -> None:
    hourly = Interval(timedelta(hours=1), T0)
    now = T0 + timedelta(hours=5, minutes=30)
    plan = plan_claim(hourly, T0, now, policy="skip", grace=GRACE)
    assert plan.fire == []
    assert len(plan.missed) == 6
    assert plan.next_slot == T0 + timedelta(hours=6)


def test_fire_all_is_bounded() -> None:
    hourly = Interval(timedelta(hours=1), T0)
    now = T0 + timedelta(hours=5, minutes=30)
    plan = plan_claim(hourly, T0, now, policy="fire_all", grace=GRACE, fire_all_max=2)
    assert plan.fire == [T0 + timedelta(hours=4), T0 + timedelta(hours=5)]
    assert plan.missed == [T0 + timedelta(hours=h) for h in range(4)]


def test_crontab_outage_counts_by_walking() -> None:
    every_minute = Crontab.from_expression("* * * * *", "Europe/Berlin")
    now = T0 + timedelta(hours=3)
    plan = plan_claim(every_minute, T0, now, policy="fire_once", grace=GRACE, record_max=10)
    assert plan.fire == [now - timedelta(minutes=1), now]
    assert len(plan.missed) == 10
    assert plan.unrecorded_missed == (T0, 179 - 10)


def test_unknown_policy_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown misfire policy 'sometimes'"):
        plan_claim(EVERY_SECOND, T0, T0, policy="sometimes")
