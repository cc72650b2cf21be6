"""One delivery of one run, inside a worker (or an eager call): the steps
:class:`~celery_driftsafe.task.DriftSafeTask` takes around the body, the overlap policies
``skip`` and ``buffer_one``, and the outcomes the delivery records.

A delivery that must not run the body (duplicate, copy of an earlier attempt, expired, skipped,
re-sent for later, forged) raises :class:`celery.exceptions.Ignore`: Celery then acknowledges
the message and writes nothing to the result backend, so only the body's execution ever stores
a result under the run's task id.

An :class:`Execution` holds the delivery's state (run, attempt, worker, token, locks) and
writes its outcomes to the ledger: a duplicate suppressed, a run skipped or expired, the
delivery re-sent for later, an attempt handed over to its retry, the body's outcome recorded
under the run's fencing token (retried while the database is away).

The overlap policy ``skip``: the task's running lock, held for the body, and what a run that
cannot take it records. The delivery's flow calls it before the start (the slow path) or right
after it (the fast path's one conditional start). The overlap policy ``buffer_one`` takes the
same lock; a run that cannot take it waits in the ledger (``waiting``, one a task at most: a
further one is skipped) and its delivery ends; the delivery that held the lock takes the
waiting run back into the outbox as it ends, whatever its end
(:func:`~celery_driftsafe.claim.outbox.release_waiting`), hands the lock to it
(:meth:`~celery_driftsafe.locks.DistributedLock.hand_over`: no later slot can start in
between, the waiting run is next) and publishes it; a beat does when that worker died
(:func:`~celery_driftsafe.beat.recovery.recover`).

The running lock (``task-running:<periodic task id>``) is one proof that a run of the task is
running; the other is the ledger: another run ``started`` whose worker's lease lasts. Both are
consulted, so a lock Redis lost while a body runs (a flush, an eviction, a restart that kept no
data) does not let the next slot's run start beside it. The ledger is asked first, about runs
started before this one only, so that of two runs started at once one runs (the earlier).
"""

from __future__ import annotations

import logging
import socket
import threading
import traceback
from collections.abc import Callable
from contextlib import ExitStack, suppress
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, NoReturn

from celery import Task
from celery.exceptions import Ignore, Reject, Retry

from celery_driftsafe.conf import get_settings
from celery_driftsafe.core.headers import RunHeaders
from celery_driftsafe.core.stored_names import FINISHED, OverlapPolicy, RunStatus
from celery_driftsafe.exceptions import LedgerUnavailable, LockError, LockLost
from celery_driftsafe.ledger.run_ledger import Ledger, RunRow, Start, Started
from celery_driftsafe.locks import lock_backend, lock_identity, running_lock, running_lock_heir
from celery_driftsafe.locks.database import DatabaseLockBackend
from celery_driftsafe.monitoring import metrics
from celery_driftsafe.store.clock import authority_clock

if TYPE_CHECKING:
    from celery_driftsafe.claim.outbox import ClaimedRun
    from celery_driftsafe.locks.contract import DistributedLock, HeldLock

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
#: Overlap policy ``buffer_one``: the run waits in the ledger for the task's running run.
WAITING_WHY = (
    "waiting: the previous run of this task is still running; this run is published again "
    "when it ends (overlap policy 'buffer_one')"
)
#: Overlap policy ``buffer_one``: another run of the task waits already.
BUFFER_FULL_WHY = (
    "skipped: the previous run of this task is still running and another run of it is "
    "already waiting for it; at most one waits (overlap policy 'buffer_one')"
)
#: Overlap policy ``buffer_one``: a retry's attempt does not wait.
RETRY_NO_WAIT_WHY = (
    "skipped: the previous run of this task is still running, and a retry's attempt does not "
    "wait for it (overlap policy 'buffer_one')"
)
#: Overlap policy ``buffer_one`` without a run lock (eager, ``fail_open``, a publisher locking
#: elsewhere): nothing would tell when to go on, so the run does not wait.
UNLOCKED_NO_WAIT_WHY = (
    "skipped: the previous run of this task is still running, and without a run lock a run "
    "does not wait for it (overlap policy 'buffer_one')"
)
#: The overlap policies that keep a task's runs from running side by side.
ONE_AT_A_TIME = (OverlapPolicy.SKIP, OverlapPolicy.BUFFER_ONE)


