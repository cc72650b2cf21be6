"""Celery's ``beat_schedule`` setting, mirrored into :class:`PeriodicTask` rows.

Every beat syncs at start. The sync is idempotent and race-safe: K beats starting at once
create each entry once (the unique task name decides; the losers see the winner's row), and an
entry whose definition did not change is left alone — so a restart never resets an interval's
anchor. An entry whose definition changed is updated (its next slot recomputed once); a row of
the same name created in the admin is never overwritten. Entries since removed from
``beat_schedule`` are disabled (:func:`disable_removed`), as Celery's own beat drops them, with
the reason :data:`REMOVED`; an entry put back enables its task again, at its first slot after now.
Only the tasks this app synced are touched (``source_app``, its ``main`` name): another Celery
app sharing the database keeps its own. Tasks synced before that was recorded, or by an app
without a name, are named in a warning at start instead (:func:`log_orphans`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

from django.core.exceptions import ValidationError
from django.db import DataError, IntegrityError, transaction
from django.db.models import QuerySet

from celery_driftsafe.celery_app import argument_problem
from celery_driftsafe.core import validation
from celery_driftsafe.core.exclusions import iso_dates, parse_dates
from celery_driftsafe.definitions.upsert import Upserted, upsert_by_name
from celery_driftsafe.exceptions import DriftSafeError
from celery_driftsafe.models import Calendar, IntervalUnit, PeriodicTask, ScheduleKind, TaskSource

logger = logging.getLogger("celery_driftsafe.beat_schedule")


@dataclass
class SyncReport:
    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    #: Tasks this app synced whose entry is gone: disabled.
    removed: list[str] = field(default_factory=list)


#: The reason recorded on a task its app's ``beat_schedule`` no longer has.
REMOVED = "removed from beat_schedule"


class EntryError(DriftSafeError, ValueError):
    """A ``beat_schedule`` entry that cannot be synced or imported: the key of the entry at
    fault (``args``, ``options.headers``, ...) and why."""

    def __init__(self, name: str, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"beat_schedule[{name!r}] {field}: {message}")


def _cron_field(name: str, value: Any) -> str:
    if isinstance(value, str | int):
        return str(value)
    if isinstance(value, set | frozenset | list | tuple):
        return ",".join(str(v) for v in sorted(value))
    raise EntryError(name, "schedule", f"cannot read crontab field {value!r}")


def _json_entry_value(name: str, field: str, value: Any, shape: type) -> Any:
    """``value`` (a list or tuple for ``args``, a mapping otherwise; None: empty) as the JSON
    value it is stored and sent as; raises :class:`EntryError` for anything else, and for
    what :func:`~celery_driftsafe.core.validation.json_value_problem` refuses (NaN, depth, ...)."""
    if value is None:
        return shape()
    if shape is list and not isinstance(value, list | tuple):
        raise EntryError(
            name, field, f"must be a list or tuple of arguments, not {validation.shape(value)}"
        )
    if shape is dict and not isinstance(value, Mapping):
        raise EntryError(name, field, f"must be a dict, not {validation.shape(value)}")
    value = list(value) if shape is list else dict(value)
    problem = validation.json_value_problem(value)
    if problem is not None:
        raise EntryError(name, field, problem)
    # Tuples inside become lists, as stored: an unchanged entry then compares equal.
    return json.loads(json.dumps(value))


def entry_fields(name: str, entry: Mapping[str, Any], timezone: str = "UTC") -> dict[str, Any]:
    """The :class:`PeriodicTask` fields of one ``beat_schedule`` entry; raises
    :class:`EntryError` naming the entry, its key at fault and what is wrong."""
    from celery.schedules import crontab, schedule, solar

    if not isinstance(entry, Mapping):
        raise EntryError(
            name,
            "entry",
            f"must be a dict with 'task' and 'schedule', not {validation.shape(entry)}",
        )
    for key in ("task", "schedule"):
        if key not in entry:
            raise EntryError(name, key, "is missing: an entry needs 'task' and 'schedule'")
    if not isinstance(entry["task"], str) or not entry["task"].strip():
        raise EntryError(
            name, "task", f"must be a task name, not {validation.shape(entry['task'])}"
        )
    sched = entry["schedule"]
    fields: dict[str, Any] = {"task": entry["task"]}
    if isinstance(sched, crontab):
        fields.update(
            schedule_kind=ScheduleKind.CRONTAB,
            crontab_minute=_cron_field(name, sched._orig_minute),
            crontab_hour=_cron_field(name, sched._orig_hour),
            crontab_day_of_month=_cron_field(name, sched._orig_day_of_month),
            crontab_month_of_year=_cron_field(name, sched._orig_month_of_year),
            crontab_day_of_week=_cron_field(name, sched._orig_day_of_week),
            timezone=timezone,
        )
    elif isinstance(sched, solar):
        fields.update(
            schedule_kind=ScheduleKind.SOLAR,
            solar_event=sched.event,
            solar_latitude=float(sched.lat),
            solar_longitude=float(sched.lon),
        )
    else:
        if isinstance(sched, schedule) and type(sched) is schedule:
            every = sched.run_every
        else:
            every = sched
        if isinstance(every, timedelta):
            seconds: Any = every.total_seconds()
        elif isinstance(every, int | float) and not isinstance(every, bool):
            seconds = every
        else:
            raise EntryError(
                name,
                "schedule",
                f"{type(sched).__name__} schedules are not supported (use a number of "
                "seconds, a timedelta, schedule(), crontab() or solar())",
            )
        if not validation.seconds_in_calendar(seconds):
            raise EntryError(
                name,
                "schedule",
                f"interval {seconds!r} s must be a finite number of seconds up to "
                f"{validation.MAX_SECONDS:.0f} (a hundred years)",
            )
        if not isinstance(every, timedelta):
            every = timedelta(seconds=seconds)
        micro = every // timedelta(microseconds=1)
        if micro <= 0:
            raise EntryError(
                name, "schedule", f"interval {every.total_seconds()} s must be longer than zero"
            )
        # Whole seconds in seconds; a fraction of a second in microseconds.
        whole = micro % 1_000_000 == 0
        fields.update(
            schedule_kind=ScheduleKind.INTERVAL,
            interval_every=micro // 1_000_000 if whole else micro,
            interval_unit=IntervalUnit.SECONDS if whole else IntervalUnit.MICROSECONDS,
        )
    fields.update(
        args=_json_entry_value(name, "args", entry.get("args"), list),
        kwargs=_json_entry_value(name, "kwargs", entry.get("kwargs"), dict),
    )
    options = entry.get("options")
    if options is None:
        options = {}
    elif not isinstance(options, Mapping):
        raise EntryError(name, "options", f"must be a dict, not {validation.shape(options)}")
    for key in ("queue", "exchange", "routing_key"):
        fields[key] = str(options.get(key) or "")
    fields["priority"] = options.get("priority")
    expires = options.get("expires")
    fields["expires_seconds"] = None
    fields["valid_until"] = None
    if isinstance(expires, int | float) and not isinstance(expires, bool):
        if not validation.seconds_in_calendar(expires):
            raise EntryError(
                name,
                "options.expires",
                f"must be a finite number of seconds up to {validation.MAX_SECONDS:.0f}, "
                f"not {expires!r}",
            )
        fields["expires_seconds"] = float(expires)
    elif isinstance(expires, datetime):
        # An absolute expiry: Celery's messages expire then, so nothing runs after it.
        if expires.utcoffset() is None:
            expires = expires.replace(tzinfo=ZoneInfo(timezone))
        fields["valid_until"] = expires
    elif expires is not None:
        raise EntryError(name, "options.expires", f"must be seconds or a datetime, not {expires!r}")
    fields["headers"] = _json_entry_value(name, "options.headers", options.get("headers"), dict)
    pause = options.get("pause_after_failures")
    for problem in validation.pause_problems(pause):
        raise EntryError(name, f"options.{problem.field}", problem.message)
    fields["pause_after_failures"] = pause
    if "overlap_policy" in options:  # else the row's own (the admin's, or the default)
        policy = options["overlap_policy"]
        if policy not in validation.OVERLAP_POLICIES:
            raise EntryError(
                name,
                "options.overlap_policy",
                f"unknown policy {policy!r}; use one of {', '.join(validation.OVERLAP_POLICIES)}",
            )
        fields["overlap_policy"] = str(policy)
    fields["excluded_dates"] = _entry_dates(name, options.get("excluded_dates"))
    return fields


def _entry_dates(name: str, value: Any) -> list[str]:
    """An entry's ``options["excluded_dates"]`` (dates, or ISO texts, in the app's time zone)
    as stored: sorted ISO texts, each once."""
    if value is None:
        return []
    if isinstance(value, str) or not isinstance(value, list | tuple | set | frozenset):
        raise EntryError(
            name,
            "options.excluded_dates",
            f"must be a list of dates (date objects or 'YYYY-MM-DD'), not "
            f"{validation.shape(value)}",
        )
    dates, problems = parse_dates(list(value), "excluded_dates")
    if problems:
        raise EntryError(name, "options.excluded_dates", problems[0].message)
    return iso_dates(dates)


def entry_calendars(name: str, entry: Mapping[str, Any]) -> list[str]:
    """The names in an entry's ``options["calendars"]`` (a list of :class:`Calendar` names)."""
    options = entry.get("options")
    value = options.get("calendars") if isinstance(options, Mapping) else None
    if value is None:
        return []
    if isinstance(value, str) or not isinstance(value, list | tuple | set | frozenset):
        raise EntryError(
            name,
            "options.calendars",
            f"must be a list of calendar names, not {validation.shape(value)}",
        )
    if not all(isinstance(item, str) and item.strip() for item in value):
        raise EntryError(
            name, "options.calendars", f"must hold calendar names (text), not {value!r}"
        )
    return sorted({item.strip() for item in value})


