"""What the beats coordinate through: their nodes (heartbeat, clock offset) and, without
Redis, their locks."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.db import models


class BeatNode(models.Model):
    """One running (or once running) beat: its heartbeat and its measured clock offset."""

    node_id = models.CharField(max_length=255, unique=True)
    hostname = models.CharField(max_length=255)
    pid = models.PositiveIntegerField()
    version = models.CharField(max_length=32, blank=True)
    started_at = models.DateTimeField()
    last_heartbeat_at = models.DateTimeField()
    stopped_at = models.DateTimeField(null=True, blank=True)
    clock_offset_seconds = models.FloatField(
        null=True, blank=True, help_text="Authority minus this node's wall clock."
    )
    clock_rtt_seconds = models.FloatField(null=True, blank=True)
    clock_measured_at = models.DateTimeField(null=True, blank=True)
    claiming_paused_reason = models.TextField(blank=True)
    claiming_since = models.DateTimeField(
        null=True,
        blank=True,
        help_text="Since when this node has been claiming without a break (authority time). "
        "A slot that fell due since then, while any node was claiming, is late "
        "rather than missed.",
    )
    lag_seconds = models.FloatField(
        null=True,
        blank=True,
        help_text="How long after its slot the oldest run of this node's recent claim rounds "
        "fired: above the misfire grace, the beats are saturated.",
    )

    redis_unreachable_since = models.DateTimeField(
        null=True,
        blank=True,
        help_text="Since when this node's REDIS_URL has not answered (authority time); empty "
        "while it answers or none is configured.",
    )
    redis_error = models.TextField(
        blank=True, help_text="Why this node's REDIS_URL does not answer (its last error)."
    )

    class Meta:
        ordering = ["hostname", "pid"]

    def __str__(self) -> str:
        return self.node_id

    def state_at(self, now: datetime, dead_after: timedelta) -> str:
        """``"stopped"`` (shut down cleanly), ``"dead"`` (no heartbeat for ``dead_after`` at
        the authority's ``now``) or ``"alive"``."""
        if self.stopped_at is not None:
            return "stopped"
        if self.last_heartbeat_at < now - dead_after:
            return "dead"
        return "alive"

    def offset_exceeds(self, bound_seconds: float) -> bool:
        """Whether the measured clock offset is beyond ``bound_seconds`` (either way)."""
        offset = self.clock_offset_seconds
        return offset is not None and abs(offset) > bound_seconds


class Lock(models.Model):
    """A lease for :mod:`celery_driftsafe.locks` when no Redis is configured.

    One row per lock name, kept after release so ``fencing_token`` only ever grows: each
    acquisition increments it. ``token`` is the holder's random token (empty: free);
    the lease is over at ``expires_at`` (an instant of the lock's clock, not a local one).
    """

    name = models.CharField(max_length=200, unique=True)
    token = models.CharField(max_length=64, blank=True, help_text="Holder's token; empty: free.")
    fencing_token = models.BigIntegerField(
        default=0, help_text="Incremented by every acquisition; never decreases."
    )
    expires_at = models.DateTimeField(help_text="The lease is over at this instant.")

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name
