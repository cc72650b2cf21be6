"""A beat scheduler that *believes* its wall clock is ``EXAMPLE_CLOCK_SKEW_SECONDS`` off.

The demo skews its beats' clocks for real with libfaketime where it can. Where it cannot
(no libfaketime or no C compiler), it starts them with this scheduler instead: the only place
a beat reads its wall clock is the offset measurement against the time authority, and here
that reading is shifted by the skew, so each node reports the skew as its measured offset.
Whether a slot is due never depends on a node's wall clock, skewed or not.

    celery -A example_project beat -S example_project.skewed_clock:SkewedClockScheduler
"""

from __future__ import annotations

import os
from typing import Any

from celery_driftsafe.scheduler import DriftSafeScheduler
from celery_driftsafe.testing import skewed_authority_clock


class SkewedClockScheduler(DriftSafeScheduler):
    def __init__(self, app: Any, *args: Any, **kwargs: Any) -> None:
        if "clock" not in kwargs:
            clock = skewed_authority_clock(float(os.environ.get("EXAMPLE_CLOCK_SKEW_SECONDS", "0")))
            kwargs["authority"], kwargs["clock"] = clock.authority, clock
        super().__init__(app, *args, **kwargs)
