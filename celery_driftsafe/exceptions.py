"""The exception hierarchy: everything celery_driftsafe raises on purpose derives from
:class:`DriftSafeError`.

This module imports nothing from Django, so the pure core (slot arithmetic, misfire policies)
stays free of it. :class:`ConfigurationError` is also Django's ``ImproperlyConfigured``, so it
is made on first use (importing ``django.core.exceptions`` then), still here.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any


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


class BrokerUnavailable(DriftSafeError):
    """A beat's publish found the broker out of reach: claiming pauses until it answers, so
    that the slots due meanwhile meet the misfire policy rather than pile up claimed."""


class LockError(DriftSafeError):
    """A lock could not be taken in time, or its backend (Redis, the database) could not be
    reached, so the outcome of an operation is unknown."""


class LockLost(LockError):
    """A lock this process held is no longer held: its lease ran out or someone took it over.
    Work done under it must not be committed without checking its fencing token."""


class BadRunHeaders(DriftSafeError):
    """A message's driftsafe headers are malformed or do not match its run."""


class TaskRefused(DriftSafeError):
    """A periodic task's row holds something it cannot be published with (the claim would
    disable it): run now refuses it and writes nothing. ``problems`` names each field at
    fault and what is wrong with it."""

    def __init__(self, name: str, problems: list[Any]) -> None:
        self.name = name
        self.problems = problems
        super().__init__(f"{name} cannot be published: " + "; ".join(map(str, problems)))


class LedgerUnavailable(DriftSafeError):
    """The database could not be reached before the body ran: the delivery is re-sent."""


class TaskModulesError(DriftSafeError):
    """The Celery app's task modules could not be imported, as a worker imports them at its
    start: ``module`` names the one that failed (empty when it cannot be told), ``__cause__``
    is what it raised."""

    def __init__(self, module: str, cause: BaseException) -> None:
        self.module = module
        where = f"the task module {module}" if module else "the Celery app's task modules"
        super().__init__(f"importing {where} failed: {type(cause).__name__}: {cause}")


_CONFIGURATION_ERROR_DOC = (
    "A setting has a value that cannot work. The message names the setting and the fix."
)


def _configuration_error_init(
    self: Any, setting: str, value: object, problem: str, hint: str = ""
) -> None:
    self.setting = setting
    self.value = value
    self.problem = problem
    self.hint = hint
    message = f"DRIFTSAFE[{setting!r}] = {value!r}: {problem}"
    if hint:
        message += f" ({hint})"
    Exception.__init__(self, message)


if TYPE_CHECKING:
    from django.core.exceptions import ImproperlyConfigured

    class ConfigurationError(DriftSafeError, ImproperlyConfigured):
        """A setting has a value that cannot work. The message names the setting and the fix."""

        setting: str
        value: object
        problem: str
        hint: str

        def __init__(self, setting: str, value: object, problem: str, hint: str = "") -> None: ...

else:

    @functools.cache
    def _configuration_error() -> type:
        from django.core.exceptions import ImproperlyConfigured

        made = type(
            "ConfigurationError",
            (DriftSafeError, ImproperlyConfigured),
            {
                "__init__": _configuration_error_init,
                "__doc__": _CONFIGURATION_ERROR_DOC,
                "__module__": __name__,
            },
        )
        globals()["ConfigurationError"] = made
        return made

    def __getattr__(name: str) -> Any:
        if name == "ConfigurationError":
            return _configuration_error()
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class BackfillRefused(DriftSafeError, ValueError):
    """A backfill cannot run as asked (an empty or reversed range, more slots than
    ``BACKFILL_MAX_SLOTS``): nothing was written or published. The message says what to do."""
