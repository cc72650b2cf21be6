"""Bounds and run limits of a periodic task, as pure functions the claim applies.

* **valid from / valid until**: :func:`bounded` wraps any schedule so that its slots are only
  those ``s`` with ``valid_from <= s < valid_until``. Everything that computes slots — the first
  slot of a new or edited task, the claim, the misfire catch-up — sees the bounded schedule, so a
  slot before ``valid_from`` never exists, and nothing at or after ``valid_until`` does either.
* **run once / max runs**: :func:`run_budget` says how many more runs a task may fire, and
  :func:`~celery_driftsafe.core.misfire.limit_plan` cuts a claim plan to that many (the
  earliest slots) and says whether the task is then used up — the claim disables it in the
  same transaction, with the reason.

Pure: no clock, no Django.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from celery_driftsafe.core.instants import require_aware
from celery_driftsafe.core.jitter import due_instant
from celery_driftsafe.core.schedules import Schedule
from celery_driftsafe.core.validation import Problem


@dataclass(frozen=True)
class Bounded:
    """The slots of ``schedule`` in ``[valid_from, valid_until)`` (either bound optional)."""

    schedule: Schedule
    valid_from: datetime | None = None
    valid_until: datetime | None = None

    def _inside(self, slot: datetime | None) -> datetime | None:
        if slot is None or (self.valid_until is not None and slot >= self.valid_until):
            return None
        return slot

    def first_at_or_after(self, instant: datetime) -> datetime | None:
        require_aware("after", instant)
        if self.valid_from is not None and instant < self.valid_from:
            instant = self.valid_from
        return self._inside(self.schedule.first_at_or_after(instant))

    def next_after(self, instant: datetime) -> datetime | None:
        require_aware("after", instant)
        if self.valid_from is not None and instant < self.valid_from:
            return self._inside(self.schedule.first_at_or_after(self.valid_from))
        return self._inside(self.schedule.next_after(instant))

    def slots_between(self, start: datetime, end: datetime) -> Iterator[datetime]:
        require_aware("after", start)
        require_aware("after", end)
        if self.valid_from is not None and start < self.valid_from:
            start = self.valid_from
        if self.valid_until is not None and end > self.valid_until:
            end = self.valid_until
        if end <= start:
            return iter(())
        return self.schedule.slots_between(start, end)

    def describe(self) -> str:
        text = self.schedule.describe()
        if self.valid_from is not None:
            text += f", from {self.valid_from:%Y-%m-%d %H:%M:%S} UTC"
        if self.valid_until is not None:
            text += f", until {self.valid_until:%Y-%m-%d %H:%M:%S} UTC"
        return text


def bounded(
    schedule: Schedule, valid_from: datetime | None, valid_until: datetime | None
) -> Schedule:
    """``schedule`` within the bounds; the schedule itself when there are none."""
    if valid_from is None and valid_until is None:
        return schedule
    return Bounded(schedule, valid_from, valid_until)


def run_budget(*, run_once: bool, max_runs: int | None, run_count: int) -> int | None:
    """How many more runs the task may fire: None for no limit."""
    budget = None if max_runs is None else max(max_runs - run_count, 0)
    if run_once:
        budget = 1 if budget is None else min(budget, 1)
    return budget


@dataclass(frozen=True)
class Limits:
    """What bounds a task's claim beyond its schedule: its name (the jitter's identity), the
    jitter, the bounds and the run limits."""

    identity: str
    jitter_seconds: float | None = None
    valid_from: datetime | None = None
    valid_until: datetime | None = None
    run_once: bool = False
    max_runs: int | None = None
    run_count: int = 0


def message_expiry(
    slot: datetime, limits: Limits, expires_seconds: float | None
) -> datetime | None:
    """When a run's message expires: ``expires_seconds`` after the slot's jittered instant,
    and at the latest at ``valid_until``."""
    expires = None
    if expires_seconds is not None:
        due = due_instant(limits.identity, slot, limits.jitter_seconds)
        expires = due + timedelta(seconds=expires_seconds)
    if limits.valid_until is not None and (expires is None or expires > limits.valid_until):
        expires = limits.valid_until
    return expires


def bound_problems(
    *, valid_from: Any, valid_until: Any, max_runs: Any, jitter_seconds: Any
) -> list[Problem]:
    """Problems of the bounds, the run limit and the jitter, each on its field."""
    problems = []
    if (
        isinstance(valid_from, datetime)
        and isinstance(valid_until, datetime)
        and valid_from.utcoffset() is not None
        and valid_until.utcoffset() is not None
        and valid_until <= valid_from
    ):
        problems.append(
            Problem(
                "valid_until",
                f"must be after valid from ({valid_from.isoformat()}): no slot could fire",
            )
        )
    if max_runs is not None and (
        not isinstance(max_runs, int) or isinstance(max_runs, bool) or max_runs < 1
    ):
        problems.append(
            Problem(
                "max_runs",
                f"must be a whole number of 1 or more (empty: no limit), not {max_runs!r}",
            )
        )
    if jitter_seconds is not None and (
        not isinstance(jitter_seconds, int | float)
        or isinstance(jitter_seconds, bool)
        or not math.isfinite(jitter_seconds)
        or jitter_seconds < 0
        or jitter_seconds > MAX_JITTER_SECONDS
    ):
        problems.append(
            Problem(
                "jitter_seconds",
                f"must be a number of seconds from 0 to {MAX_JITTER_SECONDS:g}, not "
                f"{jitter_seconds!r}",
            )
        )
    return problems


#: The largest jitter accepted (a day): a spread is meant to be a fraction of the period.
MAX_JITTER_SECONDS = 86_400.0
