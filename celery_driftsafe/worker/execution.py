"""One delivery of one run, inside a worker (or an eager call): the steps
:class:`~celery_driftsafe.task.DriftSafeTask` takes around the body, and the outcomes the
delivery records.

A delivery that must not run the body (duplicate, copy of an earlier attempt, expired, skipped,
re-sent for later, forged) raises :class:`celery.exceptions.Ignore`: Celery then acknowledges
the message and writes nothing to the result backend, so only the body's execution ever stores
a result under the run's task id.

An :class:`Execution` holds the delivery's state (run, attempt, worker, token, locks) and
writes its outcomes to the ledger: a duplicate suppressed, a run expired, the delivery re-sent
for later, an attempt handed over to its retry, the body's outcome recorded under the run's
fencing token (retried while the database is away).

Its flow: check what the message claims, take the run's lock (its fencing token above the
run's), start the run (the one start statement, :meth:`Execution._start`), run the body. Where
the database returns what it updates (PostgreSQL, SQLite 3.35+) the start comes first and
checks everything at once, and the run is read only when it is refused, to say why; elsewhere,
and for a message expired, the run is read first. Without a lock (eager calls, ``fail_open``,
a publisher locking elsewhere) the same start alone decides, and a started run is never taken
over. The overlap policies (:mod:`celery_driftsafe.worker.overlap`) are asked before the start
when the run was read first, right after it otherwise; the run's lease in the ledger follows
its lock (:mod:`celery_driftsafe.worker.lease`).
"""

from __future__ import annotations

import logging
import socket
import threading
import traceback
from collections.abc import Callable
from contextlib import ExitStack, suppress
from datetime import datetime
from typing import TYPE_CHECKING, Any, NoReturn

from celery import Task
from celery.exceptions import Ignore, Reject, Retry

from celery_driftsafe.conf import get_settings
from celery_driftsafe.core.headers import RunHeaders
from celery_driftsafe.core.stored_names import FINISHED, RunStatus
from celery_driftsafe.exceptions import LedgerUnavailable, LockError, LockLost
from celery_driftsafe.ledger.run_ledger import Ledger, RunRow, Start, Started
from celery_driftsafe.locks import lock_backend, lock_identity
from celery_driftsafe.monitoring import metrics
from celery_driftsafe.store.clock import authority_clock
from celery_driftsafe.worker import log_run
from celery_driftsafe.worker.lease import LedgerLease, lease_left
from celery_driftsafe.worker.overlap import Overlap

if TYPE_CHECKING:
    from celery_driftsafe.locks.contract import DistributedLock

#: A delivery that finds the lock backend or the database unreachable comes back this late.
UNREACHABLE_RESEND_SECONDS = 5.0

#: How long a worker keeps retrying to record an outcome while the database is away.
FINISH_RETRY_SECONDS = 60.0

#: (the publisher's, this worker's) lock stores already reported as differing.
_LOCKS_REPORTED: set[tuple[str, str]] = set()

_active = threading.local()


def current_execution() -> Execution | None:
    """The execution whose body runs in this thread, if any."""
    stack: list[Execution] = getattr(_active, "stack", [])
    return stack[-1] if stack else None


