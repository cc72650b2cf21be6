"""Schedule edits: recompute a task's next slot once, and wake every beat.

:func:`prepare_save` runs in ``PeriodicTask.save()``; :func:`after_change` is connected in
:meth:`DriftSafeConfig.ready` to ``post_save`` / ``post_delete``:

* a new task gets its interval anchor (the authority's now, unless given) and its first slot
  strictly after the authority's now (a one-off: its instant);
* an edit of the schedule, or re-enabling a disabled task, moves ``next_slot_at`` to the first
  slot after the authority's now — once, in the edit, not on every beat;
* after the transaction commits, a message on the Redis channel ``<KEY_PREFIX>:changes`` wakes
  sleeping beats; without Redis they see the change on their next loop.

``QuerySet.update()`` bypasses model signals: call :func:`reschedule` and :func:`notify` after
bulk edits. A task left enabled with no due instant (created by ``bulk_create``, raw SQL, a
fixture or a data migration, or re-enabled by ``update(enabled=True)``) is found by the beats
within seconds and scheduled as a save would have (:func:`schedule_unscheduled`, run by each
beat's :class:`BackgroundUnscheduled`).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterable
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

from django.core.exceptions import ValidationError
from django.db import router, transaction
from django.db.models import QuerySet

from celery_driftsafe.conf import get_settings
from celery_driftsafe.core.jitter import due_instant
from celery_driftsafe.core.preview import Preview, upcoming_slots
from celery_driftsafe.exceptions import ClockError
from celery_driftsafe.models import (
    CLAIM_FIELDS,
    PeriodicTask,
    ScheduleKind,
    disabled_by_scheduler,
    schedule_failure,
)
from celery_driftsafe.models.schedule_fields import RESCHEDULE_FIELDS
from celery_driftsafe.store.background_pass import BackgroundPass
from celery_driftsafe.store.clock import authority_clock
from celery_driftsafe.store.redis import channel, get_redis

logger = logging.getLogger("celery_driftsafe.changes")

#: The column a task's calendars write (:mod:`celery_driftsafe.definitions.calendars`), never
#: a save of the task.
CALENDARS_FIELD = "calendar_exclusions"


def authority_now(using: str = "default") -> datetime:
    """The configured authority's now (for edits made outside a beat)."""
    return authority_clock(using).now()


def first_slot(
    task: PeriodicTask,
    now: datetime,
    *,
    after: datetime | None = None,
    taken: Iterable[datetime] = (),
) -> datetime | None:
    """The slot a new, edited or re-enabled task starts at: the first one after ``now`` and
    after ``after`` (the latest slot that already has a run), so that it never lands on a slot
    that fired.

    A one-off keeps its instant even when it lies in the past, so that it still fires
    (subject to its misfire policy) rather than vanishing, unless a run at that instant is
    already recorded (``taken``) or it lies outside the task's bounds.

    Bounds apply (the schedule is bounded): a task valid from a future instant starts at its
    first slot at or after that instant.
    """
    schedule = task.schedule
    if task.schedule_kind == ScheduleKind.ONE_OFF:
        if task.one_off_at is None or task.one_off_at in set(taken):
            return None
        return task.one_off_at if schedule.first_at_or_after(task.one_off_at) else None
    return schedule.next_after(max(now, after) if after is not None else now)


def set_due(task: PeriodicTask) -> None:
    """``due_at`` from ``next_slot_at``: the slot plus the task's jitter."""
    task.due_at = due_instant(task.name, task.next_slot_at, task.jitter_seconds)


def _latest_run_slot(task_id: int, using: str) -> datetime | None:
    """The latest slot that has a run: the latest row's slot, or the end of the span of
    missed slots it stands for."""
    from celery_driftsafe.models import Run

    latest = (
        Run.objects.using(using)
        .filter(periodic_task_id=task_id, slot__isnull=False)
        .order_by("-slot")
        .values_list("slot", "missed_until")
        .first()
    )
    if latest is None:
        return None
    slot, until = latest
    if slot is None or (until is not None and until > slot):
        return until
    return slot


