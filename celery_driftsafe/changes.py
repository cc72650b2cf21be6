"""Schedule edits: recompute a task's next slot once, and wake every beat.

Connected in :meth:`DriftSafeConfig.ready` to ``pre_save`` / ``post_save`` / ``post_delete``
of :class:`~celery_driftsafe.models.PeriodicTask`:

* a new task gets its interval anchor (the authority's now, unless given) and its first slot
  strictly after the authority's now (a one-off: its instant);
* an edit of the schedule, or re-enabling a disabled task, moves ``next_slot_at`` to the first
  slot after the authority's now — once, in the edit, not on every beat;
* after the transaction commits, a message on the Redis channel ``<KEY_PREFIX>:changes`` wakes
  sleeping beats; without Redis they see the change on their next loop.

``QuerySet.update()`` bypasses model signals: call :func:`reschedule` and :func:`notify` after
bulk edits.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from django.db import transaction

from celery_driftsafe.clock import authority_from_settings
from celery_driftsafe.conf import get_settings
from celery_driftsafe.exceptions import ClockError, ScheduleError
from celery_driftsafe.models import PeriodicTask, ScheduleKind
from celery_driftsafe.redis_client import channel, get_redis

logger = logging.getLogger(__name__)

SCHEDULE_FIELDS = (
    "schedule_kind", "interval_every", "interval_unit", "interval_anchor", "crontab_minute",
    "crontab_hour", "crontab_day_of_month", "crontab_month_of_year", "crontab_day_of_week",
    "timezone", "one_off_at",
)


def authority_now(using: str = "default") -> datetime:
    """One reading of the configured authority (for edits made outside a beat)."""
    return authority_from_settings(using=using).read()


def first_slot(task: PeriodicTask, now: datetime) -> datetime | None:
    """The slot a new, edited or re-enabled task starts at: the first one after ``now``.

    A one-off that has not fired yet keeps its instant even when it lies in the past, so that
    it still fires (subject to its misfire policy) rather than vanishing.
    """
    if task.schedule_kind == ScheduleKind.ONE_OFF:
        return task.one_off_at if task.last_slot_at is None else None
    return task.schedule.next_after(now)


def before_save(sender: Any, instance: PeriodicTask, raw: bool = False, **kwargs: Any) -> None:
    """``pre_save``: fill the anchor and recompute ``next_slot_at`` when the schedule changed."""
    if raw:  # loaddata: store exactly what the fixture says
        return
    using = kwargs.get("using") or "default"
    previous = None
    if instance.pk is not None:
        previous = (
            PeriodicTask.objects.using(using)
            .filter(pk=instance.pk)
            .values(*SCHEDULE_FIELDS, "enabled")
            .first()
        )
    changed = previous is None or any(
        previous[name] != getattr(instance, name) for name in SCHEDULE_FIELDS
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
        instance.interval_anchor = now
    try:
        instance.next_slot_at = first_slot(instance, now)
    except ScheduleError:
        # Saved with an invalid schedule (e.g. through the ORM without full_clean): the task
        # cannot fire; the scheduler records the reason if it is ever enabled and due.
        instance.next_slot_at = None
        raise
    if re_enabled:
        instance.disabled_reason = ""


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
    """Recompute ``next_slot_at`` of ``tasks`` from the authority's now and save them."""
    now = authority_now(using)
    count = 0
    for task in tasks:
        task.next_slot_at = first_slot(task, now)
        PeriodicTask.objects.using(using).filter(pk=task.pk).update(
            next_slot_at=task.next_slot_at
        )
        count += 1
    if count:
        transaction.on_commit(notify, using=using)
    return count
