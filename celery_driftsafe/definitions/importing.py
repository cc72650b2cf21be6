"""What ``driftsafe_import`` reads: each task of Celery's ``beat_schedule`` or of
django-celery-beat's database as an :class:`Entry` (the fields it becomes here, what was
brought over and what was not, or why it cannot be imported). The command
(``management/commands/driftsafe_import.py``) plans and writes them."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from celery_driftsafe.core.validation import loads_json
from celery_driftsafe.definitions.beat_schedule import entry_fields, entry_report
from celery_driftsafe.models import IntervalUnit, ScheduleKind, TaskSource

BEAT_SCHEDULE = "beat_schedule"
DJANGO_CELERY_BEAT = "django_celery_beat"


@dataclass
class Entry:
    """One task to import: its fields, or why it cannot be imported."""

    name: str
    origin: str
    fields: dict[str, Any] = field(default_factory=dict)
    #: Set only when the task is created (an interval's anchor).
    on_create: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    notes: list[str] = field(default_factory=list)
    #: (source option, what holds it here) for each option brought over.
    carried: list[tuple[str, str]] = field(default_factory=list)
    #: (source option, why) for each option not brought over.
    dropped: list[tuple[str, str]] = field(default_factory=list)


# -- sources ---------------------------------------------------------------------------------


def from_beat_schedule(app: Any) -> list[Entry]:
    """The entries of ``app.conf.beat_schedule``, converted as a beat converts them."""
    timezone = str(app.conf.timezone or "UTC")
    entries = []
    for name, raw in (app.conf.beat_schedule or {}).items():
        entry = Entry(name=str(name), origin=BEAT_SCHEDULE)
        try:
            entry.fields = {**entry_fields(name, raw, timezone), "source": TaskSource.BEAT_SCHEDULE}
            entry.carried, entry.dropped = entry_report(raw, entry.fields)
        except (ValueError, TypeError, OverflowError) as exc:  # EntryError among them
            entry.error = str(exc)
        entries.append(entry)
    return entries


_DCB_UNITS = {
    "days": IntervalUnit.DAYS,
    "hours": IntervalUnit.HOURS,
    "minutes": IntervalUnit.MINUTES,
    "seconds": IntervalUnit.SECONDS,
    "microseconds": IntervalUnit.MICROSECONDS,
}


def _json(text: str | None, default: Any, what: str) -> Any:
    """The value of a django-celery-beat JSON column, read as the admin form reads typed
    JSON (:func:`~celery_driftsafe.core.validation.loads_json`: no NaN, bounded depth and size)."""
    if not text:
        return default
    try:
        return loads_json(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} is not valid JSON: {exc}") from None
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None


def _dcb_schedule(row: Any, entry: Entry) -> dict[str, Any]:
    carried = entry.carried
    if row.clocked_id is not None:
        carried.append(
            (f"clocked {row.clocked.clocked_time.isoformat()}", "schedule_kind one_off, one_off_at")
        )
        return {"schedule_kind": ScheduleKind.ONE_OFF, "one_off_at": row.clocked.clocked_time}
    if row.solar_id is not None:
        sun = row.solar
        carried.append(
            (
                f"solar {sun.event} {sun.latitude} {sun.longitude}",
                "schedule_kind solar, solar_event, solar_latitude, solar_longitude",
            )
        )
        return {
            "schedule_kind": ScheduleKind.SOLAR,
            "solar_event": sun.event,
            "solar_latitude": float(sun.latitude),
            "solar_longitude": float(sun.longitude),
        }
    if row.interval_id is not None:
        every, period = row.interval.every, row.interval.period
        carried.append(
            (
                f"interval every {every} {period}",
                "schedule_kind interval, interval_every, interval_unit",
            )
        )
        if period == "microseconds" and every % 1_000_000 == 0:
            every, period = every // 1_000_000, "seconds"
        if every <= 0 or period not in _DCB_UNITS:
            raise ValueError(f"interval every {every} {period} is not supported")
        anchor = row.start_time or row.last_run_at
        if anchor is not None:
            entry.on_create["interval_anchor"] = anchor
            carried.append(
                (
                    "start_time" if row.start_time else "last_run_at",
                    f"interval_anchor {anchor.isoformat()} (slots count from it)",
                )
            )
        return {
            "schedule_kind": ScheduleKind.INTERVAL,
            "interval_every": every,
            "interval_unit": _DCB_UNITS[period],
        }
    if row.crontab_id is not None:
        cron = row.crontab
        zone = str(cron.timezone or "UTC")
        carried.append(
            (
                f"crontab {cron.minute} {cron.hour} {cron.day_of_month} "
                f"{cron.month_of_year} {cron.day_of_week} ({zone})",
                "schedule_kind crontab, crontab_*, timezone",
            )
        )
        return {
            "schedule_kind": ScheduleKind.CRONTAB,
            "crontab_minute": cron.minute,
            "crontab_hour": cron.hour,
            "crontab_day_of_month": cron.day_of_month,
            "crontab_month_of_year": cron.month_of_year,
            "crontab_day_of_week": cron.day_of_week,
            "timezone": zone,
        }
    raise ValueError("it has no schedule")


def _dcb_row(row: Any, entry: Entry) -> dict[str, Any]:
    """The fields of one django-celery-beat task; records what went where on ``entry``."""
    fields = _dcb_schedule(row, entry)
    carried = entry.carried
    fields.update(
        task=row.task,
        args=_json(row.args, [], "args"),
        kwargs=_json(row.kwargs, {}, "kwargs"),
        headers=_json(row.headers, {}, "headers"),
        queue=row.queue or "",
        exchange=row.exchange or "",
        routing_key=row.routing_key or "",
        priority=row.priority,
        expires_seconds=(float(row.expire_seconds) if row.expire_seconds is not None else None),
        enabled=row.enabled,
        source=TaskSource.DATABASE,
        description=row.description or "",
        valid_from=row.start_time,
        valid_until=row.expires,
        run_once=bool(row.one_off),
    )
    carried[:0] = [("name", "name")]
    carried.append(("task", "task"))
    for name, value in (
        ("args", fields["args"]),
        ("kwargs", fields["kwargs"]),
        ("headers", fields["headers"]),
    ):
        if value:
            carried.append((name, f"{name} {json.dumps(value)[:40]}"))
    for name in ("queue", "exchange", "routing_key", "priority", "description"):
        value = fields[name]
        if value not in ("", None):
            shown = repr(value[:40]) if isinstance(value, str) else value
            carried.append((name, f"{name} {shown}"))
    if row.expire_seconds is not None:
        carried.append(("expire_seconds", f"expires_seconds {fields['expires_seconds']:g}"))
    if row.start_time is not None:
        carried.append(("start_time", f"valid_from {row.start_time.isoformat()}"))
    if row.expires is not None:
        carried.append(
            (
                "expires",
                f"valid_until {row.expires.isoformat()} (no slot at or "
                "after it; messages expire by then)",
            )
        )
    if row.one_off:
        carried.append(("one_off", "run_once (disabled after its next run)"))
    carried.append(("enabled", f"enabled {row.enabled}"))
    if row.last_run_at is not None:
        entry.on_create["last_slot_at"] = row.last_run_at
        carried.append(
            ("last_run_at", f"last_slot_at {row.last_run_at.isoformat()} (when created)")
        )
    if row.total_run_count:
        entry.on_create["run_count"] = int(row.total_run_count)
        carried.append(("total_run_count", f"run_count {row.total_run_count} (when created)"))
    return fields


def from_django_celery_beat() -> list[Entry]:
    """django-celery-beat's periodic tasks (not its internal ``celery.backend_cleanup``)."""
    from django_celery_beat.models import PeriodicTask as BeatTask

    rows = BeatTask.objects.select_related("interval", "crontab", "clocked", "solar").order_by(
        "name"
    )
    entries = []
    for row in rows:
        entry = Entry(name=row.name, origin=DJANGO_CELERY_BEAT)
        try:
            entry.fields = _dcb_row(row, entry)
        except (ValueError, TypeError, OverflowError) as exc:
            entry.error = str(exc)
        entries.append(entry)
    return entries


# -- planning and applying -------------------------------------------------------------------
