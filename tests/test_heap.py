"""The beat's long-lived objects are frozen out of full garbage collections (heap.py)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from celery_driftsafe.heap import CHECK_INTERVAL_SECONDS, MIN_OBJECTS, HeapKeeper


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
    now[0] += CHECK_INTERVAL_SECONDS
    assert keeper.maybe_freeze()  # the oldest generation grew by more than a quarter
    assert gc.get_freeze_count() > frozen and keeper.freezes == 2

    now[0] += CHECK_INTERVAL_SECONDS
    few = [{"template": [i]} for i in range(10)]
    gc.collect()
    assert not keeper.maybe_freeze()  # a few new objects are not worth a full collection
    assert len(cache) + len(more) + len(few) > 0


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
