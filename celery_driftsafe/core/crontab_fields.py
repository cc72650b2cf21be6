"""Parsing a crontab's fields (numbers, names, ranges, steps, lists, ``@`` macros) and its
time zone, for :class:`celery_driftsafe.core.crontab.Crontab`. Pure: standard library only."""

from __future__ import annotations

from functools import lru_cache
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from celery_driftsafe.core.instants import SECOND_US
from celery_driftsafe.exceptions import ScheduleError

MONTH_NAMES = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")


DAY_NAMES = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")


BOUNDS: dict[str, tuple[int, int, dict[str, int]]] = {
    "second": (0, 59, {}),
    "minute": (0, 59, {}),
    "hour": (0, 23, {}),
    "day_of_month": (1, 31, {}),
    "month_of_year": (1, 12, {name: i for i, name in enumerate(MONTH_NAMES, 1)}),
    "day_of_week": (0, 7, {name: i for i, name in enumerate(DAY_NAMES)}),
}


MACROS = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}


LONGEST_MONTH = (0, 31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)


#: Digits past which a number in a crontab field is read as "too large": every bound is
#: below 100, and Python refuses to read a number of more than 4,300 digits.
_MAX_DIGITS = 9


def _whole(digits: str) -> int:
    """A number of ASCII digits; one too long to matter reads as 10**_MAX_DIGITS (out of
    every range, a step past every field)."""
    return int(digits) if len(digits) <= _MAX_DIGITS else 10**_MAX_DIGITS


def _parse_value(name: str, text: str, source: str) -> int:
    low, high, names = BOUNDS[name]
    if text.isascii() and text.isdigit():
        value = _whole(text)
    elif text.lower() in names:
        return names[text.lower()]
    elif not text:
        raise ScheduleError(name, f"a number is missing in {source!r}")
    else:
        kind = "a number" if not names else f"a number or a name like {next(iter(names))!r}"
        raise ScheduleError(name, f"{text!r} is not {kind} in {source!r}")
    if not low <= value <= high:
        shown = text if len(text) <= _MAX_DIGITS else text[:_MAX_DIGITS] + "..."
        raise ScheduleError(name, f"{shown} is out of range {low}-{high} in {source!r}")
    return value


def _parse_item(name: str, item: str, source: str) -> range:
    low, high, _ = BOUNDS[name]
    base, slash, step_text = item.partition("/")
    step = 1
    if slash:
        if not (step_text.isascii() and step_text.isdigit()):
            raise ScheduleError(name, f"step {step_text!r} is not a number in {source!r}")
        step = _whole(step_text)
        if step == 0:
            raise ScheduleError(name, f"step 0 is not allowed in {source!r}")
    # Open-ended forms stop at Saturday: 7 is Sunday only when written out.
    top = 6 if name == "day_of_week" else high
    if base == "*":
        return range(low, top + 1, step)
    first_text, dash, last_text = base.partition("-")
    first = _parse_value(name, first_text, source)
    if not dash:
        return range(first, (top if slash else first) + 1, step)
    last = _parse_value(name, last_text, source)
    if first > last:
        hint = " (Sunday is also 7: write 'fri-7')" if name == "day_of_week" else ""
        raise ScheduleError(
            name, f"range {first_text}-{last_text} runs backwards in {source!r}{hint}"
        )
    return range(first, last + 1, step)


def parse_field(name: str, source: object) -> tuple[int, ...]:
    """Parse one cron field into the sorted tuple of values it allows."""
    if not isinstance(source, str):
        raise ScheduleError(name, f"must be text, got {type(source).__name__}")
    text = source.strip()
    if not text:
        raise ScheduleError(name, "is empty; write '*' to allow every value")
    if any(char.isspace() for char in text):
        raise ScheduleError(name, f"must not contain spaces: {source!r}")
    values: set[int] = set()
    for item in text.split(","):
        if not item:
            raise ScheduleError(name, f"has an empty list item in {source!r}")
        values.update(_parse_item(name, item, text))
    if name == "day_of_week" and 7 in values:
        values.discard(7)
        values.add(0)
    return tuple(sorted(values))


def load_zone(key: object) -> ZoneInfo:
    if not isinstance(key, str):
        raise ScheduleError("timezone", f"must be text, got {type(key).__name__}")
    if not key:
        raise ScheduleError("timezone", "is empty; write an IANA name such as 'UTC'")
    try:
        return ZoneInfo(key)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise ScheduleError(
            "timezone", f"unknown time zone {key!r}; use an IANA name such as 'Europe/Berlin'"
        ) from None


def bit_mask(values: tuple[int, ...]) -> int:
    return sum(1 << value for value in values)


def field_runs(values: tuple[int, ...], names: tuple[str, ...], first: int) -> str:
    """Render ``(1, 2, 3, 5)`` as ``"Mon-Wed, Fri"`` using ``names`` (index ``value - first``)."""
    parts: list[str] = []
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        low, high = names[values[i] - first].title(), names[values[j] - first].title()
        parts.append(low if i == j else f"{low}-{high}" if j > i + 1 else f"{low}, {high}")
        i = j + 1
    return ", ".join(parts)


@lru_cache(maxsize=256)
def times_of_day(
    hours: tuple[int, ...], minutes: tuple[int, ...], seconds: tuple[int, ...]
) -> tuple[int, ...]:
    """The sorted wall times (microseconds after midnight) the three fields allow; shared
    between Crontabs (every second of a day is 86,400 of them)."""
    return tuple(
        (hour * 3600 + minute * 60 + second) * SECOND_US
        for hour in hours
        for minute in minutes
        for second in seconds
    )
