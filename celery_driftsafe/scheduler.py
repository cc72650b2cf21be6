"""``DriftSafeScheduler``: a Celery beat scheduler that many beats can run at once.

Use it with ``celery -A proj beat -S celery_driftsafe.scheduler:DriftSafeScheduler`` or
``beat_scheduler = "celery_driftsafe.scheduler:DriftSafeScheduler"``.

One tick is one round: heartbeat and clock check when due, take over stale claims (the
outbox), read the authority's clock, claim what is due at that reading, publish, mark. Then it
waits on the local monotonic clock for the authority's time until the next slot (at most
:attr:`~DriftSafeScheduler.max_interval`, Celery's ``beat_max_loop_interval``), woken early by
a schedule-change notification. The node's wall clock is read only to report its offset.

The beat is also a node among the beats, and keeps the node's row (see
:mod:`celery_driftsafe.beat.nodes`) true: it registers the node at start-up (waiting with
backoff through an outage of the database or the time authority), re-measures the clock offset
and pauses claiming past the hard bound, beats the heart (and re-registers a node the others
marked dead), and on a signal or a shutdown request stops outside any round and records the
node stopped.
"""

from __future__ import annotations

import logging
import math
import os
import random
import signal
import socket
import threading
import time
from datetime import datetime, timedelta
from functools import partial
from typing import Any, NamedTuple

from celery.beat import Scheduler
from django.db import DatabaseError, InterfaceError, connections

from celery_driftsafe import checks
from celery_driftsafe.apps import ensure_django
from celery_driftsafe.beat import nodes
from celery_driftsafe.beat.deadlines import BackgroundDeadlines
from celery_driftsafe.beat.gc_freeze import HeapKeeper, widen_young_generation
from celery_driftsafe.beat.recovery import BackgroundReconciler, recover
from celery_driftsafe.beat.wakeup import (
    OUTAGE_REPEAT_SECONDS,
    RedisHealth,
    Wakeup,
    start_change_listener,
)
from celery_driftsafe.claim.claimers import Claimer, ClaimResult, claimer_for, next_due, run_expiry
from celery_driftsafe.claim.helper_process import spare_cores
from celery_driftsafe.claim.prefetch import Prefetcher
from celery_driftsafe.conf import DriftSafeSettings, get_settings
from celery_driftsafe.core.stored_names import TimeAuthority
from celery_driftsafe.definitions.beat_schedule import SyncReport, sync_beat_schedule
from celery_driftsafe.definitions.changes import BackgroundUnscheduled
from celery_driftsafe.exceptions import BrokerUnavailable, ClockError
from celery_driftsafe.ledger import retention
from celery_driftsafe.monitoring import metrics
from celery_driftsafe.publish.beat_entries import BeatEntries, RunEntry
from celery_driftsafe.publish.dispatcher import Dispatcher
from celery_driftsafe.publish.prebuild import Prebuilder
from celery_driftsafe.store.clock import (
    Authority,
    AuthorityClock,
    Clock,
    Reading,
    authority_from_settings,
    configured_time_authority,
)
from celery_driftsafe.store.connections import (
    missing_schema,
    read_committed_connections,
    refresh_between_rounds,
    rolled_back,
)
from celery_driftsafe.store.redis import eviction_risk

logger = logging.getLogger("celery_driftsafe.scheduler")

#: Errors that mean the database or the time authority is away: the beat waits them out.
OUTAGE_ERRORS = (DatabaseError, InterfaceError, ClockError, BrokerUnavailable)
#: A round's authority reading this far from the clock's estimate: the authority's clock
#: stepped (or this host was suspended), and the beat measures again at once.
STEP_SECONDS = 5.0


class Unreachable(NamedTuple):
    """What a round's outage error says is out of reach: its words for the log (``the
    broker``, ``the database``, ``the time authority (redis)``) and its ``dependency`` label
    of :func:`~celery_driftsafe.monitoring.metrics.dependency_up`."""

    words: str
    dependency: str


def outage_of(exc: BaseException, authority: str) -> Unreachable:
    """What is out of reach for ``exc``: the broker, the database (the time authority too,
    where it is the database) or the time authority named ``authority``."""
    if isinstance(exc, BrokerUnavailable):
        return Unreachable("the broker", "broker")
    if isinstance(exc, ClockError) and authority != "database":
        return Unreachable(
            f"the time authority ({authority})", "redis" if authority == "redis" else "database"
        )
    return Unreachable("the database", "database")


