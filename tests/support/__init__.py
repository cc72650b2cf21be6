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
#: One queue per test process, so concurrent runs on one Redis never see each other's messages.
QUEUE = f"tests-{os.getpid()}"

T = TypeVar("T")


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
