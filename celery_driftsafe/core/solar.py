"""Solar schedules: sunrise, sunset, dawn, dusk and solar noon at a latitude and longitude.

Pure like :mod:`celery_driftsafe.core.schedules`, which re-exports :class:`Solar`: no clock, no I/O,
standard library only.

The events are those of ``celery.schedules.solar``, with the same definitions:

=====================  ======================================================
``sunrise``            the sun's upper limb rises through 34' below the horizon
``sunset``             the sun's upper limb sets through 34' below the horizon
``dawn_civil``         the sun's centre rises through 6° below the horizon
``dawn_nautical``      ... 12° below
``dawn_astronomical``  ... 18° below
``dusk_civil``         the sun's centre sets through 6° below the horizon
``dusk_nautical``      ... 12° below
``dusk_astronomical``  ... 18° below
``solar_noon``         the sun's centre crosses the meridian (upper transit)
=====================  ======================================================

(34' stands for refraction at the horizon, as in almanacs; the sun's semidiameter is computed
from its distance, and its parallax is taken into account.)

The sun's position comes from the low-precision solar coordinates in Jean Meeus, *Astronomical
Algorithms*, chapter 25 (the basis of NOAA's solar calculator): declination within about 0.01°
and the equation of time within a few seconds, for centuries around 2000.

Slots. Time at the longitude is split into *days*: day ``d`` runs from the sun's lower transit
(local "solar midnight") to the next one. Each day has at most one slot per event: a rising
in the first half (lower transit to transit), a setting in the second half, a solar noon at the
transit. So slots are strictly increasing, whatever the season. A rising (setting) exists on a
day only if the sun is below (above) the event's altitude at the start of that half and above
(below) it at its end; otherwise that day has **no slot** -- polar night for a sunrise, polar
day for a sunset, the white nights of summer for an astronomical dusk. A slot is the first whole
UTC second at or after the event (found by bisection on whole seconds), so it is never early and
every machine computes the same instant. A search skips days without a slot, for at most two
years; beyond that it returns ``None`` ("no more slots") rather than looping.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import date, datetime
from functools import lru_cache

from celery_driftsafe.core.instants import from_us, require_aware, to_us
from celery_driftsafe.exceptions import ScheduleError

__all__ = ["EVENTS", "Solar"]

#: event -> (what happens, altitude of the sun's centre in degrees, or None for the upper limb
#: at 34' below the horizon).
EVENTS: dict[str, tuple[str, float | None]] = {
    "dawn_astronomical": ("rising", -18.0),
    "dawn_nautical": ("rising", -12.0),
    "dawn_civil": ("rising", -6.0),
    "sunrise": ("rising", None),
    "solar_noon": ("transit", None),
    "sunset": ("setting", None),
    "dusk_civil": ("setting", -6.0),
    "dusk_nautical": ("setting", -12.0),
    "dusk_astronomical": ("setting", -18.0),
}

_DAY = 86_400
_US_PER_S = 1_000_000
#: Seconds from 0001-01-01T00:00Z (the origin of :func:`to_us`) to J2000.0 (2000-01-01T12:00Z).
_J2000 = (date(2000, 1, 1).toordinal() - 1) * _DAY + _DAY // 2
#: How far a search looks ahead for a day that has the event.
SEARCH_DAYS = 2 * 366
_FIRST_DAY = 2  # keeps the day before in range
_LAST_DAY = date.max.toordinal() - 3
_LIMB_HORIZON = -34 / 60  # degrees: refraction at the horizon, as in almanacs
_SEMIDIAMETER_1AU = 959.63 / 3600  # degrees
_PARALLAX_1AU = 8.794 / 3600  # degrees


def _sun(seconds: float) -> tuple[float, float, float]:
    """The sun at ``seconds`` after 0001-01-01T00:00Z: declination (radians), equation of
    time (seconds, apparent minus mean solar time) and distance (astronomical units)."""
    t = (seconds - _J2000) / _DAY / 36525  # Julian centuries since J2000.0
    mean_longitude = math.radians((280.46646 + t * (36000.76983 + t * 0.0003032)) % 360)
    anomaly = math.radians(357.52911 + t * (35999.05029 - t * 0.0001537))
    eccentricity = 0.016708634 - t * (0.000042037 + t * 0.0000001267)
    centre = math.radians(
        math.sin(anomaly) * (1.914602 - t * (0.004817 + t * 0.000014))
        + math.sin(2 * anomaly) * (0.019993 - t * 0.000101)
        + math.sin(3 * anomaly) * 0.000289
    )
    true_longitude = mean_longitude + centre
    distance = 1.000001018 * (1 - eccentricity**2) / (1 + eccentricity * math.cos(anomaly + centre))
    node = math.radians(125.04 - 1934.136 * t)
    apparent_longitude = true_longitude - math.radians(0.00569 + 0.00478 * math.sin(node))
    mean_obliquity = 23 + (26 + (21.448 - t * (46.815 + t * (0.00059 - t * 0.001813))) / 60) / 60
    obliquity = math.radians(mean_obliquity + 0.00256 * math.cos(node))
    declination = math.asin(math.sin(obliquity) * math.sin(apparent_longitude))
    y = math.tan(obliquity / 2) ** 2
    equation = (
        y * math.sin(2 * mean_longitude)
        - 2 * eccentricity * math.sin(anomaly)
        + 4 * eccentricity * y * math.sin(anomaly) * math.cos(2 * mean_longitude)
        - 0.5 * y * y * math.sin(4 * mean_longitude)
        - 1.25 * eccentricity**2 * math.sin(2 * anomaly)
    )
    return declination, math.degrees(equation) * 240, distance


def _hour_angle_zero(day: int, longitude: float, half: float) -> float:
    """The instant (seconds, see :func:`_sun`) at which the sun's hour angle at ``longitude`` is
    ``half * 180°`` near the mean solar noon of ``day``: its transit (``half=0``) or the lower
    transit before it (``half=-1``)."""
    mean = day * _DAY + _DAY // 2 - longitude * 240 + half * _DAY / 2
    instant = mean
    for _ in range(3):  # the equation of time changes < 30 s a day: converged after three
        instant = mean - _sun(instant)[1]
    return instant


@dataclass(frozen=True)
class _Place:
    event: str
    latitude: float
    longitude: float

    def excess(self, second: int) -> float:
        """The altitude (degrees) of the point the event watches (the sun's centre or upper
        limb) above the event's altitude, at ``second``: positive when the sun is higher."""
        declination, equation, distance = _sun(second)
        # Hour angle from apparent solar time: seconds of the day + equation + longitude.
        hour_angle = math.radians(((second % _DAY + equation) / 240 + self.longitude - 180) % 360)
        latitude = math.radians(self.latitude)
        sine = math.sin(latitude) * math.sin(declination) + math.cos(latitude) * math.cos(
            declination
        ) * math.cos(hour_angle)
        altitude = math.degrees(math.asin(max(-1.0, min(1.0, sine))))
        altitude -= _PARALLAX_1AU / distance * math.cos(math.radians(altitude))
        target = EVENTS[self.event][1]
        if target is None:
            return altitude + _SEMIDIAMETER_1AU / distance - _LIMB_HORIZON
        return altitude - target

    def crossing(self, start: float, end: float, rising: bool) -> int | None:
        """The first whole second in ``[start, end]`` at which the sun has risen above
        (``rising``) or set below the event's altitude, or ``None`` if it is already there at
        ``start`` or not yet at ``end``."""
        low, high = math.ceil(start), math.floor(end)

        def done(second: int) -> bool:
            return (self.excess(second) >= 0) == rising

        if low > high or done(low) or not done(high):
            return None
        while high - low > 1:  # done(high) and not done(low)
            middle = (low + high) // 2
            if done(middle):
                high = middle
            else:
                low = middle
        return high


