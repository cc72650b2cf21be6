"""Pause after failures: a task with ``pause_after_failures`` (N) is disabled once N of its
runs in a row ended failed or its slots were missed.

The count is the task's ``consecutive_failures`` column, changed only by the conditional
statements here, each run in the transaction that records the outcome it counts (the worker's
outcome, the claim's missed slots; see the callers), or right after it:

* a run of the task (scheduled or run now) that ends ``failed`` adds one: the last attempt's
  failure, a lost worker, a hard time limit. An attempt that ends in a retry is no failure
  (its run is ``retrying``, and only its last attempt's outcome counts);
* a missed slot adds one, when the claim that records it fires no run of the task: under
  ``fire_once`` (and ``fire_all``) the run fired for a span of missed slots stands for them,
  and its outcome is what counts, so one downtime does not pause a task whose catch-up run
  succeeds. Under ``skip`` (nothing fires for slots missed past the grace) each missed slot
  counts, and a downtime of N slots or more pauses the task;
* a run that ends ``succeeded`` sets it back to 0;
* any other end (skipped, expired, revoked) neither counts nor resets.

Only an enabled task with ``pause_after_failures`` set (not empty, not 0) counts: the
statements say so in their condition, and a task without the setting costs one statement that
changes nothing. Each is
one ``UPDATE … SET consecutive_failures = consecutive_failures + k``: the database serialises
writers of one row, so outcomes ending at once on several workers, and a beat recording missed
slots meanwhile, are all counted. The writer whose statement brings the count to N disables
the task (:func:`~celery_driftsafe.claim.disabling.disable_by_id`, in the same transaction);
any writer after it finds the task disabled and counts nothing, so the pause, its signal
(:data:`~celery_driftsafe.signals.task_paused`) and its metric happen once.

Re-enabling the task (a save, the admin's action, ``update(enabled=True)``) clears the count.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime

from django.db import connections, transaction
from django.db.models import Count

from celery_driftsafe.claim.disabling import disable_by_id
from celery_driftsafe.core.stored_names import RunStatus
from celery_driftsafe.models import PeriodicTask, Run
from celery_driftsafe.monitoring import metrics
from celery_driftsafe.signals import task_paused
from celery_driftsafe.store.connections import returns_rows

logger = logging.getLogger("celery_driftsafe.claim")


def pause_reason(failures: int, limit: int, now: datetime) -> str:
    """Why a task was paused (the problem :func:`disable_by_id` records)."""
    return (
        f"paused after {failures} failed or missed runs in a row "
        f"(pause_after_failures={limit}), at {now.isoformat()}"
    )


def count_outcome(using: str, run_id: int, status: str, now: datetime) -> None:
    """Count the outcome ``status`` a run just ended with (see the module docstring); call it
    in the transaction that wrote the outcome, and only when that write changed the run."""
    if status == RunStatus.FAILED:
        count_failures(using, failures=1, now=now, run_id=run_id)
    elif status == RunStatus.SUCCEEDED:
        _reset(using, run_id)


def count_outcomes(using: str, run_ids: Sequence[int], status: str, now: datetime) -> None:
    """:func:`count_outcome` for many runs that ended ``status`` at once (a reconciliation's
    batch), in a statement or two whatever their number: one per task that counts, only for a
    failure."""
    if not run_ids:
        return
    runs = Run.objects.using(using).filter(pk__in=list(run_ids)).order_by()
    if status == RunStatus.FAILED:
        counting = (
            runs.filter(periodic_task__enabled=True, periodic_task__pause_after_failures__gt=0)
            .values("periodic_task_id")
            .annotate(failures=Count("id"))
        )
        for row in counting:
            count_failures(
                using, failures=row["failures"], now=now, task_id=row["periodic_task_id"]
            )
    elif status == RunStatus.SUCCEEDED:
        PeriodicTask.objects.using(using).filter(
            pk__in=runs.values("periodic_task_id"), consecutive_failures__gt=0, enabled=True
        ).update(consecutive_failures=0)


def count_missed(using: str, task: PeriodicTask, missed: int, fired: int, now: datetime) -> None:
    """A claim recorded ``missed`` slots of ``task`` and fired ``fired`` runs of it: the
    missed slots count when nothing fired (see the module docstring)."""
    if missed and not fired and task.enabled and task.pause_after_failures:
        count_failures(using, failures=missed, now=now, task_id=task.pk)


def count_failures(
    using: str,
    *,
    failures: int,
    now: datetime,
    task_id: int | None = None,
    run_id: int | None = None,
) -> bool:
    """Add ``failures`` to the count of the task ``task_id`` (or of the run ``run_id``'s
    task), and pause it when the count reaches its ``pause_after_failures``; whether this
    call paused it. The signal and the metric follow the commit."""
    connection = connections[using]
    quote = connection.ops.quote_name
    tasks = quote(PeriodicTask._meta.db_table)
    if task_id is None:
        target = f"(SELECT periodic_task_id FROM {quote(Run._meta.db_table)} WHERE id = %s)"
        key = run_id
    else:
        target, key = "%s", task_id
    update = (
        f"UPDATE {tasks} SET consecutive_failures = consecutive_failures + %s "
        f"WHERE id = {target} AND enabled AND pause_after_failures > 0"
    )
    read = "id, name, consecutive_failures, pause_after_failures"
    with transaction.atomic(using=using), connection.cursor() as cursor:
        if returns_rows(connection):
            cursor.execute(f"{update} RETURNING {read}", [failures, key])
            row = cursor.fetchone()
        else:  # MySQL: the row stays locked by the update until the commit
            cursor.execute(update, [failures, key])
            row = None
            if cursor.rowcount == 1:
                cursor.execute(f"SELECT {read} FROM {tasks} WHERE id = {target}", [key])
                row = cursor.fetchone()
        if row is None:
            return False
        pk, name, count, limit = int(row[0]), str(row[1]), int(row[2]), int(row[3])
        if count < limit:
            return False
        reason = pause_reason(count, limit, now)
        disable_by_id(using, pk, reason, name=name)
        transaction.on_commit(lambda: _announce(using, pk, reason, count), using=using)
    return True


def _reset(using: str, run_id: int) -> None:
    """The run ``run_id`` succeeded: its task counts from 0 again (a row already at 0 is not
    written, nor locked)."""
    connection = connections[using]
    quote = connection.ops.quote_name
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {quote(PeriodicTask._meta.db_table)} SET consecutive_failures = 0 "
            f"WHERE id = (SELECT periodic_task_id FROM {quote(Run._meta.db_table)} "
            "WHERE id = %s) AND consecutive_failures > 0 AND enabled",
            [run_id],
        )


def _announce(using: str, pk: int, reason: str, failures: int) -> None:
    """After the pause committed: the metric, and the signal to every receiver (one that
    raises is logged; the others still get it, and the caller goes on)."""
    task = PeriodicTask.objects.using(using).filter(pk=pk).first()
    if task is None:  # deleted since
        return
    metrics.task_paused(task.name)
    for receiver, result in task_paused.send_robust(
        sender=PeriodicTask, task=task, reason=task.disabled_reason or reason, failures=failures
    ):
        if isinstance(result, Exception):
            logger.error(
                "a receiver of task_paused, %r, raised: %r",
                receiver,
                result,
                exc_info=result,
                extra={"action": "pause-receiver-failed", "task": task.name},
            )
