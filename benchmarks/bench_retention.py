"""Retention at scale: a ledger of DAYS days of runs at TASKS tasks a minute, pruned while the
beat's claim loop (claim, publish, mark: the scheduler's own calls, in this process, as
``bench_burst`` does) keeps claiming; claim latency before, during and after the pruning.
Then what a run costs: PostgreSQL bytes per run (table and indexes), Redis bytes per fencing
counter, database bytes per lock row, and the sizing table they give.

    python -m benchmarks.bench_retention [--tasks 10000] [--days 1] [--phase 60]

Self-contained: it creates and drops its own test database on the test PostgreSQL
(``DRIFTSAFE_TEST_*`` variables, see tests/settings.py) and uses Redis databases
``DRIFTSAFE_TEST_REDIS_DB`` (broker) and ``+1`` (fencing counters), emptied before and after.
The ledger is written by PostgreSQL itself (``generate_series``), its secondary indexes built
after the fill (``--incremental``: in place during it). Needs the test dependencies installed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from benchmarks.django_db import fresh_databases
from benchmarks.run_table import fill_fast, insert_runs

os.environ.setdefault("DRIFTSAFE_TEST_REDIS_DB", "14")  # and 15: within a default Redis's 16

MINUTE = timedelta(minutes=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=10_000, help="tasks, each firing a minute")
    parser.add_argument("--days", type=float, default=1.0, help="days of runs in the ledger")
    parser.add_argument(
        "--keep-hours",
        type=float,
        default=1.0,
        help="RUN_RETENTION_SECONDS of the pruning, in hours",
    )
    parser.add_argument(
        "--phase", type=float, default=60.0, help="seconds of claiming before and after the pruning"
    )
    parser.add_argument(
        "--prune-seconds",
        type=float,
        default=300.0,
        help="the pruning phase ends after this long (or when done)",
    )
    parser.add_argument(
        "--batch-size", type=int, default=None, help="runs a batch (default: PRUNE_BATCH_SIZE)"
    )
    parser.add_argument(
        "--duty",
        type=float,
        default=None,
        help="share of the pass spent deleting (default: PRUNE_DUTY_CYCLE)",
    )
    parser.add_argument(
        "--incremental",
        action="store_true",
        help="fill with every index in place (the size a ledger grown by "
        "claims has; slower) instead of building them after the fill",
    )
    parser.add_argument(
        "--fences",
        type=int,
        default=100_000,
        help="fencing counters written to measure Redis memory",
    )
    args = parser.parse_args()

    with fresh_databases():
        import redis
        from django.conf import settings

        server = settings.DRIFTSAFE["REDIS_URL"].rsplit("/", 1)[0]
        base_db = int(settings.DRIFTSAFE["REDIS_URL"].rsplit("/", 1)[1])
        broker_url = f"{server}/{base_db}"
        fence_url = f"{server}/{base_db + 1}"
        broker = redis.Redis.from_url(broker_url)
        fences = redis.Redis.from_url(fence_url)
        broker.flushdb()
        fences.flushdb()
        try:
            _run(args, broker_url, fences)
        finally:
            broker.flushdb()
            fences.flushdb()
            broker.close()
            fences.close()


def _run(args: argparse.Namespace, broker_url: str, fences: Any) -> None:
    from celery import Celery
    from django.db import connection

    from celery_driftsafe.models import PeriodicTask

    app = Celery("retention", broker=broker_url, set_as_current=False)
    app.conf.task_default_queue = "retention"

    @app.task(name="retention.tick", shared=False)
    def tick(**kwargs: Any) -> None:
        return None

    # Tasks every minute, their slots spread over the minute: TASKS/60 slots fall due a second.
    now = datetime.now(UTC).replace(second=0, microsecond=0)
    base = now - timedelta(days=args.days + 1)
    PeriodicTask.objects.bulk_create(
        (
            PeriodicTask(
                name=f"t-{i}",
                task="retention.tick",
                schedule_kind="interval",
                interval_every=60,
                interval_anchor=base + timedelta(seconds=i % 60),
                next_slot_at=now + timedelta(seconds=i % 60),
                kwargs={"n": i},
            )
            for i in range(args.tasks)
        ),
        batch_size=5000,
    )
    rows = int(args.tasks * 1440 * args.days)
    started = time.perf_counter()
    if args.incremental:
        _fill_ledger(connection, rows, args.tasks, now)
    else:
        fill_fast(connection, lambda: _fill_ledger(connection, rows, args.tasks, now))
    fill = time.perf_counter() - started
    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE celery_driftsafe_run")
    sizes = _sizes(connection)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT indexrelid::regclass::text, pg_relation_size(indexrelid) "
            "FROM pg_index WHERE indrelid = 'celery_driftsafe_run'::regclass "
            "ORDER BY 2 DESC"
        )
        indexes = ", ".join(f"{name} {size / rows:.0f}" for name, size in cursor.fetchall())
    print(
        f"ledger: {rows:,} runs ({args.days:g} days of {args.tasks:,} tasks a minute) "
        f"written in {fill:.0f} s; run table {sizes['table'] / 2**20:,.0f} MiB + indexes "
        f"{sizes['indexes'] / 2**20:,.0f} MiB = {sizes['total'] / rows:.0f} bytes a run\n"
        f"  index bytes a run: {indexes}"
    )

    with connection.cursor() as cursor:  # every task's next slot: the next minute, spread
        cursor.execute("""UPDATE celery_driftsafe_periodictask SET next_slot_at =
                          CASE WHEN g > now() THEN g ELSE g + interval '1 minute' END,
                          due_at = CASE WHEN g > now() THEN g ELSE g + interval '1 minute' END
                          FROM (SELECT id AS task, date_trunc('minute', now())
                                + ((id - min(id) OVER ()) % 60) * interval '1 second' AS g
                                FROM celery_driftsafe_periodictask) AS grid
                          WHERE id = grid.task""")
    claims = Claims(app)
    retention: dict[str, Any] = {
        "RUN_RETENTION_SECONDS": args.keep_hours * 3600,
        "FAILED_RUN_RETENTION_SECONDS": args.keep_hours * 3600,
    }
    # the pruning constants, changed through the benchmarks' own setting
    from django.conf import settings

    pruning: dict[str, Any] = dict(getattr(settings, "DRIFTSAFE_INTERNALS", {}))
    if args.batch_size is not None:
        pruning["PRUNE_BATCH_SIZE"] = args.batch_size
    if args.duty is not None:
        pruning["PRUNE_DUTY_CYCLE"] = args.duty
    from django.test import override_settings

    with override_settings(DRIFTSAFE={**_driftsafe(), **retention}, DRIFTSAFE_INTERNALS=pruning):
        before = claims.measure(args.phase)
        pruned, prune_seconds, during = _prune_while_claiming(claims, args)
        after = claims.measure(args.phase)
    from celery_driftsafe.conf import build_settings

    merged = build_settings({**_driftsafe(), **retention}, internals=pruning)
    print(
        f"\npruning (batches of {merged.prune_batch_size}, duty cycle "
        f"{merged.prune_duty_cycle:g}, keep {args.keep_hours:g} h): "
        f"{pruned.runs:,} runs deleted in {prune_seconds:.0f} s = "
        f"{pruned.runs / max(prune_seconds, 1e-9):,.0f} runs/s "
        f"({pruned.batches} batches, {pruned.seconds:.1f} s in statements, "
        f"{1000 * pruned.seconds / max(pruned.batches, 1):.0f} ms a batch); "
        f"new runs arrive at {args.tasks / 60:,.0f}/s"
    )
    print(
        f"\n{'claim loop':<10}{'rounds':>8}{'runs':>8}{'claim p50':>11}{'p99':>9}"
        f"{'max':>9}{'round p50':>11}{'p99':>9}"
    )
    for name, stats in (("before", before), ("during", during), ("after", after)):
        print(
            f"{name:<10}{stats['rounds']:>8}{stats['runs']:>8}"
            f"{stats['claim_p50']:>9.1f}ms{stats['claim_p99']:>7.1f}ms"
            f"{stats['claim_max']:>7.1f}ms{stats['round_p50']:>9.1f}ms"
            f"{stats['round_p99']:>7.1f}ms"
        )
    _sizing(connection, fences, args, sizes["total"] / rows)


def _driftsafe() -> dict[str, Any]:
    from django.conf import settings

    return dict(settings.DRIFTSAFE)


def _fill_ledger(connection: Any, rows: int, tasks: int, now: datetime) -> None:
    """``rows`` finished runs, one a minute for each task going back from ``now`` (1% failed),
    shaped as the claim writes them, in chunks of a million."""
    insert_runs(
        connection,
        rows,
        tasks,
        now,
        task_name="retention.tick",
        kind="'scheduled'",
        status="CASE WHEN i %% 100 = 0 THEN 'failed' ELSE 'succeeded' END",
        claimed_by="'beat-host-1:41234:9f1c2a7e'",
        worker="celery@worker-host-1",
        failed="i %% 100 = 0",
    )


def _sizes(connection: Any) -> dict[str, int]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_table_size('celery_driftsafe_run'), "
            "pg_indexes_size('celery_driftsafe_run'), "
            "pg_total_relation_size('celery_driftsafe_run')"
        )
        table, indexes, total = cursor.fetchone()
    return {"table": table, "indexes": indexes, "total": total}


class Claims:
    """The beat's claim loop in this process: claim what is due at the wall clock's now,
    publish and mark it, wait 100 ms; each round's claim and whole-round times recorded."""

    def __init__(self, app: Any) -> None:
        from celery_driftsafe.claim.claimers import claimer_for
        from celery_driftsafe.publish.dispatcher import Dispatcher
        from celery_driftsafe.store.clock import SystemClock

        self.claimer = claimer_for()
        self.dispatcher = Dispatcher(app, SystemClock())

    def measure(self, seconds: float, stop: threading.Event | None = None) -> dict[str, Any]:
        claim_ms: list[float] = []
        round_ms: list[float] = []
        runs = 0
        ends = time.monotonic() + seconds
        while time.monotonic() < ends and not (stop is not None and stop.is_set()):
            t0 = time.perf_counter()
            result = self.claimer.claim(datetime.now(UTC), "bench-node")
            t1 = time.perf_counter()
            self.dispatcher.dispatch(result.runs)
            t2 = time.perf_counter()
            claim_ms.append(1000 * (t1 - t0))
            round_ms.append(1000 * (t2 - t1 + t1 - t0))
            runs += len(result.runs)
            time.sleep(0.1)
        return {
            "rounds": len(claim_ms),
            "runs": runs,
            **_stats("claim", claim_ms),
            **_stats("round", round_ms),
        }


