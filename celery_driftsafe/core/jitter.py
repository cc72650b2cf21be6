"""Deterministic jitter: spread a task's runs over the first seconds of each slot, without
randomness.

A task with ``jitter_seconds = J`` runs each slot ``s`` at ``s + offset``, where ``offset`` is
in ``[0, J)`` and derived from a SHA-256 hash of the task's name and the slot (in integer
microseconds). Every beat computes the same offset for the same ``(name, slot)``, on any
machine and in any process (no ``hash()`` seeding), so the instant is as deterministic as the
slot itself. The slot stays the identity of the run: the run row's ``slot`` and the Celery task
id are those of the slot, not of the jittered instant.

Hashing spreads a wave of tasks due at one slot evenly over ``[s, s + J)``: 100,000 tasks due
at midnight with ``J = 30`` reach the claim at about 3,333 per second, not all at once.

Pure: no clock, no Django.
"""

from __future__ import annotations

import hashlib
import math
from datetime import datetime, timedelta
from typing import overload

from celery_driftsafe.core.instants import to_us

_US = timedelta(microseconds=1)


def spread_us(jitter_seconds: float | None) -> int:
    """The spread in whole microseconds (0: no jitter; also for a value that is not a finite
    positive number, which validation reports)."""
    if (
        not isinstance(jitter_seconds, int | float)
        or isinstance(jitter_seconds, bool)
        or not math.isfinite(jitter_seconds)
        or jitter_seconds <= 0
    ):
        return 0
    return round(jitter_seconds * 1_000_000)


def offset(identity: str, slot: datetime, jitter_seconds: float | None) -> timedelta:
    """How long after ``slot`` the task ``identity`` runs it: ``0 <= offset < jitter``."""
    spread = spread_us(jitter_seconds)
    if spread <= 1:
        return timedelta(0)
    digest = hashlib.sha256(f"{identity}\x00{to_us(slot)}".encode()).digest()
    return (int.from_bytes(digest[:8], "big") % spread) * _US


@overload
def due_instant(identity: str, slot: datetime, jitter_seconds: float | None) -> datetime: ...


@overload
def due_instant(identity: str, slot: None, jitter_seconds: float | None) -> None: ...


def due_instant(
    identity: str, slot: datetime | None, jitter_seconds: float | None
) -> datetime | None:
    """The instant the slot is due: ``slot + offset(...)`` (None for no slot). Every due
    instant is derived here: the claim's plan and its record of the oldest slot fired, the
    stored ``due_at``, a message's expiry, the preview."""
    if slot is None:
        return None
    return slot + offset(identity, slot, jitter_seconds)
