"""The exception hierarchy: everything celery_driftsafe raises on purpose derives from
:class:`DriftSafeError`.

This module imports nothing from Django, so the pure core (slot arithmetic, misfire policies)
stays free of it. :class:`ConfigurationError` is also Django's ``ImproperlyConfigured``; it is
defined in :mod:`celery_driftsafe.conf` and importable from here too.
"""

from __future__ import annotations

from typing import Any


class DriftSafeError(Exception):
    """Base class of every error celery_driftsafe raises on purpose."""


class ScheduleError(DriftSafeError, ValueError):
    """A schedule cannot be evaluated: bad crontab field, unknown zone, non-positive interval.

    ``field`` names the schedule field at fault (for example ``"minute"`` or ``"timezone"``),
    so forms can attach the message to the right input.
    """

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


class ClockError(DriftSafeError):
    """The time authority could not be read, or answered something absurd."""


class LockError(DriftSafeError):
    """A lock could not be taken in time, or its backend (Redis, the database) could not be
    reached, so the outcome of an operation is unknown."""


class LockLost(LockError):
    """A lock this process held is no longer held: its lease ran out or someone took it over.
    Work done under it must not be committed without checking its fencing token."""


def __getattr__(name: str) -> Any:
    if name == "ConfigurationError":
        from celery_driftsafe.conf import ConfigurationError

        return ConfigurationError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
