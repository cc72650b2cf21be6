"""Prometheus metrics of beats and workers (the optional ``metrics`` extra: prometheus-client).

Metrics are on in a process when ``METRICS_PORT`` (beats) or ``WORKER_METRICS_PORT`` (workers)
is set. Then the hooks below, called from the claim round, the dispatcher, the heartbeat and a
run's execution, count into prometheus-client's default registry; a beat serves it on
``METRICS_PORT``, a worker's main process on ``WORKER_METRICS_PORT``
(:mod:`celery_driftsafe.monitoring.metrics_server`). With both unset every
hook returns after one look at the cached settings, and prometheus-client is never imported.

Workers: a prefork pool runs bodies in child processes, whose counters the main process cannot
see in memory. Set ``PROMETHEUS_MULTIPROC_DIR`` (prometheus-client's multiprocess mode: each
process writes its counters to files there, the main process sums them when scraped). The
other pools (``threads``, ``solo``, ``gevent``, ``eventlet``) run bodies in the main process
and need nothing else. Worker metrics are all counters, which the multiprocess mode sums.

The figures the database holds (backlog, last slot per task, node liveness and offsets, runs by
status) are served by a Django view, :mod:`celery_driftsafe.monitoring.views`, so they outlive any
beat.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Mapping, Sized
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Protocol

from celery_driftsafe.conf import DriftSafeSettings, get_settings
from celery_driftsafe.exceptions import ConfigurationError

if TYPE_CHECKING:
    from celery_driftsafe.store.clock import OffsetSample

#: What to install when metrics are switched on without prometheus-client.
EXTRA_HINT = "pip install 'celery-driftsafe[metrics]'"
#: Buckets of the dispatch lateness histogram (seconds after the slot).
LATENESS_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
)
#: Buckets of the round duration histogram (seconds).
ROUND_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
#: Outcomes counted by ``driftsafe_worker_executions_total``.
OUTCOMES = ("succeeded", "failed", "retrying", "skipped", "waiting", "expired")


def prometheus_missing() -> str | None:
    """Why prometheus-client cannot be used (None when it can)."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError as exc:
        return f"prometheus-client is not installed ({exc}): {EXTRA_HINT}"
    return None


def enabled(settings: DriftSafeSettings | None = None) -> bool:
    """Whether this process records metrics (either port is set)."""
    settings = settings or get_settings()
    return settings.metrics_port is not None or settings.worker_metrics_port is not None


@dataclass(frozen=True)
class BeatMetrics:
    claimed: Any
    published: Any
    missed: Any
    failed: Any
    deferred: Any
    lateness: Any
    round_duration: Any
    clock_offset: Any
    clock_error: Any
    backlog: Any
    nodes_alive: Any
    last_round: Any
    paused: Any
    reconciled: Any
    deadlines_missed: Any
    became_stale: Any
    dependency_up: Any


@dataclass(frozen=True)
class WorkerMetrics:
    executions: Any
    duplicates: Any
    fenced_out: Any
    lock_errors: Any


_lock = threading.Lock()
_beat: BeatMetrics | None = None
_worker: WorkerMetrics | None = None
#: ``driftsafe_tasks_paused_total``: counted by beats and workers alike (whichever recorded
#: the outcome that paused the task), so it is made once per process, apart from both.
_paused: Any = None


def import_prometheus() -> Any:
    """prometheus-client, or a ConfigurationError naming ``METRICS_PORT`` and the extra."""
    try:
        import prometheus_client
    except ImportError as exc:
        raise ConfigurationError(
            "METRICS_PORT",
            get_settings().metrics_port,
            f"metrics are switched on but prometheus-client is not installed ({exc})",
            EXTRA_HINT,
        ) from exc
    return prometheus_client


def _gauge(pc: Any, name: str, text: str) -> Any:
    # One beat per process: in multiprocess mode (a worker's environment shared with a beat)
    # the latest value of the live process is the one that counts.
    return pc.Gauge(name, text, multiprocess_mode="livemostrecent")


