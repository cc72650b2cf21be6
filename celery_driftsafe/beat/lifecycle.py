"""The beat as a node among the beats: its start-up, heartbeat, clock check and stop.

:class:`BeatNode` is the part of :class:`~celery_driftsafe.scheduler.DriftSafeScheduler` that
keeps the node's row (see :mod:`celery_driftsafe.beat.nodes`) true: it registers the node at
start-up (waiting with backoff through an outage of the database or the time authority),
re-measures the clock offset and pauses claiming past the hard bound, beats the heart (and
re-registers a node the others marked dead), and on a signal or a shutdown request stops
outside any round and records the node stopped. The rounds themselves are the scheduler's.
"""

from __future__ import annotations

import logging
import random
import signal
import threading
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.db import DatabaseError, InterfaceError, connections

from celery_driftsafe.beat import nodes
from celery_driftsafe.beat.wakeup import Wakeup
from celery_driftsafe.conf import DriftSafeSettings
from celery_driftsafe.definitions.beat_schedule import SyncReport, sync_beat_schedule
from celery_driftsafe.exceptions import BrokerUnavailable, ClockError
from celery_driftsafe.store.clock import Authority, AuthorityClock, Clock
from celery_driftsafe.store.connections import missing_schema

if TYPE_CHECKING:
    from celery_driftsafe.beat.recovery import BackgroundReconciler
    from celery_driftsafe.claim.prefetch import Prefetcher
    from celery_driftsafe.definitions.changes import BackgroundUnscheduled
    from celery_driftsafe.ledger import retention
    from celery_driftsafe.publish.dispatcher import Dispatcher

logger = logging.getLogger("celery_driftsafe.scheduler")

#: Errors that mean the database or the time authority is away: the beat waits them out.
OUTAGE_ERRORS = (DatabaseError, InterfaceError, ClockError, BrokerUnavailable)
#: A round's authority reading this far from the clock's estimate: the authority's clock
#: stepped (or this host was suspended), and the beat measures again at once.
STEP_SECONDS = 5.0


def outage_text(exc: BaseException) -> str:
    """Why the beat waits, for its log: tables or columns that are not there (a beat started
    before ``migrate``, or an upgrade not migrated yet) are named as such, not taken for a
    database out of reach. The beat waits either way, and goes on once they are there."""
    if isinstance(exc, BrokerUnavailable):
        return f"the broker is unreachable ({exc}); slots due meanwhile meet the misfire policy"
    return missing_schema(exc) or f"the database or time authority is unreachable: {exc}"


