"""Deadlines: a scheduled run that has not succeeded by its slot plus its task's
``deadline_seconds`` is flagged late, and a task none of whose last ``STALE_AFTER_SLOTS``
slots succeeded is flagged stale: the dead man's switch, kept by the beats themselves.

Each beat runs :func:`check_deadlines` every ``DEADLINE_CHECK_INTERVAL_SECONDS`` (2 s), in a
thread of its own, at the time authority's ``now``:

* **late**: a run of kind ``scheduled`` of a task with a deadline, whose ``slot + deadline``
  has passed and whose status is anything but ``succeeded`` (still waiting for a worker,
  running too long, retrying, failed, expired, revoked, missed, or skipped by the overlap
  policy: the task did not succeed at that slot). Its ``late_at`` is set by
  ``UPDATE … WHERE late_at IS NULL AND status <> 'succeeded'``, one run a statement: one
  beat wins each run, and only that beat logs it (``deadline-missed``), counts it
  (``driftsafe_beat_deadlines_missed``) and sends
  :data:`~celery_driftsafe.signals.run_deadline_missed`. A run that succeeds after it was
  flagged keeps its ``late_at``: it was late. Runs of other kinds (run now, ad hoc, backfill)
  have no deadline: an operator started them, and watches them.
* **stale**: the task's last ``STALE_AFTER_SLOTS`` scheduled slots whose deadline has passed
  (a ``missed`` row standing for a span counts as its slots) include no success. Its
  ``stale_since`` is set by an ``UPDATE … WHERE stale_since IS NULL`` that also re-checks
  that no run succeeded meanwhile; the winning beat logs ``task-stale``, counts it and sends
  :data:`~celery_driftsafe.signals.task_became_stale`. A success among those slots clears it
  (``task-fresh``), as does removing the deadline.

The check reads only tasks with a deadline (or still flagged stale), on a partial index
(``driftsafe_task_deadline``): with 20,000 tasks of which one has a deadline, PostgreSQL's
plan is ``Index Scan using driftsafe_task_deadline on celery_driftsafe_periodictask
(cost=0.12..8.14 rows=1)``, SQLite's ``SCAN celery_driftsafe_periodictask USING INDEX
driftsafe_task_deadline`` (``tests/beat/test_deadlines.py`` asserts the index is used); MySQL
and MariaDB, which have no partial indexes, merge two plain ones (migration 0020), MariaDB's
plan ``index_merge … Using sort_union(driftsafe_task_deadline_s,driftsafe_task_stale_since)``;
the cost grows with the tasks that have a deadline, not with the table. Each task's runs are
read on the unique ``(periodic_task, slot)`` index, over the slots of the last
:data:`LOOKBACK` before the deadline: a run found late only after all beats were down
longer than that is not flagged (its task is flagged stale all the same).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Exists, OuterRef, Q

from celery_driftsafe.conf import DriftSafeSettings, get_settings
from celery_driftsafe.core.validation import deadline_problems
from celery_driftsafe.models import PeriodicTask, Run, RunKind, RunStatus
from celery_driftsafe.monitoring import metrics
from celery_driftsafe.signals import run_deadline_missed, task_became_stale
from celery_driftsafe.store.background_pass import BackgroundPass

logger = logging.getLogger("celery_driftsafe.deadlines")

#: How far back before its deadline a run is looked at: bounds each task's read.
LOOKBACK = timedelta(hours=1)
#: The most late runs of one task one check flags (the next check goes on).
LATE_BATCH = 500


@dataclass
class Checked:
    """What a check found: run ids flagged late, task ids flagged stale and cleared."""

    late: list[int] = field(default_factory=list)
    stale: list[int] = field(default_factory=list)
    fresh: list[int] = field(default_factory=list)


def watched(using: str = "default") -> Any:
    """The tasks a check reads: those with a deadline, and those still flagged stale (the
    partial index's very condition, so the database reads that index)."""
    return PeriodicTask.objects.using(using).filter(
        Q(deadline_seconds__isnull=False) | Q(stale_since__isnull=False)
    )


def check_deadlines(
    now: datetime, *, using: str = "default", settings: DriftSafeSettings | None = None
) -> Checked:
    """One check at the authority's ``now`` (see the module docstring). A task whose check
    fails is logged and the others are checked."""
    settings = settings or get_settings()
    done = Checked()
    for task in watched(using).order_by("pk"):
        try:
            _check_task(task, now, settings, using, done)
        except Exception:
            logger.exception(
                "checking the deadline of task %r failed; trying again next time",
                task.name,
                extra={"action": "deadline-check", "task": task.name},
            )
    return done


def _check_task(
    task: PeriodicTask, now: datetime, settings: DriftSafeSettings, using: str, done: Checked
) -> None:
    tasks = PeriodicTask.objects.using(using).filter(pk=task.pk)
    seconds = task.deadline_seconds
    if seconds is None or deadline_problems(seconds):
        # No deadline (removed, or not one the form would take): nothing is stale any more.
        if task.stale_since is not None and tasks.filter(stale_since__isnull=False).update(
            stale_since=None
        ):
            done.fresh.append(task.pk)
            logger.info(
                "task %r is no longer stale: it has no deadline",
                task.name,
                extra={"action": "task-fresh", "task": task.name},
            )
        return
    deadline = timedelta(seconds=seconds)
    cutoff = now - deadline  # runs of slots up to here are past their deadline
    runs = Run.objects.using(using).filter(periodic_task_id=task.pk, kind=RunKind.SCHEDULED)
    not_succeeded = ~Q(status=RunStatus.SUCCEEDED)
    candidates = (
        runs.filter(not_succeeded, slot__gt=cutoff - LOOKBACK, slot__lte=cutoff, late_at=None)
        .order_by("slot")
        .only("pk", "slot", "status", "task_name", "kind", "claimed_at", "finished_at")
    )
    for run in candidates[:LATE_BATCH]:
        if run.slot is None:  # not read: the filter asks for a slot
            continue
        if runs.filter(not_succeeded, pk=run.pk, late_at=None).update(late_at=now):
            run.late_at = now
            done.late.append(run.pk)
            _report_late(task, run, run.slot + deadline, now)
    _check_stale(task, tasks, runs, cutoff, now, settings, done)


def _check_stale(
    task: PeriodicTask,
    tasks: Any,
    runs: Any,
    cutoff: datetime,
    now: datetime,
    settings: DriftSafeSettings,
    done: Checked,
) -> None:
    wanted = settings.stale_after_slots
    recent = runs.filter(slot__lte=cutoff).order_by("-slot")
    slots = 0
    oldest: datetime | None = None
    succeeded = False
    for status, missed_count, slot in recent.values_list("status", "missed_count", "slot")[:wanted]:
        if status == RunStatus.SUCCEEDED:
            succeeded = True
            break
        slots += max(missed_count or 1, 1) if status == RunStatus.MISSED else 1
        oldest = slot
        if slots >= wanted:
            break
    if succeeded or slots < wanted:
        if task.stale_since is not None and tasks.filter(stale_since__isnull=False).update(
            stale_since=None
        ):
            done.fresh.append(task.pk)
            logger.info(
                "task %r is no longer stale: %s",
                task.name,
                "a run succeeded"
                if succeeded
                else f"fewer than {wanted} of its slots past their deadline are left",
                extra={"action": "task-fresh", "task": task.name},
            )
        return
    # Conditional on what was read: no success since the oldest slot counted (a run that
    # succeeded meanwhile, seen by another beat that cleared the flag, keeps it cleared).
    success = runs.filter(
        periodic_task_id=OuterRef("pk"), status=RunStatus.SUCCEEDED, slot__gte=oldest
    )
    if task.stale_since is None and tasks.filter(stale_since=None).filter(~Exists(success)).update(
        stale_since=now
    ):
        task.stale_since = now
        done.stale.append(task.pk)
        logger.warning(
            "task %r is stale: none of its last %d slots past their deadline (%g s) succeeded",
            task.name,
            slots,
            task.deadline_seconds,
            extra={"action": "task-stale", "task": task.name},
        )
        metrics.became_stale(task.name)
        _send(task_became_stale, task=task, since=now, slots=slots)


def _report_late(task: PeriodicTask, run: Run, deadline: datetime, now: datetime) -> None:
    logger.warning(
        "run %s of task %r (slot %s) missed its deadline %s: %s at %s",
        run.pk,
        task.name,
        run.slot.isoformat() if run.slot else None,
        deadline.isoformat(),
        run.status,
        now.isoformat(),
        extra={
            "action": "deadline-missed",
            "task": task.name,
            "run": run.pk,
            "slot": run.slot.isoformat() if run.slot else None,
        },
    )
    metrics.deadline_missed(task.name)
    _send(run_deadline_missed, run=run, task=task, deadline=deadline, late_at=now)


def _send(signal: Any, **arguments: Any) -> None:
    """Send ``signal`` to every receiver; one that raises is logged, and the others still get
    it (the beat goes on)."""
    for receiver, result in signal.send_robust(sender=PeriodicTask, **arguments):
        if isinstance(result, Exception):
            logger.error(
                "a receiver of a deadline signal, %r, raised: %r",
                receiver,
                result,
                exc_info=result,
                extra={"action": "deadline-receiver-failed"},
            )


class BackgroundDeadlines(BackgroundPass):
    """A beat's deadline check: every ``DEADLINE_CHECK_INTERVAL_SECONDS``, one
    :func:`check_deadlines` in a thread of its own (its own database connection); the first
    with the beat's first round. Beats checking at once never report a run twice (each flag is
    a conditional update)."""

    thread_name = "driftsafe-deadlines"

    def __init__(self, *, using: str = "default", monotonic: Callable[[], float]) -> None:
        super().__init__(using=using, monotonic=monotonic, first_at=0.0)
        self.last: Checked | None = None
        #: The error of the last check when it failed ("": it did not).
        self._failing = ""

    def interval(self) -> float | None:
        return get_settings().deadline_check_interval_seconds

    def run_pass(self, now: datetime) -> None:
        try:
            self.last = check_deadlines(now, using=self.using)
            self._failing = ""
        except Exception as exc:  # an outage, say: the next check tries again
            # Once per distinct error, not every few seconds while an outage lasts.
            level = logging.DEBUG if str(exc) == self._failing else logging.WARNING
            self._failing = str(exc)
            logger.log(
                level,
                "checking deadlines failed; trying again every %g s: %s",
                get_settings().deadline_check_interval_seconds,
                exc,
                extra={"action": "deadline-check"},
            )
