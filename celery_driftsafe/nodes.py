"""Beat nodes: registration, heartbeats with the measured clock offset, and clean-up."""

from __future__ import annotations

import os
import socket
import uuid
from datetime import datetime, timedelta

from celery_driftsafe import __version__
from celery_driftsafe.clock import OffsetSample
from celery_driftsafe.models import BeatNode


def new_node_id() -> str:
    """``host:pid:random`` — unique even when a pid is reused after a restart."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def register(node_id: str, now: datetime, *, using: str = "default") -> BeatNode:
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
    node_id: str, now: datetime, sample: OffsetSample | None = None, *,
    paused_reason: str = "", using: str = "default",
) -> None:
    fields: dict[str, object] = {"last_heartbeat_at": now, "claiming_paused_reason": paused_reason}
    if sample is not None:
        fields.update(
            clock_offset_seconds=sample.offset,
            clock_rtt_seconds=sample.rtt,
            clock_measured_at=sample.authority_at,
        )
    BeatNode.objects.using(using).filter(node_id=node_id).update(**fields)


def mark_stopped(node_id: str, now: datetime, *, using: str = "default") -> None:
    BeatNode.objects.using(using).filter(node_id=node_id).update(stopped_at=now)


def alive(now: datetime, dead_after: timedelta, *, using: str = "default") -> list[BeatNode]:
    """Nodes with a recent heartbeat that have not stopped."""
    return list(
        BeatNode.objects.using(using).filter(
            stopped_at__isnull=True, last_heartbeat_at__gte=now - dead_after
        )
    )