def prepare_save(instance: PeriodicTask, options: dict[str, Any]) -> None:
    """Called by ``PeriodicTask.save()`` before it writes (``options`` are its keyword
    arguments, adjusted in place).

    * JSON fields stored as a JSON string of the right shape are decoded; a value the task
      could not fire with raises :class:`~django.core.exceptions.ValidationError`;
    * a new task gets its interval anchor (the authority's now, unless given) and its first
      slot;
    * an update writes every field but the claim's (:data:`~celery_driftsafe.models.CLAIM_FIELDS`),
      plus ``next_slot_at`` when the schedule changed or the task was re-enabled, moved past
      every slot that already has a run; ``enabled`` and ``disabled_reason`` left as the
      instance loaded them take the database's (the scheduler disables tasks on its own).
    """
    using = options.get("using") or router.db_for_write(PeriodicTask, instance=instance)
    instance.clean()  # decodes JSON strings; raises ValidationError on the field at fault
    adding = instance._state.adding or instance.pk is None or options.get("force_insert")
    previous = None
    if not adding:
        previous = (
            PeriodicTask.objects.using(using)
            .filter(pk=instance.pk)
            .values(*RESCHEDULE_FIELDS, "enabled", "disabled_reason", "name", CALENDARS_FIELD)
            .first()
        )
        if previous is not None:
            # The calendars' part is theirs (definitions/calendars.py): the stored one counts.
            instance.calendar_exclusions = previous[CALENDARS_FIELD]
        if previous is not None and options.get("update_fields") is None:
            options["update_fields"] = [
                f.name
                for f in PeriodicTask._meta.concrete_fields
                if not f.primary_key and f.name not in CLAIM_FIELDS and f.name != CALENDARS_FIELD
            ]
    changed = previous is None or any(
        previous[name] != getattr(instance, name) for name in RESCHEDULE_FIELDS
    )
    # The jitter hashes the name: renaming a jittered task moves its due instants.
    changed = changed or (
        previous is not None and previous["name"] != instance.name and bool(instance.jitter_seconds)
    )
    switch = (instance.enabled, instance.disabled_reason)
    if previous is not None and getattr(instance, "_switch_loaded", None) == switch:
        # Not switched by this save: the database's switch stands (the scheduler may have
        # disabled the task since it was loaded: a run-once task that fired, a broken row).
        instance.enabled, instance.disabled_reason = (
            previous["enabled"],
            previous["disabled_reason"],
        )
    re_enabled = previous is not None and not previous["enabled"] and instance.enabled
    if not (changed or re_enabled):
        return
    # A caller that already holds an authority reading (a beat syncing beat_schedule) passes
    # it as ``instance.driftsafe_now``, saving a round trip and keeping its clock consistent.
    now = getattr(instance, "driftsafe_now", None)
    if now is None:
        try:
            now = authority_now(using)
        except ClockError:
            logger.exception("cannot read the time authority to schedule %s", instance.name)
            raise
    if instance.schedule_kind == ScheduleKind.INTERVAL and instance.interval_anchor is None:
        # Slots count from valid_from when the task has one (django-celery-beat's start_time).
        instance.interval_anchor = instance.valid_from or now
    latest = None if previous is None else _latest_run_slot(instance.pk, using)
    taken = _run_slots_at(instance, using) if previous is not None else []
    try:
        instance.next_slot_at = first_slot(instance, now, after=latest, taken=taken)
        set_due(instance)
    except OverflowError as exc:  # a slot, or its jittered instant, past the year 9999
        raise ValidationError(
            {
                instance.schedule_field(): (
                    f"the task's next slot after {now.isoformat()} (with its jitter) is past "
                    f"the end of the calendar ({exc}); choose a schedule that fires sooner"
                )
            }
        ) from exc
    if re_enabled:
        instance.disabled_reason = ""
        instance.consecutive_failures = 0  # a paused task starts counting again
    fields = options.get("update_fields")
    if fields is not None:
        extra = {"next_slot_at", "due_at", "interval_anchor"} | (
            {"disabled_reason", "consecutive_failures"} if re_enabled else set()
        )
        options["update_fields"] = list(dict.fromkeys([*fields, *extra]))