def beat_metrics() -> BeatMetrics | None:
    """The beat's metrics (created on first use), or None when metrics are off."""
    global _beat
    if not enabled():
        return None
    if _beat is not None:
        return _beat
    with _lock:
        if _beat is None:
            pc = import_prometheus()
            _beat = BeatMetrics(
                claimed=pc.Counter(
                    "driftsafe_beat_slots_claimed", "Slots this beat claimed to fire"
                ),
                published=pc.Counter(
                    "driftsafe_beat_slots_published",
                    "Runs this beat published (outbox re-publishes included)",
                ),
                missed=pc.Counter(
                    "driftsafe_beat_slots_missed",
                    "Slots this beat recorded missed (fell due while no beat was claiming, or "
                    "past the misfire grace)",
                ),
                failed=pc.Counter(
                    "driftsafe_beat_slots_failed",
                    "Runs that failed before they could be published (refused "
                    "too often, arguments not fitting, expired)",
                ),
                deferred=pc.Counter(
                    "driftsafe_beat_publish_deferred",
                    "Runs left for a later publish (broker unreachable or "
                    "refusing): retried, not lost",
                ),
                lateness=pc.Histogram(
                    "driftsafe_beat_dispatch_lateness_seconds",
                    "Seconds from a slot to its publish, on the authority's clock",
                    buckets=LATENESS_BUCKETS,
                ),
                round_duration=pc.Histogram(
                    "driftsafe_beat_round_duration_seconds",
                    "Seconds one claim round took (claim, publish, mark)",
                    buckets=ROUND_BUCKETS,
                ),
                clock_offset=_gauge(
                    pc,
                    "driftsafe_beat_clock_offset_seconds",
                    "The time authority's clock minus this node's wall clock "
                    "(positive: this node is behind)",
                ),
                clock_error=_gauge(
                    pc,
                    "driftsafe_beat_clock_error_bound_seconds",
                    "Error bound of the offset measurement (half a round trip)",
                ),
                backlog=_gauge(
                    pc,
                    "driftsafe_beat_backlog_slots",
                    "Enabled tasks whose next slot is due and not claimed yet",
                ),
                nodes_alive=_gauge(
                    pc,
                    "driftsafe_beat_nodes_alive",
                    "Beat nodes with a recent heartbeat, as this beat sees them",
                ),
                last_round=_gauge(
                    pc,
                    "driftsafe_beat_last_round_timestamp_seconds",
                    "When this beat last finished a claim round (authority time, Unix seconds)",
                ),
                paused=_gauge(
                    pc,
                    "driftsafe_beat_claiming_paused",
                    "1 while this beat's claiming is paused (clock off past "
                    "HARD_CLOCK_OFFSET_SECONDS)",
                ),
                reconciled=pc.Counter(
                    "driftsafe_beat_runs_reconciled",
                    "Runs this beat's reconciliation gave an outcome: expired, worker_lost, "
                    "replaced, or the result backend's (succeeded, failed, revoked)",
                    ["outcome"],
                ),
                deadlines_missed=pc.Counter(
                    "driftsafe_beat_deadlines_missed",
                    "Scheduled runs this beat found late: not succeeded by their slot plus "
                    "their task's deadline_seconds (each late run is counted by one beat)",
                    ["task"],
                ),
                became_stale=pc.Counter(
                    "driftsafe_beat_tasks_became_stale",
                    "Tasks this beat found stale: none of their last STALE_AFTER_SLOTS slots past "
                    "their deadline succeeded (counted once each time a task becomes stale)",
                    ["task"],
                ),
                dependency_up=pc.Gauge(
                    "driftsafe_beat_dependency_up",
                    "1 while this beat reaches the dependency, 0 while it does not: database "
                    "(with the time authority), broker, redis (REDIS_URL, when set)",
                    ["dependency"],
                    multiprocess_mode="livemostrecent",
                ),
            )
    return _beat


def worker_metrics() -> WorkerMetrics | None:
    """The worker's metrics (created on first use), or None when metrics are off."""
    global _worker
    if not enabled():
        return None
    if _worker is not None:
        return _worker
    with _lock:
        if _worker is None:
            pc = import_prometheus()
            _worker = WorkerMetrics(
                executions=pc.Counter(
                    "driftsafe_worker_executions",
                    "Deliveries of runs that ended with an outcome: "
                    "succeeded, failed, retrying (the body ran), skipped, "
                    "expired (it did not)",
                    ["task", "outcome"],
                ),
                duplicates=pc.Counter(
                    "driftsafe_worker_duplicates_suppressed",
                    "Deliveries dropped as duplicates of a run that started or finished elsewhere",
                    ["task"],
                ),
                fenced_out=pc.Counter(
                    "driftsafe_worker_fenced_out",
                    "Outcomes (or retries) refused because a newer holder took the run over",
                    ["task"],
                ),
                lock_errors=pc.Counter(
                    "driftsafe_worker_lock_errors",
                    "Deliveries that found the lock backend unreachable",
                    ["task"],
                ),
            )
    return _worker


# -- what the hooks read of their callers' results -----------------------------------------------
# Monitoring is a sink: it imports nothing of the claim, the publishing or the worker, so the
# hooks name what they read of the results they are given as protocols.


class ClaimFigures(Protocol):
    """What :func:`round_done` reads of a claim round's result
    (:class:`~celery_driftsafe.claim.claimers.ClaimResult`)."""

    @property
    def runs(self) -> Sized: ...
    @property
    def missed(self) -> int: ...


