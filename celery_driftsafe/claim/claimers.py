"""Claiming: the one short transaction that turns due slots into run rows, exactly once.

Two implementations of :class:`Claimer`, one contract:

* :class:`SkipLockedClaimer` (PostgreSQL, MySQL 8, MariaDB 10.6+): ``SELECT … FOR UPDATE SKIP
  LOCKED`` takes the due tasks; rows another beat holds are passed over, not waited for.
* :class:`CompareAndSwapClaimer` (SQLite, or anywhere): read the due tasks without locks, then one
  ``UPDATE … WHERE (id, next_slot_at, changed_at) = (seen values) … RETURNING id`` advances
  exactly the tasks nobody advanced or edited meanwhile.

Either way a round is a constant number of statements whatever the number of due tasks, and
the unique ``(periodic_task, slot)`` constraint is the last guard.

The steps of a round both share are :class:`ClaimSteps`'s: load the due tasks (a row the ORM
cannot read is disabled by id), plan each under its misfire policy, jitter, bounds and run
limits (a task that cannot be planned is disabled with the reason), advance it, and insert the
round's run rows (a slot that already has a run is skipped; a task whose rows the database
refuses is disabled). The claimers add the locking: which rows a round may take and how it
learns that it won them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import partial
from typing import Any, Protocol

from django.db import (
    DataError,
    IntegrityError,
    InterfaceError,
    OperationalError,
    connections,
    transaction,
)
from django.db.models import TextField
from django.db.models.functions import Cast

from celery_driftsafe.claim.disabling import disable_by_id
from celery_driftsafe.claim.outbox import ClaimedRun, celery_task_id, run_message
from celery_driftsafe.claim.pausing import count_missed
from celery_driftsafe.claim.sql import (
    NewRun,
    advance_tasks,
    insert_runs_postgresql,
    missed_row,
    span_row,
)
from celery_driftsafe.conf import DriftSafeSettings, get_settings
from celery_driftsafe.core.bounds import message_expiry
from celery_driftsafe.core.jitter import due_instant
from celery_driftsafe.core.misfire import ClaimPlan, plan_limited
from celery_driftsafe.core.stored_names import Optimisation
from celery_driftsafe.core.validation import Problem
from celery_driftsafe.models import (
    PeriodicTask,
    Run,
    RunStatus,
    disabled_by_scheduler,
    schedule_failure,
)
from celery_driftsafe.store.connections import order_from_indexes
from celery_driftsafe.store.loaders import load_kept_models
from celery_driftsafe.store.statement_cache import select_rows

logger = logging.getLogger("celery_driftsafe.claim")


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
    :mod:`celery_driftsafe.core.misfire`).
    """

    def claim(
        self, now: datetime, node_id: str, busy_since: datetime | None = None
    ) -> ClaimResult: ...


# -- The steps of a round both claimers share -----------------------------------------------------


#: Errors that mean "the database is away", not "this row is bad": they end the round.
_OUTAGE = (OperationalError, InterfaceError)


