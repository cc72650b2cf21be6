"""The outbox: what a claimed run is published with (its captured message and publish
options, its deterministic Celery task id, its headers) and the re-publishing of stale claims.
Publishing
runs and recording that they went out is :mod:`celery_driftsafe.publish.dispatcher`.

Order matters: a run is committed as ``claimed`` first, then published with its deterministic
Celery task id, then marked ``dispatched``. A crash between publish and mark leaves a
``claimed`` run that the outbox re-publishes under the same task id; ``DriftSafeTask`` makes
that second delivery harmless. A run is never marked dispatched unless its publish returned,
and it is published only by the node that still holds its claim.

A run that waits for its task's running run (overlap policies ``buffer_one``, ``buffer_all``)
comes back into the outbox when its turn comes (:func:`release_waiting`: the running run
ended, and it is its task's earliest waiting slot): taken from ``waiting`` to ``claimed``
by its publisher, then published and marked as any claimed run is, so a publisher that dies
in between leaves it to :func:`reclaim_stale`. Whoever takes it back holds the task's running
lock meanwhile, and hands that lock to it: no later slot can start in between.
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db.models import Exists, F, OuterRef, Q

from celery_driftsafe.core.headers import (
    HEADER_CELERY_BEAT,
    HEADER_FENCING_TOKEN,
    HEADER_LOCKS,
    HEADER_PERIODIC_TASK_ID,
    HEADER_RUN_ID,
    HEADER_SLOT,
)
from celery_driftsafe.core.instants import iso_text
from celery_driftsafe.core.stored_names import WAITING_POLICIES
from celery_driftsafe.core.validation import message_problems
from celery_driftsafe.ledger.run_ledger import UNLOCKED
from celery_driftsafe.locks import lock_identity
from celery_driftsafe.models import OverlapPolicy, PeriodicTask, Run, RunKind, RunStatus

logger = logging.getLogger("celery_driftsafe.dispatch")


_TASK_ID_NAMESPACE = uuid.UUID("6f1c2b0e-5d0a-4c55-9a43-3f2f0c1d7e11")


_NAMESPACE_BYTES = _TASK_ID_NAMESPACE.bytes
#: RFC 9562's version 8 ("custom") and variant bits, set on the 128 bits of an id.
_V8_CLEAR = ~((0xF000 << 64) | (0xC000 << 48))
_V8_SET = (0x8000 << 64) | (0x8000 << 48)
_UNIX_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MS = timedelta(milliseconds=1)
_MAX_MS = 2**48 - 1


def celery_task_id(periodic_task_id: int, slot: datetime) -> str:
    """The deterministic Celery task id of a slot: the same on every beat, every time.

    A version-8 UUID whose first 48 bits are the slot in milliseconds since 1970 and whose
    other 74 bits come from SHA-1 of a fixed namespace and ``f"{id}:{slot.isoformat()}"``.
    Ids of nearby slots sort together, so the indexes on the id (the run table's, a result
    backend's) grow at their end: random ids put each new run on a random page of an index
    that a big ledger makes far larger than the database's cache, and after every checkpoint
    PostgreSQL writes that page whole to its WAL (2.8 kB a run on average with 5 million
    runs kept).
    Computed once per run, at its claim; every later publish reads the stored id, so runs
    claimed under the earlier version-5 ids keep them."""
    name = f"{periodic_task_id}:{iso_text(slot)}".encode()
    digest = hashlib.sha1(_NAMESPACE_BYTES + name, usedforsecurity=False).digest()
    ms = min(max((slot - _UNIX_EPOCH) // _MS, 0), _MAX_MS)
    value = "%032x" % ((ms << 80 | int.from_bytes(digest[:10], "big")) & _V8_CLEAR | _V8_SET)
    return f"{value[:8]}-{value[8:12]}-{value[12:16]}-{value[16:20]}-{value[20:]}"


@dataclass(frozen=True)
class ClaimedRun:
    """A committed run that must now be published."""

    run_id: int
    periodic_task_id: int | None
    task_name: str
    slot: datetime | None
    celery_task_id: str
    fencing_token: int
    args: list[Any] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    #: The node (or actor) that holds the claim: publishing re-checks it still does.
    claimed_by: str = ""
    #: The message's expiry, an instant of the time authority.
    expires_at: datetime | None = None
    dispatch_attempts: int = 1
    #: Why the run exists (``RunKind``): a claim round makes scheduled ones.
    kind: str = RunKind.SCHEDULED


def run_message(task: PeriodicTask) -> dict[str, Any]:
    """What a run of ``task`` is published with, captured when it is claimed."""
    return {"args": list(task.args), "kwargs": dict(task.kwargs), "options": publish_options(task)}


def operator_run(
    task: PeriodicTask,
    kind: str,
    slot: datetime,
    now: datetime,
    actor: str,
    message: dict[str, Any] | None = None,
) -> Run:
    """An unsaved run of ``task`` at ``slot`` that an operator made (run now, a backfill),
    claimed by ``actor`` at ``now`` with ``message`` captured (default: the task's own) and
    its expiry counted from ``now``, not from a slot that may lie in the past."""
    return Run(
        periodic_task=task,
        task_name=task.task,
        kind=kind,
        slot=slot,
        status=RunStatus.CLAIMED,
        claimed_by=actor,
        claimed_at=now,
        celery_task_id=celery_task_id(task.pk, slot),
        dispatch_attempts=1,
        message=run_message(task) if message is None else message,
        expires_at=None
        if task.expires_seconds is None
        else now + timedelta(seconds=task.expires_seconds),
    )


def claimed_run(run: Run, task: PeriodicTask | None = None) -> ClaimedRun:
    """What publishing ``run`` needs: its identity and the message captured at claim time
    (for a row claimed before messages were captured: its task's current arguments and
    options, none when the task was deleted)."""
    message = run.message if isinstance(run.message, dict) and run.message else None
    if message is None:
        message = run_message(task) if task is not None else {}
    return ClaimedRun(
        run_id=run.pk,
        periodic_task_id=run.periodic_task_id,
        task_name=run.task_name,
        slot=run.slot,
        celery_task_id=run.celery_task_id,
        fencing_token=run.fencing_token,
        claimed_by=run.claimed_by,
        expires_at=run.expires_at,
        dispatch_attempts=run.dispatch_attempts,
        kind=run.kind,
        **message_parts(message),
    )


def message_parts(message: dict[str, Any]) -> dict[str, Any]:
    """A captured message's ``args``, ``kwargs`` and ``options`` (empty where absent). A
    stored value of another shape is kept as it is, for the publisher's gate
    (:func:`message_refusal`) to refuse with the reason."""
    return {
        "args": _as_stored(message.get("args"), list),
        "kwargs": _as_stored(message.get("kwargs"), dict),
        "options": _as_stored(message.get("options"), dict),
    }


def _as_stored(value: Any, kind: type) -> Any:
    """A copy of ``value`` when it is of ``kind``, an empty one when absent, else ``value``."""
    if value is None:
        return kind()
    return kind(value) if isinstance(value, kind) else value


def message_refusal(run: ClaimedRun) -> str:
    """Why ``run``'s captured message may not be published, "" when it may: the checks its
    task's row passed at the claim (:func:`~celery_driftsafe.core.validation.message_problems`),
    again, on what is about to go out."""
    problems = message_problems(run.args, run.kwargs, run.options)
    if not problems:
        return ""
    return "the message captured at claim time cannot be published: " + "; ".join(
        map(str, problems)
    )


def message_headers(run: ClaimedRun) -> dict[str, Any]:
    """The run's own headers (after the task's custom headers, which cannot override them)."""
    headers = dict(run.options.get("headers") or {})
    headers.update(
        {
            HEADER_RUN_ID: run.run_id,
            HEADER_SLOT: iso_text(run.slot) if run.slot else None,
            HEADER_FENCING_TOKEN: run.fencing_token,
            HEADER_PERIODIC_TASK_ID: run.periodic_task_id,
            HEADER_LOCKS: lock_identity(),
        }
    )
    if run.slot is not None:
        # a scheduled run: what Celery's own beat marks every message it sends with
        # (``Scheduler.apply_async``); a manual run is not the beat's
        headers[HEADER_CELERY_BEAT] = True
    return headers


def publish_options(task: PeriodicTask) -> dict[str, Any]:
    """The task's own Celery publish options (only those it sets)."""
    options: dict[str, Any] = {}
    for name in ("queue", "exchange", "routing_key"):
        value = getattr(task, name)
        if value:
            options[name] = value
    if task.priority is not None:
        options["priority"] = task.priority
    if task.headers:
        options["headers"] = dict(task.headers)
    return options


def reclaim_stale(
    now: datetime,
    node_id: str,
    *,
    lease: timedelta,
    limit: int = 500,
    using: str = "default",
    dead_after: timedelta | None = None,
) -> list[ClaimedRun]:
    """The outbox: ``claimed`` runs that were never marked dispatched are taken over by this
    node, one compare-and-swap each on ``claimed_at``, and returned for re-publishing under the
    same Celery task id, with the message captured when they were claimed. Eligible are runs

    * claimed longer than ``lease`` ago (their beat died between commit and publish, or the
      broker was unreachable) by this node, by something that is not a beat (a manual run),
      or by a beat with no heartbeat within ``dead_after`` (when given): a live beat's claims
      are its own to publish,
    * claimed by a node known to be stopped or dead (its publisher lost them), or
    * whose refused publish is due for another try (``retry_at`` reached).

    A run waiting for its ``retry_at`` is left alone until then. The previous publisher
    re-checks ownership before it publishes (:meth:`Dispatcher.dispatch`), so a paused beat
    that comes back does not publish a run taken over here.
    """
    from celery_driftsafe.models import BeatNode

    nodes = BeatNode.objects.using(using)
    gone = nodes.filter(stopped_at__isnull=False).values("node_id")
    expired_lease = Q(retry_at__isnull=True, claimed_at__lt=now - lease)
    if dead_after is not None:
        alive = nodes.filter(stopped_at__isnull=True, last_heartbeat_at__gte=now - dead_after)
        expired_lease &= ~Q(claimed_by__in=alive.exclude(node_id=node_id).values("node_id"))
    stale = list(
        Run.objects.using(using)
        .filter(
            expired_lease | Q(retry_at__isnull=True, claimed_by__in=gone) | Q(retry_at__lte=now),
            status=RunStatus.CLAIMED,
            kind__in=(RunKind.SCHEDULED, RunKind.MANUAL, RunKind.BACKFILL),
        )
        .exclude(expires_at__lte=now)
        .select_related("periodic_task")
        .order_by("claimed_at")[:limit]
    )
    taken: list[ClaimedRun] = []
    for run in stale:
        updated = (
            Run.objects.using(using)
            .filter(
                pk=run.pk,
                status=RunStatus.CLAIMED,
                claimed_at=run.claimed_at,
                claimed_by=run.claimed_by,
            )
            .update(
                claimed_at=now,
                claimed_by=node_id,
                retry_at=None,
                dispatch_attempts=F("dispatch_attempts") + 1,
            )
        )
        if not updated:
            continue
        logger.warning(
            "re-publishing run %s of %s (slot %s): claimed by %s but never dispatched",
            run.pk,
            run.task_name,
            run.slot,
            run.claimed_by,
            extra={"action": "reclaim", "task": run.task_name, "slot": run.slot, "node": node_id},
        )
        run.claimed_at, run.claimed_by = now, node_id
        run.dispatch_attempts += 1
        taken.append(claimed_run(run, run.periodic_task))
    return taken


#: A later slot of a ``buffer_one`` task dropped when its waiting run is released.
DROPPED_WHY = (
    "skipped: it came while the task's previous run was running and another run of it was "
    "already waiting for it; the waiting run goes first (overlap policy 'buffer_one')"
)


def released_why(policy: str | None) -> str:
    """What a waiting run taken back into the outbox says: its turn came (its task's policy
    ``policy`` still waits), or the task no longer waits (its policy changed, or it was
    deleted) and the run meets the task's policy as any delivery does."""
    if policy == OverlapPolicy.REPLACE:
        return "released: the run it replaced is gone (overlap policy 'replace')"
    if policy in WAITING_POLICIES:
        return f"released: the task's running run ended (overlap policy '{policy}')"
    if policy is None:
        return "released: its periodic task was deleted; nothing waits for it any more"
    return f"released: the task's overlap policy is now '{policy}', under which no run waits"


#: Takes a waiting run's task's running lock for :func:`release_waiting`: None when it is held
#: (or cannot be told); else a function told, once the release was tried, whether the run was
#: taken back (then the lock is handed to it, so that it runs next) or not (then it is freed).
TakeRunningLock = Callable[[Run], Callable[[bool], None] | None]


def release_waiting(
    now: datetime,
    actor: str,
    *,
    periodic_task_id: int | None = None,
    take_lock: TakeRunningLock | None = None,
    limit: int = 100,
    using: str = "default",
) -> list[ClaimedRun]:
    """Overlap policies ``buffer_one``, ``buffer_all`` and ``replace``: waiting runs whose turn
    came go back into the outbox (under ``replace``, once the body it replaced is gone). Each is
    moved from ``waiting`` to ``claimed`` by ``actor`` at ``now`` (one conditional update on the
    row as read: of two releasers one wins) and returned for publishing under its Celery task
    id, with its captured message and the token it waited under (the next delivery's lock takes
    one above it). A task's turn is its earliest waiting slot's (slot order): the others keep
    waiting.

    With ``periodic_task_id``: that task's earliest waiting run (the caller holds the task's
    running lock: its run of the task just ended, or it found the lock free; it hands the
    lock to the run it gets). Without: each task's earliest, where no run of the task is
    ``started`` under a lasting lease (or without a lock) and ``take_lock(run)`` took the
    task's running lock (a beat's recovery, after the worker of the running run died or could
    not publish); and every waiting run of a task whose policy no longer waits (changed to
    ``allow`` or ``skip`` meanwhile) or that was deleted, at once, without a lock: each meets
    the task's policy when delivered (it runs, or is skipped). A run whose publisher dies
    before it is marked dispatched is re-published by :func:`reclaim_stale` after the
    lease."""
    runs = Run.objects.using(using)
    waiting = runs.filter(status=RunStatus.WAITING)
    if periodic_task_id is not None:
        waiting, limit = waiting.filter(periodic_task_id=periodic_task_id), 1
    else:
        running = runs.filter(
            Q(lease_until__gt=now) | Q(lease_until__isnull=True, worker__endswith=UNLOCKED),
            periodic_task=OuterRef("periodic_task"),
            status=RunStatus.STARTED,
        )
        waiting = waiting.exclude(
            Q(periodic_task__overlap_policy__in=WAITING_POLICIES) & Exists(running)
        )
    taken: list[ClaimedRun] = []
    turns_tried: set[int | None] = set()
    for run in waiting.select_related("periodic_task").order_by("slot", "pk")[:limit]:
        policy = run.periodic_task.overlap_policy if run.periodic_task is not None else None
        queued = policy in WAITING_POLICIES and periodic_task_id is None
        if queued:
            if run.periodic_task_id in turns_tried:
                continue  # its task's turn was its earliest waiting run's
            turns_tried.add(run.periodic_task_id)
        why = released_why(policy)
        settle = take_lock(run) if take_lock is not None and queued else None
        if queued and take_lock is not None and settle is None:
            continue
        updated = 0
        try:
            updated = runs.filter(
                pk=run.pk, status=RunStatus.WAITING, fencing_token=run.fencing_token
            ).update(
                status=RunStatus.CLAIMED,
                claimed_by=actor,
                claimed_at=now,
                dispatched_at=None,
                retry_at=None,
                dispatch_attempts=F("dispatch_attempts") + 1,
                error=why,
            )
        finally:
            if settle is not None:
                settle(bool(updated))
        if not updated:
            continue  # another releaser took it, or a delivery started it meanwhile
        dropped = 0
        if policy == OverlapPolicy.BUFFER_ONE:
            # The task's later slots not started yet came while the run ran and this one
            # waited (a worker busy or dead left their messages queued): under buffer_one they
            # are dropped, and this one, published behind them, runs next rather than be
            # skipped. Under buffer_all they wait behind it when delivered (the lock is
            # handed to it); under replace the first of them to come replaces it.
            dropped = runs.filter(
                periodic_task_id=run.periodic_task_id,
                kind=RunKind.SCHEDULED,
                slot__gt=run.slot,
                status__in=(RunStatus.CLAIMED, RunStatus.DISPATCHED),
            ).update(status=RunStatus.SKIPPED, error=DROPPED_WHY, finished_at=now)
        logger.info(
            "publishing waiting run %s of %s (slot %s): %s%s",
            run.pk,
            run.task_name,
            run.slot,
            why.removeprefix("released: "),
            f"; {dropped} later slots not started are skipped" if dropped else "",
            extra={"action": "release-waiting", "task": run.task_name, "slot": run.slot},
        )
        run.claimed_at, run.claimed_by = now, actor
        run.dispatch_attempts += 1
        taken.append(claimed_run(run, run.periodic_task))
    return taken
