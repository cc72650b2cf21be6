"""Claiming: the one short transaction that turns due slots into run rows, exactly once.

Two implementations of :class:`Claimer`, one contract:

* :class:`SkipLockedClaimer` (PostgreSQL, MySQL 8, MariaDB 10.6+): ``SELECT … FOR UPDATE SKIP
  LOCKED`` takes the due tasks; rows another beat holds are passed over, not waited for.
* :class:`CompareAndSwapClaimer` (SQLite, or anywhere): read the due tasks without locks, then one
  ``UPDATE … WHERE (id, next_slot_at) = (seen values) … RETURNING id`` advances exactly the tasks
  nobody advanced meanwhile.

Either way a round is a constant number of statements whatever the number of due tasks, and
the unique ``(periodic_task, slot)`` constraint is the last guard.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Protocol

from django.db import OperationalError, connections, transaction
from django.db.models import F, Q

from celery_driftsafe.conf import DriftSafeSettings, get_settings
from celery_driftsafe.exceptions import ScheduleError
from celery_driftsafe.misfire import ClaimPlan, plan_claim
from celery_driftsafe.models import PeriodicTask, Run, RunKind, RunStatus

logger = logging.getLogger(__name__)

_TASK_ID_NAMESPACE = uuid.UUID("6f1c2b0e-5d0a-4c55-9a43-3f2f0c1d7e11")


def celery_task_id(periodic_task_id: int, slot: datetime) -> str:
    """The deterministic Celery task id of a slot: the same on every beat, every time."""
    return str(uuid.uuid5(_TASK_ID_NAMESPACE, f"{periodic_task_id}:{slot.isoformat()}"))


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


@dataclass
class ClaimResult:
    """What a claim round did: runs to publish, rows recorded missed, tasks disabled."""

    runs: list[ClaimedRun] = field(default_factory=list)
    missed: int = 0
    disabled: list[str] = field(default_factory=list)
    tasks_seen: int = 0


class Claimer(Protocol):
    """Claims due slots.

    ``claim(now, node_id)`` takes at most ``batch_size`` enabled tasks whose ``next_slot_at``
    is at or before ``now`` (an authority reading taken just before the call), oldest slot
    first. For each task it applies the misfire policy, inserts one run row per slot that
    fires (status ``claimed``) or is missed (status ``missed``), and moves ``next_slot_at`` to
    the first slot after ``now`` — all in one transaction per round. A task whose row another
    beat holds or has already advanced is silently left out: losing a race is normal. A task
    whose stored schedule cannot be evaluated is disabled with the reason recorded. Returns the
    claimed runs in slot order.
    """

    def claim(self, now: datetime, node_id: str) -> ClaimResult: ...


class _BaseClaimer:
    def __init__(
        self, *, using: str = "default", settings: DriftSafeSettings | None = None,
        batch_size: int | None = None,
    ) -> None:
        self.using = using
        self.settings = settings or get_settings()
        self.batch_size = batch_size or self.settings.claim_batch_size

    def _due(self, now: datetime) -> Any:
        return (
            PeriodicTask.objects.using(self.using)
            .filter(enabled=True, next_slot_at__lte=now)
            .order_by("next_slot_at", "id")
        )

    def _plan(self, task: PeriodicTask, now: datetime) -> ClaimPlan:
        assert task.next_slot_at is not None
        grace = task.misfire_grace_seconds
        if grace is None:
            grace = self.settings.misfire_grace_seconds
        return plan_claim(
            task.schedule,
            task.next_slot_at,
            now,
            policy=task.misfire_policy or self.settings.misfire_policy,
            grace=timedelta(seconds=grace),
            fire_all_max=self.settings.fire_all_max,
        )

    def _plans(
        self, tasks: Sequence[PeriodicTask], now: datetime, result: ClaimResult
    ) -> list[tuple[PeriodicTask, ClaimPlan]]:
        """Plan each task; a task whose schedule is broken is disabled, not claimed."""
        planned = []
        for task in tasks:
            try:
                planned.append((task, self._plan(task, now)))
            except (ScheduleError, ValueError) as exc:
                reason = f"disabled by the scheduler: stored schedule is invalid: {exc}"
                logger.error(
                    "task %s has an invalid schedule and was disabled: %s", task.name, exc,
                    extra={"action": "disable", "task": task.name},
                )
                task.enabled = False
                task.disabled_reason = reason
                task.next_slot_at = None
                result.disabled.append(task.name)
        return planned

    def _write_runs(
        self, planned: Iterable[tuple[PeriodicTask, ClaimPlan]], now: datetime, node_id: str,
        result: ClaimResult,
    ) -> None:
        rows: list[Run] = []
        fired: list[tuple[PeriodicTask, Run]] = []
        for task, plan in planned:
            for slot in plan.missed:
                rows.append(self._missed_row(task, slot, now, node_id, plan))
            if plan.unrecorded_missed:
                first, count = plan.unrecorded_missed
                rows.append(self._missed_row(task, first, now, node_id, plan, count))
            for slot in plan.fire:
                run = Run(
                    periodic_task=task, task_name=task.task, kind=RunKind.SCHEDULED, slot=slot,
                    status=RunStatus.CLAIMED, claimed_by=node_id, claimed_at=now,
                    celery_task_id=celery_task_id(task.pk, slot), dispatch_attempts=1,
                )
                rows.append(run)
                fired.append((task, run))
            result.missed += len(plan.missed) + (1 if plan.unrecorded_missed else 0)
        if not rows:
            return
        if connections[self.using].vendor == "postgresql":
            _insert_runs_postgresql(connections[self.using], rows)
        else:
            Run.objects.using(self.using).bulk_create(rows)
            if fired and not connections[self.using].features.can_return_rows_from_bulk_insert:
                self._fetch_ids(fired)
        result.runs.extend(claimed_run(run, task) for task, run in fired)
        result.runs.sort(key=lambda r: (r.slot, r.run_id))

    def _fetch_ids(self, fired: list[tuple[PeriodicTask, Run]]) -> None:
        """Backends without INSERT … RETURNING: look the new ids up in one query."""
        keys = {(task.pk, run.slot): run for task, run in fired}
        for pk, task_id, slot in Run.objects.using(self.using).filter(
            periodic_task_id__in={t.pk for t, _ in fired}, slot__in={r.slot for _, r in fired}
        ).values_list("pk", "periodic_task_id", "slot"):
            run = keys.get((task_id, slot))
            if run is not None:
                run.pk = pk

    @staticmethod
    def _missed_row(
        task: PeriodicTask, slot: datetime, now: datetime, node_id: str, plan: ClaimPlan,
        count: int = 1,
    ) -> Run:
        late = (now - slot).total_seconds()
        if count > 1:
            error = (f"{count} slots from {slot.isoformat()} on were missed (downtime or "
                     "disabled); they are summarised in this one row")
        else:
            error = f"missed: claimed {late:.1f} s after its slot, past the misfire grace"
        return Run(
            periodic_task=task, task_name=task.task, kind=RunKind.SCHEDULED, slot=slot,
            status=RunStatus.MISSED, claimed_by=node_id, claimed_at=now, error=error,
        )

    @staticmethod
    def _advance(task: PeriodicTask, plan: ClaimPlan) -> None:
        task.next_slot_at = plan.next_slot
        if plan.fire:
            task.last_slot_at = plan.fire[-1]
            task.run_count = (task.run_count or 0) + len(plan.fire)


def claimed_run(run: Run, task: PeriodicTask | None) -> ClaimedRun:
    """What publishing ``run`` needs: the run's identity, its task's arguments and options
    (none when the periodic task was deleted meanwhile)."""
    return ClaimedRun(
        run_id=run.pk,
        periodic_task_id=run.periodic_task_id,
        task_name=run.task_name,
        slot=run.slot,
        celery_task_id=run.celery_task_id,
        fencing_token=run.fencing_token,
        args=list(task.args or []) if task else [],
        kwargs=dict(task.kwargs or {}) if task else {},
        options=publish_options(task) if task else {},
    )


def publish_options(task: PeriodicTask) -> dict[str, Any]:
    """The task's own Celery publish options (only those it sets)."""
    options: dict[str, Any] = {}
    for name in ("queue", "exchange", "routing_key"):
        value = getattr(task, name)
        if value:
            options[name] = value
    if task.priority is not None:
        options["priority"] = task.priority
    if task.expires_seconds is not None:
        options["expires_seconds"] = task.expires_seconds
    if task.headers:
        options["headers"] = dict(task.headers)
    return options


