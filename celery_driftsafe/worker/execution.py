"""One delivery of one run, inside a worker (or an eager call): the steps
:class:`~celery_driftsafe.task.DriftSafeTask` takes around the body.

A delivery that must not run the body (duplicate, copy of an earlier attempt, expired, skipped,
re-sent for later, forged) raises :class:`celery.exceptions.Ignore`: Celery then acknowledges
the message and writes nothing to the result backend, so only the body's execution ever stores
a result under the run's task id.
"""

from __future__ import annotations

import logging
import threading
import traceback
from datetime import datetime
from typing import Any, NoReturn

from celery.exceptions import Ignore, Reject, Retry

from celery_driftsafe.core.stored_names import FINISHED, RunStatus
from celery_driftsafe.exceptions import LedgerUnavailable, LockError
from celery_driftsafe.ledger.run_ledger import RunRow, Start
from celery_driftsafe.locks import lock_backend, lock_identity
from celery_driftsafe.monitoring import metrics
from celery_driftsafe.worker.execution_outcomes import UNREACHABLE_RESEND_SECONDS, log_run
from celery_driftsafe.worker.execution_overlap import OverlapPolicy

#: (the publisher's, this worker's) lock stores already reported as differing.
_LOCKS_REPORTED: set[tuple[str, str]] = set()

_active = threading.local()


def current_execution() -> Execution | None:
    """The execution whose body runs in this thread, if any."""
    stack: list[Execution] = getattr(_active, "stack", [])
    return stack[-1] if stack else None


class Execution(OverlapPolicy):
    """One delivery of one run (see the module docstring)."""

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
            self._suppress(duplicate)
        expires_at = row.expires_at or self._message_expiry()
        if expires_at is not None and now >= expires_at and row.status != RunStatus.STARTED:
            self._expire(now, expires_at)  # a started run is taken over, not expired
        return row

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
        with self.locks:
            ended = threading.Event()  # the run is over: no lease in the ledger to keep
            watched = lock.watch(
                on_renewed=self._renew_lease, on_lost=lambda _held: self._keep_lease(ended)
            )
            token = self.locks.enter_context(watched).fencing_token
            self.locks.callback(ended.set)
            start = Start(
                self.run_id,
                token,
                now,
                self.worker,
                self.attempt,
                self._store,
                self._lease_end(now),
            )
            if row is not None:
                self._check_overlap_locked(row, token, args, kwargs)
                if not self.ledger.start(start):
                    self._refused(row, now, args, kwargs)
            else:
                started = self.ledger.start_checked(
                    start,
                    task=self.task.name,
                    task_id=self.request.id,
                    periodic_task_id=self.headers.periodic_task_id,
                )
                if started is None:
                    row = self._checked(now)  # says why, or ends the delivery
                    if row.fencing_token >= token:  # the lock's counter was behind the run's
                        self.locks.close()
                        return self._run_locked(row, now, args, kwargs)
                    self._refused(row, now, args, kwargs)
                periodic_task_id, overlap_policy, took_over = started
                if periodic_task_id is not None and overlap_policy == "skip":
                    self._hold_overlap_lock_or_skip(
                        periodic_task_id, token, args, kwargs, took_over=took_over, started_at=now
                    )
            self.token, self.started_at = token, now
            return self._body(args, kwargs)

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
            token = self.ledger.start_unlocked(self.run_id, now, self.worker, self.attempt)
            if token is None:
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
