"""The claim's insert on PostgreSQL, plain against ``ON CONFLICT DO NOTHING`` (PostgreSQL only):
500 runs a statement into a copy of the run table with all its indexes, waves of the two kinds
in alternation (so that a machine slowing down or a table growing weighs on both alike).

    python -m benchmarks claim-insert [--runs 100000] [--waves 3] [--ledger N]

Prints the backend's CPU a run for each wave. ``ON CONFLICT`` looks each row up in the
(task, slot) index before inserting it and descends that index again to insert its entry;
a plain insert descends it once. ``--ledger N`` first puts N finished runs of the same tasks
into the copy (``hot-mark --ledger``), so that each task's new run lands on a leaf of its own.
Needs the test services and the test dependencies (it runs in ``tests.settings``).
"""

from __future__ import annotations

import argparse
import statistics

from benchmarks.django_db import fresh_databases
from benchmarks.hot_mark import BATCH, INSERT, prepared_backend
from celery_driftsafe.testing.processes import proc_stats

KINDS = {
    "plain": INSERT,
    "on conflict": INSERT.replace("RETURNING id", "ON CONFLICT DO NOTHING RETURNING id"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100_000, help="runs a wave (and tasks)")
    parser.add_argument("--waves", type=int, default=3, help="waves of each kind")
    parser.add_argument("--ledger", type=int, default=0, help="finished runs put in first")
    args = parser.parse_args()
    if KINDS["on conflict"] == INSERT:
        raise SystemExit("hot_mark.INSERT no longer ends with RETURNING id")
    table = "bench_claim_insert"
    with fresh_databases():
        from django.db import connection

        with connection.cursor() as cursor:
            cursor.execute(f"CREATE TABLE {table} (LIKE celery_driftsafe_run INCLUDING ALL)")
            pid = prepared_backend(cursor, table, args.ledger, args.runs)
            spent: dict[str, list[float]] = {kind: [] for kind in KINDS}
            for wave in range(2 * args.waves):
                kind = list(KINDS)[wave % 2]
                slot = f"2026-01-01T00:{wave:02d}:00+00:00"
                cpu = 0.0
                for first in range(0, args.runs, BATCH):
                    last = min(first + BATCH, args.runs) - 1
                    before = proc_stats(pid)[1]
                    cursor.execute(
                        KINDS[kind].format(table=table),
                        {"slot": slot, "first": first, "last": last},
                    )
                    if len(cursor.fetchall()) != last - first + 1:
                        raise SystemExit(f"wave {wave + 1}: rows missing from the insert")
                    cpu += proc_stats(pid)[1] - before
                spent[kind].append(1e6 * cpu / args.runs)
                figure = spent[kind][-1]
                print(f"wave {wave + 1}, {kind}: {figure:.1f} µs of the backend's CPU a run")
            for kind, figures in spent.items():
                print(f"{kind}: median {statistics.median(figures):.1f} µs a run")
            cursor.execute(f"DROP TABLE {table}")