def outage_text(exc: BaseException, authority: str = "database") -> str:
    """Why the beat waits, for its log: what is out of reach and what that stops. Tables or
    columns that are not there (a beat started before ``migrate``, or an upgrade not migrated
    yet) are named as such, not taken for a database out of reach. The beat waits either way,
    and goes on once they are there."""
    if isinstance(exc, BrokerUnavailable):
        return f"the broker is unreachable ({exc}); slots due meanwhile meet the misfire policy"
    return missing_schema(exc) or (
        f"{outage_of(exc, authority).words} is unreachable ({exc}): no slot is claimed or "
        "published until it answers, and slots due meanwhile meet the misfire policy"
    )


#: Shortest wait when something looks due but this beat could not claim it (another beat
#: holds the row), so a beat never spins.
MIN_WAIT = 0.01
#: Messages are built ahead (publish/prebuild.py) only when the next slot is at least this far off,
#: for at most half the wait and at most PREBUILD_BUDGET seconds a round; while a pass is
#: unfinished the round's wait is cut to the time it built (half the time building).
PREBUILD_MIN_WAIT = 0.1
PREBUILD_BUDGET = 0.2
#: Rounds in a row that the database may roll back for a concurrent transaction (a deadlock,
#: a serialization failure) and that are run again at once; one more is an outage.
ROLLED_BACK_ROUNDS = 3
#: A beat whose rounds stop for longer than this (or three loop intervals) starts a new stretch
#: of claiming: slots that fell due meanwhile were missed, not late (see misfire).
CONTINUITY_GAP_SECONDS = 5.0
#: The "beats are saturated" warning is repeated at most this often.
SATURATION_LOG_SECONDS = 30.0


#: The node id a lazy scheduler announced, with its process: ``celery beat`` prints its banner
#: from a lazy scheduler (never set up), then makes the one that runs, which takes this id.
_announced: tuple[int, str] | None = None
_announcing = threading.Lock()


def _node_id(*, lazy: bool) -> str:
    """A new scheduler's node id. A lazy one (Celery's banner) makes one and announces it; the
    next scheduler this process sets up takes the announced id, once, so the banner names the
    node that registers; any other gets a new one."""
    global _announced
    with _announcing:
        if lazy:
            _announced = (os.getpid(), nodes.new_node_id())
            return _announced[1]
        announced, _announced = _announced, None
    if announced is not None and announced[0] == os.getpid():
        return announced[1]
    return nodes.new_node_id()


