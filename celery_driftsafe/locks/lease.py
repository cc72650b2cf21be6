"""The lease machinery both backends share: polling, bookkeeping, logging, ``hold()`` and the
watchdog that renews a held lease and declares it lost when it runs out."""

from __future__ import annotations

import logging
import os
import random
import secrets
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from celery_driftsafe.exceptions import LockError
from celery_driftsafe.locks.contract import HeldLock
from celery_driftsafe.store.clock import Clock

logger = logging.getLogger("celery_driftsafe.locks")

#: Blocking acquisition polls with a jittered back-off between these two pauses (seconds).
POLL_MIN_SECONDS = 0.005
POLL_MAX_SECONDS = 0.05
#: A watchdog's threads start only once a lock has been held this fraction of its ttl: most
#: holds (a short task body) end before, and cost no thread at all. Renewals keep their times.
WATCHDOG_START_FRACTION = 1 / 6


def _check_ttl(ttl: float) -> None:
    if not ttl >= 0.001:
        raise ValueError(f"a lock ttl must be at least 0.001 seconds, not {ttl!r}")


def _log_extra(action: str, lock: _LeaseLock) -> dict[str, Any]:
    return {"action": action, "lock": lock.name, "fencing_token": lock.fencing_token}


class _LeaseLock:
    """What both backends share: polling, bookkeeping, logging, ``hold()`` and the watchdog."""

    def __init__(
        self, name: str, ttl: float, clock: Clock, fencing_floor: int = 0, holder: str = ""
    ) -> None:
        if not name:
            raise ValueError("a lock needs a non-empty name")
        _check_ttl(ttl)
        if fencing_floor < 0:
            raise ValueError(f"fencing_floor must be >= 0, not {fencing_floor!r}")
        self.fencing_floor = int(fencing_floor)
        if "#" in holder:
            raise ValueError(f"a lock's holder has no '#' in its name, not {holder!r}")
        #: What this object's tokens start with (``<holder>#``; empty: nothing), so that a
        #: process that knows the holder, not its token, can take the lock from it
        #: (:meth:`take_from`).
        self.holder = holder
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
    def _acquire_token(
        self, token: str, ttl: float, heir: str | None = None, holder: str | None = None
    ) -> int | None:
        """Take the lock for ``token``: the new fencing token, or None when it is held. With
        ``heir``: only the lock handed to ``heir`` (:meth:`hand_over`), and its lease lasting;
        with ``holder``: only the lock held under a token made for ``holder`` (its lease
        lasting)."""
        raise NotImplementedError

    def _hand_token(self, token: str, heir: str, ttl: float) -> bool:
        """Store ``heir`` in place of ``token`` (if it is still the holder's) with a lease of
        ``ttl`` seconds."""
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

    def _try_acquire(self, heir: str | None = None, holder: str | None = None) -> bool:
        token = secrets.token_hex(16)
        if self.holder:
            token = f"{self.holder}#{token}"
        sent = self.clock.monotonic()
        fencing_token = self._acquire_token(token, self.ttl, heir, holder)
        if fencing_token is None:
            return False
        self.token, self.fencing_token = token, fencing_token
        self._lease_ends = sent + self.ttl
        logger.debug(
            "acquired lock %s%s%s, fencing token %s",
            self.name,
            "" if heir is None else f" handed to {heir}",
            "" if holder is None else f" taken from {holder}",
            fencing_token,
            extra=_log_extra("lock-acquired", self),
        )
        return True

    def take_handed(self, heir: str) -> bool:
        """Acquire the lock if, and only if, its holder handed it to ``heir``
        (:meth:`hand_over`) and that lease lasts; tries once. A fresh token and fencing token,
        as :meth:`acquire`."""
        return self._try_acquire(heir)

    def take_from(self, holder: str) -> bool:
        """Acquire the lock if, and only if, it is held under a token made for ``holder`` (a
        lock object made with that ``holder``) and that lease lasts; tries once. For a holder
        that cannot give the lock up itself (its process was killed) and whose end another
        process has seen for sure. A fresh token and fencing token, as :meth:`acquire`."""
        if not holder or "#" in holder:
            raise ValueError(f"take_from needs a holder's name without '#', not {holder!r}")
        return self._try_acquire(holder=holder)

    def hand_over(self, heir: str) -> bool:
        """Give the lock up to ``heir`` rather than free it: while this object holds it, its
        token is replaced by ``heir`` under a fresh lease of ``ttl`` seconds, in one atomic
        step. Nobody can :meth:`acquire` it then; :meth:`take_handed` with ``heir`` can, until
        that lease runs out (then it is free again). This object no longer holds it either
        way; False (logged) when it no longer held it."""
        return self._give_up(
            f"hand-over to {heir}", lambda token: self._hand_token(token, heir, self.ttl)
        )

    def extend(self, ttl: float | None = None) -> bool:
        ttl = self.ttl if ttl is None else ttl
        _check_ttl(ttl)
        if self.token is None:
            logger.warning(
                "extend of lock %s, which this object does not hold",
                self.name,
                extra=_log_extra("lock-extend-not-held", self),
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
                extra=_log_extra("lock-extend-lost", self),
            )
        return extended

    def release(self) -> bool:
        return self._give_up("release", self._release_token)

    def _give_up(self, what: str, step: Callable[[str], bool]) -> bool:
        """Release or hand over (``what``) through the backend's ``step`` on this holder's
        token; this object no longer holds the lock afterwards (on :class:`LockError` it keeps
        the token: the call can be tried again)."""
        if self.token is None:
            logger.warning(
                "%s of lock %s, which this object does not hold",
                what,
                self.name,
                extra=_log_extra("lock-release-not-held", self),
            )
            return False
        done = step(self.token)
        if not done:
            logger.warning(
                "lock %s (fencing token %s) was no longer held at its %s: lease expired or "
                "taken over; the current holder's lease was left alone",
                self.name,
                self.fencing_token,
                what,
                extra=_log_extra("lock-release-lost", self),
            )
        self.token = self.fencing_token = None
        self._lease_ends = 0.0
        return done

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
        self,
        *,
        watchdog: bool = True,
        on_lost: Callable[[HeldLock], None] | None = None,
        on_renewed: Callable[[], object] | None = None,
    ) -> Iterator[HeldLock]:
        """For a lock this object already acquired: yield a :class:`HeldLock`, renewing the
        lease meanwhile when ``watchdog`` is true, and release it on exit (as :meth:`hold`;
        hand it over, :meth:`hand_over`, when ``held.heir`` was set meanwhile).
        ``on_renewed()`` is called in the watchdog's thread after each renewal (an error it
        raises is logged; the lease is kept)."""
        if self.token is None or self.fencing_token is None:
            raise LockError(f"lock {self.name!r} is not held by this object")
        held = HeldLock(self, self.token, self.fencing_token)
        dog = _Watchdog(self, held, on_lost, on_renewed) if watchdog else None
        try:
            if dog is not None and _waits_on(self.clock):
                dog.start()  # a clock of its own (a fake one): its time, not the starter's
            elif dog is not None:
                _starter.schedule(dog, self.ttl * WATCHDOG_START_FRACTION)
            yield held
        finally:
            if dog is not None and not _starter.cancel(dog):
                dog.stop()
            try:
                released = self.hand_over(held.heir) if held.heir else self.release()
            except LockError as exc:
                logger.warning(
                    "could not release lock %s: %s; its lease will run out",
                    self.name,
                    exc,
                    extra=_log_extra("lock-release-failed", self),
                )
                released = False
            if not released:
                held._mark_lost("no longer held at release")