def _run_slots_at(task: PeriodicTask, using: str) -> list[datetime]:
    """The one-off's instant, when a run of the task is already recorded at it."""
    from celery_driftsafe.models import Run

    if task.one_off_at is None:
        return []
    exists = Run.objects.using(using).filter(periodic_task_id=task.pk, slot=task.one_off_at)
    return [task.one_off_at] if exists.exists() else []


def after_change(sender: Any, instance: PeriodicTask, **kwargs: Any) -> None:
    """``post_save`` / ``post_delete``: wake the beats once the transaction commits."""
    using = kwargs.get("using") or "default"
    transaction.on_commit(notify, using=using)


def notify() -> bool:
    """Publish a wake-up on ``<KEY_PREFIX>:changes``; False when there is no Redis."""
    settings = get_settings()
    client = get_redis(settings)
    if client is None:
        return False
    try:
        client.publish(channel(settings, "changes"), b"1")
    except Exception as exc:  # a notification is an optimisation; polling catches up
        logger.warning("could not publish a schedule-change notification: %s", exc)
        return False
    return True


def reschedule(tasks: Iterable[PeriodicTask], *, using: str = "default") -> int:
    """Recompute ``next_slot_at`` of ``tasks`` from the authority's now (past every slot that
    already has a run) and write it."""
    now = authority_now(using)
    count = 0
    for task in tasks:
        task.next_slot_at = first_slot(
            task,
            now,
            after=_latest_run_slot(task.pk, using),
            taken=_run_slots_at(task, using),
        )
        set_due(task)
        PeriodicTask.objects.using(using).filter(pk=task.pk).update(
            next_slot_at=task.next_slot_at, due_at=task.due_at
        )
        count += 1
    if count:
        transaction.on_commit(notify, using=using)
    return count


def unscheduled_tasks(using: str = "default") -> QuerySet[PeriodicTask]:
    """Enabled tasks with no due instant (found through the due index)."""
    return PeriodicTask.objects.using(using).filter(enabled=True, due_at__isnull=True)


#: SQLite rows whose ``enabled`` or ``due_at`` no ORM write stores (raw SQL): an ``enabled``
#: other than 0 or 1, a ``due_at`` SQLite cannot read as a time or that does not begin with a
#: date. A superset: each is checked as Django reads it (:func:`_normalise_stored`).
_ODD_SQLITE_ROWS = (
    "SELECT id, CAST(enabled AS TEXT), CAST(due_at AS TEXT) FROM {table}"
    " WHERE enabled NOT IN (0, 1)"
    " OR (enabled = 1 AND due_at IS NOT NULL AND (typeof(due_at) != 'text'"
    " OR datetime(due_at) IS NULL"
    " OR due_at NOT GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9][ T][0-9][0-9]:*'))"
)


