"""Claiming ahead: while a beat publishes one full batch, the next batch is claimed in a
thread of its own (its own database connection). Only on databases with ``SKIP LOCKED``,
where the two writers never wait on each other."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from django.db import connections

from celery_driftsafe.claim import ClaimResult
from celery_driftsafe.db_connection import refresh_between_rounds
from celery_driftsafe.dispatch import ClaimedRun

logger = logging.getLogger("celery_driftsafe.scheduler")


class Prefetcher:
    """At most one batch claimed ahead, on database ``using``."""

    def __init__(self, using: str) -> None:
        self.using = using
        self._executor: ThreadPoolExecutor | None = None
        if connections[using].features.has_select_for_update_skip_locked:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="driftsafe-claim")
        self._pending: Future[ClaimResult] | None = None

    @property
    def available(self) -> bool:
        return self._executor is not None

    def claim_ahead(self, claim: Callable[[], ClaimResult]) -> None:
        """Run ``claim`` in the prefetch thread; its result is :meth:`take`'s."""
        assert self._executor is not None
        self._pending = self._executor.submit(self._claim, claim)

    def _claim(self, claim: Callable[[], ClaimResult]) -> ClaimResult:
        refresh_between_rounds(self.using)
        try:
            return claim()
        except BaseException:
            connections[self.using].close()
            raise

    def take(self) -> ClaimResult | None:
        """The batch claimed ahead, if any (its error, if it failed: handled as the round's)."""
        pending, self._pending = self._pending, None
        return None if pending is None else pending.result()

    def publish(self, dispatch: Callable[[list[ClaimedRun]], object]) -> None:
        """Publish the batch claimed ahead, if any: it is committed as this node's claims."""
        result = self.take()
        if result is not None:
            dispatch(result.runs)

    def finish(self, dispatch: Callable[[list[ClaimedRun]], object], node_id: str) -> None:
        """Publish a batch claimed ahead (the beat is stopping: it goes out now rather than
        waiting for another beat's outbox), then let the prefetch thread go, closing its
        database connection."""
        try:
            self.publish(dispatch)
        except Exception as exc:
            logger.warning(
                "could not publish the batch claimed ahead (%s); the outbox will",
                exc,
                extra={"action": "stop", "node": node_id},
            )
        if self._executor is not None:
            self._executor.submit(connections.close_all).result()
            self._executor.shutdown(wait=True)
            self._executor = None
