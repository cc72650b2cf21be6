"""The Django test databases a benchmark runs in.

``with fresh_databases(): ...`` sets Django up on ``tests.settings`` (PostgreSQL unless
``DRIFTSAFE_TEST_DB`` says otherwise), creates the test databases as the test runner does and
destroys them when the block ends, however it ends. ``fresh_databases(keep=True)`` keeps them
for the next run instead and reuses what an earlier run kept (Django's ``keepdb``):
``DRIFTSAFE_TEST_PG_TEST_NAME`` names the database, so that several can be kept side by side."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def fresh_databases(*, test_environment: bool = True, keep: bool = False) -> Iterator[None]:
    """Django set up, with fresh test databases for the block.

    ``test_environment=False`` leaves out ``setup_test_environment()``: its instrumented
    template rendering (a copy of every context for the test client) would be timed too, and a
    served page has none. ``keep=True``: the databases outlive the block, and a kept one is
    reused (migrated to the code's models) rather than created afresh."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    os.environ.setdefault("DRIFTSAFE_TEST_DB", "postgres")
    import django

    django.setup()
    from django.conf import settings
    from django.test.utils import get_runner, setup_test_environment

    if test_environment:
        setup_test_environment()
    runner = get_runner(settings)(verbosity=0, interactive=False, keepdb=keep)
    # No copy of the data for TransactionTestCase's rollback emulation: nothing here uses it,
    # and a kept database may hold tens of millions of runs.
    old = runner.setup_databases(serialized_aliases=set())
    try:
        yield
    finally:
        runner.teardown_databases(old)
