"""Scheduler throughput and lateness on PostgreSQL: N interval tasks (every 60 s, slots spread
evenly over the minute, so N/60 slots fall due each second), K beats, a fixed window.

    python benchmarks/bench_scheduler.py --tasks 10000 100000 --beats 1 2 --seconds 60

Prints one table row per (tasks, beats): start-up time (process launch -> node registered and
ready to claim), sustained
dispatches/s, dispatch lateness (dispatched_at - slot, authority time) p50/p99/max, slots due
in the window that were not dispatched in it, the beats' peak RSS and CPU, and statements per
claim round (measured separately with Django's query capture on a 500-task round).
Needs the test services (PostgreSQL, Redis) and the test dependencies installed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
os.environ.setdefault("DRIFTSAFE_TEST_DB", "postgres")

import psycopg  # noqa: E402

from tests.e2e.harness import E2ERun, real_now  # noqa: E402


def _proc_stats(pid: int) -> tuple[int, float]:
    """(RSS in kB, user+system CPU seconds) of a live process."""
    rss = 0
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return rss, (int(fields[11]) + int(fields[12])) / ticks


def _lateness(db: str, since: object, until: object) -> tuple[list[float], int, int]:
    with psycopg.connect(host="127.0.0.1", user="postgres", dbname=db) as conn:
        rows = conn.execute(
            "SELECT EXTRACT(EPOCH FROM dispatched_at - slot) FROM celery_driftsafe_run "
            "WHERE status = 'dispatched' AND slot >= %s AND slot < %s",
            (since, until),
        ).fetchall()
        stuck = conn.execute(
            "SELECT count(*) FROM celery_driftsafe_run WHERE status = 'claimed'"
        ).fetchone()[0]
        due_not_done = conn.execute(
            "SELECT count(*) FROM celery_driftsafe_periodictask WHERE next_slot_at < %s",
            (until,),
        ).fetchone()[0]
    return [float(r[0]) for r in rows], stuck, due_not_done


def _shift(db: str, delta: timedelta) -> None:
    with psycopg.connect(host="127.0.0.1", user="postgres", dbname=db) as conn:
        conn.execute(
            "UPDATE celery_driftsafe_periodictask SET interval_anchor = interval_anchor + %s, "
            "next_slot_at = next_slot_at + %s",
            (delta, delta),
        )


def _first_ready(db: str) -> object:
    """When the first beat had registered its node: start-up done, ready to claim."""
    with psycopg.connect(host="127.0.0.1", user="postgres", dbname=db) as conn:
        return conn.execute("SELECT min(started_at) FROM celery_driftsafe_beatnode").fetchone()[0]


def burst(tasks: int, beats: int) -> tuple[float, float]:
    """Capacity: every task due at the same instant; how long until all are dispatched?"""
    with tempfile.TemporaryDirectory() as tmp:
        run = E2ERun("postgresql", Path(tmp))
        try:
            parked = real_now() + timedelta(hours=1)
            run.tool("bulk_seed", {"count": tasks, "every": 3600, "start": parked.isoformat(),
                                   "spread": False})
            start = real_now() + timedelta(seconds=3)
            _shift(run.db_name, start - parked)
            for _ in range(beats):
                run.start_beat(0.0)
            done = None
            while done is None and real_now() < start + timedelta(seconds=600):
                time.sleep(0.5)
                with run.broker.pipeline(transaction=True) as pipe:
                    pipe.delete(run.queue)
                    pipe.execute()
                with psycopg.connect(host="127.0.0.1", user="postgres", dbname=run.db_name) as c:
                    left, last = c.execute(
                        "SELECT count(*) FILTER (WHERE status <> 'dispatched'), "
                        "max(dispatched_at) FROM celery_driftsafe_run"
                    ).fetchone()
                    count = c.execute("SELECT count(*) FROM celery_driftsafe_run").fetchone()[0]
                if count == tasks and left == 0:
                    done = last
            run.stop()
        finally:
            run.close()
    elapsed = (done - start).total_seconds() if done else float("nan")
    return elapsed, tasks / elapsed


def bench(tasks: int, beats: int, seconds: float) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        run = E2ERun("postgresql", Path(tmp))
        try:
            # Seed an hour ahead (seeding 100k rows takes a while), then move every slot so the
            # first ones fall due 3 s after the beats start: no backlog from the set-up.
            parked = real_now() + timedelta(hours=1)
            run.tool("bulk_seed", {"count": tasks, "every": 60, "start": parked.isoformat()})
            start = real_now() + timedelta(seconds=3)
            _shift(run.db_name, start - parked)
            launched = real_now()
            for _ in range(beats):
                run.start_beat(0.0)
            window_end = start + timedelta(seconds=seconds)
            peak_rss = 0
            cpu = [0.0] * beats
            trimmed = 0
            while real_now() < window_end:
                time.sleep(0.5)
                with run.broker.pipeline(transaction=True) as pipe:  # keep Redis small
                    pipe.llen(run.queue)
                    pipe.delete(run.queue)
                    trimmed += pipe.execute()[0]
                for i, beat in enumerate(run.beats):
                    if beat.process.poll() is None:
                        rss, used = _proc_stats(beat.process.pid)
                        peak_rss, cpu[i] = max(peak_rss, rss), used
            first = _first_ready(run.db_name)
            late, stuck, behind = _lateness(run.db_name, start, window_end - timedelta(seconds=2))
            run.stop()
            late.sort()
            due = int(tasks * (seconds - 2) / 60)
            return {
                "tasks": tasks, "beats": beats,
                "startup_s": (first - launched).total_seconds() if first else float("nan"),
                "dispatched": len(late), "due": due,
                "per_s": len(late) / (seconds - 2),
                "p50": statistics.median(late) if late else float("nan"),
                "p99": late[int(len(late) * 0.99) - 1] if late else float("nan"),
                "max": late[-1] if late else float("nan"),
                "behind": behind, "stuck": stuck,
                "rss_mb": peak_rss / 1024, "cpu_s": sum(cpu),
                "published": trimmed,
            }
        finally:
            run.close()


def queries_per_round() -> int:
    """Statements one 500-task claim round issues, on the test PostgreSQL database."""
    import django

    django.setup()
    from django.db import connection
    from django.test.utils import CaptureQueriesContext, setup_test_environment

    setup_test_environment()
    from django.test.utils import get_runner

    runner = get_runner(django.conf.settings)(verbosity=0, interactive=False)
    old = runner.setup_databases()
    try:
        from celery_driftsafe.claim import claimer_for
        from celery_driftsafe.models import PeriodicTask

        start = real_now()
        PeriodicTask.objects.bulk_create(
            PeriodicTask(name=f"q{i}", task="e2e.tick", schedule_kind="interval",
                         interval_every=60, interval_anchor=start, next_slot_at=start)
            for i in range(500)
        )
        with CaptureQueriesContext(connection) as captured:
            result = claimer_for().claim(start, "bench")
        assert len(result.runs) == 500
        return len(captured.captured_queries)
    finally:
        runner.teardown_databases(old)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--beats", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--burst", action="store_true",
                        help="also measure capacity: all tasks due at one instant")
    args = parser.parse_args()
    print(f"statements per 500-task claim round: {queries_per_round()}")
    header = (f"{'tasks':>7} {'beats':>5} {'start s':>7} {'due':>7} {'sent':>7} {'sent/s':>7} "
              f"{'p50 s':>6} {'p99 s':>6} {'max s':>6} {'behind':>6} {'RSS MB':>6} {'CPU s':>6}")
    print(header)
    for tasks in args.tasks:
        for beats in args.beats:
            r = bench(tasks, beats, args.seconds)
            print(f"{r['tasks']:>7} {r['beats']:>5} {r['startup_s']:>7.2f} {r['due']:>7} "
                  f"{r['dispatched']:>7} {r['per_s']:>7.0f} {r['p50']:>6.3f} {r['p99']:>6.3f} "
                  f"{r['max']:>6.3f} {r['behind']:>6} {r['rss_mb']:>6.0f} {r['cpu_s']:>6.1f}",
                  flush=True)
    if args.burst:
        print("\ncapacity: every task due at one instant")
        print(f"{'tasks':>7} {'beats':>5} {'drained in s':>12} {'dispatches/s':>12}")
        for tasks in args.tasks:
            for beats in args.beats:
                elapsed, rate = burst(tasks, beats)
                print(f"{tasks:>7} {beats:>5} {elapsed:>12.1f} {rate:>12.0f}", flush=True)


if __name__ == "__main__":
    main()
