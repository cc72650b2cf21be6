"""Runs that will never hear from a worker get an outcome all the same.

A run normally leaves ``dispatched`` / ``started`` because a worker records what happened.
Some never will: a message that expired in the queue (a worker discards it), a worker killed
while it ran a ``DriftSafeTask`` without late acknowledgement (nothing redelivers it), a plain
task killed mid-body or run on a worker without this app (elsewhere the worker records a plain
task's outcome, :mod:`celery_driftsafe.worker.plain_task_receivers`). Each beat runs
:func:`reconcile` every
``RECONCILE_INTERVAL_SECONDS`` (a minute), in a thread of its own; each batch is locked as it is
read and each change is conditional on the status it read, so beats reconciling at once never
fight.

* ``claimed``, ``dispatched`` or ``waiting`` (overlap policies ``buffer_one``, ``buffer_all``)
  past its ``expires_at`` (plus a lease, for a worker that took it just in time) becomes
  ``expired``: a worker discards the message, and ``DriftSafeTask`` refuses a finished run.
* ``started`` longer than ``STUCK_RUN_SECONDS`` ago, whose run lock nobody holds (its worker
  renews the lock while the body runs), becomes ``failed`` ("worker lost"), written under a
  fresh fencing token so that a worker that was merely paused cannot record over it. The
  lock is looked for where the starting worker took it (:mod:`celery_driftsafe.ledger.lost_runs`).
  A ``started`` run that another run replaced (overlap policy ``replace``) becomes ``revoked``
  the same way, as soon as its lease is over: by each beat's recovery pass (:func:`recover`),
  which also publishes its replacement then.
* ``dispatched`` longer than ``RESULT_LOOKUP_SECONDS`` ago takes the state of the Celery
  result backend when it has one for the task id (``SUCCESS``, ``FAILURE``, ``REVOKED``);
  otherwise it stays (asked again next time), and after ``STUCK_RUN_SECONDS`` the admin lists it
  under "needs attention".
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from celery.backends.base import DisabledBackend
from django.db import transaction
from django.db.models import CharField, Q, Value
from django.db.models.functions import Cast, Concat

from celery_driftsafe.beat.result_states import backend_states
from celery_driftsafe.claim.pausing import count_outcomes
from celery_driftsafe.conf import DriftSafeSettings, get_settings
from celery_driftsafe.exceptions import LockError
from celery_driftsafe.ledger.lost_runs import Until, lost_runs, next_page, replaced_runs_gone
from celery_driftsafe.models import Run, RunStatus
from celery_driftsafe.monitoring import metrics
from celery_driftsafe.store.background_pass import BackgroundPass

if TYPE_CHECKING:
    from celery_driftsafe.publish.dispatcher import Dispatcher

logger = logging.getLogger("celery_driftsafe.reconcile")

_BACKEND_STATES = {
    "SUCCESS": RunStatus.SUCCEEDED,
    "FAILURE": RunStatus.FAILED,
    "REVOKED": RunStatus.REVOKED,
}


#: Runs one statement settles (and one request to the result backend reads) at a time.
RECONCILE_BATCH = 500
#: A pass takes batch after batch until nothing is left or this long has gone; the next pass
#: goes on where it stopped. Runs come at most at the rate beats claim them, and a batch of 500
#: takes tens of milliseconds, so a pass keeps up with any stream a cluster can claim.
RECONCILE_BUDGET_SECONDS = 20.0
#: Of that, the time a pass may spend on result backend look-ups that settle nothing: runs the
#: backend knows nothing of (an ``ignore_result`` task) are asked about again each time round
#: until they expire, and must not keep a beat's thread busy a third of every minute.
RECONCILE_IDLE_SECONDS = 5.0

_WAITING = (RunStatus.CLAIMED, RunStatus.DISPATCHED, RunStatus.WAITING)


@dataclass
class Reconciled:
    expired: list[int] = field(default_factory=list)
    lost: list[int] = field(default_factory=list)
    #: Started runs replaced under overlap policy ``replace`` whose delivery is gone: revoked.
    replaced: list[int] = field(default_factory=list)
    from_results: list[int] = field(default_factory=list)
    #: Started runs whose lock is in a store this beat cannot reach: left as they are.
    unreachable: list[int] = field(default_factory=list)
    #: Where the look-up in the result backend stopped, ``(claimed_at, id)`` of the last run
    #: read (None: it read them all); the next pass starts after it, so that runs the backend
    #: knows nothing of do not hide the runs behind them.
    backend_after: tuple[datetime, int] | None = None
    #: Of ``from_results``, how many took each status.
    from_results_by_status: dict[str, int] = field(default_factory=dict)

    def outcomes(self) -> dict[str, int]:
        """Runs given each outcome (the metrics' ``outcome`` label)."""
        return {
            "expired": len(self.expired),
            "worker_lost": len(self.lost),
            "replaced": len(self.replaced),
            **self.from_results_by_status,
        }


def stuck(now: datetime, settings: DriftSafeSettings | None = None) -> Q:
    """Runs with no outcome ``STUCK_RUN_SECONDS`` after they were claimed (the admin's
    "needs attention" filter)."""
    settings = settings or get_settings()
    bound = now - timedelta(seconds=settings.stuck_run_seconds)
    return Q(
        status__in=(RunStatus.CLAIMED, RunStatus.DISPATCHED, RunStatus.STARTED, RunStatus.RETRYING),
        claimed_at__lt=bound,
    )


def reconcile(
    now: datetime,
    *,
    lease: timedelta,
    app: Any | None = None,
    using: str = "default",
    batch: int = RECONCILE_BATCH,
    budget: float = RECONCILE_BUDGET_SECONDS,
    backend_after: tuple[datetime, int] | None = None,
    settings: DriftSafeSettings | None = None,
    stop: threading.Event | None = None,
) -> Reconciled:
    """One pass (see the module docstring); ``now`` is the authority's. Each kind of run is
    taken ``batch`` at a time, one statement a batch, until none is left or ``budget``
    seconds have gone (at least one batch of each); the look-up in the result backend starts
    after ``backend_after`` (a former pass's :attr:`Reconciled.backend_after`); ``stop`` set
    ends the pass after the batch in flight (a stopping beat)."""
    settings = settings or get_settings()
    until = Until(time.monotonic() + budget, stop)
    done = Reconciled()
    runs = Run.objects.using(using)
    _expire(runs, now, lease, batch, until, done)
    bound = now - timedelta(seconds=settings.stuck_run_seconds)
    lost = lost_runs(runs, bound, now, batch, until, using, settings)
    done.lost, done.replaced, done.unreachable = lost.failed, lost.replaced, lost.unreachable
    # A lost worker's run failed: towards its task's pause_after_failures.
    count_outcomes(using, done.lost, RunStatus.FAILED, now)
    if app is not None and not isinstance(app.backend, DisabledBackend):
        lookup = now - timedelta(seconds=settings.result_lookup_seconds)
        done.backend_after = _from_result_backend(
            app, runs, lookup, now, batch, until, backend_after, done
        )
    if done.unreachable:
        logger.warning(
            "%d started runs hold their locks in a store this beat cannot reach (another "
            "REDIS_URL, no REDIS_URL here): they are left as they are, for a beat that locks "
            "there; run ids: %s",
            len(done.unreachable),
            done.unreachable[:20],
            extra={"action": "reconcile"},
        )
    if done.expired or done.lost or done.replaced or done.from_results:
        # A plain task's runs end this way every minute: only an expiry or a lost worker warns.
        logger.log(
            logging.WARNING if done.expired or done.lost else logging.INFO,
            "reconciled runs without an outcome: %d expired, %d worker lost, %d replaced, %d "
            "from the result backend",
            len(done.expired),
            len(done.lost),
            len(done.replaced),
            len(done.from_results),
            extra={"action": "reconcile"},
        )
    return done


def _expire(
    runs: Any, now: datetime, lease: timedelta, batch: int, until: Until, done: Reconciled
) -> None:
    """Record ``expired`` the waiting runs a lease past their expiry, a batch a statement
    (each change conditional on the run still waiting: a worker may take one meanwhile).
    Each status is read in claim order from the outbox index, once a pass; a batch is
    locked as it is read, skipping rows another beat's pass holds (two statements updating
    the same rows in different orders deadlock)."""
    error = Concat(
        Value("expired: not started before its expiry at "),
        Cast("expires_at", CharField()),
        output_field=CharField(),
    )
    expired = RunStatus.EXPIRED
    for status in _WAITING:
        waiting = runs.filter(status=status, expires_at__lt=now - lease).select_for_update(
            skip_locked=True
        )
        after: tuple[datetime, int] | None = None
        while True:
            with transaction.atomic(using=runs.db):
                page = next_page(waiting, "claimed_at", after, batch)
                done.expired += _settle(runs, [pk for pk, _ in page], status, expired, now, error)
            if len(page) < batch:
                break
            if until.reached():
                return
            after = (page[-1][1], page[-1][0])
        # A row without a claim instant (written by hand) has no place in that order.
        while True:
            with transaction.atomic(using=runs.db):
                found = list(waiting.filter(claimed_at=None).values_list("pk", flat=True)[:batch])
                done.expired += _settle(runs, found, status, expired, now, error)
            if len(found) < batch or until.reached():
                break


def _settle(
    runs: Any, pks: list[int], was: str, status: str, now: datetime, error: Any
) -> list[int]:
    """Give the runs ``pks`` that are still ``was`` the outcome ``status`` (finished at ``now``,
    with ``error``) in one statement; the ids it changed."""
    if not pks or not runs.filter(pk__in=pks, status=was).update(
        status=status, finished_at=now, error=error
    ):
        return []
    changed = runs.filter(pk__in=pks, status=status, finished_at=now)
    return list(changed.values_list("pk", flat=True))


def _from_result_backend(
    app: Any,
    runs: Any,
    bound: datetime,
    now: datetime,
    batch: int,
    until: Until,
    after: tuple[datetime, int] | None,
    done: Reconciled,
) -> tuple[datetime, int] | None:
    """Runs ``dispatched`` before ``bound`` take the result backend's state, a batch a
    request where the backend can (:func:`backend_states`); returns where the look-up stopped
    (None: at the end). Batches that settle nothing (runs of an ``ignore_result`` task, read
    again each time round until they expire) stop the look-up after
    :data:`RECONCILE_IDLE_SECONDS`."""
    waiting = (
        runs.filter(status=RunStatus.DISPATCHED, claimed_at__lt=bound)
        .exclude(celery_task_id="")
        .select_for_update(skip_locked=True)
    )
    idle = 0.0
    while True:
        started = time.monotonic()
        with transaction.atomic(using=runs.db):  # the batch's rows held, as in _expire
            page = next_page(waiting, "claimed_at", after, batch, "celery_task_id")
            if not page:
                return None
            try:
                found = backend_states(app, [task_id for _, _, task_id in page])
            except Exception as exc:  # no result backend, or it is away: nothing to learn
                logger.debug("no outcomes from the result backend: %r", exc)
                return after
            settled = _settle_from_backend(runs, page, found, now, done)
        if not settled:
            idle += time.monotonic() - started
        after = (page[-1][1], page[-1][0])
        if len(page) < batch:
            return None
        if until.reached() or idle >= RECONCILE_IDLE_SECONDS:
            return after


def _settle_from_backend(
    runs: Any, page: list[tuple[Any, ...]], found: dict[str, str], now: datetime, done: Reconciled
) -> bool:
    """Give the runs of ``page`` (id, claim instant, task id) the outcome ``found`` in the
    backend for them; whether any had one."""
    by_state: dict[str, list[int]] = {}
    for pk, _, task_id in page:
        state = found.get(task_id)
        if state in _BACKEND_STATES:
            by_state.setdefault(state, []).append(pk)
    for state, pks in by_state.items():
        status = _BACKEND_STATES[state]
        error = f"outcome taken from the result backend: {state}"
        settled = _settle(runs, pks, RunStatus.DISPATCHED, status, now, error)
        count_outcomes(runs.db, settled, status, now)  # in the batch's transaction
        done.from_results += settled
        by_status = done.from_results_by_status
        by_status[status] = by_status.get(status, 0) + len(settled)
    return bool(by_state)


def recover(
    now: datetime,
    node_id: str,
    settings: DriftSafeSettings,
    dispatcher: Dispatcher,
    *,
    using: str = "default",
) -> None:
    """A beat's recovery pass: mark silent nodes dead, re-publish stale claims (the outbox) and
    the waiting runs (overlap policies ``buffer_one``, ``buffer_all``, ``replace``: each task's
    earliest) whose task's running run is over (its worker died before it could publish them),
    through ``dispatcher``; and record ``revoked`` the runs replaced under ``replace`` whose
    delivery is gone (a batch a pass: :func:`~celery_driftsafe.ledger.lost_runs.lost_runs`), so
    that none stays ``started`` beside the replacement that runs. Reconciling runs is
    :class:`BackgroundReconciler`'s."""
    from celery_driftsafe.beat import nodes
    from celery_driftsafe.claim.outbox import reclaim_stale, release_waiting

    dead_after = timedelta(seconds=settings.node_dead_after_seconds)
    nodes.mark_dead(now, dead_after, node_id, using=using)
    gone = replaced_runs_gone(now, RECONCILE_BATCH, Until(time.monotonic()), using, settings)
    if gone.replaced:
        logger.info(
            "%d replaced runs recorded revoked: their lease is over and nobody holds their "
            "lock (overlap policy 'replace'); run ids: %s",
            len(gone.replaced),
            gone.replaced[:20],
            extra={"action": "reconcile"},
        )
        metrics.reconciled({"replaced": len(gone.replaced)})
    lease = timedelta(seconds=settings.lease_seconds)
    stale = reclaim_stale(now, node_id, lease=lease, using=using, dead_after=dead_after)
    take_lock = TakeRunningLock(settings, using)
    stale += release_waiting(now, node_id, take_lock=take_lock, using=using)
    dispatcher.dispatch(stale)


class TakeRunningLock:
    """Takes a waiting run's task's running lock for its release, where the waiting run's
    worker looked for it (its ``lock_store``), as far as this beat reaches it; then hands it
    to the run taken back (it runs next), or frees it. None (the run left waiting) when the
    lock is held, or the store is out of reach or cannot tell: a beat that reaches it
    publishes the run. (A run whose periodic task was deleted, or no longer waits, is
    released without a lock: :func:`~celery_driftsafe.claim.outbox.release_waiting`.)"""

    def __init__(self, settings: DriftSafeSettings, using: str) -> None:
        self.settings = settings
        self.using = using

    def __call__(self, run: Run) -> Callable[[bool], None] | None:
        from celery_driftsafe.locks import lock_backend_for, running_lock, running_lock_heir

        assert run.periodic_task_id is not None
        locks = lock_backend_for(run.lock_store, self.settings, using=self.using)
        if locks is None:
            return None
        lock = running_lock(locks, run.periodic_task_id, self.settings)
        try:
            if not lock.acquire(blocking=False):
                return None
        except LockError:
            return None

        def settle(taken_back: bool) -> None:
            try:
                if taken_back:
                    lock.hand_over(running_lock_heir(run.pk))
                else:
                    lock.release()
            except LockError as exc:
                logger.warning(
                    "could not hand the running lock of %s to its waiting run %s, or free it "
                    "(%s): it is free once its lease runs out",
                    run.task_name,
                    run.pk,
                    exc,
                    extra={"action": "release-waiting-failed", "task": run.task_name},
                )

        return settle


class BackgroundReconciler(BackgroundPass):
    """A beat's reconciliation: at most every ``RECONCILE_INTERVAL_SECONDS``, one
    :func:`reconcile` pass in a thread of its own (its own database connection), so that the
    look-up never holds up a round; the first with the beat's first round. Beats reconciling at
    once never fight (every change is conditional on the status it read)."""

    thread_name = "driftsafe-reconcile"

    def __init__(
        self,
        *,
        app: Any,
        using: str = "default",
        monotonic: Callable[[], float],
        budget: float = RECONCILE_BUDGET_SECONDS,
    ) -> None:
        super().__init__(using=using, monotonic=monotonic, first_at=0.0)
        self.app = app
        self.budget = budget
        self.last: Reconciled | None = None
        #: Where the last pass's look-up in the result backend stopped.
        self._backend_after: tuple[datetime, int] | None = None

    def interval(self) -> float | None:
        return get_settings().reconcile_interval_seconds

    def run_pass(self, now: datetime) -> None:
        settings = get_settings()
        try:
            self.last = reconcile(
                now,
                lease=timedelta(seconds=settings.lease_seconds),
                app=self.app,
                using=self.using,
                budget=self.budget,
                backend_after=self._backend_after,
                settings=settings,
                stop=self._stop,
            )
            self._backend_after = self.last.backend_after
            metrics.reconciled(self.last.outcomes())
        except Exception as exc:  # an outage, say: the next pass tries again
            logger.warning(
                "reconciling runs failed; trying again in %g s: %s",
                settings.reconcile_interval_seconds,
                exc,
                extra={"action": "reconcile"},
            )
