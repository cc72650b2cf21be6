"""Solar slots: against Celery's own ``celery.schedules.solar`` (which uses ``ephem``), against
published almanac values, through polar day and night, and the :class:`Schedule` contract."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from itertools import pairwise
from zoneinfo import ZoneInfo

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from celery_driftsafe.core import solar as solar_module
from celery_driftsafe.core.schedules import Schedule, Solar
from celery_driftsafe.core.solar import EVENTS
from celery_driftsafe.exceptions import ScheduleError

ephem = pytest.importorskip("ephem", reason="the test group installs ephem for Celery's solar")

QUICK = settings(max_examples=150, deadline=None)
TROMSO = (69.6492, 18.9553)
LONGYEARBYEN = (78.2232, 15.6267)
LONDON = (51.5074, -0.1278)
NEW_YORK = (40.7128, -74.0060)
GREENWICH = (51.4769, 0.0)
S = timedelta(seconds=1)


def utc(year: int, month: int, day: int, hour: int = 0, minute: int = 0) -> datetime:
    return datetime(year, month, day, hour, minute, tzinfo=UTC)


def celery_next(event: str, latitude: float, longitude: float, after: datetime) -> datetime:
    """Celery's answer: ``solar._next_event``, the search its ``remaining_estimate`` uses."""
    from celery.schedules import solar

    found = solar(event, latitude, longitude)._next_event(ephem.Date(after.replace(tzinfo=None)))
    return ephem.Date(found).datetime().replace(tzinfo=UTC)


instants = st.datetimes(
    min_value=datetime(1970, 1, 1), max_value=datetime(2070, 1, 1), timezones=st.just(UTC)
)


# --------------------------------------------------------------------------- Celery / ephem


@QUICK
@given(
    event=st.sampled_from(sorted(EVENTS)),
    latitude=st.floats(-65, 65),
    longitude=st.floats(-180, 180),
    after=instants,
)
# found by CI: ours 18:40:20 that day, ephem's a few seconds before ``after`` (the next day's)
@example(
    event="dusk_nautical", latitude=0.0, longitude=0.0, after=utc(2043, 9, 23, 18, 40) + 17 * S
)
def test_next_slot_agrees_with_celery_solar_below_the_polar_circles(
    event: str, latitude: float, longitude: float, after: datetime
) -> None:
    ours = Solar(event, latitude, longitude).next_after(after)
    assert ours is not None
    theirs = celery_next(event, latitude, longitude, after)
    if abs((ours - theirs).total_seconds()) > 60:
        # An event within a minute of ``after``: the two sun models differ by seconds, so one
        # may find it just after ``after`` and the other just before (giving the next day's).
        at_after = (min(ours, theirs) - after).total_seconds() < 60
        # Otherwise a day whose event one sun model finds and the other does not: allowed only
        # where the sun barely reaches the event's altitude that day (e.g. astronomical dawn at
        # 63°S near midsummer, when the sun dips to about -18° and no further).
        assert at_after or _grazes(event, latitude, longitude, min(ours, theirs)), (ours, theirs)
    # Meeus' low-precision sun: a few seconds; a minute where the sun barely grazes -18°.


def _grazes(event: str, latitude: float, longitude: float, around: datetime) -> bool:
    """Whether the sun's lowest or highest altitude within 12 hours of ``around`` (ephem's sun,
    no refraction) comes within 0.3° of ``event``'s altitude."""
    target = EVENTS[event][1]
    target = -34 / 60 if target is None else target  # the upper limb: near enough for 0.3°
    observer = ephem.Observer()
    observer.lat, observer.lon, observer.pressure = str(latitude), str(longitude), 0
    sun = ephem.Sun()
    altitudes = []
    for minutes in range(-12 * 60, 12 * 60 + 1, 5):
        observer.date = ephem.Date((around + timedelta(minutes=minutes)).replace(tzinfo=None))
        sun.compute(observer)
        altitudes.append(float(sun.alt) * 180 / 3.141592653589793)
    return min(abs(min(altitudes) - target), abs(max(altitudes) - target)) <= 0.3


