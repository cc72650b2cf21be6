"""The beat's long-lived objects are frozen out of full garbage collections (beat/gc_freeze.py)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest

from celery_driftsafe.beat.gc_freeze import (
    CHECK_INTERVAL_SECONDS,
    MIN_OBJECTS,
    YOUNG_THRESHOLD,
    HeapKeeper,
    widen_young_generation,
)


@pytest.fixture
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_a_grown_oldest_generation_is_frozen_then_only_after_growing_by_a_quarter(
    unfrozen: None,
) -> None:
    now = [0.0]
    keeper = HeapKeeper(lambda: now[0])
    cache = [{"template": [i]} for i in range(MIN_OBJECTS)]  # long-lived, like the templates
    gc.collect()
    assert keeper.maybe_freeze()
    frozen = gc.get_freeze_count()
    assert frozen >= 2 * MIN_OBJECTS and not gc.get_objects(generation=2)

    now[0] += CHECK_INTERVAL_SECONDS / 2  # not checked again so soon
    more = [{"template": [i]} for i in range(frozen // 2)]
    gc.collect()
    assert not keeper.maybe_freeze()
    assert keeper.maybe_freeze(check_now=True)  # asked to check now (templates built ahead)
    assert gc.get_freeze_count() > frozen and keeper.freezes == 2

    now[0] += CHECK_INTERVAL_SECONDS
    few = [{"template": [i]} for i in range(10)]
    gc.collect()
    assert not keeper.maybe_freeze()  # a few new objects are not worth a full collection
    # the templates were frozen (out of every generation); the few new ones were not
    tracked = {id(o) for o in gc.get_objects()}
    assert id(cache[0]) not in tracked and id(more[-1]) not in tracked
    assert id(few[0]) in tracked


def test_a_frozen_object_dropped_later_is_still_freed() -> None:
    import weakref

    class Template:
        pass

    gc.unfreeze()
    try:
        cache = {1: Template()}
        ref = weakref.ref(cache[1])
        gc.freeze()
        del cache[1]  # replaced in the cache: its reference count frees it
        assert ref() is None
    finally:
        gc.unfreeze()


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
