"""How long slot arithmetic takes: microseconds per call, and seconds of CPU per 100k calls.

The scheduler calls ``next_after`` once for every slot it claims, so at 100,000 entries due
every minute (1,667 slots/s) the per-call cost decides how much of one core this takes.

Run from the repository root: ``python -m benchmarks slots [--repeat N]``. Not a test: it
asserts nothing.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from celery_driftsafe.core.schedules import Crontab, Interval, Schedule

SPREAD = [datetime(2024, 1, 1, tzinfo=UTC) + timedelta(minutes=527 * i + 0.37) for i in range(997)]
DST_DAY = [datetime(2024, 10, 5, 12, tzinfo=UTC) + timedelta(minutes=7 * i) for i in range(200)]

CASES: list[tuple[str, Schedule, list[datetime]]] = [
    ("interval 60 s", Interval(timedelta(seconds=60), datetime(2024, 1, 1, tzinfo=UTC)), SPREAD),
    ("*/15 * * * * UTC", Crontab.from_expression("*/15 * * * *"), SPREAD),
    (
        "*/15 * * * * Europe/Berlin",
        Crontab.from_expression("*/15 * * * *", "Europe/Berlin"),
        SPREAD,
    ),
    ("30 2 * * * Europe/Berlin", Crontab.from_expression("30 2 * * *", "Europe/Berlin"), SPREAD),
    (
        "0 9 * * mon-fri America/New_York",
        Crontab.from_expression("0 9 * * mon-fri", "America/New_York"),
        SPREAD,
    ),
    ("0 0 13 * fri UTC (dom OR dow)", Crontab.from_expression("0 0 13 * fri"), SPREAD),
    ("0 0 29 2 * UTC (leap day)", Crontab.from_expression("0 0 29 2 *"), SPREAD),
    (
        "*/5 * * * * Lord_Howe, DST day",
        Crontab.from_expression("*/5 * * * *", "Australia/Lord_Howe"),
        DST_DAY,
    ),
    (
        "15 2 * * * Lord_Howe, DST day",
        Crontab.from_expression("15 2 * * *", "Australia/Lord_Howe"),
        DST_DAY,
    ),
]


def per_call_us(function: Callable[[], object], calls: int, repeat: int) -> float:
    """The best of ``repeat`` runs, in microseconds per call."""
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - started)
    return best / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    repeat = parser.parse_args().repeat

    print(f"{'schedule':38} {'next_after µs':>14} {'chained µs':>11} {'s per 100k':>11}")
    for name, schedule, instants in CASES:

        def scattered(schedule: Schedule = schedule, instants: list[datetime] = instants) -> None:
            for instant in instants:
                schedule.next_after(instant)

        def chained(schedule: Schedule = schedule, start: datetime = instants[0]) -> None:
            slot: datetime | None = start
            for _ in range(1000):
                assert slot is not None
                slot = schedule.next_after(slot)

        scattered_us = per_call_us(scattered, len(instants), repeat)
        chained_us = per_call_us(chained, 1000, repeat)
        print(f"{name:38} {scattered_us:14.2f} {chained_us:11.2f} {chained_us / 10:11.3f}")

    expressions = ["*/15 * * * *", "0 9 * * mon-fri", "0,30 8-18/2 1-15 jan-jun,oct 1-5"]

    def build() -> None:
        for expression in expressions:
            Crontab.from_expression(expression, "Europe/Berlin")

    print(f"\n{'Crontab.from_expression':38} {per_call_us(build, 3, repeat * 200):14.2f} µs")

    # Solar schedules search day by day near the poles (tests/core/test_slots_solar.py checks what
    # they find; this, how long the search takes).
    from celery_driftsafe.core.schedules import Solar

    polar = Solar("sunrise", 89.9, 45)
    start, end = datetime(2020, 4, 1, tzinfo=UTC), datetime(2022, 4, 1, tzinfo=UTC)

    def two_years() -> None:
        list(polar.slots_between(start, end))

    seconds = per_call_us(two_years, 1, max(1, repeat // 2)) / 1e6
    print(f"{'sunrise 89.9 N, two years':38} {seconds:14.3f} s")


if __name__ == "__main__":
    main()
