"""Instants as whole microseconds, shared by the pure schedules
(:mod:`celery_driftsafe.core.schedules`,
:mod:`celery_driftsafe.core.crontab`, :mod:`celery_driftsafe.core.solar`): integer arithmetic never
rounds, so a slot computed on one beat is the same instant on every other.

Standard library only; no clock."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from celery_driftsafe.exceptions import ScheduleError

US = timedelta(microseconds=1)


EPOCH = datetime(1, 1, 1, tzinfo=UTC)


DAY_US = 86_400_000_000


SECOND_US = 1_000_000


def require_aware(name: str, value: object) -> datetime:
    """Return ``value`` if it is an aware datetime, else raise ``ScheduleError(name, ...)``."""
    if not isinstance(value, datetime):
        raise ScheduleError(name, f"must be a datetime, got {type(value).__name__}")
    if value.utcoffset() is None:
        raise ScheduleError(name, f"must be time-zone aware, got naive {value.isoformat()}")
    return value


def to_us(instant: datetime) -> int:
    """Microseconds from 0001-01-01T00:00Z to the aware ``instant``."""
    return (instant - EPOCH) // US


def from_us(value: int) -> datetime | None:
    """The aware UTC datetime ``value`` microseconds after 0001-01-01T00:00Z, or ``None``."""
    try:
        return EPOCH + timedelta(microseconds=value)
    except OverflowError:
        return None
