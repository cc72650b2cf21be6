"""The overlap policies ``skip``, ``buffer_one``, ``buffer_all`` and ``replace`` for one delivery of
a run: whether another run of the task runs, the task's running lock, and what a run that finds its
task running records.

Two proofs say a run of the task runs: the task's running lock (``task-running:<periodic task
id>``), held for the body, and the ledger (:meth:`Overlap._another_runs`, the one answer:
another run ``started`` whose worker's lease lasts). Both are consulted, so a lock Redis lost
while a body runs (a flush, an eviction, a restart that kept no data) does not let the next
slot's run start beside it. The ledger is asked first, about runs started before this one
only, so that of two runs started at once one runs (the earlier).

A run that finds its task running is recorded ``skipped`` (``skip``), or waits in the ledger
(``waiting``; ``buffer_one``: one a task at most, ``buffer_all``: up to
:data:`~celery_driftsafe.core.stored_names.BUFFER_ALL_MAX_WAITING`; a further one is skipped)
and its delivery ends. The delivery that held the lock takes the task's earliest waiting run
(slot order) back into the outbox as it ends, whatever its end
(:func:`~celery_driftsafe.claim.outbox.release_waiting`), hands the lock to it
(:meth:`~celery_driftsafe.locks.DistributedLock.hand_over`: no later slot can start in
between, the waiting run is next) and publishes it; the others keep waiting, each released in
turn by the run before it; a beat does when that worker died
(:func:`~celery_driftsafe.beat.recovery.recover`). Under ``buffer_all`` a run that finds the
lock free while others wait does not overtake them: it waits too, and the earliest goes.

``replace``: a run that finds its task running waits as ``buffer_one``'s does (a run already
waiting is replaced first: it ends ``revoked``), then marks the running run replaced in the
ledger (:meth:`~celery_driftsafe.ledger.run_ledger.Ledger.replace_running`: it ends
``revoked``, naming its replacement, whatever its body does and whenever its end comes, and
never retries or starts again) and asks Celery to revoke it with ``terminate=True``. It runs
once the replaced body is gone, handed the running lock as a waiting run is: by the replaced
run's own delivery as it ends (a prefork pool process unwinds on the revoke's SIGTERM, a gevent
or eventlet greenlet on its kill; a pool that cannot terminate a body, threads or solo, lets it
run to its end: :class:`~celery_driftsafe.worker.request.DriftSafeRequest` says so instead of
failing the revoke); for a prefork pool process that dies outright, which cannot, by the
worker's main process once the pool has reaped it (:func:`replaced_body_killed`, which takes
the lock from the killed holder: :meth:`~celery_driftsafe.locks.DistributedLock.take_from`);
or by a beat after the lease when that worker is gone too (which then records the replaced
run ``revoked``: :func:`~celery_driftsafe.ledger.lost_runs.replaced_runs_gone`). So two
bodies of the task never run at once, whatever the pool, and a revoke that never reaches the
worker (its remote control off or out of reach) only means the replacement waits for the
body's end.

The delivery (:class:`~celery_driftsafe.worker.execution.Execution`) asks before it starts the
run when it read the run first (:meth:`Overlap.before_start`,
:meth:`Overlap.before_unlocked_start`), or right after its one conditional start otherwise
(:meth:`Overlap.after_start`).
"""

from __future__ import annotations

import logging
from contextlib import ExitStack, suppress
from datetime import datetime
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

from celery import Task
from celery.exceptions import Ignore

from celery_driftsafe.core.stored_names import (
    BUFFERING,
    MAX_WAITING,
    WAITING_POLICIES,
    OverlapPolicy,
    RunKind,
    RunStatus,
)
from celery_driftsafe.exceptions import LockError, LockLost
from celery_driftsafe.ledger.run_ledger import Ledger, RunRow, Started
from celery_driftsafe.locks import (
    lock_backend,
    running_lock,
    running_lock_heir,
    running_lock_holder,
)
from celery_driftsafe.locks.database import DatabaseLockBackend
from celery_driftsafe.monitoring import metrics
from celery_driftsafe.store.clock import authority_clock
from celery_driftsafe.worker import log_run

