"""The metrics view: what the database knows about the cluster, in Prometheus' text format.

Mount it with ``path("driftsafe/", include("celery_driftsafe.urls"))`` and scrape
``/driftsafe/metrics``. It is served by the web application, so it keeps answering when every
beat is down ("no live beat" is then ``driftsafe_nodes_alive == 0``). Each scrape runs a
handful of bounded, indexed queries (see :mod:`celery_driftsafe.cluster`) at one reading of
the time authority. It needs the ``metrics`` extra (prometheus-client). It holds no secrets,
but like any metrics endpoint it should not be public: restrict it where the project's other
internal URLs are restricted (or wrap :func:`metrics` in the project's own access check).
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, HttpResponse

from celery_driftsafe import cluster
from celery_driftsafe.clock import authority_clock
from celery_driftsafe.conf import get_settings
from celery_driftsafe.exceptions import ClockError
from celery_driftsafe.metrics import EXTRA_HINT, unix

#: The window of ``driftsafe_runs_recent``: short, so its count stays cheap at 10k runs a
#: minute (the beats' counters cover longer spans).
RECENT = timedelta(minutes=5)
#: At most this many tasks get a ``driftsafe_task_last_slot_timestamp_seconds`` series.
MAX_TASK_SERIES = 1000


class DatabaseCollector:
    """A prometheus-client collector of the database-derived figures at ``now``."""

    def __init__(self, now: datetime, *, using: str = "default") -> None:
        self.now = now
        self.using = using

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        now, using = self.now, self.using
        settings = get_settings()
        dead_after = timedelta(seconds=settings.node_dead_after_seconds)

        def gauge(
            name: str, text: str, value: float | None = None, labels: tuple[str, ...] = ()
        ) -> Any:
            family = GaugeMetricFamily(name, text, labels=list(labels) if labels else None)
            if value is not None:
                family.add_metric([], value)
            return family

        yield gauge(
            "driftsafe_authority_time_seconds",
            "The time authority's clock when these figures were read (Unix seconds)",
            unix(now),
        )
        yield gauge(
            "driftsafe_backlog_slots",
            "Enabled tasks whose next slot is due and not claimed yet",
            cluster.backlog(now, using=using),
        )
        oldest = cluster.oldest_due(now, using=using)
        yield gauge(
            "driftsafe_oldest_due_age_seconds",
            "How long the oldest due, unclaimed slot has been due (0: none is due)",
            (now - oldest).total_seconds() if oldest is not None else 0.0,
        )
        alive = 0
        labels = ("node", "hostname")
        up = gauge(
            "driftsafe_node_up",
            "1 for a beat node that heartbeats, 0 for one that "
            "is dead or stopped (stopped within the last hour)",
            labels=labels,
        )
        offset = gauge(
            "driftsafe_node_clock_offset_seconds",
            "A node's measured clock offset (authority minus its wall clock)",
            labels=labels,
        )
        age = gauge(
            "driftsafe_node_heartbeat_age_seconds",
            "Seconds since a node's last heartbeat",
            labels=labels,
        )
        lag = gauge(
            "driftsafe_node_lag_seconds",
            "How late after their slots a node's recent rounds fired",
            labels=labels,
        )
        paused = gauge(
            "driftsafe_node_claiming_paused", "1 while a node's claiming is paused", labels=labels
        )
        for node in cluster.nodes(now, using=using):
            values = [node.node_id, node.hostname]
            state = node.state_at(now, dead_after)
            alive += state == "alive"
            up.add_metric(values, 1.0 if state == "alive" else 0.0)
            age.add_metric(values, (now - node.last_heartbeat_at).total_seconds())
            paused.add_metric(values, 1.0 if node.claiming_paused_reason else 0.0)
            if node.clock_offset_seconds is not None:
                offset.add_metric(values, node.clock_offset_seconds)
            if node.lag_seconds is not None:
                lag.add_metric(values, node.lag_seconds)
        yield gauge("driftsafe_nodes_alive", "Beat nodes with a recent heartbeat", alive)
        yield from (up, offset, age, lag, paused)
        last = gauge(
            "driftsafe_task_last_slot_timestamp_seconds",
            f"The last slot each enabled task fired (Unix seconds; the first "
            f"{MAX_TASK_SERIES} tasks by name)",
            labels=("task",),
        )
        for name, slot in cluster.last_slots(limit=MAX_TASK_SERIES, using=using):
            last.add_metric([name], unix(slot))
        yield last
        recent = gauge(
            "driftsafe_runs_recent",
            "Runs claimed in the last 5 minutes, by status",
            labels=("status",),
        )
        for status, count in cluster.runs_by_status(now - RECENT, using=using).items():
            recent.add_metric([status], count)
        yield recent
        pending = gauge(
            "driftsafe_runs_open",
            "Runs waiting for or in their execution, by status",
            labels=("status",),
        )
        for status, count in cluster.open_runs(using=using).items():
            pending.add_metric([status], count)
        yield pending


def metrics(request: HttpRequest) -> HttpResponse:
    """The database-derived metrics in Prometheus' text format (503 while the time authority
    cannot be read)."""
    try:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    except ImportError as exc:
        raise ImproperlyConfigured(
            f"the celery_driftsafe metrics view needs prometheus-client ({exc}): {EXTRA_HINT}"
        ) from exc
    try:
        now = authority_clock().now()
    except ClockError as exc:
        return HttpResponse(
            f"time authority unreachable: {exc}\n", status=503, content_type="text/plain"
        )
    body = generate_latest(DatabaseCollector(now))
    return HttpResponse(body, content_type=CONTENT_TYPE_LATEST)
