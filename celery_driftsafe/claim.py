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

import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Protocol

from django.db import (
    DataError,
    IntegrityError,
    InterfaceError,
    OperationalError,
    connections,
    transaction,
)
from django.db.models import Min

from celery_driftsafe.bounds import Limits, message_expiry, plan_limited
from celery_driftsafe.claim_sql import (
    NewRun,
    advance_tasks,
    insert_runs_postgresql,
    missed_row,
    span_row,
)
from celery_driftsafe.conf import DriftSafeSettings, get_settings
from celery_driftsafe.dispatch import ClaimedRun, celery_task_id, run_message
from celery_driftsafe.exceptions import ScheduleError
from celery_driftsafe.jitter import due_instant, offset
from celery_driftsafe.misfire import ClaimPlan
from celery_driftsafe.models import (
    PeriodicTask,
    Run,
    RunStatus,
    schedule_problem,
)

logger = logging.getLogger(__name__)

#: Errors that mean "the database is away", not "this row is bad": they end the round.
_OUTAGE = (OperationalError, InterfaceError)


@dataclass
class ClaimResult:
    """What a claim round did: runs to publish, slots recorded missed, tasks disabled."""

    runs: list[ClaimedRun] = field(default_factory=list)
    missed: int = 0
    disabled: list[str] = field(default_factory=list)
    tasks_seen: int = 0
    #: Slots that fired past the misfire grace because the beats were busy (see misfire).
    late_from_load: int = 0
    #: The due instant (slot plus jitter) of the oldest slot this round fired: how far behind
    #: the beats are.
    oldest_slot: datetime | None = None
    #: Tasks disabled after their last allowed run (valid until, run once, max runs).
    finished: list[str] = field(default_factory=list)


class Claimer(Protocol):
    """Claims due slots.

    ``claim(now, node_id)`` takes at most ``batch_size`` enabled tasks whose ``due_at`` (the
    next slot plus the task's jitter) is at or before ``now`` (an authority reading taken just
    before the call), earliest first. For each task it applies the misfire policy, inserts one
    run row per slot that fires (status ``claimed``) or is missed (status ``missed``), and
    moves ``next_slot_at`` (and ``due_at``) to the first slot not yet due — all in one
    transaction per round. A slot fires only once ``now`` reaches its jittered instant, within
    the task's bounds, while it has runs left; a task used up is disabled (``finished: …``).
    A task another beat holds or has advanced is left out: losing a race is normal. A task
    whose stored schedule cannot be evaluated is disabled with the reason recorded. Returns
    the claimed runs in slot order. ``busy_since``: since when the beats have been claiming without
    a break (a slot that fell due since then is late, not missed; see
    :mod:`celery_driftsafe.misfire`).
    """

    def claim(
        self, now: datetime, node_id: str, busy_since: datetime | None = None
    ) -> ClaimResult: ...