@pytest.mark.parametrize("place", [TROMSO, LONGYEARBYEN, (-77.85, 166.67)])
@pytest.mark.parametrize("event", sorted(EVENTS))
def test_a_polar_year_of_slots_agrees_with_celery_solar(
    place: tuple[float, float], event: str
) -> None:
    """Every slot of 2024 (through the polar night and the midnight sun) against Celery."""
    schedule = Solar(event, *place)
    slots = list(schedule.slots_between(utc(2024, 1, 1), utc(2025, 1, 1)))
    after = utc(2023, 12, 31, 23, 59)
    theirs = []
    while (found := celery_next(event, *place, after)) < utc(2025, 1, 1):
        theirs.append(found)
        after = found + timedelta(seconds=1)
    assert len(slots) == len(theirs)
    for ours, celery in zip(slots, theirs, strict=True):
        assert abs((ours - celery).total_seconds()) <= 300, (ours, celery)


# --------------------------------------------------------------------------- almanacs


@pytest.mark.parametrize(
    ("place", "event", "day", "zone", "published"),
    [
        # Published sunrise / sunset tables (NOAA's solar calculator, to the minute).
        (LONDON, "sunrise", date(2024, 6, 20), "Europe/London", "04:43"),
        (LONDON, "sunset", date(2024, 6, 20), "Europe/London", "21:21"),
        (LONDON, "sunrise", date(2024, 12, 21), "Europe/London", "08:04"),
        (LONDON, "sunset", date(2024, 12, 21), "Europe/London", "15:53"),
        (NEW_YORK, "sunrise", date(2024, 6, 20), "America/New_York", "05:25"),
        (NEW_YORK, "sunset", date(2024, 6, 20), "America/New_York", "20:31"),
        (NEW_YORK, "sunrise", date(2024, 12, 21), "America/New_York", "07:17"),
        (NEW_YORK, "sunset", date(2024, 12, 21), "America/New_York", "16:32"),
        # The equation of time at its extremes: -14 min 14 s, +16 min 29 s.
        (GREENWICH, "solar_noon", date(2024, 2, 11), "UTC", "12:14"),
        (GREENWICH, "solar_noon", date(2024, 11, 3), "UTC", "11:43"),
    ],
)
def test_published_almanac_values(
    place: tuple[float, float], event: str, day: date, zone: str, published: str
) -> None:
    slot = Solar(event, *place).on_day(day)
    assert slot is not None
    hour, minute = map(int, published.split(":"))
    expected = datetime(day.year, day.month, day.day, hour, minute, 30, tzinfo=ZoneInfo(zone))
    assert abs(slot - expected) <= timedelta(seconds=90), slot.astimezone(ZoneInfo(zone))


def test_equation_of_time_extremes_to_the_second() -> None:
    noon = Solar("solar_noon", *GREENWICH)
    assert noon.on_day(date(2024, 2, 11)) == datetime(2024, 2, 11, 12, 14, 14, tzinfo=UTC)
    assert noon.on_day(date(2024, 11, 3)) == datetime(2024, 11, 3, 11, 43, 31, tzinfo=UTC)


# --------------------------------------------------------------------------- polar


def test_tromso_polar_night_has_no_sunrise_and_the_search_skips_to_january() -> None:
    sunrise = Solar("sunrise", *TROMSO)
    assert sunrise.on_day(date(2024, 12, 21)) is None
    assert Solar("sunset", *TROMSO).on_day(date(2024, 12, 21)) is None
    assert Solar("solar_noon", *TROMSO).on_day(date(2024, 12, 21)) is not None
    assert Solar("dawn_civil", *TROMSO).on_day(date(2024, 12, 21)) is not None
    last = list(sunrise.slots_between(utc(2024, 11, 20), utc(2024, 12, 31)))[-1]
    assert date(2024, 11, 25) <= last.date() <= date(2024, 11, 27)  # "polar night from 27 Nov"
    first = sunrise.next_after(last)
    assert first is not None and date(2025, 1, 14) <= first.date() <= date(2025, 1, 16)


def test_midnight_sun_has_neither_sunset_nor_sunrise() -> None:
    sunset = Solar("sunset", *LONGYEARBYEN)
    assert list(sunset.slots_between(utc(2024, 4, 25), utc(2024, 8, 20))) == []
    assert Solar("sunrise", *LONGYEARBYEN).on_day(date(2024, 6, 21)) is None
    back = sunset.next_after(utc(2024, 6, 1))
    assert back is not None and date(2024, 8, 23) <= back.date() <= date(2024, 8, 25)
    # white nights: no astronomical dusk in Tromsø around midsummer
    dusk = Solar("dusk_astronomical", *TROMSO)
    assert list(dusk.slots_between(utc(2024, 5, 1), utc(2024, 8, 1))) == []


