"""Backfill: run the past slots of a task's schedule in a range, each at most once.

The slots of ``[start, end)`` are the claim's own (:func:`slots_between` steps
:func:`~celery_driftsafe.core.preview.upcoming_slots`, the claim's plan, with the task's bounds
and jitter; the run limits ``run_once``/``max_runs`` do not apply: an operator asked for these
slots). A slot that already has a run (of any kind, in any status) is skipped and listed as
such. The rest go through the path of :mod:`~celery_driftsafe.publish.run_now`, in chunks:

1. the chunk's runs are inserted as ``Run(kind=backfill, status=claimed)`` with the
   deterministic Celery task id of ``(task, slot)``, each insert giving way to a run of the
   same slot (``ON CONFLICT DO NOTHING`` on PostgreSQL, a savepoint per row elsewhere), so the
   unique ``(task, slot)`` constraint decides a race with a beat's claim or another backfill;
   the runs this backfill inserted are those then found claimed by its own actor (an id of its
   own per backfill): only they are counted and published;
2. they are published with :class:`~celery_driftsafe.publish.dispatcher.Dispatcher`, which
   marks them ``dispatched``. A run whose publish fails stays ``claimed`` and a beat's outbox
   re-publishes it after the lease, under the same task id, as for run now;
3. with a ``rate``, the next chunk waits until the runs published so far are no more than the
   rate allows (on the injected clock's ``monotonic``/``sleep``).

Started inside a transaction (a view under ``ATOMIC_REQUESTS``), a backfill publishes its
runs when that transaction commits, as run now does (unpaced, then).

So an interrupted backfill leaves at most one chunk claimed and unpublished, which the beats'
outbox publishes; the slots it did not reach have no run, and running the backfill again
picks them up (the slots done are skipped).

A backfilled run's message expires ``expires_seconds`` (the task's own) after it was claimed,
as a manual run's does: a past slot is not expired on arrival. The schedule
(``next_slot_at``, ``last_slot_at``, ``run_count``) is left as it is.

At most ``BACKFILL_MAX_SLOTS`` slots per backfill: a longer range raises
:class:`~celery_driftsafe.exceptions.BackfillRefused` before anything is written.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from functools import partial
from typing import Any
from zoneinfo import ZoneInfo

from django.db import IntegrityError, connections, transaction

from celery_driftsafe.celery_app import load_task_modules
from celery_driftsafe.claim.outbox import claimed_run, operator_run, run_message
from celery_driftsafe.conf import get_settings
from celery_driftsafe.core.preview import upcoming_slots
from celery_driftsafe.exceptions import BackfillRefused, TaskRefused
from celery_driftsafe.models import PeriodicTask, Run, RunKind
from celery_driftsafe.publish.dispatcher import Dispatcher
from celery_driftsafe.store.clock import Clock, authority_clock

logger = logging.getLogger("celery_driftsafe.backfill")


@dataclass(frozen=True)
class TakenSlot:
    """A slot of the range that already has a run: the backfill skips it."""

    slot: datetime
    run_id: int
    kind: str
    status: str


@dataclass(frozen=True)
class BackfillPlan:
    """What a backfill of ``task`` over ``[start, end)`` runs, and what it skips."""

    task: PeriodicTask
    start: datetime
    end: datetime
    #: Slots without a run, in order: the backfill runs these.
    to_run: list[datetime] = field(default_factory=list)
    #: Slots that have a run already.
    taken: list[TakenSlot] = field(default_factory=list)


@dataclass
class BackfillResult:
    """What a backfill did. ``inserted`` counts only the runs this backfill wrote; slots a
    beat or another backfill took meanwhile are ``lost``."""

    plan: BackfillPlan
    actor: str = ""
    inserted: int = 0
    published: int = 0
    #: Runs to be published when the caller's transaction commits (a backfill started inside
    #: one); ``rate`` does not pace those.
    deferred: int = 0
    lost: int = 0
    #: Runs not published, with the reason: left ``claimed`` for a beat's outbox (the broker
    #: out of reach or refusing), or ``failed`` (a message that cannot be built).
    unpublished: dict[int, str] = field(default_factory=dict)


def slots_between(task: PeriodicTask, start: datetime, end: datetime, limit: int) -> list[datetime]:
    """The slots of ``task`` in ``[start, end)`` as the claim fires them (bounds and jitter
    applied, run limits not), at most ``limit + 1`` of them (so a caller sees the range hold more
    than ``limit``). Raises what evaluating the schedule raises."""
    schedule = task.schedule
    first = schedule.first_at_or_after(start)
    if first is None or first >= end:
        return []
    limits = replace(task.limits, run_once=False, max_runs=None, run_count=0)
    preview = upcoming_slots(schedule, first, limits, zone=task.timezone, count=limit + 1)
    return [row.slot for row in preview.rows if row.slot < end]


def plan_backfill(
    task: PeriodicTask, start: datetime, end: datetime, *, using: str = "default"
) -> BackfillPlan:
    """The slots a backfill of ``task`` over ``[start, end)`` runs and skips; writes nothing.

    Raises :class:`~celery_driftsafe.exceptions.BackfillRefused` for ``start >= end`` or a range
    of more than ``BACKFILL_MAX_SLOTS`` slots, :class:`~celery_driftsafe.exceptions.TaskRefused`
    for a row the claim would refuse."""
    if start >= end:
        raise BackfillRefused(
            f"backfill of {task.name}: the range is empty: from {start.isoformat()} is not "
            f"before to {end.isoformat()}"
        )
    problems = task.publish_problems()
    if problems:
        raise TaskRefused(task.name, problems)
    cap = get_settings().backfill_max_slots
    slots = slots_between(task, start, end, cap)
    if len(slots) > cap:
        raise BackfillRefused(
            f"backfill of {task.name}: from {start.isoformat()} to {end.isoformat()} holds more "
            f"than BACKFILL_MAX_SLOTS = {cap} slots: backfill a shorter range at a time, or raise "
            "BACKFILL_MAX_SLOTS"
        )
    taken = _taken(task, slots, using)
    return BackfillPlan(
        task,
        start,
        end,
        to_run=[slot for slot in slots if slot not in taken],
        taken=[taken[slot] for slot in slots if slot in taken],
    )


def _taken(task: PeriodicTask, slots: list[datetime], using: str) -> dict[datetime, TakenSlot]:
    if not slots:
        return {}
    rows = (
        Run.objects.using(using)
        .filter(periodic_task=task, slot__gte=slots[0], slot__lte=slots[-1])
        .values_list("slot", "pk", "kind", "status")
    )
    wanted = set(slots)
    return {
        slot: TakenSlot(slot, pk, kind, status) for slot, pk, kind, status in rows if slot in wanted
    }


def parse_instant(text: str, zone: str) -> datetime:
    """An ISO 8601 instant as aware UTC; one without an offset is read in ``zone`` (the task's
    time zone, an IANA name). Raises ``ValueError`` naming what it accepts."""
    try:
        value = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(
            f"{text!r} is not an ISO 8601 instant, such as 2026-03-01T00:00:00+01:00 "
            "(without an offset: in the task's time zone)"
        ) from None
    if value.tzinfo is None:
        value = value.replace(tzinfo=ZoneInfo(zone))
    return value.astimezone(UTC)


def backfill_actor(who: str = "") -> str:
    """The ``claimed_by`` of one backfill's runs: who started it and an id of its own, by which
    it tells the runs it inserted from those a racer inserted."""
    who = who or f"{socket.gethostname()}:{os.getpid()}"
    return f"backfill:{who}:{uuid.uuid4().hex[:8]}"


def run_backfill(
    plan: BackfillPlan,
    *,
    app: Any | None = None,
    clock: Clock | None = None,
    rate: float | None = None,
    actor: str = "",
    using: str = "default",
    progress: Callable[[BackfillResult], None] | None = None,
) -> BackfillResult:
    """Insert and publish the runs of ``plan`` (see the module docstring), ``rate`` runs per
    second at most (None: as fast as the broker takes them). ``actor`` is recorded in
    ``claimed_by`` (default :func:`backfill_actor`); ``progress`` is called after each chunk."""
    task = plan.task
    app = load_task_modules(app)
    if clock is None:
        clock = authority_clock(using)
    result = BackfillResult(plan, actor=actor or backfill_actor())
    chunk_size = get_settings().publish_batch_size
    if rate is not None:
        chunk_size = max(1, min(chunk_size, int(rate)))
    dispatcher = Dispatcher(app, clock, using=using)
    message = run_message(task)
    started = clock.monotonic()
    logger.info(
        "backfill of %s: %d slots from %s to %s (%d skipped: they have a run)",
        task.name,
        len(plan.to_run),
        plan.start,
        plan.end,
        len(plan.taken),
        extra={"action": "backfill", "task": task.name, "node": result.actor},
    )
    for first in range(0, len(plan.to_run), chunk_size):
        if rate is not None and result.published:
            wait = started + result.published / rate - clock.monotonic()
            if wait > 0:
                clock.sleep(wait)
        chunk = plan.to_run[first : first + chunk_size]
        mine = _insert(task, chunk, message, clock.now(), result.actor, using)
        result.inserted += len(mine)
        result.lost += len(chunk) - len(mine)
        if mine and connections[using].in_atomic_block:
            # Inside the caller's transaction (ATOMIC_REQUESTS, say): published when it
            # commits, as run now does, so a worker never receives a run it cannot see yet.
            claimed = [claimed_run(run, task) for run in mine]
            transaction.on_commit(partial(dispatcher.dispatch, claimed), using=using)
            result.deferred += len(mine)
        elif mine:
            dispatched = dispatcher.dispatch([claimed_run(run, task) for run in mine])
            result.published += len(dispatched.published)
            result.unpublished.update(dispatched.failed)
            result.unpublished.update(dispatched.refused)
            for pk in dispatched.deferred:
                result.unpublished[pk] = "the broker is out of reach: a beat's outbox publishes it"
        if progress is not None:
            progress(result)
    logger.info(
        "backfill of %s done: %d runs inserted, %d published, %d taken meanwhile",
        task.name,
        result.inserted,
        result.published,
        result.lost,
        extra={"action": "backfill-done", "task": task.name, "node": result.actor},
    )
    return result


def _insert(
    task: PeriodicTask,
    slots: list[datetime],
    message: dict[str, Any],
    now: datetime,
    actor: str,
    using: str,
) -> list[Run]:
    """Insert a run per slot, giving way where the slot has a run; the runs this call inserted.

    PostgreSQL skips a taken slot itself (``ON CONFLICT DO NOTHING``). Elsewhere each row is
    inserted in a savepoint: SQLite's ``OR IGNORE`` and MySQL's ``INSERT IGNORE`` would also
    drop a row refused for another reason, and a refused row whose slot has no run is an error
    here, not a lost race. One transaction per chunk, holding the task's row: a beat's claim
    of the task (which locks that row first) waits for the chunk, or skips the task meanwhile,
    and takes the slots left."""
    runs = [operator_run(task, RunKind.BACKFILL, slot, now, actor, message) for slot in slots]
    with transaction.atomic(using=using):
        # The task's row first, as a beat's claim takes it before it inserts runs: racers
        # that lock in the same order wait for each other rather than deadlock.
        locked = PeriodicTask.objects.using(using).select_for_update().filter(pk=task.pk)
        list(locked.values_list("pk", flat=True))
        if connections[using].vendor == "postgresql":
            Run.objects.using(using).bulk_create(runs, ignore_conflicts=True)
        else:
            for run in runs:
                try:
                    with transaction.atomic(using=using):
                        run.save(using=using)
                except IntegrityError:
                    taken = Run.objects.using(using).filter(periodic_task=task, slot=run.slot)
                    if not taken.exists():
                        raise
    return list(
        Run.objects.using(using)
        .filter(periodic_task=task, slot__in=slots, claimed_by=actor, kind=RunKind.BACKFILL)
        .order_by("slot")
    )
