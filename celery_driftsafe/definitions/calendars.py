"""Calendars and the tasks on them: what a task's calendars exclude is copied into its row
(``PeriodicTask.calendar_exclusions``), so the claim reads a task's exclusions with the task
and no query more; this module keeps that copy right and moves the next slot when it changes.

Connected in :meth:`DriftSafeConfig.ready`:

* a calendar saved (its dates or crontab edited): every task on it;
* a calendar deleted: every task that was on it;
* ``task.calendars`` changed (``add``, ``remove``, ``set``, ``clear``, from either side,
  the admin's form included): the tasks concerned.

Each such task gets its calendars' exclusions written again and, when enabled and they
changed, its next slot recomputed from the authority's now as a schedule edit does
(:func:`celery_driftsafe.definitions.changes.reschedule`: after every slot that already has a
run), then the beats are woken. A task whose schedule cannot be evaluated keeps its next slot;
the claim disables it with the reason.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from django.db import transaction

from celery_driftsafe.core.exclusions import iso_dates, parse_dates
from celery_driftsafe.definitions import changes
from celery_driftsafe.models import Calendar, PeriodicTask

logger = logging.getLogger("celery_driftsafe.calendars")


def exclusions_of(calendars: Iterable[Calendar]) -> dict[str, list[str]] | None:
    """What ``calendars`` exclude together, as stored on a task: ``{"dates": [...],
    "crontabs": [...]}`` (sorted, each once), or None when they exclude nothing."""
    dates = []
    crontabs: set[str] = set()
    for calendar in calendars:
        dates += parse_dates(calendar.dates, "dates")[0]
        if calendar.crontab.strip():
            crontabs.add(calendar.crontab.strip())
    if not dates and not crontabs:
        return None
    return {"dates": iso_dates(dates), "crontabs": sorted(crontabs)}


def refresh_tasks(task_ids: Iterable[int], *, using: str = "default") -> list[str]:
    """Write the calendars' exclusions of the tasks ``task_ids`` again, and reschedule those
    enabled whose exclusions changed; the names of the tasks rescheduled."""
    ids = sorted(set(task_ids))
    if not ids:
        return []
    tasks = PeriodicTask.objects.using(using).filter(pk__in=ids).order_by("pk")
    by_task: dict[int, list[Calendar]] = {pk: [] for pk in ids}
    through = PeriodicTask.calendars.through.objects.using(using)
    for link in through.filter(periodictask_id__in=ids).select_related("calendar"):
        by_task[link.periodictask_id].append(link.calendar)
    moved = []
    with transaction.atomic(using=using):
        for task in tasks.select_for_update():
            exclusions = exclusions_of(by_task.get(task.pk, ()))
            if exclusions == task.calendar_exclusions:
                continue
            PeriodicTask.objects.using(using).filter(pk=task.pk).update(
                calendar_exclusions=exclusions
            )
            task.calendar_exclusions = exclusions
            if not task.enabled:
                continue  # enabling it again computes its next slot
            try:
                changes.reschedule([task], using=using)
            except Exception as exc:  # its row is broken otherwise: the claim says why
                logger.warning(
                    "task %s: its calendars changed, but its next slot cannot be computed: %s",
                    task.name,
                    exc,
                    extra={"action": "calendar-reschedule", "task": task.name},
                )
                continue
            moved.append(task.name)
    if moved:
        logger.info(
            "calendars changed: next slot recomputed for %s",
            ", ".join(moved),
            extra={"action": "calendar-reschedule"},
        )
    return moved


# -- signal receivers (connected in apps.ready) ---------------------------------------------


def after_calendar_save(sender: Any, instance: Calendar, **kwargs: Any) -> None:
    """``post_save`` of a calendar: its tasks."""
    using = kwargs.get("using") or "default"
    refresh_tasks(instance.tasks.using(using).values_list("pk", flat=True), using=using)


def before_calendar_delete(sender: Any, instance: Calendar, **kwargs: Any) -> None:
    """``pre_delete``: remember the calendar's tasks (the links go with it)."""
    using = kwargs.get("using") or "default"
    instance._driftsafe_tasks = list(  # type: ignore[attr-defined]
        instance.tasks.using(using).values_list("pk", flat=True)
    )


def after_calendar_delete(sender: Any, instance: Calendar, **kwargs: Any) -> None:
    """``post_delete``: the tasks that were on it."""
    using = kwargs.get("using") or "default"
    refresh_tasks(getattr(instance, "_driftsafe_tasks", ()), using=using)


def after_links_change(
    sender: Any,
    instance: Any,
    action: str,
    reverse: bool,
    pk_set: set[int] | None,
    using: str = "default",
    **kwargs: Any,
) -> None:
    """``m2m_changed`` of ``PeriodicTask.calendars``, from either side."""
    if action == "pre_clear" and reverse:
        instance._driftsafe_tasks = list(instance.tasks.using(using).values_list("pk", flat=True))
        return
    if action not in ("post_add", "post_remove", "post_clear"):
        return
    if not reverse:
        refresh_tasks([instance.pk], using=using)
    elif action == "post_clear":
        refresh_tasks(getattr(instance, "_driftsafe_tasks", ()), using=using)
    else:
        refresh_tasks(pk_set or (), using=using)
