"""``DriftSafeTask``: a Celery task base class that executes a run at most once, and keeps
Celery's own semantics (retries, results, transactions, expiry, canvas, time limits).

Celery delivers at least once (``acks_late`` redelivery, Redis visibility timeouts, a beat's
outbox re-publishing after a crash), so the same run can reach several workers. For a message
that carries ``driftsafe_run_id`` the base class (see :mod:`celery_driftsafe.worker.execution`)

1. reads the run from the ledger and rejects the message if the headers do not match it;
2. drops a delivery of a finished run, or a copy of an earlier attempt (Celery's ``retries``
   below the run's ``attempt``), and ends a run past its ``expires_at`` (on the time
   authority's clock) as ``expired``;
3. takes the run's lock with a watchdog renewing it, and with it a fencing token that continues
   the run's own sequence;
4. marks the run ``started`` with that token — a write the database refuses when the row
   already carries a newer token — runs the body, and records ``succeeded`` or ``failed``, or,
   when the body retries, hands the run over to the next attempt (``retrying``) before the
   retry's message is sent.

A delivery that does not run the body raises :class:`celery.exceptions.Ignore`, so it never
writes to the result backend. With ``task_track_started``, Celery's ``STARTED`` write, made
before the body, is held back too for a delivery that is sure to be dropped (a finished run, a
copy of an earlier attempt): it would overwrite the run's stored outcome. Calls without the
header behave exactly like a plain task, except that inside a transaction they are published
on commit. ``apply_async(..., idempotency_key="order-42")`` creates the ledger row at publish
time so that one key runs once across producers.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Task, states
from celery.exceptions import Ignore
from celery.signals import task_prerun

from celery_driftsafe.core.headers import RunHeaders, read_headers
from celery_driftsafe.exceptions import BadRunHeaders, LedgerUnavailable
from celery_driftsafe.store.clock import authority_clock
from celery_driftsafe.worker.execution import Execution, current_execution

logger = logging.getLogger(__name__)

#: Set on the request of a delivery that is sure to be dropped: Celery's ``STARTED`` write is
#: held back (see :func:`_hold_back_started`).
_HOLD_STARTED = "driftsafe_hold_started"


class DriftSafeTask(Task):
    """Base class for tasks that must run at most once per run (see the module docstring).

    Use it as ``@app.task(base=DriftSafeTask, acks_late=True, reject_on_worker_lost=True)``:
    with late acknowledgement a worker killed mid-run leaves its message to be redelivered,
    and the redelivery takes the run over once the dead worker's lease has run out.
    """

    abstract = True
    #: Records hard time limits and lost pool processes in the ledger, and leaves a run's
    #: expiry to the time authority (see :mod:`celery_driftsafe.worker.request`).
    Request = "celery_driftsafe.worker.request:DriftSafeRequest"
    #: Its :meth:`apply_async` publishes on commit; a beat publishing a claimed run calls
    #: Celery's own ``Task.apply_async`` instead
    #: (:data:`celery_driftsafe.publish.adhoc.PUBLISHES_ON_COMMIT`).
    driftsafe_publishes_on_commit = True
    #: It records its runs itself: the receivers of plain tasks' runs leave them alone
    #: (:data:`celery_driftsafe.worker.plain_task_receivers.RECORDS_ITS_RUNS`).
    driftsafe_records_its_runs = True

    @property
    def backend(self) -> Any:
        """The task's result backend; for a delivery that is sure to be dropped, one that does
        not store ``STARTED`` (:func:`_hold_back_started`)."""
        backend = Task.backend.fget(self)
        if getattr(self.request, _HOLD_STARTED, False):
            return _StartedHeldBack(backend)
        return backend

    @backend.setter
    def backend(self, value: Any) -> None:
        Task.backend.fset(self, value)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            headers = read_headers(self.request)
        except BadRunHeaders as exc:
            logger.error(
                "rejected %s[%s]: %s; not executed",
                self.name,
                self.request.id,
                exc,
                extra={"action": "reject", "run": -1},
            )
            raise Ignore() from None
        if headers is None:
            return super().__call__(*args, **kwargs)
        execution = Execution(self, headers)
        try:
            return execution.run(args, kwargs)
        except LedgerUnavailable as exc:  # nothing ran yet: try the whole delivery later
            if self.request.is_eager:
                raise
            execution.resend(str(exc), 5.0, args, kwargs)

    def retry(self, *args: Any, **kwargs: Any) -> Any:
        """:meth:`celery.Task.retry`; for a run, the attempt is recorded and the run handed
        over to the next attempt just before the retry's message is sent."""
        execution = current_execution()
        if execution is not None:
            exc = kwargs.get("exc", args[2] if len(args) > 2 else None)
            execution.retry_reason = repr(exc) if exc is not None else "self.retry()"
        return super().retry(*args, **kwargs)

    def apply_async(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        *,
        idempotency_key: str | None = None,
        **options: Any,
    ) -> Any:
        """Like :meth:`celery.Task.apply_async`, published on commit inside a transaction;
        with ``idempotency_key`` the call is recorded in the run ledger first and runs at most
        once for that key, whoever sends it."""
        from celery_driftsafe.publish.adhoc import publish_idempotent, send_on_commit

        execution = current_execution()
        if execution is not None and execution.is_retry(self, task_id, options):
            execution.hand_over(options["retries"], execution.retry_reason)
            return super().apply_async(args, kwargs, task_id=task_id, **options)
        if idempotency_key is not None:
            return publish_idempotent(self, idempotency_key, args, kwargs, task_id, options)
        plain = super().apply_async
        return send_on_commit(
            self, lambda tid: plain(args, kwargs, task_id=tid, **options), task_id
        )


class _StartedHeldBack:
    """A result backend that sends everything on but a ``STARTED`` state."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def store_result(self, task_id: str, result: Any, state: str, *args: Any, **kw: Any) -> Any:
        if state == states.STARTED:
            return result
        return self._backend.store_result(task_id, result, state, *args, **kw)


def _hold_back_started(task: Any = None, **_: Any) -> None:
    """``task_track_started``: Celery stores ``STARTED`` right after this signal and before
    the body, so a duplicate of a finished run would set a stored ``SUCCESS`` or ``FAILURE``
    back to ``STARTED`` on a backend that overwrites (django-celery-results does; Celery's
    key-value backends keep a ``SUCCESS``). For a delivery that is sure to be dropped, the
    request is marked and :attr:`DriftSafeTask.backend` holds that write back. Costs one read
    of the run a delivery, only for a task with ``track_started``."""
    if not isinstance(task, DriftSafeTask) or not task.track_started:
        return
    request = task.request
    if request.is_eager:
        return
    try:
        headers = read_headers(request)
    except BadRunHeaders:
        setattr(request, _HOLD_STARTED, True)  # rejected in __call__, never started
        return
    if headers is not None and Execution(task, headers).drops():
        setattr(request, _HOLD_STARTED, True)


task_prerun.connect(_hold_back_started, weak=False, dispatch_uid="celery_driftsafe.hold_started")

__all__ = ["BadRunHeaders", "DriftSafeTask", "RunHeaders", "authority_clock", "read_headers"]