def log_run(level: int, message: str, *args: Any, run_id: int, action: str, **extra: Any) -> None:
    """Log about one run, with the run's id and the action in the record's extras."""
    logger.log(level, message, *args, extra={"action": action, "run": run_id, **extra})


#: (the publisher's, this worker's) lock stores already reported as differing.
_LOCKS_REPORTED: set[tuple[str, str]] = set()

_active = threading.local()


def current_execution() -> Execution | None:
    """The execution whose body runs in this thread, if any."""
    stack: list[Execution] = getattr(_active, "stack", [])
    return stack[-1] if stack else None


class Execution:
    """One delivery of one run: its state, its flow, the overlap policy ``skip`` and the
    outcomes it records (see the module docstring)."""

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
        #: Overlap policy ``buffer_one``: the waiting run this delivery took back into the
        #: outbox and handed the task's running lock to; published once the locks are given up.
        self.released: list[ClaimedRun] = []

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

    def _skip(self, token: int | None, why: str = SKIPPED_WHY) -> NoReturn:
        self.ledger.end_waiting(self.run_id, RunStatus.SKIPPED, self._now(), why, token=token)
        metrics.execution(self.task.name, "skipped")
        log_run(
            logging.INFO,
            "run %s skipped: the previous run is still running",
            self.run_id,
            run_id=self.run_id,
            action="overlap-skip",
        )
        raise Ignore()

    def _expire(self, now: datetime, expires_at: datetime, row: RunRow) -> NoReturn:
        why = (
            f"expired: the run expired at {expires_at.isoformat()}, the time authority "
            f"said {now.isoformat()} when it was delivered"
        )
        if self.ledger.end_waiting(self.run_id, RunStatus.EXPIRED, now, why):
            self._pass_turn_on(row)
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
        token = self.token
        if not self._with_attempt(
            lambda: self.ledger.hand_over(self.run_id, token, next_attempt, f"retry: {reason}"),
            RunStatus.RETRYING,
            now,
            reason,
        ):
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
        """The outcome under the token and, for a run that had more than one attempt, this
        attempt's row (a first attempt has none, and its one statement needs no transaction)."""
        token = self.token
        assert token is not None

        def finish() -> bool:
            return self.ledger.finish(self.run_id, token, status, now, error)

        return finish() if self.attempt == 0 else self._with_attempt(finish, status, now, error)

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

    # -- overlap policy skip --------------------------------------------------------------------

    def _another_runs(
        self, periodic_task_id: int, *, starts_at: datetime | None = None, locks_seen: bool = True
    ) -> bool:
        """Whether another run of the task runs: the one answer every overlap decision asks
        (:meth:`Ledger.other_running`). ``starts_at``: this run started then, or this delivery
        starts it then, and only runs started before it count (of two started at once, one
        comes first); None: it does not start now (it waits, or it starts without a lock),
        and every started run counts. ``locks_seen`` False: this delivery sees no run locks,
        so a run that only its lock would judge counts too."""
        return self.ledger.other_running(
            periodic_task_id, self.run_id, self._now(), starts_at=starts_at, locks_seen=locks_seen
        )

    @staticmethod
    def _skips_overlaps(row: RunRow) -> bool:
        return row.periodic_task_id is not None and row.overlap_policy in ONE_AT_A_TIME

    def _check_overlap_locked(
        self, row: RunRow, token: int, now: datetime, args: Any, kwargs: Any
    ) -> None:
        """Under the run lock, before the start: with overlap policy ``skip`` or
        ``buffer_one``, hold the task's running lock for the body, or record the run
        ``skipped`` (``skip``) or ``waiting`` (``buffer_one``)."""
        if not self._skips_overlaps(row):
            return
        assert row.periodic_task_id is not None
        if self._hold_running_lock(
            row.periodic_task_id,
            token,
            args,
            kwargs,
            starts_at=now,
            started=False,
            policy=row.overlap_policy,
        ):
            return
        if row.overlap_policy == OverlapPolicy.BUFFER_ONE:
            self._skip(token, self._wait(row.periodic_task_id, token, started=False))
        self._skip(token)

    def _check_overlap_unlocked(self, row: RunRow, mode: str) -> None:
        """Before a start without a run lock (``mode``: ``eager``, ``fail_open``,
        ``lock-mismatch``), with overlap policy ``skip`` (or ``buffer_one``, which does not
        wait here: no shared running lock tells when to go on): record the run ``skipped``
        when the ledger has another run of the task started, or when another holds the
        task's running lock in the database. That lock, held for the body, puts two such
        starts at the same instant in order (Redis, where the running lock usually lives, is
        out of reach or not shared); a database lock cannot be taken inside a transaction (an
        eager call in an ``atomic`` block), where the ledger alone decides."""
        assert row.periodic_task_id is not None
        why = SKIPPED_WHY if row.overlap_policy == OverlapPolicy.SKIP else UNLOCKED_NO_WAIT_WHY
        if self._another_runs(row.periodic_task_id, locks_seen=False):
            self._skip(None, why)
        task_lock = running_lock(DatabaseLockBackend(), row.periodic_task_id, self.settings)
        try:
            held: bool | None = task_lock.acquire(blocking=False)
        except LockError:  # inside a transaction: not seen by others before it commits
            held = None
        if held is False:
            self._skip(None, why)
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
        policy: str,
        took_over: bool,
        started_at: datetime,
    ) -> None:
        """After a fast-path start (at ``started_at``): hold the task's running lock, or end
        the run skipped (``buffer_one``: wait, unless another run waits); a run taken over
        from a lost worker ran in part, so it ends failed, as a reconcile pass records it when
        the slow path leaves it started."""
        if self._hold_running_lock(
            periodic_task_id,
            token,
            args,
            kwargs,
            starts_at=started_at,
            started=True,
            policy=policy,
        ):
            return
        status = RunStatus.FAILED if took_over else RunStatus.SKIPPED
        why = LOST_NOT_AGAIN if took_over else SKIPPED_WHY
        if policy == OverlapPolicy.BUFFER_ONE:
            if took_over:
                why = why.replace("'skip'", "'buffer_one'")
            else:
                why = self._wait(periodic_task_id, token, started=True)
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

    def _wait(self, periodic_task_id: int, token: int, *, started: bool) -> str:
        """Overlap policy ``buffer_one``, the task's running lock held by another run: the run
        waits in the ledger, and this delivery ends (its message acknowledged: the run holds
        no worker while it waits). Returns why the run is skipped instead: another run of the
        task waits already (or the run is no longer this delivery's to change, when the skip
        changes nothing either), or this is a retry's attempt, which does not wait (the run's
        message would come back as its first attempt's).

        The run waits first, then looks at the running lock: a run that ends meanwhile looks
        for the waiting run before it gives its lock up, so one of the two sees the other and
        takes the waiting run back (:meth:`_hand_on`)."""
        if self.attempt > 0:
            return RETRY_NO_WAIT_WHY
        if not self.ledger.wait(
            self.run_id, token, periodic_task_id, WAITING_WHY, store=self._store, started=started
        ):
            return BUFFER_FULL_WHY
        metrics.execution(self.task.name, RunStatus.WAITING)
        log_run(
            logging.INFO,
            "run %s waits for the task's running run (overlap policy 'buffer_one')",
            self.run_id,
            run_id=self.run_id,
            action="overlap-wait",
        )
        self.locks.close()  # the run's lock: its next delivery takes it at once
        if not self._another_runs(periodic_task_id):
            self._hand_on(periodic_task_id, handed=False)
        raise Ignore()

    def _hand_on(self, periodic_task_id: int, *, handed: bool) -> None:
        """Overlap policy ``buffer_one``, outside a body: take the task's running lock (free,
        or, ``handed``, handed to this run), take the task's waiting run back and hand the lock
        to it (:meth:`_take_back_waiting`), then publish it. A run that just waited does this
        when no run of the task runs (so it publishes itself), and a run the lock was handed
        to whose delivery ends without its body (expired, a copy of a finished run) passes
        its turn on. Nothing when the lock is held, or the lock backend cannot tell: then a
        beat publishes the waiting run once the lock is free."""
        task_lock = running_lock(lock_backend(self.settings), periodic_task_id, self.settings)
        try:
            taken = (
                task_lock.take_handed(running_lock_heir(self.run_id))
                if handed
                else task_lock.acquire(blocking=False)
            )
        except LockError:
            return
        if not taken:
            return
        with task_lock.watch(watchdog=False) as held:
            self._take_back_waiting(periodic_task_id, held)
        self._publish_released()

    def _take_back_waiting(self, periodic_task_id: int, held: HeldLock) -> None:
        """Overlap policy ``buffer_one``, the task's running lock still held (this delivery's
        body ended, or :meth:`_hand_on` took it): the task's waiting run, if any, back into
        the outbox (:func:`~celery_driftsafe.claim.outbox.release_waiting`), and the lock to
        be handed to it as it is given up, so that no later slot's delivery takes it in
        between; the run is published once the lock is handed (:meth:`_publish_released`).
        Never raises: a waiting run left is published by a beat's recovery pass. Nothing when
        the lock is no longer this delivery's (its lease ran out while the worker was paused,
        say): its holder, or a beat, takes the waiting run back."""
        from celery_driftsafe.claim.outbox import release_waiting

        try:
            held.check()
        except LockLost:
            return
        try:
            runs = release_waiting(
                self._now(), f"worker:{self.worker}", periodic_task_id=periodic_task_id
            )
        except Exception as exc:  # the database away: the beats take it over
            self._release_failed(exc)
            return
        if runs:
            held.heir = running_lock_heir(runs[0].run_id)
            self.released.extend(runs)

    def _publish_released(self) -> None:
        """Publish the waiting run taken back (:meth:`_take_back_waiting`) through the outbox.
        Never raises: a run this worker could not publish stays claimed, and a beat publishes
        it after the lease."""
        from celery_driftsafe.publish.dispatcher import Dispatcher

        runs, self.released = self.released, []
        if not runs:
            return
        try:
            Dispatcher(self.task.app, authority_clock()).dispatch(runs)
        except Exception as exc:  # the broker away: the beats take it over
            self._release_failed(exc)

    def _release_failed(self, exc: Exception) -> None:
        log_run(
            logging.WARNING,
            "run %s: could not publish the task's waiting run (%s); a beat will",
            self.run_id,
            exc,
            run_id=self.run_id,
            action="release-waiting-failed",
        )

    def _hold_running_lock(
        self,
        periodic_task_id: int,
        token: int,
        args: Any,
        kwargs: Any,
        *,
        starts_at: datetime,
        started: bool,
        policy: str | None,
    ) -> bool:
        """Take the task's running lock and watch it for the body; False when another run of
        the task runs by the ledger or holds the lock. With the lock backend unreachable, the
        delivery comes again later (a run already ``started`` goes back to waiting first). A
        lock handed to this run (it waited, overlap policy ``buffer_one``; the policy may have
        changed to ``skip`` since) is taken whatever else. Under ``buffer_one``, at the body's
        end the task's waiting run is taken back and the lock handed to it
        (:meth:`_take_back_waiting`).

        The ledger is asked first, and only about runs started before this one's start
        (``starts_at``, written or about to be): of two runs started at once, the later
        neither takes the lock nor skips the earlier, so one of them runs. A run started
        before this one under a lasting lease runs whatever the lock says (Redis may have
        lost the key while its body runs); one started before a waiting run was handed the
        lock is a later slot's, which finds the lock held and waits or is skipped."""
        buffering = policy == OverlapPolicy.BUFFER_ONE
        earlier = self._another_runs(periodic_task_id, starts_at=starts_at)
        task_lock = running_lock(lock_backend(self.settings), periodic_task_id, self.settings)
        try:
            held = (not earlier and task_lock.acquire(blocking=False)) or task_lock.take_handed(
                running_lock_heir(self.run_id)
            )
        except LockError as exc:
            metrics.lock_error(self.task.name)
            if started:
                self.ledger.requeue(self.run_id, token, f"waiting: {exc}")
            self.locks.close()  # give the run lock back before the delivery comes again
            self.resend(
                f"lock backend unreachable taking the overlap lock ({exc})",
                UNREACHABLE_RESEND_SECONDS,
                args,
                kwargs,
            )
        if held:
            watched = self.locks.enter_context(task_lock.watch())
            if buffering:  # given up before the lock is (the stack's order)
                self.locks.callback(self._take_back_waiting, periodic_task_id, watched)
        return held

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
            self._pass_turn_on(row)
            self._suppress(duplicate)
        expires_at = row.expires_at or self._message_expiry()
        if expires_at is not None and now >= expires_at and row.status != RunStatus.STARTED:
            self._expire(now, expires_at, row)  # a started run is taken over, not expired
        return row

    def _pass_turn_on(self, row: RunRow) -> None:
        """Overlap policy ``buffer_one``: the run ends without its body; if the task's running
        lock was handed to it (it waited), the next waiting run gets it (:meth:`_hand_on`),
        rather than the task's slots waiting for that lock's lease to run out."""
        if row.periodic_task_id is not None and row.overlap_policy == OverlapPolicy.BUFFER_ONE:
            self._hand_on(row.periodic_task_id, handed=True)

    def _locks_elsewhere(self) -> bool:
        """Whether the run was published by a process that takes run locks elsewhere (no
        ``REDIS_URL``, another ``KEY_PREFIX``): this worker cannot see the locks of that
        process's fleet, so a held lock there would not stop it from taking a started run
        over. Reported once per process and pair."""
        theirs = self.headers.locks
        if theirs is None:
            return False
        mine = self._store
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

    @property
    def _store(self) -> str:
        return lock_identity(self.settings)

    def _held_elsewhere(self, row: RunRow) -> str:
        """Why a start under this worker's lock was refused."""
        if row.status == RunStatus.STARTED and row.lock_store not in (None, self._store):
            return (
                f"it was started by a worker that locks in {row.lock_store}, whose lock this "
                f"worker (locking in {self._store}) cannot see"
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
                self.resend(
                    f"lock backend unreachable ({exc}); REDIS_UNAVAILABLE=fail_closed",
                    UNREACHABLE_RESEND_SECONDS,
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
            self._publish_released()  # the waiting run the running lock was handed to

    def _run_under(
        self, lock: DistributedLock, row: RunRow | None, now: datetime, args: Any, kwargs: Any
    ) -> Any:
        """The run's lock acquired: start the run under it, the overlap policy applied, and
        run the body; the locks are given back when the delivery ends."""
        with self.locks:
            ended = threading.Event()  # the run is over: no lease in the ledger to keep
            watched = lock.watch(
                on_renewed=self._renew_lease, on_lost=lambda _held: self._keep_lease(ended)
            )
            token = self.locks.enter_context(watched).fencing_token
            self.locks.callback(ended.set)
            read_first = row is not None
            if row is not None:
                self._check_overlap_locked(row, token, now, args, kwargs)
            started = self._start(token, now, locked=True)
            if started is None:
                if row is None:
                    row = self._checked(now)  # says why, or ends the delivery
                    if row.fencing_token >= token:  # the lock's counter was behind the run's
                        self.locks.close()
                        return self._run_locked(row, now, args, kwargs)
                self._refused(row, now, args, kwargs)
            if (
                not read_first
                and started.periodic_task_id is not None
                and started.overlap_policy in ONE_AT_A_TIME
            ):
                self._hold_overlap_lock_or_skip(
                    started.periodic_task_id,
                    token,
                    args,
                    kwargs,
                    policy=started.overlap_policy,
                    took_over=started.took_over,
                    started_at=now,
                )
            self.token, self.started_at = token, now
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
                self._store if locked else None,
                self._lease_end(now) if locked else None,
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
        left = self._lease_left(row, now)
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
            if self._skips_overlaps(row):
                self._check_overlap_unlocked(row, mode)
            token = row.fencing_token + 1  # the run's own sequence: no lock gives one
            if self._start(token, now, locked=False) is None:
                self._suppress(f"it already started (database check, {mode})")
            self.token, self.started_at = token, now
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
            if exc.requeue and self.token is not None:
                self.ledger.requeue(self.run_id, self.token, f"requeued: {exc.reason!r}")
            else:
                self._finish(RunStatus.FAILED, traceback.format_exc(limit=20))
            raise
        except Exception:
            self._finish(RunStatus.FAILED, traceback.format_exc(limit=20))
            raise
        finally:
            stack.pop()
        self._finish(RunStatus.SUCCEEDED)
        return result
