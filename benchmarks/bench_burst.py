"""Where a slot's time goes in a burst: N interval tasks all due at one instant, worked through
by the beat's own round (claim, publish, mark) in this process, on PostgreSQL and a Redis
broker, with a per-stage breakdown.

    python -m benchmarks.bench_burst [--tasks 20000] [--profile] [--ledger 0] [--explain]
    python -m benchmarks.bench_burst --tasks 100000 --compare 2

The stages are timed around the scheduler's own calls, so the figures are those of a real
round minus process start-up; ``--profile`` adds cProfile's top functions. ``--ledger N``
first fills the run ledger with N finished runs of the same tasks (the cost of a big ledger);
``--explain`` prints PostgreSQL's plan of every statement of the first round and of the
scheduler's other statements (next due instant, outbox, reconciliation). ``--compare R``
works through a first wave (every message built), then R rounds of three waves over the same
tasks: the default, OpenTelemetry's Celery instrumentation active (its publish-signal
receivers; the SDK's tracer provider, spans batched to an exporter that drops them), the
fast publish path off (``FAST_PUBLISH = False``) and publish-signal receivers that do nothing
(the fast path's own cost of serving receivers), and prints them side by side. Needs the
test services (PostgreSQL, Redis) and the test dependencies installed.
"""

from __future__ import annotations

import argparse
import resource
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from statistics import median
from typing import Any

from benchmarks.django_db import fresh_databases
from benchmarks.run_table import TASK_ID_SQL, fill_fast
from celery_driftsafe.testing.processes import proc_stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="cProfile's top functions of the last wave (with --compare: of the last "
        "wave of --profile-variant)",
    )
    parser.add_argument("--profile-file", help="with --profile: write cProfile's data here")
    parser.add_argument(
        "--profile-variant",
        default="instrumented (OpenTelemetry)",
        choices=VARIANTS,
        help="with --profile and --compare: the variant whose last wave is profiled",
    )
    parser.add_argument(
        "--ledger", type=int, default=0, help="finished runs put in the ledger first"
    )
    parser.add_argument("--explain", action="store_true")
    parser.add_argument(
        "--wal-by-relation",
        action="store_true",
        help="after each wave, the WAL it wrote by relation, full-page images apart "
        "(pg_walinspect, PostgreSQL 15 or later, a superuser)",
    )
    parser.add_argument(
        "--waves",
        type=int,
        default=1,
        help="waves worked through one after the other (the tasks' next slots, "
        "60 s apart): the first builds each task's message, the later "
        "ones show a running beat's cost",
    )
    parser.add_argument(
        "--compare",
        type=int,
        default=0,
        metavar="R",
        help="after a first wave, R rounds of a default wave, one with OpenTelemetry's "
        "instrumentation, one with the fast path off and one with publish-signal receivers "
        "that do nothing, side by side (instead of --waves)",
    )
    parser.add_argument(
        "--slow-publish",
        action="store_true",
        help="publish through Celery's apply_async (FAST_PUBLISH off)",
    )
    parser.add_argument(
        "--prebuild",
        action="store_true",
        help="first build every task's message ahead, as a beat does while nothing is due "
        "(celery_driftsafe.publish.prebuild), timed, and a later pass over the same tasks (the "
        "templates there), timed: the first wave then finds them built",
    )
    parser.add_argument(
        "--no-analyze",
        action="store_true",
        help="leave the tables without planner statistics, as a server with autovacuum off "
        "(or a restored dump, or tasks created a moment ago) has them",
    )
    parser.add_argument(
        "--behind",
        type=float,
        default=0,
        help="hours the tasks' first slot lies before the wave (no beat ran meanwhile): the "
        "first wave is then an outage's catch-up, one run and one span of missed slots a task",
    )
    parser.add_argument(
        "--before-wave",
        action="append",
        default=[],
        metavar="N:SQL",
        help="run SQL on the benchmark's connection before wave N (1 for the first), then "
        "reload the server's configuration: e.g. '2:CHECKPOINT', "
        "\"3:ALTER SYSTEM SET wal_compression = 'lz4'\" (repeatable, in order; the "
        "benchmark does not undo an ALTER SYSTEM)",
    )
    parser.add_argument(
        "--keep-db",
        action="store_true",
        help="keep the test database for later runs (DRIFTSAFE_TEST_PG_TEST_NAME names it) "
        "and reuse one kept before: its tasks, due again after the last wave it saw, and its "
        "ledger as it stands (emptied when --ledger is 0); a big ledger is then written once "
        "and compared with an empty one in alternating runs",
    )
    parser.add_argument(
        "--crontab",
        action="store_true",
        help="the tasks are '* * * * *' crontabs (UTC) rather than 60 s intervals, the wave "
        "on a whole minute (not with --keep-db)",
    )
    parser.add_argument(
        "--broker-db",
        type=int,
        default=15,
        help="Redis database of the broker (emptied before and after)",
    )
    args = parser.parse_args()
    if args.crontab and args.keep_db:
        raise SystemExit("--crontab: not with --keep-db (a kept database's tasks are intervals)")
    with fresh_databases(keep=args.keep_db):
        _measure(args)