class Execution:
    """One delivery of one run: its state, its flow and the outcomes it records (see the
    module docstring); the overlap policies are its :class:`Overlap`'s, the run's lease in
    the ledger its :class:`LedgerLease`'s."""

    def __init__(self, task: Task, headers: RunHeaders) -> None:
        self.task = task
        self.request = task.request
        self.headers = headers
        self.run_id = headers.run_id
        self.settings = get_settings()
        self.ledger = Ledger()
        self.attempt = int(self.request.retries or 0)
        self.worker = self.request.hostname or socket.gethostname()
        self.started_at: datetime | None = None
        self.handed_over = False
        self.retry_reason = ""
        self.locks = ExitStack()
        self.lease = LedgerLease(self.ledger, self.run_id, self.settings.lease_seconds)
        self.overlap = Overlap(self)

    @property
    def token(self) -> int | None:
        """The fencing token this delivery started the run under (None: not started)."""
        return self.lease.token

    @property
    def store(self) -> str:
        """Where this worker takes run locks (:func:`~celery_driftsafe.locks.lock_identity`)."""
        return lock_identity(self.settings)

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

    def _expire(self, now: datetime, expires_at: datetime, row: RunRow) -> NoReturn:
        why = (
            f"expired: the run expired at {expires_at.isoformat()}, the time authority "
            f"said {now.isoformat()} when it was delivered"
        )
        if self.ledger.end_waiting(self.run_id, RunStatus.EXPIRED, now, why):
            self.overlap.pass_turn_on(row)
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

    def unreachable(self, why: str, args: Any, kwargs: Any) -> NoReturn:
        """A backend this delivery needs is out of reach: it comes back a little later."""
        self.resend(why, UNREACHABLE_RESEND_SECONDS, args, kwargs)

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
        token = self.token
        if not self._with_attempt(
            lambda: self.ledger.hand_over(self.run_id, token, next_attempt, f"retry: {reason}"),
            RunStatus.RETRYING,
            now,
            reason,
        ):
            replaced_by = self.ledger.replaced_by(self.run_id)
            if replaced_by is not None:  # the run ends revoked (its body's end is written so)
                log_run(
                    logging.INFO,
                    "run %s: retry not sent, run %s replaced it (overlap policy 'replace')",
                    self.run_id,
                    replaced_by,
                    run_id=self.run_id,
                    action="replace-no-retry",
                )
                raise LockLost(f"run {self.run_id} was replaced; its retry is not sent")
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

    def _finish(self, status: str, error: str = "") -> bool:
        """Record the outcome under the token; while the database is away, keep trying (with
        backoff, up to ``FINISH_RETRY_SECONDS``) rather than lose it or run the body again."""
        assert self.token is not None
        waited, delay = 0.0, 0.5
        while True:
            try:
                now = self._now()
                written = self._write_outcome(status, now, error)
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
        return True

    def _write_outcome(self, status: str, now: datetime, error: str) -> bool:
        """The outcome under the token, counted towards its task's ``pause_after_failures``
        (:mod:`celery_driftsafe.claim.pausing`) in the same transaction, and, for a run that had
        more than one attempt, this attempt's row (a first attempt has none)."""
        from celery_driftsafe.claim.pausing import count_outcome

        token = self.token
        assert token is not None

        def finish() -> bool:
            if not self.ledger.finish(self.run_id, token, status, now, error):
                return False
            count_outcome(self.ledger.connection.alias, self.run_id, status, now)
            return True

        if self.attempt == 0:
            return self.ledger.together(finish)
        return self._with_attempt(finish, status, now, error)

    def _with_attempt(
        self, write: Callable[[], bool], outcome: str, now: datetime, error: str
    ) -> bool:
        """``write()``, a write of the run under the token, and when it wrote, this attempt's
        row: both or neither (:meth:`Ledger.together`)."""
        token = self.token
        assert token is not None

        def both() -> bool:
            if not write():
                return False
            self.ledger.record_attempt(
                self.run_id, self.attempt, outcome, self.worker, self.started_at, now, token, error
            )
            return True

        return self.ledger.together(both)

    # -- the delivery ---------------------------------------------------------------------------

    def run(self, args: Any, kwargs: Any) -> Any:
        now = self._now()
        if self._locks_elsewhere():
            # Its publisher's fleet locks where this worker does not look: the database's
            # conditional start alone decides, and a started run is never taken over.
            return self._run_unlocked(self._checked(now), now, args, kwargs, mode="lock-mismatch")
        message_expiry = self._message_expiry()
        if (
            self.request.is_eager
            or not self.ledger.can_return
            or (message_expiry is not None and now >= message_expiry)
        ):
            row = self._checked(now)
            if self.request.is_eager:
                return self._run_unlocked(row, now, args, kwargs, mode="eager")
            return self._run_locked(row, now, args, kwargs)
        # The fast path: lock, then one conditional start that also checks what the headers
        # claim; only a refused start reads the run to say why.
        return self._run_locked(None, now, args, kwargs)

    def _checked(self, now: datetime) -> RunRow:
        """The run, if this delivery may start it; otherwise the delivery ends here (Ignore)."""
        row = self.ledger.load(self.run_id)
        problem = self._mismatch(row)
        if problem:
            log_run(
                logging.ERROR,
                "rejected %s[%s]: %s; not executed",
                self.task.name,
                self.request.id,
                problem,
                run_id=self.run_id,
                action="reject",
            )
            raise Ignore()
        assert row is not None
        duplicate = self._duplicate(row)
        if duplicate:
            self.overlap.pass_turn_on(row)
            self._suppress(duplicate)
        expires_at = row.expires_at or self._message_expiry()
        if expires_at is not None and now >= expires_at and row.status != RunStatus.STARTED:
            self._expire(now, expires_at, row)  # a started run is taken over, not expired
        return row

    def _locks_elsewhere(self) -> bool:
        """Whether the run was published by a process that takes run locks elsewhere (no
        ``REDIS_URL``, another ``KEY_PREFIX``): this worker cannot see the locks of that
        process's fleet, so a held lock there would not stop it from taking a started run
        over. Reported once per process and pair."""
        theirs = self.headers.locks
        if theirs is None:
            return False
        mine = self.store
        if theirs == mine:
            return False
        if (theirs, mine) not in _LOCKS_REPORTED:
            _LOCKS_REPORTED.add((theirs, mine))
            log_run(
                logging.ERROR,
                "run %s was published by a process that takes run locks in %s, and this "
                "worker takes them in %s: neither sees the other's locks, so this worker "
                "starts such runs on the database's check alone and never takes over one "
                "already started (a lost worker's run is then recorded failed, not run "
                "again); give every beat and worker the same DRIFTSAFE REDIS_URL and KEY_PREFIX",
                self.run_id,
                theirs,
                mine,
                run_id=self.run_id,
                action="lock-mismatch",
            )
        return True

    def _held_elsewhere(self, row: RunRow) -> str:
        """Why a start under this worker's lock was refused."""
        if row.status == RunStatus.STARTED and row.lock_store not in (None, self.store):
            return (
                f"it was started by a worker that locks in {row.lock_store}, whose lock this "
                f"worker (locking in {self.store}) cannot see"
            )
        return "it already started or finished under another holder"

    def drops(self) -> bool:
        """Whether this delivery ends without its body whatever else happens: its headers do
        not match the run, the run is finished, or it is a copy of an earlier attempt. Only
        reads; with the database away, False (the delivery then finds that out itself)."""
        try:
            row = self.ledger.load(self.run_id)
        except LedgerUnavailable:
            return False
        return row is None or bool(self._mismatch(row) or self._duplicate(row))

    def _duplicate(self, row: RunRow) -> str:
        """Why this delivery is a duplicate of ``row`` (finished, or a copy of an earlier
        attempt); empty when it is not."""
        if row.status in FINISHED:
            return f"run is already {row.status}"
        if self.attempt < row.attempt:
            return f"a copy of attempt {self.attempt}; the run is at attempt {row.attempt}"
        return ""

    def _run_locked(self, row: RunRow | None, now: datetime, args: Any, kwargs: Any) -> Any:
        """Take the run's lock (its token above the row's when ``row`` was read), start the
        run under it and run the body."""
        floor = row.fencing_token if row is not None else self.headers.fencing_token
        try:
            lock = lock_backend(self.settings).lock(
                f"run:{self.run_id}",
                ttl=self.settings.lease_seconds,
                fencing_floor=floor,
            )
            acquired = lock.acquire(blocking=False)
        except LockError as exc:
            metrics.lock_error(self.task.name)
            row = row or self._checked(now)  # a duplicate or an expired run ends here
            if self.settings.redis_unavailable != "fail_open":
                self.unreachable(
                    f"lock backend unreachable ({exc}); REDIS_UNAVAILABLE=fail_closed",
                    args,
                    kwargs,
                )
            log_run(
                logging.WARNING,
                "run %s: lock backend unreachable (%s); REDIS_UNAVAILABLE="
                "fail_open, so only the database decides",
                self.run_id,
                exc,
                run_id=self.run_id,
                action="fail-open",
            )
            return self._run_unlocked(row, now, args, kwargs, mode="fail_open")
        if not acquired:
            # Someone holds the run: alive (then it finishes and the re-sent copy is dropped
            # as a duplicate) or dead (then its lease runs out and the copy takes over).
            if row is None:
                self._checked(now)  # a duplicate of a finished run ends here, not later
            self.resend(
                "another worker holds the run's lock", self.settings.lease_seconds, args, kwargs
            )
        try:
            return self._run_under(lock, row, now, args, kwargs)
        finally:
            self.overlap.publish_released()  # the waiting run the running lock was handed to

    def _run_under(
        self, lock: DistributedLock, row: RunRow | None, now: datetime, args: Any, kwargs: Any
    ) -> Any:
        """The run's lock acquired: start the run under it, the overlap policy applied, and
        run the body; the locks are given back when the delivery ends."""
        with self.locks:
            ended = threading.Event()  # the run is over: no lease in the ledger to keep
            watched = lock.watch(
                on_renewed=self.lease.renew, on_lost=lambda _held: self.lease.keep(ended)
            )
            token = self.locks.enter_context(watched).fencing_token
            self.locks.callback(ended.set)
            read_first = row is not None
            if row is not None:
                self.overlap.before_start(row, token, now, args, kwargs)
            started = self._start(token, now, locked=True)
            if started is None:
                if row is None:
                    row = self._checked(now)  # says why, or ends the delivery
                    if row.fencing_token >= token:  # the lock's counter was behind the run's
                        self.locks.close()
                        return self._run_locked(row, now, args, kwargs)
                self._refused(row, now, args, kwargs)
            if not read_first:
                self.overlap.after_start(started, token, now, args, kwargs)
            self.lease.token, self.started_at = token, now
            return self._body(args, kwargs)

    def _start(self, token: int, now: datetime, *, locked: bool) -> Started | None:
        """Start the run at ``now`` under ``token``, the run's lock's (``locked``: its lease in
        the ledger kept with the lock) or, without a lock, the run's own one up: the one start
        statement (:meth:`Ledger.start`), which also checks that the run is this message's
        and has not expired. None when refused."""
        return self.ledger.start(
            Start(
                self.run_id,
                token,
                now,
                self.worker,
                self.attempt,
                self.store if locked else None,
                self.lease.end(now) if locked else None,
                task=self.task.name,
                task_id=self.request.id or "",
                periodic_task_id=self.headers.periodic_task_id,
            )
        )

    def _refused(self, row: RunRow, now: datetime, args: Any, kwargs: Any) -> NoReturn:
        """A start under this worker's lock was refused: while the run's worker still holds
        its lease in the ledger (its lock was lost from Redis: a flush, a restart), the lock
        goes back at once, for that worker to set it again, and the delivery comes back once
        the lease is over; otherwise the delivery is a duplicate."""
        left = lease_left(row, now)
        if left > 0:
            self.locks.close()
            self.resend(
                f"the run's worker holds its lease in the ledger for {left:.1f} s more, "
                "though its lock was free (lost from Redis?)",
                left,
                args,
                kwargs,
            )
        self._suppress(self._held_elsewhere(row))

    def _run_unlocked(
        self, row: RunRow, now: datetime, args: Any, kwargs: Any, *, mode: str
    ) -> Any:
        """Eager calls, ``fail_open`` and a publisher locking elsewhere: the conditional start
        alone decides (a run already started is never taken over); the overlap policy is
        checked on the ledger and the database's running lock, held for the body."""
        with self.locks:
            self.overlap.before_unlocked_start(row, mode)
            token = row.fencing_token + 1  # the run's own sequence: no lock gives one
            if self._start(token, now, locked=False) is None:
                self._suppress(f"it already started (database check, {mode})")
            self.lease.token, self.started_at = token, now
            return self._body(args, kwargs)

    def _mismatch(self, run: RunRow | None) -> str:
        if run is None:
            return f"unknown run {self.run_id}"
        if run.task_name != self.task.name:
            return f"run {self.run_id} belongs to task {run.task_name!r}"
        if run.celery_task_id and run.celery_task_id != self.request.id:
            return f"run {self.run_id} has Celery task id {run.celery_task_id}"
        claimed_for = self.headers.periodic_task_id
        if claimed_for is not None and run.periodic_task_id != claimed_for and not run.task_deleted:
            return f"run {self.run_id} is not a run of periodic task {claimed_for}"
        return ""

    def _message_expiry(self) -> datetime | None:
        """The message's own ``expires`` (for runs whose row has no ``expires_at``)."""
        expires = self.request.expires
        if not expires:
            return None
        from celery.utils.time import maybe_iso8601, maybe_make_aware

        instant = maybe_iso8601(expires) if isinstance(expires, str) else expires
        if not isinstance(instant, datetime):
            return None
        aware: datetime = maybe_make_aware(instant, self.task.app.timezone)
        return aware

    # -- the body and its outcome ---------------------------------------------------------------

    def _body(self, args: Any, kwargs: Any) -> Any:
        stack = getattr(_active, "stack", None)
        if stack is None:
            stack = _active.stack = []
        stack.append(self)
        try:
            result = self.task.run(*args, **kwargs)
        except Retry as exc:
            if not self.handed_over:  # eager mode, or a Retry raised without retry()
                self.hand_over(self.attempt + 1, str(exc))
            raise
        except Reject as exc:
            # (a run replaced meanwhile is not requeued: it ends, revoked)
            if not (
                exc.requeue
                and self.token is not None
                and self.ledger.requeue(self.run_id, self.token, f"requeued: {exc.reason!r}")
            ):
                self._finish(RunStatus.FAILED, traceback.format_exc(limit=20))
            raise
        except Exception:
            self._finish(RunStatus.FAILED, traceback.format_exc(limit=20))
            raise
        finally:
            stack.pop()
        self._finish(RunStatus.SUCCEEDED)
        return result
