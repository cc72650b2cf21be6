"""Dispatch timing under clock skew: K beats with wall clocks skewed apart (libfaketime), 20
interval tasks of 1-3 s, every published message stamped on arrival with the machine's real
clock (the authority's clock here). Prints lateness p50/p99/max, the number of messages
published before their slot (early), duplicates and misses.

    python benchmarks/bench_skew.py [--seconds 60] [--offsets 0 2.5 -4]
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

from tests.e2e.harness import E2ERun, analyse, real_now  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--offsets", type=float, nargs="+", default=[0.0, 2.5, -4.0])
    parser.add_argument("--backend", choices=["postgresql", "sqlite"], default="postgresql")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run = E2ERun(args.backend, Path(tmp))
        try:
            start = real_now() + timedelta(seconds=8)
            run.seed([{"name": f"every-{1 + i % 3}s-{i:02d}", "schedule_kind": "interval",
                       "interval_every": 1 + i % 3, "interval_unit": "seconds"}
                      for i in range(20)], start)
            run.start_recorder()
            for offset in args.offsets:
                run.start_beat(offset)
            end = start + timedelta(seconds=args.seconds)
            time.sleep(max(0.0, (end - real_now()).total_seconds()))
            run.stop()
            dump = run.tool("dump")
        finally:
            run.close()
    reports = analyse(dump, run.received, start=start, until=end - timedelta(seconds=1.5))
    late = sorted(x for r in reports.values() for x in r.lateness)
    early = sum(len(r.early) for r in reports.values())
    duplicates = sum(r.duplicates for r in reports.values())
    missed = sum(len(r.missed) for r in reports.values())
    due = sum(r.expected for r in reports.values())
    offsets = [n["offset"] for n in dump["nodes"]]
    print(f"{args.backend}, {len(args.offsets)} beats skewed {args.offsets} s, "
          f"{args.seconds:.0f} s, 20 tasks every 1-3 s")
    print("measured offsets (authority - node):", ", ".join(f"{o:+.3f}" for o in offsets))
    print(f"{'due':>6}{'sent':>7}{'dup':>5}{'missed':>8}{'early':>7}"
          f"{'p50 s':>8}{'p99 s':>8}{'max s':>8}")
    print(f"{due:>6}{len(late):>7}{duplicates:>5}{missed:>8}{early:>7}"
          f"{statistics.median(late):>8.3f}{late[int(len(late) * 0.99) - 1]:>8.3f}"
          f"{late[-1]:>8.3f}")


if __name__ == "__main__":
    main()
