"""Excluded dates and times: a wrapper schedule whose slots are the inner schedule's slots
minus those that fall on an excluded date or at an excluded wall time.

A slot ``s`` of the inner schedule is *excluded* when, read in the task's time zone
(``zone``), either

* its local date is one of ``dates``, or
* its local wall time matches one of ``crontabs``: every field matches, the day fields with
  the Vixie OR rule, the time fields to the *minute* when the crontab's second field is ``0``
  (a five-field expression: ``* * * * sat,sun`` excludes every slot of a weekend, whatever
  its seconds), else to the *second* (``*/3 * * * * *`` excludes every slot whose second is a
  multiple of 3).

Matching is by the wall time the slot reads, so DST needs no rule of its own: a repeated hour
is excluded twice when its wall times match, a skipped hour has nothing to exclude.

An excluded slot is not a slot: :class:`Excluding` never returns it, does not count it, and
the misfire planner therefore neither fires it nor records it missed. A search gives up after
:data:`MAX_CONSECUTIVE_EXCLUSIONS` excluded stretches in a row (an excluded date, or a run of
matching wall times, is one stretch): a schedule whose every slot is excluded then has no next
slot, instead of spinning to the year 9999.

Pure: no clock, no Django.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta
from functools import lru_cache
from typing import Any, cast
from zoneinfo import ZoneInfo

from celery_driftsafe.core.crontab import Crontab, _day_segments
from celery_driftsafe.core.crontab_fields import load_zone
from celery_driftsafe.core.instants import DAY_US, US, from_us, require_aware, to_us
from celery_driftsafe.core.schedules import Interval, Schedule
from celery_driftsafe.core.validation import Problem
from celery_driftsafe.exceptions import ScheduleError

#: Excluded stretches a search steps over in a row before it concludes that the schedule has no
#: slot left that is not excluded.
MAX_CONSECUTIVE_EXCLUSIONS = 50_000

_Stretches = tuple[tuple[int, int], ...]
_WHOLE_DAY: _Stretches = ((0, DAY_US),)


@dataclass(frozen=True)
class Excluding:
    """The slots of ``schedule`` that are not excluded (see the module docstring).

    ``dates``: local dates excluded whole; ``crontabs``: wall times excluded (their own time
    zone is not used: every slot is read in ``zone``, an IANA name)."""

    schedule: Schedule
    dates: frozenset[date] = frozenset()
    zone: str = "UTC"
    crontabs: tuple[Crontab, ...] = ()
    _tz: ZoneInfo = field(init=False, repr=False, compare=False)
    _ordinals: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_tz", load_zone(self.zone))
        object.__setattr__(self, "_ordinals", tuple(sorted(d.toordinal() - 1 for d in self.dates)))

    # ------------------------------------------------------------------ what is excluded

    def _day_stretches(self, day: int) -> _Stretches:
        """The wall times excluded on local date index ``day``, merged."""
        i = bisect_left(self._ordinals, day)
        if i < len(self._ordinals) and self._ordinals[i] == day:
            return _WHOLE_DAY
        return _crontab_day(self.crontabs, day) if self.crontabs else ()

    def _excluded_until(self, instant_us: int) -> int | None:
        """None when ``instant_us`` is not excluded; else the instant (microseconds, after
        it) up to which every instant is excluded: the end of its excluded stretch within its
        stretch of constant UTC offset."""
        instant = from_us(instant_us)
        if instant is None:  # pragma: no cover - the inner schedule never returns such a slot
            return None
        local = instant.astimezone(self._tz)
        day = local.toordinal() - 1
        stretches = self._day_stretches(day)
        if not stretches:
            return None
        midnight = day * DAY_US
        reading = local.utcoffset()
        assert reading is not None
        for wall_start, wall_end, offset, _ in _day_segments(self._tz, day):
            wall = instant_us + offset - midnight
            if offset != reading // US or not wall_start <= wall < wall_end:
                continue
            i = bisect_right(stretches, (wall, DAY_US + 1)) - 1
            if i < 0 or wall >= stretches[i][1]:
                return None
            return midnight + min(stretches[i][1], wall_end) - offset
        raise AssertionError(f"no stretch of local day {day} holds {instant}")  # pragma: no cover

    def excludes(self, slot: datetime) -> bool:
        """Whether ``slot`` (any instant) is excluded."""
        return self._excluded_until(to_us(require_aware("after", slot))) is not None

    # ------------------------------------------------------------------ the Schedule protocol

    def first_at_or_after(self, instant: datetime) -> datetime | None:
        """The first slot of the inner schedule at or after ``instant`` that is not excluded."""
        candidate = self.schedule.first_at_or_after(require_aware("after", instant))
        skipped = 0
        while candidate is not None:
            until = self._excluded_until(to_us(candidate))
            if until is None:
                return candidate
            skipped += 1
            if skipped > MAX_CONSECUTIVE_EXCLUSIONS:
                return None
            after = from_us(until)
            if after is None:  # pragma: no cover - an exclusion reaching datetime.max
                return None
            candidate = self.schedule.first_at_or_after(after)
        return None

    def next_after(self, instant: datetime) -> datetime | None:
        """The first slot strictly after ``instant`` that is not excluded."""
        candidate = self.schedule.next_after(require_aware("after", instant))
        return None if candidate is None else self.first_at_or_after(candidate)

    def slots_between(self, start: datetime, end: datetime) -> Iterator[datetime]:
        """The slots ``s`` with ``start <= s < end`` that are not excluded, ascending."""
        require_aware("after", end)
        return self._iterate(self.first_at_or_after(require_aware("after", start)), end)

    def _iterate(self, slot: datetime | None, end: datetime) -> Iterator[datetime]:
        while slot is not None and slot < end:
            yield slot
            slot = self.next_after(slot)

    def count_between(self, start: datetime, end: datetime) -> int:
        """How many slots :meth:`slots_between` lists, without listing them: the inner
        schedule's count less the inner slots in each excluded stretch of the local days the
        range touches (only the days with something excluded are visited)."""
        low = to_us(require_aware("after", start))
        high = to_us(require_aware("after", end))
        if high <= low:
            return 0
        return _count(self.schedule, low, high) - self.excluded_count(low, high)

    def excluded_count(self, low: int, high: int) -> int:
        """How many inner slots in ``[low, high)`` (microseconds) are excluded."""
        total = 0
        for day in self._days_with_exclusions(low // DAY_US - 2, high // DAY_US + 2):
            stretches = self._day_stretches(day)
            midnight = day * DAY_US
            segments = _day_segments(self._tz, day)
            if isinstance(self.schedule, Interval) and len(segments) == 1:
                origin = midnight - segments[0][2]  # the day's local midnight, in UTC
                if low <= origin and origin + DAY_US <= high:
                    # A whole day of constant offset: its count depends only on where the
                    # interval's grid falls in it, the same on many days (remembered).
                    anchor, every = self.schedule.grid_us
                    total += _grid_count(stretches, every, (origin - anchor) % every)
                    continue
            for wall_start, wall_end, offset, _ in segments:
                for start, end in stretches:
                    begin = max(start, wall_start, low + offset - midnight)
                    stop = min(end, wall_end, high + offset - midnight)
                    if begin < stop:
                        total += _count(
                            self.schedule, midnight + begin - offset, midnight + stop - offset
                        )
        return total

    def _days_with_exclusions(self, first: int, last: int) -> Iterable[int]:
        """The local date indexes in ``[first, last]`` with an excluded date or a day some
        crontab matches, ascending."""
        first, last = max(first, 2), min(last, date.max.toordinal() - 4)
        days = set(
            self._ordinals[bisect_left(self._ordinals, first) : bisect_right(self._ordinals, last)]
        )
        for crontab in self.crontabs:
            day = crontab._next_day(first)
            while day is not None and day <= last:
                days.add(day)
                day = crontab._next_day(day + 1)
        return sorted(days)

    def describe(self) -> str:
        """The inner description, then what is excluded: ``"at 07:00 on Mon-Fri (Europe/
        Berlin), except 12 dates"``."""
        parts = []
        if self.dates:
            parts.append("1 date" if len(self.dates) == 1 else f"{len(self.dates)} dates")
        parts.extend(f"when {crontab.expression} matches" for crontab in self.crontabs)
        if not parts:
            return self.schedule.describe()
        return f"{self.schedule.describe()}, except {' and '.join(parts)} ({self.zone})"


