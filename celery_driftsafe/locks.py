"""Locks: mutual exclusion with a lease, a holder token and a fencing token.

Two backends keep one contract (:class:`DistributedLock`); :func:`lock_backend` picks one from
the settings::

    locks = lock_backend()                  # Redis if REDIS_URL is set, else the database
    lock = locks.lock("run:42", ttl=30)
    with lock.hold(watchdog=True, on_lost=alert) as held:
        do_work(fencing_token=held.fencing_token)   # storage refuses older tokens
        held.check()                                # raises LockLost if the lease is gone

* :class:`RedisLockBackend`: ``SET <prefix>:lock:<name> token NX PX ttl`` and ``INCR
  <prefix>:fence:<name>`` in one Lua script; release and extend are compare-token scripts. The
  lease is timed by Redis. The fencing counter expires ``fence_ttl`` seconds after its last
  acquisition (:func:`celery_driftsafe.retention.fence_ttl_seconds`; None: never); like a
  counter lost with Redis data (a flush, a failover to a replica that missed the last
  writes), an expired one starts again above the ``fencing_floor`` its next taker passes
  (see ``docs/reference/locks.md``).
* :class:`DatabaseLockBackend`: one row per name in :class:`celery_driftsafe.models.Lock`,
  taken over by a conditional ``UPDATE`` (free, or ``expires_at <= now``) that also increments
  the fencing token. Time comes from the backend's clock (by default the database server's,
  see :class:`~celery_driftsafe.clock.AuthorityClock`), never from this machine's wall clock.

A lease is a promise about time, so a holder paused for longer than its lease (GC, swap, a
stopped VM) can wake up still believing it holds the lock. Locks give liveness and cheap
exclusion; safety comes from the database refusing writes that carry an older fencing token.
"""

from __future__ import annotations

import logging
import math
import os
import random
import secrets
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Protocol

from celery_driftsafe.clock import AuthorityClock, Clock, DatabaseAuthority, SystemClock
from celery_driftsafe.conf import DriftSafeSettings, get_settings
from celery_driftsafe.exceptions import LockError, LockLost

logger = logging.getLogger(__name__)

#: Lease length in seconds when none is given.
DEFAULT_TTL = 30.0
#: Blocking acquisition polls with a jittered back-off between these two pauses (seconds).
POLL_MIN_SECONDS = 0.005
POLL_MAX_SECONDS = 0.05
#: A watchdog's threads start only once a lock has been held this fraction of its ttl: most
#: holds (a short task body) end before, and cost no thread at all. Renewals keep their times.
WATCHDOG_START_FRACTION = 1 / 6


class DistributedLock(Protocol):
    """One named lock as seen by one holder. Every backend keeps this contract:

    * ``acquire()`` is atomic: in one step (one Lua script, one transaction) it takes the lock
      if it is free or its lease has run out, stores a fresh random ``token``, starts a lease
      of ``ttl`` seconds and increments the name's fencing counter. A lost race returns False
      and changes nothing. ``blocking=False`` tries once; otherwise it retries with a short
      jittered sleep until ``timeout`` seconds (None: forever) and then returns False.
    * ``release()`` and ``extend()`` compare the token atomically: they act only while the
      stored token is this holder's and the lease has not run out, and return whether they
      did. With a stranger's token, after expiry or after a take-over they return False, log,
      and leave the current holder's lease alone. ``extend(ttl)`` restarts the lease so it
      ends ``ttl`` seconds from now (it does not add to what is left).
    * ``fencing_token`` is the counter's value after this acquisition: across all holders of
      one name, tokens strictly increase in acquisition order, through contention, expiry and
      release. A store that refuses writes carrying a token below the highest it has seen
      therefore refuses a former holder that was paused past its lease. A lock made with
      ``fencing_floor=n`` hands out a token above ``n`` (the counter jumps if it is behind):
      pass the highest token the store has seen, and tokens stay one sequence across backends
      and across a counter that was lost.
    * A backend that cannot be reached raises :class:`LockError`; that call's outcome is
      unknown (the lease still ends by itself).
    * ``lease_remaining()`` is the local, pessimistic view: measured from before the request
      that set the lease, on the local monotonic clock.
    * Not reentrant, and one object belongs to one thread (plus its own watchdog).
    """

    name: str
    ttl: float
    token: str | None
    fencing_token: int | None

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool: ...

    def release(self) -> bool: ...

    def extend(self, ttl: float | None = None) -> bool: ...

    def lease_remaining(self) -> float: ...

    def hold(
        self,
        *,
        blocking: bool = True,
        timeout: float | None = None,
        watchdog: bool = False,
        on_lost: Callable[[HeldLock], None] | None = None,
    ) -> AbstractContextManager[HeldLock]: ...

    def watch(
        self, *, watchdog: bool = True, on_lost: Callable[[HeldLock], None] | None = None
    ) -> AbstractContextManager[HeldLock]: ...


