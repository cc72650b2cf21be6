"""The overlap policy ``skip`` of one delivery: the task's running lock, held for the body, and
what a run that cannot take it records. The delivery's flow, which calls it before the start
(the slow path) or right after it (the fast path's one conditional start), is
:mod:`celery_driftsafe.worker.execution`.

The running lock (``task-running:<periodic task id>``) is one proof that a run of the task is
running; the other is the ledger: another run ``started`` whose worker's lease lasts. Both are
consulted, so a lock Redis lost while a body runs (a flush, an eviction, a restart that kept no
data) does not let the next slot's run start beside it. The ledger is asked first, about runs
started before this one only, so that of two runs started at once one runs (the earlier).
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from celery.exceptions import Ignore

from celery_driftsafe.core.stored_names import RunStatus
from celery_driftsafe.exceptions import LockError
from celery_driftsafe.ledger.run_ledger import RunRow
from celery_driftsafe.locks import lock_backend
from celery_driftsafe.locks.database import DatabaseLockBackend
from celery_driftsafe.monitoring import metrics
from celery_driftsafe.worker.execution_outcomes import (
    LOST_NOT_AGAIN,
    SKIPPED_WHY,
    UNREACHABLE_RESEND_SECONDS,
    ExecutionOutcomes,
    log_run,
)


class OverlapPolicy(ExecutionOutcomes):
    """A delivery's overlap policy ``skip`` (see the module docstring)."""

    @staticmethod
    def _skips_overlaps(row: RunRow) -> bool:
        return row.periodic_task_id is not None and row.overlap_policy == "skip"

    def _check_overlap_locked(self, row: RunRow, token: int, args: Any, kwargs: Any) -> None:
        """Under the run lock, before the start: with overlap policy ``skip``, hold the task's
        running lock for the body, or record the run ``skipped``."""
        if not self._skips_overlaps(row):
            return
        assert row.periodic_task_id is not None
        if not self._hold_running_lock(row.periodic_task_id, token, args, kwargs, None):
            self._skip(token)

    def _check_overlap_unlocked(self, row: RunRow, mode: str) -> None:
        """Before a start without a run lock (``mode``: ``eager``, ``fail_open``,
        ``lock-mismatch``), with overlap policy ``skip``: record the run ``skipped`` when the
        ledger has another run of the task started, or when another holds the task's running
        lock in the database. That lock, held for the body, puts two such starts at the
        same instant in order (Redis, where the running lock usually lives, is out of reach
        or not shared); a database lock cannot be taken inside a transaction (an eager call
        in an ``atomic`` block), where the ledger alone decides."""
        assert row.periodic_task_id is not None
        if self.ledger.other_started(row.periodic_task_id, self.run_id):
            self._skip(None)
        task_lock = DatabaseLockBackend().lock(
            f"task-running:{row.periodic_task_id}", ttl=self.settings.lease_seconds
        )
        try:
            held: bool | None = task_lock.acquire(blocking=False)
        except LockError:  # inside a transaction: not seen by others before it commits
            held = None
        if held is False:
            self._skip(None)
        if held:
            self.locks.enter_context(task_lock.watch())
        log_run(
            logging.INFO,
            "run %s: overlap checked on the ledger%s (%s)",
            self.run_id,
            " and the database's running lock" if held else " only",
            mode,
            run_id=self.run_id,
            action="overlap-ledger",
        )

    def _hold_overlap_lock_or_skip(
        self,
        periodic_task_id: int,
        token: int,
        args: Any,
        kwargs: Any,
        *,
        took_over: bool,
        started_at: datetime,
    ) -> None:
        """After a fast-path start (at ``started_at``): hold the task's running lock, or end
        the run skipped; a run taken over from a lost worker ran in part, so it ends failed, as
        a reconcile pass records it when the slow path leaves it started."""
        if self._hold_running_lock(periodic_task_id, token, args, kwargs, started_at):
            return
        status = RunStatus.FAILED if took_over else RunStatus.SKIPPED
        why = LOST_NOT_AGAIN if took_over else SKIPPED_WHY
        self.ledger.finish(self.run_id, token, status, self._now(), why)
        metrics.execution(self.task.name, status)
        log_run(
            logging.WARNING if took_over else logging.INFO,
            "run %s %s",
            self.run_id,
            why,
            run_id=self.run_id,
            action="overlap-skip",
        )
        raise Ignore()

    def _hold_running_lock(
        self,
        periodic_task_id: int,
        token: int,
        args: Any,
        kwargs: Any,
        started_at: datetime | None,
    ) -> bool:
        """Take the task's running lock and watch it for the body; False when another run of
        the task runs by the ledger or holds the lock. With the lock backend unreachable, the
        delivery comes again later (a run already started, at ``started_at``, goes back to
        waiting first).

        The ledger is asked first, and only about runs started before this one (a run not
        started yet comes after every started one): of two runs started at once, the later
        neither takes the lock nor skips the earlier, so one of them runs. A run started
        before this one under a lasting lease runs whatever the lock says (Redis may have
        lost the key while its body runs)."""
        now = self._now()
        if self.ledger.other_started(
            periodic_task_id, self.run_id, lease_lasting_at=now, before=started_at or now
        ):
            return False
        task_lock = lock_backend(self.settings).lock(
            f"task-running:{periodic_task_id}", ttl=self.settings.lease_seconds
        )
        try:
            held = task_lock.acquire(blocking=False)
        except LockError as exc:
            metrics.lock_error(self.task.name)
            if started_at is not None:
                self.ledger.requeue(self.run_id, token, f"waiting: {exc}")
            self.locks.close()  # give the run lock back before the delivery comes again
            self.resend(
                f"lock backend unreachable taking the overlap lock ({exc})",
                UNREACHABLE_RESEND_SECONDS,
                args,
                kwargs,
            )
        if held:
            self.locks.enter_context(task_lock.watch())
        return held
