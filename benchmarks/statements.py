"""Statements one claim round issues: N interval tasks due at one instant, one round of the
claim on the test database (PostgreSQL by default), counted with Django's query capture.

    python -m benchmarks statements [--tasks 500]

Needs the test services and the test dependencies (it runs in ``tests.settings``).
"""

from __future__ import annotations

import argparse
from datetime import UTC, datetime

from benchmarks.django_db import fresh_databases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tasks", type=int, default=500, help="tasks due (default 500: one round's batch)"
    )
    args = parser.parse_args()
    with fresh_databases():
        from django.db import connection
        from django.test.utils import CaptureQueriesContext

        from celery_driftsafe.claim.claimers import claimer_for
        from tests.support.factories import many_interval_tasks

        start = datetime.now(UTC).replace(microsecond=0)
        many_interval_tasks(args.tasks, start, name="q{i}", task="bench.tick")
        with CaptureQueriesContext(connection) as captured:
            result = claimer_for().claim(start, "bench")
        print(
            f"one claim round of {args.tasks} due tasks on {connection.vendor}: "
            f"{len(result.runs)} runs claimed, {len(captured.captured_queries)} statements"
        )
        for query in captured.captured_queries:
            sql = " ".join(query["sql"].split())
            print(f"  {sql[:150]}{'...' if len(sql) > 150 else ''}")


if __name__ == "__main__":
    main()
