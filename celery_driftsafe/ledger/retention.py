"""Retention: the run ledger, its fencing counters and its lock rows stay bounded.

Every slot adds a :class:`~celery_driftsafe.models.Run` row, and every executed run a fencing
counter in Redis (``<prefix>:fence:run:<id>``) or a :class:`~celery_driftsafe.models.Lock` row.
:class:`Pruner` deletes what is no longer needed, in small batches:

* a run is deleted once it is *finished* (``succeeded``, ``skipped``, ``revoked``: after
  ``RUN_RETENTION_SECONDS``; ``failed``, ``missed``, ``expired``: after
  ``FAILED_RUN_RETENTION_SECONDS``), counted from its claim (``claimed_at``). A finished status
  is final: nothing moves a run out of it, so a run in flight (``claimed``, ``dispatched``,
  ``started``, ``retrying``) is never deleted, however old;
* the latest run (by slot) of each periodic task is kept whatever its age: editing or
  re-enabling a task reads it to start after every slot that fired (one row per task);
* with a run go its :class:`~celery_driftsafe.models.RunAttempt` rows, its database lock row
  (when nobody holds it) and its Redis fencing counter. A fencing counter also expires by
  itself (:func:`celery_driftsafe.locks.fence_ttl_seconds`), so Redis stays bounded when nothing
  prunes; why a counter
  that expires cannot let a stale holder win is explained in ``docs/reference/locks.md``.

A batch is one short transaction: the candidates are read in ``claimed_at`` order on the
``(status, claimed_at)`` index, one status at a time, locked with ``SKIP LOCKED`` where the
database has it, and deleted by primary key. Between two batches a pass pauses so that it
spends at most ``PRUNE_DUTY_CYCLE`` of its time in statements (a quarter by default): small
batches and long pauses keep a claim from queueing behind a batch for long.

The beats prune with :class:`BackgroundPruner` (one beat at a time, under the ``prune`` lock,
in a thread of their own, every ``PRUNE_INTERVAL_SECONDS``); cron users run
``manage.py driftsafe_prune``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from celery_driftsafe.conf import DriftSafeSettings, get_settings
from celery_driftsafe.core.stored_names import FINISHED, RunStatus
from celery_driftsafe.store.background_pass import BackgroundPass

logger = logging.getLogger("celery_driftsafe.retention")

#: Finished runs kept ``RUN_RETENTION_SECONDS``.
DONE = (RunStatus.SUCCEEDED, RunStatus.SKIPPED, RunStatus.REVOKED)
#: Finished runs that did not succeed, kept ``FAILED_RUN_RETENTION_SECONDS``.
NOT_SUCCEEDED = (RunStatus.FAILED, RunStatus.MISSED, RunStatus.EXPIRED)
assert set(DONE) | set(NOT_SUCCEEDED) == set(FINISHED), "every finished status has a retention"
#: The name of the lock one pruning beat holds.
PRUNE_LOCK = "prune"


@dataclass(frozen=True)
class Retention:
    """How long finished runs are kept (pure: no database, time passed in)."""

    done: timedelta | None
    not_succeeded: timedelta | None

    @classmethod
    def from_settings(cls, settings: DriftSafeSettings) -> Retention:
        def span(seconds: float | None) -> timedelta | None:
            return None if seconds is None else timedelta(seconds=seconds)

        return cls(
            span(settings.run_retention_seconds), span(settings.failed_run_retention_seconds)
        )

    @property
    def keeps_everything(self) -> bool:
        return self.done is None and self.not_succeeded is None

    def cutoffs(self, now: datetime) -> list[tuple[str, datetime]]:
        """``(status, cutoff)``: runs of that status claimed before ``cutoff`` may go."""
        found: list[tuple[str, datetime]] = []
        for statuses, keep in ((DONE, self.done), (NOT_SUCCEEDED, self.not_succeeded)):
            if keep is not None:
                found += [(status, now - keep) for status in statuses]
        return found


@dataclass
class Pruned:
    """What a batch or a pass deleted."""

    runs: int = 0
    attempts: int = 0
    lock_rows: int = 0
    fences: int = 0
    batches: int = 0
    seconds: float = 0.0
    by_status: dict[str, int] = field(default_factory=dict)

    def add(self, other: Pruned) -> None:
        self.runs += other.runs
        self.attempts += other.attempts
        self.lock_rows += other.lock_rows
        self.fences += other.fences
        self.batches += other.batches
        self.seconds += other.seconds
        for status, count in other.by_status.items():
            self.by_status[status] = self.by_status.get(status, 0) + count


class Pruner:
    """Deletes finished runs past their retention (see the module docstring)."""

    def __init__(
        self,
        settings: DriftSafeSettings | None = None,
        *,
        using: str = "default",
        batch_size: int | None = None,
        redis: Any = None,
    ) -> None:
        self.settings = settings or get_settings()
        self.using = using
        self.batch_size = batch_size or self.settings.prune_batch_size
        self.retention = Retention.from_settings(self.settings)
        self._redis = redis

    def _client(self) -> Any:
        if self._redis is None and self.settings.redis_url:
            from celery_driftsafe.store.redis import get_redis

            self._redis = get_redis(self.settings)
        return self._redis

    def _candidates(self, status: str, cutoff: datetime, limit: int, *, lock: bool) -> Any:
        from django.db import connections
        from django.db.models import Exists, OuterRef, Q

        from celery_driftsafe.models import Run

        runs = Run.objects.using(self.using)
        newer = runs.filter(
            periodic_task_id=OuterRef("periodic_task_id"), slot__gt=OuterRef("slot")
        )
        # A run of a task is kept while it is the task's latest (no newer slot); a run without
        # a task (ad hoc, or its task was deleted) has nothing to protect.
        queryset = (
            runs.filter(status=status, claimed_at__lt=cutoff)
            .filter(Q(periodic_task_id__isnull=True) | Exists(newer))
            .order_by("claimed_at")
        )
        if lock and connections[self.using].features.has_select_for_update_skip_locked:
            queryset = queryset.select_for_update(skip_locked=True)
        return queryset.values_list("pk", flat=True)[:limit]

    def pending(self, now: datetime) -> dict[str, int]:
        """How many runs of each status a pass at ``now`` would delete (``--dry-run``)."""
        counts: dict[str, int] = {}
        for status, cutoff in self.retention.cutoffs(now):
            counts[status] = self._candidates(status, cutoff, 2**62, lock=False).count()
        return counts

    def has_candidates(self, now: datetime) -> bool:
        """Whether anything is to be deleted at ``now``: a read only, outside any transaction
        (a pass with nothing to do takes no write lock, not even on SQLite)."""
        return any(
            self._candidates(status, cutoff, 1, lock=False).exists()
            for status, cutoff in self.retention.cutoffs(now)
        )

    def prune_batch(self, now: datetime) -> Pruned:
        """Delete at most ``batch_size`` runs in one transaction; their fencing counters are
        deleted after it commits."""
        from django.db import transaction

        started = time.monotonic()
        done = Pruned(batches=1)
        deleted: list[int] = []
        with transaction.atomic(using=self.using):
            for status, cutoff in self.retention.cutoffs(now):
                left = self.batch_size - len(deleted)
                if left <= 0:
                    break
                ids = list(self._candidates(status, cutoff, left, lock=True))
                if ids:
                    self._delete_rows(ids, status, now, done)
                    deleted += ids
        done.fences = self._delete_fences(deleted)
        done.seconds = time.monotonic() - started
        return done

    def _delete_rows(self, ids: Sequence[int], status: str, now: datetime, done: Pruned) -> None:
        from django.db.models import Q

        from celery_driftsafe.models import Lock, Run, RunAttempt

        done.attempts += (
            RunAttempt.objects.using(self.using).filter(run_id__in=ids)._raw_delete(self.using)
        )
        # Re-checked in the statement: a finished status is final, but nothing is taken on trust.
        count = (
            Run.objects.using(self.using).filter(pk__in=ids, status=status)._raw_delete(self.using)
        )
        done.runs += count
        done.by_status[status] = done.by_status.get(status, 0) + count
        done.lock_rows += (
            Lock.objects.using(self.using)
            .filter(Q(token="") | Q(expires_at__lte=now), name__in=[f"run:{pk}" for pk in ids])
            ._raw_delete(self.using)
        )

    def _delete_fences(self, ids: Sequence[int]) -> int:
        client = self._client() if ids else None
        if client is None:
            return 0
        from redis.exceptions import RedisError

        from celery_driftsafe.store.redis import key_prefix

        prefix = key_prefix(self.settings)
        try:
            return int(client.unlink(*(f"{prefix}:fence:run:{pk}" for pk in ids)))
        except RedisError as exc:  # they expire by themselves
            logger.warning(
                "could not delete the fencing counters of %d pruned runs: %s",
                len(ids),
                exc,
                extra={"action": "prune-fences"},
            )
            return 0

    def pause_after(self, batch_seconds: float) -> float:
        """The pause after a batch that took ``batch_seconds``: the pass then spends
        ``PRUNE_DUTY_CYCLE`` of its time in statements."""
        duty = self.settings.prune_duty_cycle
        return batch_seconds * (1.0 - duty) / duty

    def prune(
        self,
        now: datetime,
        *,
        max_batches: int | None = None,
        pause: float | None = None,
        stop: Callable[[float], bool] | None = None,
    ) -> Pruned:
        """Batches until nothing is left to delete at ``now`` (or ``max_batches``). Between
        two batches it pauses ``pause`` seconds (default: :meth:`pause_after` the batch);
        ``stop(seconds)`` waits and says whether to stop (default: a plain sleep)."""
        total = Pruned()
        if not self.has_candidates(now):
            return total
        while max_batches is None or total.batches < max_batches:
            batch = self.prune_batch(now)
            total.add(batch)
            if batch.runs < self.batch_size:
                break
            wait = self.pause_after(batch.seconds) if pause is None else pause
            if stop is not None:
                if stop(wait):
                    break
            elif wait > 0:
                time.sleep(wait)
        if total.runs:
            logger.info(
                "pruned %d runs (%d attempts, %d lock rows, %d fencing counters) in %d "
                "batches, %.2f s",
                total.runs,
                total.attempts,
                total.lock_rows,
                total.fences,
                total.batches,
                total.seconds,
                extra={"action": "prune"},
            )
        return total


class BackgroundPruner(BackgroundPass):
    """A beat's pruning: at most every ``PRUNE_INTERVAL_SECONDS``, a pass in a thread of its
    own (its own database connection), while this beat holds the ``prune`` lock; a beat that
    finds it held leaves the pass to its holder. :meth:`maybe_start` costs the round nothing
    but a comparison (and a thread start when due), so claiming is never delayed by it."""

    thread_name = "driftsafe-prune"

    def __init__(self, *, using: str = "default", monotonic: Callable[[], float]) -> None:
        # The first pass comes one interval after the start (a beat restarting in a loop
        # does not prune on every start).
        first_at = monotonic() + (get_settings().prune_interval_seconds or 0.0)
        super().__init__(using=using, monotonic=monotonic, first_at=first_at)
        self.last: Pruned | None = None

    def interval(self) -> float | None:
        return get_settings().prune_interval_seconds

    def wanted(self) -> bool:
        return not Retention.from_settings(get_settings()).keeps_everything

    def run_pass(self, now: datetime) -> None:
        from celery_driftsafe.exceptions import LockError
        from celery_driftsafe.locks import lock_backend

        settings = get_settings()
        try:
            lock = lock_backend(settings, using=self.using).lock(
                PRUNE_LOCK, ttl=max(settings.lease_seconds, 10.0)
            )
            try:
                if not lock.acquire(blocking=False):
                    return  # another beat prunes
            except LockError as exc:
                logger.warning(
                    "not pruning this time: the lock backend is unreachable: %s",
                    exc,
                    extra={"action": "prune"},
                )
                return
            with lock.watch():
                self.last = Pruner(settings, using=self.using).prune(now, stop=self._stop.wait)
        except Exception:
            logger.exception(
                "pruning the run ledger failed; trying again later", extra={"action": "prune"}
            )
