"""What one delivery of one run records, and how it ends without the body: the state of an
:class:`~celery_driftsafe.worker.execution.Execution` and its outcomes.

:class:`ExecutionOutcomes` holds the delivery's state (run, attempt, worker, token, locks) and
writes its outcomes to the ledger: a duplicate suppressed, a run skipped or expired, the
delivery re-sent for later, an attempt handed over to its retry, the body's outcome recorded
under the run's fencing token (retried while the database is away). The delivery's flow, which
decides among them, is :mod:`celery_driftsafe.worker.execution`.
"""

from __future__ import annotations

import logging
import socket
import threading
from contextlib import ExitStack, suppress
from datetime import datetime, timedelta
from typing import Any, NoReturn

from celery import Task
from celery.exceptions import Ignore

from celery_driftsafe.conf import get_settings
from celery_driftsafe.core.headers import RunHeaders
from celery_driftsafe.core.stored_names import RunStatus
from celery_driftsafe.exceptions import LedgerUnavailable, LockLost
from celery_driftsafe.ledger.run_ledger import Ledger, RunRow
from celery_driftsafe.monitoring import metrics
from celery_driftsafe.store.clock import authority_clock

logger = logging.getLogger("celery_driftsafe.task")

#: A delivery that finds the lock backend or the database unreachable comes back this late.
UNREACHABLE_RESEND_SECONDS = 5.0

#: How long a worker keeps retrying to record an outcome while the database is away.
FINISH_RETRY_SECONDS = 60.0

SKIPPED_WHY = "skipped: the previous run of this task is still running (overlap policy 'skip')"
#: A run taken over from a lost worker while the task's next run holds its running lock.
LOST_NOT_AGAIN = (
    "failed: the worker that started it was lost, and it is not run again while the task's "
    "next run is running (overlap policy 'skip')"
)


def log_run(level: int, message: str, *args: Any, run_id: int, action: str, **extra: Any) -> None:
    """Log about one run, with the run's id and the action in the record's extras."""
    logger.log(level, message, *args, extra={"action": action, "run": run_id, **extra})


