"""Beat nodes: registration, heartbeats with the measured clock offset, and clean-up."""

from __future__ import annotations

import logging
import os
import socket
import uuid
from datetime import datetime, timedelta

from django.db.models import Min

from celery_driftsafe import __version__
from celery_driftsafe.conf import DriftSafeSettings
from celery_driftsafe.models import BeatNode
from celery_driftsafe.monitoring import metrics, metrics_server
from celery_driftsafe.store.clock import AuthorityClock, OffsetSample

logger = logging.getLogger("celery_driftsafe.nodes")
#: The clock check speaks for the beat.
_beat_logger = logging.getLogger("celery_driftsafe.scheduler")


def new_node_id() -> str:
    """``host:pid:random`` — unique even when a pid is reused after a restart."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def register(node_id: str, now: datetime, *, using: str = "default") -> BeatNode:
    """Record the node running; it serves its metrics from now on (``METRICS_PORT``)."""
    metrics_server.serve_node(node_id)
    node, _ = BeatNode.objects.using(using).update_or_create(
        node_id=node_id,
        defaults={
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "version": __version__,
            "started_at": now,
            "last_heartbeat_at": now,
            "stopped_at": None,
        },
    )
    return node


def heartbeat(
    node_id: str,
    now: datetime,
    sample: OffsetSample | None = None,
    *,
    paused_reason: str = "",
    claiming_since: datetime | None = None,
    lag_seconds: float | None = None,
    redis_failing: tuple[datetime, str] | None = None,
    using: str = "default",
) -> bool:
    """Record a heartbeat; False when the node is not registered as running (it was marked
    dead, or its row is gone): the caller must re-register. ``redis_failing``: since when
    (authority time) the node's Redis has not answered it, and why."""
    fields: dict[str, object] = {
        "last_heartbeat_at": now,
        "claiming_paused_reason": paused_reason,
        "claiming_since": claiming_since,
        "lag_seconds": lag_seconds,
        "redis_unreachable_since": redis_failing[0] if redis_failing else None,
        "redis_error": redis_failing[1] if redis_failing else "",
    }
    if sample is not None:
        fields.update(
            clock_offset_seconds=sample.offset,
            clock_rtt_seconds=sample.rtt,
            clock_measured_at=sample.authority_at,
        )
    alive = bool(
        BeatNode.objects.using(using)
        .filter(node_id=node_id, stopped_at__isnull=True)
        .update(**fields)
    )
    metrics.heartbeat(sample, now, paused=bool(paused_reason), using=using)
    return alive


def mark_stopped(node_id: str, now: datetime, *, using: str = "default") -> None:
    metrics_server.stop_node(node_id)
    BeatNode.objects.using(using).filter(node_id=node_id).update(stopped_at=now)


def mark_dead(
    now: datetime, dead_after: timedelta, by: str, *, using: str = "default"
) -> list[str]:
    """Mark nodes whose last heartbeat is older than ``dead_after`` as stopped; return their
    ids. Their claimed-but-unpublished runs are then taken over at once (see
    :func:`celery_driftsafe.claim.outbox.reclaim_stale`), without waiting for the lease."""
    stale = (
        BeatNode.objects.using(using)
        .filter(stopped_at__isnull=True, last_heartbeat_at__lt=now - dead_after)
        .exclude(node_id=by)  # the caller is alive, whatever its last heartbeat says
    )
    ids = list(stale.values_list("node_id", flat=True))
    if ids:
        BeatNode.objects.using(using).filter(node_id__in=ids, stopped_at__isnull=True).update(
            stopped_at=now,
            claiming_paused_reason=(
                f"marked dead by {by}: no heartbeat for over {dead_after.total_seconds():g} s"
            ),
        )
        logger.warning(
            "marked beat nodes dead (no heartbeat for %s): %s",
            dead_after,
            ", ".join(ids),
            extra={"action": "mark-dead", "node": by},
        )
    return ids


def alive(now: datetime, dead_after: timedelta, *, using: str = "default") -> list[BeatNode]:
    """Nodes with a recent heartbeat that have not stopped."""
    return list(
        BeatNode.objects.using(using).filter(
            stopped_at__isnull=True, last_heartbeat_at__gte=now - dead_after
        )
    )


