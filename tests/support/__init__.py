"""What the tests share besides fixtures: the reference instant, the test broker's queue and
how to read it, and one way to wait for a condition. Factories of stored rows are in
:mod:`tests.support.factories`; fixtures are in the ``conftest.py`` files."""

from __future__ import annotations

import base64
import json
import os
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

from tests import settings as test_settings

#: The reference instant of the tests (and of the ``fake_clock`` and ``clock`` fixtures).
T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)

BROKER_DB = test_settings.REDIS_DB + 1
BROKER_URL = f"{test_settings.REDIS_SERVER}/{BROKER_DB}"
#: One queue per test process, so concurrent runs on one Redis never see each other's messages;
#: under the run's prefix, so a Redis not of the run's own is left as it was.
QUEUE = f"{test_settings.RUN_PREFIX}-tests-{os.getpid()}"

T = TypeVar("T")
#: What separates a kombu binding's routing key, pattern and queue on Redis.
KOMBU_SEPARATOR = "\x06\x16"


def rabbitmq_url() -> str:
    """The test RabbitMQ's URL (``DRIFTSAFE_TEST_RABBITMQ_URL``); without one the test fails,
    saying how to get one."""
    if test_settings.RABBITMQ_URL is None:
        import pytest

        pytest.fail(test_settings.RABBITMQ_MISSING)
    return test_settings.RABBITMQ_URL


def empty_redis(client: Any) -> None:
    """Empty a test database of the Redis ``client`` is on: all of it on the run's own server
    (``tests/services.sh`` started it); on any other only the keys under the run's prefix, so
    nothing the run did not write is read or removed."""
    if test_settings.REDIS_IS_PRIVATE:
        client.flushdb()
        return
    keys = list(client.scan_iter(f"{test_settings.RUN_PREFIX}*", count=1000))
    if keys:
        client.delete(*keys)


def forget_queue(client: Any, queue: str) -> None:
    """Remove what kombu keeps on a Redis broker for ``queue``: its lists (one per priority),
    and its entries in the exchanges' binding sets (``_kombu.binding.<exchange>`` and
    ``_kombu.binding_permanent.<exchange>``: each member names its queue last), leaving other
    queues' bindings as they were."""
    keys = list(client.scan_iter(f"{queue}*", count=1000))
    if keys:
        client.delete(*keys)
    bindings = [
        key
        for pattern in ("_kombu.binding.*", "_kombu.binding_permanent.*")
        for key in client.scan_iter(pattern, count=1000)
    ]
    for binding in bindings:
        members = client.smembers(binding)
        ours = [m for m in members if m.decode().rpartition(KOMBU_SEPARATOR)[2].startswith(queue)]
        if ours:
            client.srem(binding, *ours)


def drain(queue: str = QUEUE) -> list[dict[str, Any]]:
    """Pop every message published to ``queue`` on the test broker; returns their headers
    (with ``args``/``kwargs`` decoded from the body)."""
    import redis

    client = redis.Redis.from_url(BROKER_URL)
    out = []
    while (raw := client.rpop(queue)) is not None:
        message = json.loads(raw)
        headers = dict(message["headers"])
        body = json.loads(base64.b64decode(message["body"]))
        headers["args"], headers["kwargs"] = body[0], body[1]
        headers["properties"] = message.get("properties", {})
        out.append(headers)
    client.close()
    return out


def wait_until(
    condition: Callable[[], T],
    what: str,
    timeout: float = 10.0,
    interval: float = 0.05,
    context: Callable[[], str] | None = None,
) -> T:
    """Poll ``condition`` until it returns something true, and return that; past ``timeout``
    seconds fail the test, saying ``what`` was awaited (and ``context()``, say a process's log,
    when given). The timeout bounds a wait for something that should happen; it is never the
    fact a test asserts."""
    import pytest

    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            detail = f"\n{context()}" if context is not None else ""
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}{detail}")
        time.sleep(interval)
