"""Runs that will never hear from a worker get an outcome all the same.

A run normally leaves ``dispatched`` / ``started`` because a worker records what happened.
Some never will: a message that expired in the queue (a worker discards it), a worker killed
while it ran a ``DriftSafeTask`` without late acknowledgement (nothing redelivers it), a plain
task (no base class records anything). Each beat runs :func:`reconcile` with its outbox pass;
every statement is bounded, and each change is conditional on the status it read, so beats
reconciling at once never fight.

* ``claimed`` or ``dispatched`` past its ``expires_at`` (plus a lease, for a worker that took
  it just in time) becomes ``expired``: a worker discards the message, and ``DriftSafeTask``
  refuses a finished run.
* ``started`` longer than ``STUCK_RUN_SECONDS`` ago, whose run lock nobody holds (its worker
  renews the lock while the body runs), becomes ``failed`` ("worker lost"), written under a
  fresh fencing token so that a worker that was merely paused cannot record over it.
* ``dispatched`` longer than ``STUCK_RUN_SECONDS`` ago takes the state of the Celery result
  backend when it has one for the task id (``SUCCESS``, ``FAILURE``, ``REVOKED``); otherwise it
  stays, and the admin lists it under "needs attention".
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.db.models import Q

from celery_driftsafe.conf import DriftSafeSettings, get_settings
from celery_driftsafe.exceptions import LockError
from celery_driftsafe.models import Run, RunStatus

if TYPE_CHECKING:
    from celery_driftsafe.publisher import Dispatcher

logger = logging.getLogger(__name__)

_BACKEND_STATES = {
    "SUCCESS": RunStatus.SUCCEEDED,
    "FAILURE": RunStatus.FAILED,
    "REVOKED": RunStatus.REVOKED,
}


@dataclass
class Reconciled:
    expired: list[int] = field(default_factory=list)
    lost: list[int] = field(default_factory=list)
    from_results: list[int] = field(default_factory=list)


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
    limit: int = 200,
    settings: DriftSafeSettings | None = None,
) -> Reconciled:
    """One bounded pass (see the module docstring); ``now`` is the authority's."""
    settings = settings or get_settings()
    done = Reconciled()
    runs = Run.objects.using(using)
    expired = list(
        runs.filter(
            status__in=(RunStatus.CLAIMED, RunStatus.DISPATCHED), expires_at__lt=now - lease
        ).values_list("pk", "expires_at")[:limit]
    )
    for pk, expires_at in expired:
        if runs.filter(pk=pk, status__in=(RunStatus.CLAIMED, RunStatus.DISPATCHED)).update(
            status=RunStatus.EXPIRED,
            finished_at=now,
            error=f"expired: not started before its expiry at {expires_at}",
        ):
            done.expired.append(pk)
    bound = now - timedelta(seconds=settings.stuck_run_seconds)
    started = runs.filter(status=RunStatus.STARTED, started_at__lt=bound)
    for pk, started_at, token in started.values_list("pk", "started_at", "fencing_token")[:limit]:
        if _worker_lost(pk, started_at, token, now, using, settings):
            done.lost.append(pk)
    if app is not None:
        _from_result_backend(app, runs, bound, now, limit, done)
    if done.expired or done.lost or done.from_results:
        logger.warning(
            "reconciled runs without an outcome: %d expired, %d worker lost, %d from the "
            "result backend",
            len(done.expired),
            len(done.lost),
            len(done.from_results),
            extra={"action": "reconcile"},
        )
    return done


def _worker_lost(
    pk: int,
    started_at: datetime | None,
    token: int,
    now: datetime,
    using: str,
    settings: DriftSafeSettings,
) -> bool:
    from celery_driftsafe.locks import lock_backend

    # Above the run's token even when the lock's counter expired or was lost.
    lock = lock_backend(settings, using=using).lock(
        f"run:{pk}", ttl=settings.lease_seconds, fencing_floor=token
    )
    try:
        if not lock.acquire(blocking=False):
            return False  # a worker still renews it: the body is running
    except LockError:
        return False  # cannot tell: leave it for a later pass
    try:
        taken = lock.fencing_token
        return bool(
            Run.objects.using(using)
            .filter(pk=pk, status=RunStatus.STARTED, fencing_token__lt=taken)
            .update(
                status=RunStatus.FAILED,
                finished_at=now,
                fencing_token=taken,
                error=f"worker lost: started at {started_at}, no outcome recorded and nobody "
                "holds the run's lock (the worker died or was killed)",
            )
        )
    finally:
        lock.release()


