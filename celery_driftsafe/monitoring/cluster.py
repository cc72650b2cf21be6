"""What the database says about the cluster, read cheaply: the backlog, the nodes, recent runs
and what fires next. Read by the metrics view (:mod:`celery_driftsafe.monitoring.views`), the
admin's
cluster dashboard (:mod:`celery_driftsafe.admin.dashboard`) and a beat's heartbeat metrics.

Every query is bounded so it stays fast on a ledger of many millions of runs: recent runs are
read per status on the ``(status, claimed_at)`` index, newest first, with a LIMIT; due tasks on
the ``(enabled, due_at)`` index (``due_at``: a slot's jittered instant, when it is due).
Time is a parameter (the authority's ``now``), never read here.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Count, Min, Q

from celery_driftsafe.models import BeatNode, PeriodicTask, Run, RunStatus

#: Open statuses: a run waiting for, or in, its execution.
OPEN_STATUSES = (
    RunStatus.CLAIMED,
    RunStatus.DISPATCHED,
    RunStatus.STARTED,
    RunStatus.RETRYING,
    RunStatus.WAITING,
)
#: Nodes that stopped longer ago than this are left out of the summaries.
STOPPED_NODES_SHOWN = timedelta(hours=1)
#: At most this many nodes are summarised.
MAX_NODES = 100
#: The models whose rows these summaries show (task names and slots, runs, nodes' hosts).
SHOWN_MODELS = (PeriodicTask, Run, BeatNode)


def may_view(user: Any) -> bool:
    """Whether ``user`` may see these summaries (the metrics view, the cluster dashboard): an
    active user allowed to view each of :data:`SHOWN_MODELS`, by the admin's rule (the view or
    the change permission). An anonymous user or None may not."""
    if user is None or not getattr(user, "is_active", False):
        return False
    for model in SHOWN_MODELS:
        label, name = model._meta.app_label, model._meta.model_name
        if not (user.has_perm(f"{label}.view_{name}") or user.has_perm(f"{label}.change_{name}")):
            return False
    return True


def backlog(now: datetime, *, using: str = "default") -> int:
    """Enabled tasks whose next slot is due at ``now`` (its jittered instant has come) and not
    claimed yet."""
    return int(PeriodicTask.objects.using(using).filter(enabled=True, due_at__lte=now).count())


def oldest_due(now: datetime, *, using: str = "default") -> datetime | None:
    """Since when the longest-waiting due, unclaimed slot has been due at ``now`` (its
    jittered instant; None: nothing is due)."""
    value: datetime | None = (
        PeriodicTask.objects.using(using)
        .filter(enabled=True, due_at__lte=now)
        .aggregate(oldest=Min("due_at"))["oldest"]
    )
    return value


def nodes_alive(now: datetime, dead_after_seconds: float, *, using: str = "default") -> int:
    """Nodes that have not stopped and sent a heartbeat within ``dead_after_seconds``."""
    return int(
        BeatNode.objects.using(using)
        .filter(
            stopped_at__isnull=True,
            last_heartbeat_at__gte=now - timedelta(seconds=dead_after_seconds),
        )
        .count()
    )


def nodes(now: datetime, *, using: str = "default", limit: int = MAX_NODES) -> list[BeatNode]:
    """The running nodes and those stopped within :data:`STOPPED_NODES_SHOWN`."""
    return list(
        BeatNode.objects.using(using)
        .filter(Q(stopped_at__isnull=True) | Q(stopped_at__gte=now - STOPPED_NODES_SHOWN))
        .order_by("hostname", "pid", "node_id")[:limit]
    )


@dataclass(frozen=True)
class RecentRun:
    """One run of the recent past, as the timeline and the lateness histogram need it."""

    pk: int
    task_name: str
    status: str
    slot: datetime | None
    claimed_by: str
    claimed_at: datetime | None
    dispatched_at: datetime | None

    @property
    def lateness(self) -> float | None:
        """Seconds from the slot to the publish (dispatch lateness), if both are known."""
        if self.slot is None or self.dispatched_at is None:
            return None
        return (self.dispatched_at - self.slot).total_seconds()


def recent_runs(since: datetime, *, limit: int = 2000, using: str = "default") -> list[RecentRun]:
    """The newest ``limit`` runs claimed since ``since``, newest first.

    Two indexed queries per status, each reading at most ``limit`` index entries: first the
    ``limit``-th newest claim of the status (no run older than that can be among the newest
    ``limit`` overall), then the runs of every status from the latest of those instants on,
    merged. So a busy hour costs about ``limit`` rows read, not ``limit`` per status."""
    table = Run.objects.using(using)
    cutoff = since
    for status in RunStatus.values:
        nth = (
            table.filter(status=status, claimed_at__gte=since)
            .order_by("-claimed_at")
            .values_list("claimed_at", flat=True)[limit - 1 : limit]
        )
        for instant in nth:
            if instant is not None and instant > cutoff:
                cutoff = instant
    fields = ("pk", "task_name", "status", "slot", "claimed_by", "claimed_at", "dispatched_at")
    rows: list[RecentRun] = []
    for status in RunStatus.values:
        query = (
            table.filter(status=status, claimed_at__gte=cutoff)
            .order_by("-claimed_at")
            .values_list(*fields)[:limit]
        )
        rows.extend(RecentRun(*row) for row in query)
    rows.sort(key=lambda run: (run.claimed_at, run.pk), reverse=True)
    return rows[:limit]


def runs_by_status(since: datetime, *, using: str = "default") -> dict[str, int]:
    """How many runs were claimed since ``since``, by status (every status present)."""
    counts = dict.fromkeys(RunStatus.values, 0)
    query = (
        Run.objects.using(using)
        .filter(status__in=RunStatus.values, claimed_at__gte=since)
        .values_list("status")
        .annotate(n=Count("pk"))
        .order_by()
    )
    for status, n in query:
        counts[status] = int(n)
    return counts


def open_runs(*, using: str = "default") -> dict[str, int]:
    """How many runs wait for or are in their execution, by status."""
    counts = dict.fromkeys((str(s) for s in OPEN_STATUSES), 0)
    query = (
        Run.objects.using(using)
        .filter(status__in=OPEN_STATUSES)
        .values_list("status")
        .annotate(n=Count("pk"))
        .order_by()
    )
    for status, n in query:
        counts[status] = int(n)
    return counts


def next_fires(
    *, limit: int = 15, using: str = "default", leave_out: Sequence[int] = ()
) -> list[PeriodicTask]:
    """The enabled tasks that fire next, by when their next slot is due (its jittered
    instant; on the due index); ``leave_out``: ids of tasks not to read."""
    tasks = PeriodicTask.objects.using(using).filter(enabled=True, due_at__isnull=False)
    if leave_out:
        tasks = tasks.exclude(pk__in=leave_out)
    return list(
        tasks.order_by("due_at", "id").only(
            "id", "name", "task", "next_slot_at", "due_at", "last_slot_at", "schedule_kind"
        )[:limit]
    )


def last_slots(*, limit: int = 1000, using: str = "default") -> list[tuple[str, datetime]]:
    """(name, last fired slot) of up to ``limit`` enabled tasks that fired, by name."""
    rows = (
        PeriodicTask.objects.using(using)
        .filter(enabled=True, last_slot_at__isnull=False)
        .order_by("name")
        .values_list("name", "last_slot_at")[:limit]
    )
    return [(name, slot) for name, slot in rows if slot is not None]


@dataclass(frozen=True)
class Bucket:
    """One bar of a histogram: values in ``[low, high)`` (``high`` None: no upper bound),
    labelled by its upper bound (``<25ms``; the open last one ``≥30s``)."""

    low: float
    high: float | None
    count: int

    @property
    def label(self) -> str:
        def text(value: float) -> str:
            return f"{value * 1000:g}ms" if value < 1 else f"{value:g}s"

        if self.high is None:
            return f"≥{text(self.low)}"
        return f"<{text(self.high)}"


#: Edges of the dashboard's lateness histogram, in seconds.
LATENESS_EDGES = (0.0, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 30.0)


def histogram(values: Sequence[float], edges: Sequence[float] = LATENESS_EDGES) -> list[Bucket]:
    """Counts of ``values`` between consecutive ``edges``; below the first edge counts in the
    first bucket, from the last edge on in an open last bucket."""
    counts = [0] * len(edges)
    for value in values:
        index = max(bisect.bisect_right(edges, value) - 1, 0)
        counts[index] += 1
    return [
        Bucket(edges[i], edges[i + 1] if i + 1 < len(edges) else None, counts[i])
        for i in range(len(edges))
    ]


def quantile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (nearest rank) of ``values``, None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = math.ceil(q * len(ordered))  # nearest rank, 1-based
    return ordered[min(max(rank, 1), len(ordered)) - 1]
