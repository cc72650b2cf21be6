"""A wave spread by deterministic jitter: N crontab tasks all due at one minute, claimed with and
without a jitter, on PostgreSQL (or SQLite with ``DRIFTSAFE_TEST_DB=sqlite``).

    python -m benchmarks.bench_jitter [--tasks 100000] [--jitter 30]

The authority's now is stepped by hand through the first ``jitter`` seconds of the slot, one
second at a time; at each step the claim runs until nothing more is due (no publishing: the
claim alone). Printed: how many runs became claimable in each second (min, mean, max over the
seconds), and what the claim cost per step. Without jitter the whole wave is due at the slot's
first second. Each task is checked to be claimed exactly once, under its slot, never before its
jittered instant.
"""

from __future__ import annotations

import argparse
import time
from datetime import UTC, datetime, timedelta

from benchmarks.django_db import fresh_databases

SLOT = datetime(2030, 1, 1, tzinfo=UTC)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=100_000)
    parser.add_argument("--jitter", type=float, default=30.0)
    args = parser.parse_args()

    with fresh_databases():
        print(f"{args.tasks:,} tasks on '* * * * *', all due at {SLOT:%H:%M:%S}")
        print(
            f"{'jitter':>8} {'seconds':>8} {'min/s':>8} {'mean/s':>8} {'max/s':>8} "
            f"{'claim s':>8} {'worst step s':>12}"
        )
        for jitter in (0.0, args.jitter):
            _wave(args.tasks, jitter)


def _wave(count: int, jitter: float) -> None:
    from django.db import connection

    from celery_driftsafe.claim.claimers import claimer_for
    from celery_driftsafe.core.jitter import offset
    from celery_driftsafe.models import PeriodicTask, Run

    Run.objects.all().delete()
    PeriodicTask.objects.all().delete()
    PeriodicTask.objects.bulk_create(
        (
            PeriodicTask(
                name=f"wave-{i}",
                task="wave.tick",
                schedule_kind="crontab",
                crontab_minute="*",
                jitter_seconds=jitter or None,
                next_slot_at=SLOT,
            )
            for i in range(count)
        ),
        batch_size=5000,
    )
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")
    names = dict(PeriodicTask.objects.values_list("pk", "name"))
    claimer = claimer_for()
    per_second: list[int] = []
    total_time, worst = 0.0, 0.0
    steps = max(int(jitter), 1)
    for second in range(steps + 1):
        now = SLOT + timedelta(seconds=second)
        claimed = 0
        started = time.perf_counter()
        while True:
            result = claimer.claim(now, "bench")
            for run in result.runs:
                assert run.slot == SLOT
                assert SLOT + offset(names[run.periodic_task_id], SLOT, jitter) <= now
            claimed += len(result.runs)
            if not result.tasks_seen:
                break
        spent = time.perf_counter() - started
        total_time += spent
        worst = max(worst, spent)
        # claimed at step k: due in (k - 1, k] (step 0: exactly at the slot)
        bucket = max(second - 1, 0) if jitter else second
        if bucket < len(per_second):
            per_second[bucket] += claimed
        else:
            per_second.append(claimed)
    assert sum(per_second) == count == Run.objects.filter(slot=SLOT).count(), per_second
    seconds = len([c for c in per_second if c]) if jitter == 0 else steps
    used = per_second[:seconds]
    print(
        f"{jitter:>8g} {seconds:>8} {min(used):>8,} {sum(used) / len(used):>8,.0f} "
        f"{max(used):>8,} {total_time:>8.1f} {worst:>12.2f}"
    )


if __name__ == "__main__":
    main()
