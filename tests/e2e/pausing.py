"""A beat that freezes itself at the worst moment, for the paused-publisher test: after a round
committed its claims and before it publishes them. A test arms it by creating the file named
by ``DRIFTSAFE_E2E_PAUSE_FLAG``; the beat removes it and sends itself SIGSTOP, exactly as a
VM pause or a long GC would stop it there. The test sends SIGCONT."""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence
from typing import Any

from celery_driftsafe.claim.outbox import ClaimedRun
from celery_driftsafe.scheduler import DriftSafeScheduler


class PausingScheduler(DriftSafeScheduler):
    def setup_schedule(self) -> None:
        super().setup_schedule()
        dispatch = self.dispatcher.dispatch
        flag = os.environ.get("DRIFTSAFE_E2E_PAUSE_FLAG", "")

        def pause_then_dispatch(runs: Sequence[ClaimedRun]) -> Any:
            if runs and flag and os.path.exists(flag):
                os.remove(flag)
                os.kill(os.getpid(), signal.SIGSTOP)
            return dispatch(runs)

        self.dispatcher.dispatch = pause_then_dispatch  # type: ignore[method-assign]