if TYPE_CHECKING:
    from celery_driftsafe.claim.outbox import ClaimedRun
    from celery_driftsafe.conf import DriftSafeSettings
    from celery_driftsafe.core.headers import RunHeaders
    from celery_driftsafe.locks.contract import DistributedLock, HeldLock

SKIPPED_WHY = "skipped: the previous run of this task is still running (overlap policy 'skip')"
#: A run taken over from a lost worker while the task's next run holds its running lock.
LOST_NOT_AGAIN = (
    "failed: the worker that started it was lost, and it is not run again while the task's "
    "next run is running (overlap policy 'skip')"
)
#: Overlap policies ``buffer_one``, ``buffer_all``: the run waits in the ledger for the task's
#: running run (and, ``buffer_all``, for the runs of earlier slots waiting before it).
WAITING_WHY = {
    OverlapPolicy.BUFFER_ONE: (
        "waiting: the previous run of this task is still running; this run is published again "
        "when it ends (overlap policy 'buffer_one')"
    ),
    OverlapPolicy.BUFFER_ALL: (
        "waiting: the previous run of this task is still running; this run is published again "
        "when it ends and the waiting runs of earlier slots have run, in slot order "
        "(overlap policy 'buffer_all')"
    ),
}
#: Overlap policies ``buffer_one``, ``buffer_all``: as many runs of the task wait as may.
BUFFER_FULL_WHY = {
    OverlapPolicy.BUFFER_ONE: (
        "skipped: the previous run of this task is still running and another run of it is "
        "already waiting for it; at most one waits (overlap policy 'buffer_one')"
    ),
    OverlapPolicy.BUFFER_ALL: (
        f"skipped: the previous run of this task is still running and "
        f"{MAX_WAITING[OverlapPolicy.BUFFER_ALL]} runs of it are already waiting, the most "
        f"that may wait (overlap policy 'buffer_all')"
    ),
}
#: Overlap policies whose runs wait: a retry's attempt does not wait.
RETRY_NO_WAIT_WHY = (
    "skipped: the previous run of this task is still running, and a retry's attempt does not "
    "wait for it (overlap policy '{policy}')"
)
#: Overlap policies ``buffer_one``, ``buffer_all`` without a run lock (eager, ``fail_open``, a
#: publisher locking elsewhere): nothing would tell when to go on, so the run does not wait.
UNLOCKED_NO_WAIT_WHY = (
    "skipped: the previous run of this task is still running, and without a run lock a run "
    "does not wait for it (overlap policy '{policy}')"
)
#: Overlap policy ``replace``: the run waits in the ledger for the replaced body to be gone.
REPLACING_WHY = (
    "waiting: the previous run of this task is still running; it is revoked (terminated "
    "where its worker's pool can), and this run is published again once its body is gone "
    "(overlap policy 'replace')"
)
#: Overlap policy ``replace``: a later slot's run runs or waits already (this one's delivery
#: came late); an earlier slot does not replace it.
OUTDATED_WHY = (
    "skipped: a run of a later slot of this task runs or waits already, and an earlier slot "
    "does not replace it (overlap policy 'replace')"
)
#: The overlap policies that keep a task's runs from running side by side.
ONE_AT_A_TIME = (OverlapPolicy.SKIP, *WAITING_POLICIES)


class Delivery(Protocol):
    """What the overlap policies use of the delivery they serve."""

    task: Task
    headers: RunHeaders
    ledger: Ledger
    run_id: int
    settings: DriftSafeSettings
    attempt: int
    worker: str
    #: The delivery's locks, given up as it ends (the running lock joins them).
    locks: ExitStack

    @property
    def store(self) -> str:
        """Where this worker takes run locks (:func:`~celery_driftsafe.locks.lock_identity`)."""

    def unreachable(self, why: str, args: Any, kwargs: Any) -> NoReturn:
        """End the delivery: it comes back a little later (a backend was out of reach)."""