def _stats(name: str, values: list[float]) -> dict[str, float]:
    if not values:
        return {f"{name}_p50": 0.0, f"{name}_p99": 0.0, f"{name}_max": 0.0}
    ordered = sorted(values)
    return {
        f"{name}_p50": statistics.median(ordered),
        f"{name}_p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        f"{name}_max": ordered[-1],
    }


def _prune_while_claiming(claims: Claims, args: argparse.Namespace) -> tuple[Any, float, Any]:
    """The beats' pruning pass (:class:`~celery_driftsafe.ledger.retention.Pruner`, pausing as long
    as each batch took) in a thread, while this thread claims."""
    from django.db import connections

    from celery_driftsafe.ledger.retention import Pruned, Pruner

    stop = threading.Event()
    done: list[Pruned] = []

    def prune() -> None:
        try:
            pruner = Pruner()
            done.append(pruner.prune(datetime.now(UTC), stop=stop.wait))
        finally:
            connections.close_all()
            stop.set()

    thread = threading.Thread(target=prune)
    started = time.perf_counter()
    thread.start()
    during = claims.measure(args.prune_seconds, stop)
    stop.set()
    thread.join()
    return done[0], time.perf_counter() - started, during


def _sizing(connection: Any, fences: Any, args: argparse.Namespace, run_bytes: float) -> None:
    """Bytes per fencing counter (Redis) and per lock row (database fallback); the table."""
    prefix = "driftsafe-bench:fence:run:"
    used = int(fences.info("memory")["used_memory"])
    pipe = fences.pipeline(transaction=False)
    for i in range(args.fences):
        pipe.set(f"{prefix}{10_000_000 + i}", 1 + i % 3, px=7 * 86_400_000)
        if i % 10_000 == 9_999:
            pipe.execute()
    pipe.execute()
    grown = int(fences.info("memory")["used_memory"]) - used
    sample = fences.memory_usage(f"{prefix}{10_000_000}") or 0
    fence_bytes = grown / args.fences
    with connection.cursor() as cursor:
        before = _relation(cursor, "celery_driftsafe_lock")
        cursor.execute("""INSERT INTO celery_driftsafe_lock (name, token, fencing_token, expires_at)
                          SELECT 'run:' || (10000000 + i), '', 2, now()
                          FROM generate_series(1, 100000) AS i""")
        cursor.execute("VACUUM ANALYZE celery_driftsafe_lock")
        lock_bytes = (_relation(cursor, "celery_driftsafe_lock") - before) / 100_000
    per_day = 1000 * 1440  # runs a day of 1,000 tasks firing every minute
    print(
        f"\nRedis: {fence_bytes:.0f} bytes a fencing counter (INFO used_memory over "
        f"{args.fences:,} keys with a TTL; MEMORY USAGE of one: {sample} bytes); "
        f"database lock row: {lock_bytes:.0f} bytes (table + index)"
    )
    print(
        f"\nsizing per 1,000 tasks firing every minute (1.44M runs a day), "
        f"{run_bytes:.0f} bytes a run:"
    )
    print(f"{'kept':<10}{'runs':>12}{'PostgreSQL':>12}{'Redis':>10}{'lock rows (no Redis)':>22}")
    for days in (1, 7, 30):
        n = per_day * days
        print(
            f"{days:>3} days{n:>14,}{n * run_bytes / 2**30:>10.1f}GiB"
            f"{n * fence_bytes / 2**30:>8.2f}GiB{n * lock_bytes / 2**30:>20.2f}GiB"
        )


def _relation(cursor: Any, name: str) -> int:
    cursor.execute("SELECT pg_total_relation_size(%s)", [name])
    size: int = cursor.fetchone()[0]
    return size


if __name__ == "__main__":
    main()