def _calendars(name: str, names: list[str], using: str) -> list[Calendar]:
    """The calendars named; raises :class:`EntryError` naming those that do not exist."""
    found = list(Calendar.objects.using(using).filter(name__in=names))
    missing = sorted(set(names) - {calendar.name for calendar in found})
    if missing:
        raise EntryError(
            name,
            "options.calendars",
            f"no calendar named {', '.join(map(repr, missing))}: create it in the admin "
            "(Calendars) or in a data migration first",
        )
    return found


#: The options of an entry's ``options`` this package publishes with.
PUBLISH_OPTIONS = ("queue", "exchange", "routing_key", "priority", "expires", "headers")
#: The options of an entry's ``options`` that set a field of its task, not its message
#: (Celery's own beat passes them to ``apply_async``, which sends what it does not know along
#: as message properties, harmlessly).
TASK_OPTIONS = ("overlap_policy", "pause_after_failures", "excluded_dates", "calendars")


def entry_report(
    entry: Mapping[str, Any], fields: Mapping[str, Any]
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """What of a ``beat_schedule`` entry :func:`entry_fields` brought over (option, the field
    holding it) and what it did not (option, why)."""
    carried = [
        ("task", "task"),
        (f"schedule {entry['schedule']!r}"[:60], f"schedule_kind {fields['schedule_kind']}"),
    ]
    dropped = []
    for key in ("args", "kwargs"):
        if fields.get(key):
            carried.append((key, key))
    options = dict(entry.get("options") or {})
    for key in options:
        if key == "expires" and fields.get("valid_until") is not None:
            carried.append(("options.expires", "valid_until (no slot at or after it)"))
        elif key == "expires":
            carried.append(("options.expires", "expires_seconds"))
        elif key == "calendars":
            carried.append(("options.calendars", "calendars (linked when a beat syncs the entry)"))
        elif key in PUBLISH_OPTIONS or key in TASK_OPTIONS:
            carried.append((f"options.{key}", key))
        else:
            dropped.append(
                (
                    f"options.{key}",
                    f"not a publish option this package sends ({', '.join(PUBLISH_OPTIONS)}), "
                    f"nor a task's ({', '.join(TASK_OPTIONS)})",
                )
            )
    if "overlap_policy" in fields:
        carried.append(("overlap_policy", f"overlap_policy {fields['overlap_policy']}"))
    if entry.get("relative"):
        dropped.append(("relative", "interval slots are anchored, not rounded to the period"))
    for key in entry:
        if key not in ("task", "schedule", "args", "kwargs", "options", "relative"):
            dropped.append((str(key), "not a key of Celery's beat entries"))
    return carried, dropped


def sync_beat_schedule(
    app: Any, *, now: datetime | None = None, using: str = "default"
) -> SyncReport:
    """Mirror ``app.conf.beat_schedule`` into the database (see the module docstring).

    ``now`` is an authority reading used for new anchors and next slots (default: read the
    configured authority)."""
    report = SyncReport()
    timezone = str(app.conf.timezone or "UTC")
    entries = app.conf.beat_schedule or {}
    owner = str(app.main) if app.main else None
    for name, entry in entries.items():
        try:
            fields = entry_fields(name, entry, timezone)
            unfit = argument_problem(
                app, fields["task"], fields.get("args", []), fields.get("kwargs", {})
            )
            if unfit:
                raise EntryError(name, "args", unfit)
            if owner is not None:
                fields["source_app"] = owner
            calendars = entry_calendars(name, entry)
            with transaction.atomic(using=using):  # all of the entry or nothing of it
                _sync_one(name, fields, report, using, now, calendars)
        except ENTRY_ERRORS as exc:
            report.errors[name] = error_text(exc)
            logger.error(
                "beat_schedule entry %r skipped, nothing of it written: %s; fix the entry "
                "(the other entries are synced)",
                name,
                report.errors[name],
                extra={"action": "sync", "task": name},
            )
    if owner is not None:
        report.removed = disable_removed(owner, entries, using)
    log_orphans(entries, owner, using)
    return report


#: What one entry's sync may raise: the entry is skipped and the others go on. An outage
#: (``OperationalError``, a missing table) is not among them: the beat waits it out.
ENTRY_ERRORS = (
    ValueError,
    TypeError,
    OverflowError,
    ValidationError,
    DataError,
    IntegrityError,
)


def error_text(exc: BaseException) -> str:
    """An entry's error as one line naming the field at fault: ``field: message; ...``."""
    if isinstance(exc, ValidationError) and hasattr(exc, "error_dict"):
        return "; ".join(
            f"{field}: {' '.join(messages)}" for field, messages in exc.message_dict.items()
        )
    if isinstance(exc, ValidationError):
        return "; ".join(exc.messages)
    return str(exc) or type(exc).__name__


def disable_removed(owner: str, entries: Mapping[str, Any], using: str = "default") -> list[str]:
    """Disable the enabled tasks that app ``owner`` synced and whose entry its
    ``beat_schedule`` no longer has (each write conditional on the row as read); their names."""
    rows = _enabled_without_entry(entries, using).filter(source_app=owner)
    removed = []
    for pk, name in rows.values_list("pk", "name"):
        if rows.filter(pk=pk).update(
            enabled=False, next_slot_at=None, due_at=None, disabled_reason=REMOVED
        ):
            removed.append(name)
            logger.warning(
                "task %s disabled: app %r's beat_schedule no longer has it (put the entry back "
                "to enable it again)",
                name,
                owner,
                extra={"action": "sync", "task": name},
            )
    return removed


def _enabled_without_entry(entries: Mapping[str, Any], using: str) -> QuerySet[PeriodicTask]:
    """Enabled tasks from a ``beat_schedule`` that ``entries`` do not have."""
    return (
        PeriodicTask.objects.using(using)
        .filter(source=TaskSource.BEAT_SCHEDULE, enabled=True)
        .exclude(name__in=list(entries))
    )


#: Names of orphaned rows one warning lists at most.
ORPHANS_NAMED = 10


def log_orphans(entries: Mapping[str, Any], owner: str | None, using: str = "default") -> list[str]:
    """Warn about enabled tasks from a ``beat_schedule`` that this app's ``beat_schedule``
    does not have and that :func:`disable_removed` leaves alone: synced by another app, or
    before the app was recorded. Returns the names named."""
    orphans = _enabled_without_entry(entries, using)
    if owner is not None:
        orphans = orphans.exclude(source_app=owner)
    names = list(orphans.order_by("name").values_list("name", flat=True)[: ORPHANS_NAMED + 1])
    if names:
        more = " and more" if len(names) > ORPHANS_NAMED else ""
        logger.warning(
            "enabled tasks from beat_schedule that this app's beat_schedule does not have: "
            "%s%s; they keep firing (another Celery app's, or synced before the app was "
            "recorded): disable or delete them in the admin if they are gone from the code",
            ", ".join(names[:ORPHANS_NAMED]),
            more,
            extra={"action": "sync"},
        )
    return names[:ORPHANS_NAMED]


def _sync_one(
    name: str,
    fields: dict[str, Any],
    report: SyncReport,
    using: str,
    now: datetime | None,
    calendar_names: Sequence[str] = (),
) -> None:
    calendars = _calendars(name, list(calendar_names), using)
    outcome = upsert_by_name(
        name,
        fields,
        now=now,
        using=using,
        on_create={"source": TaskSource.BEAT_SCHEDULE},
        may_update=lambda task: task.source == TaskSource.BEAT_SCHEDULE,
        validate=True,
    )
    if outcome != Upserted.REFUSED:
        task = PeriodicTask.objects.using(using).get(name=name)
        linked = set(task.calendars.using(using).values_list("pk", flat=True))
        if linked != {calendar.pk for calendar in calendars}:
            task.calendars.set(calendars)  # its next slot moves (definitions/calendars.py)
            if outcome == Upserted.UNCHANGED:
                outcome = Upserted.UPDATED
        _enable_if_back(name, using, now)
    if outcome == Upserted.CREATED:
        report.created.append(name)
    elif outcome == Upserted.UPDATED:
        report.updated.append(name)
    else:
        if outcome == Upserted.REFUSED:
            logger.warning(
                "beat_schedule entry %r ignored: a task of that name is managed in the database",
                name,
                extra={"action": "sync", "task": name},
            )
        report.unchanged.append(name)


def _enable_if_back(name: str, using: str, now: datetime | None) -> None:
    """An entry put back: enable its task, disabled as :data:`REMOVED`, as a re-enabling
    save does (its first slot after now and after every slot that has a run)."""
    task = (
        PeriodicTask.objects.using(using)
        .filter(name=name, enabled=False, disabled_reason=REMOVED)
        .first()
    )
    if task is None:
        return
    task.enabled = True
    task.driftsafe_now = now  # type: ignore[attr-defined]
    task.save(using=using)
    logger.info(
        "task %s enabled again: its beat_schedule entry is back",
        name,
        extra={"action": "sync", "task": name},
    )
