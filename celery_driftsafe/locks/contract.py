"""The lock contract: what every backend promises (:class:`DistributedLock`), the
backend protocol and what ``hold()`` yields."""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

from celery_driftsafe.exceptions import LockLost

#: Lease length in seconds when none is given.
DEFAULT_TTL = 30.0


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
    * ``hand_over(heir)`` gives the lock up to a named successor instead of freeing it: in one
      atomic step, while this holder's token is stored, ``heir`` is stored in its place under a
      fresh lease of ``ttl``. ``acquire()`` then fails as for any holder; ``take_handed(heir)``
      takes it (a fresh token, the fencing counter incremented) while that lease lasts; once it
      has run out the lock is free. A holder passes its turn on this way so that nobody can
      take the lock in the moment between its release and its successor's acquisition.
    * A lock made with ``holder="<name>"`` (no ``#`` in it) stores tokens that start with
      ``<name>#``; then
      ``take_from(name)`` takes it (a fresh token, the fencing counter incremented), in one
      atomic step, while such a token is stored and its lease lasts, and fails otherwise. It is
      for a holder that cannot give the lock up (its process was killed), taken over by a
      process that knows for sure the holder is gone: the process that saw it end.
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

    def hand_over(self, heir: str) -> bool: ...

    def take_handed(self, heir: str) -> bool: ...

    def take_from(self, holder: str) -> bool: ...

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
        self,
        *,
        watchdog: bool = True,
        on_lost: Callable[[HeldLock], None] | None = None,
        on_renewed: Callable[[], object] | None = None,
    ) -> AbstractContextManager[HeldLock]: ...


class LockBackend(Protocol):
    """Makes lock objects; cheap, so make one lock object per use and per thread."""

    def lock(
        self, name: str, ttl: float = DEFAULT_TTL, *, fencing_floor: int = 0, holder: str = ""
    ) -> DistributedLock: ...


@dataclass
class HeldLock:
    """What :meth:`DistributedLock.hold` yields while the lock is held.

    ``lost`` is set (and ``lost_reason`` says why) when the watchdog failed to renew the
    lease, or when the lock was found no longer held at release. ``heir``, set while held:
    on exit the lock is handed to it (:meth:`DistributedLock.hand_over`) rather than released.
    """

    lock: DistributedLock
    token: str
    fencing_token: int
    lost: threading.Event = field(default_factory=threading.Event)
    lost_reason: str | None = None
    heir: str | None = None

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
