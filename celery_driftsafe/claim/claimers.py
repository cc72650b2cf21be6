"""Claiming: the one short transaction that turns due slots into run rows, exactly once.

Two implementations of :class:`Claimer`, one contract:

* :class:`SkipLockedClaimer` (PostgreSQL, MySQL 8, MariaDB 10.6+): ``SELECT … FOR UPDATE SKIP
  LOCKED`` takes the due tasks; rows another beat holds are passed over, not waited for.
* :class:`CompareAndSwapClaimer` (SQLite, or anywhere): read the due tasks without locks, then one
  ``UPDATE … WHERE (id, next_slot_at, changed_at) = (seen values) … RETURNING id`` advances
  exactly the tasks nobody advanced or edited meanwhile.

Either way a round is a constant number of statements whatever the number of due tasks, and
the unique ``(periodic_task, slot)`` constraint is the last guard.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from typing import Any, Protocol

from django.db import OperationalError, connections, transaction

from celery_driftsafe.claim.outbox import ClaimedRun
from celery_driftsafe.claim.sql import advance_tasks
from celery_driftsafe.claim.steps import ClaimSteps, disable_by_id
from celery_driftsafe.conf import DriftSafeSettings
from celery_driftsafe.models import PeriodicTask
from celery_driftsafe.store.connections import order_from_indexes
from celery_driftsafe.store.statement_cache import select_rows

logger = logging.getLogger("celery_driftsafe.claim")


@dataclass
class ClaimResult:
    """What a claim round did: runs to publish, slots recorded missed, tasks disabled."""

    runs: list[ClaimedRun] = field(default_factory=list)
    missed: int = 0
    disabled: list[str] = field(default_factory=list)
    tasks_seen: int = 0
    #: Slots that fired past the misfire grace because the beats were busy (see misfire).
    late_from_load: int = 0
    #: The due instant (slot plus jitter) of the oldest slot this round fired: how far behind
    #: the beats are.
    oldest_slot: datetime | None = None
    #: Tasks disabled after their last allowed run (valid until, run once, max runs).
    finished: list[str] = field(default_factory=list)


class Claimer(Protocol):
    """Claims due slots.

    ``claim(now, node_id)`` takes at most ``batch_size`` enabled tasks whose ``due_at`` (the
    next slot plus the task's jitter) is at or before ``now`` (an authority reading taken just
    before the call), earliest first. For each task it applies the misfire policy, inserts one
    run row per slot that fires (status ``claimed``) or is missed (status ``missed``), and
    moves ``next_slot_at`` (and ``due_at``) to the first slot not yet due — all in one
    transaction per round. A slot fires only once ``now`` reaches its jittered instant, within
    the task's bounds, while it has runs left; a task used up is disabled (``finished: …``).
    A task another beat holds or has advanced is left out: losing a race is normal. A task
    whose stored schedule cannot be evaluated is disabled with the reason recorded. Returns
    the claimed runs in slot order. ``busy_since``: since when the beats have been claiming without
    a break (a slot that fell due since then is late, not missed; see
    :mod:`celery_driftsafe.core.misfire`).
    """

    def claim(
        self, now: datetime, node_id: str, busy_since: datetime | None = None
    ) -> ClaimResult: ...


class SkipLockedClaimer(ClaimSteps):
    """``SELECT … FOR UPDATE SKIP LOCKED``: PostgreSQL, MySQL 8+, MariaDB 10.6+."""

    def claim(self, now: datetime, node_id: str, busy_since: datetime | None = None) -> ClaimResult:
        result = ClaimResult()
        with transaction.atomic(using=self.using):
            order_from_indexes(self.using)
            tasks = self._load(now, result, lock=True)
            result.tasks_seen = len(tasks)
            if not tasks:
                return result
            planned = self._plans(tasks, now, result, busy_since)
            for task, plan in planned:
                self._advance(task, plan, result)
            refused = self._write_runs(planned, now, node_id, result)
            advance_tasks(self.using, tasks)
            self._disable_refused(refused, result)
        return result


class CompareAndSwapClaimer(ClaimSteps):
    """Lock-free claim: the ``UPDATE`` only advances tasks still at the ``next_slot_at`` this
    beat read, and ``RETURNING`` says which. Needs ``UPDATE … RETURNING`` (SQLite 3.35+,
    PostgreSQL)."""

    def claim(self, now: datetime, node_id: str, busy_since: datetime | None = None) -> ClaimResult:
        result = ClaimResult()
        tasks = self._load(now, result, lock=False)
        result.tasks_seen = len(tasks)
        if not tasks:
            return result
        seen = {
            task.pk: (
                getattr(task, "stored_slot", task.next_slot_at),
                getattr(task, "stored_change", task.changed_at),
            )
            for task in tasks
        }
        planned = self._plans(tasks, now, result, busy_since)
        disabled = [t for t in tasks if not t.enabled]
        for task, plan in planned:
            self._advance(task, plan, result)
        try:
            with transaction.atomic(using=self.using):
                won = advance_tasks(self.using, [t for t, _ in planned] + disabled, seen)
                planned = [(t, p) for t, p in planned if t.pk in won]
                result.disabled = [t.name for t in disabled if t.pk in won]
                result.finished = [t.name for t, _ in planned if t.name in result.finished]
                refused = self._write_runs(planned, now, node_id, result)
                self._disable_refused(refused, result)
        except OperationalError as exc:
            if "locked" not in str(exc):
                raise
            # SQLite refused the write lock (another beat is writing): this round lost.
            logger.debug("claim round lost to a concurrent writer: %s", exc)
            return ClaimResult(tasks_seen=result.tasks_seen)
        return result


def claimer_for(using: str = "default", settings: DriftSafeSettings | None = None) -> Claimer:
    """The best claimer the database supports."""
    features = connections[using].features
    if features.has_select_for_update_skip_locked:
        return SkipLockedClaimer(using=using, settings=settings)
    return CompareAndSwapClaimer(using=using, settings=settings)


def next_due(using: str = "default") -> datetime | None:
    """When the earliest unclaimed slot of any enabled task is due (its jittered instant).

    A due instant stored as text that is no instant (SQLite, raw SQL) and sorts first made
    every round fail here, and the beat back off for up to 30 s a round: such rows are
    disabled with the reason, and the others read again."""
    build = partial(_first_due, using)
    try:
        rows = select_rows(using, ("next-due",), [], build)
    except (ValueError, TypeError, AttributeError):  # Django's reading of the text
        if not _disable_unreadable_due(using):
            raise
        rows = select_rows(using, ("next-due",), [], build)
    return rows[0][0] if rows else None


#: How many of the first due instants :func:`_disable_unreadable_due` reads one by one.
UNREADABLE_LOOK = 100


def _disable_unreadable_due(using: str) -> list[str]:
    """Disable the enabled tasks among the first :data:`UNREADABLE_LOOK` in due order whose
    stored ``due_at`` Django cannot read as an instant; their names."""
    from django.db.models import TextField
    from django.db.models.functions import Cast
    from django.utils.dateparse import parse_datetime

    rows = list(
        PeriodicTask.objects.using(using)
        .filter(enabled=True, due_at__isnull=False)
        .order_by("due_at")
        .annotate(stored=Cast("due_at", TextField()))
        .values_list("pk", "stored")[:UNREADABLE_LOOK]
    )
    disabled = []
    for pk, text in rows:
        try:
            parse_datetime(text)  # what Django's SQLite driver converter does with it
        except ValueError as exc:
            disabled.append(disable_by_id(using, pk, f"due_at: cannot be read: {exc!r}"))
    return disabled


def _first_due(using: str) -> Any:
    # The first entry of the (enabled, due_at, id) index: as MIN(due_at), which the ORM
    # cannot give as a statement to keep (compiled_sql).
    tasks: Any = PeriodicTask.objects.using(using)
    connection = connections[using]
    if connection.vendor == "sqlite":
        # Enabled as the claim reads it (ClaimSteps._due_as_stored) and the ORM does: 1.
        # Django writes the filter as the bare column, true also for a 2 stored by raw SQL,
        # which the claim never took: the beat then saw a task due and spun at MIN_WAIT.
        table = connection.ops.quote_name(PeriodicTask._meta.db_table)
        tasks = tasks.extra(where=[f"{table}.enabled = 1"])
    else:
        tasks = tasks.filter(enabled=True)
    return tasks.filter(due_at__isnull=False).order_by("due_at").values_list("due_at")[:1]
