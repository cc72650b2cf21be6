"""The admin's cluster dashboard and the metrics view on a big ledger, and what a metrics hook
costs with metrics off and on.

    DRIFTSAFE_TEST_REDIS_DB=96 python -m benchmarks dashboard [--tasks 10000]
        [--minutes 200] [--repeat 5]

A test database on PostgreSQL gets ``--tasks`` interval tasks that each fired every minute
for ``--minutes`` minutes (10,000 tasks and 200 minutes: 2M runs, 600k of them in the last
hour, what 10k tasks a minute leave behind), written by one ``INSERT … SELECT
generate_series`` and analysed. Then the dashboard page (through Django's test client, as a
logged-in superuser) and the metrics view are fetched ``--repeat`` times: median and worst
wall time, and the queries one page runs. Last, one hook call with metrics off and on.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.django_db import fresh_databases  # noqa: E402  (run as a script, too)

SEED_RUNS = """
INSERT INTO celery_driftsafe_run (periodic_task_id, task_name, kind, slot, status, claimed_by,
    claimed_at, dispatched_at, started_at, finished_at, celery_task_id, fencing_token,
    dispatch_attempts, duplicate_deliveries, worker, error, message, attempt, missed_count)
SELECT t.id, t.task, 'scheduled', s.slot,
       CASE WHEN (t.id + m) %% 97 = 0 THEN 'failed' WHEN (t.id + m) %% 389 = 0 THEN 'missed'
            ELSE 'succeeded' END,
       'beat-' || (t.id + m) %% 3 || ':4100:abcd',
       s.slot + make_interval(secs => ((t.id * 7 + m) %% 50) / 1000.0),
       s.slot + make_interval(secs => ((t.id * 7 + m) %% 50) / 1000.0 + 0.001),
       s.slot + interval '20 milliseconds', s.slot + interval '300 milliseconds',
       md5(t.id || ':' || m), 0, 1, 0, 'w1', '', '{}'::jsonb, 0, 1
FROM celery_driftsafe_periodictask t
CROSS JOIN generate_series(1, %(minutes)s) AS m
CROSS JOIN LATERAL (SELECT date_trunc('minute', now()) - make_interval(mins => m) AS slot) s
"""


def timed(call, repeat: int) -> tuple[float, float]:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times), max(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", type=int, default=10_000)
    parser.add_argument("--minutes", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    with fresh_databases():
        import django
        from django.conf import settings

        settings.ALLOWED_HOSTS = ["*"]
        from django.contrib.auth.models import User
        from django.db import connection
        from django.test import Client, override_settings
        from django.urls import reverse

        from celery_driftsafe.claim.claimers import ClaimResult
        from celery_driftsafe.models import PeriodicTask, Run
        from celery_driftsafe.monitoring import metrics

        started = time.perf_counter()
        PeriodicTask.objects.bulk_create(
            PeriodicTask(
                name=f"bench-{i:06d}",
                task="bench.work",
                schedule_kind="interval",
                interval_every=60,
                interval_unit="seconds",
            )
            for i in range(args.tasks)
        )
        with connection.cursor() as cursor:
            cursor.execute(SEED_RUNS, {"minutes": args.minutes})
            cursor.execute(
                "UPDATE celery_driftsafe_periodictask SET "
                "next_slot_at = date_trunc('minute', now()) + interval '1 minute', "
                "due_at = date_trunc('minute', now()) + interval '1 minute', "
                "last_slot_at = date_trunc('minute', now()) - interval '1 minute'"
            )
            cursor.execute("ANALYZE")
        total = Run.objects.count()
        print(
            f"seeded {args.tasks} tasks, {total:,} runs "
            f"({args.tasks * min(args.minutes, 60):,} in the last hour) "
            f"in {time.perf_counter() - started:.1f} s"
        )

        User.objects.create_superuser("bench", "bench@example.com", "pw")
        client = Client()
        client.force_login(User.objects.get(username="bench"))
        dashboard = reverse("admin:celery_driftsafe_dashboard")
        rows = []
        for name, url in (
            ("admin cluster dashboard", dashboard),
            ("metrics view", "/driftsafe/metrics"),
        ):
            queries: list[str] = []

            def count(execute, sql, params, many, context, queries=queries):  # type: ignore[no-untyped-def]
                queries.append(sql)
                return execute(sql, params, many, context)

            with connection.execute_wrapper(count):
                assert client.get(url).status_code == 200
            median, worst = timed(lambda url=url: client.get(url), args.repeat)
            rows.append((name, median, worst, len(queries)))
        print(f"\n{'page':<26}{'median':>10}{'worst':>10}{'queries':>9}")
        for name, median, worst, count in rows:
            print(f"{name:<26}{median * 1000:>8.0f} ms{worst * 1000:>7.0f} ms{count:>9}")

        calls = 200_000
        result = ClaimResult()
        now = django.utils.timezone.now()
        print(f"\n{'hook (one call)':<42}{'metrics off':>12}{'metrics on':>12}")
        for label, hook in (
            ("execution(task, outcome)", lambda: metrics.execution("bench.work", "succeeded")),
            (
                "round_done(result, now, began, ended)",
                lambda: metrics.round_done(result, now, 0.0, 0.01),
            ),
        ):
            off, _ = timed(lambda hook=hook: [hook() for _ in range(calls)], 1)
            with override_settings(DRIFTSAFE={**settings.DRIFTSAFE, "WORKER_METRICS_PORT": 0}):
                hook()
                on, _ = timed(lambda hook=hook: [hook() for _ in range(calls)], 1)
            print(f"{label:<42}{off / calls * 1e9:>9.0f} ns{on / calls * 1e9:>9.0f} ns")


if __name__ == "__main__":
    main()
