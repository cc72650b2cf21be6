"""Names a run, a task or a schedule takes in the database, with their labels for forms and the
admin. The run statuses and kinds and the policies are the core's
(:mod:`celery_driftsafe.core.stored_names`), which the claim and the worker read too; the
names only the tables use are Django's ``TextChoices`` here."""

from __future__ import annotations

from django.db import models

from celery_driftsafe.core.stored_names import (
    MisfirePolicy,
    OverlapPolicy,
    RunKind,
    RunStatus,
)

__all__ = [
    "MISFIRE_POLICY_CHOICES",
    "PROJECT_DEFAULT",
    "IntervalUnit",
    "MisfirePolicy",
    "OverlapPolicy",
    "RunKind",
    "RunStatus",
    "ScheduleKind",
    "SolarEvent",
    "TaskSource",
]

#: A task's blank ``misfire_policy``: the project's ``MISFIRE_POLICY``.
PROJECT_DEFAULT = ""


class ScheduleKind(models.TextChoices):
    INTERVAL = "interval", "Interval"
    CRONTAB = "crontab", "Crontab"
    ONE_OFF = "one_off", "One-off"
    SOLAR = "solar", "Solar"


class SolarEvent(models.TextChoices):
    """The events of ``celery.schedules.solar`` (see :mod:`celery_driftsafe.core.solar`)."""

    DAWN_ASTRONOMICAL = "dawn_astronomical", "Astronomical dawn (sun 18° below, rising)"
    DAWN_NAUTICAL = "dawn_nautical", "Nautical dawn (sun 12° below, rising)"
    DAWN_CIVIL = "dawn_civil", "Civil dawn (sun 6° below, rising)"
    SUNRISE = "sunrise", "Sunrise"
    SOLAR_NOON = "solar_noon", "Solar noon"
    SUNSET = "sunset", "Sunset"
    DUSK_CIVIL = "dusk_civil", "Civil dusk (sun 6° below, setting)"
    DUSK_NAUTICAL = "dusk_nautical", "Nautical dusk (sun 12° below, setting)"
    DUSK_ASTRONOMICAL = "dusk_astronomical", "Astronomical dusk (sun 18° below, setting)"


class IntervalUnit(models.TextChoices):
    MICROSECONDS = "microseconds", "microseconds"
    SECONDS = "seconds", "seconds"
    MINUTES = "minutes", "minutes"
    HOURS = "hours", "hours"
    DAYS = "days", "days"


#: A task's ``misfire_policy``: blank for the project's default (``MISFIRE_POLICY``), or one of
#: the policies.
MISFIRE_POLICY_CHOICES = [(PROJECT_DEFAULT, "Project default"), *MisfirePolicy.choices]


class TaskSource(models.TextChoices):
    DATABASE = "database", "Database / admin"
    BEAT_SCHEDULE = "beat_schedule", "Celery beat_schedule"