class DriftSafeScheduler(Scheduler):
    """The drift-safe beat scheduler (see the module docstring)."""

    def __init__(
        self,
        app: Any,
        *args: Any,
        clock: Clock | None = None,
        authority: Authority | None = None,
        using: str = "default",
        install_signal_handlers: bool = True,
        **kwargs: Any,
    ) -> None:
        self._clock_override = clock
        self._authority_override = authority
        self.using = using
        self._install_signals = install_signal_handlers
        self._shutdown = threading.Event()
        self._wake = Wakeup()
        #: Set by the signal handler (a plain attribute: a handler must take no lock).
        self._terminating: int | None = None
        self._in_round = False
        self._ready = False
        self._closed = False
        self._listener: threading.Thread | None = None
        self.node_id = _node_id(lazy=bool(kwargs.get("lazy")))
        self.rounds = 0
        #: Celery's own bound on the loop's wait where one is given: ``celery beat
        #: --max-interval``, else ``beat_max_loop_interval`` (Celery's default, 0: none).
        self._celery_max_interval = float(
            kwargs.get("max_interval") or app.conf.beat_max_loop_interval or 0
        )
        super().__init__(app, *args, **kwargs)

    # -- set-up and shut-down -------------------------------------------------------------

    def setup_schedule(self) -> None:
        # First, so a SIGTERM from here on is ours: it lets the set-up finish (and the node
        # register), and the first tick then stops, recording the node stopped.
        self._install_signal_handlers()
        ensure_django()
        read_committed_connections()
        checks.refuse_bad_configuration(self.node_id)
        self.settings: DriftSafeSettings = get_settings()
        self.authority = self._authority_override or authority_from_settings(
            self.settings, using=self.using
        )
        self.clock: Clock = self._clock_override or AuthorityClock(
            self.authority,
            samples=self.settings.clock_sync_samples,
            resync_seconds=self.settings.clock_sync_interval_seconds,
        )
        self.claimer: Claimer = claimer_for(self.using, self.settings)
        self.dispatcher = Dispatcher(self.app, self.clock, using=self.using)
        self.dispatcher.entries = self._entries = BeatEntries(self)
        self.pruner = retention.BackgroundPruner(using=self.using, monotonic=self.clock.monotonic)
        self.unscheduled = BackgroundUnscheduled(using=self.using, monotonic=self.clock.monotonic)
        self.reconciler = BackgroundReconciler(
            app=self.app, using=self.using, monotonic=self.clock.monotonic
        )
        self.deadlines = BackgroundDeadlines(using=self.using, monotonic=self.clock.monotonic)
        self._paused_reason = ""
        self._clock_watch = (
            nodes.ClockWatch(self.clock, self.authority.name, self.settings, self.node_id)
            if isinstance(self.clock, AuthorityClock)
            else None
        )
        self._outage: str | None = None
        #: While the database (or time authority, or broker) is out of reach: what, since when
        #: and when it was last said (monotonic).
        self._outage_since = self._outage_said = 0.0
        self._outage_of: Unreachable | None = None
        self._redis = RedisHealth()
        self._backoff = 0.0
        self._rolled_back_rounds = 0  # in a row
        self._next_heartbeat = 0.0
        self._next_recovery = 0.0
        #: Since when (authority time) this beat has been claiming without a break, and when
        #: (monotonic) its last round ended; see :meth:`_note_continuity`.
        self._claiming_since: datetime | None = None
        self._last_round_end: float | None = None
        self._others_since: datetime | None = None
        self._lag: float | None = None
        self._saturation_logged = -math.inf
        #: While a wave is worked through, the next batch is claimed ahead.
        self._prefetcher = Prefetcher(
            self.using,
            self.node_id,
            use_process=self.settings.claim_process,
            monotonic=self.clock.monotonic,
        )
        self._heap = HeapKeeper(time.monotonic)
        widen_young_generation()
        #: While nothing is due, the messages of the tasks due soonest are built ahead.
        self._prebuilder = Prebuilder(
            self.dispatcher.fast,
            partial(run_expiry, settings=self.settings),
            using=self.using,
            monotonic=self.clock.monotonic,
        )
        report = self._start_up()
        logger.info(
            "driftsafe node %s up (authority %s): beat_schedule %d created, %d updated, "
            "%d unchanged, %d rejected, %d removed",
            self.node_id,
            self.authority.name,
            len(report.created),
            len(report.updated),
            len(report.unchanged),
            len(report.errors),
            len(report.removed),
            extra={"action": "start", "node": self.node_id},
        )
        if self._authority_override is None and (
            self.settings.time_authority == TimeAuthority.AUTO and self.authority.name == "local"
        ):
            logger.warning(
                "driftsafe node %s: TIME_AUTHORITY 'auto' is this machine's clock (the database "
                "is SQLite and REDIS_URL is not set), so run every beat on this machine; for "
                "beats on several machines set REDIS_URL or use PostgreSQL or MySQL",
                self.node_id,
                extra={"action": "local-authority", "node": self.node_id},
            )
        if risk := eviction_risk(self.settings):
            logger.warning("%s", risk, extra={"action": "redis-eviction", "node": self.node_id})
        self._listener = self._start_listener()
        self._ready = True

    def _start_listener(self) -> threading.Thread | None:  # a test's stepped beat has none
        return start_change_listener(
            self.settings, self._wake, self._shutdown, self._redis, loop_seconds=self.max_interval
        )

    def apply_async(
        self, entry: Any, producer: Any = None, advance: bool = True, **kwargs: Any
    ) -> Any:
        """Celery's; a claimed run handed to ``apply_entry`` (:class:`RunEntry`, where code
        wraps it) is published as its entry's options now say."""
        if isinstance(entry, RunEntry):
            return entry.send()
        return super().apply_async(entry, producer, advance, **kwargs)

    def sync(self) -> None:
        """Nothing to persist: every claim is committed when made."""

    @property
    def info(self) -> str:
        """The lines of Celery's start-up banner about this beat. Celery prints the banner
        from a lazy scheduler of its own, never set up: the node id shown is the one the
        scheduler that runs takes (see :func:`_node_id`)."""
        settings = get_settings()
        return (
            f"    . driftsafe node -> {self.node_id}\n"
            f"    . time authority -> {self._authority_shown(settings)}"
        )

    @property
    def max_interval(self) -> float:
        """The loop's longest wait (Celery's banner shows it as ``maxinterval``): Celery's
        own ``--max-interval`` or ``beat_max_loop_interval`` where set, else
        :data:`celery_driftsafe.conf.MAX_LOOP_INTERVAL_SECONDS` (1 s, not Celery's 300 s:
        without Redis an edit reaches a beat at its next look)."""
        return self._celery_max_interval or float(get_settings().max_loop_interval_seconds)

    @max_interval.setter
    def max_interval(self, value: float) -> None:
        """Celery's ``Scheduler.__init__`` sets the value it chose from the same sources (or
        the getter's): the getter reads them itself, so the default stays read on access."""

    def _authority_shown(self, settings: DriftSafeSettings) -> str:
        """The banner's time authority: what ``auto`` resolves to, when it can be told yet."""
        if settings.time_authority != TimeAuthority.AUTO:
            return str(settings.time_authority)
        try:
            return f"{configured_time_authority(settings, using=self.using)} (auto)"
        except Exception:  # the banner comes before start-up, which reports any failure
            return "auto"

    # -- the loop ---------------------------------------------------------------------------

    def tick(self, *args: Any, **kwargs: Any) -> float:
        """One round, then the wait until the next slot; always returns 0 (it waited).

        A stop (a signal, or :meth:`close`) raises ``SystemExit`` here, never inside a round:
        before it, after it, or out of the wait, which a signal cuts short."""
        if self._stopping():
            raise SystemExit()
        self._in_round = True
        try:
            wait = self._guarded_round()
        finally:
            self._in_round = False
        if self._stopping():
            raise SystemExit()
        if wait > 0:
            self._wake.wait(wait)
            self._wake.clear()
        if self._stopping():
            raise SystemExit()
        return 0.0

    def _guarded_round(self) -> float:
        """A round with outage handling: one log line per state change, backoff with jitter."""
        try:
            refresh_between_rounds(self.using)
            wait = self.run_round()
        except OUTAGE_ERRORS as exc:
            if rolled_back(exc) and self._rolled_back_rounds < ROLLED_BACK_ROUNDS:
                # A deadlock or serialization failure: its transaction changed nothing, and
                # the database is there. Run the round again now rather than wait it out.
                self._rolled_back_rounds += 1
                logger.warning(
                    "claim round rolled back for a concurrent transaction (%s); running it again",
                    str(exc).splitlines()[0],
                    extra={"action": "rolled-back", "node": self.node_id},
                )
                return 0.0
            self._note_outage(exc)
            connections[self.using].close()
            return self._back_off()
        except Exception as exc:
            # Not an outage and not one row (the claim isolates rows): a bug or something
            # unforeseen. The beat must not exit over it: log it once, back off, try again.
            if self._outage != repr(exc):
                logger.exception(
                    "claim round failed unexpectedly; retrying with backoff",
                    extra={"action": "round-error", "node": self.node_id},
                )
            self._outage, self._outage_of = repr(exc), None
            connections[self.using].close()
            return self._back_off()
        self._rolled_back_rounds = 0
        self._note_recovered()
        return wait

    def _note_recovered(self) -> None:
        """After an outage or an unexpected error: one line saying what answers again."""
        if self._outage is not None:
            if self._outage_of is not None:
                logger.warning(
                    "claiming resumed: %s answers again after %.0f s (%s)",
                    self._outage_of.words,
                    self.clock.monotonic() - self._outage_since,
                    self._outage,
                    extra={"action": "recovered", "node": self.node_id},
                )
                metrics.dependency_up(self._outage_of.dependency, True)
            else:
                logger.warning(
                    "claiming resumed after an unexpected error (%s)",
                    self._outage,
                    extra={"action": "recovered", "node": self.node_id},
                )
            self._outage, self._outage_of = None, None
            self._backoff = 0.0

    def _note_outage(self, exc: BaseException, waiting: str = "claiming paused") -> None:
        """A round met a dependency out of reach: say so at ERROR when it starts, and at
        least every :data:`OUTAGE_REPEAT_SECONDS` while it lasts, naming it, for how long and
        what that stops; set its metric."""
        now = self.clock.monotonic()
        of = outage_of(exc, self.authority.name)
        if self._outage is None or of != self._outage_of:
            self._outage_since = now
        elif now - self._outage_said < OUTAGE_REPEAT_SECONDS:
            self._outage = str(exc)
            return
        lasting = now - self._outage_since
        logger.error(
            "%s%s, %s; retrying with backoff",
            waiting,
            f" for {lasting:.0f} s" if lasting >= 1 else "",
            outage_text(exc, self.authority.name),
            extra={"action": "outage", "node": self.node_id},
        )
        metrics.dependency_up(of.dependency, False)
        self._outage, self._outage_of, self._outage_said = str(exc), of, now

    def _back_off(self) -> float:
        self._backoff = min(max(self._backoff * 2, 0.5), 30.0)
        return self._backoff * random.uniform(0.5, 1.0)

    def run_round(self) -> float:
        """Claim and publish what is due; return the seconds to wait before the next round."""
        self.rounds += 1
        self._heap.maybe_freeze()
        mono = self.clock.monotonic()
        if self._note_continuity(mono):
            self._next_heartbeat = 0.0  # learn afresh what the other nodes did meanwhile
        if mono >= self._next_heartbeat:
            self._heartbeat()
            self._next_heartbeat = mono + self.settings.heartbeat_interval_seconds
        if self._paused_reason:
            self._prefetcher.drain(self.dispatcher.dispatch)  # claimed before the pause
            return self.max_interval
        reading = Reading(self.authority.read(), self.clock.monotonic())
        self._follow_authority(reading.at)
        if self._claiming_since is None:
            self._claiming_since = reading.at
        self.dispatcher.check_broker()  # after a failed publish: nothing more claimed until back
        if mono >= self._next_recovery:
            recover(reading.at, self.node_id, self.settings, self.dispatcher, using=self.using)
            self._next_recovery = mono + min(self.settings.lease_seconds / 2, 5.0)
        self.reconciler.maybe_start(reading.at)  # in its own thread, when due
        self.unscheduled.maybe_start(reading.at)  # tasks written without save(), likewise
        self.deadlines.maybe_start(reading.at)  # late runs and stale tasks, likewise
        busy_since = self._claiming_since
        if self._others_since is not None and self._others_since < busy_since:
            busy_since = self._others_since
        result = self._prefetcher.take()
        if result is None:
            result = self.claimer.claim(reading.at, self.node_id, busy_since=busy_since)
        full = result.tasks_seen >= getattr(self.claimer, "batch_size", 0)
        if full and self._prefetcher.available and not self._shutdown.is_set():
            # More is due: claim the next batch while this one is published.
            self._prefetcher.claim_ahead(
                self.claimer.claim,
                reading.at,
                self.node_id,
                busy_since,
                partial(self._claim_process_room, reading.at),
            )
        if self.dispatcher.dispatch(result.runs).deferred:
            raise BrokerUnavailable(self.dispatcher.broker_down or "publishing failed")
        self._log_round(result, reading.at)
        self._last_round_end = metrics.round_done(result, reading.at, mono, self.clock.monotonic())
        if full or self._prefetcher.pending:
            return 0.0  # a full batch (more may be due right now), or batches claimed ahead
        self.pruner.maybe_start(reading.at)  # low priority: in its own thread, when due
        self._prefetcher.rest()  # a claim process idle since its last wave ends
        wait = self._wait_after(reading, claimed=bool(result.tasks_seen))
        # Where runs go through a wrapped apply_entry, Celery's own path publishes them: no
        # message of the fast path is worth building ahead.
        if wait >= PREBUILD_MIN_WAIT and not self._entries.wrapped():
            started = self.clock.monotonic()
            try:
                if self._prebuilder.run(reading.at, min(wait / 2, PREBUILD_BUDGET)):
                    self._heap.maybe_freeze(check_now=True)  # before the wave, not in it
            except Exception as exc:  # an outage, a row it cannot read: the claim reports it
                logger.debug("not building messages ahead: %s", exc)
            spent = self.clock.monotonic() - started
            wait = max(wait - spent, 0.0)
            if self._prebuilder.pending:
                wait = min(wait, max(spent, PREBUILD_MIN_WAIT / 2))  # more to build: come back
        # Slots due a few ms apart wait for one round together (MIN_ROUND_INTERVAL_SECONDS).
        spacing = self.settings.min_round_interval_seconds - (self.clock.monotonic() - mono)
        return max(wait, spacing)

    def _claim_process_room(self, now: datetime) -> str | None:
        """Why this beat's machine cannot spare its claim process a core (None: it can),
        counting the live beats on it; asked when a helper is to be started (the first wave,
        and the first after a lost helper's wait)."""
        host = socket.gethostname()
        dead_after = timedelta(seconds=self.settings.node_dead_after_seconds)
        here = sum(node.hostname == host for node in nodes.alive(now, dead_after, using=self.using))
        return spare_cores(here)

    def _note_continuity(self, mono: float) -> bool:
        """Whether this beat's claiming was broken since its last round (it was paused, the
        database was away, a round failed): then it starts a new stretch. Between two rounds of
        a working beat lies at most :attr:`max_interval`."""
        if self._last_round_end is None:
            return self._claiming_since is None
        gap = mono - self._last_round_end
        if gap <= max(3 * self.max_interval, CONTINUITY_GAP_SECONDS):
            return False
        self._claiming_since = None
        self._last_round_end = None
        return True

    def _wait_after(self, reading: Reading, *, claimed: bool) -> float:
        next_due = self.next_due()
        cap = self.max_interval
        if next_due is None:
            return cap
        wait = (next_due - reading.now(self.clock.monotonic())).total_seconds()
        if wait <= 0:
            # Due, but not ours to claim (another beat holds it) or just became due.
            return 0.0 if claimed else MIN_WAIT
        return min(wait, cap)

    def next_due(self) -> datetime | None:
        """When the earliest unclaimed slot of any enabled task is due (its jittered instant)."""
        return next_due(self.using)

    def _log_round(self, result: ClaimResult, now: datetime) -> None:
        if result.runs or result.missed or result.disabled:
            logger.info(
                "claimed %d runs (%d missed, %d tasks disabled)",
                len(result.runs),
                result.missed,
                len(result.disabled),
                extra={"action": "claim", "node": self.node_id},
            )
        if result.oldest_slot is None:
            if not result.tasks_seen and self._lag is None:
                self._lag = 0.0  # nothing was due: not behind
            return
        lag = (now - result.oldest_slot).total_seconds()
        self._lag = max(lag, self._lag or 0.0)
        grace = self.settings.misfire_grace_seconds
        mono = self.clock.monotonic()
        if lag > grace and mono - self._saturation_logged >= SATURATION_LOG_SECONDS:
            self._saturation_logged = mono
            logger.warning(
                "the beats are saturated: this round fired slots %.1f s after they fell due "
                "(misfire grace %g s); %d fired late instead of missed, %d recorded missed. "
                "Add beats or spread the schedule",
                lag,
                grace,
                result.late_from_load,
                result.missed,
                extra={"action": "saturated", "node": self.node_id},
            )

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
                report = sync_beat_schedule(self.app, now=self.authority.read(), using=self.using)
                self._note_recovered()
                for dependency in ("database", "broker"):
                    metrics.dependency_up(dependency, True)
                return report
            except OUTAGE_ERRORS as exc:
                self._note_outage(exc, "start-up waiting")
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
            self.deadlines.close()
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
        """Re-measure the offset when due or stepped; warn past the soft bound, pause past the
        hard one, each once a crossing (:class:`~celery_driftsafe.beat.nodes.ClockWatch`)."""
        if self._clock_watch is not None:
            self._paused_reason = self._clock_watch.check()

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

    def _redis_failing(self, now: datetime) -> tuple[datetime, str] | None:
        """Since when (authority time, from ``now``) this beat's Redis has not answered its
        change listener, and why; None while it answers."""
        failing = self._redis.failing
        if failing is None:
            return None
        since, error = failing
        return now - timedelta(seconds=max(time.monotonic() - since, 0.0)), error

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
            redis_failing=self._redis_failing(now),
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
