"""Misfire policies: which due slots of one task fire, which are recorded missed, and where
the task goes next. Pure: no Django, no Redis, no clock; ``now`` is a parameter.

A slot ``s`` is *due* when ``s <= now``. A due slot is *on time* when ``now - s <= grace``;
on-time slots always fire, whatever the policy (a beat a few seconds late is late, not down).
Slots older than the grace are *missed* (the beats were down, or the task was disabled) and
the policy decides:

``fire_once`` (default)
    one catch-up run, under the latest missed slot, when no on-time slot fires anyway;
    every other missed slot is recorded as missed.
``fire_all``
    the latest ``fire_all_max`` missed slots fire; older ones are recorded as missed.
``skip``
    no missed slot fires; all are recorded as missed.

Recording is bounded too: at most ``record_max`` missed slots get a row each (the latest
ones); the older remainder is summarised by :attr:`ClaimPlan.unrecorded_missed` (a count and
the first such slot), so a week-long outage of a one-second task is one summary, not 600,000
rows.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from celery_driftsafe.slots import Interval, Schedule

_TICK = timedelta(microseconds=1)


@dataclass(frozen=True)
class ClaimPlan:
    """What one claim does for one task."""

    fire: list[datetime] = field(default_factory=list)
    missed: list[datetime] = field(default_factory=list)
    #: Older missed slots with no row of their own: (first slot, how many), or None.
    unrecorded_missed: tuple[datetime, int] | None = None
    #: The task's next unclaimed slot (strictly after ``now``), or None when it has no more.
    next_slot: datetime | None = None


def plan_claim(
    schedule: Schedule,
    next_slot: datetime,
    now: datetime,
    *,
    policy: str = "fire_once",
    grace: timedelta = timedelta(seconds=60),
    fire_all_max: int = 100,
    record_max: int = 1000,
    on_time_max: int = 10_000,
) -> ClaimPlan:
    """Plan the claim of a task whose first unclaimed slot is ``next_slot``, at ``now``.

    ``next_slot`` itself is trusted to be a slot of ``schedule`` (it was computed from it);
    if ``next_slot > now`` nothing is due and the plan only repeats ``next_slot``.
    """
    if policy not in ("fire_once", "fire_all", "skip"):
        raise ValueError(f"unknown misfire policy {policy!r}")
    if next_slot > now:
        return ClaimPlan(next_slot=next_slot)
    recent_start = now - grace
    keep = max(record_max, fire_all_max if policy == "fire_all" else 1)
    missed_tail: deque[datetime] = deque(maxlen=keep)
    missed_total = 0
    first_missed: datetime | None = None
    if next_slot < recent_start:
        first_missed = next_slot
        missed_total, tail_start = _count_and_tail_start(schedule, next_slot, recent_start, keep)
        missed_tail.extend(_slots(schedule, tail_start, recent_start))
    on_time = list(_slots(schedule, max(next_slot, recent_start), now + _TICK, on_time_max))

    missed = list(missed_tail)
    fire = list(on_time)
    if missed:
        if policy == "fire_all":
            fire = missed[-fire_all_max:] + fire
            missed = missed[: max(len(missed) - fire_all_max, 0)]
        elif policy == "fire_once" and not on_time:
            fire = [missed.pop()]
    unrecorded = missed_total - len(missed_tail)
    summary = (first_missed, unrecorded) if unrecorded > 0 and first_missed else None
    return ClaimPlan(
        fire=fire,
        missed=missed,
        unrecorded_missed=summary,
        next_slot=schedule.next_after(now),
    )


def _slots(
    schedule: Schedule, start: datetime, end: datetime, limit: int | None = None
) -> list[datetime]:
    out: list[datetime] = []
    for slot in schedule.slots_between(start, end):
        out.append(slot)
        if limit is not None and len(out) >= limit:
            break
    return out


def _count_and_tail_start(
    schedule: Schedule, start: datetime, end: datetime, keep: int
) -> tuple[int, datetime]:
    """Count slots in ``[start, end)`` and find where the last ``keep`` of them begin.

    Intervals are counted arithmetically; other schedules are walked once (a crontab fires at
    most once a minute, so a year's outage is half a million steps, done once).
    """
    if isinstance(schedule, Interval):
        every = schedule.every
        count = (end - _TICK - start) // every + 1
        tail = start + every * max(count - keep, 0)
        return count, tail
    recent: deque[datetime] = deque(maxlen=keep)
    count = 0
    for slot in schedule.slots_between(start, end):
        recent.append(slot)
        count += 1
    return count, (recent[0] if recent else end)
