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
from datetime import UTC, datetime, timedelta
from typing import Any

from celery_driftsafe.conf import get_settings
from celery_driftsafe.scheduler import DriftSafeScheduler
from celery_driftsafe.store.clock import AuthorityClock, authority_from_settings


class SkewedClockScheduler(DriftSafeScheduler):
    def __init__(self, app: Any, *args: Any, **kwargs: Any) -> None:
        skew = timedelta(seconds=float(os.environ.get("EXAMPLE_CLOCK_SKEW_SECONDS", "0")))
        if "clock" not in kwargs:
            settings = get_settings()
            authority = authority_from_settings(settings)
            kwargs["authority"] = authority
            kwargs["clock"] = AuthorityClock(
                authority,
                samples=settings.clock_sync_samples,
                resync_seconds=settings.clock_sync_interval_seconds,
                wall=lambda: datetime.now(UTC) + skew,
            )
        super().__init__(app, *args, **kwargs)
