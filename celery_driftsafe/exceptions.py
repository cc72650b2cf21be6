"""The exception hierarchy: everything celery_driftsafe raises on purpose derives from
:class:`DriftSafeError`."""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured


class DriftSafeError(Exception):
    """Base class of every error celery_driftsafe raises on purpose."""


class ConfigurationError(DriftSafeError, ImproperlyConfigured):
    """A setting has a value that cannot work. The message names the setting and the fix."""

    def __init__(self, setting: str, value: object, problem: str, hint: str = "") -> None:
        self.setting = setting
        self.value = value
        self.problem = problem
        self.hint = hint
        message = f"DRIFTSAFE[{setting!r}] = {value!r}: {problem}"
        if hint:
            message += f" ({hint})"
        super().__init__(message)


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