def _odd_rows(using: str, limit: int) -> list[tuple[int, Any, str | None]]:
    """SQLite only (other databases keep a boolean and an instant in their columns): the
    rows :data:`_ODD_SQLITE_ROWS` finds, at most ``limit``."""
    from django.db import connections

    connection = connections[using]
    if connection.vendor != "sqlite":
        return []
    table = connection.ops.quote_name(PeriodicTask._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(_ODD_SQLITE_ROWS.format(table=table) + " ORDER BY id LIMIT %s", [limit])
        return list(cursor.fetchall())


def _normalise_stored(using: str, limit: int) -> list[str]:
    """Put right what raw SQL stored on SQLite in the two columns every read of due tasks
    filters on, where no read would ever see it again:

    * ``enabled`` holding neither 0 nor 1 (say 2): Django reads it as false and no claim takes
      it, but nothing said why. It is written 0, with the reason, so the admin shows it
      disabled and why.
    * ``due_at`` that Django reads as empty (``'garbage'``) on an enabled task: the claim
      never saw the task due, so it silently never fired. ``due_at`` is derived (the next slot
      plus its jitter), so it is cleared, and the task is then scheduled as any task without a
      due instant is (:func:`schedule_unscheduled`): from its stored next slot, or its first
      slot after now when that cannot be read either.

    Each write is conditional on the value still being the one read. Returns the names."""
    from django.db import connections
    from django.utils.dateparse import parse_datetime

    connection = connections[using]
    table = connection.ops.quote_name(PeriodicTask._meta.db_table)
    names = []
    for pk, enabled, due_text in _odd_rows(using, limit):
        name = str(
            PeriodicTask.objects.using(using).filter(pk=pk).values_list("name", flat=True).first()
        )
        if enabled not in ("0", "1"):  # as text: Django's converter reads a "bool" as 1 or not
            reason = disabled_by_scheduler(f"enabled held {enabled}, not a boolean")
            with connection.cursor() as cursor:
                cursor.execute(
                    f"UPDATE {table} SET enabled = 0, disabled_reason = %s"
                    " WHERE id = %s AND CAST(enabled AS TEXT) = %s",
                    [reason, pk, enabled],
                )
                done = cursor.rowcount
            if done:
                names.append(name)
                logger.error(
                    "task %s disabled: %s", name, reason, extra={"action": "disable", "task": name}
                )
            continue
        try:
            if due_text is not None and parse_datetime(due_text) is not None:
                continue
        except ValueError:
            # Django cannot read it at all: the next-due read and the claim's load, which
            # meet it, disable the task with that reason.
            continue
        with connection.cursor() as cursor:
            cursor.execute(
                f"UPDATE {table} SET due_at = NULL WHERE id = %s AND CAST(due_at AS TEXT) = %s",
                [pk, due_text],
            )
            done = cursor.rowcount
        if done:
            names.append(name)
            logger.warning(
                "task %s had a due instant that is no instant (%r, written without save()):"
                " scheduled again from its next slot",
                name,
                due_text,
                extra={"action": "unscheduled", "task": name},
            )
    return names


#: Tasks without a due instant one pass of :func:`schedule_unscheduled` takes at most.
UNSCHEDULED_BATCH = 500


def schedule_unscheduled(
    now: datetime, *, using: str = "default", limit: int = UNSCHEDULED_BATCH
) -> list[str]:
    """Enabled tasks with no due instant, as ``save()`` never leaves one: written behind its
    back (``bulk_create``, raw SQL, ``loaddata``, a data migration) or re-enabled by
    ``update(enabled=True)``. Each gets what ``save()`` would have given it, from the
    authority's ``now``: an interval anchor if it has none, and its first slot after ``now`` and
    after every slot that already has a run (a next slot already stored is kept, only its due
    instant is added). A task with no slot left (a one-off that ran, past ``valid_until``) is
    disabled as finished, one whose schedule cannot be evaluated is disabled with the reason.
    Each write is conditional on the row still having no due instant, so beats doing this at
    once, or a ``save()`` meanwhile, cannot clash. Returns the names of the tasks scheduled."""
    _normalise_stored(using, limit)
    rows = unscheduled_tasks(using)
    scheduled = []
    for task in rows.order_by("id")[:limit]:
        fields: dict[str, Any] = {}
        try:
            if task.next_slot_at is None:
                if task.schedule_kind == ScheduleKind.INTERVAL and task.interval_anchor is None:
                    task.interval_anchor = fields["interval_anchor"] = task.valid_from or now
                task.next_slot_at = first_slot(
                    task,
                    now,
                    after=_latest_run_slot(task.pk, using),
                    taken=_run_slots_at(task, using),
                )
            problem = "" if task.next_slot_at else "finished: no slot left after now"
            if not problem:
                set_due(task)  # a slot at the calendar's end plus its jitter overflows
        except Exception as exc:
            problem = disabled_by_scheduler(schedule_failure(task, exc))
        if problem:
            fields.update(enabled=False, next_slot_at=None, due_at=None, disabled_reason=problem)
        else:
            fields.update(next_slot_at=task.next_slot_at, due_at=task.due_at)
        if not rows.filter(pk=task.pk).update(**fields):
            continue  # saved, scheduled or disabled meanwhile
        if problem:
            logger.error(
                "task %s had no next slot and cannot get one: %s",
                task.name,
                problem,
                extra={"action": "disable", "task": task.name},
            )
            continue
        scheduled.append(task.name)
        logger.info(
            "task %s had no next slot (written without save()): first slot %s",
            task.name,
            task.next_slot_at,
            extra={"action": "unscheduled", "task": task.name},
        )
    return scheduled


#: Seconds from one look for tasks without a due instant to the next, in each beat.
UNSCHEDULED_INTERVAL_SECONDS = 5.0


class BackgroundUnscheduled(BackgroundPass):
    """A beat's look for tasks without a due instant (:func:`schedule_unscheduled`), every
    :data:`UNSCHEDULED_INTERVAL_SECONDS`, in a thread of its own, batch after batch until none
    is left: scheduling thousands of tasks written by ``bulk_create`` (a query or two each)
    never holds up a round."""

    thread_name = "driftsafe-unscheduled"

    def __init__(self, *, using: str = "default", monotonic: Callable[[], float]) -> None:
        super().__init__(using=using, monotonic=monotonic, first_at=0.0)
        self.scheduled = 0

    def interval(self) -> float | None:
        return UNSCHEDULED_INTERVAL_SECONDS

    def wanted(self) -> bool:
        """Whether there is such a task (one index look-up on the round's connection; on
        SQLite also a look for rows raw SQL left with an odd ``enabled`` or ``due_at``, see
        :func:`_normalise_stored`): a thread, and its connection, only when there is work."""
        return unscheduled_tasks(self.using).exists() or bool(_odd_rows(self.using, 1))

    def run_pass(self, now: datetime) -> None:
        started = self.monotonic()
        try:
            while not self._stop.is_set():
                # the authority's now, carried forward on the monotonic clock
                at = now + timedelta(seconds=self.monotonic() - started)
                batch = schedule_unscheduled(at, using=self.using, limit=UNSCHEDULED_BATCH)
                self.scheduled += len(batch)
                if len(batch) < UNSCHEDULED_BATCH:
                    return
        except Exception as exc:  # an outage, say: the next pass tries again
            logger.warning(
                "scheduling tasks without a next slot failed; trying again in %g s: %s",
                UNSCHEDULED_INTERVAL_SECONDS,
                exc,
                extra={"action": "unscheduled"},
            )


def preview(
    task: PeriodicTask, now: datetime, *, count: int = 10, using: str = "default"
) -> Preview:
    """The next ``count`` slots ``task`` fires, as it stands in memory (a form's values not
    saved yet included), at the authority's ``now``; writes nothing.

    It starts where saving it would leave it: a new task, an edited schedule or a re-enabled
    task at :func:`first_slot` (as :func:`prepare_save` computes it), a saved task whose
    schedule is unchanged at its stored next slot; from there the claim's own plan is stepped
    (:func:`~celery_driftsafe.core.preview.upcoming_slots`). Raises what evaluating the schedule
    raises (:class:`~celery_driftsafe.exceptions.ScheduleError`, ``OverflowError``).

    An interval task without an anchor (and without ``valid_from``) is previewed from ``now``
    as its anchor, which the result names (:attr:`Preview.anchor`): a save anchors it at its
    own now, so the previewed slots are the saved ones only when the save is given this anchor
    (``interval_anchor`` set on the instance; the admin form hands it back)."""
    task = copy.copy(task)
    previous = None
    if task.pk is not None and not task._state.adding:
        previous = (
            PeriodicTask.objects.using(using)
            .filter(pk=task.pk)
            .values(*RESCHEDULE_FIELDS, "enabled", "name", "next_slot_at", "run_count")
            .first()
        )
    if previous is not None:
        task.run_count = previous["run_count"]  # the claim's, not the form's
    changed = previous is None or any(
        previous[name] != getattr(task, name) for name in RESCHEDULE_FIELDS
    )
    changed = changed or (
        previous is not None and previous["name"] != task.name and bool(task.jitter_seconds)
    )
    re_enabled = previous is not None and not previous["enabled"] and task.enabled
    stored = None if previous is None else previous["next_slot_at"]
    anchor = None
    if changed or re_enabled or stored is None:
        if task.schedule_kind == ScheduleKind.INTERVAL and task.interval_anchor is None:
            task.interval_anchor = task.valid_from or now
            anchor = None if task.valid_from else now
        latest = None if previous is None else _latest_run_slot(task.pk, using)
        taken = _run_slots_at(task, using) if previous is not None else []
        start = first_slot(task, now, after=latest, taken=taken)
    else:
        start = stored
    result = upcoming_slots(task.schedule, start, task.limits, zone=task.timezone, count=count)
    return replace(result, anchor=anchor)
