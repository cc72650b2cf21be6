"""The publish tests' broker: a queue of each test's own on the test Redis, and apps that
publish to it with a few registered tasks (plain, ``DriftSafeTask``, with options of their own)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from celery_driftsafe.task import DriftSafeTask
from tests import settings as test_settings
from tests.support import forget_queue
from tests.support.fast_path import BROKER_URL


@pytest.fixture
def queue() -> Iterator[str]:
    """A queue name of this test's own; its Redis lists are deleted afterwards."""
    name = f"{test_settings.RUN_PREFIX}-fast-{uuid.uuid4().hex[:8]}"
    yield name
    client = redis.Redis.from_url(BROKER_URL)
    forget_queue(client, name)
    client.close()


@pytest.fixture
def make_app(queue: str) -> Iterator[Callable[..., Celery]]:
    apps: list[Celery] = []

    def make(**conf: Any) -> Celery:
        app = Celery("driftsafe-fast", broker=BROKER_URL, set_as_current=False)
        app.conf.update(
            task_default_queue=queue,
            broker_connection_retry_on_startup=False,
            worker_hijack_root_logger=False,
            **conf,
        )

        @app.task(name="fast.add", shared=False)
        def add(x: int, y: int) -> int:
            return x + y

        @app.task(name="fast.safe", base=DriftSafeTask, shared=False)
        def safe(x: int, y: int) -> int:
            return x + y

        @app.task(
            name="fast.limited",
            shared=False,
            time_limit=30,
            soft_time_limit=20,
            ignore_result=True,
            serializer="pickle",
        )
        def limited(x: int, y: int) -> int:
            return x + y

        apps.append(app)
        return app

    yield make
    for app in apps:
        app.close()