class _BaseClaimer:
    def __init__(
        self,
        *,
        using: str = "default",
        settings: DriftSafeSettings | None = None,
        batch_size: int | None = None,
    ) -> None:
        self.using = using
        self.settings = settings or get_settings()
        self.batch_size = batch_size or self.settings.claim_batch_size
        #: Tasks of the current round that reach a bound or limit: id -> why.
        self._finished: dict[int, str] = {}

    def _due(self, now: datetime) -> Any:
        # due_at is the next slot plus its jitter (the slot itself without jitter).
        return (
            PeriodicTask.objects.using(self.using)
            .filter(enabled=True, due_at__lte=now)
            .order_by("due_at", "id")
        )

    def _load(self, due: Any, result: ClaimResult) -> list[PeriodicTask]:
        """The due rows. A row the ORM cannot even load (text that is not JSON or not a date,
        stored by raw SQL on SQLite) is disabled by id, and the others are loaded one by one."""
        try:
            return list(due[: self.batch_size])
        except _OUTAGE:
            raise
        except Exception:
            ids = list(due.values_list("pk", flat=True)[: self.batch_size])
        tasks = []
        for pk in ids:
            try:
                tasks.append(PeriodicTask.objects.using(self.using).get(pk=pk))
            except _OUTAGE:
                raise
            except Exception as exc:
                name = self._disable_by_id(pk, f"the row cannot be read: {exc!r}")
                result.disabled.append(name)
        return tasks

    def _disable_by_id(self, pk: int, problem: str) -> str:
        name = str(
            PeriodicTask.objects.using(self.using)
            .filter(pk=pk)
            .values_list("name", flat=True)
            .first()
            or pk
        )
        logger.error(
            "task %s disabled: %s", name, problem, extra={"action": "disable", "task": name}
        )
        PeriodicTask.objects.using(self.using).filter(pk=pk).update(
            enabled=False, next_slot_at=None, disabled_reason=_reason(problem)
        )
        return name

    def _plan(
        self, task: PeriodicTask, now: datetime, busy_since: datetime | None = None
    ) -> ClaimPlan:
        """Plan one task under its policies, jitter, bounds and run limits (bounds.py)."""
        assert task.next_slot_at is not None
        grace = task.misfire_grace_seconds
        if grace is None:
            grace = self.settings.misfire_grace_seconds
        plan, finished = plan_limited(
            task.schedule,
            task.next_slot_at,
            now,
            _limits(task),
            policy=task.misfire_policy or self.settings.misfire_policy,
            grace=timedelta(seconds=grace),
            fire_all_max=self.settings.fire_all_max,
            busy_since=busy_since,
        )
        if finished is not None:
            self._finished[task.pk] = finished
        return plan

    def _plans(
        self,
        tasks: Sequence[PeriodicTask],
        now: datetime,
        result: ClaimResult,
        busy_since: datetime | None = None,
    ) -> list[tuple[PeriodicTask, ClaimPlan]]:
        """Plan each task; a task whose row cannot be fired (bad JSON shape, bad option,
        broken schedule, anything its planning raises) is disabled with the reason, and the
        others go on."""
        self._finished = {}
        planned = []
        for task in tasks:
            task.coerce()
            problems = task.problems(schedule=False)  # planning evaluates the schedule
            try:
                if not problems:
                    planned.append((task, self._plan(task, now, busy_since)))
                    continue
                problem = "; ".join(map(str, problems))
            except ScheduleError as exc:
                problem = str(schedule_problem(exc))
            except Exception as exc:
                problem = f"{task.schedule_field()}: the schedule cannot be evaluated: {exc!r}"
            logger.error(
                "task %s disabled: %s",
                task.name,
                problem,
                extra={"action": "disable", "task": task.name},
            )
            task.enabled = False
            task.disabled_reason = _reason(problem)
            task.next_slot_at = task.due_at = None
            result.disabled.append(task.name)
        return planned

    def _write_runs(
        self,
        planned: Iterable[tuple[PeriodicTask, ClaimPlan]],
        now: datetime,
        node_id: str,
        result: ClaimResult,
    ) -> list[PeriodicTask]:
        """Insert the round's run rows; return the tasks whose rows the database refused
        (they are to be disabled). A slot that already has a run is skipped, not an error."""
        rows: list[NewRun] = []
        for task, plan in planned:
            for slot in plan.missed:
                rows.append(missed_row(task, slot, now))
            if plan.missed_span is not None:
                rows.append(span_row(task, plan.missed_span))
            if plan.fire:
                message = run_message(task)
                text = json.dumps(message)
                for slot in plan.fire:
                    rows.append(
                        NewRun(
                            task,
                            slot,
                            RunStatus.CLAIMED,
                            celery_task_id(task.pk, slot),
                            message,
                            text,
                            self._expires_at(task, slot),
                        )
                    )
                first_due = plan.fire[0] + offset(task.name, plan.fire[0], task.jitter_seconds)
                result.oldest_slot = min(result.oldest_slot or first_due, first_due)
            result.missed += plan.missed_count
            result.late_from_load += plan.late_from_load
        if not rows:
            return []
        refused = self._insert(rows, now, node_id)
        for row in rows:
            if row.status != RunStatus.CLAIMED:
                continue
            if row.pk is not None:
                result.runs.append(row.claimed(node_id))
            elif row.task not in refused:
                logger.warning(
                    "slot %s of %s already has a run; skipped (the task was saved or "
                    "rescheduled onto a slot that fired)",
                    row.slot,
                    row.task.name,
                    extra={
                        "action": "slot-taken",
                        "task": row.task.name,
                        "slot": row.slot,
                        "node": node_id,
                    },
                )
        result.runs.sort(key=lambda r: (r.slot, r.run_id))
        return refused

    def _expires_at(self, task: PeriodicTask, slot: datetime) -> datetime | None:
        seconds = task.expires_seconds
        if seconds is None:
            seconds = self.settings.run_expires_seconds
        return message_expiry(slot, _limits(task), seconds)

    def _insert(self, rows: list[NewRun], now: datetime, node_id: str) -> list[PeriodicTask]:
        """Insert ``rows``, skipping those whose slot already has a run. Should the database
        refuse the batch for another reason, insert task by task and return the tasks whose
        rows it still refuses."""
        try:
            with transaction.atomic(using=self.using):
                self._insert_rows(rows, now, node_id)
            return []
        except (IntegrityError, DataError) as exc:
            logger.warning("claim batch refused (%s); inserting task by task", exc)
        by_task: dict[int, list[NewRun]] = {}
        for row in rows:
            row.pk = None
            by_task.setdefault(row.task.pk, []).append(row)
        refused = []
        for group in by_task.values():
            try:
                with transaction.atomic(using=self.using):
                    self._insert_rows(group, now, node_id)
            except (IntegrityError, DataError) as exc:
                task = group[0].task
                for row in group:
                    row.pk = None
                task.disabled_reason = _reason(f"the database refused its run row: {exc}")
                logger.error(
                    "task %s disabled: %s",
                    task.name,
                    task.disabled_reason,
                    extra={"action": "disable", "task": task.name},
                )
                refused.append(task)
        return refused

    def _insert_rows(self, rows: list[NewRun], now: datetime, node_id: str) -> None:
        connection = connections[self.using]
        if connection.vendor == "postgresql":
            for status in (RunStatus.CLAIMED, RunStatus.MISSED):
                some = [row for row in rows if row.status == status]
                if some:
                    insert_runs_postgresql(connection, some, now, node_id)
            return
        models = [row.model(now, node_id) for row in rows]
        Run.objects.using(self.using).bulk_create(models, ignore_conflicts=True)
        # ignore_conflicts sets no ids: look up the rows this round inserted (an older run
        # of the same slot was claimed by another node or at another instant).
        keys: dict[tuple[int, datetime | None], NewRun] = {
            (row.task.pk, row.slot): row for row in rows
        }
        for row in rows:
            row.pk = None
        for pk, task_id, slot in (
            Run.objects.using(self.using)
            .filter(
                periodic_task_id__in={row.task.pk for row in rows},
                slot__in={row.slot for row in rows},
                claimed_by=node_id,
                claimed_at=now,
            )
            .values_list("pk", "periodic_task_id", "slot")
        ):
            found = keys.get((task_id, slot))
            if found is not None:
                found.pk = pk

    def _disable_refused(self, refused: list[PeriodicTask], result: ClaimResult) -> None:
        for task in refused:
            PeriodicTask.objects.using(self.using).filter(pk=task.pk).update(
                enabled=False, disabled_reason=task.disabled_reason
            )
            result.disabled.append(task.name)

    def _advance(self, task: PeriodicTask, plan: ClaimPlan, result: ClaimResult) -> None:
        task.next_slot_at = plan.next_slot
        task.due_at = due_instant(task.name, plan.next_slot, task.jitter_seconds)
        if plan.fire:
            task.last_slot_at = plan.fire[-1]
            task.run_count = (task.run_count or 0) + len(plan.fire)
        finished = self._finished.get(task.pk)
        if finished is not None:
            task.enabled = False
            task.next_slot_at = task.due_at = None
            task.disabled_reason = f"finished: {finished}"
            logger.info(
                "task %s finished: %s",
                task.name,
                finished,
                extra={"action": "finish", "task": task.name},
            )
            result.finished.append(task.name)


