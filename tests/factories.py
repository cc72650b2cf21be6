"""Small builders for test rows."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from celery_driftsafe.models import PeriodicTask, ScheduleKind


def interval_task(name: str, every: int, anchor: datetime, **fields: Any) -> PeriodicTask:
    """An interval task saved with its anchor; ``next_slot_at`` as given or computed."""
    next_slot = fields.pop("next_slot_at", None)
    task = PeriodicTask(
        name=name, task=fields.pop("task", "tests.add"), args=fields.pop("args", [1, 2]),
        schedule_kind=ScheduleKind.INTERVAL, interval_every=every, interval_unit="seconds",
        interval_anchor=anchor, **fields,
    )
    task.full_clean()
    task.save()
    if next_slot is not None:
        PeriodicTask.objects.filter(pk=task.pk).update(next_slot_at=next_slot)
        task.next_slot_at = next_slot
    return task


def crontab_task(name: str, expression: str, timezone: str = "UTC", **fields: Any) -> PeriodicTask:
    minute, hour, dom, month, dow = expression.split()
    next_slot = fields.pop("next_slot_at", None)
    task = PeriodicTask(
        name=name, task=fields.pop("task", "tests.add"), args=fields.pop("args", [1, 2]),
        schedule_kind=ScheduleKind.CRONTAB, crontab_minute=minute, crontab_hour=hour,
        crontab_day_of_month=dom, crontab_month_of_year=month, crontab_day_of_week=dow,
        timezone=timezone, **fields,
    )
    task.full_clean()
    task.save()
    if next_slot is not None:
        PeriodicTask.objects.filter(pk=task.pk).update(next_slot_at=next_slot)
        task.next_slot_at = next_slot
    return task
