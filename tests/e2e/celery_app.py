"""The Celery app of the end-to-end runs, configured the way a Django project does it."""

from __future__ import annotations

import json
import os
import time
from typing import Any

from celery import Celery

from celery_driftsafe.task import DriftSafeTask

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.e2e.settings")

app = Celery("e2e")
app.config_from_object("django.conf:settings", namespace="CELERY")


@app.task(name="e2e.tick")
def tick(*args: Any, **kwargs: Any) -> None:
    """Does nothing: the test counts messages, not work."""


@app.task(name="e2e.work", base=DriftSafeTask, acks_late=True, reject_on_worker_lost=True)
def work(marker: str, seconds: float = 0.0) -> str:
    """Sleeps, then records that its body ran to the end (in Redis, for the test to count)."""
    import redis

    time.sleep(seconds)
    client = redis.Redis.from_url(os.environ["DRIFTSAFE_E2E_REDIS"])
    client.rpush(f"{os.environ['DRIFTSAFE_E2E_PREFIX']}:executions",
                 json.dumps({"marker": marker, "pid": os.getpid()}))
    client.close()
    return marker