class Overlap:
    """The overlap policies for one delivery (see the module docstring)."""

    def __init__(self, delivery: Delivery) -> None:
        self.delivery = delivery
        self.task = delivery.task
        self.ledger = delivery.ledger
        self.run_id = delivery.run_id
        self.settings = delivery.settings
        self.attempt = delivery.attempt
        self.worker = delivery.worker
        self.store = delivery.store
        self.locks = delivery.locks
        #: Overlap policies ``buffer_one``, ``buffer_all``: the waiting run this delivery took
        #: back into the outbox and handed the task's running lock to; published once the
        #: locks are given up.
        self.released: list[ClaimedRun] = []

    def _now(self) -> datetime:
        return authority_clock().now()

    def _skip(self, token: int | None, why: str = SKIPPED_WHY) -> NoReturn:
        """Record the run ``why`` (skipped: its task runs; ``token``: a lock holder's) and end
        the delivery without its body."""
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

    def pass_turn_on(self, row: RunRow) -> None:
        """Overlap policies whose runs wait (``buffer_one``, ``buffer_all``, ``replace``): the
        run ends without its body; if the task's running lock was handed to it (it waited), the
        next waiting run gets it (:meth:`_hand_on`), rather than the task's slots waiting for
        that lock's lease to run out."""
        if row.periodic_task_id is not None and row.overlap_policy in WAITING_POLICIES:
            self._hand_on(row.periodic_task_id, handed=True)

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
    def _applies(row: RunRow) -> bool:
        return row.periodic_task_id is not None and row.overlap_policy in ONE_AT_A_TIME

    def before_start(self, row: RunRow, token: int, now: datetime, args: Any, kwargs: Any) -> None:
        """Under the run lock, before the start: with overlap policy ``skip``, ``buffer_one``
        or ``buffer_all``, hold the task's running lock for the body, or record the run
        ``skipped`` (``skip``) or ``waiting`` (the buffering ones)."""
        if not self._applies(row):
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
        if row.overlap_policy == OverlapPolicy.REPLACE:
            self._skip(token, self._replace(row.periodic_task_id, token, started=False))
        if row.overlap_policy in BUFFERING:
            why = self._wait(row.periodic_task_id, token, row.overlap_policy, started=False)
            self._skip(token, why)
        self._skip(token)

    def before_unlocked_start(self, row: RunRow, mode: str) -> None:
        """Before a start without a run lock (``mode``: ``eager``, ``fail_open``,
        ``lock-mismatch``), with overlap policy ``skip`` (or a buffering one, which does not
        wait here: no shared running lock tells when to go on): record the run ``skipped``
        when another run of the task runs by the ledger (a run started by a lock holder that
        recorded no lease counting too: no lock can judge it here), or when another holds the
        task's running lock in the database. That lock, held for the body, puts two such
        starts at the same instant in order (Redis, where the running lock usually lives, is
        out of reach or not shared); a database lock cannot be taken inside a transaction (an
        eager call in an ``atomic`` block), where the ledger alone decides."""
        if not self._applies(row):
            return
        assert row.periodic_task_id is not None
        why = (
            SKIPPED_WHY
            if row.overlap_policy == OverlapPolicy.SKIP
            else UNLOCKED_NO_WAIT_WHY.format(policy=row.overlap_policy)
        )
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

    def after_start(
        self, started: Started, token: int, started_at: datetime, args: Any, kwargs: Any
    ) -> None:
        """After a start the run was not read for (the fast path; at ``started_at``): with
        overlap policy ``skip``, ``buffer_one`` or ``buffer_all``, hold the task's running
        lock, or end the run skipped (the buffering ones: wait, unless as many runs wait as
        may); a run taken over from a lost worker ran in part, so it ends failed, as a
        reconcile pass records it when the slow path leaves it started."""
        periodic_task_id, policy = started.periodic_task_id, started.overlap_policy
        if periodic_task_id is None or policy not in ONE_AT_A_TIME:
            return
        took_over = started.took_over
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
        if policy in WAITING_POLICIES:
            if took_over:
                why = why.replace("'skip'", f"'{policy}'")
            elif policy == OverlapPolicy.REPLACE:
                why = self._replace(periodic_task_id, token, started=True)
            else:
                why = self._wait(periodic_task_id, token, policy, started=True)
        self._finish(token, status, why)
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

    def _finish(self, token: int, status: str, why: str) -> None:
        """End the run ``status`` under ``token``; a failure (a run taken over from a lost
        worker, not run again) counts towards its task's ``pause_after_failures`` in the same
        transaction (:mod:`celery_driftsafe.claim.pausing`), as every failed run does."""
        from celery_driftsafe.claim.pausing import count_outcome

        now = self._now()

        def finish() -> None:
            if self.ledger.finish(self.run_id, token, status, now, why):
                count_outcome(self.ledger.connection.alias, self.run_id, status, now)

        self.ledger.together(finish)

    def _wait(self, periodic_task_id: int, token: int, policy: str, *, started: bool) -> str:
        """Overlap policy ``policy`` (``buffer_one``, ``buffer_all``), the task's running lock
        held by another run (or, ``buffer_all``, runs waiting before this one): the run waits
        in the ledger, and this delivery ends (its message acknowledged: the run holds no
        worker while it waits). Returns why the run is skipped instead: as many runs of the
        task wait as may (:data:`~celery_driftsafe.core.stored_names.MAX_WAITING`; or the run
        is no longer this delivery's to change, when the skip changes nothing either), or this
        is a retry's attempt, which does not wait (the run's message would come back as its
        first attempt's).

        The run waits first, then looks at the running lock: a run that ends meanwhile looks
        for the waiting run before it gives its lock up and, finding none, once more after
        (:meth:`_look_again`), so one of the two sees the other and takes the waiting run back
        (:meth:`_hand_on`)."""
        if self.attempt > 0:
            return RETRY_NO_WAIT_WHY.format(policy=policy)
        if not self.ledger.wait(
            self.run_id,
            token,
            periodic_task_id,
            WAITING_WHY[OverlapPolicy(policy)],
            store=self.store,
            started=started,
            limit=MAX_WAITING[OverlapPolicy(policy)],
        ):
            # (the lock may be free, when this run queued behind the waiting ones: the
            # earliest goes now, not a beat's pass later)
            if not self._another_runs(periodic_task_id):
                self._hand_on(periodic_task_id, handed=False)
            return BUFFER_FULL_WHY[OverlapPolicy(policy)]
        metrics.execution(self.task.name, RunStatus.WAITING)
        log_run(
            logging.INFO,
            "run %s waits for the task's running run (overlap policy '%s')",
            self.run_id,
            policy,
            run_id=self.run_id,
            action="overlap-wait",
        )
        self.locks.close()  # the run's lock: its next delivery takes it at once
        if not self._another_runs(periodic_task_id):
            self._hand_on(periodic_task_id, handed=False)
        raise Ignore()

    def _replace(self, periodic_task_id: int, token: int, *, started: bool) -> str:
        """Overlap policy ``replace``, the task's running lock held by another run: this run
        waits in the ledger in place of any run of an earlier slot of the task not started yet
        (waiting, released to run next, or on its way: it ends ``revoked``, replaced before it
        started), marks the running run replaced (:meth:`Ledger.replace_running`), asks Celery
        to revoke it, terminating it (:meth:`_revoke`), and this delivery ends; the run is
        published again, handed the running lock, once the replaced body is gone (see the module
        docstring). As in :meth:`_wait`, it looks at the lock once it waits: a run that ended
        meanwhile did not see it. Returns why the run is skipped instead: a retry's attempt does
        not wait, and a delivery that came late does not replace a later slot's run, running or
        waiting."""
        if self.attempt > 0:
            return RETRY_NO_WAIT_WHY.format(policy=OverlapPolicy.REPLACE)
        now = self._now()
        me = self._named()
        slot = self._slot()
        if slot is not None and self.ledger.later_running(periodic_task_id, self.run_id, slot, now):
            return OUTDATED_WHY
        # an earlier slot's run not started yet is replaced before it starts (the latest slot
        # wins): one released to run next (the running lock handed to it: its delivery finds
        # it revoked and passes the lock on to this one), or a scheduled one whose message is
        # still on its way; and, below, one that waits
        before_start = f"revoked: replaced before it started by {me} (overlap policy 'replace')"
        self.ledger.revoke_pending(
            periodic_task_id,
            self.run_id,
            (RunStatus.CLAIMED, RunStatus.DISPATCHED),
            now,
            before_start,
            before=slot,
            kind=RunKind.SCHEDULED,
        )
        for _ in range(3):  # (a refused wait: another waits; an earlier one is replaced)
            self.ledger.revoke_pending(
                periodic_task_id,
                self.run_id,
                (RunStatus.WAITING,),
                now,
                before_start,
                before=slot,
            )
            if self.ledger.wait(
                self.run_id,
                token,
                periodic_task_id,
                REPLACING_WHY,
                store=self.store,
                started=started,
            ):
                break
        else:
            return OUTDATED_WHY
        self._revoke_retrying(periodic_task_id, now, me)
        replaced = self.ledger.replace_running(
            periodic_task_id,
            self.run_id,
            now,
            f"revoked: replaced by {me} (overlap policy 'replace')",
        )
        metrics.execution(self.task.name, RunStatus.WAITING)
        log_run(
            logging.INFO,
            "run %s replaces the task's running run (%s): revoked, and run once its body "
            "is gone (overlap policy 'replace')",
            self.run_id,
            ", ".join(replaced) or "it ended meanwhile",
            run_id=self.run_id,
            action="overlap-replace",
        )
        self.locks.close()  # the run's lock: its next delivery takes it at once
        if replaced:
            self._revoke(replaced)
        if not self._another_runs(periodic_task_id):
            self._hand_on(periodic_task_id, handed=False)
        raise Ignore()

    def _slot(self) -> datetime | None:
        """This run's slot, as its message says (None: not said, or unreadable)."""
        try:
            return datetime.fromisoformat(self.delivery.headers.slot or "")
        except ValueError:
            return None

    def _named(self) -> str:
        """This run, as the runs it replaces name it: its slot (from its message) and id."""
        slot = self.delivery.headers.slot
        return f"the run of slot {slot} (run {self.run_id})" if slot else f"run {self.run_id}"

    def _revoke_retrying(self, periodic_task_id: int, now: datetime, me: str) -> None:
        """Overlap policy ``replace``: a run of the task between two attempts is replaced too
        (it ends ``revoked``): its retry does not come back."""
        self.ledger.revoke_pending(
            periodic_task_id,
            self.run_id,
            (RunStatus.RETRYING,),
            now,
            f"revoked: replaced before its retry by {me} (overlap policy 'replace')",
        )

    def _revoke(self, task_ids: list[str]) -> None:
        """Ask the workers to revoke the replaced runs' messages, terminating their bodies
        where the pool can (Celery's broadcast: no reply awaited). Never raises: a revoke
        that does not arrive (the broker away, the worker's remote control off) leaves the
        body to run to its end, which the replacement waits for."""
        try:
            self.task.app.control.revoke(task_ids, terminate=True)
        except Exception as exc:
            log_run(
                logging.WARNING,
                "run %s: could not send the revoke of %s (%s); the replaced run's body runs "
                "to its end, and this run waits for it",
                self.run_id,
                ", ".join(task_ids),
                exc,
                run_id=self.run_id,
                action="replace-revoke-failed",
            )

    def _hand_on(self, periodic_task_id: int, *, handed: bool, look_again: bool = True) -> None:
        """Overlap policies ``buffer_one``, ``buffer_all``, outside a body: take the task's
        running lock (free, or, ``handed``, handed to this run), take the task's earliest
        waiting run back and hand the lock to it (:meth:`_take_back_waiting`), then publish
        it. A run that just waited (or could not: as many wait as may) does this when no run
        of the task runs (so it publishes the earliest, itself if it is), and a run the lock
        was handed to whose delivery ends without its body (expired, a copy of a finished run)
        passes its turn on. Nothing when the lock is held, or the lock backend cannot tell:
        then a beat publishes the waiting run once the lock is free. Having given the lock up
        handed to no run, it looks once more (``look_again``, :meth:`_look_again`)."""
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
        if self.released:
            self.publish_released()
        elif look_again:
            self._look_again(periodic_task_id)

    def _look_again(self, periodic_task_id: int) -> None:
        """The task's running lock given up, handed to no run (this delivery looked for a
        waiting run while it held the lock, and found none): a run that began waiting after
        that look found the lock still held and left its turn to the holder, so the holder
        looks once more, and a run it finds waiting is handed on as by a run that just waited
        (:meth:`_hand_on`, with no further look). Of a waiter (writes that it waits, then
        tries the lock) and a holder (gives the lock up, then looks), one sees the other.
        Never raises: a waiting run left is published by a beat's recovery pass."""
        if self.released:  # the lock was handed to the run taken back
            return
        try:
            waiting = self.ledger.others_waiting(periodic_task_id, self.run_id)
        except Exception as exc:  # the database away: the beats take it over
            self._release_failed(exc)
            return
        if waiting:
            self._hand_on(periodic_task_id, handed=False, look_again=False)

    def _take_back_waiting(self, periodic_task_id: int, held: HeldLock) -> None:
        """Overlap policies ``buffer_one``, ``buffer_all``, the task's running lock still held
        (this delivery's body ended, or :meth:`_hand_on` took it): the task's earliest waiting
        run, if any, back into the outbox
        (:func:`~celery_driftsafe.claim.outbox.release_waiting`), and the lock to be handed to
        it as it is given up, so that no later slot's delivery takes it in between; the run is
        published once the lock is handed (:meth:`publish_released`). Never raises: a waiting
        run left is published by a beat's recovery pass. Nothing when the lock is no longer
        this delivery's (its lease ran out while the worker was paused, say): its holder, or a
        beat, takes the waiting run back."""
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

    def publish_released(self) -> None:
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
        lock handed to this run (it waited, overlap policy ``buffer_one`` or ``buffer_all``;
        the policy may have changed to ``skip`` since) is taken whatever else. Under the
        buffering policies, at the body's end the task's earliest waiting run is taken back
        and the lock handed to it (:meth:`_take_back_waiting`). Under ``buffer_all``, a lock
        taken free while other runs of the task wait is given back (:meth:`_queue_behind`).

        The ledger is asked first, and only about runs started before this one's start
        (``starts_at``, written or about to be): of two runs started at once, the later
        neither takes the lock nor skips the earlier, so one of them runs. A run started
        before this one under a lasting lease runs whatever the lock says (Redis may have
        lost the key while its body runs); one started before a waiting run was handed the
        lock is a later slot's, which finds the lock held and waits or is skipped."""
        buffering = policy in WAITING_POLICIES
        earlier = self._another_runs(periodic_task_id, starts_at=starts_at)
        task_lock = running_lock(
            lock_backend(self.settings), periodic_task_id, self.settings, run_id=self.run_id
        )
        try:
            free = not earlier and task_lock.acquire(blocking=False)
            held = free or task_lock.take_handed(running_lock_heir(self.run_id))
        except LockError as exc:
            metrics.lock_error(self.task.name)
            if started:
                self.ledger.requeue(self.run_id, token, f"waiting: {exc}")
            self.locks.close()  # give the run lock back before the delivery comes again
            self.delivery.unreachable(
                f"lock backend unreachable taking the overlap lock ({exc})", args, kwargs
            )
        if (
            free
            and policy == OverlapPolicy.BUFFER_ALL
            and self._queue_behind(periodic_task_id, task_lock)
        ):
            return False
        if held:
            if buffering:  # once the lock is given up (the stack's order)
                self.locks.callback(self._look_again, periodic_task_id)
            watched = self.locks.enter_context(task_lock.watch())
            if buffering:  # before the lock is given up
                self.locks.callback(self._take_back_waiting, periodic_task_id, watched)
            if policy == OverlapPolicy.REPLACE:
                self._revoke_retrying(periodic_task_id, self._now(), self._named())
        return held

    def _queue_behind(self, periodic_task_id: int, task_lock: DistributedLock) -> bool:
        """Overlap policy ``buffer_all``, the task's running lock taken free: whether other
        runs of the task wait (their turn not handed on yet: the run that held the lock was
        lost, or ended just now). Then the lock is given back, and the run waits behind them
        rather than overtake them; the earliest waiting slot goes first, this one if it is the
        earliest (:meth:`_wait`, then :meth:`_hand_on`)."""
        queued = True
        try:
            queued = self.ledger.others_waiting(periodic_task_id, self.run_id)
        finally:
            if queued:
                with suppress(LockError):  # it lapses after its lease
                    task_lock.release()
        return queued


