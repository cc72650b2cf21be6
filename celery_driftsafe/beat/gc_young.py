"""A beat's youngest garbage generation, collected less often than Python's default.

A claim round of 500 tasks makes tens of thousands of objects that live until the round ends,
and with Python's default threshold of 700 the cyclic collector walked them again and again
while they were still in use (about 5% of the beat's CPU in a burst; the ablation in
docs/explanation/performance.md measures it). Garbage without reference cycles is freed by
its reference count whatever the threshold.
"""

from __future__ import annotations

import gc

from celery_driftsafe.conf import get_settings
from celery_driftsafe.core.stored_names import Optimisation

#: The youngest generation's threshold in a beat (net allocations between its collections).
YOUNG_THRESHOLD = 20_000


def widen_young_generation() -> bool:
    """Collect the youngest generation every :data:`YOUNG_THRESHOLD` allocations rather than
    Python's default 700 (the other thresholds stay); whether it changed anything. A threshold
    of 0 (collection off) or one already as wide, set by the project, is left as it is."""
    young, *older = gc.get_threshold()
    if not get_settings().optimised(Optimisation.GC_YOUNG) or not 0 < young < YOUNG_THRESHOLD:
        return False
    gc.set_threshold(YOUNG_THRESHOLD, *older)
    return True
