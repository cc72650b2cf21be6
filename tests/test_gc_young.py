"""A beat collects the youngest garbage generation less often (beat/gc_young.py)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest

from celery_driftsafe.beat.gc_young import YOUNG_THRESHOLD, widen_young_generation


@pytest.fixture
def threshold() -> Iterator[None]:
    kept = gc.get_threshold()
    yield
    gc.set_threshold(*kept)


def test_the_youngest_generation_is_widened_unless_the_project_chose(threshold: None) -> None:
    gc.set_threshold(700, 10, 10)  # Python's default
    assert widen_young_generation()
    assert gc.get_threshold() == (YOUNG_THRESHOLD, 10, 10)
    assert not widen_young_generation()  # already as wide

    gc.set_threshold(100_000, 5, 5)  # a project's own, wider
    assert not widen_young_generation() and gc.get_threshold() == (100_000, 5, 5)
    gc.set_threshold(0, 10, 10)  # collection off: left off
    assert not widen_young_generation() and gc.get_threshold() == (0, 10, 10)


@pytest.mark.django_db(transaction=True)
def test_a_beat_widens_the_youngest_generation(
    threshold: None, broker_app: Any, clock: Any
) -> None:
    from celery_driftsafe.scheduler import DriftSafeScheduler

    gc.set_threshold(700, 10, 10)
    sched = DriftSafeScheduler(
        app=broker_app, clock=clock, authority=clock, install_signal_handlers=False
    )
    try:
        assert gc.get_threshold() == (YOUNG_THRESHOLD, 10, 10)
    finally:
        sched.close()