class SkipLockedClaimer(_BaseClaimer):
    """``SELECT … FOR UPDATE SKIP LOCKED``: PostgreSQL, MySQL 8+, MariaDB 10.6+."""

    def claim(self, now: datetime, node_id: str) -> ClaimResult:
        result = ClaimResult()
        with transaction.atomic(using=self.using):
            tasks = list(
                self._due(now).select_for_update(skip_locked=True)[
                    : self.batch_size
                ]
            )
            result.tasks_seen = len(tasks)
            if not tasks:
                return result
            planned = self._plans(tasks, now, result)
            for task, plan in planned:
                self._advance(task, plan)
            self._write_runs(planned, now, node_id, result)
            advance_tasks(self.using, tasks)
        return result


class CompareAndSwapClaimer(_BaseClaimer):
    """Lock-free claim: the ``UPDATE`` only advances tasks still at the ``next_slot_at`` this
    beat read, and ``RETURNING`` says which. Needs ``UPDATE … RETURNING`` (SQLite 3.35+,
    PostgreSQL)."""

    def claim(self, now: datetime, node_id: str) -> ClaimResult:
        result = ClaimResult()
        tasks = list(self._due(now)[: self.batch_size])
        result.tasks_seen = len(tasks)
        if not tasks:
            return result
        seen = {task.pk: task.next_slot_at for task in tasks}
        planned = self._plans(tasks, now, result)
        disabled = [t for t in tasks if not t.enabled]
        for task, plan in planned:
            self._advance(task, plan)
        try:
            with transaction.atomic(using=self.using):
                won = advance_tasks(self.using, [t for t, _ in planned] + disabled, seen)
                planned = [(t, p) for t, p in planned if t.pk in won]
                result.disabled = [t.name for t in disabled if t.pk in won]
                self._write_runs(planned, now, node_id, result)
        except OperationalError as exc:
            if "locked" not in str(exc):
                raise
            # SQLite refused the write lock (another beat is writing): this round lost.
            logger.debug("claim round lost to a concurrent writer: %s", exc)
            return ClaimResult(tasks_seen=result.tasks_seen)
        return result