def replaced_body_killed(app: Any, request: Any) -> None:
    """In a prefork worker's main process, once the pool has seen the pool process that ran a
    run's body end (killed by the terminating revoke of overlap policy ``replace``, or lost
    otherwise): if another run replaced that run, take the task's running lock over from the
    killed holder (:meth:`~celery_driftsafe.locks.DistributedLock.take_from`: only the lock
    that run's delivery held, only while its lease lasts; a free lock is taken as any), take
    the task's waiting run back into the outbox, hand the lock to it and publish it, as the
    run's own delivery does at its end. The body is gone for sure then (the pool reaped its
    process), so the replacement starts without waiting out the lease, and never beside it.
    ``request``: the worker request's context. Never raises: what it cannot do, a beat's
    recovery does once the lease is over."""
    from django.db import close_old_connections

    from celery_driftsafe.claim.outbox import release_waiting
    from celery_driftsafe.conf import get_settings
    from celery_driftsafe.core.headers import valid_headers
    from celery_driftsafe.publish.dispatcher import Dispatcher

    headers = valid_headers(request)
    if headers is None or headers.periodic_task_id is None:
        return
    periodic_task_id, run_id = headers.periodic_task_id, headers.run_id
    close_old_connections()
    try:
        if Ledger().replaced_by(run_id) is None:
            return
        settings = get_settings()
        task_lock = running_lock(lock_backend(settings), periodic_task_id, settings)
        if not (
            task_lock.take_from(running_lock_holder(run_id)) or task_lock.acquire(blocking=False)
        ):
            return  # held by a run of the task: its end hands it on
        clock = authority_clock()
        worker = str(getattr(request, "hostname", "") or "")
        with task_lock.watch(watchdog=False) as held:
            runs = release_waiting(
                clock.now(), f"worker:{worker}", periodic_task_id=periodic_task_id
            )
            if runs:
                held.heir = running_lock_heir(runs[0].run_id)
        if runs:
            Dispatcher(app, clock).dispatch(runs)
        log_run(
            logging.INFO,
            "run %s, replaced, was killed: its replacement %s is published (overlap policy "
            "'replace')",
            run_id,
            runs[0].run_id if runs else "(none waiting)",
            run_id=run_id,
            action="replace-killed",
        )
    except Exception as exc:  # the database, Redis or the broker away: a beat does it later
        log_run(
            logging.WARNING,
            "run %s, replaced, was killed; its replacement could not be published (%s): a "
            "beat will, once the task's running lock is free",
            run_id,
            exc,
            run_id=run_id,
            action="release-waiting-failed",
        )