class BeatNode:
    """The node's life of a drift-safe beat (see the module docstring); the scheduler sets
    these attributes up."""

    app: Any
    using: str
    node_id: str
    settings: DriftSafeSettings
    authority: Authority
    clock: Clock
    dispatcher: Dispatcher
    pruner: retention.BackgroundPruner
    reconciler: BackgroundReconciler
    unscheduled: BackgroundUnscheduled
    _prefetcher: Prefetcher
    _install_signals: bool
    _shutdown: threading.Event
    _wake: Wakeup
    _terminating: int | None
    _ready: bool
    _closed: bool
    _listener: threading.Thread | None
    _paused_reason: str
    _claiming_since: datetime | None
    _others_since: datetime | None
    _lag: float | None

    # -- start-up and stop ----------------------------------------------------------------

    def _start_up(self) -> SyncReport:
        """Measure the clock, register the node, mirror ``beat_schedule`` (all idempotent).

        Through an outage of the database or the time authority it retries with backoff, so
        a beat started while they restart waits for them instead of crashing; a signal while
        it waits stops it (exit 0), recording the node stopped if it was registered."""
        backoff = 0.0
        registered = False
        while True:
            try:
                self._check_clock()
                nodes.register(self.node_id, self.clock.now(), using=self.using)
                registered = True
                return sync_beat_schedule(self.app, now=self.authority.read(), using=self.using)
            except OUTAGE_ERRORS as exc:
                if not backoff:
                    logger.error(
                        "start-up waiting: %s; retrying with backoff",
                        outage_text(exc),
                        extra={"action": "outage", "node": self.node_id},
                    )
                connections[self.using].close()
                backoff = min(max(backoff * 2, 0.5), 10.0)
                self._wake.wait(backoff * random.uniform(0.5, 1.0))
                self._wake.clear()
            if self._terminating is not None:
                if registered:
                    self._mark_stopped(attempts=1)
                raise SystemExit()

    def _install_signal_handlers(self) -> None:
        if self._install_signals and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_terminate)
            signal.signal(signal.SIGINT, self._on_terminate)

    def _on_terminate(self, signum: int, frame: Any) -> None:
        """SIGTERM / SIGINT: stop after the set-up or round in flight; at once when waiting.

        It may run between any two bytecodes of the main thread, so it only writes a flag and
        wakes the wait (see :class:`Wakeup`): no lock, no database, no exception. ``tick``
        raises ``SystemExit`` outside any round, celery's beat service then calls
        :meth:`close`, which records the node stopped."""
        self._terminating = signum
        self._wake.set()

    def _stopping(self) -> bool:
        if self._terminating is not None and not self._shutdown.is_set():
            logger.info(
                "driftsafe node %s stopping on signal %d",
                self.node_id,
                self._terminating,
                extra={"action": "stop", "node": self.node_id},
            )
            self._shutdown.set()
        return self._shutdown.is_set()

    def request_shutdown(self) -> None:
        """Ask the scheduler (for example one run in a thread) to stop after this round."""
        self._shutdown.set()
        self._wake.set()

    def close(self) -> None:
        """Record the node stopped (a few tries through a short outage) and let go of
        connections. Idempotent; a signal during it changes nothing."""
        self._shutdown.set()
        self._wake.set()
        if self._closed:
            return
        self._closed = True
        if self._ready:
            self._prefetcher.finish(self.dispatcher.dispatch, self.node_id)
            self.pruner.close()
            self.reconciler.close()
            self.unscheduled.close()
            self._mark_stopped()
        if self._listener is not None:
            self._listener.join(timeout=2)
        connections.close_all()

    def _mark_stopped(self, attempts: int = 3) -> None:
        for attempt in range(1, attempts + 1):
            try:
                nodes.mark_stopped(self.node_id, self.clock.now(), using=self.using)
                return
            except OUTAGE_ERRORS as exc:
                connections[self.using].close()
                if attempt == attempts:
                    logger.warning(
                        "could not mark node %s stopped: %s",
                        self.node_id,
                        exc,
                        extra={"action": "stop", "node": self.node_id},
                    )
                    return
                self.clock.sleep(0.5 * attempt)

    # -- clock and heartbeat ----------------------------------------------------------------

    def _check_clock(self) -> None:
        """Re-measure the offset when due; warn past the soft bound, pause past the hard one."""
        if not isinstance(self.clock, AuthorityClock) or not self.clock.needs_sync():
            return
        self._paused_reason = nodes.check_offset(
            self.clock.sync(),
            self.authority.name,
            self.settings,
            self._paused_reason,
            self.node_id,
        )

    def _follow_authority(self, reading: datetime) -> None:
        """Measure again at once (and heartbeat) when ``reading``, the round's, is far from the
        clock's estimate: else heartbeats stamped with the stale estimate look old against
        fresh readings until the next measurement, and this beat and its peers are marked
        dead by one another, refusing to publish their own claims meanwhile."""
        if not isinstance(self.clock, AuthorityClock):
            return
        moved = (reading - self.clock.now()).total_seconds()
        if abs(moved) <= STEP_SECONDS:
            return
        logger.warning(
            "the time authority's clock is %+.1f s from this beat's estimate (a step, or this "
            "host was suspended); measuring again",
            moved,
            extra={"action": "clock-step", "node": self.node_id},
        )
        self.clock.last_sample = None  # needs_sync: _heartbeat's check measures now
        self._heartbeat()

    def _heartbeat(self) -> None:
        self._check_clock()
        sample = self.clock.last_sample if isinstance(self.clock, AuthorityClock) else None
        now = self.clock.now()
        alive = nodes.heartbeat(
            self.node_id,
            now,
            sample,
            paused_reason=self._paused_reason,
            # a stretch that starts with this round starts now
            claiming_since=None if self._paused_reason else (self._claiming_since or now),
            lag_seconds=self._lag,
            using=self.using,
        )
        self._lag = None
        self._others_since = nodes.others_claiming_since(
            self.node_id,
            now,
            timedelta(seconds=self.settings.node_dead_after_seconds),
            using=self.using,
        )
        if not alive:
            # Another beat marked this node dead while it was paused (SIGSTOP, a VM pause, a
            # long GC) and took over its unpublished claims; publishing re-checks ownership,
            # so nothing it held goes out twice. Come back as alive.
            logger.warning(
                "node %s was marked dead while it was paused; its unpublished claims were "
                "taken over; re-registering",
                self.node_id,
                extra={"action": "re-register", "node": self.node_id},
            )
            nodes.register(self.node_id, self.clock.now(), using=self.using)