class ClaimSteps:
    """The steps of a claim round both claimers share: load the due rows, plan each task,
    advance it, write the run rows, disable the rows the database refuses."""

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
        #: Whether plans may be made by arithmetic rather than by walking the slots (the same
        #: plans; :func:`~celery_driftsafe.core.misfire.plan_claim`).
        self.arithmetic = self.settings.optimised(Optimisation.MISFIRE_ARITHMETIC)
        #: Tasks of the current round that reach a bound or limit: id -> why.
        self._finished: dict[int, str] = {}

    def _due(self, now: datetime, *, lock: bool) -> Any:
        """The first ``batch_size`` due tasks, earliest first; ``lock``: ``FOR UPDATE SKIP
        LOCKED``. due_at is the next slot plus its jitter (the slot itself without jitter)."""
        due = PeriodicTask.objects.using(self.using).filter(enabled=True).order_by("due_at", "id")
        if lock:
            due = due.filter(due_at__lte=now).select_for_update(skip_locked=True)
        elif connections[self.using].vendor == "sqlite":
            due = self._due_as_stored(due, now)
        else:
            due = due.filter(due_at__lte=now)
        return due[: self.batch_size]

    def _due_as_stored(self, due: Any, now: datetime) -> Any:
        """SQLite, which compares instants as text, where a raw SQL write may spell them
        otherwise than Django (``2026-03-01T12:00:00``, where Django writes a space, which
        sorts before the "T"). Due is ``due_at <= now``, and also an instant of ``now``'s day
        spelled with a "T": compared with Django's spelling only, such a task fell due a day
        late (the two are ranges of the due index). The compare-and-swap compares the slot
        and the edit stamp as stored: compared as Django spells them, such a task was never
        won, round after round."""
        connection = connections[self.using]
        text = str(connection.ops.adapt_datetimefield_value(now))
        table = connection.ops.quote_name(PeriodicTask._meta.db_table)
        ranges = " UNION ALL ".join(
            f"SELECT id FROM {table} WHERE enabled = 1 AND due_at {condition}"
            for condition in ("<= %s", ">= %s AND due_at <= %s")
        )
        return due.extra(
            where=[f"{table}.id IN ({ranges})"],
            params=[text, text[:10] + "T", text[:10] + "T" + text[11:]],
        ).annotate(
            stored_slot=Cast("next_slot_at", TextField()),
            stored_change=Cast("changed_at", TextField()),
        )

    def _load(self, now: datetime, result: ClaimResult, *, lock: bool) -> list[PeriodicTask]:
        """The due rows. A row the ORM cannot even load (text that is not JSON or not a date,
        stored by raw SQL on SQLite) is disabled by id, and the others are loaded one by one."""
        try:
            return load_kept_models(
                self.using,
                ("due", lock, self.batch_size),
                [now],
                partial(self._due, now, lock=lock),
            )
        except _OUTAGE:
            raise
        except Exception:
            ids = list(self._due(now, lock=lock).values_list("pk", flat=True))
        tasks = []
        for pk in ids:
            try:
                tasks.append(PeriodicTask.objects.using(self.using).get(pk=pk))
            except _OUTAGE:
                raise
            except Exception as exc:
                name = disable_by_id(self.using, pk, f"the row cannot be read: {exc!r}")
                result.disabled.append(name)
        return tasks

    def _plan(
        self, task: PeriodicTask, now: datetime, busy_since: datetime | None = None
    ) -> ClaimPlan:
        """Plan one task under its policies, jitter, bounds and run limits (core/bounds.py)."""
        assert task.next_slot_at is not None
        grace = task.misfire_grace_seconds
        if grace is None:
            grace = self.settings.misfire_grace_seconds
        plan, finished = plan_limited(
            task.schedule,
            task.next_slot_at,
            now,
            task.limits,
            policy=task.misfire_policy or self.settings.misfire_policy,
            grace=timedelta(seconds=grace),
            fire_all_max=self.settings.fire_all_max,
            busy_since=busy_since,
            arithmetic=self.arithmetic,
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
            problems = task.publish_problems(schedule=False)  # planning evaluates the schedule
            problems += claim_state_problems(task)
            try:
                if not problems:
                    plan = self._plan(task, now, busy_since)
                    problem = count_problem(task.run_count, len(plan.fire))
                    if problem is None:
                        planned.append((task, plan))
                        continue
                else:
                    problem = "; ".join(map(str, problems))
            except Exception as exc:
                problem = schedule_failure(task, exc)
            logger.error(
                "task %s disabled: %s",
                task.name,
                problem,
                extra={"action": "disable", "task": task.name},
            )
            task.enabled = False
            task.disabled_reason = disabled_by_scheduler(problem)
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
                for slot in plan.fire:
                    rows.append(
                        NewRun(
                            task,
                            slot,
                            RunStatus.CLAIMED,
                            celery_task_id(task.pk, slot),
                            message,
                            self._expires_at(task, slot),
                        )
                    )
                first_due = due_instant(task.name, plan.fire[0], task.jitter_seconds)
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
        return run_expiry(task, slot, self.settings)

    def _insert(self, rows: list[NewRun], now: datetime, node_id: str) -> list[PeriodicTask]:
        """Insert ``rows``, skipping those whose slot already has a run. The batch goes first
        as a plain insert (on PostgreSQL cheaper than ``ON CONFLICT``, see
        :func:`insert_runs_postgresql`), and again skipping taken slots only when that meets a
        slot that already has a run (rare: a schedule moved back over slots it ran, a run
        written by hand). Should the database refuse the batch for another reason, insert task
        by task and return the tasks whose rows it still refuses. No ``INSERT IGNORE`` (MySQL)
        or ``OR IGNORE`` (SQLite): they also drop a row a constraint refuses, with only a
        warning, and the slot would pass for taken."""
        # OPTIMISATIONS_OFF "plain_insert": skipping taken slots from the first statement
        plain = self.settings.optimised(Optimisation.PLAIN_INSERT)
        refusal = self._attempt(rows, now, node_id, skip_taken=not plain)
        if plain and isinstance(refusal, IntegrityError):
            logger.debug("a slot of the claim batch already has a run (%s)", refusal)
            refusal = self._attempt(rows, now, node_id, skip_taken=True)
        if refusal is None:
            return []
        logger.warning("claim batch refused (%s); inserting task by task", refusal)
        by_task: dict[int, list[NewRun]] = {}
        for row in rows:
            by_task.setdefault(row.task.pk, []).append(row)
        refused = []
        for group in by_task.values():
            refusal = self._attempt(group, now, node_id, skip_taken=True)
            if refusal is None:
                continue
            task = group[0].task
            task.disabled_reason = disabled_by_scheduler(
                f"the database refused its run row: {refusal}"
            )
            logger.error(
                "task %s disabled: %s",
                task.name,
                task.disabled_reason,
                extra={"action": "disable", "task": task.name},
            )
            refused.append(task)
        return refused

    def _attempt(
        self, rows: list[NewRun], now: datetime, node_id: str, *, skip_taken: bool
    ) -> IntegrityError | DataError | None:
        """:meth:`_insert_rows` in a savepoint of its own; the database's refusal, if it
        refused (the rows then have no ids: a statement before the refused one was rolled
        back with it)."""
        try:
            with transaction.atomic(using=self.using):
                self._insert_rows(rows, now, node_id, skip_taken=skip_taken)
        except (IntegrityError, DataError) as exc:
            for row in rows:
                row.pk = None
            return exc
        return None

    def _insert_rows(
        self, rows: list[NewRun], now: datetime, node_id: str, *, skip_taken: bool
    ) -> None:
        """``skip_taken``: leave out a row whose slot already has a run (PostgreSQL: ``ON
        CONFLICT DO NOTHING``; elsewhere the taken slots are looked up first, the claimed
        tasks being locked), else such a row fails the statement."""
        connection = connections[self.using]
        if connection.vendor == "postgresql":
            for status in (RunStatus.CLAIMED, RunStatus.MISSED):
                some = [row for row in rows if row.status == status]
                if some:
                    insert_runs_postgresql(connection, some, now, node_id, skip_taken=skip_taken)
            return
        runs = Run.objects.using(self.using)
        keys: dict[tuple[int, datetime | None], NewRun] = {
            (row.task.pk, row.slot): row for row in rows
        }
        tasks = {row.task.pk for row in rows}
        slots = {row.slot for row in rows}
        if skip_taken:
            taken = runs.filter(periodic_task_id__in=tasks, slot__in=slots)
            for key in taken.values_list("periodic_task_id", "slot"):
                keys.pop(key, None)
        inserting = list(keys.values())
        models = runs.bulk_create([row.model(now, node_id) for row in inserting])
        for row, model in zip(inserting, models, strict=True):
            row.pk = model.pk
        if all(row.pk is not None for row in inserting):
            return
        # MySQL returns no ids from a bulk insert: look up the rows this round inserted.
        for pk, task_id, slot in runs.filter(
            periodic_task_id__in=tasks, slot__in=slots, claimed_by=node_id, claimed_at=now
        ).values_list("pk", "periodic_task_id", "slot"):
            found = keys.get((task_id, slot))
            if found is not None:
                found.pk = pk

    def _disable_refused(self, refused: list[PeriodicTask], result: ClaimResult) -> None:
        for task in refused:
            PeriodicTask.objects.using(self.using).filter(pk=task.pk).update(
                enabled=False, disabled_reason=task.disabled_reason
            )
            result.disabled.append(task.name)

    def _count_missed(
        self,
        planned: Iterable[tuple[PeriodicTask, ClaimPlan]],
        refused: list[PeriodicTask],
        now: datetime,
    ) -> None:
        """Count the round's missed slots towards ``pause_after_failures`` (in the round's
        transaction; see :mod:`celery_driftsafe.claim.pausing`)."""
        for task, plan in planned:
            if plan.missed_count and task not in refused:
                count_missed(self.using, task, plan.missed_count, len(plan.fire), now)

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


#: The largest run count the column holds (a ``bigint`` on every database).
RUN_COUNT_MAX = 2**63 - 1


def claim_state_problems(task: PeriodicTask) -> list[Problem]:
    """What is wrong with the claim's own columns of a due row, written behind ``save()``
    (raw SQL, ``QuerySet.update``): the claim cannot plan or count such a row."""
    found = []
    if task.next_slot_at is None:
        found.append(
            Problem(
                "next_slot_at",
                "empty while due_at is set; save the task (or enable it again) to compute "
                "its next slot",
            )
        )
    count = task.run_count
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        found.append(Problem("run_count", f"must be a whole number of 0 or more, not {count!r}"))
    return found


def count_problem(run_count: int, fired: int) -> str | None:
    """Why ``run_count`` cannot count ``fired`` more runs (None: it can)."""
    if run_count + fired <= RUN_COUNT_MAX:
        return None
    return (
        f"run_count: {run_count} runs cannot count {fired} more (the column holds at most "
        f"{RUN_COUNT_MAX}); set it to 0 and enable the task again"
    )


def run_expiry(task: PeriodicTask, slot: datetime, settings: DriftSafeSettings) -> datetime | None:
    """When the message of ``task``'s run of ``slot`` expires (None: never)."""
    seconds = task.expires_seconds
    if seconds is None:
        seconds = settings.run_expires_seconds
    if (
        task.jitter_seconds is None
        and task.valid_until is None
        and settings.optimised(Optimisation.EXPIRY_SHORTCUT)
    ):  # what message_expiry gives
        return None if seconds is None else slot + timedelta(seconds=seconds)
    return message_expiry(slot, task.limits, seconds)


# -- The claimers ---------------------------------------------------------------------------------


class SkipLockedClaimer(ClaimSteps):
    """``SELECT … FOR UPDATE SKIP LOCKED``: PostgreSQL, MySQL 8+, MariaDB 10.6+."""

    def claim(self, now: datetime, node_id: str, busy_since: datetime | None = None) -> ClaimResult:
        result = ClaimResult()
        with transaction.atomic(using=self.using):
            order_from_indexes(self.using)
            tasks = self._load(now, result, lock=True)
            result.tasks_seen = len(tasks)
            if not tasks:
                return result
            planned = self._plans(tasks, now, result, busy_since)
            for task, plan in planned:
                self._advance(task, plan, result)
            refused = self._write_runs(planned, now, node_id, result)
            advance_tasks(self.using, tasks)
            self._disable_refused(refused, result)
            self._count_missed(planned, refused, now)
        return result


class CompareAndSwapClaimer(ClaimSteps):
    """Lock-free claim: the ``UPDATE`` only advances tasks still at the ``next_slot_at`` this
    beat read, and ``RETURNING`` says which. Needs ``UPDATE … RETURNING`` (SQLite 3.35+,
    PostgreSQL)."""

    def claim(self, now: datetime, node_id: str, busy_since: datetime | None = None) -> ClaimResult:
        result = ClaimResult()
        tasks = self._load(now, result, lock=False)
        result.tasks_seen = len(tasks)
        if not tasks:
            return result
        seen = {
            task.pk: (
                getattr(task, "stored_slot", task.next_slot_at),
                getattr(task, "stored_change", task.changed_at),
            )
            for task in tasks
        }
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
                self._count_missed(planned, refused, now)
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
    """When the earliest unclaimed slot of any enabled task is due (its jittered instant).

    A due instant stored as text that is no instant (SQLite, raw SQL) and sorts first made
    every round fail here, and the beat back off for up to 30 s a round: such rows are
    disabled with the reason, and the others read again."""
    build = partial(_first_due, using)
    try:
        rows = select_rows(using, ("next-due",), [], build)
    except (ValueError, TypeError, AttributeError):  # Django's reading of the text
        if not _disable_unreadable_due(using):
            raise
        rows = select_rows(using, ("next-due",), [], build)
    return rows[0][0] if rows else None


#: How many of the first due instants :func:`_disable_unreadable_due` reads one by one.
UNREADABLE_LOOK = 100


def _disable_unreadable_due(using: str) -> list[str]:
    """Disable the enabled tasks among the first :data:`UNREADABLE_LOOK` in due order whose
    stored ``due_at`` Django cannot read as an instant; their names."""
    from django.db.models import TextField
    from django.db.models.functions import Cast
    from django.utils.dateparse import parse_datetime

    rows = list(
        PeriodicTask.objects.using(using)
        .filter(enabled=True, due_at__isnull=False)
        .order_by("due_at")
        .annotate(stored=Cast("due_at", TextField()))
        .values_list("pk", "stored")[:UNREADABLE_LOOK]
    )
    disabled = []
    for pk, text in rows:
        try:
            parse_datetime(text)  # what Django's SQLite driver converter does with it
        except ValueError as exc:
            disabled.append(disable_by_id(using, pk, f"due_at: cannot be read: {exc!r}"))
    return disabled


def _first_due(using: str) -> Any:
    # The first entry of the (enabled, due_at, id) index: as MIN(due_at), which the ORM
    # cannot give as a statement to keep (store/statement_cache.py).
    tasks: Any = PeriodicTask.objects.using(using)
    connection = connections[using]
    if connection.vendor == "sqlite":
        # Enabled as the claim reads it (ClaimSteps._due_as_stored) and the ORM does: 1.
        # Django writes the filter as the bare column, true also for a 2 stored by raw SQL,
        # which the claim never took: the beat then saw a task due and spun at MIN_WAIT.
        table = connection.ops.quote_name(PeriodicTask._meta.db_table)
        tasks = tasks.extra(where=[f"{table}.enabled = 1"])
    else:
        tasks = tasks.filter(enabled=True)
    return tasks.filter(due_at__isnull=False).order_by("due_at").values_list("due_at")[:1]
