"""A beat's periodic work off the claim's path: a pass at most once an interval, in a thread of
its own with its own database connection, started from the round at the cost of a comparison.
The reconciliation (:mod:`celery_driftsafe.beat.recovery`) and the pruning
(:mod:`celery_driftsafe.ledger.retention`) are two."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import datetime


class BackgroundPass:
    """One kind of pass; a subclass says how often (:meth:`interval`), whether a due pass has
    anything to do (:meth:`wanted`) and what it does (:meth:`run_pass`, which watches
    ``_stop`` between its batches)."""

    thread_name = "driftsafe-pass"

    def __init__(
        self, *, using: str = "default", monotonic: Callable[[], float], first_at: float
    ) -> None:
        self.using = using
        self.monotonic = monotonic
        #: The monotonic instant from which the next pass may start.
        self.next_at = first_at
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def interval(self) -> float | None:
        """Seconds from one pass to the next (None: no passes)."""
        raise NotImplementedError

    def wanted(self) -> bool:
        """Whether a pass that is due has anything to do (asked once per interval)."""
        return True

    def run_pass(self, now: datetime) -> None:
        raise NotImplementedError

    def maybe_start(self, now: datetime) -> bool:
        """Start a pass at the authority's ``now`` when one is due and none is in flight;
        whether one started."""
        interval = self.interval()
        if interval is None or self._stop.is_set():
            return False
        if self._thread is not None and self._thread.is_alive():
            return False
        mono = self.monotonic()
        if mono < self.next_at:
            return False
        self.next_at = mono + interval
        if not self.wanted():
            return False
        self._thread = threading.Thread(
            target=self._run, args=(now,), name=self.thread_name, daemon=True
        )
        self._thread.start()
        return True

    def _run(self, now: datetime) -> None:
        from django.db import connections

        try:
            self.run_pass(now)
        finally:
            connections.close_all()  # this thread's connections only

    def join(self, timeout: float | None = None) -> None:
        """Wait for a pass in flight (tests)."""
        if self._thread is not None:
            self._thread.join(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Stop after the batch in flight and wait for it (a stopping beat)."""
        self._stop.set()
        self.join(timeout)