def _measure(args: Any) -> None:
    import redis
    from celery import Celery
    from django.conf import settings

    broker_url = f"{settings.DRIFTSAFE['REDIS_URL'].rsplit('/', 1)[0]}/{args.broker_db}"
    broker = redis.Redis.from_url(broker_url)
    broker.flushdb()
    try:
        from celery_driftsafe.claim.claimers import claimer_for
        from celery_driftsafe.publish.dispatcher import Dispatcher
        from celery_driftsafe.store.clock import SystemClock
        from tests.support.factories import many_interval_tasks

        app = Celery("burst", broker=broker_url, set_as_current=False)
        app.conf.task_default_queue = "burst"

        @app.task(name="burst.tick", shared=False)
        def tick(**kwargs: Any) -> None:
            return None

        from django.db import connection

        due = datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=1)
        if args.crontab:
            due = due.replace(second=0)
        kept = args.keep_db and _reuse(connection, args, due)
        if kept:
            due = kept
        else:
            many_interval_tasks(
                args.tasks,
                # Half a period off the wave: each task has one slot within the grace, as when
                # the slots are spread over the minute (the one before it is missed).
                due - timedelta(hours=args.behind, seconds=30 if args.behind else 0),
                name="burst-{i}",
                task="burst.tick",
                numbered_kwargs=True,
            )
            if args.crontab:
                _as_crontabs(connection, due - timedelta(hours=args.behind))
        if args.ledger and not kept:
            filled = time.perf_counter()
            _fill_ledger(connection, args.ledger, due)
            print(f"ledger: {args.ledger:,} runs written in {time.perf_counter() - filled:.0f} s")
        if not args.no_analyze:
            with connection.cursor() as cursor:
                cursor.execute("ANALYZE")
        claimer = claimer_for()
        plans: list[tuple[str, list[str]]] = []
        if args.explain:
            connection.execute_wrappers.append(_Explain(plans))
        if args.slow_publish:
            from django.test.utils import override_settings

            override_settings(DRIFTSAFE={**settings.DRIFTSAFE, "FAST_PUBLISH": False}).enable()
        dispatcher = Dispatcher(app, SystemClock())
        if args.prebuild:
            _prebuild(dispatcher, due, args.tasks)
        before = _before_waves(args.before_wave)
        variants = ["default"]
        if args.compare:
            args.waves = 1 + len(VARIANTS) * args.compare
            variants = ["first wave", *(list(VARIANTS) * args.compare)]
        figures: dict[str, list[tuple[float, float]]] = defaultdict(list)
        # --profile: the last wave, or with --compare the last of --profile-variant's
        profiled = args.waves - 1
        if args.compare:
            profiled = max(w for w in range(args.waves) if variants[w] == args.profile_variant)
        for wave in range(args.waves):
            variant = variants[wave % len(variants)] if args.compare else "default"
            if args.compare:
                print(f"wave {wave + 1}: {variant}")
            for sql in before.get(wave + 1, []):
                with connection.cursor() as cursor:
                    cursor.execute(sql)
                    cursor.execute("SELECT pg_reload_conf()")
                time.sleep(0.5)  # every backend has read the configuration again
                print(f"before wave {wave + 1}: {sql}")
            with _variant(variant):
                published, elapsed, cpu, rounds, stages, cpu_stages = _wave(
                    args,
                    claimer,
                    dispatcher,
                    connection,
                    app,
                    plans,
                    due + timedelta(seconds=60 * wave),
                    profile=args.profile and wave == profiled,
                )
            figures[variant].append((published / elapsed, 1e6 * cpu / max(published, 1)))
            print(
                f"wave {wave + 1}: {args.tasks} tasks due at one instant: {published} "
                f"dispatched, {broker.llen('burst')} messages queued, {rounds} rounds, "
                f"{elapsed:.2f} s, {published / elapsed:.0f} slots/s; this process used "
                f"{cpu:.2f} s of CPU ({100 * cpu / elapsed:.0f}% of one core); "
                f"fast path {dispatcher.fast.published}, apply_async "
                f"{dispatcher.fast.declined} messages so far; peak RSS "
                f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB"
            )
            print(f"  {'stage':<16}{'wall s':>8}{'µs/slot':>9}{'CPU µs/slot':>13}")
            for stage, seconds in stages.items():
                print(
                    f"  {stage:<16}{seconds:8.2f}{1e6 * seconds / max(published, 1):9.1f}"
                    f"{1e6 * cpu_stages[stage] / max(published, 1):13.1f}"
                )
            broker.delete("burst")
        if args.compare:
            _compare_table(figures, args.tasks)
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE")
            cursor.execute(
                "SELECT (SELECT count(*) FROM celery_driftsafe_run), "
                "pg_total_relation_size('celery_driftsafe_run'), "
                "(SELECT count(*) FROM celery_driftsafe_periodictask), "
                "pg_total_relation_size('celery_driftsafe_periodictask')"
            )
            runs, run_bytes, tasks, task_bytes = cursor.fetchone()
        print(
            f"on disk, with indexes: {task_bytes / max(tasks, 1):.0f} bytes a task, "
            f"{run_bytes / max(runs, 1):.0f} bytes a run ({runs:,} runs)"
        )
    finally:
        broker.flushdb()
        broker.close()
        if args.wal_by_relation:  # a failed wave must not leave the server keeping its WAL
            from django.db import connection as open_connection

            with open_connection.cursor() as cursor:
                _drop_wal_slot(cursor)