def _limits(task: PeriodicTask) -> Limits:
    return Limits(
        task.name,
        task.jitter_seconds,
        task.valid_from,
        task.valid_until,
        task.run_once,
        task.max_runs,
        task.run_count or 0,
    )


def _reason(problem: str) -> str:
    return f"disabled by the scheduler: {problem}"


class SkipLockedClaimer(_BaseClaimer):
    """``SELECT … FOR UPDATE SKIP LOCKED``: PostgreSQL, MySQL 8+, MariaDB 10.6+."""

    def claim(self, now: datetime, node_id: str, busy_since: datetime | None = None) -> ClaimResult:
        result = ClaimResult()
        with transaction.atomic(using=self.using):
            tasks = self._load(self._due(now).select_for_update(skip_locked=True), result)
            result.tasks_seen = len(tasks)
            if not tasks:
                return result
            planned = self._plans(tasks, now, result, busy_since)
            for task, plan in planned:
                self._advance(task, plan, result)
            refused = self._write_runs(planned, now, node_id, result)
            advance_tasks(self.using, tasks)
            self._disable_refused(refused, result)
        return result


class CompareAndSwapClaimer(_BaseClaimer):
    """Lock-free claim: the ``UPDATE`` only advances tasks still at the ``next_slot_at`` this
    beat read, and ``RETURNING`` says which. Needs ``UPDATE … RETURNING`` (SQLite 3.35+,
    PostgreSQL)."""

    def claim(self, now: datetime, node_id: str, busy_since: datetime | None = None) -> ClaimResult:
        result = ClaimResult()
        tasks = self._load(self._due(now), result)
        result.tasks_seen = len(tasks)
        if not tasks:
            return result
        seen = {task.pk: task.next_slot_at for task in tasks}
        planned = self._plans(tasks, now, result, busy_since)
        disabled = [t for t in tasks if not t.enabled]
        for task, plan in planned:
            self._advance(task, plan, result)
        try:
            with transaction.atomic(using=self.using):
                won = advance_tasks(self.using, [t for t, _ in planned] + disabled, seen)
                planned = [(t, p) for t, p in planned if t.pk in won]
                result.disabled = [t.name for t in disabled if t.pk in won]
                result.finished = [t.name for t, _ in planned if t.name in result.finished]
                refused = self._write_runs(planned, now, node_id, result)
                self._disable_refused(refused, result)
        except OperationalError as exc:
            if "locked" not in str(exc):
                raise
            # SQLite refused the write lock (another beat is writing): this round lost.
            logger.debug("claim round lost to a concurrent writer: %s", exc)
            return ClaimResult(tasks_seen=result.tasks_seen)
        return result


def claimer_for(using: str = "default", settings: DriftSafeSettings | None = None) -> Claimer:
    """The best claimer the database supports."""
    features = connections[using].features
    if features.has_select_for_update_skip_locked:
        return SkipLockedClaimer(using=using, settings=settings)
    return CompareAndSwapClaimer(using=using, settings=settings)


def next_due(using: str = "default") -> datetime | None:
    """When the earliest unclaimed slot of any enabled task is due (its jittered instant)."""
    value: datetime | None = (
        PeriodicTask.objects.using(using)
        .filter(enabled=True)
        .aggregate(next_due=Min("due_at"))["next_due"]
    )
    return value
