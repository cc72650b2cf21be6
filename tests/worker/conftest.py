"""Fixtures of the overlap policy tests (``buffer_one``, ``buffer_all``): the worker's path
and where it takes its locks."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests import settings as test_settings


@pytest.fixture(params=["fast", "slow"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The worker's path: ``fast``, one conditional start, then the overlap policy (PostgreSQL,
    SQLite 3.35+); ``slow``, the run read, the policy applied, then the start (a database
    without ``UPDATE … RETURNING``: MySQL, an older SQLite)."""
    from celery_driftsafe.ledger.run_ledger import Ledger

    if request.param == "slow":
        original = Ledger.__init__

        def without_returning(self: Ledger) -> None:
            original(self)
            self.can_return = False

        monkeypatch.setattr(Ledger, "__init__", without_returning)
    return str(request.param)


@pytest.fixture(params=["redis", "database"])
def locks(request: pytest.FixtureRequest) -> Iterator[str]:
    """Where the worker takes its locks: Redis (the tests' settings), or the database (no
    ``REDIS_URL``; the database is the time authority then)."""
    if request.param == "redis":
        yield "redis"
        return
    from django.test import override_settings

    without_redis = {**test_settings.DRIFTSAFE, "REDIS_URL": None, "TIME_AUTHORITY": "database"}
    from celery_driftsafe.models import Lock as LockRow

    with override_settings(DRIFTSAFE=without_redis):
        yield "database"
    assert LockRow.objects.filter(name__startswith="task-running:").exists(), "no database lock"