#: The waves ``--compare`` puts side by side, in the order each round works them through.
VARIANTS = ("default", "instrumented (OpenTelemetry)", "fast path off", "no-op receivers")


@contextmanager
def _variant(name: str) -> Iterator[None]:
    """The setting of one wave of ``--compare``: OpenTelemetry's Celery instrumentation
    active, or the fast publish path off, or neither (and neither left on after it)."""
    if name == "instrumented (OpenTelemetry)":
        from opentelemetry import trace
        from opentelemetry.instrumentation.celery import CeleryInstrumentor

        if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
            CeleryInstrumentor().instrument()
        else:  # the first time: the tracer provider too (it can be set once)
            from tests.e2e.tracing import install_opentelemetry

            install_opentelemetry()
        try:
            yield
        finally:
            CeleryInstrumentor().uninstrument()
    elif name == "fast path off":
        from django.conf import settings
        from django.test.utils import override_settings

        with override_settings(DRIFTSAFE={**settings.DRIFTSAFE, "FAST_PUBLISH": False}):
            yield
    elif name == "no-op receivers":
        from tests.e2e.tracing import connect_noop_receivers

        disconnect = connect_noop_receivers()
        try:
            yield
        finally:
            disconnect()
    else:
        yield


def _compare_table(figures: dict[str, list[tuple[float, float]]], tasks: int) -> None:
    """The waves of ``--compare`` side by side: each variant's median rate and CPU a slot,
    and its rate as a share of the default's."""
    base = median(rate for rate, _ in figures["default"])
    print(f"\n{tasks:,} tasks due at one instant, one beat's round in this process:")
    print(f"  {'':<30}{'waves':>6}{'slots/s':>9}{'% of default':>14}{'CPU µs/slot':>13}")
    for variant in VARIANTS:
        rates = [rate for rate, _ in figures[variant]]
        cpu = median(c for _, c in figures[variant])
        print(
            f"  {variant:<30}{len(rates):>6}{median(rates):>9.0f}"
            f"{100 * median(rates) / base:>13.0f}%{cpu:>13.1f}"
        )