class ExecutionOutcomes:
    """The state of one delivery and the outcomes it records (see the module docstring)."""

    def __init__(self, task: Task, headers: RunHeaders) -> None:
        self.task = task
        self.request = task.request
        self.headers = headers
        self.run_id = headers.run_id
        self.settings = get_settings()
        self.ledger = Ledger()
        self.attempt = int(self.request.retries or 0)
        self.worker = self.request.hostname or socket.gethostname()
        self.token: int | None = None
        self.started_at: datetime | None = None
        self.handed_over = False
        self.retry_reason = ""
        self.locks = ExitStack()

    # -- outcomes without the body --------------------------------------------------------------

    def _suppress(self, why: str) -> NoReturn:
        metrics.duplicate(self.task.name)
        with suppress(LedgerUnavailable):  # only a counter
            self.ledger.count_duplicate(self.run_id)
        log_run(
            logging.WARNING,
            "duplicate delivery of run %s (%s[%s]) skipped: %s",
            self.run_id,
            self.task.name,
            self.request.id,
            why,
            run_id=self.run_id,
            action="duplicate",
        )
        raise Ignore()

    def _skip(self, token: int | None) -> NoReturn:
        self.ledger.end_waiting(
            self.run_id, RunStatus.SKIPPED, self._now(), SKIPPED_WHY, token=token
        )
        metrics.execution(self.task.name, "skipped")
        log_run(
            logging.INFO,
            "run %s skipped: the previous run is still running",
            self.run_id,
            run_id=self.run_id,
            action="overlap-skip",
        )
        raise Ignore()

    def _expire(self, now: datetime, expires_at: datetime) -> NoReturn:
        why = (
            f"expired: the run expired at {expires_at.isoformat()}, the time authority "
            f"said {now.isoformat()} when it was delivered"
        )
        if self.ledger.end_waiting(self.run_id, RunStatus.EXPIRED, now, why):
            metrics.execution(self.task.name, "expired")
            log_run(
                logging.WARNING,
                "run %s (%s[%s]) %s; not executed",
                self.run_id,
                self.task.name,
                self.request.id,
                why,
                run_id=self.run_id,
                action="expired",
            )
            self._store_revoked(RunStatus.EXPIRED.value)
        else:
            self._suppress("it expired, and another delivery is handling it")
        raise Ignore()

    def _store_revoked(self, reason: str) -> None:
        """Store REVOKED as Celery does for a message it expires itself (never for eager
        calls, nor when results are ignored)."""
        if self.request.is_eager or self.task.ignore_result:
            return
        with suppress(NotImplementedError):  # no result backend
            self.task.backend.mark_as_revoked(self.request.id, reason, request=self.request)

    def resend(self, why: str, countdown: float, args: Any, kwargs: Any) -> NoReturn:
        """Acknowledge this delivery and send the same message (same task id, headers, attempt
        number, links) again in ``countdown`` seconds."""
        request = self.request
        signature = self.task.signature_from_request(request, args, kwargs, countdown=countdown)
        Task.apply_async(self.task, args, kwargs, **signature.options)
        with suppress(LedgerUnavailable):  # the reason is logged below too
            self.ledger.note(self.run_id, f"waiting: {why}")
        log_run(
            logging.WARNING,
            "run %s (%s[%s]) re-sent for %.1f s later: %s",
            self.run_id,
            self.task.name,
            request.id,
            countdown,
            why,
            run_id=self.run_id,
            action="resend",
        )
        raise Ignore()

    # -- the outcome of the body ----------------------------------------------------------------

    def is_retry(self, task: Task, task_id: str | None, options: dict[str, Any]) -> bool:
        """Whether a publish is this execution's ``retry()`` sending the next attempt."""
        retries = options.get("retries")
        return (
            task is self.task
            and task_id == self.request.id
            and not self.handed_over
            and isinstance(retries, int)
            and retries > self.attempt
        )

    def hand_over(self, next_attempt: int, reason: str) -> None:
        """End this attempt with a retry, before the next attempt's message is sent: the run
        waits for ``next_attempt`` and its locks are free for it."""
        assert self.token is not None
        now = self._now()
        reason = reason or self.retry_reason
        if not self.ledger.hand_over(self.run_id, self.token, next_attempt, f"retry: {reason}"):
            metrics.fenced_out(self.task.name)
            log_run(
                logging.ERROR,
                "run %s: retry not sent, a newer holder (fencing token above %s) took the run over",
                self.run_id,
                self.token,
                run_id=self.run_id,
                action="fenced-out",
            )
            raise LockLost(f"run {self.run_id} was taken over; its retry is not sent")
        self.handed_over = True
        metrics.execution(self.task.name, "retrying")
        self.ledger.record_attempt(
            self.run_id,
            self.attempt,
            RunStatus.RETRYING,
            self.worker,
            self.started_at,
            now,
            self.token,
            reason,
        )
        self.locks.close()
        log_run(
            logging.INFO,
            "run %s attempt %s ends in a retry (%s); attempt %s is next",
            self.run_id,
            self.attempt,
            reason,
            next_attempt,
            run_id=self.run_id,
            action="retry",
        )

    def _now(self) -> datetime:
        return authority_clock().now()

    def _lease_left(self, row: RunRow, now: datetime) -> float:
        """Seconds the started run's worker still holds its lease in the ledger (0: over)."""
        if row.status != RunStatus.STARTED or row.lease_until is None:
            return 0.0
        return max(0.0, (row.lease_until - now).total_seconds())

    def _lease_end(self, now: datetime) -> datetime:
        """When a lease in the ledger taken or renewed at ``now`` ends."""
        return now + timedelta(seconds=self.settings.lease_seconds)

    def _renew_lease(self) -> bool:
        """In the lock's watchdog thread, after each renewal: the run's lease in the ledger
        follows its lock, on a connection of that thread's, closed again. False once the
        ledger refuses it (the run ended, or a newer holder took it over)."""
        from django.db import connections

        if self.token is None:
            return True
        try:
            return self.ledger.renew_lease(self.run_id, self.token, self._lease_end(self._now()))
        finally:
            connections.close_all()

    def _keep_lease(self, stop: threading.Event) -> None:
        """The run's lock was declared lost while its body runs (its renewal was refused: a
        copy held the key Redis lost, for the moment of its refused start; or the lease ran
        out while the worker was paused or the backend away). The body runs on, so the lease
        in the ledger, which a takeover also needs over, is renewed from a thread of its own
        until ``stop`` is set (the run ends) or the ledger refuses it (a newer holder took the
        run over while this worker was away)."""
        thread = threading.Thread(
            target=self._keep_lease_until,
            args=(stop,),
            name=f"driftsafe-lease[run:{self.run_id}]",
            daemon=True,
        )
        thread.start()

    def _keep_lease_until(self, stop: threading.Event) -> None:
        log_run(
            logging.WARNING,
            "run %s: its lock was lost while the body runs; the worker keeps its lease in the "
            "ledger until the run ends, so no copy takes it over meanwhile",
            self.run_id,
            run_id=self.run_id,
            action="lease-kept",
        )
        interval = self.settings.lease_seconds / 3
        while not stop.is_set():
            try:
                if not self._renew_lease():
                    if not stop.is_set() and self._taken_over():
                        log_run(
                            logging.ERROR,
                            "run %s: its lease in the ledger can no longer be renewed: a "
                            "newer holder took the run over while this worker was away",
                            self.run_id,
                            run_id=self.run_id,
                            action="lease-taken-over",
                        )
                    return
            except Exception as exc:  # the database or the time authority away: keep trying
                log_run(
                    logging.WARNING,
                    "run %s: could not renew its lease in the ledger (%s); retrying",
                    self.run_id,
                    exc,
                    run_id=self.run_id,
                    action="lease-renew-failed",
                )
            stop.wait(interval)

    def _taken_over(self) -> bool:
        """Whether a newer holder wrote the run (not this worker's own outcome or hand-over,
        which also end its lease), read on a connection closed again."""
        from django.db import connections

        try:
            row = self.ledger.load(self.run_id)
        finally:
            connections.close_all()
        return row is not None and row.fencing_token != self.token

    def _finish(self, status: str, error: str = "") -> bool:
        """Record the outcome under the token; while the database is away, keep trying (with
        backoff, up to ``FINISH_RETRY_SECONDS``) rather than lose it or run the body again."""
        assert self.token is not None
        waited, delay = 0.0, 0.5
        while True:
            try:
                now = self._now()
                written = self.ledger.finish(self.run_id, self.token, status, now, error)
                break
            except LedgerUnavailable as exc:
                if waited >= FINISH_RETRY_SECONDS:
                    log_run(
                        logging.ERROR,
                        "run %s: outcome %s not recorded, the database stayed "
                        "unreachable for %.0f s: %s; the run stays 'started'",
                        self.run_id,
                        status,
                        waited,
                        exc,
                        run_id=self.run_id,
                        action="outcome-lost",
                    )
                    return False
                authority_clock().sleep(delay)
                waited, delay = waited + delay, min(delay * 2, 5.0)
        if not written:
            metrics.fenced_out(self.task.name)
            log_run(
                logging.ERROR,
                "run %s: outcome %s discarded, a newer holder (fencing token "
                "above %s) took the run over while this worker was paused past its lease",
                self.run_id,
                status,
                self.token,
                run_id=self.run_id,
                action="fenced-out",
            )
            return False
        metrics.execution(self.task.name, status)
        if self.attempt > 0:
            self.ledger.record_attempt(
                self.run_id,
                self.attempt,
                status,
                self.worker,
                self.started_at,
                now,
                self.token,
                error,
            )
        return True
