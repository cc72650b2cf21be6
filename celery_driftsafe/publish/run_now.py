"""Run now: a manual run of a periodic task, through the same ledger and outbox as a slot.

The path mirrors a beat's claim, so a manual run is deduplicated, visible and recoverable
exactly like a scheduled one:

0. the row passes the claim's own gate
   (:meth:`~celery_driftsafe.models.PeriodicTask.publish_problems`): what the claim would
   disable (a reserved header, ``args`` that are not a list, a bad option, a broken schedule)
   raises :class:`~celery_driftsafe.exceptions.TaskRefused` with the reasons, and nothing is
   written or published. ``args``/``kwargs``/``headers`` stored as a JSON string of the right
   shape are read as that value, as the claim reads them. Arguments the task's signature cannot
   take (Celery's own check at publish) are refused the same way;
1. read the time authority once: that instant is the run's *slot*;
2. commit ``Run(kind=manual, slot=now, status=claimed)`` with the deterministic Celery task id
   of ``(task, slot)``. The unique ``(task, slot)`` constraint refuses a second run at the same
   instant (a replayed request carrying the same clock reading is recorded and published once),
   and a re-publish by the outbox reuses the id. Two clicks are two readings, so two runs;
3. publish it with :class:`~celery_driftsafe.publish.dispatcher.Dispatcher` through the project's
Celery
   app, by name, which marks it ``dispatched``. If the broker is down the run stays
   ``claimed`` and a beat's outbox re-publishes it after the lease, under the same task id; if
   the broker refuses the message, the outbox tries again with backoff.

A manual run changes nothing about the schedule: ``next_slot_at``, ``last_slot_at`` and
``run_count`` stay as they are, and the overlap policy does not apply (an operator asked).

The Celery app comes from :func:`celery_driftsafe.celery_app.get_celery_app`; its task
modules are imported first, as a beat imports them
(:func:`~celery_driftsafe.celery_app.load_task_modules`), so that a manual run is published with
the task's own options, as the beat's runs are. A module that fails to import raises
:class:`~celery_driftsafe.exceptions.TaskModulesError` before anything is written.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import IntegrityError, connections, transaction

from celery_driftsafe.celery_app import argument_problem, load_task_modules
from celery_driftsafe.claim.outbox import claimed_run, operator_run
from celery_driftsafe.core.validation import Problem
from celery_driftsafe.exceptions import TaskRefused
from celery_driftsafe.models import PeriodicTask, Run, RunKind, RunStatus
from celery_driftsafe.publish.dispatcher import Dispatcher, DispatchResult
from celery_driftsafe.store.clock import Clock, authority_clock

logger = logging.getLogger("celery_driftsafe.run_now")


def admin_actor(username: str) -> str:
    """The ``claimed_by`` of a run an admin user started."""
    return f"admin:{username}" if username else "admin"


def _default_actor() -> str:
    return f"manual:{socket.gethostname()}:{os.getpid()}"


@dataclass(frozen=True)
class ManualRun:
    """What :func:`run_now` did.

    ``created`` is False when a run of that task at that instant already existed (a duplicate
    request): nothing was published again. ``status`` is the run's status afterwards;
    ``deferred`` means the publish waits for the caller's transaction to commit.
    """

    run_id: int | None
    task_name: str
    slot: datetime
    celery_task_id: str
    created: bool
    status: str
    deferred: bool = False
    error: str = ""


def run_now(
    task: PeriodicTask,
    *,
    app: Any | None = None,
    clock: Clock | None = None,
    actor: str = "",
    using: str = "default",
) -> ManualRun:
    """Start ``task`` now, through the ledger (see the module docstring).

    ``clock`` supplies the slot (default: :func:`~celery_driftsafe.store.clock.authority_clock`);
    ``actor`` is recorded as ``claimed_by``. Inside a caller's transaction the publish waits
    for its commit, so a worker never receives a run it cannot see yet. Raises
    :class:`~celery_driftsafe.exceptions.TaskRefused`, having written nothing, for a row the
    claim would refuse.
    """
    problems = task.publish_problems()
    if not problems:
        app = load_task_modules(app)
        unfit = argument_problem(app, task.task, task.args, task.kwargs)
        problems = [Problem("args", unfit)] if unfit else []
    if problems:
        refused = TaskRefused(task.name, problems)
        logger.warning(
            "run now refused: %s",
            refused,
            extra={"action": "run-now-refused", "task": task.name, "node": actor},
        )
        raise refused
    if clock is None:
        clock = authority_clock(using)
    slot = clock.now()
    actor = actor or _default_actor()
    run = operator_run(task, RunKind.MANUAL, slot, slot, actor)
    task_id = run.celery_task_id
    try:
        with transaction.atomic(using=using):
            run.save(using=using)
    except IntegrityError:
        existing = Run.objects.using(using).filter(periodic_task=task, slot=slot).first()
        logger.info(
            "run now of %s at %s already recorded; not published again",
            task.name,
            slot,
            extra={"action": "run-now-duplicate", "task": task.name, "slot": slot, "node": actor},
        )
        return ManualRun(
            run_id=existing.pk if existing else None,
            task_name=task.task,
            slot=slot,
            celery_task_id=task_id,
            created=False,
            status=existing.status if existing else RunStatus.CLAIMED,
        )
    claimed = claimed_run(run, task)
    dispatcher = Dispatcher(app, clock, using=using)
    logger.info(
        "run now of %s (slot %s) by %s",
        task.name,
        slot,
        actor,
        extra={"action": "run-now", "task": task.name, "slot": slot, "node": actor},
    )
    if connections[using].in_atomic_block:
        transaction.on_commit(lambda: dispatcher.dispatch([claimed]), using=using)
        return ManualRun(
            run_id=run.pk,
            task_name=task.task,
            slot=slot,
            celery_task_id=task_id,
            created=True,
            status=RunStatus.CLAIMED,
            deferred=True,
        )
    result = dispatcher.dispatch([claimed])
    return ManualRun(
        run_id=run.pk,
        task_name=task.task,
        slot=slot,
        celery_task_id=task_id,
        created=True,
        status=_status_after(result, run.pk),
        error=result.failed.get(run.pk, "") or result.refused.get(run.pk, ""),
    )


def _status_after(result: DispatchResult, run_id: int) -> str:
    if run_id in result.published:
        return RunStatus.DISPATCHED
    if run_id in result.failed:
        return RunStatus.FAILED
    if run_id in result.refused:
        return RunStatus.CLAIMED
    return RunStatus.CLAIMED
