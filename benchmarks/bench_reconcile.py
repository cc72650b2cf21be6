"""Runs of plain tasks settled by reconciliation: how fast a beat's passes record ``expired``
the runs past their expiry and take the result backend's outcome of the runs stuck in
``dispatched``, on PostgreSQL with a Redis result backend.

    python -m benchmarks reconcile [--expired 100000] [--finished 100000] [--waiting 100000]

``--expired`` runs a day old, past their expiry; ``--finished`` runs dispatched two hours ago
whose outcome the result backend holds; ``--waiting`` runs dispatched two hours ago that the
backend knows nothing of (an ``ignore_result`` task): they stay, and are read all the same.
Passes run, as a beat runs them, until one changes nothing; each prints what it settled and
its time. Needs the test services (PostgreSQL, Redis) and the test dependencies installed.
"""

from __future__ import annotations

import argparse
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from benchmarks.django_db import fresh_databases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--expired", type=int, default=100_000)
    parser.add_argument("--finished", type=int, default=100_000)
    parser.add_argument("--waiting", type=int, default=100_000)
    parser.add_argument(
        "--results-db", type=int, default=101, help="Redis database of the result backend"
    )
    args = parser.parse_args()
    with fresh_databases():
        _measure(args)


def _measure(args: Any) -> None:
    from celery import Celery, states
    from django.conf import settings
    from django.db import connection

    from celery_driftsafe.beat.recovery import reconcile
    from tests.support.factories import interval_task

    url = f"{settings.DRIFTSAFE['REDIS_URL'].rsplit('/', 1)[0]}/{args.results_db}"
    app = Celery("reconcile", broker="memory://", backend=url, set_as_current=False)
    app.conf.result_expires = None
    client = app.backend.client
    client.flushdb()
    now = datetime.now(UTC).replace(microsecond=0)
    task = interval_task("plain", 1, anchor=now - timedelta(days=2))
    groups = (
        ("expired", args.expired, now - timedelta(hours=25), "dispatched"),
        ("finished", args.finished, now - timedelta(hours=2), "dispatched"),
        ("waiting", args.waiting, now - timedelta(hours=2), "dispatched"),
    )
    first = 0
    with connection.cursor() as cursor:
        for name, count, claimed, status in groups:
            cursor.execute(
                """INSERT INTO celery_driftsafe_run (periodic_task_id, task_name, kind, slot,
                   status, claimed_by, claimed_at, dispatched_at, celery_task_id, fencing_token,
                   dispatch_attempts, duplicate_deliveries, worker, error, message, attempt,
                   missed_count, expires_at)
                SELECT %(task)s, 'plain.job', 'scheduled', s, %(status)s, 'n', s, s,
                   %(name)s || '-' || i, 0, 1, 0, '', '', '{}', 0, 1,
                   s + interval '1 day'
                FROM generate_series(%(first)s, %(last)s) AS i,
                     LATERAL (SELECT %(claimed)s::timestamptz
                              - make_interval(secs => i * 0.001)) AS t(s)""",
                {
                    "task": task.pk,
                    "status": status,
                    "name": name,
                    "first": first,
                    "last": first + count - 1,
                    "claimed": claimed,
                },
            )
            first += count
        cursor.execute("ANALYZE celery_driftsafe_run")
    with client.pipeline(transaction=False) as pipe:
        payload = app.backend.encode({"status": states.SUCCESS, "result": 1})
        start = args.expired
        for i in range(start, start + args.finished):
            pipe.set(app.backend.get_key_for_task(f"finished-{i}"), payload)
            if i % 10_000 == 0:
                pipe.execute()
        pipe.execute()
    print(
        f"runs waiting: {args.expired:,} past their expiry, {args.finished:,} with an outcome "
        f"in Redis, {args.waiting:,} the backend knows nothing of"
    )
    after = None
    for number in range(1, 100):
        started = time.perf_counter()
        done = reconcile(now, lease=timedelta(seconds=30), app=app, backend_after=after)
        elapsed = time.perf_counter() - started
        after = done.backend_after
        print(
            f"pass {number}: {len(done.expired):,} expired, {len(done.from_results):,} from "
            f"the result backend in {elapsed:.1f} s"
            f" ({(len(done.expired) + len(done.from_results)) / elapsed:,.0f} runs/s)"
        )
        if not done.expired and not done.from_results:
            break
    client.flushdb()
