"""The metrics view: what the database knows about the cluster, in Prometheus' text format.

Mount it with ``path("driftsafe/", include("celery_driftsafe.urls"))`` and scrape
``/driftsafe/metrics``. It is served by the web application, so it keeps answering when every
beat is down ("no live beat" is then ``driftsafe_nodes_alive == 0``). Each scrape runs a
handful of bounded, indexed queries (see :mod:`celery_driftsafe.monitoring.cluster`) at one reading
of
the time authority. It needs the ``metrics`` extra (prometheus-client).

It shows task names, node ids and host names, so it answers only

* a request with ``Authorization: Bearer <DRIFTSAFE["METRICS_TOKEN"]>`` (a scraper), or
* a logged-in user allowed to view periodic tasks, runs and beat nodes
  (:func:`celery_driftsafe.monitoring.cluster.may_view`).

Anyone else gets 401 (with ``WWW-Authenticate: Bearer``), a logged-in user without those
permissions 403. A failure to read the time authority or the database is logged
(``metrics-error``) and answered 503 with a body that says which, not the error's text (it
may name hosts and users).
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError
from django.http import HttpRequest, HttpResponse

from celery_driftsafe.conf import get_settings
from celery_driftsafe.exceptions import ClockError
from celery_driftsafe.monitoring import cluster
from celery_driftsafe.monitoring.metrics import EXTRA_HINT, unix
from celery_driftsafe.store.clock import authority_clock

logger = logging.getLogger("celery_driftsafe.views")

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


#: ``WWW-Authenticate`` of a 401.
CHALLENGE = 'Bearer realm="celery_driftsafe metrics"'


def _bearer(request: HttpRequest) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header (None: no such header)."""
    scheme, _, token = request.headers.get("Authorization", "").strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip()


def _text(body: str, status: int) -> HttpResponse:
    return HttpResponse(body + "\n", status=status, content_type="text/plain; charset=utf-8")


def _unauthorized(error: str = "") -> HttpResponse:
    response = _text(
        "authentication required: a bearer token (DRIFTSAFE METRICS_TOKEN), or a logged-in "
        "user allowed to view periodic tasks, runs and beat nodes",
        401,
    )
    response["WWW-Authenticate"] = f'{CHALLENGE}, error="{error}"' if error else CHALLENGE
    return response


def _refusal(request: HttpRequest) -> HttpResponse | None:
    """The answer to a request that may not see the metrics (None: it may)."""
    presented = _bearer(request)
    if presented is not None:
        expected = get_settings().metrics_token
        if expected and hmac.compare_digest(presented.encode(), expected.encode()):
            return None
        logger.warning(
            "metrics view: refused a bearer token from %s (%s)",
            request.META.get("REMOTE_ADDR", "?"),
            "it is not METRICS_TOKEN" if expected else "METRICS_TOKEN is not set",
            extra={"action": "metrics-denied"},
        )
        return _unauthorized("invalid_token")
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return _unauthorized()
    if not cluster.may_view(user):
        return _text(
            "forbidden: the metrics need the permissions to view periodic tasks, runs and beat "
            "nodes",
            403,
        )
    return None


def _unavailable(what: str, exc: Exception) -> HttpResponse:
    """503 for ``what`` out of reach: the error's text goes to the log, not to the scraper."""
    logger.error(
        "metrics view: %s cannot be read: %s", what, exc, extra={"action": "metrics-error"}
    )
    return _text(f"metrics unavailable: {what} cannot be read (see the server's log)", 503)


def metrics(request: HttpRequest) -> HttpResponse:
    """The database-derived metrics in Prometheus' text format, for a scraper with the bearer
    token or a user allowed to see them (see the module docstring); 503 while the time
    authority or the database cannot be read."""
    try:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    except ImportError as exc:
        raise ImproperlyConfigured(
            f"the celery_driftsafe metrics view needs prometheus-client ({exc}): {EXTRA_HINT}"
        ) from exc
    refused = _refusal(request)
    if refused is not None:
        return refused
    try:
        now = authority_clock().now()
    except ClockError as exc:
        return _unavailable("the time authority", exc)
    try:
        body = generate_latest(DatabaseCollector(now))
    except DatabaseError as exc:
        return _unavailable("the database", exc)
    return HttpResponse(body, content_type=CONTENT_TYPE_LATEST)
