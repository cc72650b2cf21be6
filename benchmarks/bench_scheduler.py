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
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

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


class ServerCPU:
    """CPU seconds used meanwhile by this run's PostgreSQL backends (a backend's process title
    names its database; the beats open and close connections, so every process is sampled
    each 0.2 s and a new one counts from zero) and by the Redis server (one process for every
    user of this machine: an upper bound)."""

    def __init__(self, db: str) -> None:
        self.db = db
        self.first: dict[int, float] = {}
        self.last: dict[int, tuple[str, float]] = {}
        self._stop = threading.Event()
        self._sample(initial=True)
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _sample(self, initial: bool = False) -> None:
        import psutil

        for proc in psutil.process_iter(["name", "cmdline"]):
            try:
                title = " ".join(proc.info["cmdline"] or ())
                if f" {self.db} " in title and "postgres" in title:
                    kind = "pg"
                elif (proc.info["name"] or "").startswith("redis-server"):
                    kind = "redis"
                else:
                    continue
                times = proc.cpu_times()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            used = times.user + times.system
            self.first.setdefault(proc.pid, used if initial else 0.0)
            self.last[proc.pid] = (kind, used)

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            self._sample()

    def stop(self) -> tuple[float, float]:
        """(PostgreSQL backends, Redis server) CPU seconds since the start."""
        self._stop.set()
        self._thread.join()
        self._sample()
        totals = {"pg": 0.0, "redis": 0.0}
        for pid, (kind, used) in self.last.items():
            totals[kind] += used - self.first.get(pid, 0.0)
        return totals["pg"], totals["redis"]


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


