"""Overhead of DriftSafeTask over a plain task, per execution, on loopback Redis and
PostgreSQL, side by side in one run.

    python -m benchmarks task [--runs 2000]

Each run row is made beforehand (the beat's job); what is timed is one delivery as a worker
calls it: the run's lock with its fencing token (one Redis call), the start that also checks
the headers (one ``UPDATE … RETURNING``), body, outcome (one ``UPDATE``), release (one Redis
call). The body is empty, so the difference to the plain task is the whole overhead. The two
writes are durable commits to rows touched once each, so the figure follows the database's
commit latency on the machine (``PROFILE=1``, ``PROFILE_SORT=tottime`` shows where it goes).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid

from benchmarks.django_db import fresh_databases
from celery_driftsafe.testing.recording import percentile


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=2000)
    args = parser.parse_args()

    with fresh_databases():
        from celery import Celery
        from django.conf import settings

        from celery_driftsafe.models import Run
        from celery_driftsafe.task import DriftSafeTask

        app = Celery("bench", broker="memory://", set_as_current=False)

        @app.task(name="bench.plain", shared=False)
        def plain() -> None:
            return None

        @app.task(name="bench.safe", base=DriftSafeTask, shared=False)
        def safe() -> None:
            return None

        runs = Run.objects.bulk_create(
            Run(
                kind="manual",
                task_name="bench.safe",
                status="dispatched",
                celery_task_id=str(uuid.uuid4()),
            )
            for _ in range(args.runs)
        )
        timings: dict[str, list[float]] = {"plain task": [], "DriftSafeTask": []}
        profile = None
        if os.environ.get("PROFILE"):
            import cProfile

            profile = cProfile.Profile()
            profile.enable()
        for run in runs:
            for label, task, headers in (
                ("plain task", plain, {}),
                ("DriftSafeTask", safe, {"driftsafe_run_id": run.pk, "driftsafe_fencing_token": 0}),
            ):
                task.push_request(
                    id=run.celery_task_id, hostname="bench", delivery_info={}, **headers
                )
                started = time.perf_counter()
                task()
                timings[label].append((time.perf_counter() - started) * 1000)
                task.pop_request()
        if profile is not None:
            import pstats

            profile.disable()
            order = os.environ.get("PROFILE_SORT", "cumulative")
            pstats.Stats(profile).sort_stats(order).print_stats(25)
        assert Run.objects.filter(status="succeeded").count() == args.runs
        db = settings.DATABASES["default"]["ENGINE"].rsplit(".", 1)[-1]
        lock = "Redis" if settings.DRIFTSAFE.get("REDIS_URL") else "database"
        print(f"{args.runs} executions, database {db}, locks on {lock}")
        print(f"{'':<16}{'p50 ms':>9}{'p99 ms':>9}{'mean ms':>9}")
        for label, values in timings.items():
            print(
                f"{label:<16}{percentile(values, 50):>9.3f}{percentile(values, 99):>9.3f}"
                f"{statistics.fmean(values):>9.3f}"
            )
        overhead = [
            s - p for s, p in zip(timings["DriftSafeTask"], timings["plain task"], strict=True)
        ]
        print(
            f"{'overhead':<16}{percentile(overhead, 50):>9.3f}{percentile(overhead, 99):>9.3f}"
            f"{statistics.fmean(overhead):>9.3f}"
        )


if __name__ == "__main__":
    main()
