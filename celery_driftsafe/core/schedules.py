"""Slot arithmetic: the deterministic sequence of UTC instants at which a schedule fires.

A *slot* is an identity, not a moment on some machine's clock: every beat that evaluates the
same schedule computes the same slots, whatever its own clock says. This module is pure. It
reads no clock, does no I/O and imports neither Django nor Redis; time always comes in as an
argument, and every datetime it returns is aware and in UTC.

Three schedules implement :class:`Schedule`:

* :class:`Interval` -- ``anchor + k * every`` for every integer ``k``;
* :class:`Crontab` -- a classic five-field cron expression evaluated in an IANA time zone
  (parsing and evaluation live in :mod:`celery_driftsafe.core.crontab`);
* :class:`OneOff` -- a single instant;
* :class:`Solar` -- sunrise, sunset, dawn, dusk or solar noon at a latitude and longitude
  (astronomy and day-by-day search in :mod:`celery_driftsafe.core.solar`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from typing import Any, Protocol, runtime_checkable

from celery_driftsafe.core.crontab import Crontab
from celery_driftsafe.core.instants import from_us, require_aware, to_us
from celery_driftsafe.core.solar import Solar
from celery_driftsafe.exceptions import ScheduleError

__all__ = [
    "Crontab",
    "Interval",
    "OneOff",
    "Schedule",
    "Solar",
    "shared_crontab",
    "shared_interval",
]


@runtime_checkable
class Schedule(Protocol):
    """The contract every schedule keeps.

    A schedule denotes a *set* of slots: aware UTC instants, strictly increasing when listed.
    Implementations are immutable values, safe to share between threads, and never read a
    clock. Every method accepts aware datetimes in any time zone and raises
    :class:`~celery_driftsafe.exceptions.ScheduleError` (field ``"after"``) for naive ones.

    * ``first_at_or_after(t)`` -- the smallest slot ``s`` with ``s >= t``, or ``None`` if there
      is none (a one-off in the past, or no slot before ``datetime.max``).
    * ``next_after(t)`` -- the smallest slot ``s`` with ``s > t``, or ``None``.
    * ``slots_between(start, end)`` -- every slot ``s`` with ``start <= s < end``, ascending;
      empty when ``end <= start``. Arguments are checked when it is called, not when the
      iterator is first advanced.
    * ``describe()`` -- short plain-English text for people, e.g. ``"every 5 minutes"``.

    Consistency: for every slot ``s`` returned, ``first_at_or_after(s) == s``, and iterating
    ``next_after`` from ``first_at_or_after(start)`` yields exactly ``slots_between``.
    """

    def first_at_or_after(self, instant: datetime) -> datetime | None:
        """Return the smallest slot at or after ``instant``, or ``None``."""
        ...

    def next_after(self, instant: datetime) -> datetime | None:
        """Return the smallest slot strictly after ``instant``, or ``None``."""
        ...

    def slots_between(self, start: datetime, end: datetime) -> Iterator[datetime]:
        """Return the slots ``s`` with ``start <= s < end`` in ascending order."""
        ...

    def describe(self) -> str:
        """Return a short human description of the schedule."""
        ...


_UNITS: tuple[tuple[str, int], ...] = (
    ("day", 86_400_000_000),
    ("hour", 3_600_000_000),
    ("minute", 60_000_000),
)


def _describe_duration(total_us: int) -> str:
    """Render a positive duration as ``"5 minutes"``, ``"1 hour 30 minutes"``, ``"minute"``."""
    parts: list[tuple[int | str, str]] = []
    rest = total_us
    for unit, size in _UNITS:
        count, rest = divmod(rest, size)
        if count:
            parts.append((count, unit))
    if rest:
        seconds = f"{rest / 1_000_000:.6f}".rstrip("0").rstrip(".")
        parts.append((seconds, "second"))
    if len(parts) == 1 and parts[0][0] == 1:
        return parts[0][1]
    return " ".join(
        f"{count} {unit}" if count == 1 else f"{count} {unit}s" for count, unit in parts
    )


@dataclass(frozen=True)
class Interval:
    """Slots ``anchor + k * every`` for every integer ``k``, including negative ``k``.

    Because slots before the anchor exist too, the sequence is the same whatever instant a
    search starts from: two beats that look at different moments agree on every slot. The
    arithmetic is exact, in integer microseconds of real (UTC) time: a daily interval stays 24
    hours apart across DST changes, unlike ``anchor + k * every`` computed on a datetime whose
    tzinfo is a DST zone, which Python does in wall-clock time. ``every`` must be positive (field
    ``"every"``); ``anchor`` must be an aware datetime (field ``"anchor"``).
    """

    every: timedelta
    anchor: datetime
    _every_us: int = field(init=False, repr=False, compare=False)
    _anchor_us: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.every, timedelta):
            raise ScheduleError("every", f"must be a duration, got {type(self.every).__name__}")
        every_us = self.every // timedelta(microseconds=1)
        if every_us <= 0:
            raise ScheduleError("every", f"must be longer than zero, got {self.every}")
        object.__setattr__(self, "_every_us", every_us)
        object.__setattr__(self, "_anchor_us", to_us(require_aware("anchor", self.anchor)))

    @property
    def grid_us(self) -> tuple[int, int]:
        """The anchor and the step in whole microseconds (:func:`~._instants.to_us`): slot
        ``k`` is ``from_us(anchor + k * every)``."""
        return self._anchor_us, self._every_us

    def _slot(self, k: int) -> datetime | None:
        return from_us(self._anchor_us + k * self._every_us)

    def first_at_or_after(self, instant: datetime) -> datetime | None:
        """Return the smallest ``anchor + k * every`` that is ``>= instant``."""
        offset = to_us(require_aware("after", instant)) - self._anchor_us
        return self._slot(-(-offset // self._every_us))

    def next_after(self, instant: datetime) -> datetime | None:
        """Return the smallest ``anchor + k * every`` that is ``> instant``."""
        offset = to_us(require_aware("after", instant)) - self._anchor_us
        return self._slot(offset // self._every_us + 1)

    def slots_between(self, start: datetime, end: datetime) -> Iterator[datetime]:
        """Return the slots ``s`` with ``start <= s < end``, ascending."""
        start_us = to_us(require_aware("after", start))
        end_us = to_us(require_aware("after", end))
        every, anchor = self._every_us, self._anchor_us
        first = anchor + -(-(start_us - anchor) // every) * every
        return _instants(range(first, end_us, every))

    def describe(self) -> str:
        """Return e.g. ``"every 5 minutes"`` or ``"every 1 hour 30 minutes"``."""
        return f"every {_describe_duration(self._every_us)}"


def _instants(values: range) -> Iterator[datetime]:
    for value in values:
        slot = from_us(value)
        if slot is None:
            return
        yield slot


@dataclass(frozen=True)
class OneOff:
    """A single slot at ``at`` (an aware datetime; field ``"at"``)."""

    at: datetime
    _at_utc: datetime = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        at_us = to_us(require_aware("at", self.at))
        at_utc = from_us(at_us)
        if at_utc is None:  # pragma: no cover - only for instants within a day of datetime.max
            raise ScheduleError("at", f"{self.at} is beyond the supported range")
        object.__setattr__(self, "_at_utc", at_utc)

    def first_at_or_after(self, instant: datetime) -> datetime | None:
        """Return ``at`` if ``at >= instant``, else ``None``."""
        return self._at_utc if self._at_utc >= require_aware("after", instant) else None

    def next_after(self, instant: datetime) -> datetime | None:
        """Return ``at`` if ``at > instant``, else ``None``."""
        return self._at_utc if self._at_utc > require_aware("after", instant) else None

    def slots_between(self, start: datetime, end: datetime) -> Iterator[datetime]:
        """Return ``[at]`` if ``start <= at < end``, else nothing."""
        inside = require_aware("after", start) <= self._at_utc < require_aware("after", end)
        return iter([self._at_utc] if inside else [])

    def describe(self) -> str:
        """Return e.g. ``"once at 2024-05-01 12:00 UTC"``."""
        return f"once at {self._at_utc:%Y-%m-%d %H:%M:%S}".removesuffix(":00") + " UTC"


# -------------------------------------------------------------------- shared schedules
# A claim round builds the schedule of every task it plans, and most tasks share a handful of
# expressions: a Crontab costs about 30 µs to build (each field parsed, the day's times
# listed), as much as planning the task. Schedules are immutable values, so equal inputs
# share one instance.

#: Distinct schedules kept by each of the shared constructors below.
SHARED_SCHEDULES = 4096


def shared_crontab(fields: dict[str, Any], timezone: Any) -> Crontab:
    """``Crontab(**fields, timezone=timezone)``, the same instance for equal texts; anything
    but text is built afresh (and refused as the constructor refuses it)."""
    key = (*fields.items(), ("timezone", timezone))
    if all(isinstance(value, str) for _, value in key):
        return _crontab(key)
    return Crontab(**fields, timezone=timezone)


@lru_cache(maxsize=SHARED_SCHEDULES)
def _crontab(key: tuple[tuple[str, str], ...]) -> Crontab:
    return Crontab(**dict(key))


def shared_interval(every: Any, anchor: Any) -> Interval:
    """``Interval(every, anchor)``, the same instance for an equal duration and anchor where
    the anchor is in UTC (as read from the database; in another zone an equal instant may
    still read differently), else built afresh."""
    if isinstance(every, timedelta) and isinstance(anchor, datetime) and anchor.tzinfo is UTC:
        return _interval(every, anchor)
    return Interval(every, anchor)


@lru_cache(maxsize=SHARED_SCHEDULES)
def _interval(every: timedelta, anchor: datetime) -> Interval:
    return Interval(every, anchor)
