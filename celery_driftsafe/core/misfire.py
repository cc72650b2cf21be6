"""Misfire policies: which due slots of one task fire, which are recorded missed, and where
the task goes next. Pure: no Django, no Redis, no clock; ``now`` is a parameter.

A slot ``s`` is *due* when ``s <= now``. A due slot is *on time* when it fell due while the
beats were claiming (at or after ``busy_since``, the start of their stretch of claiming without
a break) and ``now - s <= grace``; on-time slots always fire, whatever the policy (a beat a few
seconds late is late, not down). Every other due slot is *missed*: it fell due while no beat
was claiming (all down, paused, or the database away: downtime), or longer than the grace ago.
The policy decides the missed ones:

``fire_once`` (default)
    one run for them all, under the latest missed slot, when no on-time slot fires anyway;
    every other missed slot is recorded as missed. After downtime a task fires once, however
    many of its slots fell due meanwhile, within the grace or not.
``fire_all``
    the latest ``fire_all_max`` missed slots fire; older ones are recorded as missed.
``skip``
    as ``fire_once``, but the latest missed slot fires only when it is within the grace (it
    was missed for the downtime alone); all others are recorded as missed.

``busy_since`` None (unknown) counts no slot as fallen due in downtime: the grace alone
decides.

A task whose only due slot is older than the grace is *late*, not missed, when it fell due while
the beats were working through a backlog without a break (``busy_since``): a burst that the
cluster drains within a period fires every slot, however late. A task with two or more due
slots has fallen a whole period behind (the cluster is over capacity, or was down): the
policy applies.

Recording is bounded too: up to ``record_max`` missed slots get a row each; more than that
are recorded as one span (:attr:`ClaimPlan.missed_span`: first, last, count), counted without
listing them, so a day-long outage of a once-a-minute task is one row, not 1,440, and
recovering costs O(tasks), not O(tasks * missed slots).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from functools import lru_cache
from typing import Any, Protocol, cast, runtime_checkable

from celery_driftsafe.core.bounds import Bounded, Limits, run_budget
from celery_driftsafe.core.exclusions import MAX_CONSECUTIVE_EXCLUSIONS, is_excluding
from celery_driftsafe.core.instants import from_us, to_us
from celery_driftsafe.core.jitter import due_instant, spread_us
from celery_driftsafe.core.schedules import Interval, Schedule
from celery_driftsafe.core.stored_names import MisfirePolicy

_TICK = timedelta(microseconds=1)


@dataclass(frozen=True)
class MissedSpan:
    """Missed slots recorded in one row: the first, the last and how many."""

    first: datetime
    last: datetime
    count: int


@dataclass(frozen=True)
class ClaimPlan:
    """What one claim does for one task."""

    fire: list[datetime] = field(default_factory=list)
    #: Missed slots with a row each (at most ``record_max``).
    missed: list[datetime] = field(default_factory=list)
    #: Every missed slot in one row, when there are more than ``record_max``.
    missed_span: MissedSpan | None = None
    #: The task's next unclaimed slot, or None when it has no more: after ``now``, unless the
    #: plan stopped at ``on_time_max`` slots on time (the rest are due, for the next round).
    next_slot: datetime | None = None
    #: The slot fires past the grace because the beats were busy, not down (see above).
    late_from_load: bool = False

    @property
    def missed_count(self) -> int:
        return len(self.missed) + (self.missed_span.count if self.missed_span else 0)


#: The policies by value (a plain set: asking an enum for its members each call costs more than
#: the rest of a plan that fires on time).
_POLICIES = frozenset(policy.value for policy in MisfirePolicy)


def plan_claim(
    schedule: Schedule,
    next_slot: datetime,
    now: datetime,
    *,
    policy: str = MisfirePolicy.FIRE_ONCE,
    grace: timedelta = timedelta(seconds=60),
    fire_all_max: int = 100,
    record_max: int = 3,
    on_time_max: int = 10_000,
    busy_since: datetime | None = None,
    jitter: Jitter | None = None,
    arithmetic: bool = True,
) -> ClaimPlan:
    """Plan the claim of a task whose first unclaimed slot is ``next_slot``, at ``now``.

    ``next_slot`` itself is trusted to be a slot of ``schedule`` (it was computed from it);
    if ``next_slot`` is not due at ``now`` nothing is due and the plan only repeats ``next_slot``.
    ``busy_since``: since when the beats have been claiming without a break (None: unknown); a
    slot due before it fell due in downtime.

    ``jitter``: the task's deterministic spread (:mod:`celery_driftsafe.core.jitter`). A slot ``s``
    is then due at ``jitter.due(s)`` instead of ``s``: it is due when that instant is at or
    before ``now``, on time while ``now`` is within ``grace`` of it, and the plan stops at the
    first slot not yet due (it is the next slot; later slots fire after it, never before their
    own instant).

    ``arithmetic``: whether the plan may be made without walking the slots: a slot on time
    takes a shortcut, and a plain interval's slots are counted on its grid. False: every plan
    walks its slots. The plans are the same either way (the walk is the oracle the tests
    compare the grid with); the caller chooses (the claim, from the settings' optimisations).
    """
    if policy not in _POLICIES:
        raise ValueError(f"unknown misfire policy {policy!r}")
    due = jitter.due if jitter is not None else _on_the_slot
    spread = jitter.spread if jitter is not None else timedelta(0)
    if due(next_slot) > now:
        return ClaimPlan(next_slot=next_slot)
    recent_start = now - grace
    if arithmetic and jitter is None and next_slot >= recent_start:
        # The common case, a slot on time: it fires, and the plan is the one below (no tail,
        # one slot on time, the next slot the first after it and after now) without walking.
        following = schedule.next_after(next_slot)
        if following is None or following > now:
            return ClaimPlan(fire=[next_slot], next_slot=following)
    if busy_since is not None and busy_since <= due(next_slot) < recent_start:
        following = schedule.next_after(next_slot)
        if following is None or due(following) > now:
            return ClaimPlan(fire=[next_slot], next_slot=following, late_from_load=True)
    grace_start = recent_start
    if busy_since is not None and busy_since > recent_start:
        # A slot that fell due before the beats' stretch of claiming began fell due while
        # none was claiming: missed, however recent (the policy gives the downtime its run).
        # A stretch that began after now (never in a beat) begins now.
        recent_start = min(busy_since, now)
    fired_max = fire_all_max if policy == MisfirePolicy.FIRE_ALL else 1
    keep = fired_max + max(record_max, 1)
    # Slots before window_start are due before recent_start whatever their jitter: missed.
    window_start = recent_start - spread
    counted = (
        _count_on_the_grid(schedule, next_slot, recent_start, now, keep, on_time_max)
        if arithmetic and jitter is None and type(schedule) is Interval
        else None
    )
    if counted is not None:
        missed_total, tail, on_time, upcoming = counted
    else:
        missed_total, tail, on_time, upcoming = _walk_due(
            schedule, next_slot, window_start, recent_start, now, keep, on_time_max, due
        )

    fire = on_time
    if tail:
        if policy == MisfirePolicy.FIRE_ALL:
            fire = tail[-fire_all_max:] + fire
            tail = tail[: max(len(tail) - fire_all_max, 0)]
        elif not on_time and (policy == MisfirePolicy.FIRE_ONCE or due(tail[-1]) >= grace_start):
            # fire_once: the latest missed slot; skip: only when it is within the grace (it
            # was missed for the downtime alone).
            fire = [tail.pop()]
    remaining = missed_total - (len(fire) - len(on_time))
    span = None
    if remaining > record_max:
        span = MissedSpan(first=next_slot, last=tail[-1], count=remaining)
        tail = []
    return ClaimPlan(
        fire=fire,
        missed=tail,
        missed_span=span,
        next_slot=upcoming if upcoming is not None else schedule.next_after(now),
    )


def _on_the_slot(slot: datetime) -> datetime:
    return slot


_Counted = tuple[int, list[datetime], list[datetime], datetime | None]


def _walk_due(
    schedule: Schedule,
    next_slot: datetime,
    window_start: datetime,
    recent_start: datetime,
    now: datetime,
    keep: int,
    on_time_max: int,
    due: Callable[[datetime], datetime],
) -> _Counted:
    """How many slots from ``next_slot`` on are missed, the last ``keep`` of them, the slots on
    time (at most ``on_time_max``) and the slot after those: the missed ones counted, then the
    rest walked one by one."""
    tail: list[datetime] = []
    missed_total = 0
    if next_slot < window_start:
        missed_total, tail_start = _count_and_tail_start(schedule, next_slot, window_start, keep)
        tail = _slots(schedule, tail_start, window_start)
    on_time: list[datetime] = []
    upcoming = None
    for slot in schedule.slots_between(max(next_slot, window_start), now + _TICK):
        instant = due(slot)
        if instant > now:
            upcoming = slot
            break
        if instant < recent_start and not on_time:
            tail.append(slot)
            missed_total += 1
            continue
        on_time.append(slot)
        if len(on_time) >= on_time_max:
            # The rest of the on-time slots fire next round: the next slot is the first of
            # them (due already), not the first after now, which would skip them unrecorded.
            upcoming = schedule.next_after(slot)
            break
    return missed_total, tail[-keep:], on_time, upcoming


def _count_on_the_grid(
    schedule: Interval,
    next_slot: datetime,
    recent_start: datetime,
    now: datetime,
    keep: int,
    on_time_max: int,
) -> _Counted | None:
    """What :func:`_walk_due` finds for an interval without jitter, by arithmetic on the
    slots' indices: a task back after an outage plans in a few microseconds, where the walk
    took some 14 (a tenth of the beat's cost of a slot). None when ``next_slot`` is not on the
    interval's grid (the walk then starts from it as it is)."""
    anchor, every = schedule.grid_us
    first, off_grid = divmod(to_us(next_slot) - anchor, every)
    if off_grid:
        return None
    now_us = to_us(now)
    recent = -(-(now_us - (now - recent_start) // _TICK - anchor) // every)  # first on time
    last = (now_us - anchor) // every  # the last slot due
    on_from = max(first, recent)
    taken = min(max(last - on_from + 1, 0), on_time_max)
    # The last `keep` missed slots and the slots on time are one run of the grid: one
    # conversion, then a step at a time (a conversion costs ten steps).
    low = max(first, recent - keep)
    slots: list[datetime] = []
    slot = from_us(anchor + low * every)
    for _ in range(on_from + taken - low):
        assert slot is not None  # every slot here is at or before now
        slots.append(slot)
        slot += schedule.every
    missed = max(on_from - low, 0)
    # After the slots taken: the first after now, or the first on-time slot left for the next
    # round when there were more than on_time_max.
    upcoming = from_us(anchor + (on_from + taken) * every)
    return max(recent - first, 0), slots[:missed], slots[missed:], upcoming


@dataclass(frozen=True)
class Jitter:
    """A task's deterministic spread: slot ``s`` is due at ``due_instant(identity, s, spread)``,
    ``s`` plus an offset in ``[0, spread)`` (see :mod:`celery_driftsafe.core.jitter`)."""

    identity: str
    spread: timedelta

    def due(self, slot: datetime) -> datetime:
        return due_instant(self.identity, slot, self.spread.total_seconds())


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

    Intervals are counted arithmetically, crontabs and solar schedules by their
    ``count_between`` (a day or a year at a time, never a slot at a time): the cost does not
    grow with the slots counted, so a ``next_slot_at`` decades behind plans as fast as one an
    hour behind. Other schedules are walked once, and remembered.
    """
    if isinstance(schedule, Bounded) and isinstance(schedule.schedule, Interval | Countable):
        start = max(start, schedule.valid_from or start)
        end = min(end, schedule.valid_until or end)
        if end <= start:
            return 0, end
        schedule = schedule.schedule
        if isinstance(schedule, Interval):
            start = schedule.first_at_or_after(start) or end
            if start >= end:
                return 0, end
    if isinstance(schedule, Interval):
        every = schedule.every
        count = (end - _TICK - start) // every + 1
        tail = start + every * max(count - keep, 0)
        return count, tail
    if isinstance(schedule, Countable):  # crontabs and solar schedules: hashable values
        return _count_remembered(schedule, start, end, keep)
    if isinstance(schedule, Hashable):
        return _walk_remembered(schedule, start, end, keep)
    return _walk(schedule, start, end, keep)


@runtime_checkable
class Countable(Protocol):
    """A schedule that counts its slots in ``[start, end)`` without listing them."""

    def count_between(self, start: datetime, end: datetime) -> int: ...


def _count_and_tail_by_counting(
    schedule: Countable, start: datetime, end: datetime, keep: int
) -> tuple[int, datetime]:
    """The count, and the ``keep``-th slot from the end found by bisection on counts: the
    window back from ``end`` doubles until it holds ``keep`` slots, then the instant where
    the count from it to ``end`` drops below ``keep`` is found to the microsecond."""
    count = schedule.count_between(start, end)
    if count <= keep:
        return count, start
    span = _SECOND
    while span < end - start and schedule.count_between(end - span, end) < keep:
        span *= 2
    # count(low) >= keep > count(high)
    low, high = (end - span if span < end - start else start), end - span // 2
    while high - low > _TICK:
        middle = low + (high - low) // 2
        if schedule.count_between(middle, end) >= keep:
            low = middle
        else:
            high = middle
    return count, low


_SECOND = timedelta(seconds=1)


@lru_cache(maxsize=4096)
def _count_remembered(
    schedule: Countable, start: datetime, end: datetime, keep: int
) -> tuple[int, datetime]:
    """After an outage, tasks with the same crontab share their missed slots: a thousand
    tasks on one expression cost one count (some forty of them, with the bisection)."""
    return _count_and_tail_by_counting(schedule, start, end, keep)


def _walk(schedule: Schedule, start: datetime, end: datetime, keep: int) -> tuple[int, datetime]:
    recent: deque[datetime] = deque(maxlen=keep)
    count = 0
    for slot in schedule.slots_between(start, end):
        recent.append(slot)
        count += 1
    return count, (recent[0] if recent else end)


@lru_cache(maxsize=4096)
def _walk_remembered(
    schedule: Hashable, start: datetime, end: datetime, keep: int
) -> tuple[int, datetime]:
    return _walk(cast(Schedule, schedule), start, end, keep)


# -- Under a task's bounds and run limits -------------------------------------------------------


def limit_plan(plan: ClaimPlan, budget: int | None) -> tuple[ClaimPlan, bool]:
    """``plan`` firing at most ``budget`` runs (the earliest), and whether that uses the budget
    up (the task is then to be disabled: it has no next slot). Slots cut off are not recorded:
    past its last allowed run a task has no more slots."""
    if budget is None or len(plan.fire) < budget:
        return plan, False
    return replace(
        plan,
        fire=plan.fire[:budget],
        next_slot=None,
        late_from_load=(plan.late_from_load and budget > 0),
    ), True


def plan_limited(
    schedule: Schedule, next_slot: datetime, now: datetime, limits: Limits, **options: Any
) -> tuple[ClaimPlan, str | None]:
    """:func:`plan_claim` for a task with ``limits``: ``schedule`` is already bounded
    (:func:`~celery_driftsafe.core.bounds.bounded`); a stored ``next_slot`` outside the bounds
    moves to the first slot within them; slots are due at their jittered instants; the plan
    fires at most the runs left. Returns the plan and, when the task is used up (no slot left
    before valid until, or no run left), why — the claim then disables it. ``options`` go to
    ``plan_claim`` (policy, grace, ...)."""
    start: datetime | None = next_slot
    excludes = is_excluding(schedule)
    if limits.valid_from is not None or limits.valid_until is not None or excludes:
        # A stored next slot outside the bounds, or on a date excluded since it was stored
        # (a calendar edited), moves to the first slot that may fire.
        start = schedule.first_at_or_after(next_slot)
    ended = f"valid until {limits.valid_until}: no slot is left before it"
    if start is None and excludes and limits.valid_until is None:
        return ClaimPlan(), EXCLUDED_TO_THE_END
    if start is None:
        if limits.valid_until is None:  # a valid_from past the last slot the calendar holds
            return ClaimPlan(), f"valid from {limits.valid_from}: no slot is left after it"
        return ClaimPlan(), ended
    spread = spread_us(limits.jitter_seconds)
    jitter = Jitter(limits.identity, timedelta(microseconds=spread)) if spread else None
    plan = plan_claim(schedule, start, now, jitter=jitter, **options)
    budget = run_budget(
        run_once=limits.run_once, max_runs=limits.max_runs, run_count=limits.run_count
    )
    plan, used_up = limit_plan(plan, budget)
    if used_up:
        return plan, (
            "run once: it fired its run"
            if limits.run_once and budget == 1
            else f"max runs: it reached {limits.max_runs} runs"
        )
    if plan.next_slot is None and limits.valid_until is not None:
        return plan, ended
    if plan.next_slot is None and excludes:
        return plan, EXCLUDED_TO_THE_END
    return plan, None


#: Why a task whose every further slot is excluded is finished.
EXCLUDED_TO_THE_END = (
    "excluded dates: every slot left is excluded (none found in "
    f"{MAX_CONSECUTIVE_EXCLUSIONS:,} excluded stretches in a row)"
)
