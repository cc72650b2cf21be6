"""Started runs whose worker is gone: :func:`lost_runs`, the part of a reconcile pass
(:mod:`celery_driftsafe.beat.recovery`) that records them ``failed``, and that records a run
replaced under overlap policy ``replace`` ``revoked`` (:func:`replaced_runs_gone`, also a part
of each recovery pass: its replacement runs meanwhile).

A run is judged in the store its starting worker locked in (its ``lock_store``), as far as the
beat reaches it (:func:`celery_driftsafe.locks.lock_backend_for`): a beat that looked only in
its own store would take a lock held elsewhere for a free one, and one that skipped other
stores would leave their lost runs started for ever (a fleet that moved from database locks
to Redis, say). Runs in a store out of its reach are left for a beat that reaches it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db.models import Q

from celery_driftsafe.conf import DriftSafeSettings
from celery_driftsafe.exceptions import LockError
from celery_driftsafe.locks import LockBackend, lock_backend_for
from celery_driftsafe.models import Run, RunStatus


@dataclass(frozen=True)
class Until:
    """When a pass stops taking batches: its time is up, or its beat is stopping."""

    deadline: float
    stop: threading.Event | None = None

    def reached(self) -> bool:
        return time.monotonic() >= self.deadline or (self.stop is not None and self.stop.is_set())


def next_page(
    runs: Any, order: str, after: tuple[datetime, int] | None, batch: int, *more: str
) -> list[tuple[Any, ...]]:
    """The next ``batch`` of ``runs`` in ``(order, id)`` order after ``after``: rows of
    ``(id, order's value, *more)``. The bound ``order >= after`` lets the database start its
    index scan there (the exact condition alone is an OR it cannot use)."""
    if after is not None:
        runs = runs.filter(
            Q(**{f"{order}__gte": after[0]}),
            Q(**{f"{order}__gt": after[0]}) | Q(**{order: after[0], "pk__gt": after[1]}),
        )
    return list(runs.order_by(order, "pk").values_list("pk", order, *more)[:batch])


def lease_over(now: datetime) -> Q:
    """Runs whose worker's lease in the ledger is over at ``now``, or that record none."""
    return Q(lease_until__isnull=True) | Q(lease_until__lte=now)


@dataclass
class Lost:
    """What :func:`lost_runs` recorded: run ids."""

    #: ``failed``: the worker was lost.
    failed: list[int] = field(default_factory=list)
    #: ``revoked``: replaced (overlap policy ``replace``), its delivery gone.
    replaced: list[int] = field(default_factory=list)
    #: Left as they are: their lock is in a store out of this beat's reach.
    unreachable: list[int] = field(default_factory=list)


def lost_runs(
    runs: Any,
    bound: datetime,
    now: datetime,
    batch: int,
    until: Until,
    using: str,
    settings: DriftSafeSettings,
) -> Lost:
    """Record ``failed`` the runs started before ``bound`` whose lock nobody holds and whose
    lease in the ledger is over (a lock Redis lost is not a dead worker), a batch at a time
    until none is left or ``until``. A run another run replaced (overlap policy ``replace``:
    it ends ``revoked`` whatever its body does, its reason naming its replacement, and never
    starts again) is recorded ``revoked`` once its lease is over and its lock free, whenever
    it started: its delivery is gone (its worker died, or a message it re-sent itself was
    discarded by the revoke of its id)."""
    lost = Lost()
    backends: dict[str | None, LockBackend | None] = {}
    after: tuple[datetime, int] | None = None
    while True:
        started = runs.filter(
            Q(started_at__lt=bound) | Q(replaced_by__isnull=False),
            lease_over(now),
            status=RunStatus.STARTED,
        )
        rows = next_page(
            started, "started_at", after, batch, "fencing_token", "lock_store", "replaced_by"
        )
        for pk, started_at, token, store, replaced_by in rows:
            if store not in backends:
                backends[store] = lock_backend_for(store, settings, using=using)
            locks = backends[store]
            if locks is None:
                lost.unreachable.append(pk)
            elif _worker_lost(
                locks, (pk, started_at, token, store, replaced_by), now, using, settings
            ):
                (lost.failed if replaced_by is None else lost.replaced).append(pk)
        if len(rows) < batch or until.reached():
            return lost
        after = (rows[-1][1], rows[-1][0])


def replaced_runs_gone(
    now: datetime, batch: int, until: Until, using: str, settings: DriftSafeSettings
) -> Lost:
    """:func:`lost_runs` for the replaced runs alone (a recovery pass's: a replaced run is
    recorded as soon as its lease is over, not a reconcile interval later)."""
    replaced = Run.objects.using(using).filter(replaced_by__isnull=False)
    return lost_runs(replaced, now, now, batch, until, using, settings)


def _worker_lost(
    locks: LockBackend,
    run: tuple[int, datetime | None, int, str | None, int | None],
    now: datetime,
    using: str,
    settings: DriftSafeSettings,
) -> bool:
    """Record ``run`` (id, start, token, lock store, the run that replaced it) ended if nobody
    holds its lock in ``locks`` (its store's backend): ``failed``, or ``revoked`` if another
    run replaced it (its reason, naming its replacement, kept); the update is conditional on
    the run as read, its replacement included (one replaced since is left for the next
    pass, not recorded failed)."""
    pk, started_at, token, store, replaced_by = run
    # Above the run's token even when the lock's counter expired or was lost.
    lock = locks.lock(f"run:{pk}", ttl=settings.lease_seconds, fencing_floor=token)
    try:
        if not lock.acquire(blocking=False):
            return False  # a worker still renews it: the body is running
    except LockError:
        return False  # cannot tell: leave it for a later pass
    try:
        taken = lock.fencing_token
        ended: dict[str, Any] = (
            {"status": RunStatus.REVOKED}  # its error names its replacement already
            if replaced_by is not None
            else {
                "status": RunStatus.FAILED,
                "error": f"worker lost: started at {started_at}, no outcome recorded and "
                "nobody holds the run's lock (the worker died or was killed)",
            }
        )
        return bool(
            Run.objects.using(using)
            .filter(
                lease_over(now),
                pk=pk,
                status=RunStatus.STARTED,
                fencing_token__lt=taken,
                lock_store=store,
                replaced_by=replaced_by,
            )
            .update(finished_at=now, fencing_token=taken, **ended)
        )
    finally:
        lock.release()