_RUN_COLUMNS = (
    ("periodic_task_id", "bigint"), ("task_name", "text"), ("kind", "text"),
    ("slot", "timestamptz"), ("status", "text"), ("claimed_by", "text"),
    ("claimed_at", "timestamptz"), ("celery_task_id", "text"), ("fencing_token", "bigint"),
    ("dispatch_attempts", "integer"), ("duplicate_deliveries", "integer"), ("worker", "text"),
    ("error", "text"),
)


def _insert_runs_postgresql(connection: Any, rows: Sequence[Run]) -> None:
    """``INSERT … SELECT unnest(…) RETURNING``: one statement, no per-row ORM work; sets the
    new ids on ``rows``. The unique ``(periodic_task, slot)`` constraint still applies."""
    table = connection.ops.quote_name(Run._meta.db_table)
    names = ", ".join(name for name, _ in _RUN_COLUMNS)
    arrays = ", ".join(f"%s::{kind}[]" for _, kind in _RUN_COLUMNS)
    values = [[getattr(row, name) for row in rows] for name, _ in _RUN_COLUMNS]
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {table} ({names}) SELECT * FROM unnest({arrays}) "
            f"RETURNING id, periodic_task_id, slot",
            values,
        )
        ids = {(task_id, slot): pk for pk, task_id, slot in cursor.fetchall()}
    for row in rows:
        row.pk = ids[(row.periodic_task_id, row.slot)]


_FIELDS = ("next_slot_at", "last_slot_at", "run_count", "enabled", "disabled_reason")
_PG_TYPES = ("timestamptz", "timestamptz", "bigint", "boolean", "text")


