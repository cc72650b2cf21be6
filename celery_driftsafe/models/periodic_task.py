"""Periodic task definitions: the schedule, its options, and the claim state the beats own."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from django.core.exceptions import ValidationError
from django.db import models, router, transaction

from celery_driftsafe.exceptions import ScheduleError
from celery_driftsafe.models.choices import (
    IntervalUnit,
    MisfirePolicy,
    OverlapPolicy,
    ScheduleKind,
    SolarEvent,
    TaskSource,
)
from celery_driftsafe.schedule_fields import CRONTAB_FIELDS, ERROR_FIELDS, KIND_FIELD
from celery_driftsafe.slots import Crontab, Interval, OneOff, Schedule, Solar
from celery_driftsafe.validation import Problem, coerce_json, json_problems, option_problems

#: Stands in for an interval anchor not stored yet, where only the schedule's shape matters
#: (validation, descriptions); never used to compute a real slot.
STAND_IN_ANCHOR = datetime(2000, 1, 1, tzinfo=UTC)

_UNIT_SECONDS = {"seconds": 1, "minutes": 60, "hours": 3600, "days": 86400}

#: The columns the claim writes: never written back by a ``save()`` of a loaded instance.
CLAIM_FIELDS = frozenset({"next_slot_at", "last_slot_at", "run_count"})


class PeriodicTaskQuerySet(models.QuerySet["PeriodicTask"]):
    def delete(self) -> tuple[int, dict[str, int]]:
        """Lock the rows first: a beat claiming one of them finishes (its new run row is then
        found and detached like the others) or skips it, instead of inserting a run for a task
        deleted under it (a foreign key violation at commit)."""
        with transaction.atomic(using=self.db):
            list(self.model._default_manager.using(self.db).select_for_update()
                 .filter(pk__in=list(self.values_list("pk", flat=True))).values_list("pk"))
            return super().delete()


class PeriodicTask(models.Model):
    """A periodic task: what to call, with what, on which schedule, under which policies.

    ``next_slot_at`` is the next slot not yet claimed (UTC); a beat claims the task when the
    authority's clock has reached it, and moves it forward in the same transaction.
    """

    name = models.CharField(max_length=200, unique=True, help_text="Unique, human-chosen name.")
    task = models.CharField(max_length=200, help_text="Registered Celery task name.")
    args = models.JSONField(default=list, blank=True, help_text="JSON list of arguments.")
    kwargs = models.JSONField(default=dict, blank=True, help_text="JSON object of keyword args.")
    # Celery publish options.
    queue = models.CharField(max_length=200, blank=True)
    exchange = models.CharField(max_length=200, blank=True)
    routing_key = models.CharField(max_length=200, blank=True)
    priority = models.PositiveSmallIntegerField(null=True, blank=True)
    expires_seconds = models.FloatField(
        null=True, blank=True, help_text="Message expires this many seconds after its slot."
    )
    headers = models.JSONField(default=dict, blank=True, help_text="Extra message headers.")
    # Schedule: exactly one kind.
    schedule_kind = models.CharField(max_length=16, choices=ScheduleKind.choices)
    interval_every = models.PositiveIntegerField(null=True, blank=True)
    interval_unit = models.CharField(
        max_length=16, choices=IntervalUnit.choices, default=IntervalUnit.SECONDS, blank=True
    )
    interval_anchor = models.DateTimeField(
        null=True, blank=True, help_text="Slots are anchor + k * every; set once, kept forever."
    )
    crontab_second = models.CharField(
        max_length=180, default="0", blank=True,
        help_text="Seconds of the minute (0-59; cron syntax). Empty: 0.",
    )
    crontab_minute = models.CharField(max_length=240, default="*", blank=True)
    crontab_hour = models.CharField(max_length=96, default="*", blank=True)
    crontab_day_of_month = models.CharField(max_length=124, default="*", blank=True)
    crontab_month_of_year = models.CharField(max_length=64, default="*", blank=True)
    crontab_day_of_week = models.CharField(max_length=64, default="*", blank=True)
    timezone = models.CharField(max_length=63, default="UTC", help_text="IANA zone of the crontab.")
    one_off_at = models.DateTimeField(null=True, blank=True)
    solar_event = models.CharField(
        max_length=24, choices=SolarEvent.choices, blank=True,
        help_text="The sun's event the task fires at (as celery.schedules.solar defines it).",
    )
    solar_latitude = models.FloatField(
        null=True, blank=True,
        help_text="Degrees north, -90 to 90 (south is negative).",
    )
    solar_longitude = models.FloatField(
        null=True, blank=True,
        help_text="Degrees east, -180 to 180 (west is negative).",
    )
    # State and policies.
    enabled = models.BooleanField(default=True)
    disabled_reason = models.TextField(blank=True)
    misfire_policy = models.CharField(
        max_length=16, choices=MisfirePolicy.choices, default=MisfirePolicy.DEFAULT, blank=True
    )
    misfire_grace_seconds = models.FloatField(
        null=True, blank=True, help_text="Empty: the project default."
    )
    overlap_policy = models.CharField(
        max_length=16, choices=OverlapPolicy.choices, default=OverlapPolicy.ALLOW
    )
    source = models.CharField(
        max_length=16, choices=TaskSource.choices, default=TaskSource.DATABASE
    )
    next_slot_at = models.DateTimeField(null=True, blank=True)
    last_slot_at = models.DateTimeField(null=True, blank=True)
    run_count = models.PositiveBigIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    changed_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        # The claim reads due tasks in (next_slot_at, id) order; with id in the index a burst
        # (many tasks sharing one next_slot_at) is read in order, without a sort.
        indexes = [
            models.Index(fields=["enabled", "next_slot_at", "id"], name="driftsafe_task_due_id")
        ]

    def __str__(self) -> str:
        return self.name

    @property
    def schedule(self) -> Schedule:
        """The slot arithmetic object for this row; raises :class:`ScheduleError`."""
        return self.build_schedule()

    def build_schedule(self, *, anchor: datetime | None = None) -> Schedule:
        """Build the schedule; ``anchor`` stands in for a not yet stored interval anchor."""
        if self.schedule_kind == ScheduleKind.INTERVAL:
            if not self.interval_every:
                raise ScheduleError("every", "an interval task needs a positive 'every'")
            unit = _UNIT_SECONDS.get(self.interval_unit or "seconds")
            if unit is None:
                raise ScheduleError("every", f"unknown unit {self.interval_unit!r}")
            anchor = self.interval_anchor or anchor
            if anchor is None:
                raise ScheduleError("anchor", "an interval task needs an anchor")
            return Interval(timedelta(seconds=self.interval_every * unit), anchor)
        if self.schedule_kind == ScheduleKind.CRONTAB:
            fields = {argument: getattr(self, name) for name, argument in CRONTAB_FIELDS.items()}
            fields["second"] = fields["second"] or "0"
            return Crontab(**fields, timezone=self.timezone)
        if self.schedule_kind == ScheduleKind.ONE_OFF:
            if self.one_off_at is None:
                raise ScheduleError("at", "a one-off task needs an instant")
            return OneOff(self.one_off_at)
        if self.schedule_kind == ScheduleKind.SOLAR:
            if not self.solar_event:
                raise ScheduleError("event", "a solar task needs an event, such as 'sunset'")
            if self.solar_latitude is None:
                raise ScheduleError("latitude", "a solar task needs a latitude")
            if self.solar_longitude is None:
                raise ScheduleError("longitude", "a solar task needs a longitude")
            return Solar(self.solar_event, self.solar_latitude, self.solar_longitude)
        raise ScheduleError("schedule_kind", f"unknown schedule kind {self.schedule_kind!r}")

    def coerce(self) -> None:
        """Read ``args``/``kwargs``/``headers`` stored as a JSON string of the right shape as
        that value (see :mod:`celery_driftsafe.validation`)."""
        self.args = coerce_json(self.args, list)
        self.kwargs = coerce_json(self.kwargs, dict)
        self.headers = coerce_json(self.headers, dict)

    def problems(self, *, schedule: bool = True) -> list[Problem]:
        """Everything that keeps this row from firing, each naming the model field at fault.
        ``schedule=False`` leaves the schedule out (a caller about to evaluate it anyway)."""
        found = json_problems(self.args, self.kwargs, self.headers)
        found += option_problems(
            task=self.task, priority=self.priority, expires_seconds=self.expires_seconds,
            misfire_grace_seconds=self.misfire_grace_seconds,
            misfire_policy=self.misfire_policy, overlap_policy=self.overlap_policy,
        )
        if not schedule:
            return found
        try:
            # An interval's anchor is stored on first save; any aware instant validates it.
            built = self.build_schedule(anchor=STAND_IN_ANCHOR)
            built.next_after(self.interval_anchor or STAND_IN_ANCHOR)
        except ScheduleError as exc:
            found.append(schedule_problem(exc))
        except (ValueError, OverflowError, TypeError, KeyError) as exc:
            found.append(Problem(self.schedule_field(),
                                 f"the schedule cannot be evaluated: {exc!r}"))
        return found

    def schedule_field(self) -> str:
        """The field to blame when the schedule as a whole cannot be evaluated."""
        return KIND_FIELD.get(str(self.schedule_kind), "schedule_kind")

    def clean(self) -> None:
        """Model validation: every problem on the field at fault."""
        self.coerce()
        errors: dict[str, list[str]] = {}
        for problem in self.problems():
            errors.setdefault(problem.field, []).append(problem.message)
        if errors:
            raise ValidationError(errors)

    objects = PeriodicTaskQuerySet.as_manager()

    def delete(self, using: Any = None, keep_parents: bool = False) -> tuple[int, dict[str, int]]:
        """Delete, with the row locked first (see :meth:`PeriodicTaskQuerySet.delete`)."""
        using = using or router.db_for_write(PeriodicTask, instance=self)
        with transaction.atomic(using=using):
            list(PeriodicTask.objects.using(using).select_for_update().filter(pk=self.pk)
                 .values_list("pk"))
            return super().delete(using=using, keep_parents=keep_parents)

    def save(self, *args: Any, **kwargs: Any) -> None:
        """Save what the user owns; never write the scheduler's claim state back.

        ``next_slot_at``, ``last_slot_at`` and ``run_count`` belong to the claim: an update
        leaves them out (unless named in ``update_fields``), so saving an instance loaded a
        while ago cannot move a task back to a slot that already fired. A schedule edit or a
        re-enable computes a new next slot after every slot that already has a run (see
        :mod:`celery_driftsafe.changes`). A value the task could not fire with raises
        :class:`~django.core.exceptions.ValidationError` naming the field.
        """
        from celery_driftsafe.changes import prepare_save

        prepare_save(self, kwargs)
        super().save(*args, **kwargs)


def schedule_problem(exc: ScheduleError) -> Problem:
    """A :class:`ScheduleError` as a problem of the model field that holds the schedule field."""
    return Problem(SCHEDULE_ERROR_FIELDS.get(exc.field, "schedule_kind"), str(exc))


#: Which model field holds each schedule field named by :class:`ScheduleError`.
SCHEDULE_ERROR_FIELDS = ERROR_FIELDS
