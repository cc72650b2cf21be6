"""Claiming ahead: while a beat publishes one full batch, the next batch is claimed in a
process of the beat's own (:mod:`celery_driftsafe.claim.helper_process`; ``CLAIM_PROCESS``) or,
until
that is ready, when it is off or lost, in a thread (its own database connection). Only on
databases with ``SKIP LOCKED``, where the two writers never wait on each other."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime
from functools import partial

from django.db import connections

from celery_driftsafe.claim.claimers import ClaimResult
from celery_driftsafe.claim.helper_process import IDLE_SECONDS, ClaimProcess, ClaimProcessLost
from celery_driftsafe.claim.outbox import ClaimedRun
from celery_driftsafe.conf import get_settings
from celery_driftsafe.core.stored_names import Optimisation
from celery_driftsafe.store.connections import refresh_between_rounds

logger = logging.getLogger("celery_driftsafe.scheduler")


class Prefetcher:
    """Batches claimed ahead, on database ``using``, for node ``node_id``: one in a thread
    and, with ``use_process``, one more in a helper process once that is ready (the two claim
    side by side, taking disjoint rows). They are taken in the order they were asked for."""

    def __init__(
        self,
        using: str,
        node_id: str = "",
        *,
        use_process: bool = False,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.using = using
        self._monotonic = monotonic
        #: When (``monotonic``) the helper was started or last asked for a batch.
        self._helper_used = 0.0
        self._executor: ThreadPoolExecutor | None = None
        self._process: ClaimProcess | None = None
        # Off (OPTIMISATIONS_OFF "claim_ahead"): nothing is claimed ahead (not available)
        if (
            get_settings().optimised(Optimisation.CLAIM_AHEAD)
            and connections[using].features.has_select_for_update_skip_locked
        ):
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="driftsafe-claim")
            if use_process:
                self._process = ClaimProcess(using, node_id, monotonic)
        #: Batches asked for, oldest first: a thread's future, or None for the process's.
        self._pending: deque[Future[ClaimResult] | None] = deque()

    @property
    def available(self) -> bool:
        return self._executor is not None

    @property
    def process(self) -> ClaimProcess | None:
        """The helper process, when this beat may use one."""
        return self._process

    @property
    def pending(self) -> int:
        """Batches claimed (or being claimed) ahead and not yet taken."""
        return len(self._pending)

    def claim_ahead(
        self,
        claim: Callable[..., ClaimResult],
        now: datetime,
        node_id: str,
        busy_since: datetime | None,
        room: Callable[[], str | None] = lambda: None,
    ) -> None:
        """Claim the next batches (``claim(now, node_id, busy_since=busy_since)`` in the
        thread, the same in the helper process) while the caller publishes; their results are
        :meth:`take`'s. Each claims at most one batch at a time. The helper is started at the
        first call (and again at the first after a lost one's wait: :meth:`ClaimProcess.revive
        <celery_driftsafe.claim.helper_process.ClaimProcess.revive>`), unless ``room()`` says why
        the
        machine cannot spare it a core."""
        assert self._executor is not None
        helper = self._process
        if helper is not None:
            helper.revive()  # a lost helper, once its wait is over, is started again below
        if helper is not None and helper.unavailable is None:
            if not helper.started:
                why = room()
                if why is None:
                    helper.start()  # a wave: from now on, claims go there too once ready
                    self._helper_used = self._monotonic()  # idle from its start, not before
                else:
                    helper.decline(why)
            if helper.unavailable is None and helper.ready and not helper.busy:
                try:
                    helper.submit(now, busy_since)
                except ClaimProcessLost:
                    pass  # it said so; the thread claims (the batch in hand is published)
                else:
                    self._pending.append(None)
                    self._helper_used = self._monotonic()
        if not any(self._pending):
            self._pending.append(
                self._executor.submit(
                    self._claim, partial(claim, now, node_id, busy_since=busy_since)
                )
            )

    def rest(self) -> bool:
        """Between waves: stop a helper that has had no batch to claim for
        :data:`~celery_driftsafe.claim.helper_process.IDLE_SECONDS` (the next wave starts one
        again);
        whether it stopped one."""
        helper = self._process
        if helper is None or not helper.running or helper.busy or self._pending:
            return False
        if self._monotonic() - self._helper_used < IDLE_SECONDS:
            return False
        helper.stop(f"no batch to claim for {IDLE_SECONDS:g} s")
        return True

    def _claim(self, claim: Callable[[], ClaimResult]) -> ClaimResult:
        refresh_between_rounds(self.using)
        try:
            return claim()
        except BaseException:
            connections[self.using].close()
            raise

    def take(self) -> ClaimResult | None:
        """The oldest batch claimed ahead, if any (its error, if it failed: handled as the
        round's; the batch behind it stays, to be taken next)."""
        if not self._pending:
            return None
        pending = self._pending.popleft()
        if pending is None:
            assert self._process is not None
            return self._process.result()
        return pending.result()

    def drain(self, dispatch: Callable[[list[ClaimedRun]], object]) -> None:
        """Hand every batch claimed ahead to ``dispatch`` (the dispatcher's, which publishes
        them: they are committed as this node's claims). A batch whose claim failed is passed
        over (it rolled back); the last such error is raised once the others are out."""
        failure: Exception | None = None
        while self._pending:
            try:
                result = self.take()
            except Exception as exc:
                failure = exc
                continue
            if result is not None:
                dispatch(result.runs)
        if failure is not None:
            raise failure

    def finish(self, dispatch: Callable[[list[ClaimedRun]], object], node_id: str) -> None:
        """Publish a batch claimed ahead (the beat is stopping: it goes out now rather than
        waiting for another beat's outbox), then let the prefetch thread go, closing its
        database connection."""
        try:
            self.drain(dispatch)
        except Exception as exc:
            logger.warning(
                "could not publish the batch claimed ahead (%s); the outbox will",
                exc,
                extra={"action": "stop", "node": node_id},
            )
        if self._process is not None:
            self._process.stop()
        if self._executor is not None:
            self._executor.submit(connections.close_all).result()
            self._executor.shutdown(wait=True)
            self._executor = None