class LockBackend(Protocol):
    """Makes lock objects; cheap, so make one lock object per use and per thread."""

    def lock(
        self, name: str, ttl: float = DEFAULT_TTL, *, fencing_floor: int = 0
    ) -> DistributedLock: ...


@dataclass
class HeldLock:
    """What :meth:`DistributedLock.hold` yields while the lock is held.

    ``lost`` is set (and ``lost_reason`` says why) when the watchdog failed to renew the
    lease, or when the lock was found no longer held at release.
    """

    lock: DistributedLock
    token: str
    fencing_token: int
    lost: threading.Event = field(default_factory=threading.Event)
    lost_reason: str | None = None

    def check(self) -> None:
        """Raise :class:`LockLost` if the lock is known lost or its lease has run out."""
        if self.lost.is_set():
            raise LockLost(f"lock {self.lock.name!r} lost: {self.lost_reason}")
        if self.lock.lease_remaining() <= 0:
            raise LockLost(f"lock {self.lock.name!r}: its lease ran out")

    def _mark_lost(self, reason: str) -> None:
        if self.lost_reason is None:
            self.lost_reason = reason
        self.lost.set()


def _check_ttl(ttl: float) -> None:
    if not ttl >= 0.001:
        raise ValueError(f"a lock ttl must be at least 0.001 seconds, not {ttl!r}")


def _log_extra(action: str, lock: _LeaseLock) -> dict[str, Any]:
    return {"action": action, "lock": lock.name, "fencing_token": lock.fencing_token}


