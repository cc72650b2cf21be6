"""A started run's lease in the ledger: how long its worker holds it there, whatever a lock
says.

A lock holder's start writes ``lease_until`` (:meth:`LedgerLease.end`), and the lease follows
the run's lock: each renewal of the lock by its watchdog renews it (:meth:`LedgerLease.renew`).
A run is taken over from its worker only once the lease is over both in the ledger and by the
lock, and another run of the task counts as running while its lease lasts; so a lock Redis
lost (a flush, an eviction, a restart that kept no data) neither lets a copy take a running
run over nor the next slot start beside it. When the lock is declared lost while the body
runs, the lease is kept from a thread of its own until the run ends
(:meth:`LedgerLease.keep`).
"""

from __future__ import annotations

import logging
import threading
from datetime import datetime, timedelta

from celery_driftsafe.core.stored_names import RunStatus
from celery_driftsafe.ledger.run_ledger import Ledger, RunRow
from celery_driftsafe.store.clock import authority_clock
from celery_driftsafe.worker import log_run


def lease_left(row: RunRow, now: datetime) -> float:
    """Seconds the started run's worker still holds its lease in the ledger (0: over)."""
    if row.status != RunStatus.STARTED or row.lease_until is None:
        return 0.0
    return max(0.0, (row.lease_until - now).total_seconds())


class LedgerLease:
    """One delivery's lease of its run in the ledger, ``seconds`` long from each renewal."""

    def __init__(self, ledger: Ledger, run_id: int, seconds: float) -> None:
        self.ledger = ledger
        self.run_id = run_id
        self.seconds = seconds
        #: The fencing token the run was started under (None: not started yet, nothing to
        #: renew); every renewal is conditional on it.
        self.token: int | None = None

    def end(self, now: datetime) -> datetime:
        """When a lease in the ledger taken or renewed at ``now`` ends."""
        return now + timedelta(seconds=self.seconds)

    def renew(self) -> bool:
        """In the lock's watchdog thread, after each renewal: the run's lease in the ledger
        follows its lock, on a connection of that thread's, closed again. False once the
        ledger refuses it (the run ended, or a newer holder took it over)."""
        from django.db import connections

        if self.token is None:
            return True
        try:
            return self.ledger.renew_lease(
                self.run_id, self.token, self.end(authority_clock().now())
            )
        finally:
            connections.close_all()

    def keep(self, stop: threading.Event) -> None:
        """The run's lock was declared lost while its body runs (its renewal was refused: a
        copy held the key Redis lost, for the moment of its refused start; or the lease ran
        out while the worker was paused or the backend away). The body runs on, so the lease
        in the ledger, which a takeover also needs over, is renewed from a thread of its own
        until ``stop`` is set (the run ends) or the ledger refuses it (a newer holder took the
        run over while this worker was away)."""
        thread = threading.Thread(
            target=self._keep_until,
            args=(stop,),
            name=f"driftsafe-lease[run:{self.run_id}]",
            daemon=True,
        )
        thread.start()

    def _keep_until(self, stop: threading.Event) -> None:
        log_run(
            logging.WARNING,
            "run %s: its lock was lost while the body runs; the worker keeps its lease in the "
            "ledger until the run ends, so no copy takes it over meanwhile",
            self.run_id,
            run_id=self.run_id,
            action="lease-kept",
        )
        interval = self.seconds / 3
        while not stop.is_set():
            try:
                if not self.renew():
                    if not stop.is_set() and self._taken_over():
                        log_run(
                            logging.ERROR,
                            "run %s: its lease in the ledger can no longer be renewed: a "
                            "newer holder took the run over while this worker was away",
                            self.run_id,
                            run_id=self.run_id,
                            action="lease-taken-over",
                        )
                    return
            except Exception as exc:  # the database or the time authority away: keep trying
                log_run(
                    logging.WARNING,
                    "run %s: could not renew its lease in the ledger (%s); retrying",
                    self.run_id,
                    exc,
                    run_id=self.run_id,
                    action="lease-renew-failed",
                )
            stop.wait(interval)

    def _taken_over(self) -> bool:
        """Whether a newer holder wrote the run (not this worker's own outcome or hand-over,
        which also end its lease), read on a connection closed again."""
        from django.db import connections

        try:
            row = self.ledger.load(self.run_id)
        finally:
            connections.close_all()
        return row is not None and row.fencing_token != self.token
