"""Names a run, a task or a schedule takes in the database, with their labels for forms and the
admin."""

from __future__ import annotations

from django.db import models

from celery_driftsafe.core import stored_names


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


class MisfirePolicy(models.TextChoices):
    DEFAULT = "", "Project default"
    FIRE_ONCE = stored_names.MisfirePolicy.FIRE_ONCE.value, "Fire once for all missed slots"
    FIRE_ALL = stored_names.MisfirePolicy.FIRE_ALL.value, "Fire every missed slot (bounded)"
    SKIP = stored_names.MisfirePolicy.SKIP.value, "Skip to the next future slot"


class OverlapPolicy(models.TextChoices):
    ALLOW = stored_names.OverlapPolicy.ALLOW.value, "Allow overlapping runs"
    SKIP = stored_names.OverlapPolicy.SKIP.value, "Skip a slot while the previous run is running"


class RunStatus(models.TextChoices):
    CLAIMED = stored_names.RunStatus.CLAIMED.value, "Claimed"
    DISPATCHED = stored_names.RunStatus.DISPATCHED.value, "Dispatched"
    STARTED = stored_names.RunStatus.STARTED.value, "Started"
    RETRYING = stored_names.RunStatus.RETRYING.value, "Retry scheduled"
    SUCCEEDED = stored_names.RunStatus.SUCCEEDED.value, "Succeeded"
    FAILED = stored_names.RunStatus.FAILED.value, "Failed"
    SKIPPED = stored_names.RunStatus.SKIPPED.value, "Skipped"
    MISSED = stored_names.RunStatus.MISSED.value, "Missed"
    EXPIRED = stored_names.RunStatus.EXPIRED.value, "Expired"
    REVOKED = stored_names.RunStatus.REVOKED.value, "Revoked"


class RunKind(models.TextChoices):
    SCHEDULED = stored_names.RunKind.SCHEDULED.value, "Scheduled"
    MANUAL = stored_names.RunKind.MANUAL.value, "Run now"
    ADHOC = stored_names.RunKind.ADHOC.value, "Ad-hoc call"


class TaskSource(models.TextChoices):
    DATABASE = "database", "Database / admin"
    BEAT_SCHEDULE = "beat_schedule", "Celery beat_schedule"