def test_at_the_poles_the_sun_rises_once_a_year() -> None:
    assert Solar("sunrise", 90, 0).next_after(utc(2024, 4, 1)) == datetime(
        2025, 3, 18, 6, 20, 56, tzinfo=UTC
    )
    south = Solar("sunrise", -90, 0).next_after(utc(2024, 4, 1))
    assert south is not None and date(2024, 9, 19) <= south.date() <= date(2024, 9, 23)


def test_the_search_is_bounded_and_ends_in_no_more_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(solar_module, "SEARCH_DAYS", 30)
    assert Solar("sunrise", 90, 0).next_after(utc(2024, 4, 1)) is None
    assert list(Solar("sunrise", 90, 0).slots_between(utc(2024, 4, 1), utc(2026, 1, 1))) == []


def test_two_years_near_the_pole_find_the_few_sunrises() -> None:
    # how long the search takes: python -m benchmarks slots ("sunrise 89.9 N, two years")
    slots = list(Solar("sunrise", 89.9, 45).slots_between(utc(2020, 4, 1), utc(2022, 4, 1)))
    assert 2 <= len(slots) <= 10  # a few days of sunrise each March (and grazes in September)


# --------------------------------------------------------------------------- contract


@QUICK
@given(
    event=st.sampled_from(sorted(EVENTS)),
    latitude=st.floats(-90, 90),
    longitude=st.floats(-180, 180),
    start=instants,
)
def test_schedule_contract(event: str, latitude: float, longitude: float, start: datetime) -> None:
    schedule = Solar(event, latitude, longitude)
    assert isinstance(schedule, Schedule)
    end = start + timedelta(days=4)
    between = list(schedule.slots_between(start, end))
    walked = []
    slot = schedule.first_at_or_after(start)
    while slot is not None and slot < end:
        walked.append(slot)
        slot = schedule.next_after(slot)
    assert between == walked
    assert all(a < b for a, b in pairwise(between))
    for slot in between:
        assert slot.tzinfo is UTC and slot.microsecond == 0
        assert schedule.first_at_or_after(slot) == slot
        assert schedule.next_after(slot - timedelta(microseconds=1)) == slot
    if event == "solar_noon":
        assert len(between) in (3, 4, 5)


def test_input_in_any_zone_gives_utc_and_boundaries() -> None:
    sunset = Solar("sunset", *LONDON)
    slot = sunset.first_at_or_after(datetime(2024, 6, 20, 12, 0, tzinfo=ZoneInfo("Asia/Tokyo")))
    assert slot is not None and slot.tzinfo is UTC
    assert sunset.next_after(slot) == sunset.on_day(date(2024, 6, 20 if slot.day == 19 else 21))
    assert list(sunset.slots_between(slot, slot)) == []
    assert list(sunset.slots_between(slot, slot + timedelta(microseconds=1))) == [slot]


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (("noon", 0, 0), "event"),
        (("sunrise", 91, 0), "latitude"),
        (("sunrise", -90.5, 0), "latitude"),
        (("sunrise", 0, 180.01), "longitude"),
        (("sunrise", "north", 0), "latitude"),
        (("sunrise", 0, None), "longitude"),
        (("sunrise", float("nan"), 0), "latitude"),
        (("sunrise", 0, float("inf")), "longitude"),
    ],
)
def test_bad_input_names_the_field(args: tuple[object, object, object], field: str) -> None:
    with pytest.raises(ScheduleError) as caught:
        Solar(*args)  # type: ignore[arg-type]
    assert caught.value.field == field


def test_naive_instants_are_refused_and_decimals_accepted() -> None:
    schedule = Solar("sunrise", Decimal("52.520008"), Decimal("13.404954"))  # type: ignore[arg-type]
    assert schedule.latitude == pytest.approx(52.520008)
    with pytest.raises(ScheduleError, match="naive"):
        schedule.next_after(datetime(2024, 1, 1))
    assert schedule.describe() == "at sunrise at 52.52°N 13.405°E"
    assert Solar("dusk_civil", -33.87, -151.2).describe() == "at dusk civil at 33.87°S 151.2°W"