def advance_tasks(
    using: str, tasks: Sequence[PeriodicTask], seen: dict[int, Any] | None = None
) -> set[int]:
    """Write the claim state of ``tasks`` in one statement; return the ids written.

    With ``seen`` (task id -> the ``next_slot_at`` read before planning) the statement is a
    compare-and-swap: a task is written only while enabled and still at that slot, and the
    ids returned are the tasks this caller won. PostgreSQL gets ``UPDATE ... FROM unnest(...)``;
    other databases a ``CASE`` per column (with ``RETURNING`` for the swap: SQLite 3.35+).
    """
    if not tasks:
        return set()
    connection = connections[using]
    table = connection.ops.quote_name(PeriodicTask._meta.db_table)
    if connection.vendor == "postgresql":
        return _advance_postgresql(connection, table, tasks, seen)
    adapt = connection.ops.adapt_datetimefield_value
    assignments: list[str] = []
    params: list[Any] = []
    for name in _FIELDS:
        whens = []
        for task in tasks:
            value = getattr(task, name)
            whens.append("WHEN %s THEN %s")
            params.extend([task.pk, adapt(value) if name.endswith("_at") else value])
        assignments.append(f"{connection.ops.quote_name(name)} = CASE id {' '.join(whens)} END")
    if seen is None:
        where = f"id IN ({', '.join(['%s'] * len(tasks))})"
        params.extend(task.pk for task in tasks)
    else:
        pairs = " OR ".join(["(id = %s AND next_slot_at = %s)"] * len(tasks))
        where = f"enabled AND ({pairs})"
        for task in tasks:
            params.extend([task.pk, adapt(seen[task.pk])])
    sql = f"UPDATE {table} SET {', '.join(assignments)} WHERE {where}"
    with connection.cursor() as cursor:
        if seen is None:
            cursor.execute(sql, params)
            return {task.pk for task in tasks}
        cursor.execute(sql + " RETURNING id", params)
        return {row[0] for row in cursor.fetchall()}


def _advance_postgresql(
    connection: Any, table: str, tasks: Sequence[PeriodicTask], seen: dict[int, Any] | None
) -> set[int]:
    columns = ["id", *_FIELDS]
    types = ["bigint", *_PG_TYPES]
    arrays: list[list[Any]] = [[task.pk for task in tasks]]
    arrays += [[getattr(task, name) for task in tasks] for name in _FIELDS]
    where = f"{table}.id = v.id"
    if seen is not None:
        columns.append("seen")
        types.append("timestamptz")
        arrays.append([seen[task.pk] for task in tasks])
        where += f" AND {table}.enabled AND {table}.next_slot_at = v.seen"
    sets = ", ".join(f"{name} = v.{name}" for name in _FIELDS)
    unnest = ", ".join(f"%s::{t}[]" for t in types)
    sql = (f"UPDATE {table} SET {sets} FROM unnest({unnest}) AS v({', '.join(columns)}) "
           f"WHERE {where} RETURNING {table}.id")
    with connection.cursor() as cursor:
        cursor.execute(sql, arrays)
        return {row[0] for row in cursor.fetchall()}


def claimer_for(using: str = "default", settings: DriftSafeSettings | None = None) -> Claimer:
    """The best claimer the database supports."""
    features = connections[using].features
    if features.has_select_for_update_skip_locked:
        return SkipLockedClaimer(using=using, settings=settings)
    return CompareAndSwapClaimer(using=using, settings=settings)


def reclaim_stale(
    now: datetime, node_id: str, *, lease: timedelta, limit: int = 500, using: str = "default"
) -> list[ClaimedRun]:
    """The outbox: runs claimed longer than ``lease`` ago and never marked dispatched (their
    beat died between commit and publish, or the broker refused), or claimed by a node known
    to be stopped or dead, are taken over by this node, one compare-and-swap each on
    ``claimed_at``, and returned for re-publishing under the same Celery task id."""
    from celery_driftsafe.models import BeatNode

    gone = BeatNode.objects.using(using).filter(stopped_at__isnull=False).values("node_id")
    stale = list(
        Run.objects.using(using)
        .filter(Q(claimed_at__lt=now - lease) | Q(claimed_by__in=gone),
                status=RunStatus.CLAIMED, kind__in=(RunKind.SCHEDULED, RunKind.MANUAL))
        .select_related("periodic_task")
        .order_by("claimed_at")[:limit]
    )
    taken: list[ClaimedRun] = []
    for run in stale:
        updated = Run.objects.using(using).filter(
            pk=run.pk, status=RunStatus.CLAIMED, claimed_at=run.claimed_at
        ).update(claimed_at=now, claimed_by=node_id, dispatch_attempts=F("dispatch_attempts") + 1)
        if not updated:
            continue
        task = run.periodic_task
        logger.warning(
            "re-publishing run %s of %s (slot %s): claimed by %s but never dispatched",
            run.pk, run.task_name, run.slot, run.claimed_by,
            extra={"action": "reclaim", "task": run.task_name, "slot": run.slot, "node": node_id},
        )
        taken.append(claimed_run(run, task))
    return taken
