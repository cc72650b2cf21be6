"""Whether the services a beat depends on answer, said alike by the beat's log, the metrics,
the admin's dashboard and ``driftsafe_status``: what is out of reach and what that stops."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from celery_driftsafe.conf import get_settings
from celery_driftsafe.models import BeatNode


def redis_state(url: str | None) -> str:
    """``REDIS_URL`` as this process reaches it now: ``not configured``, ``reachable``, or
    ``unreachable: <the error>`` (a ping with a 2-second timeout, no retries)."""
    if not url:
        return "not configured"
    import redis

    from celery_driftsafe.store.redis import client_from_url

    client = None
    try:
        client = client_from_url(
            url, socket_timeout=2, socket_connect_timeout=2, retry_on_timeout=False
        )
        client.ping()
    except (redis.RedisError, OSError) as exc:
        return f"unreachable: {exc}"
    finally:
        if client is not None:
            client.close()
    return "reachable"


def redis_outage_effects(policy: str | None = None) -> str:
    """What a Redis that does not answer stops, under ``REDIS_UNAVAILABLE = policy`` (default:
    the project's setting)."""
    if policy is None:
        policy = str(get_settings().redis_unavailable)
    bodies = (
        "task bodies run on the database's checks alone (REDIS_UNAVAILABLE = 'fail_open')"
        if policy == "fail_open"
        else "DriftSafeTask bodies do not run: their deliveries are sent again until Redis "
        "answers (REDIS_UNAVAILABLE = 'fail_closed')"
    )
    return (
        f"Redis does not answer: {bodies}; schedule edits reach the beats only at their next "
        "loop (no wake-up); slots keep being claimed and published from the database"
    )


#: A beat that has not heartbeated for this many heartbeat intervals (while not yet dead) is
#: named as silent: it does not reach the database (or is paused or overloaded).
SILENT_AFTER_HEARTBEATS = 3


@dataclass(frozen=True)
class BeatTrouble:
    """The alive beats that are degraded at an instant, as every view names them."""

    #: Alive beats whose Redis does not answer them (as they last recorded).
    redis_cut_off: list[BeatNode]
    #: Alive beats not heard from for over ``silent_after`` seconds.
    silent: list[BeatNode]
    silent_after: float

    def silence_effects(self) -> str:
        """What the silent beats mean, naming them ("": none is)."""
        if not self.silent:
            return ""
        return (
            f"beats silent for over {self.silent_after:g} s (no heartbeat: they may not reach "
            f"the database, or are paused): {', '.join(n.node_id for n in self.silent)}; until "
            "they are marked dead, the runs they claimed and have not published wait for them"
        )


def beat_trouble(nodes: Iterable[BeatNode], now: datetime) -> BeatTrouble:
    """Which of ``nodes`` are alive at the authority's ``now`` but cut off from Redis or
    silent."""
    settings = get_settings()
    dead_after = timedelta(seconds=settings.node_dead_after_seconds)
    quiet = SILENT_AFTER_HEARTBEATS * settings.heartbeat_interval_seconds
    alive = [node for node in nodes if node.state_at(now, dead_after) == "alive"]
    return BeatTrouble(
        redis_cut_off=[node for node in alive if node.redis_unreachable_since is not None],
        silent=[node for node in alive if (now - node.last_heartbeat_at).total_seconds() > quiet],
        silent_after=quiet,
    )
