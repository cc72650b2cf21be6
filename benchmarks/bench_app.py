"""The Celery app every benchmarked beat runs: configured from Django settings, as a Django
project does it, with one task that does nothing (the benchmark counts messages, not work)."""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "benchmarks.bench_settings")

app = Celery("bench")
app.config_from_object("django.conf:settings", namespace="CELERY")

#: The name every benchmark entry calls.
TASK = "bench.tick"


@app.task(name=TASK)
def tick(*args: Any, **kwargs: Any) -> None:
    """Never executed: no worker consumes the benchmark queue."""