def _from_result_backend(
    app: Any, runs: Any, bound: datetime, now: datetime, limit: int, done: Reconciled
) -> None:
    for pk, task_id in (
        runs.filter(status=RunStatus.DISPATCHED, claimed_at__lt=bound)
        .exclude(celery_task_id="")
        .values_list("pk", "celery_task_id")[:limit]
    ):
        try:
            state = app.AsyncResult(task_id).state
        except Exception:  # no result backend, or it is away: nothing to learn here
            return
        status = _BACKEND_STATES.get(state)
        if status is not None and runs.filter(pk=pk, status=RunStatus.DISPATCHED).update(
            status=status, finished_at=now, error=f"outcome taken from the result backend: {state}"
        ):
            done.from_results.append(pk)


def recover(
    now: datetime,
    node_id: str,
    settings: DriftSafeSettings,
    dispatcher: Dispatcher,
    *,
    using: str = "default",
) -> None:
    """A beat's recovery pass: mark silent nodes dead and re-publish stale claims (the outbox)
    through ``dispatcher``. Reconciling runs is :class:`BackgroundReconciler`'s."""
    from celery_driftsafe import nodes
    from celery_driftsafe.dispatch import reclaim_stale

    dead_after = timedelta(seconds=settings.node_dead_after_seconds)
    nodes.mark_dead(now, dead_after, node_id, using=using)
    lease = timedelta(seconds=settings.lease_seconds)
    stale = reclaim_stale(now, node_id, lease=lease, using=using, dead_after=dead_after)
    dispatcher.dispatch(stale)


#: Runs that will never hear from a worker are looked for at most this often: they are an hour
#: (STUCK_RUN_SECONDS) or a day (RUN_EXPIRES_SECONDS) old, and the look-up reads every run
#: still waiting for its outcome (~200 ms in a steady 100,000-task stream).
RECONCILE_INTERVAL_SECONDS = 60.0


class BackgroundReconciler:
    """A beat's reconciliation: at most every :data:`RECONCILE_INTERVAL_SECONDS`, one
    :func:`reconcile` pass in a thread of its own (its own database connection), so that the
    look-up never holds up a round; the first with the beat's first round. Beats reconciling at
    once never fight (every change is conditional on the status it read)."""

    def __init__(self, *, app: Any, using: str = "default", monotonic: Any) -> None:
        self.app = app
        self.using = using
        self.monotonic = monotonic
        self.next_at = 0.0
        self.last: Reconciled | None = None
        self._thread: threading.Thread | None = None

    def maybe_start(self, now: datetime) -> bool:
        """Start a pass at the authority's ``now`` when one is due and none is in flight;
        whether one started."""
        if self._thread is not None and self._thread.is_alive():
            return False
        mono = self.monotonic()
        if mono < self.next_at:
            return False
        self.next_at = mono + RECONCILE_INTERVAL_SECONDS
        self._thread = threading.Thread(
            target=self._pass, args=(now,), name="driftsafe-reconcile", daemon=True
        )
        self._thread.start()
        return True

    def _pass(self, now: datetime) -> None:
        from django.db import connections

        settings = get_settings()
        try:
            self.last = reconcile(
                now,
                lease=timedelta(seconds=settings.lease_seconds),
                app=self.app,
                using=self.using,
                settings=settings,
            )
        except Exception as exc:  # an outage, say: the next pass tries again
            logger.warning(
                "reconciling runs failed; trying again in %g s: %s",
                RECONCILE_INTERVAL_SECONDS,
                exc,
                extra={"action": "reconcile"},
            )
        finally:
            connections.close_all()  # this thread's connections only

    def join(self, timeout: float | None = None) -> None:
        """Wait for a pass in flight (tests, and a stopping beat)."""
        if self._thread is not None:
            self._thread.join(timeout)