def others_claiming_since(
    node_id: str, now: datetime, dead_after: timedelta, *, using: str = "default"
) -> datetime | None:
    """The earliest ``claiming_since`` of the other live nodes: since when, as far as they
    know, some beat has been claiming without a break."""
    value: datetime | None = (
        BeatNode.objects.using(using)
        .filter(
            stopped_at__isnull=True,
            last_heartbeat_at__gte=now - dead_after,
            claiming_paused_reason="",
        )
        .exclude(node_id=node_id)
        .aggregate(since=Min("claiming_since"))["since"]
    )
    return value


class ClockWatch:
    """The verdict on this node's clock offset, judged on every fresh measurement and logged
    once each time it crosses a bound: past ``MAX_CLOCK_OFFSET_SECONDS`` a warning
    (``clock-offset``), back within it a line (``clock-offset-ok``); past
    ``HARD_CLOCK_OFFSET_SECONDS`` claiming pauses (``pause``) until the offset is back
    (``resume``). A step of the wall clock is measured at the next check, not at the next
    scheduled measurement; a measurement another caller took (the clock measures on its own
    when one is due) is judged too."""

    #: A wall clock that moved this far against the authority since the last measurement
    #: (a step) is measured again at once.
    STEP_TOLERANCE_SECONDS = 0.5

    def __init__(
        self, clock: AuthorityClock, authority: str, settings: DriftSafeSettings, node_id: str
    ) -> None:
        self.clock = clock
        self.authority = authority
        self.settings = settings
        self.node_id = node_id
        #: Why claiming is paused (``""``: it is not).
        self.paused_reason = ""
        self._beyond = False
        self._judged: OffsetSample | None = None

    def check(self) -> str:
        """Measure when due (or when the wall clock stepped), judge a measurement not judged
        yet, and return why claiming is paused (``""``: it may go on)."""
        clock = self.clock
        if clock.needs_sync() or clock.wall_moved(self.STEP_TOLERANCE_SECONDS):
            clock.sync()
        sample = clock.last_sample
        if sample is not None and sample is not self._judged:
            self._judged = sample
            self._judge(sample)
        return self.paused_reason

    def _judge(self, sample: OffsetSample) -> None:
        settings, node = self.settings, self.node_id
        offset = abs(sample.offset)
        if offset > settings.hard_clock_offset_seconds:
            reason = (
                f"clock offset {sample.offset:+.3f} s from the {self.authority} "
                f"authority exceeds HARD_CLOCK_OFFSET_SECONDS="
                f"{settings.hard_clock_offset_seconds}; claiming paused"
            )
            if not self.paused_reason:
                _beat_logger.error(reason, extra={"action": "pause", "node": node})
            self.paused_reason, self._beyond = reason, True
            return
        if self.paused_reason:
            # said here; within MAX_CLOCK_OFFSET_SECONDS it needs no second line, beyond it
            # the warning below follows
            self.paused_reason, self._beyond = "", False
            _beat_logger.warning(
                "clock offset %+.3f s back within HARD_CLOCK_OFFSET_SECONDS=%s; claiming resumed",
                sample.offset,
                settings.hard_clock_offset_seconds,
                extra={"action": "resume", "node": node},
            )
        beyond = offset > settings.max_clock_offset_seconds
        if beyond and not self._beyond:
            _beat_logger.warning(
                "node %s wall clock is %+.3f s off the %s authority (±%.3f s), beyond "
                "MAX_CLOCK_OFFSET_SECONDS=%s; due-ness does not depend on it, but check NTP",
                node,
                sample.offset,
                self.authority,
                sample.error_bound,
                settings.max_clock_offset_seconds,
                extra={"action": "clock-offset", "node": node},
            )
        elif self._beyond and not beyond:
            _beat_logger.info(
                "node %s wall clock is back within MAX_CLOCK_OFFSET_SECONDS=%s of the %s "
                "authority (%+.3f s)",
                node,
                settings.max_clock_offset_seconds,
                self.authority,
                sample.offset,
                extra={"action": "clock-offset-ok", "node": node},
            )
        self._beyond = beyond
