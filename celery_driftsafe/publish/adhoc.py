"""How a DriftSafeTask is published from application code: on commit when called inside a
transaction, and with an idempotency key recorded in the run ledger first.

Inside ``transaction.atomic()`` (or a view under ``ATOMIC_REQUESTS``) a publish waits for the
commit, so a worker never looks for a ledger row (or any row the caller wrote) that is not
committed yet; after a rollback nothing is published and an idempotency key is not used up.
Under ``task_always_eager`` the call runs at once (there is no worker to race, and a user's
test usually runs inside a transaction that never commits).
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from celery import Task

from celery_driftsafe.core.headers import HEADER_FENCING_TOKEN, HEADER_LOCKS, HEADER_RUN_ID
from celery_driftsafe.core.stored_names import RunKind, RunStatus
from celery_driftsafe.locks import lock_identity

_ADHOC_NAMESPACE = uuid.UUID("0b8c7f4e-2a55-4d1e-9d8e-7a61c3f0b2a4")


#: The class attribute, true on a task class whose ``apply_async`` publishes on commit
#: (:class:`~celery_driftsafe.task.DriftSafeTask`'s): a beat, which publishes a claimed run now,
#: calls Celery's own ``Task.apply_async`` for it. The publishing layer reads this rather than
#: import the task class above it.
PUBLISHES_ON_COMMIT = "driftsafe_publishes_on_commit"


def publishes_on_commit(task: Any) -> bool:
    """Whether ``task``'s own ``apply_async`` waits for a transaction's commit."""
    return getattr(task, PUBLISHES_ON_COMMIT, False) is True


def send_on_commit(task: Task, send: Callable[[str], Any], task_id: str | None) -> Any:
    """``send(task_id)`` now, or when the default database's current transaction commits
    (returning the ``AsyncResult`` the send will have)."""
    from django.db import connection, transaction

    if task.app.conf.task_always_eager or not connection.in_atomic_block:
        return send(task_id or str(uuid.uuid4()))
    task_id = task_id or str(uuid.uuid4())
    transaction.on_commit(lambda: send(task_id))
    return task.AsyncResult(task_id)


def _expires_at(task: Task, expires: Any, now: datetime) -> datetime | None:
    """An explicit ``expires`` (seconds from now, or an instant) on the authority's clock."""
    if expires is None:
        return None
    if isinstance(expires, datetime):
        from celery.utils.time import maybe_make_aware

        aware: datetime = maybe_make_aware(expires, task.app.timezone)
        return aware
    if isinstance(expires, bool) or not isinstance(expires, int | float):
        raise ValueError(f"expires must be seconds or a datetime, not {expires!r}")
    return now + timedelta(seconds=float(expires))


def publish_idempotent(
    task: Task,
    key: str,
    args: Any,
    kwargs: Any,
    task_id: str | None,
    options: dict[str, Any],
) -> Any:
    """Record the call under ``key`` (once across producers), then publish it (on commit).

    The message carries no ``expires``: the worker judges the run's ``expires_at`` on the time
    authority's clock instead of its own.
    """
    from django.db import IntegrityError, transaction

    from celery_driftsafe.models import Run
    from celery_driftsafe.store.clock import authority_clock

    if not isinstance(key, str) or not key or len(key) > 255:
        raise ValueError(
            f"idempotency_key must be a non-empty string of at most 255 characters, not {key!r}"
        )
    task_id = task_id or str(uuid.uuid5(_ADHOC_NAMESPACE, f"{task.name}:{key}"))
    now = authority_clock().now()
    expires_at = _expires_at(task, options.pop("expires", None), now)
    try:
        with transaction.atomic():
            run, created = Run.objects.get_or_create(
                idempotency_key=key,
                defaults={
                    "kind": RunKind.ADHOC,
                    "task_name": task.name,
                    "status": RunStatus.CLAIMED,
                    "claimed_at": now,
                    "claimed_by": f"producer:{socket.gethostname()}",
                    "celery_task_id": task_id,
                    "expires_at": expires_at,
                },
            )
    except IntegrityError:  # lost a race on the key to another producer
        run, created = Run.objects.get(idempotency_key=key), False
    if run.task_name != task.name:
        raise ValueError(f"idempotency_key {key!r} was already used for task {run.task_name!r}")
    if not (created or run.status == RunStatus.CLAIMED):
        return task.AsyncResult(run.celery_task_id)
    headers = dict(options.pop("headers", None) or {})
    headers.update({HEADER_RUN_ID: run.pk, HEADER_FENCING_TOKEN: 0, HEADER_LOCKS: lock_identity()})

    def send(run_task_id: str) -> Any:
        result = Task.apply_async(
            task, args, kwargs, task_id=run_task_id, headers=headers, **options
        )
        Run.objects.filter(pk=run.pk, status=RunStatus.CLAIMED).update(
            status=RunStatus.DISPATCHED, dispatched_at=authority_clock().now()
        )
        return result

    return send_on_commit(task, send, run.celery_task_id)
