"""Crontab schedules: parse a cron expression (five fields, or six with seconds first) and find
its slots.

Pure like :mod:`celery_driftsafe.core.schedules`, which re-exports :class:`Crontab`: no clock, no
I/O,
standard library only (``zoneinfo`` for zones).

Fields: ``second`` (optional, 0-59, default ``0``; written first in a six-field expression,
as Quartz and Hangfire do), ``minute``, ``hour``, ``day_of_month``, ``month_of_year``,
``day_of_week``.

Syntax, per field: ``*``, numbers, ranges ``a-b``, steps ``*/n``, ``a-b/n`` and ``a/n``
(from ``a`` to the field's maximum), comma lists, month names ``jan``-``dec`` and weekday names
``sun``-``sat`` (case-insensitive); in ``day_of_week`` both 0 and 7 mean Sunday, and the
open-ended forms ``*`` and ``a/n`` run up to 6 (so ``1/2`` is Monday, Wednesday, Friday). If both
``day_of_month`` and ``day_of_week`` are restricted (neither starts with ``*``) a day matches
when *either* matches, otherwise when both do (the Vixie cron rule). An expression that can
never fire, such as ``0 0 31 2 *``, is rejected when the Crontab is built.

DST: wall times are read in ``timezone``. If the ``hour`` field is exactly ``*`` (``*/1`` and
``0-23`` do not count) the crontab is *hourly or more frequent*: every UTC instant whose local
wall time matches is a slot, so a repeated hour fires again and a skipped hour fires nothing.
Otherwise it is *fixed-time*: a wall time that occurs twice fires once, at its first
occurrence, and a wall time that does not exist fires once, at the instant the gap ends
(several such times collapse onto that slot).

How a search works: walk the matching local dates (month by month, then day by day from
sorted tuples), and within a date bisect the sorted matching minutes of the day. Each date is
split into at most two stretches of constant UTC offset, computed once per ``(zone, date)``
and cached. That relies on a zone changing its offset at most once in any 50 hours, which holds
for every zone in the tz database since 1900 (the closest pair is about 95 hours apart).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta
from functools import lru_cache
from zoneinfo import ZoneInfo

from celery_driftsafe.core.crontab_fields import (
    BOUNDS,
    DAY_NAMES,
    LONGEST_MONTH,
    MACROS,
    MONTH_NAMES,
    bit_mask,
    field_runs,
    load_zone,
    parse_field,
    times_of_day,
)
from celery_driftsafe.core.instants import (
    DAY_US,
    EPOCH,
    SECOND_US,
    US,
    from_us,
    require_aware,
    to_us,
)
from celery_driftsafe.exceptions import ScheduleError

__all__ = ["Crontab"]

_LAST_DAY_INDEX = date.max.toordinal() - 3  # leaves room to look at the following day


# --------------------------------------------------------------------------- zone days


def _offset(aware: datetime) -> int:
    offset = aware.utcoffset()
    assert offset is not None  # every datetime reaching here has a ZoneInfo or UTC tzinfo
    return offset // US


def _offset_at(zone: ZoneInfo, instant_us: int) -> int:
    return _offset((EPOCH + timedelta(microseconds=instant_us)).astimezone(zone))


# A segment: (wall_start, wall_end, offset, utc_start). Wall times are microseconds after the
# local midnight of the day, clipped to [0, one day); offset is local minus UTC; utc_start is
# where the stretch begins in UTC (the end of the gap before it, if any).
_Segment = tuple[int, int, int, int]


@lru_cache(maxsize=4096)
def _day_segments(zone: ZoneInfo, day: int) -> tuple[_Segment, ...]:
    """Split local day ``day`` (``date.toordinal() - 1``) of ``zone`` into constant offsets."""
    today, tomorrow = date.fromordinal(day + 1), date.fromordinal(day + 2)
    start = datetime(today.year, today.month, today.day, tzinfo=zone)
    end = datetime(tomorrow.year, tomorrow.month, tomorrow.day, tzinfo=zone)
    midnight = day * DAY_US
    # The earliest instant that can read as local midnight, the latest that can read as the
    # next midnight: between them lies every instant whose local date is `day`.
    utc_low = midnight - max(_offset(start), _offset(start.replace(fold=1)))
    utc_high = midnight + DAY_US - min(_offset(end), _offset(end.replace(fold=1)))
    before, after = _offset_at(zone, utc_low), _offset_at(zone, utc_high)
    if before == after:
        return ((0, DAY_US, before, utc_low),)
    low, high = utc_low // SECOND_US, utc_high // SECOND_US  # transitions fall on seconds
    while high - low > 1:
        middle = (low + high) // 2
        if _offset_at(zone, middle * SECOND_US) == before:
            low = middle
        else:
            high = middle
    change = high * SECOND_US
    wall_before_end = min(max(change + before - midnight, 0), DAY_US)
    wall_after_start = min(max(change + after - midnight, 0), DAY_US)
    return ((0, wall_before_end, before, utc_low), (wall_after_start, DAY_US, after, change))


# --------------------------------------------------------------------------- the schedule


@dataclass(frozen=True)
class Crontab:
    """A classic cron schedule evaluated in ``timezone`` (see the module docstring).

    Every field is validated when the Crontab is built; a bad one raises
    :class:`~celery_driftsafe.exceptions.ScheduleError` naming it, and so does a combination
    that can never fire (field ``"day_of_month"``). Searches return ``None`` only when no slot
    exists before ``datetime.max``.
    """

    minute: str = "*"
    hour: str = "*"
    day_of_month: str = "*"
    month_of_year: str = "*"
    day_of_week: str = "*"
    timezone: str = "UTC"
    second: str = "0"
    _seconds: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _zone: ZoneInfo = field(init=False, repr=False, compare=False)
    _minutes: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _hours: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _days: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _months: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _weekdays: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _day_or: bool = field(init=False, repr=False, compare=False)
    _fixed_time: bool = field(init=False, repr=False, compare=False)
    _times: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _weekday_step: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        parsed = {name: parse_field(name, getattr(self, name)) for name in BOUNDS}
        zone = load_zone(self.timezone)
        days, months, weekdays = (
            parsed["day_of_month"],
            parsed["month_of_year"],
            parsed["day_of_week"],
        )
        day_or = not self.day_of_month.strip().startswith("*") and not (
            self.day_of_week.strip().startswith("*")
        )
        # Every (month, day) that exists falls on each weekday within 400 years, so only the
        # AND rule with no day that exists in any allowed month can never fire.
        if not day_or and not any(days[0] <= LONGEST_MONTH[month] for month in months):
            raise ScheduleError(
                "day_of_month",
                f"{self.day_of_month.strip()!r} never occurs in month "
                f"{self.month_of_year.strip()!r}, so this schedule would never fire",
            )
        weekday_mask = bit_mask(weekdays)
        step = tuple(
            next(k for k in range(7) if weekday_mask >> ((weekday + k) % 7) & 1)
            for weekday in range(7)
        )
        times = times_of_day(parsed["hour"], parsed["minute"], parsed["second"])
        for name, value in (
            ("_seconds", parsed["second"]),
            ("_zone", zone),
            ("_minutes", parsed["minute"]),
            ("_hours", parsed["hour"]),
            ("_days", days),
            ("_months", months),
            ("_weekdays", weekdays),
            ("_day_or", day_or),
            ("_fixed_time", self.hour.strip() != "*"),
            ("_times", times),
            ("_weekday_step", step),
        ):
            object.__setattr__(self, name, value)

    @classmethod
    def from_expression(cls, expression: str, timezone: str = "UTC") -> Crontab:
        """Build a Crontab from ``"minute hour day_of_month month_of_year day_of_week"``, or
        from six fields with the seconds first (``"*/15 * * * * *"``: every 15 seconds).

        The macros ``@yearly``, ``@annually``, ``@monthly``, ``@weekly``, ``@daily``,
        ``@midnight`` and ``@hourly`` are accepted too. Any other number of fields raises
        ``ScheduleError("expression", ...)``.
        """
        if not isinstance(expression, str):
            raise ScheduleError("expression", f"must be text, got {type(expression).__name__}")
        text = MACROS.get(expression.strip().lower(), expression)
        fields = text.split()
        second = "0"
        if len(fields) == 6:
            second, *fields = fields
        if len(fields) != 5:
            raise ScheduleError(
                "expression",
                f"needs 5 fields (minute hour day-of-month month day-of-week), or 6 with the "
                f"seconds first, got {len(text.split())} in {expression!r}",
            )
        minute, hour, day_of_month, month_of_year, day_of_week = fields
        return cls(minute, hour, day_of_month, month_of_year, day_of_week, timezone, second)

    @property
    def expression(self) -> str:
        """The fields joined by spaces, as written (without the time zone): five, or six with
        the seconds first when they are not ``0``."""
        names = [name for name in BOUNDS if name != "second" or self.second.strip() != "0"]
        return " ".join(getattr(self, name).strip() for name in names)

    # ------------------------------------------------------------------ searching

    def first_at_or_after(self, instant: datetime) -> datetime | None:
        """Return the smallest slot ``>= instant``, or ``None`` if none before ``datetime.max``."""
        return self._search(to_us(require_aware("after", instant)))

    def next_after(self, instant: datetime) -> datetime | None:
        """Return the smallest slot ``> instant``, or ``None`` if none before ``datetime.max``.

        Slots fall on whole seconds, so this is the first slot at or after ``instant + 1 µs``.
        """
        return self._search(to_us(require_aware("after", instant)) + 1)

    def slots_between(self, start: datetime, end: datetime) -> Iterator[datetime]:
        """Return the slots ``s`` with ``start <= s < end``, ascending."""
        return self._iterate(to_us(require_aware("after", start)), require_aware("after", end))

    def _iterate(self, start_us: int, end: datetime) -> Iterator[datetime]:
        slot = self._search(start_us)
        while slot is not None and slot < end:
            yield slot
            slot = self._search(to_us(slot) + 1)

    def _search(self, after_us: int) -> datetime | None:
        """The smallest slot at or after ``after_us`` (microseconds, see :func:`to_us`)."""
        instant = from_us(after_us)
        if instant is None:
            return None
        try:
            local = instant.astimezone(self._zone)
            if local.toordinal() < 3:
                raise OverflowError("too close to datetime.min")
            today = local.toordinal() - 1
            # The day before can still hold a slot >= after_us only if it changes its offset
            # (a repeated hour or a gap that crosses midnight); otherwise all of it lies before.
            multiple = len(_day_segments(self._zone, today - 1)) > 1
            day = self._next_day(today - 1 if multiple else today)
            while day is not None:
                found = self._first_in_day(day, after_us)
                if found is not None:
                    return from_us(self._earlier_next_day(day, after_us, found))
                day = self._next_day(day + 1)
        except OverflowError:  # within a few days of datetime.min or datetime.max
            return None
        return None

    def _earlier_next_day(self, day: int, after_us: int, found: int) -> int:
        """``found``, or an earlier slot of the next day if a repeated hour crosses midnight.

        Only an hourly crontab can fire in both occurrences of a repeated hour, and only a day
        with an offset change can overlap the next one in UTC.
        """
        if self._fixed_time or len(_day_segments(self._zone, day)) == 1:
            return found
        if self._next_day(day + 1) != day + 1:
            return found
        early = self._first_in_day(day + 1, after_us)
        return found if early is None else min(found, early)

    def _first_in_day(self, day: int, after_us: int) -> int | None:
        """The earliest slot ``>= after_us`` among the wall times of local ``day``."""
        times = self._times
        midnight = day * DAY_US
        covered = 0  # wall times below this were already seen earlier in UTC
        for wall_start, wall_end, offset, utc_start in _day_segments(self._zone, day):
            if self._fixed_time:
                if wall_start > covered and utc_start >= after_us:
                    # Wall times in [covered, wall_start) do not exist: they fire at the
                    # instant the gap ends, if any of them matches.
                    i = bisect_left(times, covered)
                    if i < len(times) and times[i] < wall_start:
                        return utc_start
                wall_start = max(wall_start, covered)
                covered = max(covered, wall_end)
            i = bisect_left(times, max(wall_start, after_us + offset - midnight))
            if i < len(times) and times[i] < wall_end:
                return midnight + times[i] - offset
        return None

    def _next_day(self, day: int) -> int | None:
        """The first local date index ``>= day`` whose month and day match, or ``None``."""
        if day > _LAST_DAY_INDEX:
            return None
        current = date.fromordinal(day + 1)
        year, month, mday = current.year, current.month, current.day
        months = self._months
        while year <= 9999:
            if month in months:
                found = self._first_day_in_month(year, month, mday)
                if found is not None:
                    index = date(year, month, found).toordinal() - 1
                    return index if index <= _LAST_DAY_INDEX else None
                position = bisect_right(months, month)
            else:
                position = bisect_left(months, month)
            if position == len(months):
                year, month = year + 1, months[0]
            else:
                month = months[position]
            mday = 1
        return None

    def _first_day_in_month(self, year: int, month: int, mday: int) -> int | None:
        """The first matching day of the month ``>= mday``, or ``None``."""
        last = _month_length(year, month)
        weekday = date(year, month, mday).toordinal() % 7  # 0 is Sunday, as in cron
        days = self._days
        i = bisect_left(days, mday)
        if self._day_or:
            best = days[i] if i < len(days) and days[i] <= last else None
            by_weekday = mday + self._weekday_step[weekday]
            if by_weekday <= last and (best is None or by_weekday < best):
                best = by_weekday
            return best
        step = self._weekday_step
        for candidate in days[i:]:
            if candidate > last:
                return None
            if step[(weekday + candidate - mday) % 7] == 0:
                return candidate
        return None

    # ------------------------------------------------------------------ wall-time matching

    def matches_day(self, day: int) -> bool:
        """Whether local date index ``day`` (``date.toordinal() - 1``) matches the day fields
        (day of month, month, day of week, with the Vixie OR rule)."""
        return self._next_day(day) == day

    def wall_stretches(self) -> tuple[tuple[int, int], ...]:
        """The wall times of a matching day that the expression covers, as merged stretches
        ``[start, end)`` in microseconds after local midnight: each matching second ``[t, t +
        1 s)``, or, when the second field is ``0`` (a five-field expression), each matching
        minute whole ``[t, t + 60 s)``. For excluding slots by wall time (see
        :mod:`celery_driftsafe.core.exclusions`), not for finding this crontab's slots."""
        return _wall_stretches(self._times, self.second.strip() == "0")

    # ------------------------------------------------------------------ counting

    def count_between(self, start: datetime, end: datetime) -> int:
        """How many slots ``s`` with ``start <= s < end``: as many as :meth:`slots_between`
        lists, without listing them.

        Whole local years are counted from the dates that match (each without an offset change
        has ``len(times)`` slots) and the year's transition days, each counted by its stretches
        of constant offset; both are remembered per year. The rest (the days near ``start`` and
        ``end``) is counted a day at a time. So a count over a century costs about a century's
        years once, where listing an every-minute crontab's slots costs 6 µs a slot.
        """
        low = to_us(require_aware("after", start))
        high = to_us(require_aware("after", end))
        if high <= low:
            return 0
        # Every slot of local day d lies within two days of d's UTC midnight.
        first_day = max(low // DAY_US - 2, 2)
        last_day = min(high // DAY_US + 2, _LAST_DAY_INDEX)
        total = 0
        gaps: set[int] = set()
        regular: set[int] = set()
        year = date.fromordinal(first_day + 1).year
        while year <= 9999:
            year_first = date(year, 1, 1).toordinal() - 1
            if year_first > last_day:
                break
            year_last = date(year, 12, 31).toordinal() - 1
            if (year_first - 2) * DAY_US >= low and (year_last + 3) * DAY_US <= high:
                count, year_gaps, year_regular = _year_count(self, year)
            else:
                count, year_gaps, year_regular = self._count_days(
                    max(year_first, first_day), min(year_last, last_day), low, high
                )
            total += count
            gaps.update(year_gaps)
            regular.update(year_regular)
            year += 1
        # A wall time in a gap fires when the gap ends: one slot however many match, and none
        # more where a wall time matches the gap's end itself (or the same gap seen from both
        # days it spans).
        return total + len(gaps - regular)

    def _count_days(
        self, first: int, last: int, low: int, high: int
    ) -> tuple[int, frozenset[int], frozenset[int]]:
        """Slots in ``[low, high)`` of the matching local days ``first`` to ``last``: those at
        wall times, the gap ends that fire and the slots at a stretch's start (for
        :meth:`count_between`)."""
        total = 0
        gaps: set[int] = set()
        regular: set[int] = set()
        day = self._next_day(first)
        while day is not None and day <= last:
            count, day_gaps, day_regular = self._count_in_day(day, low, high)
            total += count
            gaps.update(day_gaps)
            regular.update(day_regular)
            day = self._next_day(day + 1)
        return total, frozenset(gaps), frozenset(regular)

    def _count_in_day(self, day: int, low: int, high: int) -> tuple[int, set[int], set[int]]:
        """Count the slots of local ``day`` in ``[low, high)`` as :meth:`_first_in_day` finds
        them: the wall times of each stretch (for a fixed-time crontab, those not seen in an
        earlier stretch), the gap ends that fire, and which wall-time slots sit at a
        stretch's start (a gap end may fall on one of them)."""
        times = self._times
        midnight = day * DAY_US
        covered = 0
        total = 0
        gaps: set[int] = set()
        regular: set[int] = set()
        segments = _day_segments(self._zone, day)
        for wall_start, wall_end, offset, utc_start in segments:
            if self._fixed_time:
                if wall_start > covered and low <= utc_start < high:
                    i = bisect_left(times, covered)
                    if i < len(times) and times[i] < wall_start:
                        gaps.add(utc_start)
                wall_start = max(wall_start, covered)
                covered = max(covered, wall_end)
            begin = max(wall_start, low + offset - midnight)
            stop = min(wall_end, high + offset - midnight)
            if begin < stop:
                total += bisect_left(times, stop) - bisect_left(times, begin)
            if len(segments) > 1 and begin <= wall_start < stop:
                i = bisect_left(times, wall_start)
                if i < len(times) and times[i] == wall_start:
                    regular.add(midnight + wall_start - offset)
        return total, gaps, regular

    # ------------------------------------------------------------------ describing

    def describe(self) -> str:
        """Return e.g. ``"at 02:30 (Europe/Berlin)"``, ``"every 15 minutes (UTC)"`` or
        ``"every 10 seconds (UTC)"``."""
        minute, hour, second = self.minute.strip(), self.hour.strip(), self.second.strip()
        seconds = ""
        if second == "*":
            seconds = "every second"
        elif second.startswith("*/") and 60 % len(self._seconds) == 0:
            seconds = f"every {60 // len(self._seconds)} seconds"
        elif second != "0":
            seconds = f"at second {second}"
        if self._fixed_time and len(self._hours) * len(self._minutes) <= 4:
            single = len(self._seconds) == 1 and second != "0"
            at_second = f":{self._seconds[0]:02}" if single else ""
            text = "at " + ", ".join(
                f"{h:02}:{m:02}{at_second}" for h in self._hours for m in self._minutes
            )
            seconds = "" if at_second else seconds
        elif minute == "*" and not self._fixed_time and seconds:
            text, seconds = seconds, ""
        elif self._fixed_time:
            text = f"at minute {minute} past hour {hour}"
        elif minute == "*":
            text = "every minute"
        elif minute.startswith("*/") and 60 % len(self._minutes) == 0:
            every = 60 // len(self._minutes)
            text = "every minute" if every == 1 else f"every {every} minutes"
        elif len(self._minutes) == 1:
            text = f"every hour at :{self._minutes[0]:02}"
        else:
            text = f"every hour at minute {minute}"
        days = self.day_of_month.strip()
        weekdays = field_runs(self._weekdays, DAY_NAMES, 0)
        if days != "*" and self.day_of_week.strip() != "*":
            joint = "or" if self._day_or else "if it is a"
            text += f" on day {days} of the month {joint} {weekdays}"
        elif days != "*":
            text += f" on day {days} of the month"
        elif self.day_of_week.strip() != "*":
            text += f" on {weekdays}"
        if self.month_of_year.strip() != "*":
            text += f" in {field_runs(self._months, MONTH_NAMES, 1)}"
        if seconds:
            text = f"{seconds}, {text}"
        return f"{text} ({self.timezone})"


@lru_cache(maxsize=16384)
def _year_count(crontab: Crontab, year: int) -> tuple[int, frozenset[int], frozenset[int]]:
    """:meth:`Crontab._count_days` over the whole local ``year``: the matching dates times the
    slots of a day, corrected on the days the zone changes its offset."""
    first = date(year, 1, 1).toordinal() - 1
    changes = _transition_days(crontab._zone, year)
    matching = _matching_days(crontab, _month_length(year, 2) == 29, (first + 1) % 7)
    total = len(matching) * len(crontab._times)
    gaps: set[int] = set()
    regular: set[int] = set()
    for day in sorted(changes):
        if day - first in matching:
            total -= len(crontab._times)
            count, day_gaps, day_regular = crontab._count_in_day(day, -(2**62), 2**62)
            total += count
            gaps.update(day_gaps)
            regular.update(day_regular)
    return total, frozenset(gaps), frozenset(regular)


@lru_cache(maxsize=1024)
def _matching_days(crontab: Crontab, leap: bool, weekday: int) -> frozenset[int]:
    """The days of a year (0 is 1 January) whose date matches, for a leap year or not that
    begins on ``weekday`` (0 is Sunday): every such year has the same ones."""
    year = next(
        year
        for year in range(2001, 2030)
        if (_month_length(year, 2) == 29) == leap and date(year, 1, 1).toordinal() % 7 == weekday
    )
    first = date(year, 1, 1).toordinal() - 1
    last = date(year, 12, 31).toordinal() - 1
    days: set[int] = set()
    day = crontab._next_day(first)
    while day is not None and day <= last:
        days.add(day - first)
        day = crontab._next_day(day + 1)
    return frozenset(days)


#: How far apart :func:`_transition_days` looks at a zone's offset: less than the shortest
#: time between two offset changes (see the module docstring), so two looks that read the same
#: offset have no change between them.
_LOOK = timedelta(hours=48)


@lru_cache(maxsize=16384)
def _transition_days(zone: ZoneInfo, year: int) -> frozenset[int]:
    """The local days of ``year`` that change their offset (more than one stretch)."""
    first = date(year, 1, 1).toordinal() - 1
    last = date(year, 12, 31).toordinal() - 1
    days: set[int] = set()
    instant = EPOCH + timedelta(days=max(first - 2, 2))
    end = EPOCH + timedelta(days=min(last + 3, _LAST_DAY_INDEX))
    before = instant.astimezone(zone).utcoffset()
    while instant < end:
        instant += _LOOK
        after = instant.astimezone(zone).utcoffset()
        if after != before:
            # The change lies in the 48 hours before `instant`: the days around it are the
            # candidates.
            around = to_us(instant) // DAY_US
            for day in range(around - 4, around + 3):
                if first <= day <= last and len(_day_segments(zone, day)) > 1:
                    days.add(day)
            before = after
    return frozenset(days)


@lru_cache(maxsize=256)
def _wall_stretches(times: tuple[int, ...], whole_minutes: bool) -> tuple[tuple[int, int], ...]:
    width = 60 * SECOND_US if whole_minutes else SECOND_US
    merged: list[list[int]] = []
    for start in times:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], start + width)
        else:
            merged.append([start, start + width])
    return tuple((start, min(end, DAY_US)) for start, end in merged)


def _month_length(year: int, month: int) -> int:
    if month == 2:
        leap = year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)
        return 29 if leap else 28
    return LONGEST_MONTH[month]
