"""What a stored :class:`~celery_driftsafe.models.PeriodicTask` may hold.

Anything can end up in a row: the admin validates, but the ORM, raw SQL, fixtures and data
migrations do not. The same rules are applied in two places:

* at write time, by ``PeriodicTask.save()`` (and the admin form), which refuses a bad value
  with a :class:`~django.core.exceptions.ValidationError` on the field at fault;
* at claim time, by the scheduler, which disables just that task with a reason naming the
  field and goes on firing every other task.

One coercion is made, because it is unambiguous and a common habit from django-celery-beat:
``args``, ``kwargs`` or ``headers`` stored as a JSON *string* (``json.dumps([1, 2])``) whose
decoded value has the right shape are read as that value. A string that does not decode to
the right shape is an error, never "one argument per character".

This module imports no Django model, so both sides can use it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from celery_driftsafe import headers
from celery_driftsafe.names import MisfirePolicy, OverlapPolicy

#: Header names Celery's task protocol (version 2) sets itself, plus those of this package.
#: A task's own ``headers`` must not override them: ``id`` or ``task`` would make the worker
#: run something else than the run that was claimed.
RESERVED_HEADERS = frozenset(
    {
        "lang",
        "task",
        "id",
        "shadow",
        "eta",
        "expires",
        "group",
        "group_index",
        "retries",
        "timelimit",
        "root_id",
        "parent_id",
        "argsrepr",
        "kwargsrepr",
        "origin",
        "ignore_result",
        "replaced_task_nesting",
        "stamped_headers",
        "stamps",
        "chord",
        "callbacks",
        "errbacks",
        "chain",
        "reply_to",
        "correlation_id",
        "delivery_info",
        *headers.ALL,
    }
)

MISFIRE_POLICIES = ("", *MisfirePolicy)
OVERLAP_POLICIES = tuple(OverlapPolicy)
#: AMQP priorities are 0-255 (Redis transport: 0-9, higher values are clamped by kombu).
MAX_PRIORITY = 255
#: The longest duration a task or a setting may give in seconds (a hundred years): a slot
#: moved by more would leave the calendar (``OverflowError``), and one task's expiry doing so
#: would fail every claim round.
MAX_SECONDS = 100 * 365.25 * 86400


@dataclass(frozen=True)
class Problem:
    """A value a task cannot be fired with: the model field at fault and what is wrong."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def coerce_json(value: Any, expected: type) -> Any:
    """``value``, or the decoded value of a JSON string of the ``expected`` type."""
    if isinstance(value, str):
        try:
            decoded = json.loads(value)
        except ValueError:
            return value
        if isinstance(decoded, expected):
            return decoded
    return value


def json_problems(args: Any, kwargs: Any, headers: Any) -> list[Problem]:
    """Problems of the three JSON fields (already coerced)."""
    problems = []
    if not isinstance(args, list):
        problems.append(
            Problem("args", f'must be a JSON list such as [1, "a"], not {_shape(args)}')
        )
    if not isinstance(kwargs, dict):
        problems.append(
            Problem("kwargs", f'must be a JSON object such as {{"a": 1}}, not {_shape(kwargs)}')
        )
    if not isinstance(headers, dict):
        problems.append(Problem("headers", f"must be a JSON object, not {_shape(headers)}"))
    else:
        reserved = sorted(set(headers) & RESERVED_HEADERS)
        if reserved:
            problems.append(
                Problem(
                    "headers",
                    f"must not set {', '.join(reserved)}: Celery or celery_driftsafe "
                    "sets these headers themselves",
                )
            )
    return problems


def option_problems(
    *,
    task: Any,
    priority: Any,
    expires_seconds: Any,
    misfire_grace_seconds: Any,
    misfire_policy: Any,
    overlap_policy: Any,
) -> list[Problem]:
    """Problems of the task name, publish options and policies."""
    problems = []
    if not isinstance(task, str) or not task.strip():
        problems.append(Problem("task", "needs the registered Celery task name"))
    if priority is not None and (
        not isinstance(priority, int)
        or isinstance(priority, bool)
        or not 0 <= priority <= MAX_PRIORITY
    ):
        problems.append(
            Problem(
                "priority", f"must be a whole number from 0 to {MAX_PRIORITY}, not {priority!r}"
            )
        )
    if expires_seconds is not None and not _positive_seconds(expires_seconds):
        problems.append(
            Problem(
                "expires_seconds",
                f"must be a positive number of seconds up to {MAX_SECONDS:.0f} (a hundred "
                f"years; empty: RUN_EXPIRES_SECONDS), not {expires_seconds!r}",
            )
        )
    if misfire_grace_seconds is not None and not _non_negative_seconds(misfire_grace_seconds):
        problems.append(
            Problem(
                "misfire_grace_seconds",
                f"must be zero or a positive number of seconds up to {MAX_SECONDS:.0f} (a "
                f"hundred years), not {misfire_grace_seconds!r}",
            )
        )
    if misfire_policy not in MISFIRE_POLICIES:
        problems.append(
            Problem(
                "misfire_policy",
                f"unknown policy {misfire_policy!r}; use one "
                f"of {', '.join(p for p in MISFIRE_POLICIES if p)}",
            )
        )
    if overlap_policy not in OVERLAP_POLICIES:
        problems.append(
            Problem(
                "overlap_policy",
                f"unknown policy {overlap_policy!r}; use one of {', '.join(OVERLAP_POLICIES)}",
            )
        )
    return problems


def seconds_in_calendar(value: Any) -> bool:
    """Seconds an instant can be moved by: a finite number up to :data:`MAX_SECONDS`."""
    return _number(value) and math.isfinite(value) and abs(value) <= MAX_SECONDS


def _positive_seconds(value: Any) -> bool:
    return seconds_in_calendar(value) and value > 0


def _non_negative_seconds(value: Any) -> bool:
    return seconds_in_calendar(value) and value >= 0


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _shape(value: Any) -> str:
    if isinstance(value, str):
        shown = value if len(value) <= 40 else value[:37] + "..."
        return f"the string {shown!r}"
    return f"{type(value).__name__} {value!r}"[:80]
