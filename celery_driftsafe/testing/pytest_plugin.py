"""The pytest plugin of celery_driftsafe, loaded through the ``pytest11`` entry point.

Fixtures (see :doc:`/howto/test-your-schedules`):

``driftsafe_clock``
    A :class:`~celery_driftsafe.testing.FakeClock` at 2026-01-01 00:00 UTC. Override it in a
    ``conftest.py`` to start elsewhere, or ``set()`` it before creating tasks.
``driftsafe_celery_app``
    The application's Celery app (``DRIFTSAFE['CELERY_APP']``, else ``celery.current_app``):
    the beat copies its ``beat_schedule``, time zone and routing. Override it to use another.
``driftsafe_publish_app``
    ``None``: the beat publishes to an in-memory broker of its own and records the messages.
    Override it to return a Celery app (pytest-celery's ``celery_app`` with an in-process
    worker, say) and the beat publishes through that app, taking its ``beat_schedule`` too.
``driftsafe``
    A :class:`~celery_driftsafe.testing.beat.SteppedBeat` on the test database (it requests
    pytest-django's ``db``; ``transactional_db`` wins when the test asks for it), with the fake
    clock installed as the time authority for the whole test.

Importing this module imports neither Django nor the package's models, so the plugin loads in
any pytest run, with Django configured or not; the fixtures import what they need.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest

from celery_driftsafe.testing import FakeClock, inject_authority_clock

#: Where :func:`driftsafe_clock` starts.
DEFAULT_START = datetime(2026, 1, 1, tzinfo=UTC)


@pytest.fixture
def driftsafe_clock() -> FakeClock:
    """A fake authority clock at :data:`DEFAULT_START`; it moves only when told to."""
    return FakeClock(DEFAULT_START)


@pytest.fixture
def driftsafe_celery_app() -> Any:
    """The Celery app whose ``beat_schedule`` and routing the ``driftsafe`` beat uses."""
    from celery_driftsafe.celery_app import get_celery_app

    return get_celery_app()


@pytest.fixture
def driftsafe_publish_app() -> Any:
    """The Celery app the beat publishes through; ``None``: an in-memory one of its own."""
    return None


@pytest.fixture
def driftsafe(
    db: None, driftsafe_clock: FakeClock, driftsafe_celery_app: Any, driftsafe_publish_app: Any
) -> Iterator[Any]:
    """A beat stepped by the test on the fake clock (see the module docstring). ``db`` is
    pytest-django's: the plugin needs pytest-django for this fixture."""
    from celery_driftsafe.testing.beat import SteppedBeat

    beat = SteppedBeat(driftsafe_clock, driftsafe_celery_app, publish_app=driftsafe_publish_app)
    with inject_authority_clock(driftsafe_clock):
        try:
            yield beat
        finally:
            beat.close()