@lru_cache(maxsize=8192)
def _event_on(place: _Place, day: int) -> int | None:
    """The slot of ``place.event`` on solar day ``day`` (whole seconds, see :func:`_sun`)."""
    what = EVENTS[place.event][0]
    transit = _hour_angle_zero(day, place.longitude, 0)
    if what == "transit":
        return math.ceil(transit)
    if what == "rising":
        return place.crossing(_hour_angle_zero(day, place.longitude, -1), transit, True)
    return place.crossing(transit, _hour_angle_zero(day + 1, place.longitude, -1), False)


def _number(name: str, value: object, bound: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        try:
            value = float(value)  # type: ignore[arg-type]  # Decimal, numeric text
        except (TypeError, ValueError):
            raise ScheduleError(name, f"must be a number, got {value!r}") from None
    number = float(value)
    if not -bound <= number <= bound:
        raise ScheduleError(name, f"must be between -{bound:g} and {bound:g}, got {value!r}")
    return number


@dataclass(frozen=True)
class Solar:
    """Slots at a solar ``event`` (see :data:`EVENTS`) seen from ``latitude`` (degrees north,
    -90 to 90) and ``longitude`` (degrees east, -180 to 180); see the module docstring.

    Bad input raises :class:`~celery_driftsafe.exceptions.ScheduleError` naming the field
    (``"event"``, ``"latitude"`` or ``"longitude"``). Numbers may be given as ``Decimal`` or
    numeric text; they are kept as floats.
    """

    event: str
    latitude: float
    longitude: float

    def __post_init__(self) -> None:
        if self.event not in EVENTS:
            raise ScheduleError(
                "event", f"unknown solar event {self.event!r}; use one of {', '.join(EVENTS)}"
            )
        object.__setattr__(self, "latitude", _number("latitude", self.latitude, 90))
        object.__setattr__(self, "longitude", _number("longitude", self.longitude, 180))

    @property
    def _place(self) -> _Place:
        return _Place(self.event, self.latitude, self.longitude)

    def _day_of(self, second: int) -> int:
        """The solar day at this longitude whose span holds ``second`` (within minutes)."""
        return (second + round(self.longitude * 240)) // _DAY

    def on_day(self, day: date) -> datetime | None:
        """The slot on the solar day of ``day`` (the day whose transit is near noon of that
        date in mean solar time at the longitude), or ``None`` when the event does not happen
        that day (polar night, polar day, white nights)."""
        index = day.toordinal() - 1
        if not _FIRST_DAY <= index <= _LAST_DAY:
            return None
        second = _event_on(self._place, index)
        return None if second is None else from_us(second * _US_PER_S)

    def _search(self, after_us: int) -> datetime | None:
        found = self._search_day(after_us)
        return None if found is None else from_us(found[1] * _US_PER_S)

    def _search_day(self, after_us: int) -> tuple[int, int] | None:
        """The solar day of the first slot at or after ``after_us``, and the slot (seconds)."""
        second = -(-after_us // _US_PER_S)  # slots fall on whole seconds
        first = max(self._day_of(second) - 1, _FIRST_DAY)
        place = self._place
        for day in range(first, min(first + SEARCH_DAYS + 2, _LAST_DAY + 1)):
            found = _event_on(place, day)
            if found is not None and found >= second:
                return day, found
        return None

    @property
    def _every_day(self) -> bool:
        """Whether every solar day has the event, whatever the season: the sun's noon is above
        the event's altitude and its midnight below it at any declination (within ±24°, with a
        degree to spare for refraction, the sun's size and its motion during the day)."""
        if EVENTS[self.event][0] == "transit":
            return True
        altitude = EVENTS[self.event][1]
        depth = 1.0 if altitude is None else abs(altitude)  # the upper limb at 34': under 1°
        return abs(self.latitude) + 24 + depth + 1 < 90

    def count_between(self, start: datetime, end: datetime) -> int:
        """How many slots ``s`` with ``start <= s < end``, as :meth:`slots_between` lists them.

        Where every day has the event (solar noon anywhere; a rising or setting away from the
        poles, see :attr:`_every_day`) the count is the days between the first slots at or
        after ``start`` and ``end``; elsewhere the slots are listed, a day at a time."""
        start_us = to_us(require_aware("after", start))
        end_us = to_us(require_aware("after", end))
        if end_us <= start_us:
            return 0
        if self._every_day:
            first = self._search_day(start_us)
            after = self._search_day(end_us)
            if first is not None and after is not None:
                return max(after[0] - first[0], 0)
        return sum(1 for _ in self._iterate(start_us, end))

    def first_at_or_after(self, instant: datetime) -> datetime | None:
        """Return the smallest slot ``>= instant``, or ``None`` if there is none in the two
        years after it."""
        return self._search(to_us(require_aware("after", instant)))

    def next_after(self, instant: datetime) -> datetime | None:
        """Return the smallest slot ``> instant``, or ``None`` if there is none in the two
        years after it."""
        return self._search(to_us(require_aware("after", instant)) + 1)

    def slots_between(self, start: datetime, end: datetime) -> Iterator[datetime]:
        """Return the slots ``s`` with ``start <= s < end``, ascending."""
        start_us = to_us(require_aware("after", start))
        return self._iterate(start_us, require_aware("after", end))

    def _iterate(self, start_us: int, end: datetime) -> Iterator[datetime]:
        slot = self._search(start_us)
        while slot is not None and slot < end:
            yield slot
            slot = self._search(to_us(slot) + 1)

    def describe(self) -> str:
        """Return e.g. ``"at sunset at 52.52°N 13.405°E"``."""
        north = f"{abs(self.latitude):g}°{'N' if self.latitude >= 0 else 'S'}"
        east = f"{abs(self.longitude):g}°{'E' if self.longitude >= 0 else 'W'}"
        return f"at {self.event.replace('_', ' ')} at {north} {east}"
