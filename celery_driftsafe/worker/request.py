"""What a Celery worker's main process records about runs it handles without their body
finishing: a hard time limit, a pool process lost without a redelivery, a revoked or expired
message. Only messages carrying ``driftsafe_run_id`` are touched.

:class:`DriftSafeRequest` is :class:`~celery_driftsafe.task.DriftSafeTask`'s request class.
For overlap policy ``replace`` it also stands where the worker meets its pool: a terminating
revoke on a pool that cannot terminate a body (threads, solo) is said so in the log, not failed
(the body runs on to its end, and its replacement waits for it); and once a prefork pool has
seen a replaced run's pool process end, its replacement is published at once
(:func:`~celery_driftsafe.worker.overlap.replaced_body_killed`).

It also leaves a run's expiry to the time authority: Celery would compare a message's
``expires`` with this machine's wall clock and drop the message unrecorded, so for a run the
worker lets the body's side (:mod:`celery_driftsafe.worker.execution`) judge ``Run.expires_at``.
"""

from __future__ import annotations

import logging
from typing import Any

from billiard.einfo import ExceptionWithTraceback
from billiard.exceptions import Terminated, WorkerLostError
from celery.concurrency.base import BasePool
from celery.worker.request import Request

from celery_driftsafe.core.headers import valid_headers
from celery_driftsafe.core.stored_names import RunStatus

logger = logging.getLogger("celery_driftsafe.task")


def record_from_worker(request: Any, status: str, error: str, *, started_too: bool) -> bool:
    """End the run of ``request`` (a worker request or its context) as ``status``: if it is
    the run of that message (its Celery task id is the request's), still waiting, or
    (``started_too``) started by this worker in this attempt."""
    from django.db import close_old_connections

    from celery_driftsafe.claim.pausing import count_outcome
    from celery_driftsafe.exceptions import LedgerUnavailable
    from celery_driftsafe.ledger.run_ledger import Ledger
    from celery_driftsafe.store.clock import authority_clock

    headers = valid_headers(request)
    if headers is None:
        return False
    task_id = str(getattr(request, "id", "") or "")
    attempt = int(getattr(request, "retries", 0) or 0)
    worker = str(getattr(request, "hostname", "") or "")
    close_old_connections()
    ledger = Ledger()
    now = authority_clock().now()
    try:
        if started_too:

            def end() -> bool:
                ended = ledger.end_by_worker(
                    headers.run_id, task_id, attempt, worker, status, now, error
                )
                if ended:  # towards pause_after_failures, in the same transaction
                    count_outcome(ledger.connection.alias, headers.run_id, status, now)
                return ended

            written = ledger.together(end)
        else:
            written = ledger.end_waiting(headers.run_id, status, now, error, task_id=task_id)
    except LedgerUnavailable as exc:
        logger.error(
            "run %s: could not record %s: %s",
            headers.run_id,
            status,
            exc,
            extra={"action": "outcome-lost", "run": headers.run_id},
        )
        return False
    if written:
        logger.warning(
            "run %s recorded %s: %s",
            headers.run_id,
            status,
            error,
            extra={"action": status, "run": headers.run_id},
        )
    return written


class DriftSafeRequest(Request):
    """A worker request that records in the ledger what Celery decides outside the body."""

    def maybe_expire(self) -> bool | None:
        if valid_headers(self._context) is not None:
            return False  # judged on the time authority's clock when the run is delivered
        result: bool | None = super().maybe_expire()
        return result

    def on_timeout(self, soft: bool, timeout: float) -> None:
        super().on_timeout(soft, timeout)
        if not soft:
            record_from_worker(
                self._context,
                RunStatus.FAILED,
                f"hard time limit ({timeout} s) exceeded: the worker killed the body",
                started_too=True,
            )

    def on_failure(
        self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False
    ) -> None:
        super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)
        exc = exc_info.exception
        if isinstance(exc, ExceptionWithTraceback):
            exc = exc.exc
        redelivered = self.task.acks_late and self.task.reject_on_worker_lost
        if isinstance(exc, WorkerLostError) and not redelivered:
            record_from_worker(
                self._context, RunStatus.FAILED, f"worker lost: {exc}", started_too=True
            )
        if isinstance(exc, Terminated | WorkerLostError):  # its pool process has ended
            from celery_driftsafe.worker.overlap import replaced_body_killed

            replaced_body_killed(self.task.app, self._context)

    def terminate(self, pool: Any, signal: Any = None) -> None:
        """A terminating revoke: Celery's, where the pool can terminate a body; on a pool that
        cannot (threads, solo: Celery would fail the revoke with ``NotImplementedError``), the
        body runs on to its end, and the log says so. The message is revoked either way."""
        if _can_terminate(pool):
            super().terminate(pool, signal)
            return
        logger.warning(
            "%s[%s]: this worker's pool (%s) cannot terminate a running body; it runs on to "
            "its end",
            self.task.name,
            self.id,
            type(pool).__module__,
            extra={
                "action": "revoke-no-terminate",
                "run": getattr(self._context, "driftsafe_run_id", -1),
            },
        )


def _can_terminate(pool: Any) -> bool:
    """Whether ``pool`` terminates a running body (prefork; gevent and eventlet kill its
    greenlet), rather than keeping Celery's ``terminate_job``, which raises."""
    job = getattr(pool, "terminate_job", None)
    return job is not None and getattr(job, "__func__", None) is not BasePool.terminate_job


def on_task_revoked(
    sender: Any = None,
    request: Any = None,
    terminated: bool = False,
    signum: Any = None,
    expired: bool = False,
    **kwargs: Any,
) -> None:
    """``task_revoked`` receiver: a revoked (or, for a message without a run, expired) message
    of a run ends the run as ``revoked`` (``expired``) instead of leaving it waiting."""
    if request is None:
        return
    status = RunStatus.EXPIRED if expired else RunStatus.REVOKED
    why = "terminated by a revoke" if terminated else f"the worker discarded its message ({status})"
    record_from_worker(request, status, f"{status}: {why}", started_too=terminated)