class Drain:
    """Pops every message off the run's queue as it arrives (1,000 at a time) and stamps each
    pop with this process's clock (the servers' clock on this machine); parsing waits until
    the end, so the recorder takes little CPU from the beats."""

    def __init__(self, run: E2ERun) -> None:
        self.run = run
        self.batches: list[tuple[float, list[bytes]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        client = self.run.broker
        while not self._stop.is_set():
            got = client.lpop(self.run.queue, 1000)
            if got:
                self.batches.append((time.time(), got))
            else:
                time.sleep(0.005)

    def stop(self) -> list[tuple[float, str, str]]:
        """(stamp, task id, slot) of every message."""
        self._stop.set()
        self._thread.join()
        while got := self.run.broker.lpop(self.run.queue, 1000):
            self.batches.append((time.time(), got))
        out = []
        for stamp, raws in self.batches:
            for raw in raws:
                headers = json.loads(raw)["headers"]
                out.append((stamp, headers["id"], headers["driftsafe_slot"]))
        return out


def _outcome(db: str) -> dict[str, int]:
    with psycopg.connect(host="127.0.0.1", user="postgres", dbname=db) as conn:
        rows = conn.execute(
            "SELECT status, count(*), sum(missed_count) FROM celery_driftsafe_run GROUP BY status"
        ).fetchall()
    return {status: int(count) for status, count, _ in rows} | {
        "missed_slots": sum(int(total or 0) for status, _, total in rows if status == "missed")}


@contextmanager
def _seeded(tasks: int, *, spread: bool) -> Iterator[tuple[E2ERun, datetime]]:
    """An end-to-end run with ``tasks`` interval tasks (every 60 s) parked an hour ahead
    (seeding takes a while); the caller moves them with :func:`_shift`."""
    with tempfile.TemporaryDirectory() as tmp:
        run = E2ERun("postgresql", Path(tmp))
        parked = real_now() + timedelta(hours=1)
        if SQL_SEED:
            _sql_seed(run, tasks, parked, spread=spread)
        else:
            run.tool("bulk_seed", {"count": tasks, "every": 60, "start": parked.isoformat(),
                                   "spread": spread})
        yield run, parked


#: ``--sql-seed``: seed with one ``INSERT … SELECT generate_series`` (a million tasks in
#: about a minute) instead of the ORM.
SQL_SEED = False


def _sql_seed(run: E2ERun, tasks: int, start: datetime, *, spread: bool) -> None:
    """The rows ``bulk_seed`` writes (``e2e.tick`` every 60 s, ``args`` ``[i]``), written by
    PostgreSQL: one row through the ORM, then copies of it."""
    seeded = time.monotonic()
    run.tool("bulk_seed", {"count": 1, "every": 60, "start": start.isoformat()})
    with psycopg.connect(host="127.0.0.1", user="postgres", dbname=run.db_name,
                         autocommit=True) as conn:
        columns = [r[0] for r in conn.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_name = "
            "'celery_driftsafe_periodictask' AND column_name <> 'id' ORDER BY ordinal_position"
        ).fetchall()]
        step = "60.0 * i / %(tasks)s" if spread else "0"
        values = {
            "name": "'bench-' || lpad(i::text, 7, '0')",
            "task": "'e2e.tick'", "schedule_kind": "'interval'", "interval_every": "60",
            "interval_unit": "'seconds'",
            "interval_anchor": f"%(start)s::timestamptz + make_interval(secs => {step})",
            "next_slot_at": f"%(start)s::timestamptz + make_interval(secs => {step})",
            "args": "jsonb_build_array(i)",
        }
        conn.execute(
            "INSERT INTO celery_driftsafe_periodictask (" + ", ".join(columns) + ") "
            "SELECT " + ", ".join(values.get(c, f"t.{c}") for c in columns)
            + " FROM (SELECT * FROM celery_driftsafe_periodictask LIMIT 1) AS t, "
            "generate_series(0, %(tasks)s - 1) AS i",
            {"tasks": tasks, "start": start},
        )
        conn.execute("DELETE FROM celery_driftsafe_periodictask WHERE name = 'bench-000000'")
        conn.execute("ANALYZE celery_driftsafe_periodictask")
    print(f"seeded {tasks:,} tasks with SQL in {time.monotonic() - seeded:.0f} s", flush=True)


def burst(tasks: int, beats: int) -> dict[str, Any]:
    """Capacity: ``tasks`` interval tasks (every 60 s) due at one instant; ``beats`` beats.
    Every message is recorded as it lands: when the wave was out, how late, duplicates, early
    ones, missed slots."""
    with _seeded(tasks, spread=False) as (run, parked):
        try:
            for _ in range(beats):
                run.start_beat(0.0)
            _wait_ready(run.db_name, beats)
            due = real_now() + timedelta(seconds=2)
            _shift(run.db_name, due - parked)
            drain = Drain(run)
            pids = [b.process.pid for b in run.beats]
            cpu0 = sum(_proc_stats(pid)[1] for pid in pids)
            servers0 = ServerCPU(run.db_name)
            load0 = os.getloadavg()[0]
            peak_rss = 0
            deadline = due + timedelta(seconds=55)  # the wave, before its next slots are due
            while real_now() < deadline:
                time.sleep(0.5)
                peak_rss = max(peak_rss, *(_proc_stats(pid)[0] for pid in pids))
                if sum(len(raws) for _, raws in drain.batches) >= tasks:
                    break
            cpu = sum(_proc_stats(pid)[1] for pid in pids) - cpu0
            servers = servers0.stop()
            messages = drain.stop()
            outcome = _outcome(run.db_name)
            run.stop()
        finally:
            run.close()
    ids = Counter(task_id for _, task_id, _ in messages)
    late = sorted(stamp - datetime.fromisoformat(slot).timestamp()
                  for stamp, _, slot in messages)
    return {
        "tasks": tasks, "beats": beats, "messages": len(messages),
        "distinct": len(ids), "duplicates": sum(n - 1 for n in ids.values()),
        "early": sum(1 for x in late if x < 0),
        "last_s": late[-1] if late else float("nan"),
        "p50_s": late[len(late) // 2] if late else float("nan"),
        "p99_s": late[int(len(late) * 0.99) - 1] if late else float("nan"),
        "missed_slots": outcome.get("missed_slots", 0),
        "rate": len(ids) / late[-1] if late and late[-1] > 0 else float("nan"),
        "cpu_s": cpu, "rss_mb": peak_rss / 1024, "pg_cpu_s": servers[0],
        "redis_cpu_s": servers[1], "load": (load0, os.getloadavg()[0]),
    }


def _wait_ready(db: str, beats: int, timeout: float = 60.0) -> None:
    """Until ``beats`` nodes have registered (their start-up is not part of the figure)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with psycopg.connect(host="127.0.0.1", user="postgres", dbname=db) as conn:
            ready = conn.execute("SELECT count(*) FROM celery_driftsafe_beatnode "
                                 "WHERE stopped_at IS NULL").fetchone()[0]
        if ready >= beats:
            return
        time.sleep(0.2)
    raise RuntimeError(f"only {ready} of {beats} beats registered within {timeout:g} s")


def recovery(tasks: int, outage: timedelta) -> dict[str, Any]:
    """``tasks`` tasks every 60 s come back after ``outage`` with no beat running: one beat
    starts; how long until every task's catch-up is decided and its catch-up run published,
    ledger rows written for the outage, the beat's memory."""
    with _seeded(tasks, spread=True) as (run, parked):
        try:
            # the first slots lie ``outage`` back: nothing ran since
            _shift(run.db_name, real_now() - outage - parked)
            drain = Drain(run)
            started = real_now()
            beat = run.start_beat(0.0)
            pid = beat.process.pid
            peak_rss, decided_at, first_wave_at = 0, None, None
            while real_now() < started + timedelta(seconds=180):
                time.sleep(0.5)
                peak_rss = max(peak_rss, _proc_stats(pid)[0])
                with psycopg.connect(host="127.0.0.1", user="postgres", dbname=run.db_name) as c:
                    behind = c.execute(
                        "SELECT count(*) FROM celery_driftsafe_periodictask "
                        "WHERE next_slot_at < %s", (started,)).fetchone()[0]
                    waiting = c.execute(
                        "SELECT count(*) FROM celery_driftsafe_run WHERE status = 'claimed'"
                    ).fetchone()[0]
                if behind == 0 and decided_at is None:
                    decided_at = real_now()
                if decided_at is not None and waiting == 0:
                    first_wave_at = real_now()
                    break
            messages = drain.stop()
            with psycopg.connect(host="127.0.0.1", user="postgres", dbname=run.db_name) as c:
                rows = c.execute("SELECT count(*) FROM celery_driftsafe_run "
                                 "WHERE slot < %s", (started,)).fetchone()[0]
            outcome = _outcome(run.db_name)
            run.stop()
        finally:
            run.close()
    first = min((stamp for stamp, _, _ in messages), default=None)
    return {
        "tasks": tasks, "outage_h": outage.total_seconds() / 3600,
        "first_message_s": first - started.timestamp() if first else float("nan"),
        "decided_s": (decided_at - started).total_seconds() if decided_at else float("nan"),
        "first_wave_s": (first_wave_at - started).total_seconds() if first_wave_at
        else float("nan"),
        "outage_rows_per_task": rows / tasks, "missed_slots": outcome.get("missed_slots", 0),
        "rss_mb": peak_rss / 1024,
    }


def bench(tasks: int, beats: int, seconds: float) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        run = E2ERun("postgresql", Path(tmp))
        try:
            # Seed an hour ahead (seeding 100k rows takes a while), then move every slot so the
            # first ones fall due 3 s after the beats start: no backlog from the set-up.
            parked = real_now() + timedelta(hours=1)
            if SQL_SEED:
                _sql_seed(run, tasks, parked, spread=True)
            else:
                run.tool("bulk_seed", {"count": tasks, "every": 60,
                                       "start": parked.isoformat()})
            # Moving a million rows takes a while: leave it time, so that no slot falls due
            # before the beats start.
            start = real_now() + timedelta(seconds=3 + tasks / 10_000)
            _shift(run.db_name, start - parked)
            time.sleep(max(0.0, (start - real_now()).total_seconds() - 3))
            launched = real_now()
            for _ in range(beats):
                run.start_beat(0.0)
            window_end = start + timedelta(seconds=seconds)
            peak_rss = 0
            cpu = [0.0] * beats
            servers0 = ServerCPU(run.db_name)
            load0 = os.getloadavg()[0]
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
            servers = servers0.stop()
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
                "published": trimmed, "pg_cpu_s": servers[0], "redis_cpu_s": servers[1],
                "load": (load0, os.getloadavg()[0]),
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
                        help="measure capacity: all tasks due at one instant")
    parser.add_argument("--recovery", type=float, metavar="HOURS",
                        help="measure recovery after HOURS with no beat running")
    parser.add_argument("--steady", action=argparse.BooleanOptionalAction, default=True,
                        help="the spread-over-the-minute run (default on)")
    parser.add_argument("--sql-seed", action="store_true",
                        help="seed the tasks with one SQL statement (for a million)")
    args = parser.parse_args()
    global SQL_SEED
    SQL_SEED = args.sql_seed
    print(f"statements per 500-task claim round: {queries_per_round()}")
    header = (f"{'tasks':>7} {'beats':>5} {'start s':>7} {'due':>7} {'sent':>7} {'sent/s':>7} "
              f"{'p50 s':>6} {'p99 s':>6} {'max s':>6} {'behind':>6} {'RSS MB':>6} {'CPU s':>6}")
    if args.steady:
        print(header)
    for tasks in args.tasks if args.steady else ():
        for beats in args.beats:
            r = bench(tasks, beats, args.seconds)
            print(f"{r['tasks']:>7} {r['beats']:>5} {r['startup_s']:>7.2f} {r['due']:>7} "
                  f"{r['dispatched']:>7} {r['per_s']:>7.0f} {r['p50']:>6.3f} {r['p99']:>6.3f} "
                  f"{r['max']:>6.3f} {r['behind']:>6} {r['rss_mb']:>6.0f} {r['cpu_s']:>6.1f}",
                  flush=True)
            print(f"    CPU s in the window: beats {r['cpu_s']:.1f}, this run's PostgreSQL "
                  f"backends {r['pg_cpu_s']:.1f}, Redis server (all users) "
                  f"{r['redis_cpu_s']:.1f}; load average {r['load'][0]:.1f} -> "
                  f"{r['load'][1]:.1f}", flush=True)
    if args.burst:
        print("\ncapacity: every task due at one instant (lateness: message landed - slot)")
        print(f"{'tasks':>7} {'beats':>5} {'last s':>7} {'slots/s':>8} {'p50 s':>6} "
              f"{'p99 s':>6} {'dup':>4} {'early':>5} {'missed':>6} {'CPU s':>6} {'RSS MB':>6}")
        for tasks in args.tasks:
            for beats in args.beats:
                r = burst(tasks, beats)
                print(f"{tasks:>7} {beats:>5} {r['last_s']:>7.1f} {r['rate']:>8.0f} "
                      f"{r['p50_s']:>6.1f} {r['p99_s']:>6.1f} {r['duplicates']:>4} "
                      f"{r['early']:>5} {r['missed_slots']:>6} {r['cpu_s']:>6.1f} "
                      f"{r['rss_mb']:>6.0f}  ({r['distinct']}/{tasks} published)", flush=True)
                print(f"    CPU s: beats {r['cpu_s']:.1f}, this run's PostgreSQL backends "
                      f"{r['pg_cpu_s']:.1f}, Redis server (all users) {r['redis_cpu_s']:.1f}; "
                      f"load average {r['load'][0]:.1f} -> {r['load'][1]:.1f}", flush=True)
    if args.recovery:
        print(f"\nrecovery: back after {args.recovery} h with no beat, one beat")
        print(f"{'tasks':>7} {'first msg s':>11} {'decided s':>9} {'wave out s':>10} "
              f"{'rows/task':>9} {'missed slots':>12} {'RSS MB':>6}")
        for tasks in args.tasks:
            r = recovery(tasks, timedelta(hours=args.recovery))
            print(f"{tasks:>7} {r['first_message_s']:>11.1f} {r['decided_s']:>9.1f} "
                  f"{r['first_wave_s']:>10.1f} {r['outage_rows_per_task']:>9.2f} "
                  f"{r['missed_slots']:>12} {r['rss_mb']:>6.0f}", flush=True)


if __name__ == "__main__":
    main()
