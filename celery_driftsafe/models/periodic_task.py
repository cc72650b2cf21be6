"""Periodic task definitions: the schedule, its options, and the claim state the beats own."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from django.core.exceptions import ImproperlyConfigured, ValidationError
from django.db import models, router, transaction
from django.utils.timezone import now as django_now

from celery_driftsafe.core.bounds import Limits, bound_problems, bounded
from celery_driftsafe.core.exclusions import (
    MAX_CONSECUTIVE_EXCLUSIONS,
    iso_dates,
    parse_dates,
    shared_excluding,
    stored_exclusions,
)
from celery_driftsafe.core.jitter import due_instant
from celery_driftsafe.core.schedules import OneOff, Schedule, Solar, shared_crontab, shared_interval
from celery_driftsafe.core.stored_names import BUFFER_ALL_MAX_WAITING
from celery_driftsafe.core.validation import (
    Problem,
    coerce_json,
    deadline_problems,
    instant_problems,
    json_problems,
    option_problems,
    pause_problems,
)
from celery_driftsafe.exceptions import ScheduleError
from celery_driftsafe.models.choices import (
    MISFIRE_POLICY_CHOICES,
    PROJECT_DEFAULT,
    IntervalUnit,
    OverlapPolicy,
    ScheduleKind,
    SolarEvent,
    TaskSource,
)
from celery_driftsafe.models.schedule_fields import CRONTAB_FIELDS, ERROR_FIELDS, KIND_FIELD

#: Stands in for an interval anchor not stored yet, where only the schedule's shape matters
#: (validation, descriptions); never used to compute a real slot.
STAND_IN_ANCHOR = datetime(2000, 1, 1, tzinfo=UTC)

#: The shortest interval a task may have. A beat waits at least 10 ms between rounds
#: (``scheduler.MIN_WAIT``), so a shorter step cannot fire slot by slot anyway; and a step of
#: a microsecond makes a million slots a second: the beat claimed 10,000 runs of that one task
#: a round, every round, and each round took seconds, so every other task fired seconds late.
MIN_INTERVAL = timedelta(milliseconds=10)

_UNIT_MICROSECONDS = {
    "microseconds": 1,
    "seconds": 10**6,
    "minutes": 60 * 10**6,
    "hours": 3600 * 10**6,
    "days": 86400 * 10**6,
}

#: The columns the scheduler writes (the claim's, the deadline check's ``stale_since``, the
#: failure count of ``pause_after_failures``): never written back by a ``save()`` of a loaded
#: instance.
CLAIM_FIELDS = frozenset(
    {
        "next_slot_at",
        "due_at",
        "last_slot_at",
        "run_count",
        "stale_since",
        "consecutive_failures",
    }
)


def _mirror_due_at(values: dict[str, Any]) -> None:
    """A bulk write that sets ``next_slot_at`` but not ``due_at`` makes the task due at its
    slot: never later than its jittered instant, and the claim, which recomputes the jittered
    instant itself, moves ``due_at`` to it without firing early (see
    :mod:`celery_driftsafe.core.jitter`)."""
    if "next_slot_at" in values and "due_at" not in values:
        values["due_at"] = values["next_slot_at"]


class PeriodicTaskQuerySet(models.QuerySet["PeriodicTask"]):
    def delete(self) -> tuple[int, dict[str, int]]:
        """Lock the rows first: a beat claiming one of them finishes (its new run row is then
        found and detached like the others) or skips it, instead of inserting a run for a task
        deleted under it (a foreign key violation at commit)."""
        with transaction.atomic(using=self.db):
            list(
                self.model._default_manager.using(self.db)
                .select_for_update()
                .filter(pk__in=list(self.values_list("pk", flat=True)))
                .values_list("pk")
            )
            return super().delete()

    def update(self, **kwargs: Any) -> int:
        """``update(next_slot_at=...)`` also sets ``due_at`` (see :func:`_mirror_due_at`); an
        update of anything but the claim's own state stamps ``changed_at``, as ``save()`` does
        (a compare-and-swap claim reads it: see :mod:`celery_driftsafe.claim.claimers`);
        ``update(enabled=True)`` clears ``consecutive_failures``, as a re-enabling save does."""
        _mirror_due_at(kwargs)
        if kwargs.get("enabled") is True:
            kwargs.setdefault("consecutive_failures", 0)
        if kwargs.keys() - CLAIM_FIELDS and "changed_at" not in kwargs:
            kwargs["changed_at"] = django_now()
        return super().update(**kwargs)

    def bulk_create(self, objs: Any, *args: Any, **kwargs: Any) -> list[PeriodicTask]:
        """Rows created in bulk with a ``next_slot_at`` and no ``due_at`` get their due
        instant (the slot plus the task's jitter)."""
        objs = list(objs)
        for obj in objs:
            if obj.due_at is None and obj.next_slot_at is not None:
                obj.due_at = due_instant(obj.name, obj.next_slot_at, obj.jitter_seconds)
        return super().bulk_create(objs, *args, **kwargs)


#: What :meth:`PeriodicTask.save` runs before it writes, given the instance and ``save()``'s
#: keyword arguments (adjusted in place):
#: :func:`celery_driftsafe.definitions.changes.prepare_save`, installed by the app's
#: ``ready()`` through :func:`prepare_saves_with`. The models sit below the layer that keeps a
#: task's next slot right, so they call it without importing it.
_save_preparation: Callable[[PeriodicTask, dict[str, Any]], None] | None = None


def prepare_saves_with(prepare: Callable[[PeriodicTask, dict[str, Any]], None]) -> None:
    """Have every :meth:`PeriodicTask.save` run ``prepare`` before it writes."""
    global _save_preparation
    _save_preparation = prepare


class PeriodicTask(models.Model):
    """A periodic task: what to call, with what, on which schedule, under which policies.

    ``next_slot_at`` is the next slot not yet claimed (UTC); a beat claims the task when the
    authority's clock has reached it, and moves it forward in the same transaction.
    """

    # Unique through Meta.constraints: ``unique=True`` would add a second index on PostgreSQL
    # (``varchar_pattern_ops``, for LIKE) that nothing reads and every task write keeps.
    name = models.CharField(max_length=200, help_text="Unique, human-chosen name.")
    description = models.TextField(blank=True, help_text="Notes for people; not used to run.")
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
        max_length=180,
        default="0",
        blank=True,
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
        max_length=24,
        choices=SolarEvent.choices,
        blank=True,
        help_text="The sun's event the task fires at (as celery.schedules.solar defines it).",
    )
    solar_latitude = models.FloatField(
        null=True,
        blank=True,
        help_text="Degrees north, -90 to 90 (south is negative).",
    )
    solar_longitude = models.FloatField(
        null=True,
        blank=True,
        help_text="Degrees east, -180 to 180 (west is negative).",
    )
    # Bounds and limits (enforced by the claim; see celery_driftsafe.core.bounds).
    valid_from = models.DateTimeField(
        null=True,
        blank=True,
        help_text="No slot before this instant fires; an interval without an anchor counts "
        "its slots from here. Empty: no lower bound.",
    )
    valid_until = models.DateTimeField(
        null=True,
        blank=True,
        help_text="No slot at or after this instant fires, and no message is delivered after "
        "it; the task is then disabled. Empty: no upper bound.",
    )
    run_once = models.BooleanField(
        default=False,
        help_text="Fire one run, then disable the task (re-enabling it allows one more).",
    )
    max_runs = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="Disable the task once its run count reaches this number. Empty: no limit.",
    )
    jitter_seconds = models.FloatField(
        null=True,
        blank=True,
        help_text="Spread each run over this many seconds after its slot, at an instant "
        "derived from the task's name and the slot (the same on every beat). "
        "Empty: on the slot.",
    )
    # Excluded dates (see celery_driftsafe.core.exclusions).
    excluded_dates = models.JSONField(
        default=list,
        blank=True,
        help_text="Dates (YYYY-MM-DD) in the task's time zone on which no slot fires; such a "
        "slot is not recorded missed either.",
    )
    calendars = models.ManyToManyField(
        "celery_driftsafe.Calendar",
        blank=True,
        related_name="tasks",
        help_text="Shared calendars whose dates (and crontab) are excluded too.",
    )
    # Written by the calendars only (celery_driftsafe.definitions.calendars), never by a save of
    # the task: what its calendars exclude, so the claim reads a task's exclusions in its row.
    calendar_exclusions = models.JSONField(
        null=True,
        blank=True,
        editable=False,
        help_text="What the task's calendars exclude ({dates, crontabs}), kept by the "
        "calendars. Empty: no calendar.",
    )
    # State and policies.
    enabled = models.BooleanField(default=True)
    disabled_reason = models.TextField(blank=True)
    misfire_policy = models.CharField(
        max_length=16, choices=MISFIRE_POLICY_CHOICES, default=PROJECT_DEFAULT, blank=True
    )
    misfire_grace_seconds = models.FloatField(
        null=True, blank=True, help_text="Empty: the project default."
    )
    overlap_policy = models.CharField(
        max_length=16,
        choices=OverlapPolicy.choices,
        default=OverlapPolicy.ALLOW,
        help_text="What a slot does while the task's previous run is still running: "
        "allow: run beside it; skip: record the slot skipped; buffer_one: wait (one slot at "
        "most, further ones are skipped) and run as soon as the running one ends; "
        f"buffer_all: wait, every slot (up to {BUFFER_ALL_MAX_WAITING} at once, further ones "
        "are skipped), and run one at a time in slot order; replace: "
        "revoke the running run and run once its body is gone (a prefork worker terminates "
        "it; gevent and eventlet kill it at its next yield); replace on a threads pool (or "
        "solo) waits for the running body to end, then runs. Never two bodies at once.",
    )
    deadline_seconds = models.FloatField(
        null=True,
        blank=True,
        help_text="Each scheduled run must have succeeded this many seconds after its slot; "
        "a run that has not is flagged late (the run_deadline_missed signal). "
        "Empty: no deadline.",
    )
    pause_after_failures = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="Disable (pause) the task once this many of its runs in a row ended failed "
        "(retries exhausted) or its slots were missed; a success starts the count again, "
        "re-enabling the task clears it. Empty or 0: never pause.",
    )
    # Written by the run's outcome and the claim only (celery_driftsafe.claim.pausing).
    consecutive_failures = models.PositiveIntegerField(
        default=0,
        help_text="Runs in a row that ended failed or slots missed since the last success "
        "(counted for pause_after_failures only; cleared on re-enabling).",
    )
    # Written by the beats' deadline check only (celery_driftsafe.beat.deadlines).
    stale_since = models.DateTimeField(
        null=True,
        blank=True,
        help_text="Since when the task is stale: none of its last STALE_AFTER_SLOTS slots "
        "past their deadline succeeded. Empty: not stale (or no deadline).",
    )
    source = models.CharField(
        max_length=16, choices=TaskSource.choices, default=TaskSource.DATABASE
    )
    # NULL, not "": rows written by raw SQL or a benchmark's COPY may leave it out.
    source_app = models.CharField(
        max_length=200,
        null=True,
        blank=True,
        help_text="For a task from beat_schedule: the Celery app (its main name) whose "
        "beat_schedule has it. Empty: not known (synced before this was recorded).",
    )
    next_slot_at = models.DateTimeField(null=True, blank=True)
    due_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="When the next slot is due: the slot plus its jitter (the claim reads this).",
    )
    last_slot_at = models.DateTimeField(null=True, blank=True)
    run_count = models.PositiveBigIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    changed_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        # The claim reads due tasks in (due_at, id) order; with id in the index a burst
        # (many tasks sharing one due_at) is read in order, without a sort.
        indexes = [
            models.Index(fields=["enabled", "due_at", "id"], name="driftsafe_task_due_at_id"),
            # The deadline check reads the few tasks with a deadline (or still flagged stale),
            # not 100,000 rows: see celery_driftsafe.beat.deadlines.
            models.Index(
                fields=["id"],
                name="driftsafe_task_deadline",
                condition=models.Q(deadline_seconds__isnull=False)
                | models.Q(stale_since__isnull=False),
            ),
        ]
        constraints = [models.UniqueConstraint(fields=["name"], name="driftsafe_task_name_once")]

    def __str__(self) -> str:
        return self.name

    @property
    def schedule(self) -> Schedule:
        """The slot arithmetic object for this row, within its bounds (``valid_from``,
        ``valid_until``); raises :class:`ScheduleError`."""
        return bounded(self.excluding(self.build_schedule()), self.valid_from, self.valid_until)

    def excluding(self, schedule: Schedule) -> Schedule:
        """``schedule`` without the slots on the task's excluded dates and its calendars'
        (read in its time zone); ``schedule`` itself when nothing is excluded. Raises
        :class:`ScheduleError` naming ``excluded_dates`` or ``calendars``."""
        if not self.excluded_dates and not self.calendar_exclusions:
            return schedule
        zone = self.timezone or "UTC"
        dates, crontabs = stored_exclusions(self.excluded_dates, self.calendar_exclusions, zone)
        return shared_excluding(schedule, dates, zone, crontabs)

    @property
    def limits(self) -> Limits:
        """What bounds the claim of this row beyond its schedule: the jitter (keyed by the
        name), the bounds and the run limits."""
        return Limits(
            self.name,
            self.jitter_seconds,
            self.valid_from,
            self.valid_until,
            self.run_once,
            self.max_runs,
            self.run_count or 0,
        )

    def build_schedule(self, *, anchor: datetime | None = None) -> Schedule:
        """Build the schedule; ``anchor`` stands in for a not yet stored interval anchor."""
        if self.schedule_kind == ScheduleKind.INTERVAL:
            every = self.interval_every
            if not every:
                raise ScheduleError("every", "an interval task needs a positive 'every'")
            if not isinstance(every, int) or isinstance(every, bool) or every < 0:
                raise ScheduleError("every", f"must be a positive whole number, not {every!r}")
            unit = _UNIT_MICROSECONDS.get(self.interval_unit or "seconds")
            if unit is None:
                raise ScheduleError("every", f"unknown unit {self.interval_unit!r}")
            anchor = self.interval_anchor or anchor
            if anchor is None:
                raise ScheduleError("anchor", "an interval task needs an anchor")
            try:
                step = timedelta(microseconds=every * unit)
            except OverflowError:
                raise ScheduleError(
                    "every",
                    f"{every} {self.interval_unit or 'seconds'} is longer than the calendar "
                    "holds (at most 999999999 days)",
                ) from None
            if step < MIN_INTERVAL:
                raise ScheduleError(
                    "every",
                    f"{every} {self.interval_unit or 'seconds'} is shorter than the shortest "
                    f"interval, {MIN_INTERVAL.total_seconds() * 1000:g} ms: a beat waits at least "
                    "that long between rounds; write 10000 microseconds or more",
                )
            return shared_interval(step, anchor)
        if self.schedule_kind == ScheduleKind.CRONTAB:
            fields = {argument: getattr(self, name) for name, argument in CRONTAB_FIELDS.items()}
            fields["second"] = fields["second"] or "0"
            return shared_crontab(fields, self.timezone)
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
        that value (see :mod:`celery_driftsafe.core.validation`)."""
        self.args = coerce_json(self.args, list)
        self.kwargs = coerce_json(self.kwargs, dict)
        self.headers = coerce_json(self.headers, dict)
        self.excluded_dates = coerce_json(self.excluded_dates, list)

    def publish_problems(self, *, schedule: bool = True, writing: bool = False) -> list[Problem]:
        """The gate of everything published from this row (the claim, the beat's messages
        built ahead, run now, the admin's actions): read it as the claim does
        (:meth:`coerce`), then list what keeps it from being published (:meth:`problems`).
        Empty: it may be published. ``writing=True`` adds the checks of a write."""
        self.coerce()
        return self.problems(schedule=schedule, writing=writing)

    def problems(self, *, schedule: bool = True, writing: bool = False) -> list[Problem]:
        """Everything that keeps this row from firing, each naming the model field at fault.
        ``schedule=False`` leaves the schedule out (a caller about to evaluate it anyway);
        ``writing=True`` adds the checks of a write (:meth:`clean`): every value inside the
        JSON fields, and instants that stay in the calendar (see
        :mod:`celery_driftsafe.core.validation`)."""
        found = json_problems(self.args, self.kwargs, self.headers, contents=writing)
        found += option_problems(
            task=self.task,
            priority=self.priority,
            expires_seconds=self.expires_seconds,
            misfire_grace_seconds=self.misfire_grace_seconds,
            misfire_policy=self.misfire_policy,
            overlap_policy=self.overlap_policy,
        )
        found += deadline_problems(self.deadline_seconds)
        found += pause_problems(self.pause_after_failures)
        found += bound_problems(
            valid_from=self.valid_from,
            valid_until=self.valid_until,
            max_runs=self.max_runs,
            jitter_seconds=self.jitter_seconds,
        )
        if writing:
            # valid_until only ever cuts slots off: any instant will do.
            found += instant_problems(
                one_off_at=self.one_off_at,
                valid_from=self.valid_from,
                interval_anchor=self.interval_anchor,
            )
        if not schedule:
            return found
        if writing:
            dates, date_problems = parse_dates(self.excluded_dates, "excluded_dates")
            found += date_problems
            if not date_problems:
                self.excluded_dates = iso_dates(dates)
        try:
            # An interval's anchor is stored on first save; any aware instant validates it.
            built = self.build_schedule(anchor=STAND_IN_ANCHOR)
            start = self.interval_anchor or STAND_IN_ANCHOR
            built.next_after(start)
            if (
                (self.excluded_dates or self.calendar_exclusions)
                and built.next_after(start) is not None
                and self.excluding(built).next_after(start) is None
            ):
                found.append(
                    Problem(
                        "excluded_dates",
                        "every slot of the schedule is excluded (by these dates or the "
                        f"calendars' crontabs, {MAX_CONSECUTIVE_EXCLUSIONS:,} excluded "
                        "stretches in a row): the task would never fire",
                    )
                )
        except ScheduleError as exc:
            found.append(schedule_problem(exc))
        except (ValueError, OverflowError, TypeError, KeyError) as exc:
            found.append(
                Problem(self.schedule_field(), f"the schedule cannot be evaluated: {exc!r}")
            )
        return found

    def schedule_field(self) -> str:
        """The field to blame when the schedule as a whole cannot be evaluated."""
        return KIND_FIELD.get(str(self.schedule_kind), "schedule_kind")

    def clean(self) -> None:
        """Model validation: every problem on the field at fault."""
        errors: dict[str, list[str]] = {}
        for problem in self.publish_problems(writing=True):
            errors.setdefault(problem.field, []).append(problem.message)
        if errors:
            raise ValidationError(errors)

    objects = PeriodicTaskQuerySet.as_manager()

    def delete(self, using: Any = None, keep_parents: bool = False) -> tuple[int, dict[str, int]]:
        """Delete, with the row locked first (see :meth:`PeriodicTaskQuerySet.delete`)."""
        using = using or router.db_for_write(PeriodicTask, instance=self)
        with transaction.atomic(using=using):
            list(
                PeriodicTask.objects.using(using)
                .select_for_update()
                .filter(pk=self.pk)
                .values_list("pk")
            )
            return super().delete(using=using, keep_parents=keep_parents)

    def save(self, *args: Any, **kwargs: Any) -> None:
        """Save what the user owns; never write the scheduler's claim state back.

        ``next_slot_at``, ``last_slot_at`` and ``run_count`` belong to the claim: an update
        leaves them out (unless named in ``update_fields``), so saving an instance loaded a
        while ago cannot move a task back to a slot that already fired. A schedule edit or a
        re-enable computes a new next slot after every slot that already has a run (see
        :mod:`celery_driftsafe.definitions.changes`). A value the task could not fire with raises
        :class:`~django.core.exceptions.ValidationError` naming the field.
        """
        if _save_preparation is None:
            raise ImproperlyConfigured(
                "celery_driftsafe's app is not ready (its AppConfig.ready() installs what "
                "PeriodicTask.save() runs first): save periodic tasks once Django is set up"
            )
        _save_preparation(self, kwargs)
        super().save(*args, **kwargs)
        self._remember_switch()

    @classmethod
    def from_db(cls, *args: Any, **kwargs: Any) -> PeriodicTask:
        instance = super().from_db(*args, **kwargs)
        instance._remember_switch()
        return instance

    def refresh_from_db(self, *args: Any, **kwargs: Any) -> None:
        super().refresh_from_db(*args, **kwargs)
        self._remember_switch()

    def _remember_switch(self) -> None:
        """Note ``enabled`` and ``disabled_reason`` as loaded (or saved): the scheduler changes
        them behind a loaded instance's back (a finished task, a broken row), so a save that
        leaves them as they were keeps the database's (:func:`~celery_driftsafe.definitions.changes.
        prepare_save`) rather than switching a finished task back on."""
        loaded = self.__dict__  # a deferred field is one missing here (get_deferred_fields)
        if "enabled" in loaded and "disabled_reason" in loaded:
            self._switch_loaded = (loaded["enabled"], loaded["disabled_reason"])

    #: ``from_db`` is Django's, then this: the claim's reader, which builds instances without
    #: ``from_db`` (:mod:`celery_driftsafe.store.loaders`), calls it on each.
    from_db_then = _remember_switch


def unreadable_instants(using: str = "default") -> dict[int, str]:
    """Tasks with an instant column Django cannot read (id -> which column holds what), where
    the database stores any text there (SQLite: raw SQL may write ``2026-13-45``); reading
    such a row raises, and with it the whole query that reads it. Reads every row's instants
    as text: for the path on which a query has failed, not for every page."""
    from django.db import connections
    from django.db.models import TextField
    from django.db.models.functions import Cast
    from django.utils.dateparse import parse_datetime

    if connections[using].vendor != "sqlite":
        return {}
    found: dict[int, str] = {}
    for field in PeriodicTask._meta.concrete_fields:
        if not isinstance(field, models.DateTimeField):
            continue
        rows = (
            PeriodicTask.objects.using(using)
            .filter(**{f"{field.name}__isnull": False})
            .order_by()
            .annotate(stored=Cast(field.name, TextField()))
            .values_list("pk", "stored")
        )
        for pk, text in rows:
            try:
                parse_datetime(text)  # what Django's SQLite converter does with the text
            except ValueError as exc:
                found.setdefault(pk, f"{field.name}: {text!r} is no instant ({exc})")
    return found


def schedule_problem(exc: ScheduleError) -> Problem:
    """A :class:`ScheduleError` as a problem of the model field that holds the schedule field."""
    return Problem(SCHEDULE_ERROR_FIELDS.get(exc.field, "schedule_kind"), str(exc))


def schedule_failure(task: PeriodicTask, exc: Exception) -> str:
    """Why evaluating ``task``'s schedule raised ``exc``, naming the field at fault."""
    if isinstance(exc, ScheduleError):
        return str(schedule_problem(exc))
    return f"{task.schedule_field()}: the schedule cannot be evaluated: {exc!r}"


def disabled_by_scheduler(problem: str) -> str:
    """The ``disabled_reason`` of a task the scheduler disabled for ``problem``."""
    return f"disabled by the scheduler: {problem}"


#: Which model field holds each schedule field named by :class:`ScheduleError`.
SCHEDULE_ERROR_FIELDS = ERROR_FIELDS