class _LeaseLock:
    """What both backends share: polling, bookkeeping, logging, ``hold()`` and the watchdog."""

    def __init__(self, name: str, ttl: float, clock: Clock, fencing_floor: int = 0) -> None:
        if not name:
            raise ValueError("a lock needs a non-empty name")
        _check_ttl(ttl)
        if fencing_floor < 0:
            raise ValueError(f"fencing_floor must be >= 0, not {fencing_floor!r}")
        self.fencing_floor = int(fencing_floor)
        self.name = name
        self.ttl = float(ttl)
        self.clock = clock
        self.token: str | None = None
        self.fencing_token: int | None = None
        self._lease_ends = 0.0  # local monotonic time by which the lease has surely ended

    def __repr__(self) -> str:
        state = f"fencing_token={self.fencing_token}" if self.token else "not held"
        return f"<{type(self).__name__} {self.name!r} ttl={self.ttl} {state}>"

    # -- the backend's three atomic steps -------------------------------------------------------
    def _acquire_token(self, token: str, ttl: float) -> int | None:
        """Take the lock for ``token``: the new fencing token, or None when it is held."""
        raise NotImplementedError

    def _extend_token(self, token: str, ttl: float) -> bool:
        """Restart the lease of ``token`` (if it is still the holder's) for ``ttl`` seconds."""
        raise NotImplementedError

    def _release_token(self, token: str) -> bool:
        """Free the lock if ``token`` still holds it."""
        raise NotImplementedError

    def _thread_done(self) -> None:
        """Called by the watchdog thread as it ends: free per-thread resources."""

    # -- the contract ---------------------------------------------------------------------------
    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        if timeout is not None and timeout < 0:
            raise ValueError(f"timeout must be >= 0 or None, not {timeout!r}")
        give_up = None if timeout is None else self.clock.monotonic() + timeout
        pause = POLL_MIN_SECONDS
        while True:
            if self._try_acquire():
                return True
            if not blocking:
                return False
            now = self.clock.monotonic()
            if give_up is not None and now >= give_up:
                return False
            delay = pause * (0.5 + random.random() / 2)
            self.clock.sleep(delay if give_up is None else min(delay, give_up - now))
            pause = min(pause * 2, POLL_MAX_SECONDS)

    def _try_acquire(self) -> bool:
        token = secrets.token_hex(16)
        sent = self.clock.monotonic()
        fencing_token = self._acquire_token(token, self.ttl)
        if fencing_token is None:
            return False
        self.token, self.fencing_token = token, fencing_token
        self._lease_ends = sent + self.ttl
        logger.debug(
            "acquired lock %s, fencing token %s",
            self.name,
            fencing_token,
            extra=_log_extra("lock_acquired", self),
        )
        return True

    def extend(self, ttl: float | None = None) -> bool:
        ttl = self.ttl if ttl is None else ttl
        _check_ttl(ttl)
        if self.token is None:
            logger.warning(
                "extend of lock %s, which this object does not hold",
                self.name,
                extra=_log_extra("lock_extend_not_held", self),
            )
            return False
        sent = self.clock.monotonic()
        extended = self._extend_token(self.token, ttl)
        if extended:
            self._lease_ends = sent + ttl
        else:
            logger.warning(
                "could not extend lock %s (fencing token %s): lease expired or taken over",
                self.name,
                self.fencing_token,
                extra=_log_extra("lock_extend_lost", self),
            )
        return extended

    def release(self) -> bool:
        if self.token is None:
            logger.warning(
                "release of lock %s, which this object does not hold",
                self.name,
                extra=_log_extra("lock_release_not_held", self),
            )
            return False
        released = self._release_token(self.token)  # on LockError, keep the token: retryable
        if not released:
            logger.warning(
                "lock %s (fencing token %s) was no longer held at release: lease expired or "
                "taken over; the current holder's lease was left alone",
                self.name,
                self.fencing_token,
                extra=_log_extra("lock_release_lost", self),
            )
        self.token = self.fencing_token = None
        self._lease_ends = 0.0
        return released

    def lease_remaining(self) -> float:
        if self.token is None:
            return 0.0
        return max(0.0, self._lease_ends - self.clock.monotonic())

    @contextmanager
    def hold(
        self,
        *,
        blocking: bool = True,
        timeout: float | None = None,
        watchdog: bool = False,
        on_lost: Callable[[HeldLock], None] | None = None,
    ) -> Iterator[HeldLock]:
        """Acquire (or raise :class:`LockError`), yield a :class:`HeldLock`, release on exit.

        With ``watchdog=True`` a thread extends the lease every ``ttl/3``. When an extension
        is refused, or the lease runs out before one succeeds (backend unreachable, or a call
        stuck past the lease), the watchdog sets ``held.lost``, calls ``on_lost(held)`` in its
        own thread, and stops. On exit it is stopped (waiting for a renewal in flight) before
        the release. A failed release is logged and sets ``held.lost``; it is not raised.
        """
        if not self.acquire(blocking=blocking, timeout=timeout):
            waited = "" if not blocking else f" after waiting {timeout} s"
            raise LockError(f"lock {self.name!r} is held by someone else{waited}")
        with self.watch(watchdog=watchdog, on_lost=on_lost) as held:
            yield held

    @contextmanager
    def watch(
        self, *, watchdog: bool = True, on_lost: Callable[[HeldLock], None] | None = None
    ) -> Iterator[HeldLock]:
        """For a lock this object already acquired: yield a :class:`HeldLock`, renewing the
        lease meanwhile when ``watchdog`` is true, and release it on exit (as :meth:`hold`)."""
        if self.token is None or self.fencing_token is None:
            raise LockError(f"lock {self.name!r} is not held by this object")
        held = HeldLock(self, self.token, self.fencing_token)
        dog = _Watchdog(self, held, on_lost) if watchdog else None
        try:
            if dog is not None:
                _starter.schedule(dog, self.ttl * WATCHDOG_START_FRACTION)
            yield held
        finally:
            if dog is not None and not _starter.cancel(dog):
                dog.stop()
            try:
                released = self.release()
            except LockError as exc:
                logger.warning(
                    "could not release lock %s: %s; its lease will run out",
                    self.name,
                    exc,
                    extra=_log_extra("lock_release_failed", self),
                )
                released = False
            if not released:
                held._mark_lost("no longer held at release")


