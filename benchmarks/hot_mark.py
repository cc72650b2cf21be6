"""What a HOT mark would save (PostgreSQL only): the run table's insert and its mark to
``dispatched`` as a burst does them (500 runs a statement, each batch marked right after its
insert), on copies of the run table with all its indexes, once as it is and once as a
redesign would need it for the mark to be a HOT update (no index reads ``status``, the table
filled to ``--fillfactor`` so a page has room for the new row versions).

    python -m benchmarks hot-mark [--runs 100000] [--waves 3] [--fillfactor 50 85] [--ledger N]

Prints the backend's CPU a run for the insert and for the mark, and the share of marks that
were HOT. ``--ledger N`` first puts N finished runs of the same tasks (``--runs`` of them, one a
minute each, going back from the first wave) into each copy, its secondary indexes built after
(as ``burst-profile --ledger``), so that each task's new run lands on a leaf of its own in the
(task, slot) index. Needs the test services and the test dependencies (it runs in
``tests.settings``).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from benchmarks.django_db import fresh_databases
from benchmarks.run_table import fill_fast
from celery_driftsafe.testing.processes import proc_stats

BATCH = 500
INSERT = """INSERT INTO {table} (periodic_task_id, task_name, kind, slot, status, claimed_by,
    claimed_at, celery_task_id, fencing_token, dispatch_attempts, duplicate_deliveries, worker,
    error, message, attempt, missed_count, expires_at)
  SELECT i, 'bench.tick', 'scheduled', %(slot)s, 'claimed', 'bench-node', now(),
    md5(i::text || %(slot)s::text), 0, 1, 0, '', '', '{{"args": [], "kwargs": {{}}}}', 0, 1,
    %(slot)s::timestamptz + interval '1 day'
  FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS i RETURNING id"""
#: The publisher's mark (publisher._mark_dispatched), and the same without ``status``.
_MARK = {
    False: "UPDATE {table} SET dispatched_at = now(), retry_at = NULL, "
    "error = CASE WHEN status = 'claimed' THEN '' ELSE error END, "
    "status = CASE WHEN status = 'claimed' THEN 'dispatched' ELSE status END "
    "WHERE id = ANY(%(ids)s) AND dispatched_at IS NULL",
    True: "UPDATE {table} SET dispatched_at = now(), retry_at = NULL, error = '' "
    "WHERE id = ANY(%(ids)s) AND dispatched_at IS NULL",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100_000, help="runs a wave")
    parser.add_argument("--waves", type=int, default=3)
    parser.add_argument("--fillfactor", type=int, nargs="+", default=[50, 85])
    parser.add_argument("--ledger", type=int, default=0, help="finished runs put in first")
    args = parser.parse_args()
    with fresh_databases():
        from django.db import connection

        with connection.cursor() as cursor:
            _measure(cursor, "as it is", "", False, args)
            for fillfactor in args.fillfactor:
                _measure(
                    cursor, f"no index on status, fillfactor {fillfactor}", fillfactor, True, args
                )


def _measure(cursor: Any, label: str, fillfactor: Any, hot: bool, args: Any) -> None:
    table = "bench_hot_mark"
    cursor.execute(f"DROP TABLE IF EXISTS {table}")
    cursor.execute(f"CREATE TABLE {table} (LIKE celery_driftsafe_run INCLUDING ALL)")
    if hot:
        cursor.execute(f"ALTER TABLE {table} SET (fillfactor = {int(fillfactor)})")
        cursor.execute(
            "SELECT indexname FROM pg_indexes WHERE tablename = %s AND indexdef LIKE %s",
            [table, "%(status%"],
        )
        for (name,) in cursor.fetchall():  # the same number of indexes, none on status
            cursor.execute(f'DROP INDEX "{name}"')
            cursor.execute(f'CREATE INDEX "{name}" ON {table} (claimed_at, id)')
    pid = prepared_backend(cursor, table, args.ledger, args.runs, f"{label}: ")

    def backend_cpu() -> float:  # its CPU seconds (the benchmark runs beside its server)
        return proc_stats(pid)[1]

    for wave in range(args.waves):
        spent = {"insert": 0.0, "mark": 0.0}
        slot = f"2026-01-01T00:{wave:02d}:00+00:00"
        for first in range(0, args.runs, BATCH):
            last = min(first + BATCH, args.runs) - 1
            before = backend_cpu()
            cursor.execute(INSERT.format(table=table), {"slot": slot, "first": first, "last": last})
            ids = [row[0] for row in cursor.fetchall()]
            middle = backend_cpu()
            cursor.execute(_MARK[hot].format(table=table), {"ids": ids})
            spent["insert"] += middle - before
            spent["mark"] += backend_cpu() - middle
        cursor.execute("SELECT pg_stat_force_next_flush()")  # as this statement ends
        cursor.execute(
            "SELECT n_tup_hot_upd, n_tup_upd FROM pg_stat_user_tables WHERE relname = %s", [table]
        )
        hot_updates, updates = cursor.fetchone()
        print(
            f"{label}, wave {wave + 1}: insert {1e6 * spent['insert'] / args.runs:.1f} µs, "
            f"mark {1e6 * spent['mark'] / args.runs:.1f} µs of the backend's CPU a run; "
            f"{100 * hot_updates / max(updates, 1):.0f}% of marks so far HOT"
        )
    cursor.execute(f"SELECT pg_total_relation_size('{table}'), pg_relation_size('{table}')")
    total, heap = cursor.fetchone()
    runs = args.runs * args.waves + args.ledger
    print(f"{label}: {total / runs:.0f} bytes a run with its indexes, {heap / runs:.0f} of heap")
    cursor.execute(f"DROP TABLE {table}")


def prepared_backend(cursor: Any, table: str, ledger: int, tasks: int, label: str = "") -> int:
    """Fill ``table`` with ``ledger`` finished runs of ``tasks`` tasks first (if any, saying
    how long it took); the process id of ``cursor``'s backend, whose CPU the caller reads."""
    if ledger:
        started = time.perf_counter()
        fill_ledger(table, ledger, tasks)
        print(f"{label}{ledger:,} runs written in {time.perf_counter() - started:.0f} s")
    cursor.execute("SELECT pg_backend_pid()")
    pid: int = cursor.fetchone()[0]
    return pid


def fill_ledger(table: str, runs: int, tasks: int) -> None:
    """``runs`` succeeded runs of ``tasks`` tasks, one a minute each before the first wave,
    written with the copy's secondary indexes dropped and built after (``fill_fast``)."""
    from django.db import connection

    def write() -> None:
        with connection.cursor() as cursor:
            for first in range(0, runs, 1_000_000):
                cursor.execute(
                    f"""INSERT INTO {table} (periodic_task_id, task_name, kind, slot, status,
                        claimed_by, claimed_at, dispatched_at, started_at, finished_at,
                        celery_task_id, fencing_token, dispatch_attempts, duplicate_deliveries,
                        worker, error, message, attempt, missed_count)
                      SELECT i %% %(tasks)s, 'bench.tick', 'scheduled', s, 'succeeded',
                        'old-node', s, s, s, s, md5(i::text), 0, 1, 0, 'w', '', '{{}}', 0, 1
                      FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS i,
                        LATERAL (SELECT '2026-01-01T00:00:00+00:00'::timestamptz
                                 - make_interval(mins => (1 + i / %(tasks)s)::int)) AS t(s)""",
                    {"tasks": tasks, "first": first, "last": min(first + 1_000_000, runs) - 1},
                )

    fill_fast(connection, write, table)
    with connection.cursor() as cursor:
        cursor.execute(f"VACUUM ANALYZE {table}")
