"""Reading what a publish left on the test broker, for comparing the fast path's messages with
Celery's own: the raw envelopes of a queue, what may differ by design between two publishes of
one message, and two claimed runs to publish."""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime
from typing import Any

import redis

from celery_driftsafe.beat import nodes
from celery_driftsafe.claim.claimers import ClaimedRun, claimer_for
from tests import settings as test_settings
from tests.support.factories import interval_task

BROKER_URL = f"{test_settings.REDIS_SERVER}/{test_settings.REDIS_DB + 1}"
#: Real time: Celery computes a message's ``expiration`` from its own clock.
T0 = datetime.now(UTC).replace(microsecond=0)


def raw_messages(queue: str) -> list[tuple[str, dict[str, Any]]]:
    """Pop every message of ``queue`` (all its priority lists), oldest first, with the Redis
    list it was in."""
    client = redis.Redis.from_url(BROKER_URL)
    out = []
    for key in sorted(k.decode() for k in client.keys(f"{queue}*")):
        while (raw := client.rpop(key)) is not None:
            out.append((key, json.loads(raw)))
    client.close()
    return out


def comparable(key: str, envelope: dict[str, Any]) -> dict[str, Any]:
    """An envelope without what differs by design between any two publishes of one message:
    kombu's random delivery tag, and the expiry's milliseconds (counted from the moment of
    publishing: see :func:`same_expiry`)."""
    properties = dict(envelope["properties"])
    properties.pop("delivery_tag")
    if "expiration" in properties:
        properties["expiration"] = "set"
    return {
        **envelope,
        "properties": properties,
        "body": base64.b64decode(envelope["body"]),
        "list": key,
    }


def same_expiry(fast: dict[str, Any], celery: dict[str, Any]) -> bool:
    """Both messages expire at the same instant: their TTLs (milliseconds from the moment
    each was published, one after the other) differ by less than two seconds."""
    ttls = [m["properties"].get("expiration") for m in (fast, celery)]
    if ttls[0] is None or ttls[1] is None:
        return ttls[0] is ttls[1]
    return abs(int(ttls[0]) - int(ttls[1])) < 2000


def claim(**task_fields: Any) -> list[ClaimedRun]:
    nodes.register("n1", T0)
    interval_task("t1", 60, anchor=T0, next_slot_at=T0, **task_fields)
    interval_task(
        "t2",
        60,
        anchor=T0,
        next_slot_at=T0,
        **{**task_fields, "args": [40, 2] if task_fields.get("args") != [] else []},
    )
    runs = claimer_for().claim(T0, "n1").runs
    assert len(runs) == 2
    return runs