class _DeferredStarter:
    """One thread per process that starts each held lock's :class:`_Watchdog` once the lock
    has been held for ``WATCHDOG_START_FRACTION`` of its ttl (see there)."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._pending: dict[int, tuple[float, _Watchdog]] = {}
        self._pid = -1

    def schedule(self, dog: _Watchdog, delay: float) -> None:
        import time

        with self._condition:
            if self._pid != os.getpid():  # first use, or a forked child: no thread yet
                self._pid = os.getpid()
                self._pending.clear()
                threading.Thread(target=self._loop, name="driftsafe-lock-watchdog-starter",
                                 daemon=True).start()
            self._pending[id(dog)] = (time.monotonic() + delay, dog)
            self._condition.notify()

    def cancel(self, dog: _Watchdog) -> bool:
        """True when the watchdog was never started (nothing to stop)."""
        with self._condition:
            return self._pending.pop(id(dog), None) is not None

    def _loop(self) -> None:
        import time

        with self._condition:
            while True:
                now = time.monotonic()
                for key, (at, dog) in list(self._pending.items()):
                    if at <= now:
                        del self._pending[key]
                        dog.start()
                wake = min((at for at, _ in self._pending.values()), default=None)
                self._condition.wait(None if wake is None else max(wake - now, 0.001))


_starter = _DeferredStarter()


class _Watchdog:
    """Two daemon threads for one held lease: a renewer that extends it every ``ttl/3`` (from
    when the watchdog was made), and a timekeeper that declares it lost when the local lease
    runs out, even while a renewal call is stuck on an unreachable backend (socket timeouts
    and retries can outlast a lease)."""

    def __init__(
        self, lock: _LeaseLock, held: HeldLock, on_lost: Callable[[HeldLock], None] | None
    ) -> None:
        self.lock, self.held, self.on_lost = lock, held, on_lost
        self.made_at = lock.clock.monotonic()
        self._stopping = threading.Event()
        self._lose_once = threading.Lock()
        self._threads = [
            threading.Thread(target=target, name=f"driftsafe-lock-{role}[{lock.name}]", daemon=True)
            for role, target in (("renewer", self._renew), ("timekeeper", self._keep_time))
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stopping.set()
        for thread in self._threads:
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join()

    def _renew(self) -> None:
        try:
            reason = self._renew_until_stopped()
            if reason is not None:
                self._lose(reason)
        finally:
            self.lock._thread_done()

    def _keep_time(self) -> None:
        # Renewals only ever move the end of the lease later, so re-checking after each wait
        # is enough; no notification needed.
        while not self._stopping.wait(max(self.lock.lease_remaining(), POLL_MIN_SECONDS)):
            if self.lock.lease_remaining() <= 0:
                self._lose("the lease ran out before it could be renewed")
                return

    def _renew_until_stopped(self) -> str | None:
        """None when stopped; otherwise why the lock was lost."""
        interval = self.lock.ttl / 3
        wait = max(0.0, interval - (self.lock.clock.monotonic() - self.made_at))
        while not self._stopping.wait(wait):
            if self.lock.lease_remaining() <= 0:
                return "the lease ran out before it could be renewed"
            try:
                if not self.lock.extend():
                    return "renewal refused: the lease expired or another holder took it"
            except LockError as exc:
                remaining = self.lock.lease_remaining()
                if remaining <= 0:
                    return f"backend unreachable until the lease ran out: {exc}"
                logger.warning(
                    "could not renew lock %s (%s); retrying, %.3f s of lease left",
                    self.lock.name,
                    exc,
                    remaining,
                    extra=_log_extra("lock_renew_failed", self.lock),
                )
                wait = min(interval, max(remaining, POLL_MIN_SECONDS))
                continue
            wait = interval
        return None

    def _lose(self, reason: str) -> None:
        with self._lose_once:
            if self._stopping.is_set():  # stopped, or the other thread already lost it
                return
            self._stopping.set()
        logger.error(
            "lost lock %s (fencing token %s): %s",
            self.lock.name,
            self.held.fencing_token,
            reason,
            extra=_log_extra("lock_lost", self.lock),
        )
        self.held._mark_lost(reason)
        if self.on_lost is not None:
            try:
                self.on_lost(self.held)
            except Exception:
                logger.exception(
                    "on_lost callback of lock %s failed",
                    self.lock.name,
                    extra=_log_extra("lock_lost_callback_failed", self.lock),
                )


# -- Redis --------------------------------------------------------------------------------------

# KEYS[1] the lock, KEYS[2] its fencing counter; ARGV[1] the token, ARGV[2] the lease in ms,
# ARGV[3] the fencing floor (the token handed out is above it), ARGV[4] the counter's time to
# live in ms (0: none).
_ACQUIRE_SCRIPT = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
    local token = redis.call('INCR', KEYS[2])
    local floor = tonumber(ARGV[3])
    if token <= floor then
        token = floor + 1
        redis.call('SET', KEYS[2], token)
    end
    if tonumber(ARGV[4]) > 0 then
        redis.call('PEXPIRE', KEYS[2], ARGV[4])
    end
    return token
end
return 0
"""
_EXTEND_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
_RELEASE_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('DEL', KEYS[1])
end
return 0
"""


class RedisLockBackend:
    """Locks in Redis under ``<key_prefix>:lock:<name>``, fencing counters under
    ``<key_prefix>:fence:<name>``. ``clock`` only measures waits (Redis times the lease).

    One server or a Sentinel-managed master; not Redis Cluster (the two keys of a lock would
    need to share a hash slot). The client's socket timeouts and retries bound how long one
    call can hang; the watchdog declares a lease lost on time regardless.
    """

    def __init__(
        self, client: Any, key_prefix: str = "driftsafe", *, clock: Clock | None = None,
        fence_ttl: float | None = None,
    ) -> None:
        self.client = client
        self.key_prefix = key_prefix
        #: Seconds a fencing counter lives after its last acquisition (None: forever).
        self.fence_ttl = fence_ttl
        self.clock: Clock = clock if clock is not None else SystemClock()
        self.acquire_script = client.register_script(_ACQUIRE_SCRIPT)
        self.extend_script = client.register_script(_EXTEND_SCRIPT)
        self.release_script = client.register_script(_RELEASE_SCRIPT)

    def lock(self, name: str, ttl: float = DEFAULT_TTL, *, fencing_floor: int = 0) -> RedisLock:
        return RedisLock(self, name, ttl, fencing_floor=fencing_floor)

    def lock_key(self, name: str) -> str:
        return f"{self.key_prefix}:lock:{name}"

    def fence_key(self, name: str) -> str:
        return f"{self.key_prefix}:fence:{name}"


def _ms(ttl: float) -> int:
    # Round up: Redis' lease never ends before the local view of it.
    return math.ceil(ttl * 1000)


class RedisLock(_LeaseLock):
    """A :class:`DistributedLock` in Redis; see :class:`RedisLockBackend`."""

    def __init__(
        self, backend: RedisLockBackend, name: str, ttl: float = DEFAULT_TTL,
        *, fencing_floor: int = 0,
    ) -> None:
        super().__init__(name, ttl, backend.clock, fencing_floor)
        self.backend = backend
        self.key = backend.lock_key(name)

    def _call(self, script: Any, keys: Sequence[str], args: Sequence[str | int]) -> int:
        from redis.exceptions import RedisError

        try:
            return int(script(keys=list(keys), args=list(args)))
        except RedisError as exc:
            raise LockError(f"lock {self.name!r}: Redis error: {exc}") from exc

    def _acquire_token(self, token: str, ttl: float) -> int | None:
        keys = (self.key, self.backend.fence_key(self.name))
        fence_ttl = self.backend.fence_ttl
        fencing_token = self._call(
            self.backend.acquire_script, keys,
            (token, _ms(ttl), self.fencing_floor, _ms(fence_ttl) if fence_ttl else 0),
        )
        return fencing_token or None

    def _extend_token(self, token: str, ttl: float) -> bool:
        return self._call(self.backend.extend_script, (self.key,), (token, _ms(ttl))) == 1

    def _release_token(self, token: str) -> bool:
        return self._call(self.backend.release_script, (self.key,), (token,)) == 1


# -- Database -----------------------------------------------------------------------------------


class DatabaseLockBackend:
    """Locks as rows of :class:`celery_driftsafe.models.Lock` on database ``using``.

    ``clock.now()`` decides expiry, so every process must use the same authority; the default
    is the database server's clock. A lease is over *at* ``expires_at``: a lock whose
    ``expires_at`` equals ``now`` can be taken over, and its holder can no longer extend or
    release it. Lock calls commit on their own, so they refuse to run inside a transaction on
    ``using`` (take the lock first, then open the transaction). On SQLite, writers take turns:
    a long write transaction elsewhere delays acquisitions and renewals.
    """

    def __init__(self, *, clock: Clock | None = None, using: str = "default") -> None:
        self.using = using
        self.clock: Clock = clock if clock is not None else AuthorityClock(DatabaseAuthority(using))

    def lock(
        self, name: str, ttl: float = DEFAULT_TTL, *, fencing_floor: int = 0
    ) -> DatabaseLock:
        return DatabaseLock(self, name, ttl, fencing_floor=fencing_floor)


class DatabaseLock(_LeaseLock):
    """A :class:`DistributedLock` in the database; see :class:`DatabaseLockBackend`."""

    def __init__(
        self, backend: DatabaseLockBackend, name: str, ttl: float = DEFAULT_TTL,
        *, fencing_floor: int = 0,
    ) -> None:
        super().__init__(name, ttl, backend.clock, fencing_floor)
        self.using = backend.using

    def _rows(self) -> Any:
        from celery_driftsafe.models import Lock as LockRow

        return LockRow.objects.using(self.using).filter(name=self.name)

    def _outside_transaction(self) -> None:
        from django.db import connections

        if connections[self.using].in_atomic_block:
            raise LockError(
                f"lock {self.name!r}: database locks must be taken, extended and released "
                "outside a transaction (others would not see the lock until it commits)"
            )

    def _acquire_token(self, token: str, ttl: float) -> int | None:
        from django.db import DatabaseError, transaction
        from django.db.models import F, Q, Value
        from django.db.models.functions import Greatest

        from celery_driftsafe.models import Lock as LockRow

        self._outside_transaction()
        now = self.clock.now()
        expires_at = now + timedelta(seconds=ttl)
        try:
            with transaction.atomic(using=self.using):
                # Take over a free or expired row. On PostgreSQL a concurrent taker waits on
                # the row lock and then re-checks the condition against the new row: one wins.
                taken = (
                    self._rows()
                    .filter(Q(token="") | Q(expires_at__lte=now))
                    .update(
                        token=token,
                        fencing_token=Greatest(F("fencing_token") + 1,
                                               Value(self.fencing_floor + 1)),
                        expires_at=expires_at,
                    )
                )
                if not taken:  # no row yet, or held: insert unless a row exists
                    LockRow.objects.using(self.using).bulk_create(
                        [
                            LockRow(
                                name=self.name, token=token,
                                fencing_token=self.fencing_floor + 1, expires_at=expires_at,
                            )
                        ],
                        ignore_conflicts=True,
                    )
                fencing_token: int | None = (
                    self._rows().filter(token=token).values_list("fencing_token", flat=True).first()
                )
        except DatabaseError as exc:
            raise LockError(f"lock {self.name!r}: database error: {exc}") from exc
        return fencing_token

    def _update_if_held(self, token: str, changes: Callable[[datetime], dict[str, Any]]) -> bool:
        """One conditional UPDATE: apply ``changes(now)`` if ``token`` holds an unexpired lease."""
        from django.db import DatabaseError

        self._outside_transaction()
        now = self.clock.now()
        try:
            held = self._rows().filter(token=token, expires_at__gt=now)
            return bool(held.update(**changes(now)))
        except DatabaseError as exc:
            raise LockError(f"lock {self.name!r}: database error: {exc}") from exc

    def _extend_token(self, token: str, ttl: float) -> bool:
        return self._update_if_held(token, lambda now: {"expires_at": now + timedelta(seconds=ttl)})

    def _release_token(self, token: str) -> bool:
        # The row stays (with an empty token) so the fencing counter keeps counting.
        return self._update_if_held(token, lambda now: {"token": ""})

    def _thread_done(self) -> None:
        from django.db import connections

        connections[self.using].close()


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
        from celery_driftsafe.redis_client import get_redis, key_prefix
        from celery_driftsafe.retention import fence_ttl_seconds

        return RedisLockBackend(get_redis(settings), key_prefix(settings), clock=clock,
                                fence_ttl=fence_ttl_seconds(settings))
    return DatabaseLockBackend(clock=clock, using=using)
