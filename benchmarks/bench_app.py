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
elif os.environ.get("DRIFTSAFE_BENCH_TRACING") == "noop":
    # receivers of the publish signals that do nothing: what any receiver costs the beat's
    # publishing, apart from the receiver's own work
    from celery import signals

    def _nothing(**kwargs: Any) -> None:
        pass

    signals.before_task_publish.connect(_nothing, weak=False)
    signals.after_task_publish.connect(_nothing, weak=False)

if os.environ.get("DRIFTSAFE_BENCH_GC_LOG"):
    # Where a beat's garbage collections go: each generation's collections and seconds, in
    # the file of that name and the process id, written at most once a second (for a person
    # looking into a figure; the benchmarks do not read it)
    import gc
    import json
    import sys
    import time

    _gc_totals: dict[str, list[float]] = {"0": [0, 0.0], "1": [0, 0.0], "2": [0, 0.0]}
    _gc_began = [0.0, 0.0]

    def _time_collections(phase: str, info: dict[str, int]) -> None:
        now = time.perf_counter()
        if phase == "start":
            _gc_began[0] = now
            return
        total = _gc_totals[str(info["generation"])]
        total[0] += 1
        total[1] += now - _gc_began[0]
        if now - _gc_began[1] > 1.0:
            _gc_began[1] = now
            with open(f"{os.environ['DRIFTSAFE_BENCH_GC_LOG']}.{os.getpid()}", "w") as log:
                json.dump({"argv": sys.argv, "collections": _gc_totals}, log)

    gc.callbacks.append(_time_collections)

#: The name every benchmark entry calls.
TASK = "bench.tick"


@app.task(name=TASK)
def tick(*args: Any, **kwargs: Any) -> None:
    """Never executed: no worker consumes the benchmark queue."""
