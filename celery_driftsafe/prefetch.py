"""Claiming ahead: while a beat publishes one full batch, the next batches are claimed in
threads of their own (each with its own database connection). Only on databases with ``SKIP
LOCKED``, where the writers never wait on each other: two claims at once take disjoint
batches. Which of them gets the earlier due tasks is a race, so two batches claimed together
may go out in either order (each in slot order, a few milliseconds apart)."""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from django.db import connections

from celery_driftsafe.claim import ClaimResult
from celery_driftsafe.db_connection import refresh_between_rounds
from celery_driftsafe.dispatch import ClaimedRun

logger = logging.getLogger("celery_driftsafe.scheduler")

#: Batches claimed ahead at most. A claim round waits on the database about as long as it
#: computes, and it costs more than publishing a batch: with one claim ahead, a burst went
#: at the pace of the claims and the publishing thread waited for them. Two claims at once
#: overlap one's database work with the other's Python.
DEPTH = 2


class Prefetcher:
    """At most :data:`DEPTH` batches claimed ahead, on database ``using``, taken in the order
    they were asked for."""

    def __init__(self, using: str) -> None:
        self.using = using
        self._executor: ThreadPoolExecutor | None = None
        if connections[using].features.has_select_for_update_skip_locked:
            self._executor = ThreadPoolExecutor(DEPTH, thread_name_prefix="driftsafe-claim")
        self._pending: deque[Future[ClaimResult]] = deque()

    @property
    def available(self) -> bool:
        return self._executor is not None

    @property
    def pending(self) -> bool:
        """Whether a batch claimed ahead waits to be taken."""
        return bool(self._pending)

    def claim_ahead(self, claim: Callable[[], ClaimResult]) -> None:
        """Run ``claim`` in the prefetch threads until :data:`DEPTH` batches are pending; the
        results are :meth:`take`'s, in this order."""
        assert self._executor is not None
        while len(self._pending) < DEPTH:
            self._pending.append(self._executor.submit(self._claim, claim))

    def _claim(self, claim: Callable[[], ClaimResult]) -> ClaimResult:
        refresh_between_rounds(self.using)
        try:
            return claim()
        except BaseException:
            connections[self.using].close()
            raise

    def take(self) -> ClaimResult | None:
        """The earliest batch claimed ahead, if any (its error, if it failed: handled as the
        round's; the batches after it are still taken, one a round)."""
        return self._pending.popleft().result() if self._pending else None

    def publish(self, dispatch: Callable[[list[ClaimedRun]], object]) -> None:
        """Publish every batch claimed ahead: they are committed as this node's claims."""
        while self._pending:
            result = self.take()
            if result is not None:
                dispatch(result.runs)

    def finish(self, dispatch: Callable[[list[ClaimedRun]], object], node_id: str) -> None:
        """Publish the batches claimed ahead (the beat is stopping: they go out now rather
        than waiting for another beat's outbox), then let the prefetch threads go, closing
        their database connections."""
        while self._pending:
            try:
                self.publish(dispatch)
            except Exception as exc:
                logger.warning(
                    "could not publish a batch claimed ahead (%s); the outbox will",
                    exc,
                    extra={"action": "stop", "node": node_id},
                )
        if self._executor is not None:
            self._close_connections()
            self._executor.shutdown(wait=True)
            self._executor = None

    def _close_connections(self) -> None:
        """Close each prefetch thread's own connection: every thread runs one closing task
        and waits at a barrier for the others, so no thread runs two."""
        assert self._executor is not None
        barrier = threading.Barrier(DEPTH)

        def close() -> None:
            connections.close_all()
            barrier.wait(timeout=10)

        for future in [self._executor.submit(close) for _ in range(DEPTH)]:
            try:
                future.result()
            except threading.BrokenBarrierError:  # a thread stuck elsewhere: it goes anyway
                logger.debug("a prefetch thread did not close its connection in time")
