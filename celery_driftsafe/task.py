"""``DriftSafeTask``: a Celery task base class that executes a run at most once.

Celery delivers at least once (``acks_late`` redelivery, Redis visibility timeouts, a beat's
outbox re-publishing after a crash), so the same run can reach several workers. For a message
that carries ``driftsafe_run_id`` the base class

1. reads the run from the ledger and rejects the message if the headers do not match it
   (unknown run, another task's run, another Celery task id, a malformed header);
2. takes the run's lock (Redis, or the database without Redis) with a watchdog renewing it,
   and with it a fencing token;
3. re-verifies the run inside the lock and marks it ``started`` with that token — a write
   the database refuses when the row already carries a newer token;
4. runs the body, then records ``succeeded`` or ``failed`` — again refused when a newer token
   has taken over meanwhile (a worker paused past its lease), whose outcome is then discarded
   with a log line.

A duplicate delivery of a running or finished run is acknowledged, logged, counted on the run
(``duplicate_deliveries``) and never executed. Calls without the header behave exactly like a
plain task. ``apply_async(..., idempotency_key="order-42")`` creates the ledger row at publish
time so that one key runs once across producers.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import traceback
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from celery import Task
from django.db import IntegrityError
from django.db.models import F

from celery_driftsafe.clock import AuthorityClock, authority_from_settings
from celery_driftsafe.conf import get_settings
from celery_driftsafe.exceptions import DriftSafeError, LockError
from celery_driftsafe.headers import (
    ALL as RUN_HEADERS,
)
from celery_driftsafe.headers import (
    HEADER_FENCING_TOKEN,
    HEADER_PERIODIC_TASK_ID,
    HEADER_RUN_ID,
    HEADER_SLOT,
)
from celery_driftsafe.locks import lock_backend

if TYPE_CHECKING:
    pass

logger = logging.getLogger(__name__)

_ADHOC_NAMESPACE = uuid.UUID("0b8c7f4e-2a55-4d1e-9d8e-7a61c3f0b2a4")
# Run statuses (spelled out: this module must import before Django's app registry is ready,
# so that a Celery app module can say base=DriftSafeTask).
_RUNNABLE = ("claimed", "dispatched", "started")
_FINISHED = ("succeeded", "failed", "skipped", "missed")


class BadRunHeaders(DriftSafeError):
    """A message's driftsafe headers are malformed or do not match its run."""


class LedgerUnavailable(DriftSafeError):
    """The database could not be reached before the body ran: the delivery is re-sent."""


#: How long a worker keeps retrying to record an outcome while the database is away.
FINISH_RETRY_SECONDS = 60.0


@dataclass(frozen=True)
class RunHeaders:
    run_id: int
    fencing_token: int
    periodic_task_id: int | None
    slot: str | None


