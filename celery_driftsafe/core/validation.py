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

What goes *into* a task is checked once more at write time (``save()``, ``full_clean()``, the
admin form, the ``beat_schedule`` sync and ``driftsafe_import``; not by the claim, which reads
shapes only): every value inside ``args``, ``kwargs`` and ``headers`` must be one Celery's
``json`` serializer sends and every supported database stores as it is
(:func:`json_value_problem`: finite numbers, text without NUL or lone surrogates, objects with
text keys, at most :data:`MAX_JSON_DEPTH` levels and :data:`MAX_JSON_CHARS` characters), JSON
text typed or imported is read by :func:`loads_json` (which refuses ``NaN``, ``Infinity``,
too deep or too long text before Python's parser meets it), and the instants a task stores
lie where their slots, jittered and expired, stay in the calendar (:func:`instant_problems`).

This module imports no Django model, so both sides can use it.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from celery_driftsafe.core.headers import reserved
from celery_driftsafe.core.stored_names import MisfirePolicy, OverlapPolicy

#: The publish options a run's message may carry: those the task's own fields give
#: (:func:`celery_driftsafe.claim.outbox.publish_options`). Where the message goes is the task's;
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
#: The deepest a value in ``args``, ``kwargs`` or ``headers`` may nest (the field itself is
#: level 1): far beyond any argument list, far below where Python's and Celery's JSON
#: encoders and decoders run out of stack.
MAX_JSON_DEPTH = 64
#: The longest ``args``, ``kwargs`` or ``headers`` may be, as JSON text (characters): every
#: message of the task carries them.
MAX_JSON_CHARS = 1_000_000
#: The most digits of a whole number in a JSON field: Python's default limit for reading or
#: writing one as text (``sys.get_int_max_str_digits()``), past which Celery's serializer
#: cannot send it.
MAX_INT_DIGITS = 4300
_INT_LIMIT = 10**MAX_INT_DIGITS
#: How far past a stored instant a task's runs may reach: a day of jitter
#: (``bounds.MAX_JITTER_SECONDS``) and a message expiry of up to :data:`MAX_SECONDS`, plus a
#: day for a crontab's time zone.
CALENDAR_MARGIN = timedelta(seconds=MAX_SECONDS + 2 * 86_400)
#: The earliest and latest instant a task may store as ``one_off_at``, ``valid_from`` or
#: ``interval_anchor`` (its slots start there; ``valid_until`` only cuts them off): a slot
#: there, its jittered instant and its message expiry must all be instants Python can hold
#: (years 1 to 9999).
EARLIEST_INSTANT = datetime.min.replace(tzinfo=UTC) + timedelta(days=2)
LATEST_INSTANT = (datetime.max.replace(tzinfo=UTC) - CALENDAR_MARGIN).replace(
    hour=0, minute=0, second=0, microsecond=0
)


@dataclass(frozen=True)
class Problem:
    """A value a task cannot be fired with: the model field at fault and what is wrong."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def coerce_json(value: Any, expected: type) -> Any:
    """``value``, or the decoded value of a JSON string of the ``expected`` type (read by
    :func:`loads_json`: a string too deep or too long to read stays a string, an error)."""
    if isinstance(value, str):
        try:
            decoded = loads_json(value)
        except ValueError:
            return value
        if isinstance(decoded, expected):
            return decoded
    return value


def json_problems(args: Any, kwargs: Any, headers: Any, *, contents: bool = False) -> list[Problem]:
    """Problems of the three JSON fields (already coerced); ``contents``: also of every value
    inside them (:func:`json_value_problem`), as a write checks them."""
    problems = []
    if not isinstance(args, list):
        problems.append(Problem("args", f'must be a JSON list such as [1, "a"], not {shape(args)}'))
    if not isinstance(kwargs, dict):
        problems.append(
            Problem("kwargs", f'must be a JSON object such as {{"a": 1}}, not {shape(kwargs)}')
        )
    problems += header_problems(headers)
    if contents:
        for name, value, kind in (
            ("args", args, list),
            ("kwargs", kwargs, dict),
            ("headers", headers, dict),
        ):
            problem = json_value_problem(value) if isinstance(value, kind) else None
            if problem is not None:
                problems.append(Problem(name, problem))
    return problems


def json_value_problem(value: Any) -> str | None:
    """Why ``value`` cannot be a task's ``args``, ``kwargs`` or ``headers`` (None: it can).

    It must be what Celery's ``json`` serializer sends and every supported database stores
    unchanged: ``None``, booleans, whole numbers of at most :data:`MAX_INT_DIGITS` digits,
    finite floats (JSON has no ``NaN`` or ``Infinity``), text without NUL characters or lone
    surrogates (PostgreSQL stores neither), lists and tuples, and dicts with text keys; at
    most :data:`MAX_JSON_DEPTH` levels deep and :data:`MAX_JSON_CHARS` characters long. The
    walk is iterative, so a value nested a million levels deep is refused, not a
    ``RecursionError``."""
    stack: list[tuple[Any, int, str]] = [(value, 1, "")]
    seen = 0
    while stack:
        item, depth, where = stack.pop()
        seen += 1
        if seen > MAX_JSON_CHARS:  # each value takes a character at least
            return f"holds more than {MAX_JSON_CHARS:,} values"
        if item is None or isinstance(item, bool | str | int | float):
            problem = _scalar_problem(item)
            if problem is not None:
                return problem + _at(where)
            continue
        if depth > MAX_JSON_DEPTH:
            return f"nests deeper than {MAX_JSON_DEPTH} levels{_at(where)}"
        if isinstance(item, list | tuple):
            stack.extend((v, depth + 1, f"{where}[{i}]") for i, v in enumerate(item))
        elif isinstance(item, dict):
            for key, v in item.items():
                if not isinstance(key, str):
                    return (
                        f"has the key {key!r}{_at(where)}: keys must be text (JSON turns others "
                        "into text)"
                    )
                problem = _scalar_problem(key)
                if problem is not None:
                    return f"the key {key[:40]!r}{_at(where)} {problem}"
                stack.append((v, depth + 1, f"{where}[{key[:40]!r}]"))
        else:
            return (
                f"{shape(item)}{_at(where)} is not a JSON value (use lists, objects with text "
                "keys, text, numbers, true/false and null)"
            )
    size = len(json.dumps(value, ensure_ascii=False))
    if size > MAX_JSON_CHARS:
        return f"is {size:,} characters long as JSON, more than {MAX_JSON_CHARS:,}"
    return None


def _at(where: str) -> str:
    """Where in a value a problem is (``[0]['a']``), for its message."""
    if not where:
        return ""
    return f" at {where if len(where) <= 60 else where[:57] + '...'}"


def _scalar_problem(item: Any) -> str | None:
    if isinstance(item, float) and not math.isfinite(item):
        return f"holds {item!r}, which is not a finite number (JSON has no NaN or Infinity)"
    if isinstance(item, int) and not isinstance(item, bool) and not -_INT_LIMIT < item < _INT_LIMIT:
        return f"holds a whole number of more than {MAX_INT_DIGITS:,} digits"
    if isinstance(item, str):
        if "\x00" in item:
            return "holds text with a NUL character (\\u0000), which PostgreSQL cannot store"
        if not item.isascii():
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return "holds text with a lone surrogate, which is not UTF-8"
    return None


#: A JSON string literal (its escapes included): taken out before counting brackets.
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKETS = re.compile(r"[\[\]{}]")


def loads_json(text: str) -> Any:
    """The value of the JSON ``text``, for a task's ``args``, ``kwargs`` or ``headers`` typed
    in a form or imported; raises ``ValueError`` (``json.JSONDecodeError`` for text that is
    not JSON) saying what is wrong.

    Length and nesting are measured on the text before it is parsed, so text too deep for
    Python's parser (a ``RecursionError``) or with a number too long for it is an error
    message, not a crash; ``NaN`` and ``Infinity`` are refused, and so is anything
    :func:`json_value_problem` refuses (``1e999`` reads as an infinite float)."""
    if len(text) > MAX_JSON_CHARS:
        raise ValueError(f"is {len(text):,} characters long, more than {MAX_JSON_CHARS:,}")
    depth = deepest = 0
    for bracket in _BRACKETS.finditer(_JSON_STRING.sub("", text)):
        depth += 1 if bracket.group() in "[{" else -1
        deepest = max(deepest, depth)
    if deepest > MAX_JSON_DEPTH:
        raise ValueError(f"nests {deepest} levels deep, more than {MAX_JSON_DEPTH}")
    value = json.loads(text, parse_constant=_refuse_constant, parse_int=_bounded_int)
    problem = json_value_problem(value)
    if problem is not None:
        raise ValueError(problem)
    return value


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"holds {name}, which is not a finite number (JSON has no NaN or Infinity)")


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"holds a whole number of more than {MAX_INT_DIGITS:,} digits")
    return int(text)


def instant_problems(**instants: Any) -> list[Problem]:
    """Problems of aware instants a task stores (field name -> value; None: not set), each
    outside :data:`EARLIEST_INSTANT` .. :data:`LATEST_INSTANT`."""
    problems = []
    for field, value in instants.items():
        if (
            isinstance(value, datetime)
            and value.utcoffset() is not None
            and not EARLIEST_INSTANT <= value <= LATEST_INSTANT
        ):
            problems.append(
                Problem(
                    field,
                    f"must be from {EARLIEST_INSTANT.date()} to {LATEST_INSTANT.date()} (UTC), "
                    f"not {value.isoformat()}: a slot there, moved by its jitter and "
                    "its message expiry (up to a hundred years), must stay in the calendar",
                )
            )
    return problems


def header_problems(value: Any) -> list[Problem]:
    """Problems of a task's custom ``headers``: a JSON object that sets no reserved header
    (:func:`celery_driftsafe.core.headers.reserved`)."""
    if not isinstance(value, dict):
        return [Problem("headers", f"must be a JSON object, not {shape(value)}")]
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
        return [*problems, Problem("options", f"must be a JSON object, not {shape(options)}")]
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
            problems.append(Problem(name, f"must be a name, not {shape(value)}"))
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


def deadline_problems(deadline_seconds: Any) -> list[Problem]:
    """Problems of a task's deadline: empty (none) or a positive number of seconds."""
    if deadline_seconds is None or _positive_seconds(deadline_seconds):
        return []
    return [
        Problem(
            "deadline_seconds",
            f"must be a positive number of seconds up to {MAX_SECONDS:.0f} (a hundred years; "
            f"empty: no deadline), not {deadline_seconds!r}",
        )
    ]


def pause_problems(pause_after_failures: Any) -> list[Problem]:
    """Problems of a task's ``pause_after_failures``: empty or 0 (never pause), or a whole
    number of failures in a row."""
    value = pause_after_failures
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return []
    return [
        Problem(
            "pause_after_failures",
            "must be a whole number of failed or missed runs in a row, 1 or more "
            f"(empty or 0: never pause), not {value!r}",
        )
    ]


def seconds_in_calendar(value: Any) -> bool:
    """Seconds an instant can be moved by: a finite number up to :data:`MAX_SECONDS`."""
    return _number(value) and math.isfinite(value) and abs(value) <= MAX_SECONDS


def _positive_seconds(value: Any) -> bool:
    return seconds_in_calendar(value) and value > 0


def _non_negative_seconds(value: Any) -> bool:
    return seconds_in_calendar(value) and value >= 0


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def shape(value: Any) -> str:
    """``value`` shown in an error: its type and a short repr."""
    if isinstance(value, str):
        shown = value if len(value) <= 40 else value[:37] + "..."
        return f"the string {shown!r}"
    return f"{type(value).__name__} {value!r}"[:80]
