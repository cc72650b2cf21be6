"""Keeping a beat's long-lived objects out of Python's full garbage collections.

A beat holds a message template for every task it publishes (``fastpublish``): with 100,000
tasks about 200,000 objects that live as long as the process. Python's cyclic collector walks
every tracked object of its oldest generation in a full collection: ~100 ms with 100,000
templates, and during a burst one ran about once a second, each a stall of the round it fell
in. So once the oldest generation has grown by a quarter since the last time (checked every
few seconds), the beat collects once and freezes what survived (:func:`gc.freeze`): frozen
objects are no longer walked. A beat also checks right after building messages ahead, while
it waits: the templates built for the coming wave are then frozen before it, rather than by a
collection that stalls a round of the wave. A frozen object that later becomes garbage is
still freed by its reference count; only a reference cycle among frozen objects would stay,
and the caches frozen here make none.

The youngest generation is collected less often in a beat too (:func:`widen_young_generation`):
a claim round of 500 tasks makes tens of thousands of objects that live until the round ends,
and with Python's default threshold of 700 the collector walked them again and again while they
were still in use (about 5% of the beat's CPU in a burst).
"""

from __future__ import annotations

import gc
from collections.abc import Callable

from celery_driftsafe.conf import get_settings
from celery_driftsafe.core.stored_names import Optimisation

#: How often the oldest generation is counted (a few milliseconds for 400,000 objects).
CHECK_INTERVAL_SECONDS = 10.0
#: Fewer objects than this in the oldest generation cost a full collection little: not frozen.
MIN_OBJECTS = 50_000
#: The youngest generation's threshold in a beat (net allocations between its collections).
YOUNG_THRESHOLD = 20_000


def widen_young_generation() -> bool:
    """Collect the youngest generation every :data:`YOUNG_THRESHOLD` allocations rather than
    Python's default 700 (the other thresholds stay); whether it changed anything. A threshold
    of 0 (collection off) or one already as wide, set by the project, is left as it is.
    Garbage without reference cycles is freed by its reference count whatever this is."""
    young, *older = gc.get_threshold()
    if not get_settings().optimised(Optimisation.GC_YOUNG) or not 0 < young < YOUNG_THRESHOLD:
        return False
    gc.set_threshold(YOUNG_THRESHOLD, *older)
    return True


class HeapKeeper:
    """Freezes the survivors of a full collection when the oldest generation has grown."""

    def __init__(self, monotonic: Callable[[], float]) -> None:
        self._monotonic = monotonic
        self._next_check = 0.0
        #: Full collections and freezes done, for tests and figures.
        self.freezes = 0
        #: Off (``OPTIMISATIONS_OFF`` "gc_freeze"): never freezes.
        self.enabled = get_settings().optimised(Optimisation.GC_FREEZE)

    def maybe_freeze(self, *, check_now: bool = False) -> bool:
        """Check (at most every ``CHECK_INTERVAL_SECONDS``, or now with ``check_now``) and
        freeze if it is worth it; whether it froze."""
        if not self.enabled:
            return False
        now = self._monotonic()
        if now < self._next_check and not check_now:
            return False
        self._next_check = now + CHECK_INTERVAL_SECONDS
        oldest = len(gc.get_objects(generation=2))
        if oldest < max(MIN_OBJECTS, gc.get_freeze_count() // 4):
            return False
        gc.collect()
        gc.freeze()
        self.freezes += 1
        return True
