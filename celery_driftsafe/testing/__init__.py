"""Helpers for testing code that uses celery_driftsafe, shipped for users' own tests.

:class:`FakeClock` is a :class:`~celery_driftsafe.clock.Clock` that only moves when told to:
``sleep()`` advances it instantly, so a test of a schedule over a day runs in microseconds and
boundary cases (a slot exactly at ``now``) are exact rather than hoped for::

    from celery_driftsafe.testing import FakeClock

    clock = FakeClock(datetime(2026, 3, 29, 0, 59, tzinfo=UTC))
    clock.advance(60)
    assert clock.now() == datetime(2026, 3, 29, 1, 0, tzinfo=UTC)

:func:`fake_authority` installs such a clock in place of the configured time authority, and
:class:`~celery_driftsafe.testing.beat.SteppedBeat` (the ``driftsafe`` pytest fixture) runs
the real scheduler's rounds on it (see :doc:`/howto/test-your-schedules`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta

from celery_driftsafe import clock as _clock
from celery_driftsafe.exceptions import ClockError


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
            return self._now

    def set(self, instant: datetime) -> None:
        """Jump the authority time (the monotonic clock is unaffected, as with a real step)."""
        if instant.tzinfo is None:
            raise ValueError("FakeClock.set needs an aware datetime")
        with self._lock:
            self._now = instant.astimezone(UTC)

    # The Authority protocol, so a FakeClock can also stand in for the shared clock.
    def read(self) -> datetime:
        return self.now()


class UnreachableAuthority:
    """An authority that always fails, for testing outage handling."""

    name = "unreachable"

    def read(self) -> datetime:
        raise ClockError("authority unreachable (test double)")


@contextmanager
def fake_authority(clock: FakeClock) -> Iterator[FakeClock]:
    """Within the block, ``clock`` stands in for ``DRIFTSAFE['TIME_AUTHORITY']`` in this
    process: new and edited :class:`~celery_driftsafe.models.PeriodicTask` rows take their
    first slot from it, and so do beats built from settings, "run now" and ``DriftSafeTask``
    executed here. Other processes (a real worker or beat) still read the real authority."""
    _clock._stand_ins.append(clock)
    try:
        yield clock
    finally:
        _clock._stand_ins.remove(clock)
