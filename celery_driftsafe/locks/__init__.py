"""Locks: mutual exclusion with a lease, a holder token and a fencing token.

Two backends keep one contract (:class:`DistributedLock`); :func:`lock_backend` picks one from
the settings::

    locks = lock_backend()  # Redis if REDIS_URL is set, else the database
    lock = locks.lock("run:42", ttl=30)
    with lock.hold(watchdog=True, on_lost=alert) as held:
        do_work(fencing_token=held.fencing_token)  # storage refuses older tokens
        held.check()  # raises LockLost if the lease is gone

* :class:`RedisLockBackend`: ``SET <prefix>:lock:<name> token NX PX ttl`` and ``INCR
  <prefix>:fence:<name>`` in one Lua script; release and extend are compare-token scripts. The
  lease is timed by Redis. The fencing counter expires ``fence_ttl`` seconds after its last
  acquisition (:func:`fence_ttl_seconds`; None: never); like a
  counter lost with Redis data (a flush, a failover to a replica that missed the last
  writes), an expired one starts again above the ``fencing_floor`` its next taker passes
  (see ``docs/reference/locks.md``).
* :class:`DatabaseLockBackend`: one row per name in :class:`celery_driftsafe.models.Lock`,
  taken over by a conditional ``UPDATE`` (free, or ``expires_at <= now``) that also increments
  the fencing token. Time comes from the backend's clock (by default the database server's,
  see :class:`~celery_driftsafe.store.clock.AuthorityClock`), never from this machine's wall clock.

A lease is a promise about time, so a holder paused for longer than its lease (GC, swap, a
stopped VM) can wake up still believing it holds the lock. Locks give liveness and cheap
exclusion; safety comes from the database refusing writes that carry an older fencing token.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace

from celery_driftsafe.conf import DriftSafeSettings, get_settings
from celery_driftsafe.locks.contract import DEFAULT_TTL, DistributedLock, HeldLock, LockBackend
from celery_driftsafe.locks.database import DatabaseLock, DatabaseLockBackend
from celery_driftsafe.locks.lease import (
    POLL_MAX_SECONDS,
    POLL_MIN_SECONDS,
    WATCHDOG_START_FRACTION,
)
from celery_driftsafe.locks.redis import RedisLock, RedisLockBackend
from celery_driftsafe.store.clock import Clock

__all__ = [
    "DEFAULT_TTL",
    "FENCE_TTL_WHEN_KEPT_FOREVER",
    "MAX_LOCK_IDENTITY",
    "POLL_MAX_SECONDS",
    "POLL_MIN_SECONDS",
    "WATCHDOG_START_FRACTION",
    "DatabaseLock",
    "DatabaseLockBackend",
    "DistributedLock",
    "HeldLock",
    "LockBackend",
    "RedisLock",
    "RedisLockBackend",
    "fence_ttl_seconds",
    "lock_backend",
    "lock_backend_for",
    "lock_identity",
    "running_lock",
    "running_lock_heir",
    "running_lock_holder",
]


#: The longest :func:`lock_identity`: a longer ``KEY_PREFIX`` is named by its digest.
MAX_LOCK_IDENTITY = 200


def lock_identity(settings: DriftSafeSettings | None = None) -> str:
    """Where the settings take run locks, as the ``driftsafe_locks`` header says it:
    ``"database"``, or ``"redis:<KEY_PREFIX>"``. Processes that lock runs must agree, or one
    does not see another's locks (docs/reference/task.md). The Redis URL is left out: two
    spellings of one server would differ. A prefix too long for the run's ``lock_store``
    column is named by its SHA-256 digest."""
    settings = settings or get_settings()
    if not settings.redis_url:
        return "database"
    identity = f"redis:{settings.key_prefix}"
    if len(identity) > MAX_LOCK_IDENTITY:  # the run's ``lock_store`` column holds it
        identity = "redis-sha256:" + hashlib.sha256(settings.key_prefix.encode()).hexdigest()
    return identity


def lock_backend_for(
    store: str | None, settings: DriftSafeSettings | None = None, *, using: str = "default"
) -> LockBackend | None:
    """The backend holding the locks taken in ``store`` (a run's ``lock_store``), as far as
    this process reaches it: its own for None or its own store; the database's for
    ``database``, which every process shares; for ``redis:<prefix>``, that prefix on this
    process's Redis (a fleet that moved its ``KEY_PREFIX``). None for a store out of its
    reach: Redis without ``REDIS_URL`` here, a prefix known only by its digest."""
    settings = settings or get_settings()
    if store is None or store == lock_identity(settings):
        return lock_backend(settings, using=using)
    if store == "database":
        return DatabaseLockBackend(using=using)
    if store.startswith("redis:") and settings.redis_url:
        return lock_backend(replace(settings, key_prefix=store.removeprefix("redis:")))
    return None


#: A fencing counter's time to live when runs are kept forever.
FENCE_TTL_WHEN_KEPT_FOREVER = 7 * 86400.0


def fence_ttl_seconds(settings: DriftSafeSettings) -> float:
    """How long a Redis fencing counter lives after its last acquisition.

    The shorter retention period (runs are pruned, and their counters deleted, after it), or
    :data:`FENCE_TTL_WHEN_KEPT_FOREVER` when runs are kept forever; never shorter than a run
    can wait for a worker (``RUN_EXPIRES_SECONDS``) or be reconciled (``STUCK_RUN_SECONDS``)
    plus a lease. Any value is safe (see ``docs/reference/locks.md``); this one only spares
    refused writes and their retries while a run is still being worked on.
    """
    kept = [
        s
        for s in (settings.run_retention_seconds, settings.failed_run_retention_seconds)
        if s is not None
    ]
    ttl = min(kept) if kept else FENCE_TTL_WHEN_KEPT_FOREVER
    waiting = max(settings.run_expires_seconds or 0.0, settings.stuck_run_seconds)
    return max(ttl, waiting + settings.lease_seconds)


def lock_backend(
    settings: DriftSafeSettings | None = None,
    *,
    clock: Clock | None = None,
    using: str = "default",
) -> LockBackend:
    """The lock backend the settings call for: Redis when ``REDIS_URL`` is set, else the
    database (``using``). ``clock`` overrides each backend's default clock."""
    settings = settings or get_settings()
    if settings.redis_url:
        from celery_driftsafe.store.redis import get_redis, key_prefix

        return RedisLockBackend(
            get_redis(settings),
            key_prefix(settings),
            clock=clock,
            fence_ttl=fence_ttl_seconds(settings),
        )
    return DatabaseLockBackend(clock=clock, using=using)


def running_lock(
    locks: LockBackend,
    periodic_task_id: int,
    settings: DriftSafeSettings,
    *,
    run_id: int | None = None,
) -> DistributedLock:
    """A periodic task's running lock (overlap policies ``skip``, ``buffer_one``, ``buffer_all`` and
    ``replace``): held by the delivery whose body runs, renewed with the run's lease. Taken for run
    ``run_id``, its token names that run (:func:`running_lock_holder`), so that the process that saw
    the run's body killed can take it over (:meth:`DistributedLock.take_from`)."""
    holder = running_lock_holder(run_id) if run_id is not None else ""
    return locks.lock(f"task-running:{periodic_task_id}", ttl=settings.lease_seconds, holder=holder)


def running_lock_holder(run_id: int) -> str:
    """The holder a task's running lock names while run ``run_id``'s delivery holds it."""
    return f"run:{run_id}"


def running_lock_heir(run_id: int) -> str:
    """The name a task's running lock is handed to (:meth:`DistributedLock.hand_over`) for
    run ``run_id`` (overlap policies ``buffer_one``, ``buffer_all``: the waiting run goes
    next)."""
    return f"heir:run:{run_id}"
