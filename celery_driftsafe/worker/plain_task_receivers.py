"""Outcomes of plain tasks' runs, recorded by the worker that ran them.

The scheduler fires any Celery task. A task without :class:`~celery_driftsafe.task.DriftSafeTask`
as its base records nothing itself, so its run used to wait for a beat's reconciliation: the
result backend's state a minute later, or, for a task whose results are ignored, ``expired`` a
day later although it ran. On a worker where this app is installed, the ``task_prerun`` and
``task_postrun`` receivers here record such a run's outcome as soon as its body returns:
``succeeded``, or ``failed`` with the traceback, with the worker, the attempt and the instants
the body started and ended on the time authority's clock. One conditional update a run.

Nothing here changes what runs: a plain task has no at-most-once guarantee (a second delivery
runs the body again, and only the first outcome is kept). A body that ends in a retry records
nothing (its next attempt will); a body killed by a time limit or with its pool process leaves
the run to the reconciliation, as before.
"""

from __future__ import annotations

import logging
import socket
import traceback
from datetime import datetime
from typing import Any

from celery import states

from celery_driftsafe.core.headers import RunHeaders, valid_headers
from celery_driftsafe.core.stored_names import RunStatus
from celery_driftsafe.exceptions import ClockError, LedgerUnavailable

logger = logging.getLogger("celery_driftsafe.task")

#: The request attribute that carries the body's start from ``task_prerun`` to ``task_postrun``.
_STARTED = "driftsafe_plain_started_at"
_OUTCOMES = {states.SUCCESS: RunStatus.SUCCEEDED, states.FAILURE: RunStatus.FAILED}
#: The class attribute, true on a task class that records its runs itself
#: (:class:`~celery_driftsafe.task.DriftSafeTask`): these receivers leave its runs alone. The
#: worker layer reads this rather than import the task class above it.
RECORDS_ITS_RUNS = "driftsafe_records_its_runs"


def _plain_run(task: Any) -> RunHeaders | None:
    """The run headers of ``task``'s current request, when the task records nothing itself."""
    if task is None or getattr(task, RECORDS_ITS_RUNS, False) is True:
        return None
    return valid_headers(task.request)  # malformed: the body runs as any plain task's does


def _now() -> datetime | None:
    from celery_driftsafe.store.clock import authority_clock

    try:
        return authority_clock().now()
    except ClockError:
        return None


def on_task_prerun(sender: Any = None, task: Any = None, **kwargs: Any) -> None:
    """``task_prerun`` receiver: note when a plain task's run started (no write)."""
    if _plain_run(task) is not None:
        setattr(task.request, _STARTED, _now())


def on_task_postrun(
    sender: Any = None, task: Any = None, retval: Any = None, state: str | None = None, **kw: Any
) -> None:
    """``task_postrun`` receiver: record the outcome of a plain task's run (the run of
    that message only: its Celery task id is the run's)."""
    status = _OUTCOMES.get(state or "")
    if status is None:
        return  # a retry (its last attempt records), an Ignore, a Reject
    headers = _plain_run(task)
    if headers is None:
        return
    from django.db import close_old_connections

    from celery_driftsafe.claim.pausing import count_outcome
    from celery_driftsafe.ledger.run_ledger import Ledger
    from celery_driftsafe.monitoring import metrics

    request = task.request
    error = ""
    if status == RunStatus.FAILED and isinstance(retval, BaseException):
        error = "".join(traceback.format_exception(retval, limit=20))
    finished_at = _now()
    if finished_at is None:
        logger.error(
            "run %s: the time authority is unreachable; the outcome %s is left to the "
            "reconciliation",
            headers.run_id,
            status,
            extra={"action": "outcome-lost", "run": headers.run_id},
        )
        return
    if not request.is_eager:  # an eager call may be inside the caller's transaction
        close_old_connections()
    ledger = Ledger()

    def end() -> bool:
        ended = ledger.end_plain(
            headers.run_id,
            task.name,
            str(request.id or ""),
            int(request.retries or 0),
            request.hostname or socket.gethostname(),
            status,
            getattr(request, _STARTED, None),
            finished_at,
            error,
        )
        if ended:  # towards pause_after_failures, in the same transaction
            count_outcome(ledger.connection.alias, headers.run_id, status, finished_at)
        return ended

    try:
        written = ledger.together(end)
    except LedgerUnavailable as exc:
        logger.error(
            "run %s: could not record %s: %s; the outcome is left to the reconciliation",
            headers.run_id,
            status,
            exc,
            extra={"action": "outcome-lost", "run": headers.run_id},
        )
        return
    if written:
        metrics.execution(task.name, status)
