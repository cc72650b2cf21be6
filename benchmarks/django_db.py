"""The Django test databases a benchmark runs in, and a fast fill of the run table.

``with fresh_databases(): ...`` sets Django up on ``tests.settings`` (PostgreSQL unless
``DRIFTSAFE_TEST_DB`` says otherwise), creates the test databases as the test runner does and
destroys them when the block ends, however it ends."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def fresh_databases(*, test_environment: bool = True) -> Iterator[None]:
    """Django set up, with fresh test databases for the block.

    ``test_environment=False`` leaves out ``setup_test_environment()``: its instrumented
    template rendering (a copy of every context for the test client) would be timed too, and a
    served page has none."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    os.environ.setdefault("DRIFTSAFE_TEST_DB", "postgres")
    import django

    django.setup()
    from django.conf import settings
    from django.test.utils import get_runner, setup_test_environment

    if test_environment:
        setup_test_environment()
    runner = get_runner(settings)(verbosity=0, interactive=False)
    old = runner.setup_databases()
    try:
        yield
    finally:
        runner.teardown_databases(old)


def fill_fast(connection: Any, fill: Callable[[], object]) -> None:
    """Run ``fill()`` with the run table's secondary indexes dropped, then build them again
    (sorted builds: much faster than a random insert into each; the indexes come out compact,
    as after a ``REINDEX``). PostgreSQL only."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'celery_driftsafe_run' "
            "AND indexname NOT IN (SELECT conname FROM pg_constraint "
            "WHERE conrelid = 'celery_driftsafe_run'::regclass)")
        saved = cursor.fetchall()
        for name, _ in saved:
            cursor.execute(f'DROP INDEX "{name}"')
        fill()
        cursor.execute("SET maintenance_work_mem = '512MB'")
        for _, definition in saved:
            cursor.execute(definition)
