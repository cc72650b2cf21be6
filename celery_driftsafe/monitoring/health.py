"""Whether the services a beat depends on answer, said alike by the beat's log, the metrics,
the admin's dashboard and ``driftsafe_status``: what is out of reach and what that stops."""

from __future__ import annotations

from celery_driftsafe.conf import get_settings


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


def silent_after_seconds() -> float:
    """How long a beat may go without a heartbeat before it is named silent."""
    return SILENT_AFTER_HEARTBEATS * get_settings().heartbeat_interval_seconds


def silence_effects(node_ids: list[str], seconds: float) -> str:
    """What beats silent for over ``seconds`` mean, naming them."""
    return (
        f"beats silent for over {seconds:g} s (no heartbeat: they may not reach the database, "
        f"or are paused): {', '.join(node_ids)}; until they are marked dead, the runs they "
        "claimed and have not published wait for them"
    )