def _reuse(connection: Any, args: Any, due: datetime) -> datetime | None:
    """In a kept database that holds the run's tasks, make them due again and return the
    instant: ``due``, or a minute after the last wave a kept run worked if that is later (its
    slots are in the ledger). ``None`` when the database is new (nothing kept)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*), max(next_slot_at) FROM celery_driftsafe_periodictask "
            "WHERE task = 'burst.tick'"
        )
        tasks, last = cursor.fetchone()
        if not tasks:
            return None
        if tasks != args.tasks or args.behind:
            raise SystemExit(
                f"--keep-db: the kept database holds {tasks:,} burst tasks, this run asks for "
                f"{args.tasks:,}{' and --behind' if args.behind else ''}: name another database "
                "(DRIFTSAFE_TEST_PG_TEST_NAME) or drop this one"
            )
        due = max(due, last)
        if not args.ledger:
            cursor.execute("TRUNCATE celery_driftsafe_run CASCADE")
        cursor.execute(
            "UPDATE celery_driftsafe_periodictask SET interval_anchor = %s, next_slot_at = %s",
            [due, due],
        )
        cursor.execute("SELECT count(*) FROM celery_driftsafe_run")
        (runs,) = cursor.fetchone()
        if runs < args.ledger:
            raise SystemExit(
                f"--keep-db: the kept ledger holds {runs:,} runs, fewer than --ledger "
                f"{args.ledger:,}: drop the database and fill it again"
            )
        cursor.execute("VACUUM celery_driftsafe_periodictask")
    print(f"kept database reused: {tasks:,} tasks due at {due.isoformat()}, {runs:,} runs")
    return due


def _as_crontabs(connection: Any, first: datetime) -> None:
    """Make every task a ``* * * * *`` crontab in UTC whose next slot is ``first`` (a whole
    minute)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE celery_driftsafe_periodictask SET schedule_kind = 'crontab', "
            "crontab_second = '0', crontab_minute = '*', crontab_hour = '*', "
            "crontab_day_of_month = '*', crontab_month_of_year = '*', "
            "crontab_day_of_week = '*', timezone = 'UTC', next_slot_at = %s, due_at = %s",
            [first, first],
        )


def _before_waves(specs: list[str]) -> dict[int, list[str]]:
    """``--before-wave N:SQL`` options by wave number; a malformed one stops the run."""
    by_wave: dict[int, list[str]] = {}
    for spec in specs:
        number, _, sql = spec.partition(":")
        if not number.strip().isdigit() or not sql.strip():
            raise SystemExit(f"--before-wave {spec!r}: expected N:SQL, N a wave number")
        by_wave.setdefault(int(number), []).append(sql.strip())
    return by_wave


def _prebuild(dispatcher: Any, due: datetime, tasks: int) -> None:
    """One whole pass of building ahead (no budget), timed."""
    from functools import partial

    from celery_driftsafe.claim.claimers import run_expiry
    from celery_driftsafe.conf import get_settings
    from celery_driftsafe.publish.prebuild import Prebuilder

    for what in ("built ahead", "a later pass, every template there"):
        ahead = Prebuilder(dispatcher.fast, partial(run_expiry, settings=get_settings()))
        started, cpu = time.perf_counter(), time.process_time()
        built = ahead.run(due, budget=float("inf"))
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
        print(
            f"{what}: {built} messages built, {getattr(ahead, 'read', '?')} tasks read in "
            f"full, in {elapsed:.2f} s ({1e6 * elapsed / tasks:.0f} µs a task; this process "
            f"{cpu:.2f} s of CPU)"
        )


