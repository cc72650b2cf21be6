"""Helpers for testing code that uses celery_driftsafe, shipped for users' own tests.

:class:`FakeClock` is a :class:`~celery_driftsafe.store.clock.Clock` that only moves when told to:
``sleep()`` advances it instantly, so a test of a schedule over a day runs in microseconds and
boundary cases (a slot exactly at ``now``) are exact rather than hoped for::

    from celery_driftsafe.testing import FakeClock

    clock = FakeClock(datetime(2026, 3, 29, 0, 59, tzinfo=UTC))
    clock.advance(60)
    assert clock.now() == datetime(2026, 3, 29, 1, 0, tzinfo=UTC)

:func:`inject_authority_clock` puts such a clock in place of the authority for everything
outside a beat (the task base class, run now, the admin, schedule edits)::

    with inject_authority_clock(FakeClock(start)):
        task.save()  # its first slot is computed from ``start``

The pytest plugin (:mod:`celery_driftsafe.testing.pytest_plugin`) does that for a whole test,
and its ``driftsafe`` fixture (:class:`~celery_driftsafe.testing.beat.SteppedBeat`) runs the
real scheduler's rounds on the fake clock (see :doc:`/howto/test-your-schedules`).
"""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta

from celery_driftsafe.exceptions import ClockError
from celery_driftsafe.store.clock import AuthorityClock, inject_authority_clock

__all__ = [
    "FakeClock",
    "UnreachableAuthority",
    "inject_authority_clock",
    "skewed_authority_clock",
]


class FakeClock:
    """A controllable clock. ``now()`` is ``start`` plus the time advanced so far; the
    monotonic clock advances in step. Thread-safe."""

    name = "fake"

    def __init__(self, start: datetime | None = None, *, monotonic_start: float = 1000.0) -> None:
        if start is None:
            start = datetime(2026, 1, 1, tzinfo=UTC)
        if start.tzinfo is None:
            raise ValueError("FakeClock needs an aware start datetime, e.g. tzinfo=UTC")
        self._now = start.astimezone(UTC)
        self._monotonic = monotonic_start
        self._lock = threading.Lock()
        self._advanced = threading.Condition(self._lock)
        #: Threads inside :meth:`wait` now (a test advances once they all wait).
        self.waiters = 0
        self.sleeps: list[float] = []

    def now(self) -> datetime:
        with self._lock:
            return self._now

    def monotonic(self) -> float:
        with self._lock:
            return self._monotonic

    def sleep(self, seconds: float) -> None:
        """Record the requested sleep and advance by it at once."""
        with self._lock:
            self.sleeps.append(seconds)
        if seconds > 0:
            self.advance(seconds)

    def advance(self, seconds: float | timedelta) -> datetime:
        """Move both clocks forward; returns the new ``now()``."""
        delta = seconds if isinstance(seconds, timedelta) else timedelta(seconds=seconds)
        if delta < timedelta(0):
            raise ValueError("a clock does not go backwards; use set() for a jump")
        with self._lock:
            self._now += delta
            self._monotonic += delta.total_seconds()
            self._advanced.notify_all()
            return self._now

    def set(self, instant: datetime) -> None:
        """Jump the authority time (the monotonic clock is unaffected, as with a real step)."""
        if instant.tzinfo is None:
            raise ValueError("FakeClock.set needs an aware datetime")
        with self._lock:
            self._now = instant.astimezone(UTC)

    def wait(self, event: threading.Event, seconds: float) -> bool:
        """Until ``event`` is set or this clock has been advanced by ``seconds`` (by another
        thread); whether the event is set. What a lock's watchdog waits with, so a test moves
        a lease along with :meth:`advance` instead of sleeping."""
        with self._lock:
            deadline = self._monotonic + max(seconds, 0.0)
            self.waiters += 1
        try:
            while not event.is_set():
                with self._advanced:
                    if self._monotonic >= deadline:
                        return False
                    self._advanced.wait(0.005)  # also notices the event, which does not notify
            return True
        finally:
            with self._lock:
                self.waiters -= 1

    # The Authority protocol, so a FakeClock can also stand in for the shared clock.
    def read(self) -> datetime:
        return self.now()


class UnreachableAuthority:
    """An authority that always fails, for testing outage handling."""

    name = "unreachable"

    def read(self) -> datetime:
        raise ClockError("authority unreachable (test double)")


def skewed_authority_clock(skew_seconds: float) -> AuthorityClock:
    """The configured time authority's clock as a node whose wall clock is ``skew_seconds`` off
    measures it: for a beat that *believes* its clock is off, where libfaketime cannot skew the
    whole process (``DriftSafeScheduler(app, clock=..., authority=clock.authority)``). Only
    the offset it measures and reports is skewed: due-ness never reads a node's wall clock."""
    from celery_driftsafe.conf import get_settings
    from celery_driftsafe.store.clock import authority_from_settings

    settings = get_settings()
    skew = timedelta(seconds=skew_seconds)
    return AuthorityClock(
        authority_from_settings(settings),
        samples=settings.clock_sync_samples,
        resync_seconds=settings.clock_sync_interval_seconds,
        wall=lambda: datetime.now(UTC) + skew,
    )
