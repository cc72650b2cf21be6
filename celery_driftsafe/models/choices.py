"""Names a run, a task or a schedule takes in the database, with their labels for forms and the
admin."""

from __future__ import annotations

from django.db import models

from celery_driftsafe import names


class ScheduleKind(models.TextChoices):
    INTERVAL = "interval", "Interval"
    CRONTAB = "crontab", "Crontab"
    ONE_OFF = "one_off", "One-off"
    SOLAR = "solar", "Solar"


class SolarEvent(models.TextChoices):
    """The events of ``celery.schedules.solar`` (see :mod:`celery_driftsafe.solar`)."""

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


class MisfirePolicy(models.TextChoices):
    DEFAULT = "", "Project default"
    FIRE_ONCE = names.MisfirePolicy.FIRE_ONCE.value, "Fire once for all missed slots"
    FIRE_ALL = names.MisfirePolicy.FIRE_ALL.value, "Fire every missed slot (bounded)"
    SKIP = names.MisfirePolicy.SKIP.value, "Skip to the next future slot"


class OverlapPolicy(models.TextChoices):
    ALLOW = names.OverlapPolicy.ALLOW.value, "Allow overlapping runs"
    SKIP = names.OverlapPolicy.SKIP.value, "Skip a slot while the previous run is running"


class RunStatus(models.TextChoices):
    CLAIMED = names.RunStatus.CLAIMED.value, "Claimed"
    DISPATCHED = names.RunStatus.DISPATCHED.value, "Dispatched"
    STARTED = names.RunStatus.STARTED.value, "Started"
    RETRYING = names.RunStatus.RETRYING.value, "Retry scheduled"
    SUCCEEDED = names.RunStatus.SUCCEEDED.value, "Succeeded"
    FAILED = names.RunStatus.FAILED.value, "Failed"
    SKIPPED = names.RunStatus.SKIPPED.value, "Skipped"
    MISSED = names.RunStatus.MISSED.value, "Missed"
    EXPIRED = names.RunStatus.EXPIRED.value, "Expired"
    REVOKED = names.RunStatus.REVOKED.value, "Revoked"


class RunKind(models.TextChoices):
    SCHEDULED = names.RunKind.SCHEDULED.value, "Scheduled"
    MANUAL = names.RunKind.MANUAL.value, "Run now"
    ADHOC = names.RunKind.ADHOC.value, "Ad-hoc call"


class TaskSource(models.TextChoices):
    DATABASE = "database", "Database / admin"
    BEAT_SCHEDULE = "beat_schedule", "Celery beat_schedule"