def _wave(
    args: Any,
    claimer: Any,
    dispatcher: Any,
    connection: Any,
    app: Any,
    plans: list[tuple[str, list[str]]],
    due: datetime,
    *,
    profile: bool,
) -> tuple[int, float, float, int, dict[str, float], dict[str, float]]:
    """One wave, all due at ``due``: claimed and published round by round."""
    from celery_driftsafe.beat.gc_freeze import HeapKeeper
    from celery_driftsafe.models import Run

    stages: dict[str, float] = defaultdict(float)
    cpu_stages: dict[str, float] = defaultdict(float)
    profiler: Any = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    before = Run.objects.filter(status="dispatched", claimed_by="bench-node").count()
    server = _ServerCost(connection, keep_wal=args.wal_by_relation)
    started = time.perf_counter()
    cpu_started = time.process_time()
    rounds = 0
    claim_times: list[float] = []
    heap = HeapKeeper(time.monotonic)  # as a beat does before each round
    while True:
        heap.maybe_freeze()
        # The authority's now stays at the wave's instant: one wave is measured, not the
        # waves after it (a slow run would otherwise never end).
        now = due
        t0, c0 = time.perf_counter(), time.process_time()
        result = claimer.claim(now, "bench-node")
        t1, c1 = time.perf_counter(), time.process_time()
        outcome = dispatcher.dispatch(result.runs)
        t2, c2 = time.perf_counter(), time.process_time()
        if args.explain and rounds == 0:
            _explain_others(connection, app, plans)
            for wrapper in list(connection.execute_wrappers):
                connection.execute_wrappers.remove(wrapper)
        stages["claim"] += t1 - t0
        claim_times.append(t1 - t0)
        stages["publish + mark"] += t2 - t1
        cpu_stages["claim"] += c1 - c0
        cpu_stages["publish + mark"] += c2 - c1
        rounds += 1
        if not result.tasks_seen:
            break
        assert not outcome.refused and not outcome.deferred, outcome
    elapsed = time.perf_counter() - started
    cpu = time.process_time() - cpu_started
    if profiler is not None:
        import pstats

        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
        if args.profile_file:
            profiler.dump_stats(args.profile_file)
    for sql, plan in plans:
        print(f"\n{sql}\n  " + "\n  ".join(plan))
    plans.clear()
    published = Run.objects.filter(status="dispatched", claimed_by="bench-node").count() - before
    backend_cpu, wal = server.spent()
    tenth = max(len(claim_times) // 10, 1)
    print(
        "  a claim round, ms, by tenth of the wave: "
        + " ".join(
            f"{1e3 * sum(claim_times[i : i + tenth]) / len(claim_times[i : i + tenth]):.0f}"
            for i in range(0, len(claim_times), tenth)
        )
    )
    print(
        f"  PostgreSQL (this connection's backend): {1e6 * backend_cpu / max(published, 1):.1f} "
        f"µs of CPU and {wal / max(published, 1):,.0f} bytes of WAL a slot; "
        f"{server.checkpoints()} checkpoints began during the wave"
    )
    if args.wal_by_relation:
        server.wal_by_relation(max(published, 1))
    return published, elapsed, cpu, rounds, stages, cpu_stages


_WAL_SLOT = "driftsafe_burst_profile"
_CHECKPOINTS = "SELECT checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter"


def _drop_wal_slot(cursor: Any) -> None:
    """Drop the replication slot that keeps a wave's WAL, if there is one."""
    cursor.execute(
        "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = %s",
        [_WAL_SLOT],
    )


class _ServerCost:
    """The CPU this connection's PostgreSQL backend used and the WAL written since it was made
    (the server runs on this machine: its process's times are read from /proc)."""

    def __init__(self, connection: Any, *, keep_wal: bool = False) -> None:
        with connection.cursor() as cursor:
            if keep_wal:  # the WAL from here on stays until wal_by_relation has read it
                _drop_wal_slot(cursor)
                cursor.execute("SELECT pg_create_physical_replication_slot(%s, true)", [_WAL_SLOT])
            cursor.execute(f"SELECT pg_backend_pid(), pg_current_wal_lsn(), ({_CHECKPOINTS})")
            self._pid, self._lsn, self._checkpoints = cursor.fetchone()
        self._connection = connection
        self._cpu = proc_stats(self._pid)[1]

    def checkpoints(self) -> int:
        """Checkpoints the server began since this was made."""
        with self._connection.cursor() as cursor:
            cursor.execute(_CHECKPOINTS)
            (now,) = cursor.fetchone()
        return int(now - self._checkpoints)

    def spent(self) -> tuple[float, int]:
        with self._connection.cursor() as cursor:
            cursor.execute("SELECT pg_current_wal_lsn() - %s::pg_lsn", [self._lsn])
            (wal,) = cursor.fetchone()
        return proc_stats(self._pid)[1] - self._cpu, int(wal)

    def wal_by_relation(self, slots: int) -> None:
        """Print the WAL written since this was made by relation (each record counted for the
        first block it touches): bytes a slot, and how much of it full-page images are."""
        with self._connection.cursor() as cursor:
            try:
                cursor.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
                rows = self._by_relation(cursor)
            finally:
                _drop_wal_slot(cursor)
        print(f"  WAL by relation, a slot: {'records':>8}{'bytes':>9}{'FPI bytes':>11}{'FPIs':>7}")
        for name, records, length, fpi, fpis in rows:
            print(
                f"    {str(name)[:36]:<36}{records / slots:8.2f}{length / slots:9.0f}"
                f"{fpi / slots:11.0f}{fpis / slots:7.3f}"
            )

    def _by_relation(self, cursor: Any) -> list[tuple[Any, ...]]:
        cursor.execute(
            """SELECT coalesce(c.relname, w.node), count(*), sum(w.record_length),
                          sum(w.fpi_length), count(*) FILTER (WHERE w.fpi_length > 0)
                   FROM (SELECT record_length, fpi_length,
                                substring(block_ref from 'rel [0-9]+/[0-9]+/([0-9]+)') AS node
                         FROM pg_get_wal_records_info(%s::pg_lsn, pg_current_wal_flush_lsn())) w
                   LEFT JOIN pg_class c ON c.relfilenode::text = w.node
                   GROUP BY 1 ORDER BY 3 DESC LIMIT 15""",
            [self._lsn],
        )
        return list(cursor.fetchall())


def _fill_ledger(connection: Any, runs: int, before: datetime) -> None:
    """``runs`` succeeded runs of the tasks, one a minute each, going back from ``before``,
    written by PostgreSQL itself in chunks of a million, with the run table's plain indexes
    built after (``run_table.fill_fast``): tens of millions of rows in minutes, not hours. The
    primary key and the unique (task, slot) index grow row by row as in production."""
    fill_fast(connection, lambda: _write_ledger(connection, runs, before))


def _write_ledger(connection: Any, runs: int, before: datetime) -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT min(id), count(*) FROM celery_driftsafe_periodictask")
        first, tasks = cursor.fetchone()
        for start in range(0, runs, 1_000_000):
            cursor.execute(
                f"""INSERT INTO celery_driftsafe_run (periodic_task_id, task_name, kind, slot,
                   status, claimed_by, claimed_at, dispatched_at, started_at, finished_at,
                   celery_task_id, fencing_token, dispatch_attempts, duplicate_deliveries,
                   worker, error, message, attempt, missed_count)
                SELECT %(first)s + i %% %(tasks)s, 'burst.tick', 'scheduled', s, 'succeeded',
                   'old-node', s, s, s, s, {TASK_ID_SQL}, 1, 1, 0, 'w', '', '{{}}', 0, 1
                FROM generate_series(%(start)s, %(end)s) AS i,
                     LATERAL (SELECT %(before)s::timestamptz
                              - make_interval(mins => 1 + i / %(tasks)s)) AS t(s)""",
                {
                    "first": first,
                    "tasks": tasks,
                    "start": start,
                    "end": min(start + 1_000_000, runs) - 1,
                    "before": before,
                },
            )


class _Explain:
    """An execute wrapper that records PostgreSQL's plan of each statement before running it."""

    def __init__(self, plans: list[tuple[str, list[str]]]) -> None:
        self.plans = plans

    def __call__(self, execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if not many and sql.lstrip().split(None, 1)[0].upper() in (
            "SELECT",
            "INSERT",
            "UPDATE",
            "DELETE",
        ):
            raw = context["cursor"].cursor
            raw.execute("EXPLAIN " + sql, params)
            self.plans.append((_short(sql), [row[0][:200] for row in raw.fetchall()]))
        return execute(sql, params, many, context)


def _short(sql: str) -> str:
    text = " ".join(sql.split())
    return text if len(text) <= 200 else text[:197] + "..."


def _explain_others(connection: Any, app: Any, plans: list[tuple[str, list[str]]]) -> None:
    """The scheduler's statements outside the claim: next due instant, outbox, reconcile."""
    from datetime import timedelta as td

    from celery_driftsafe.beat.recovery import reconcile
    from celery_driftsafe.claim.outbox import reclaim_stale
    from celery_driftsafe.scheduler import DriftSafeScheduler

    now = datetime.now(UTC)
    DriftSafeScheduler.next_due(type("S", (), {"using": "default"})())  # type: ignore[arg-type]
    reclaim_stale(now, "bench-node", lease=td(seconds=30), dead_after=td(seconds=30))
    reconcile(now, lease=td(seconds=30), app=app)


if __name__ == "__main__":
    main()
