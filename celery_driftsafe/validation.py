"""What a stored :class:`~celery_driftsafe.models.PeriodicTask` may hold.

Anything can end up in a row: the admin validates, but the ORM, raw SQL, fixtures and data
migrations do not. The same rules are applied wherever a row is written or published:

* at write time, by ``PeriodicTask.save()`` (and the admin form), which refuses a bad value
  with a :class:`~django.core.exceptions.ValidationError` on the field at fault;
* before anything is published from a row, by one gate
  (:meth:`~celery_driftsafe.models.PeriodicTask.publish_problems`): the claim disables just
  that task with a reason naming the field and goes on firing every other task, run now
  refuses it with that reason and writes nothing;
* when a run's captured message is published (:func:`message_problems`), since the run row
  can be rewritten as well: the run is recorded failed with the reason.

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

from celery_driftsafe.headers import reserved
from celery_driftsafe.names import MisfirePolicy, OverlapPolicy

#: The publish options a run's message may carry: those the task's own fields give
#: (:func:`celery_driftsafe.dispatch.publish_options`). Where the message goes is the task's;
#: everything else is the publisher's or the ledger's, so an option outside these in a stored
#: message is refused, never passed to Celery (see docs/reference/headers.md): ``task_id``,
#: ``shadow``, ``link``, ``chain``, ``root_id``… would run another task or the run under
#: another id than the ledger's; ``countdown``, ``eta``, ``expires``, the time limits and
#: ``ignore_result`` would change its timing or outcome behind the ledger; ``serializer``,
#: ``compression`` and the content type would make the message undecodable or pick a
#: serializer the workers refuse (pickle).
PUBLISH_OPTIONS = frozenset({"queue", "exchange", "routing_key", "priority", "headers"})
#: Of those, the ones that hold a name.
_NAME_OPTIONS = ("queue", "exchange", "routing_key")

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
    problems += header_problems(headers)
    return problems


def header_problems(value: Any) -> list[Problem]:
    """Problems of a task's custom ``headers``: a JSON object that sets no reserved header
    (:func:`celery_driftsafe.headers.reserved`)."""
    if not isinstance(value, dict):
        return [Problem("headers", f"must be a JSON object, not {_shape(value)}")]
    names = [name for name in value if not isinstance(name, str) or reserved(name)]
    if not names:
        return []
    names = sorted(map(str, names))
    return [
        Problem(
            "headers",
            f"must not set {', '.join(names)}: Celery, kombu or celery_driftsafe set or read "
            "these headers themselves (see the reserved headers in docs/reference/headers.md)",
        )
    ]


def message_problems(args: Any, kwargs: Any, options: Any) -> list[Problem]:
    """Problems of a run's captured message (``Run.message``, stored at its claim and
    published from there): the checks the task's row passed then, applied again to what is
    about to be published, because that row can be rewritten too. (Run for every message a
    beat publishes: the common case costs a few type checks.)"""
    problems = []
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        problems += json_problems(args, kwargs, {})
    if not isinstance(options, dict):
        return [*problems, Problem("options", f"must be a JSON object, not {_shape(options)}")]
    if not PUBLISH_OPTIONS.issuperset(options):
        unknown = sorted(set(options) - PUBLISH_OPTIONS)
        problems.append(
            Problem(
                "options",
                f"{', '.join(unknown)}: a run is published with "
                f"{', '.join(sorted(PUBLISH_OPTIONS))} only",
            )
        )
    for name in _NAME_OPTIONS:
        value = options.get(name)
        if value is not None and not isinstance(value, str):
            problems.append(Problem(name, f"must be a name, not {_shape(value)}"))
    priority = options.get("priority")
    if priority is not None:
        problems += priority_problems(priority)
    headers = options.get("headers")
    if headers is not None:
        problems += header_problems(headers)
    return problems


def priority_problems(priority: Any) -> list[Problem]:
    """Problems of a message priority: none, or a whole number from 0 to ``MAX_PRIORITY``."""
    if priority is None or (
        isinstance(priority, int)
        and not isinstance(priority, bool)
        and 0 <= priority <= MAX_PRIORITY
    ):
        return []
    return [
        Problem("priority", f"must be a whole number from 0 to {MAX_PRIORITY}, not {priority!r}")
    ]


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
    problems += priority_problems(priority)
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
