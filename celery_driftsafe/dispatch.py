"""Publishing claimed runs (the outbox's second half) and recording that they went out.

Order matters: a run is committed as ``claimed`` first, then published with its deterministic
Celery task id, then marked ``dispatched``. A crash between publish and mark leaves a
``claimed`` run that the outbox re-publishes under the same task id; ``DriftSafeTask`` makes
that second delivery harmless. A run is never marked dispatched unless its publish returned.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from django.db.models import Case, F, Value, When

from celery_driftsafe.claim import ClaimedRun
from celery_driftsafe.clock import Clock
from celery_driftsafe.headers import (
    HEADER_FENCING_TOKEN,
    HEADER_PERIODIC_TASK_ID,
    HEADER_RUN_ID,
    HEADER_SLOT,
)
from celery_driftsafe.models import Run, RunStatus

logger = logging.getLogger(__name__)



@dataclass
class DispatchResult:
    published: list[int] = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)
    #: Runs left ``claimed`` because publishing failed (broker down): the outbox retries them.
    deferred: list[int] = field(default_factory=list)


def message_headers(run: ClaimedRun) -> dict[str, Any]:
    """The run's own headers (after the task's custom headers, which cannot override them)."""
    headers = dict(run.options.get("headers") or {})
    headers.update({
        HEADER_RUN_ID: run.run_id,
        HEADER_SLOT: run.slot.isoformat() if run.slot else None,
        HEADER_FENCING_TOKEN: run.fencing_token,
        HEADER_PERIODIC_TASK_ID: run.periodic_task_id,
    })
    return headers


class Dispatcher:
    """Publishes runs through a Celery app over one producer connection per batch."""

    def __init__(self, app: Any, clock: Clock, *, using: str = "default") -> None:
        self.app = app
        self.clock = clock
        self.using = using

    def dispatch(self, runs: Sequence[ClaimedRun]) -> DispatchResult:
        """Publish ``runs`` (pipelined where the transport batches, as kombu's Redis transport
        does), then mark what went out ``dispatched`` and what cannot run ``failed``.

        If the broker fails, every run of the round that is not known to be out stays
        ``claimed``: the outbox re-publishes it after the lease, under the same task id.
        """
        result = DispatchResult()
        if not runs:
            return result
        registered = self.app.tasks
        sent: list[int] = []
        index = 0
        try:
            with self.app.producer_or_acquire() as producer:
                batch = producer.batch() if hasattr(producer, "batch") else nullcontext()
                with batch:
                    for index, run in enumerate(runs):  # noqa: B007 - read after the loop
                        if run.task_name not in registered:
                            result.failed[run.run_id] = (
                                f"task {run.task_name!r} is not registered with this beat's "
                                "Celery app (check the task name, or import its module in the "
                                "beat process)"
                            )
                            continue
                        self._publish(run, producer)
                        sent.append(run.run_id)
        except Exception as exc:  # broker refused or unreachable: nothing is known to be out
            result.deferred = [r.run_id for r in runs if r.run_id not in result.failed]
            logger.error(
                "publishing failed at run %d of %d; %d runs stay claimed for the outbox: %s",
                index + 1, len(runs), len(result.deferred), exc,
                extra={"action": "publish-failed"},
            )
        else:
            result.published = sent
        self._record(result)
        return result

    def _publish(self, run: ClaimedRun, producer: Any) -> None:
        options = {k: v for k, v in run.options.items() if k not in ("headers", "expires_seconds")}
        expires = run.options.get("expires_seconds")
        if expires is not None and run.slot is not None:
            options["expires"] = run.slot + timedelta(seconds=expires)
        self.app.send_task(
            run.task_name,
            args=run.args,
            kwargs=run.kwargs,
            task_id=run.celery_task_id,
            headers=message_headers(run),
            producer=producer,
            **options,
        )

    def _record(self, result: DispatchResult) -> None:
        now = self.clock.now()
        runs = Run.objects.using(self.using)
        if result.published:
            # A fast worker may have started the run already: keep its status, stamp the time.
            runs.filter(pk__in=result.published, dispatched_at__isnull=True).update(
                dispatched_at=now,
                status=Case(
                    When(status=RunStatus.CLAIMED, then=Value(RunStatus.DISPATCHED)),
                    default=F("status"),
                ),
            )
        for run_id, reason in result.failed.items():
            logger.error("run %s failed before publishing: %s", run_id, reason,
                         extra={"action": "dispatch-failed", "run": run_id})
            runs.filter(pk=run_id, status=RunStatus.CLAIMED).update(
                status=RunStatus.FAILED, finished_at=now, error=reason
            )
