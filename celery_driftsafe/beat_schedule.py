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
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

from django.core.exceptions import ValidationError
from django.db.models import QuerySet

from celery_driftsafe.exceptions import ScheduleError
from celery_driftsafe.models import IntervalUnit, PeriodicTask, ScheduleKind, TaskSource
from celery_driftsafe.upsert import Upserted, upsert_by_name

logger = logging.getLogger(__name__)


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


def _cron_field(value: Any) -> str:
    if isinstance(value, str | int):
        return str(value)
    if isinstance(value, set | frozenset | list | tuple):
        return ",".join(str(v) for v in sorted(value))
    raise ScheduleError("expression", f"cannot read crontab field {value!r}")


def entry_fields(name: str, entry: Mapping[str, Any], timezone: str = "UTC") -> dict[str, Any]:
    """The :class:`PeriodicTask` fields of one ``beat_schedule`` entry; raises ``ValueError``
    (``ScheduleError`` for schedules) naming the entry and what is wrong."""
    from celery.schedules import crontab, schedule, solar

    if not isinstance(entry, Mapping) or "task" not in entry or "schedule" not in entry:
        raise ValueError(f"beat_schedule[{name!r}] needs 'task' and 'schedule'")
    sched = entry["schedule"]
    fields: dict[str, Any] = {"task": entry["task"]}
    if isinstance(sched, crontab):
        fields.update(
            schedule_kind=ScheduleKind.CRONTAB,
            crontab_minute=_cron_field(sched._orig_minute),
            crontab_hour=_cron_field(sched._orig_hour),
            crontab_day_of_month=_cron_field(sched._orig_day_of_month),
            crontab_month_of_year=_cron_field(sched._orig_month_of_year),
            crontab_day_of_week=_cron_field(sched._orig_day_of_week),
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
        elif isinstance(sched, timedelta):
            every = sched
        elif isinstance(sched, int | float) and not isinstance(sched, bool):
            every = timedelta(seconds=sched)
        else:
            raise ScheduleError(
                "schedule_kind",
                f"beat_schedule[{name!r}]: {type(sched).__name__} schedules are not supported "
                "(use a number of seconds, a timedelta, schedule(), crontab() or solar())",
            )
        micro = every // timedelta(microseconds=1)
        if micro <= 0:
            raise ScheduleError(
                "every",
                f"beat_schedule[{name!r}]: interval {every.total_seconds()} s must be "
                "longer than zero",
            )
        # Whole seconds in seconds; a fraction of a second in microseconds.
        whole = micro % 1_000_000 == 0
        fields.update(
            schedule_kind=ScheduleKind.INTERVAL,
            interval_every=micro // 1_000_000 if whole else micro,
            interval_unit=IntervalUnit.SECONDS if whole else IntervalUnit.MICROSECONDS,
        )
    args = list(entry.get("args") or [])
    kwargs = dict(entry.get("kwargs") or {})
    try:
        json.dumps([args, kwargs])
    except (TypeError, ValueError) as exc:
        raise ValueError(f"beat_schedule[{name!r}]: args/kwargs must be JSON: {exc}") from exc
    fields.update(args=args, kwargs=kwargs)
    options = dict(entry.get("options") or {})
    for key in ("queue", "exchange", "routing_key"):
        fields[key] = str(options.get(key) or "")
    fields["priority"] = options.get("priority")
    expires = options.get("expires")
    fields["expires_seconds"] = None
    fields["valid_until"] = None
    if isinstance(expires, int | float) and not isinstance(expires, bool):
        fields["expires_seconds"] = float(expires)
    elif isinstance(expires, datetime):
        # An absolute expiry: Celery's messages expire then, so nothing runs after it.
        if expires.utcoffset() is None:
            expires = expires.replace(tzinfo=ZoneInfo(timezone))
        fields["valid_until"] = expires
    elif expires is not None:
        raise ValueError(
            f"beat_schedule[{name!r}]: options.expires must be seconds or a "
            f"datetime, not {expires!r}"
        )
    fields["headers"] = dict(options.get("headers") or {})
    return fields


#: The options of an entry's ``options`` this package publishes with.
PUBLISH_OPTIONS = ("queue", "exchange", "routing_key", "priority", "expires", "headers")


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
        elif key in PUBLISH_OPTIONS:
            carried.append((f"options.{key}", key))
        else:
            dropped.append(
                (
                    f"options.{key}",
                    f"not a publish option this package sends ({', '.join(PUBLISH_OPTIONS)})",
                )
            )
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
            if owner is not None:
                fields["source_app"] = owner
            _sync_one(name, fields, report, using, now)
        except (ValueError, ValidationError) as exc:
            report.errors[name] = "; ".join(getattr(exc, "messages", [])) or str(exc)
            logger.error(
                "beat_schedule entry %r ignored: %s",
                name,
                exc,
                extra={"action": "sync", "task": name},
            )
    if owner is not None:
        report.removed = disable_removed(owner, entries, using)
    log_orphans(entries, owner, using)
    return report


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
    name: str, fields: dict[str, Any], report: SyncReport, using: str, now: datetime | None
) -> None:
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