def _waits_on(clock: Clock) -> bool:
    """Whether ``clock`` measures waits itself (``wait(event, seconds)``), as a fake clock does."""
    return callable(getattr(clock, "wait", None))


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
                threading.Thread(
                    target=self._loop, name="driftsafe-lock-watchdog-starter", daemon=True
                ).start()
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
        self,
        lock: _LeaseLock,
        held: HeldLock,
        on_lost: Callable[[HeldLock], None] | None,
        on_renewed: Callable[[], object] | None = None,
    ) -> None:
        self.lock, self.held, self.on_lost, self.on_renewed = lock, held, on_lost, on_renewed
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

    def _wait(self, seconds: float) -> bool:
        """Until stopped or ``seconds`` passed on the lock's clock; whether it was stopped.
        A clock with a ``wait(event, seconds)`` of its own (the fake clock of
        :mod:`celery_driftsafe.testing`) measures the wait; any other waits in real time."""
        if _waits_on(self.lock.clock):
            stopped: bool = self.lock.clock.wait(self._stopping, seconds)  # type: ignore[attr-defined]
            return stopped
        return self._stopping.wait(seconds)

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
        while not self._wait(max(self.lock.lease_remaining(), POLL_MIN_SECONDS)):
            if self.lock.lease_remaining() <= 0:
                self._lose("the lease ran out before it could be renewed")
                return

    def _renew_until_stopped(self) -> str | None:
        """None when stopped; otherwise why the lock was lost."""
        interval = self.lock.ttl / 3
        wait = max(0.0, interval - (self.lock.clock.monotonic() - self.made_at))
        while not self._wait(wait):
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
                    extra=_log_extra("lock-renew-failed", self.lock),
                )
                wait = min(interval, max(remaining, POLL_MIN_SECONDS))
                continue
            self._renewed()
            wait = interval
        return None

    def _renewed(self) -> None:
        if self.on_renewed is None:
            return
        try:
            self.on_renewed()
        except Exception:
            logger.exception(
                "on_renewed callback of lock %s failed",
                self.lock.name,
                extra=_log_extra("lock-renewed-callback-failed", self.lock),
            )

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
            extra=_log_extra("lock-lost", self.lock),
        )
        self.held._mark_lost(reason)
        if self.on_lost is not None:
            try:
                self.on_lost(self.held)
            except Exception:
                logger.exception(
                    "on_lost callback of lock %s failed",
                    self.lock.name,
                    extra=_log_extra("lock-lost-callback-failed", self.lock),
                )