@lru_cache(maxsize=4096)
def _crontab_day(crontabs: tuple[Crontab, ...], day: int) -> _Stretches:
    """The wall times ``crontabs`` exclude on local date index ``day``."""
    matching = tuple(c for c in crontabs if c.matches_day(day))
    return _merged(matching) if matching else ()


@lru_cache(maxsize=1024)
def _merged(crontabs: tuple[Crontab, ...]) -> _Stretches:
    if len(crontabs) == 1:
        return crontabs[0].wall_stretches()
    merged: list[list[int]] = []
    for start, end in sorted(s for c in crontabs for s in c.wall_stretches()):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return tuple((start, end) for start, end in merged)


@lru_cache(maxsize=4096)
def _grid_count(stretches: _Stretches, every: int, phase: int) -> int:
    """Points ``-phase + k * every`` in the ``stretches`` (microseconds of a day)."""
    return sum(
        -(-(end + phase) // every) - -(-(start + phase) // every) for start, end in stretches
    )


def _count(schedule: Schedule, low: int, high: int) -> int:
    """Slots of ``schedule`` in ``[low, high)`` (microseconds): arithmetic for an interval,
    ``count_between`` where the schedule has one, else listed."""
    if high <= low:
        return 0
    if isinstance(schedule, Interval):
        anchor, every = schedule.grid_us
        return -(-(high - anchor) // every) - -(-(low - anchor) // every)
    start, end = from_us(low), from_us(high)
    if start is None:  # pragma: no cover - beyond the calendar
        return 0
    if end is None:  # pragma: no cover
        end = datetime.max.replace(tzinfo=start.tzinfo) - timedelta(days=1)
    counting = getattr(schedule, "count_between", None)
    if counting is not None:
        return int(counting(start, end))
    return sum(1 for _ in schedule.slots_between(start, end))


def excluding(
    schedule: Schedule,
    dates: Iterable[date] = (),
    zone: str = "UTC",
    crontabs: Iterable[Crontab] = (),
) -> Schedule:
    """``schedule`` without the excluded slots; the schedule itself when nothing is
    excluded."""
    frozen, cron = frozenset(dates), tuple(crontabs)
    if not frozen and not cron:
        return schedule
    return Excluding(schedule, frozen, zone, cron)


def is_excluding(schedule: Schedule) -> bool:
    """Whether ``schedule`` excludes slots (itself, or the schedule within its bounds)."""
    inner = getattr(schedule, "schedule", None)
    return isinstance(schedule, Excluding) or isinstance(inner, Excluding)


def excluded_between(schedule: Schedule, start: datetime, end: datetime) -> int:
    """How many slots of the schedule within ``schedule`` (itself, or within its bounds) in
    ``[start, end)`` are excluded: 0 when it excludes nothing."""
    inner = schedule if isinstance(schedule, Excluding) else getattr(schedule, "schedule", None)
    if not isinstance(inner, Excluding):
        return 0
    return inner.excluded_count(to_us(start), to_us(end))


# -------------------------------------------------------------------- stored exclusions


def parse_dates(value: Any, field_name: str) -> tuple[list[date], list[Problem]]:
    """Read a stored list of ISO dates (``["2026-12-25", ...]``; ``date`` objects accepted):
    the dates, and a problem on ``field_name`` for anything else, naming the entry."""
    if value is None or value == "":
        return [], []
    if not isinstance(value, list | tuple):
        return [], [
            Problem(
                field_name,
                f"must be a list of dates (YYYY-MM-DD), not {type(value).__name__} {value!r}",
            )
        ]
    dates: list[date] = []
    bad: list[str] = []
    for entry in value:
        if isinstance(entry, date) and not isinstance(entry, datetime):
            dates.append(entry)
            continue
        try:
            if not isinstance(entry, str):
                raise ValueError
            dates.append(date.fromisoformat(entry.strip()))
        except ValueError:
            bad.append(repr(entry))
    if bad:
        return dates, [
            Problem(
                field_name,
                f"{', '.join(bad[:5])}{' …' if len(bad) > 5 else ''} "
                f"{'is no date' if len(bad) == 1 else 'are no dates'}: write each as "
                "YYYY-MM-DD, such as 2026-12-25",
            )
        ]
    return dates, []


def parse_crontab(text: Any, zone: str, field_name: str) -> tuple[Crontab | None, list[Problem]]:
    """An exclusion crontab from its expression (five fields, or six with the seconds first;
    empty: none), or a problem on ``field_name``."""
    if text is None or (isinstance(text, str) and not text.strip()):
        return None, []
    try:
        return Crontab.from_expression(text, zone), []
    except ScheduleError as exc:
        return None, [Problem(field_name, f"not a crontab expression: {exc}")]


def iso_dates(dates: Iterable[date]) -> list[str]:
    """Dates as stored: sorted ISO texts, each once."""
    return [d.isoformat() for d in sorted(set(dates))]


def stored_exclusions(
    excluded_dates: Any, calendar_exclusions: Any, zone: str
) -> tuple[frozenset[date], tuple[Crontab, ...]]:
    """What a task row excludes: its own ``excluded_dates`` (a list of ISO dates) and its
    calendars' (``calendar_exclusions``: ``{"dates": [...], "crontabs": [...]}``, kept by the
    calendars). Raises :class:`ScheduleError` on the field at fault (``excluded_dates``, or
    ``calendars`` for the calendars' part). Equal texts share one reading."""
    own = _texts("excluded_dates", excluded_dates)
    theirs: dict[str, Any] = {}
    if calendar_exclusions:
        if not isinstance(calendar_exclusions, dict):
            raise ScheduleError(
                "calendars",
                f"the calendars' exclusions must be an object, not {calendar_exclusions!r}; "
                "save one of the task's calendars to write them again",
            )
        theirs = calendar_exclusions
    dates = own + _texts("calendars", theirs.get("dates"))
    crontabs = _texts("calendars", theirs.get("crontabs"))
    try:
        return _read_exclusions(dates, crontabs, zone)
    except TypeError:  # an entry that is no text (a list, an object): unhashable
        bad = next(v for v in (*dates, *crontabs) if not isinstance(v, str | date))
        raise ScheduleError("excluded_dates", f"{bad!r} is no date: write YYYY-MM-DD") from None


def _texts(field_name: str, value: Any) -> tuple[Any, ...]:
    if value is None or value == "":
        return ()
    if not isinstance(value, list | tuple):
        raise ScheduleError(field_name, f"must be a list of dates (YYYY-MM-DD), not {value!r}")
    return tuple(value)


@lru_cache(maxsize=1024)
def _read_exclusions(
    dates: tuple[Any, ...], crontabs: tuple[Any, ...], zone: str
) -> tuple[frozenset[date], tuple[Crontab, ...]]:
    parsed, problems = parse_dates(list(dates), "excluded_dates")
    if problems:
        raise ScheduleError("excluded_dates", problems[0].message)
    read = []
    for text in crontabs:
        crontab, problems = parse_crontab(text, zone, "calendars")
        if problems:
            raise ScheduleError("calendars", problems[0].message)
        if crontab is not None:
            read.append(crontab)
    return frozenset(parsed), tuple(read)


def shared_excluding(
    schedule: Schedule, dates: frozenset[date], zone: str, crontabs: tuple[Crontab, ...]
) -> Schedule:
    """:func:`excluding`, the same instance for equal arguments (a claim round builds the
    schedule of every task it plans); built afresh around a schedule that is no value."""
    if isinstance(schedule, Hashable):
        return _shared_excluding(schedule, dates, zone, crontabs)
    return excluding(schedule, dates, zone, crontabs)  # pragma: no cover - ours are values


@lru_cache(maxsize=4096)
def _shared_excluding(
    schedule: Hashable, dates: frozenset[date], zone: str, crontabs: tuple[Crontab, ...]
) -> Schedule:
    return excluding(cast(Schedule, schedule), dates, zone, crontabs)
