"""Small builders for test rows."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from celery_driftsafe.models import PeriodicTask, ScheduleKind


def _saved(name: str, fields: dict[str, Any]) -> PeriodicTask:
    """Validate and save; then force ``next_slot_at`` when the test gives one (the save itself
    computes it from the authority's now)."""
    next_slot = fields.pop("next_slot_at", None)
    fields.setdefault("task", "tests.add")
    fields.setdefault("args", [1, 2])
    task = PeriodicTask(name=name, **fields)
    task.full_clean()
    task.save()
    if next_slot is not None:
        PeriodicTask.objects.filter(pk=task.pk).update(next_slot_at=next_slot)
        task.next_slot_at = next_slot
    return task


def interval_task(name: str, every: int, anchor: datetime, **fields: Any) -> PeriodicTask:
    """An interval task saved with its anchor; ``next_slot_at`` as given or computed."""
    return _saved(
        name,
        {
            "schedule_kind": ScheduleKind.INTERVAL,
            "interval_every": every,
            "interval_unit": "seconds",
            "interval_anchor": anchor,
            **fields,
        },
    )


def crontab_task(name: str, expression: str, timezone: str = "UTC", **fields: Any) -> PeriodicTask:
    minute, hour, dom, month, dow = expression.split()
    return _saved(
        name,
        {
            "schedule_kind": ScheduleKind.CRONTAB,
            "crontab_minute": minute,
            "crontab_hour": hour,
            "crontab_day_of_month": dom,
            "crontab_month_of_year": month,
            "crontab_day_of_week": dow,
            "timezone": timezone,
            **fields,
        },
    )


def solar_task(
    name: str, event: str, latitude: float, longitude: float, **fields: Any
) -> PeriodicTask:
    return _saved(
        name,
        {
            "schedule_kind": ScheduleKind.SOLAR,
            "solar_event": event,
            "solar_latitude": latitude,
            "solar_longitude": longitude,
            **fields,
        },
    )
