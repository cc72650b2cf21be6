"""An independent reference for slot arithmetic, for the property-based tests: crontab
expressions generated together with the value sets they mean (computed here, not by the parser
under test), a brute-force enumeration of the slots they fire, DST transitions of the zones of
interest, and instants placed near them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import cache
from zoneinfo import ZoneInfo

from hypothesis import assume, settings
from hypothesis import strategies as st

from celery_driftsafe.core.schedules import Crontab

ZONES = ["Europe/Berlin", "America/New_York", "Australia/Lord_Howe", "Asia/Kolkata", "UTC"]
# Years of interest per zone with DST. St John's moved its clocks at 00:01 until 2011, so its
# repeated hour straddled midnight; Goose Bay did too, with a two-hour shift in 1988.
DST_YEARS = {
    "Europe/Berlin": (2020, 2030),
    "America/New_York": (2020, 2030),
    "Australia/Lord_Howe": (2020, 2030),
    "America/St_Johns": (2006, 2010),
    "America/Goose_Bay": (1987, 1990),
}
BRUTE_FORCE_ZONES = [*ZONES, "America/St_Johns", "America/Goose_Bay"]
BOUNDS = {
    "minute": (0, 59),
    "hour": (0, 23),
    "day_of_month": (1, 31),
    "month_of_year": (1, 12),
    "day_of_week": (0, 7),
}
NAMES = {
    "month_of_year": ("", "jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct",
                      "nov", "dec"),
    "day_of_week": ("sun", "mon", "tue", "wed", "thu", "fri", "sat"),
}  # fmt: skip
MINUTE = timedelta(minutes=1)
MICROSECOND = timedelta(microseconds=1)
QUICK = settings(max_examples=150, deadline=None)


@dataclass(frozen=True)
class Spec:
    """A generated crontab: the text of each field and the values it means."""

    texts: tuple[str, str, str, str, str]
    minutes: frozenset[int]
    hours: frozenset[int]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]

    @property
    def expression(self) -> str:
        return " ".join(self.texts)

    @property
    def fixed_time(self) -> bool:
        return self.texts[1] != "*"

    @property
    def day_or(self) -> bool:
        return not self.texts[2].startswith("*") and not self.texts[4].startswith("*")

    def matches(self, wall: datetime) -> bool:
        if wall.minute not in self.minutes or wall.hour not in self.hours:
            return False
        if wall.month not in self.months:
            return False
        day_ok = wall.day in self.days
        weekday_ok = wall.isoweekday() % 7 in self.weekdays
        return (day_ok or weekday_ok) if self.day_or else (day_ok and weekday_ok)

    def crontab(self, zone: str) -> Crontab:
        return Crontab(*self.texts, timezone=zone)


@st.composite
def field_items(draw: st.DrawFn, name: str, for_croniter: bool) -> tuple[str, set[int]]:
    low, high = BOUNDS[name]
    top = 6 if name == "day_of_week" else high  # where '*' and 'a/n' stop

    def text(value: int) -> str:
        names = NAMES.get(name)
        if names and value < len(names) and names[value] and draw(st.booleans()):
            return draw(st.sampled_from([str.lower, str.upper, str.title]))(names[value])
        return str(value)

    kind = draw(st.sampled_from(["*", "*/n", "a", "a-b", "a-b/n", "a/n"]))
    if kind == "*":
        return "*", set(range(low, top + 1))
    if kind == "*/n":
        step = draw(st.integers(1, top - low + 1))
        return f"*/{step}", set(range(low, top + 1, step))
    if kind == "a/n":
        first = draw(st.integers(low, top))
        step = draw(st.integers(1, top - low + 1))
        return f"{text(first)}/{step}", set(range(first, top + 1, step))
    first = draw(st.integers(low, high))
    if kind == "a":
        return text(first), {first}
    if for_croniter:  # croniter reads a one-value range such as '5-5' as '*'
        assume(first < high)
        last = draw(st.integers(first + 1, high))
    else:
        last = draw(st.integers(first, high))
    if kind == "a-b":
        return f"{text(first)}-{text(last)}", set(range(first, last + 1))
    step = draw(st.integers(1, last - first + 1))
    return f"{text(first)}-{text(last)}/{step}", set(range(first, last + 1, step))


@st.composite
def fields(
    draw: st.DrawFn, name: str, for_croniter: bool, star_weight: int
) -> tuple[str, frozenset[int]]:
    low, high = BOUNDS[name]
    if draw(st.integers(0, 9)) < star_weight:
        values = set(range(low, high + 1))
        texts = ["*"]
    else:
        items = draw(st.lists(field_items(name, for_croniter), min_size=1, max_size=3))
        texts = [text for text, _ in items]
        values = set().union(*(values for _, values in items))
    if name == "day_of_week" and 7 in values:
        values = (values - {7}) | {0}
    return ",".join(texts), frozenset(values)


LONGEST_MONTH = (0, 31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)


@st.composite
def specs(draw: st.DrawFn, for_croniter: bool = False) -> Spec:
    minute = draw(fields("minute", for_croniter, 1))
    hour = draw(
        st.one_of(
            st.just(("*", frozenset(range(24)))),
            fields("hour", for_croniter, 0),
            # Hours in which the test zones change their clocks.
            st.sampled_from(
                [
                    ("1", frozenset({1})),
                    ("2", frozenset({2})),
                    ("3", frozenset({3})),
                    ("1-3", frozenset({1, 2, 3})),
                    ("2,3", frozenset({2, 3})),
                    ("0-2/2", frozenset({0, 2})),
                ]
            ),
        )
    )
    day = draw(fields("day_of_month", for_croniter, 7))
    month = draw(fields("month_of_year", for_croniter, 7))
    weekday = draw(fields("day_of_week", for_croniter, 6))
    spec = Spec(
        (minute[0], hour[0], day[0], month[0], weekday[0]),
        minute[1],
        hour[1],
        day[1],
        month[1],
        weekday[1],
    )
    # Combinations that can never fire are rejected by Crontab; tested in test_slots.py.
    assume(spec.day_or or any(min(spec.days) <= LONGEST_MONTH[m] for m in spec.months))
    return spec


@cache
def transitions(zone: str) -> tuple[datetime, ...]:
    """Every instant in the ``DST_YEARS`` of ``zone`` at which it changes its UTC offset."""
    tz = ZoneInfo(zone)
    first_year, last_year = DST_YEARS[zone]
    found: list[datetime] = []
    day = datetime(first_year, 1, 1, 12, tzinfo=UTC)
    while day.year <= last_year:
        following = day + timedelta(days=1)
        if day.astimezone(tz).utcoffset() != following.astimezone(tz).utcoffset():
            low, high = day, following
            while high - low > MINUTE:
                middle = low + (high - low) // 2
                if middle.astimezone(tz).utcoffset() == low.astimezone(tz).utcoffset():
                    low = middle
                else:
                    high = middle
            found.append(high)
        day = following
    return tuple(found)


@st.composite
def instants(draw: st.DrawFn, zone: str, near_transition: int = 75) -> datetime:
    """An instant, usually up to 30 hours before a DST transition of ``zone``."""
    if zone in DST_YEARS and draw(st.integers(0, 99)) < near_transition:
        centre = draw(st.sampled_from(transitions(zone)))
        seconds = draw(st.integers(0, 30 * 3600))
        micros = draw(st.sampled_from([0, 0, 1, 999_999, 500_000]))
        return centre - timedelta(seconds=seconds, microseconds=micros)
    first_year, last_year = DST_YEARS.get(zone, (2020, 2030))
    return draw(
        st.datetimes(
            datetime(first_year, 1, 1), datetime(last_year, 12, 31), timezones=st.just(UTC)
        )
    )


def reference_slots(
    spec: Spec,
    zone: str,
    start: datetime,
    end: datetime,
    *,
    step: timedelta = MINUTE,
    matches: Callable[[datetime], bool] | None = None,
) -> list[datetime]:
    """The DESIGN.md rules applied to every UTC ``step`` (a minute, or a second for crontabs
    with seconds) in ``[start, end)``; ``matches`` tells whether a wall time matches (default:
    ``spec.matches``)."""
    tz = ZoneInfo(zone)
    match = matches or spec.matches
    instant = start.astimezone(UTC).replace(microsecond=0)
    instant -= timedelta(seconds=instant.second % (step // timedelta(seconds=1)))
    if instant < start:
        instant += step
    slots: list[datetime] = []
    while instant < end:
        local = instant.astimezone(tz)
        if not spec.fixed_time:
            fires = match(local)
        else:
            # First occurrence of an existing wall time (fold 1 marks the repeat)...
            fires = local.fold == 0 and match(local)
            # ...or the first instant after a gap that swallowed a matching wall time.
            missing = (instant - step).astimezone(tz).replace(tzinfo=None) + step
            while not fires and missing < local.replace(tzinfo=None):
                fires = match(missing)
                missing += step
        if fires:
            slots.append(instant)
        instant += step
    return slots


def offset_constant(zone: str, start: datetime, end: datetime) -> bool:
    """True if ``zone`` keeps one UTC offset over ``[start, end]`` (changes are > 90 h apart)."""
    tz = ZoneInfo(zone)
    offset = start.astimezone(tz).utcoffset()
    probe = start
    while probe < end:
        probe = min(probe + timedelta(hours=6), end)
        if probe.astimezone(tz).utcoffset() != offset:
            return False
    return True
