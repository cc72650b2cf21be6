"""Soak: one beat and one worker run for a long time; their memory and the runs' lateness are
sampled, and the run fails (exit code 1) when either grows.

    python -m benchmarks soak [--minutes 60] [--tasks 20] [--every 1] [--samples 20]
                              [--max-rss-growth-mb 20] [--max-lateness-growth 0.25]

A real ``celery beat`` and ``celery worker`` (the end-to-end tests' harness,
``tests/e2e/harness.py``: a database, key prefix and queue of their own) on ``--tasks``
interval tasks every ``--every`` seconds. Every ``--minutes * 60 / --samples`` seconds it
prints the resident memory of the beat and the worker (with their child processes) and the
lateness of the runs whose slot fell in the interval: from the slot to the beat's dispatch,
and to the body's start on the worker (p50, p99, max), with how many ran.

It fails when the last third of the samples is worse than the first third (the first sample,
start-up, aside): the beat's or the worker's median memory grew by more than
``--max-rss-growth-mb``, or the median of the samples' p99 dispatch lateness grew by more than
``--max-lateness-growth`` seconds, or a slot of the last interval did not run. A soak is not a
test: it takes an hour to mean something, and it is the growth over that hour it watches, not
a speed. Needs what the end-to-end tests need (PostgreSQL, Redis; ``DRIFTSAFE_TEST_POSTGRES_URL``,
``DRIFTSAFE_TEST_REDIS_URL``).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any


@dataclass
class Sample:
    minute: float
    beat_mb: float
    worker_mb: float
    runs: int
    due: int
    dispatch_p50: float
    dispatch_p99: float
    start_p99: float
    start_max: float


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--tasks", type=int, default=20)
    parser.add_argument("--every", type=int, default=1, help="each task's interval, seconds")
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--max-rss-growth-mb", type=float, default=20.0)
    parser.add_argument("--max-lateness-growth", type=float, default=0.25)
    args = parser.parse_args()
    if args.samples < 4:
        parser.error("--samples: at least 4 (the first is start-up; thirds are compared)")
    with tempfile.TemporaryDirectory(prefix="driftsafe-soak-") as workdir:
        samples = _soak(args, Path(workdir))
    return _verdict(args, samples)


def _soak(args: Any, workdir: Path) -> list[Sample]:
    from celery_driftsafe.core.schedules import Interval
    from tests.e2e.harness import E2ERun, real_now

    run = E2ERun("postgresql", workdir)
    samples: list[Sample] = []
    try:
        start = real_now() + timedelta(seconds=5)
        run.seed(
            [
                {
                    "name": f"soak-{i:03d}",
                    "task": "e2e.slot_work",
                    "args": [0.0],
                    "schedule_kind": "interval",
                    "interval_every": args.every,
                    "interval_unit": "seconds",
                }
                for i in range(args.tasks)
            ],
            start,
        )
        schedules = [
            Interval(timedelta(seconds=task["every"]), datetime.fromisoformat(task["anchor"]))
            for task in run.tool("dump")["tasks"]
        ]
        worker = run.start_worker("soak", pool="prefork", concurrency=2)
        beat = run.start_beat(0.0)
        interval = args.minutes * 60 / args.samples
        began = time.monotonic()
        since = start
        print(
            f"soak: {args.tasks} tasks every {args.every} s, one beat and one worker "
            f"(PostgreSQL), {args.minutes:g} min, a sample every {interval:.0f} s\n"
        )
        print(
            f"{'minute':>6} {'beat MB':>8} {'worker MB':>9} {'ran/due':>11} "
            f"{'dispatch p50':>12} {'p99':>7} {'start p99':>9} {'max':>7}"
        )
        for n in range(1, args.samples + 1):
            time.sleep(max(0.0, began + n * interval - time.monotonic()))
            died = run.children.died()
            if died is not None:
                raise SystemExit(f"soak: {died} died\n{run.logs()[-4000:]}")
            until = real_now() - timedelta(seconds=3)  # the last slots may still be running
            dispatch, started = _lateness(run, since, until)
            due = sum(len(list(schedule.slots_between(since, until))) for schedule in schedules)
            sample = Sample(
                minute=(time.monotonic() - began) / 60,
                beat_mb=_rss_mb(beat.pid),
                worker_mb=_rss_mb(worker.pid),
                runs=len(started),
                due=due,
                dispatch_p50=_q(dispatch, 0.50),
                dispatch_p99=_q(dispatch, 0.99),
                start_p99=_q(started, 0.99),
                start_max=max(started, default=float("nan")),
            )
            samples.append(sample)
            print(
                f"{sample.minute:6.1f} {sample.beat_mb:8.1f} {sample.worker_mb:9.1f} "
                f"{f'{sample.runs}/{sample.due}':>11} {sample.dispatch_p50:12.3f} "
                f"{sample.dispatch_p99:7.3f} {sample.start_p99:9.3f} {sample.start_max:7.3f}",
                flush=True,
            )
            since = until
    finally:
        run.close()
    return samples


def _verdict(args: Any, samples: list[Sample]) -> int:
    steady = samples[1:]
    third = max(1, len(steady) // 3)
    first, last = steady[:third], steady[-third:]

    def growth(field: str) -> float:
        def median(part: list[Sample]) -> float:
            return statistics.median(getattr(s, field) for s in part)

        return median(last) - median(first)

    failures = []
    print()
    for name in ("beat_mb", "worker_mb"):
        grew = growth(name)
        print(f"{name.removesuffix('_mb')} memory: {grew:+.1f} MB from the first third to the last")
        if grew > args.max_rss_growth_mb:
            failures.append(f"{name.removesuffix('_mb')} memory grew by {grew:.1f} MB")
    lateness = growth("dispatch_p99")
    print(f"p99 dispatch lateness: {lateness:+.3f} s from the first third to the last")
    if lateness > args.max_lateness_growth:
        failures.append(f"p99 dispatch lateness grew by {lateness:.3f} s")
    short = [s for s in last if s.runs < s.due]
    if short:
        failures.append(f"slots that did not run in the last third: {short}")
    if failures:
        print("\nFAILED: " + "; ".join(failures))
        return 1
    print("\nno growth: passed")
    return 0


def _q(values: list[float], q: float) -> float:
    from celery_driftsafe.testing.recording import percentile

    return percentile(values, q * 100) if values else float("nan")


def _rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` and its child processes (a beat's claim process, a prefork
    worker's pool), MB."""
    from celery_driftsafe.testing.processes import proc_stats

    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False)
    total = 0
    for each in [pid, *map(int, out.stdout.split())]:
        with contextlib.suppress(FileNotFoundError):  # ended meanwhile
            total += proc_stats(each)[0]
    return total / 1024


def _lateness(run: Any, since: Any, until: Any) -> tuple[list[float], list[float]]:
    """Seconds from slot to dispatch and from slot to start, of the runs with a slot in
    ``[since, until)`` that started."""
    sql = (
        "SELECT slot, dispatched_at, started_at FROM celery_driftsafe_run "
        "WHERE slot >= %s AND slot < %s AND started_at IS NOT NULL"
    )
    from celery_driftsafe.testing.processes import postgres_exec

    literal = sql % (f"'{since.isoformat()}'", f"'{until.isoformat()}'")
    rows = postgres_exec(literal, dbname=run.db_name)
    dispatch = [(d - s).total_seconds() for s, d, _ in rows if d is not None]
    started = [(b - s).total_seconds() for s, _, b in rows]
    return dispatch, started