def _int_header(name: str, value: Any, *, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise BadRunHeaders(f"header {name}={value!r} is not a whole number")
    try:
        number = int(value)
    except ValueError:
        raise BadRunHeaders(f"header {name}={value!r} is not a whole number") from None
    if number < 0:
        raise BadRunHeaders(f"header {name}={value!r} is negative")
    return number


def read_headers(request: Any) -> RunHeaders | None:
    """The run headers of the current request, None when it carries none."""
    raw = getattr(request, HEADER_RUN_ID, None)
    if raw is None:
        return None
    run_id = _int_header(HEADER_RUN_ID, raw)
    token = _int_header(HEADER_FENCING_TOKEN, getattr(request, HEADER_FENCING_TOKEN, 0))
    periodic = _int_header(
        HEADER_PERIODIC_TASK_ID, getattr(request, HEADER_PERIODIC_TASK_ID, None), optional=True
    )
    slot = getattr(request, HEADER_SLOT, None)
    if slot is not None and not isinstance(slot, str):
        raise BadRunHeaders(f"header {HEADER_SLOT}={slot!r} is not an ISO 8601 instant")
    assert run_id is not None and token is not None
    return RunHeaders(run_id, token, periodic, slot)


def _runs() -> Any:
    """The run ledger's manager, imported late (see the status tuples above)."""
    from celery_driftsafe.models import Run

    return Run.objects


_clocks: dict[int, AuthorityClock] = {}
_clocks_lock = threading.Lock()


def authority_clock() -> AuthorityClock:
    """This process's clock on the configured authority (re-measured every minute)."""
    pid = os.getpid()
    with _clocks_lock:
        clock = _clocks.get(pid)
        if clock is None:
            settings = get_settings()
            clock = AuthorityClock(
                authority_from_settings(settings),
                samples=1, resync_seconds=settings.clock_sync_interval_seconds,
            )
            _clocks[pid] = clock
        return clock


def _log(level: int, message: str, *args: Any, run_id: int, action: str, **extra: Any) -> None:
    logger.log(level, message, *args, extra={"action": action, "run": run_id, **extra})


class DriftSafeTask(Task):
    """Base class for tasks that must run at most once per run (see the module docstring).

    Use it as ``@app.task(base=DriftSafeTask, acks_late=True, reject_on_worker_lost=True)``:
    with late acknowledgement a worker killed mid-run leaves its message to be redelivered,
    and the redelivery takes the run over once the dead worker's lease has run out.
    """

    abstract = True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            headers = read_headers(self.request)
        except BadRunHeaders as exc:
            _log(logging.ERROR, "rejected %s[%s]: %s; not executed", self.name,
                 self.request.id, exc, run_id=-1, action="reject")
            return None
        if headers is None:
            return super().__call__(*args, **kwargs)
        execution = _Execution(self, headers)
        try:
            return execution.run(args, kwargs)
        except LedgerUnavailable as exc:  # nothing ran yet: try the whole delivery later
            return execution.resend(str(exc), 5.0, args, kwargs)

    def apply_async(
        self, args: Any = None, kwargs: Any = None, task_id: str | None = None,
        *, idempotency_key: str | None = None, **options: Any,
    ) -> Any:
        """Like :meth:`celery.Task.apply_async`; with ``idempotency_key`` the call is recorded
        in the run ledger first and runs at most once for that key, whoever sends it."""
        if idempotency_key is None:
            return super().apply_async(args, kwargs, task_id=task_id, **options)
        return _publish_idempotent(self, idempotency_key, args, kwargs, options)


class _Ledger:
    """The statements every delivery makes, as plain SQL: this is the per-execution hot path,
    where compiling ORM queries would cost more than the round trips."""

    def __init__(self) -> None:
        from django.db import connection

        from celery_driftsafe.models import PeriodicTask, Run

        self.connection = connection
        quote = connection.ops.quote_name
        self.runs = quote(Run._meta.db_table)
        self.tasks = quote(PeriodicTask._meta.db_table)

    def _write(self, sql: str, params: list[Any]) -> int:
        from django.db import DatabaseError

        try:
            with self.connection.cursor() as cursor:
                cursor.execute(sql, params)
                return int(cursor.rowcount)
        except DatabaseError as exc:
            self.connection.close()  # the next statement reconnects
            raise LedgerUnavailable(f"database unreachable: {exc}") from exc

    def _at(self, instant: datetime) -> Any:
        return self.connection.ops.adapt_datetimefield_value(instant)

    def load(self, run_id: int) -> dict[str, Any] | None:
        sql = (f"SELECT r.status, r.task_name, r.celery_task_id, r.periodic_task_id, "
               f"t.overlap_policy FROM {self.runs} r LEFT JOIN {self.tasks} t "
               f"ON t.id = r.periodic_task_id WHERE r.id = %s")
        from django.db import DatabaseError

        try:
            with self.connection.cursor() as cursor:
                cursor.execute(sql, [run_id])
                row = cursor.fetchone()
        except DatabaseError as exc:
            self.connection.close()
            raise LedgerUnavailable(f"database unreachable: {exc}") from exc
        if row is None:
            return None
        keys = ("status", "task_name", "celery_task_id", "periodic_task_id", "overlap_policy")
        return dict(zip(keys, row, strict=True))

    def start(self, run_id: int, token: int, now: datetime, worker: str) -> bool:
        return self._write(
            f"UPDATE {self.runs} SET status = 'started', started_at = %s, fencing_token = %s, "
            f"worker = %s, error = '' WHERE id = %s AND fencing_token < %s "
            f"AND status IN ('claimed', 'dispatched', 'started')",
            [self._at(now), token, worker, run_id, token],
        ) == 1

    def finish(self, run_id: int, token: int, status: str, now: datetime, error: str) -> bool:
        return self._write(
            f"UPDATE {self.runs} SET status = %s, finished_at = %s, error = %s "
            f"WHERE id = %s AND fencing_token = %s",
            [status, self._at(now), error, run_id, token],
        ) == 1


class _Execution:
    """One delivery of one run."""

    def __init__(self, task: DriftSafeTask, headers: RunHeaders) -> None:
        self.task = task
        self.headers = headers
        self.run_id = headers.run_id
        self.settings = get_settings()
        self.ledger = _Ledger()

    def run(self, args: Any, kwargs: Any) -> Any:
        run = self.ledger.load(self.run_id)
        problem = self._mismatch(run)
        if problem:
            _log(logging.ERROR, "rejected %s[%s]: %s; not executed", self.task.name,
                 self.task.request.id, problem, run_id=self.run_id, action="reject")
            return None
        assert run is not None
        if run["status"] in _FINISHED:
            return self._duplicate(f"run is already {run['status']}")
        lock = lock_backend(self.settings).lock(
            f"run:{self.run_id}", ttl=self.settings.lease_seconds
        )
        try:
            acquired = lock.acquire(blocking=False)
        except LockError as exc:
            return self._lock_unavailable(exc, run, args, kwargs)
        if not acquired:
            # Someone holds the run: alive (then it finishes and the re-sent copy is dropped
            # as a duplicate) or dead (then its lease runs out and the copy takes over).
            return self.resend("another worker holds the run's lock",
                                self.settings.lease_seconds, args, kwargs)
        with lock.watch() as held:
            return self._run_fenced(held.fencing_token, run, args, kwargs)

    def _mismatch(self, run: dict[str, Any] | None) -> str:
        if run is None:
            return f"unknown run {self.run_id}"
        if run["task_name"] != self.task.name:
            return f"run {self.run_id} belongs to task {run['task_name']!r}"
        if run["celery_task_id"] and run["celery_task_id"] != self.task.request.id:
            return f"run {self.run_id} has Celery task id {run['celery_task_id']}"
        claimed_for = self.headers.periodic_task_id
        if claimed_for is not None and run["periodic_task_id"] != claimed_for:
            return f"run {self.run_id} is not a run of periodic task {claimed_for}"
        return ""

    def _duplicate(self, why: str) -> None:
        _runs().filter(pk=self.run_id).update(
            duplicate_deliveries=F("duplicate_deliveries") + 1
        )
        _log(logging.WARNING, "duplicate delivery of run %s (%s[%s]) skipped: %s", self.run_id,
             self.task.name, self.task.request.id, why, run_id=self.run_id, action="duplicate")
        return None

    def _now(self) -> datetime:
        return authority_clock().now()

    def _start(self, token: int) -> bool:
        worker = self.task.request.hostname or socket.gethostname()
        return self.ledger.start(self.run_id, token, self._now(), worker)

    def _finish(self, token: int, status: str, error: str = "") -> bool:
        """Record the outcome under ``token``; while the database is away, keep trying (with
        backoff, up to ``FINISH_RETRY_SECONDS``) rather than lose it or run the body again."""
        waited, delay = 0.0, 0.5
        while True:
            try:
                written = self.ledger.finish(self.run_id, token, status, self._now(), error)
                break
            except LedgerUnavailable as exc:
                if waited >= FINISH_RETRY_SECONDS:
                    _log(logging.ERROR, "run %s: outcome %s not recorded, the database stayed "
                         "unreachable for %.0f s: %s; the run stays 'started'", self.run_id,
                         status, waited, exc, run_id=self.run_id, action="outcome-lost")
                    return False
                authority_clock().sleep(delay)
                waited, delay = waited + delay, min(delay * 2, 5.0)
        if not written:
            _log(logging.ERROR, "run %s: outcome %s discarded, a newer holder (fencing token "
                 "above %s) took the run over while this worker was paused past its lease",
                 self.run_id, status, token, run_id=self.run_id, action="fenced-out")
        return bool(written)

    def _run_fenced(self, token: int, run: dict[str, Any], args: Any, kwargs: Any) -> Any:
        """Under the run lock's ``token``: take the overlap lock first if the task skips
        overlaps, then start, run the body and record the outcome under the same token."""
        if run["periodic_task_id"] is None or run["overlap_policy"] != "skip":
            return self._start_and_run(token, args, kwargs)
        task_lock = lock_backend(self.settings).lock(
            f"task-running:{run['periodic_task_id']}", ttl=self.settings.lease_seconds
        )
        if not task_lock.acquire(blocking=False):
            runnable = _runs().filter(
                pk=self.run_id, status__in=_RUNNABLE, fencing_token__lt=token
            )
            runnable.update(
                status="skipped", fencing_token=token, finished_at=self._now(),
                error="skipped: the previous run of this task is still running "
                      "(overlap policy 'skip')",
            )
            return None
        with task_lock.watch():
            return self._start_and_run(token, args, kwargs)

    def _start_and_run(self, token: int, args: Any, kwargs: Any) -> Any:
        if not self._start(token):
            return self._duplicate("it already started or finished under another holder")
        return self._body(token, args, kwargs)

    def _body(self, token: int, args: Any, kwargs: Any) -> Any:
        try:
            result = self.task.run(*args, **kwargs)
        except Exception:
            self._finish(token, "failed", traceback.format_exc(limit=20))
            raise
        self._finish(token, "succeeded")
        return result

    def _lock_unavailable(
        self, exc: LockError, run: dict[str, Any], args: Any, kwargs: Any
    ) -> Any:
        if self.settings.redis_unavailable == "fail_open":
            _log(logging.WARNING, "run %s: lock backend unreachable (%s); REDIS_UNAVAILABLE="
                 "fail_open, so only the database decides", self.run_id, exc,
                 run_id=self.run_id, action="fail-open")
            return self._run_database_only(args, kwargs)
        return self.resend(f"lock backend unreachable ({exc}); REDIS_UNAVAILABLE=fail_closed",
                            5.0, args, kwargs)

    def resend(self, why: str, countdown: float, args: Any, kwargs: Any) -> None:
        """Acknowledge this delivery and send the same message (same task id, same headers)
        again in ``countdown`` seconds."""
        request = self.task.request
        headers = {name: getattr(request, name, None) for name in RUN_HEADERS}
        options = {k: v for k, v in (request.delivery_info or {}).items()
                   if k in ("exchange", "routing_key") and v}
        Task.apply_async(self.task, args, kwargs, task_id=request.id,
                         countdown=countdown, headers=headers, **options)
        _log(logging.WARNING, "run %s (%s[%s]) re-sent for %.1f s later: %s", self.run_id,
             self.task.name, request.id, countdown, why, run_id=self.run_id, action="resend")
        return None

    def _run_database_only(self, args: Any, kwargs: Any) -> Any:
        """Fail-open: one conditional update decides who starts (claimed/dispatched only)."""
        started = _runs().filter(
            pk=self.run_id, status__in=("claimed", "dispatched")
        ).update(status="started", started_at=self._now(),
                 fencing_token=F("fencing_token") + 1)
        if not started:
            return self._duplicate("it already started (database check, fail-open)")
        token = _runs().values_list("fencing_token", flat=True).get(pk=self.run_id)
        return self._body(token, args, kwargs)


def _publish_idempotent(
    task: DriftSafeTask, key: str, args: Any, kwargs: Any, options: dict[str, Any]
) -> Any:
    if not isinstance(key, str) or not key or len(key) > 255:
        raise ValueError(f"idempotency_key must be a non-empty string of at most 255 "
                         f"characters, not {key!r}")
    task_id = str(uuid.uuid5(_ADHOC_NAMESPACE, f"{task.name}:{key}"))
    now = authority_clock().now()
    try:
        run, created = _runs().get_or_create(
            idempotency_key=key,
            defaults={"kind": "adhoc", "task_name": task.name, "status": "claimed",
                      "claimed_at": now, "claimed_by": f"producer:{socket.gethostname()}",
                      "celery_task_id": task_id},
        )
    except IntegrityError:  # lost a race on the key to another producer
        run, created = _runs().get(idempotency_key=key), False
    if run.task_name != task.name:
        raise ValueError(f"idempotency_key {key!r} was already used for task {run.task_name!r}")
    if created or run.status == "claimed":
        headers = dict(options.pop("headers", None) or {})
        headers.update({HEADER_RUN_ID: run.pk, HEADER_FENCING_TOKEN: 0})
        Task.apply_async(task, args, kwargs, task_id=task_id, headers=headers, **options)
        _runs().filter(pk=run.pk, status="claimed").update(
            status="dispatched", dispatched_at=authority_clock().now()
        )
    return task.AsyncResult(task_id)


__all__ = ["BadRunHeaders", "DriftSafeTask", "RunHeaders", "read_headers"]
