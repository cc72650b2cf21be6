"""The Celery app every benchmarked beat runs: configured from Django settings, as a Django
project does it, with one task that does nothing (the benchmark counts messages, not work)."""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "benchmarks.bench_settings")

app = Celery("bench")
app.config_from_object("django.conf:settings", namespace="CELERY")

if os.environ.get("DRIFTSAFE_BENCH_TRACING") == "opentelemetry":
    # OpenTelemetry's Celery instrumentation, installed at the app's import as a project
    # does (spans made and dropped where an exporter would send them)
    from tests.e2e.tracing import install_opentelemetry

    install_opentelemetry()
elif os.environ.get("DRIFTSAFE_BENCH_TRACING") == "sentry":
    # Sentry's Celery integration (it wraps apply_async, send_task and Celery beat's
    # apply_entry on the class), events sent nowhere
    from tests.e2e.tracing import install

    install("sentry")
elif os.environ.get("DRIFTSAFE_BENCH_TRACING") == "noop":
    # receivers of the publish signals that do nothing: what any receiver costs the beat's
    # publishing, apart from the receiver's own work
    from tests.e2e.tracing import connect_noop_receivers

    connect_noop_receivers()

#: The name every benchmark entry calls.
TASK = "bench.tick"


@app.task(name=TASK)
def tick(*args: Any, **kwargs: Any) -> None:
    """Never executed: no worker consumes the benchmark queue."""