class SlottedRun(Protocol):
    """A claimed run's slot (:class:`~celery_driftsafe.claim.outbox.ClaimedRun`)."""

    @property
    def slot(self) -> datetime | None: ...


class DispatchFigures(Protocol):
    """What :func:`dispatched` reads of a dispatch's result
    (:class:`~celery_driftsafe.publish.dispatcher.DispatchResult`)."""

    @property
    def published(self) -> Collection[int]: ...
    @property
    def failed(self) -> Sized: ...
    @property
    def expired(self) -> Sized: ...
    @property
    def deferred(self) -> Sized: ...
    @property
    def refused(self) -> Sized: ...


# -- beat hooks (each a no-op with metrics off) -------------------------------------------------


def round_done(result: ClaimFigures, now: datetime, began: float, ended: float) -> float:
    """A claim round read the authority at ``now`` and ran from ``began`` to ``ended`` (local
    monotonic seconds): what it claimed and missed, how long it took. Returns ``ended``."""
    m = beat_metrics()
    if m is None:
        return ended
    m.claimed.inc(len(result.runs))
    m.missed.inc(result.missed)
    m.round_duration.observe(max(ended - began, 0.0))
    m.last_round.set(now.timestamp())
    return ended


def dispatched(result: DispatchFigures, runs: Mapping[int, SlottedRun], now: datetime) -> None:
    """A dispatch ended at ``now``: published runs and their lateness, failures, deferrals."""
    m = beat_metrics()
    if m is None:
        return
    m.published.inc(len(result.published))
    m.failed.inc(len(result.failed) + len(result.expired))
    m.deferred.inc(len(result.deferred) + len(result.refused))
    for run_id in result.published:
        slot = runs[run_id].slot if run_id in runs else None
        if slot is not None:
            m.lateness.observe(max((now - slot).total_seconds(), 0.0))


def reconciled(outcomes: Mapping[str, int]) -> None:
    """A reconciliation pass ended: how many runs it gave each outcome."""
    m = beat_metrics()
    if m is not None:
        for outcome, count in outcomes.items():
            m.reconciled.labels(outcome=outcome).inc(count)


def deadline_missed(task: str) -> None:
    """A beat flagged a run of the periodic task named ``task`` late."""
    m = beat_metrics()
    if m is not None:
        m.deadlines_missed.labels(task=task).inc()


def became_stale(task: str) -> None:
    """A beat flagged the periodic task named ``task`` stale."""
    m = beat_metrics()
    if m is not None:
        m.became_stale.labels(task=task).inc()


def heartbeat(
    sample: OffsetSample | None, now: datetime, *, paused: bool, using: str = "default"
) -> None:
    """At a beat's heartbeat: offset, claiming paused, and (two indexed counts) the backlog
    and the nodes alive."""
    m = beat_metrics()
    if m is None:
        return
    from celery_driftsafe.monitoring import cluster

    if sample is not None:
        m.clock_offset.set(sample.offset)
        m.clock_error.set(sample.error_bound)
    m.paused.set(1 if paused else 0)
    m.backlog.set(cluster.backlog(now, using=using))
    m.nodes_alive.set(cluster.nodes_alive(now, get_settings().node_dead_after_seconds, using=using))


def dependency_up(dependency: str, up: bool) -> None:
    """A beat found ``dependency`` (``database``, ``broker``, ``redis``) answering or not."""
    m = beat_metrics()
    if m is not None:
        m.dependency_up.labels(dependency=dependency).set(1 if up else 0)


# -- beat and worker hooks -----------------------------------------------------------------------


def task_paused(task: str) -> None:
    """The periodic task named ``task`` was paused after failures (by this process)."""
    global _paused
    if not enabled():
        return
    with _lock:
        if _paused is None:
            _paused = import_prometheus().Counter(
                "driftsafe_tasks_paused",
                "Tasks paused (disabled) after pause_after_failures failed or missed runs in a "
                "row, by the beat or worker that recorded the last of them (once per pause)",
                ["task"],
            )
    _paused.labels(task=task).inc()


# -- worker hooks --------------------------------------------------------------------------------


def execution(task: str, outcome: str) -> None:
    m = worker_metrics()
    if m is not None:
        m.executions.labels(task=task, outcome=outcome).inc()


def duplicate(task: str) -> None:
    m = worker_metrics()
    if m is not None:
        m.duplicates.labels(task=task).inc()


def fenced_out(task: str) -> None:
    m = worker_metrics()
    if m is not None:
        m.fenced_out.labels(task=task).inc()


def lock_error(task: str) -> None:
    m = worker_metrics()
    if m is not None:
        m.lock_errors.labels(task=task).inc()


def unix(value: datetime) -> float:
    """An aware instant as Unix seconds."""
    return value.astimezone(UTC).timestamp()
