"""Calendars of excluded dates, shared by periodic tasks ("public holidays DE", "company
shutdown"): a slot of a task on one of its calendars' dates, or at a wall time its crontab
matches, is not a slot (:mod:`celery_driftsafe.core.exclusions`)."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError
from django.db import models

from celery_driftsafe.core.exclusions import iso_dates, parse_crontab, parse_dates


class Calendar(models.Model):
    """Dates (and optionally wall times, as a crontab) excluded from every task on it.

    Its dates and crontab are read in each task's own time zone. Saving or deleting a calendar
    writes the exclusions of its tasks again and moves their next slot
    (:mod:`celery_driftsafe.definitions.calendars`)."""

    # Unique through Meta.constraints (as PeriodicTask.name: no second LIKE index).
    name = models.CharField(max_length=200, help_text='Unique, e.g. "public holidays DE".')
    description = models.TextField(blank=True, help_text="Notes for people.")
    dates = models.JSONField(
        default=list,
        blank=True,
        help_text="Excluded dates (YYYY-MM-DD), each read in the time zone of the task: no slot "
        "on such a date fires or is recorded missed.",
    )
    crontab = models.CharField(
        max_length=200,
        blank=True,
        help_text="Optional: wall times excluded, as a crontab expression read in the task's "
        "time zone. Five fields exclude whole minutes (* * * * sat,sun: weekends); six, with the "
        "seconds first, exclude whole seconds (*/3 * * * * *). Empty: dates only.",
    )
    changed_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        constraints = [models.UniqueConstraint(fields=["name"], name="driftsafe_calendar_name")]

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        """Every problem on its field; the dates stored sorted, each once."""
        dates, problems = parse_dates(self.dates, "dates")
        _, more = parse_crontab(self.crontab, "UTC", "crontab")
        errors: dict[str, list[str]] = {}
        for problem in problems + more:
            errors.setdefault(problem.field, []).append(problem.message)
        if errors:
            raise ValidationError(errors)
        self.dates = iso_dates(dates)

    def save(self, *args: Any, **kwargs: Any) -> None:
        """Validate (:meth:`clean`), then save: nothing the tasks could not read is stored."""
        self.clean()
        super().save(*args, **kwargs)
