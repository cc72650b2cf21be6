"""The admin with a big ledger: N runs of T tasks on PostgreSQL, each list page, filter and
change page timed through Django's test client (the whole request: queries and rendering).

    python -m benchmarks.bench_admin [--runs 10000000] [--tasks 10000] [--repeat 5]

Self-contained: it creates and drops its own test database on the test PostgreSQL
(``DRIFTSAFE_TEST_*`` variables, see tests/settings.py); the ledger is written by PostgreSQL
itself (``generate_series``), its indexes built after the fill, then analysed (as autovacuum
would). Prints one row a page: median and slowest of ``--repeat`` requests after one warm-up,
the queries it made, and its slowest query.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from benchmarks.django_db import fresh_databases
from benchmarks.run_table import fill_fast, insert_runs

os.environ.setdefault("DRIFTSAFE_TEST_REDIS_DB", "14")  # within a default Redis's 16

NODES = ("beat-a:101:0a1b2c3d", "beat-b:202:1b2c3d4e", "beat-c:303:2c3d4e5f")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10_000_000)
    parser.add_argument("--tasks", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--profile", metavar="PAGE", help="cProfile one page (its name)")
    args = parser.parse_args()

    with fresh_databases(test_environment=False):  # a served page renders uninstrumented
        _run(args)


def _run(args: argparse.Namespace) -> None:
    from django.contrib.auth.models import User
    from django.db import connection
    from django.test import Client
    from django.urls import reverse

    from celery_driftsafe.models import BeatNode, PeriodicTask

    now = datetime.now(UTC).replace(microsecond=0)
    PeriodicTask.objects.bulk_create(
        (
            PeriodicTask(
                name=f"task-{i:05d}",
                task="bench.tick",
                schedule_kind="interval",
                interval_every=60,
                interval_anchor=now,
                next_slot_at=now + timedelta(seconds=i % 60),
                kwargs={"n": i},
            )
            for i in range(args.tasks)
        ),
        batch_size=5000,
    )
    BeatNode.objects.bulk_create(
        BeatNode(
            node_id=node, hostname=node.split(":")[0], pid=i, started_at=now, last_heartbeat_at=now
        )
        for i, node in enumerate(NODES)
    )
    started = time.perf_counter()
    fill_fast(connection, lambda: _fill(connection, args.runs, args.tasks, now))
    fill = time.perf_counter() - started
    started = time.perf_counter()
    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE celery_driftsafe_run")
        cursor.execute("ANALYZE celery_driftsafe_periodictask")
        cursor.execute("SELECT pg_total_relation_size('celery_driftsafe_run')")
        (size,) = cursor.fetchone()
    print(
        f"ledger: {args.runs:,} runs of {args.tasks:,} tasks written in {fill:.0f} s, "
        f"analysed in {time.perf_counter() - started:.0f} s; {size / 2**30:.1f} GiB"
    )

    User.objects.create_superuser("bench", "bench@example.com", "bench")
    client = Client()
    client.force_login(User.objects.get(username="bench"))
    runs = reverse("admin:celery_driftsafe_run_changelist")
    tasks = reverse("admin:celery_driftsafe_periodictask_changelist")
    task = PeriodicTask.objects.order_by("pk")[args.tasks // 2]
    failing = PeriodicTask.objects.order_by("pk")[args.tasks // 2 + 1]  # 1 in 100 always fails
    with connection.cursor() as cursor:
        cursor.execute("SELECT max(id) FROM celery_driftsafe_run")
        (last_run,) = cursor.fetchone()
        cursor.execute("SELECT celery_task_id FROM celery_driftsafe_run WHERE id = %s", [last_run])
        (last_task_id,) = cursor.fetchone()
    pages = [
        ("run list", runs),
        ("run list, page 2", runs + "?p=1"),
        ("run list, page 50", runs + "?p=49"),
        ("runs: status failed", runs + "?status__exact=failed"),
        ("runs: status succeeded", runs + "?status__exact=succeeded"),
        ("runs: status started", runs + "?status__exact=started"),
        ("runs: needs attention", runs + "?attention=stuck"),
        ("runs: kind manual", runs + "?kind__exact=manual"),
        ("runs: node admin", runs + "?node=admin"),
        ("runs: node beat-c", runs + f"?node={NODES[2]}"),
        ("runs: one task", runs + f"?periodic_task={task.pk}"),
        ("runs: one task, failed", runs + f"?periodic_task={failing.pk}&status__exact=failed"),
        ("runs: search task name", runs + f"?q={task.name}"),
        ("runs: search 1,000 tasks", runs + "?q=task-05"),
        ("runs: search Celery name", runs + "?q=bench.tick"),
        ("runs: search a task id", runs + f"?q={last_task_id}"),
        ("runs: search, no match", runs + "?q=no-such-run"),
        ("run change page", reverse("admin:celery_driftsafe_run_change", args=[last_run])),
        ("task list", tasks),
        ("task list, last page", tasks + f"?p={max(args.tasks // 100 - 1, 0)}"),
        ("tasks: last run failed", tasks + "?last_run=failed"),
        ("tasks: disabled", tasks + "?enabled__exact=0"),
        ("tasks: search", tasks + "?q=task-0042"),
        ("task change page", reverse("admin:celery_driftsafe_periodictask_change", args=[task.pk])),
    ]
    from django.test.utils import CaptureQueriesContext

    print(
        f"\n{'page':<28}{'median':>9}{'slowest':>9}{'queries':>9}{'rows':>7}{'slowest query':>15}"
    )
    if args.profile:
        import cProfile
        import pstats

        url = dict(pages)[args.profile]
        client.get(url)
        profile = cProfile.Profile()
        profile.runcall(client.get, url)
        pstats.Stats(profile).sort_stats("cumulative").print_stats(40)
    for name, url in pages:
        client.get(url)  # warm-up: caches, the session
        times = []
        for _ in range(args.repeat):
            with CaptureQueriesContext(connection) as queries:
                t0 = time.perf_counter()
                response = client.get(url)
                times.append(1000 * (time.perf_counter() - t0))
            assert response.status_code == 200, (url, response.status_code)
        cl = (getattr(response, "context_data", None) or {}).get("cl")
        rows = len(cl.result_list) if cl is not None else 1
        slowest = max(float(q["time"]) for q in queries.captured_queries) * 1000
        print(
            f"{name:<28}{statistics.median(times):>7.0f}ms{max(times):>7.0f}ms"
            f"{len(queries.captured_queries):>9}{rows:>7}{slowest:>13.0f}ms"
        )


def _fill(connection: Any, runs: int, tasks: int, now: datetime) -> None:
    """``runs`` runs, one a minute for each task going back from ``now``: 97% succeeded, 1%
    failed, 1% skipped, 1% missed; every 10,000th a manual run from the admin; the last
    minute's runs of a few tasks in flight; claimed by three beats in turn."""
    insert_runs(
        connection,
        runs,
        tasks,
        now,
        task_name="bench.tick",
        kind="CASE WHEN i %% 10000 = 7 THEN 'manual' ELSE 'scheduled' END",
        status="CASE WHEN i < 50 THEN 'started' WHEN i %% 100 = 1 THEN 'failed' "
        "WHEN i %% 100 = 2 THEN 'skipped' WHEN i %% 100 = 3 THEN 'missed' "
        "ELSE 'succeeded' END",
        claimed_by="CASE WHEN i %% 10000 = 7 THEN 'admin:ops' "
        "ELSE (%(nodes)s::text[])[1 + (i / %(tasks)s) %% 3] END",
        worker="celery@worker-1",
        failed="i %% 100 = 1",
        params={"nodes": list(NODES)},
    )


if __name__ == "__main__":
    main()
