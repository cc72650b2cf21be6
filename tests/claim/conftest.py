"""The claim tests' claimers: each test that takes ``claimer`` or ``make_claimer`` runs with
every claimer the database supports (compare-and-swap needs ``UPDATE … RETURNING``, not in
MySQL/MariaDB; SKIP LOCKED is PostgreSQL's and MySQL's), and skips, saying why, for the
others."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection

from celery_driftsafe.claim.claimers import Claimer, CompareAndSwapClaimer, SkipLockedClaimer
from tests.skip_guard import configuration

MakeClaimer = Callable[..., Claimer]


def _supported(name: str) -> bool:
    if name == "cas":
        return connection.vendor != "mysql"
    return bool(connection.features.has_select_for_update_skip_locked)


@pytest.fixture(params=["cas", "skip_locked"])
def make_claimer(request: pytest.FixtureRequest) -> MakeClaimer:
    """Makes the claimer of this parameter, with the keyword arguments given."""
    if not _supported(request.param):
        pytest.skip(
            configuration(f"{connection.vendor} does not support the {request.param} claimer")
        )
    cls = CompareAndSwapClaimer if request.param == "cas" else SkipLockedClaimer

    def make(**kwargs: Any) -> Claimer:
        return cls(**kwargs)

    return make


@pytest.fixture
def claimer(make_claimer: MakeClaimer) -> Claimer:
    """The claimer of this parameter, as configured by default."""
    return make_claimer()


@pytest.fixture
def cas_supported() -> None:
    """Skips, saying why, on a database without the compare-and-swap claimer."""
    if not _supported("cas"):
        pytest.skip(
            configuration(f"{connection.vendor} does not support the compare-and-swap claimer")
        )
