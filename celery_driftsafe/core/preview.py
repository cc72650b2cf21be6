"""A preview of a task's next slots: what the claim will fire, listed before it fires.

:func:`upcoming_slots` does not compute slots of its own. It steps the claim's own plan
(:func:`~celery_driftsafe.core.misfire.plan_limited`, with the task's bounds, run limits and
jitter) as a beat that is never late would: at each slot's jittered due instant it plans the
claim, takes the slots the plan fires, counts them as runs and moves to the plan's next slot.
So the preview and the beats cannot disagree on a slot, a jittered instant or where the list
ends; only a beat that is down or late (the misfire policies) fires differently.

Each row carries the slot in UTC and in the task's time zone, its jittered due instant, the
instant the claim fires it, and a mark where the zone's UTC offset differs from the row before
(a DST change between the two slots). The instant it fires at is the instant of the plan that
fires it: its own due instant, or a later one when an earlier slot of the task is due after it
(a jitter longer than the period): the claim takes a task's slots in slot order, so such a
slot waits for the one before and fires with it. When the task fires no more slots (a bound, a
run limit, a one-off done) the preview says why.

Pure: no clock, no Django; the caller passes the task's first unclaimed slot.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

from celery_driftsafe.core.bounds import Limits
from celery_driftsafe.core.exclusions import excluded_between
from celery_driftsafe.core.jitter import due_instant
from celery_driftsafe.core.misfire import plan_limited
from celery_driftsafe.core.schedules import Schedule


@dataclass(frozen=True)
class SlotRow:
    """One slot of a preview."""

    #: The slot (aware UTC): the run's identity.
    slot: datetime
    #: When the slot is due: the slot plus the task's jitter (equal to ``slot`` without one).
    due: datetime
    #: When a beat that is never late claims and dispatches it: ``due``, or the instant the
    #: slot before fires at when that is later (slots of one task fire in slot order).
    fires_at: datetime
    #: The slot in the task's time zone.
    local: datetime
    #: The zone's UTC offset changed since the row before (DST): from what, to what.
    offset_change: tuple[timedelta, timedelta] | None = None

    @property
    def jittered(self) -> bool:
        return self.due != self.slot

    @property
    def held(self) -> bool:
        """The slot fires after its own due instant, held behind the slot before."""
        return self.fires_at != self.due

    @property
    def local_text(self) -> str:
        """The slot in the task's zone with its UTC offset: ``2026-03-29 03:00:00 +02:00``
        (``03:00:00.25 +02:00`` for a slot with a fraction of a second)."""
        return f"{instant_text(self.local)} {offset_text(self.local.utcoffset())}"

    @property
    def due_text(self) -> str:
        """``due`` in UTC as a time of the slot's day (with its date when on another day), to
        the fraction of a second it has: ``01:30:14.482913``."""
        return instant_text(self.due, date=self.due.date() != self.slot.date())

    @property
    def fires_text(self) -> str:
        """``fires_at`` as :attr:`due_text` shows ``due``."""
        return instant_text(self.fires_at, date=self.fires_at.date() != self.slot.date())

    def offset_change_text(self, arrow: str) -> str:
        """The DST change since the row before (``UTC offset +01:00 → +02:00`` with ``arrow``
        ``"→"``), or ``""``."""
        if self.offset_change is None:
            return ""
        before, after = (offset_text(value) for value in self.offset_change)
        return f"UTC offset {before} {arrow} {after}"


@dataclass(frozen=True)
class Preview:
    """The next slots of a task and, when it fires no more after them, why."""

    rows: list[SlotRow] = field(default_factory=list)
    #: Why the task fires no slot after these (None: it goes on).
    end: str | None = None
    #: The interval anchor the preview counted from, when the task has none stored yet and the
    #: preview took the instant it was computed at (a save stores its own now unless it is
    #: handed this one; see :func:`celery_driftsafe.definitions.changes.preview`).
    anchor: datetime | None = None
    #: Slots of the schedule skipped between the first and the last row because they fall on
    #: an excluded date or time (:mod:`celery_driftsafe.core.exclusions`).
    excluded: int = 0


def upcoming_slots(
    schedule: Schedule,
    next_slot: datetime | None,
    limits: Limits,
    *,
    zone: str = "UTC",
    count: int = 10,
) -> Preview:
    """The next ``count`` slots the claim fires for a task whose first unclaimed slot is
    ``next_slot``, under ``limits``, each also read in ``zone`` (an IANA name).

    ``schedule`` is already bounded (:func:`~celery_driftsafe.core.bounds.bounded`), as the
    claim receives it. ``next_slot`` None: the task has no slot left."""
    tz = ZoneInfo(zone)
    rows: list[SlotRow] = []
    if next_slot is None:
        return Preview(rows, "the schedule has no slot left")
    slot: datetime | None = next_slot
    previous_offset: timedelta | None = None
    while slot is not None and len(rows) < count:
        # A beat that is never late claims when the task's next slot is due; every slot the
        # plan fires then is claimed and dispatched at that instant.
        now = due_instant(limits.identity, slot, limits.jitter_seconds)
        assert now is not None
        plan, finished = plan_limited(schedule, slot, now, limits)
        for fired in plan.fire[: count - len(rows)]:
            local = fired.astimezone(tz)
            offset = local.utcoffset()
            assert offset is not None
            change = None
            if previous_offset is not None and offset != previous_offset:
                change = (previous_offset, offset)
            previous_offset = offset
            due = due_instant(limits.identity, fired, limits.jitter_seconds)
            assert due is not None
            rows.append(SlotRow(fired, due, now, local, change))
        limits = replace(limits, run_count=limits.run_count + len(plan.fire))
        if finished is not None:
            if rows:
                last = rows[-1].slot + timedelta.resolution
                return Preview(
                    rows, finished, excluded=excluded_between(schedule, rows[0].slot, last)
                )
            return Preview(rows, finished)
        if not plan.fire and plan.next_slot == slot:  # pragma: no cover - never at its due
            break
        slot = plan.next_slot
    excluded = 0
    if rows:
        excluded = excluded_between(schedule, rows[0].slot, rows[-1].slot + timedelta.resolution)
    if slot is None:
        return Preview(rows, _NO_SLOT_LEFT, excluded=excluded)
    return Preview(rows, excluded=excluded)


_NO_SLOT_LEFT = "the schedule has no slot left"


def instant_text(value: datetime, *, date: bool = True) -> str:
    """An instant as the preview shows it, in its own zone: ``2026-03-28 01:30:00``, with the
    fraction of a second where it has one (``01:30:00.25``, ``01:30:02.829268``); the time
    only without ``date``."""
    text = f"{value:%Y-%m-%d %H:%M:%S}" if date else f"{value:%H:%M:%S}"
    if value.microsecond:
        text += f".{value.microsecond:06d}".rstrip("0")
    return text


def offset_text(value: timedelta | None) -> str:
    """A UTC offset as people read it: ``+01:00``, ``-03:30``."""
    minutes = int((value or timedelta(0)).total_seconds()) // 60
    sign = "-" if minutes < 0 else "+"
    return f"{sign}{abs(minutes) // 60:02d}:{abs(minutes) % 60:02d}"
