"""Which ``beat_schedule`` schedules a beat mirrors, and into what (the table in
docs/reference/scheduler.md)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from celery.schedules import crontab, schedule, solar

from celery_driftsafe.definitions.beat_schedule import EntryError, entry_fields


class EveryOther(schedule):  # type: ignore[misc]
    """A schedule class of a user's own, derived from Celery's ``schedule``."""


@pytest.mark.parametrize(
    ("value", "every", "unit"),
    [
        (30, 30, "seconds"),
        (30.0, 30, "seconds"),
        (0.25, 250_000, "microseconds"),
        (timedelta(milliseconds=1500), 1_500_000, "microseconds"),
        (schedule(timedelta(seconds=0.5)), 500_000, "microseconds"),
        (schedule(timedelta(minutes=2)), 120, "seconds"),
        (1.0000004, 1, "seconds"),  # rounded to whole microseconds, as timedelta rounds it
    ],
)
def test_intervals_are_kept_to_the_microsecond(value: object, every: int, unit: str) -> None:
    fields = entry_fields("e", {"task": "t", "schedule": value})
    assert (fields["schedule_kind"], fields["interval_every"], fields["interval_unit"]) == (
        "interval",
        every,
        unit,
    )


@pytest.mark.parametrize("value", [0, -5, 0.0000004, timedelta(0)])
def test_an_interval_of_zero_or_less_is_rejected(value: object) -> None:
    with pytest.raises(EntryError, match=r"beat_schedule\['e'\].*longer than zero"):
        entry_fields("e", {"task": "t", "schedule": value})


def test_crontab_and_solar_are_mirrored() -> None:
    cron = entry_fields("c", {"task": "t", "schedule": crontab(minute=5)}, "Europe/Berlin")
    assert (cron["schedule_kind"], cron["crontab_minute"], cron["timezone"]) == (
        "crontab",
        "5",
        "Europe/Berlin",
    )
    sun = entry_fields("s", {"task": "t", "schedule": solar("sunset", 52.52, 13.405)})
    assert (sun["schedule_kind"], sun["solar_event"], sun["solar_latitude"]) == (
        "solar",
        "sunset",
        52.52,
    )


def test_other_schedule_types_are_rejected_naming_the_ones_accepted() -> None:
    with pytest.raises(EntryError, match=r"EveryOther schedules are not supported.*solar"):
        entry_fields("x", {"task": "t", "schedule": EveryOther(timedelta(seconds=10))})
