"""The claim's bulk SQL: the run rows a round inserts and the task rows it advances, each in
one statement whatever the number of tasks (on PostgreSQL every row's values in one JSON
document read by ``jsonb_array_elements``, elsewhere a ``CASE`` per column). The claim's
contract and its two implementations are in :mod:`celery_driftsafe.claim.claimers`."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db import (
    connections,
)

from celery_driftsafe.claim.outbox import ClaimedRun, message_parts
from celery_driftsafe.core.instants import iso_text
from celery_driftsafe.core.misfire import MissedSpan
from celery_driftsafe.models import (
    PeriodicTask,
    Run,
    RunKind,
    RunStatus,
)
from celery_driftsafe.store.loaders import read_instants_in_c

logger = logging.getLogger("celery_driftsafe.claim_sql")


@dataclass(slots=True)
class NewRun:
    """A run row a claim round writes (lighter than a model instance: a burst writes many)."""

    task: PeriodicTask
    slot: datetime
    status: str
    celery_task_id: str = ""
    message: dict[str, Any] = field(default_factory=dict)
    expires_at: datetime | None = None
    error: str = ""
    missed_count: int = 1
    missed_until: datetime | None = None
    pk: int | None = None

    def model(self, now: datetime, node_id: str) -> Run:
        return Run(
            periodic_task=self.task,
            task_name=self.task.task,
            kind=RunKind.SCHEDULED,
            slot=self.slot,
            status=self.status,
            claimed_by=node_id,
            claimed_at=now,
            celery_task_id=self.celery_task_id,
            message=self.message,
            expires_at=self.expires_at,
            error=self.error,
            missed_count=self.missed_count,
            missed_until=self.missed_until,
            dispatch_attempts=1 if self.status == RunStatus.CLAIMED else 0,
        )

    def claimed(self, node_id: str) -> ClaimedRun:
        assert self.pk is not None
        return ClaimedRun(
            run_id=self.pk,
            periodic_task_id=self.task.pk,
            task_name=self.task.task,
            slot=self.slot,
            celery_task_id=self.celery_task_id,
            fencing_token=0,
            claimed_by=node_id,
            expires_at=self.expires_at,
            dispatch_attempts=1,
            **message_parts(self.message),
        )


def missed_row(task: PeriodicTask, slot: datetime, now: datetime) -> NewRun:
    late = (now - slot).total_seconds()
    return NewRun(
        task,
        slot,
        RunStatus.MISSED,
        error=(
            f"missed: claimed {late:.1f} s after its slot (it fell due while no beat was "
            "claiming, or past the misfire grace)"
        ),
    )


def span_row(task: PeriodicTask, span: MissedSpan) -> NewRun:
    error = (
        f"{span.count} slots from {span.first.isoformat()} to {span.last.isoformat()} "
        "were missed (the beats were down or the task was disabled); this one row "
        "stands for all of them"
    )
    return NewRun(
        task,
        span.first,
        RunStatus.MISSED,
        error=error,
        missed_count=span.count,
        missed_until=span.last,
    )


#: Per-row columns of the claim's insert, by status, with how each is read from the JSON
#: document's row (the others are the same for every row).
_ROW_COLUMNS: dict[str, tuple[tuple[str, str], ...]] = {
    RunStatus.CLAIMED: (
        ("periodic_task_id", "(r->>0)::bigint"),
        ("task_name", "r->>1"),
        ("slot", "(r->>2)::timestamptz"),
        ("celery_task_id", "r->>3"),
        ("message", "r->4"),
        ("expires_at", "(r->>5)::timestamptz"),
    ),
    RunStatus.MISSED: (
        ("periodic_task_id", "(r->>0)::bigint"),
        ("task_name", "r->>1"),
        ("slot", "(r->>2)::timestamptz"),
        ("error", "r->>3"),
        ("missed_count", "(r->>4)::integer"),
        ("missed_until", "(r->>5)::timestamptz"),
    ),
}


def _instant(value: datetime | None) -> str | None:
    return None if value is None else iso_text(value)


def _row_values(row: NewRun) -> list[Any]:
    """A row of the insert's JSON document, in the order of :data:`_ROW_COLUMNS`."""
    values: list[Any] = [row.task.pk, row.task.task, iso_text(row.slot)]
    if row.status == RunStatus.CLAIMED:
        return [*values, row.celery_task_id, row.message, _instant(row.expires_at)]
    return [*values, row.error, row.missed_count, _instant(row.missed_until)]


def insert_runs_postgresql(
    connection: Any, rows: Sequence[NewRun], now: datetime, node_id: str, *, skip_taken: bool
) -> None:
    """``INSERT … SELECT … FROM jsonb_array_elements(…) RETURNING``: one statement for rows of
    one status, the varying columns of every row in one JSON document (one ``json.dumps`` in
    C, where per-column arrays were quoted element by element in Python) and one value for
    each column that does not vary; sets the new ids on ``rows``.

    With ``skip_taken`` (``ON CONFLICT DO NOTHING``) a row whose slot already has a run is
    skipped (its ``pk`` stays None); without it such a row fails the statement with an
    ``IntegrityError``. The plain insert costs the database less: ``ON CONFLICT`` first looks
    for the row in the (task, slot) index and then descends it again to insert, where a
    plain insert descends it once (``python -m benchmarks claim-insert``: 3-5 µs of
    PostgreSQL's CPU a slot)."""
    status = rows[0].status
    columns = _ROW_COLUMNS[status]
    constants = {
        "kind": RunKind.SCHEDULED,
        "status": status,
        "claimed_by": node_id,
        "claimed_at": now,
        "fencing_token": 0,
        "dispatch_attempts": 1 if status == RunStatus.CLAIMED else 0,
        "duplicate_deliveries": 0,
        "worker": "",
        "attempt": 0,
        **(
            {"error": "", "missed_count": 1}
            if status == RunStatus.CLAIMED
            else {"celery_task_id": "", "message": "{}"}
        ),
    }
    table = connection.ops.quote_name(Run._meta.db_table)
    names = ", ".join([*(name for name, _ in columns), *constants])
    selects = ", ".join(
        [
            *(read for _, read in columns),
            *(("%s::jsonb" if name == "message" else "%s") for name in constants),
        ]
    )
    document = json.dumps([_row_values(row) for row in rows], separators=(",", ":"))
    with connection.cursor() as cursor:
        read_instants_in_c(connection, cursor)  # the returned slots
        cursor.execute(
            f"INSERT INTO {table} ({names}) SELECT {selects} "
            "FROM jsonb_array_elements(%s::jsonb) AS r "
            f"{'ON CONFLICT DO NOTHING ' if skip_taken else ''}"
            "RETURNING id, periodic_task_id, slot",
            [*constants.values(), document],
        )
        ids = {(task_id, slot): pk for pk, task_id, slot in cursor.fetchall()}
    for row in rows:
        row.pk = ids.get((row.task.pk, row.slot))


_FIELDS = ("next_slot_at", "due_at", "last_slot_at", "run_count", "enabled", "disabled_reason")
#: Each of :data:`_FIELDS`' PostgreSQL type, for reading it back from a JSON document (text
#: needs no cast); an instant (``timestamptz``) is sent as ISO 8601.
_PG_TYPES = {
    "next_slot_at": "timestamptz",
    "due_at": "timestamptz",
    "last_slot_at": "timestamptz",
    "run_count": "bigint",
    "enabled": "boolean",
    "disabled_reason": "",
}


def advance_tasks(
    using: str, tasks: Sequence[PeriodicTask], seen: dict[int, Any] | None = None
) -> set[int]:
    """Write the claim state of ``tasks`` in one statement; return the ids written.

    With ``seen`` (task id -> the ``next_slot_at`` and ``changed_at`` read before planning) the
    statement is a compare-and-swap: a task is written only while enabled, still at that slot
    and not edited since (an edit that keeps the slot would otherwise be claimed with the plan
    of the row as it was), and the ids returned are the tasks this caller won. PostgreSQL gets
    ``UPDATE … FROM jsonb_array_elements(…)``; other databases a ``CASE`` per column (with
    ``RETURNING`` for the swap: SQLite 3.35+).
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
        # Null-safe: a row written without a next slot (raw SQL) is won, to be disabled.
        same = {"sqlite": "IS", "mysql": "<=>"}.get(connection.vendor, "IS NOT DISTINCT FROM")
        pairs = " OR ".join(
            [f"(id = %s AND next_slot_at {same} %s AND changed_at = %s)"] * len(tasks)
        )
        where = f"enabled AND ({pairs})"
        for task in tasks:
            stored = seen[task.pk]  # instants, or on SQLite the texts as stored
            params.extend([task.pk, *(v if isinstance(v, str) else adapt(v) for v in stored)])
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
    """``UPDATE … FROM jsonb_array_elements(…)``: the tasks' new state as one JSON document
    (one ``json.dumps`` in C rather than seven arrays quoted element by element in Python)."""
    types = [_PG_TYPES[name] for name in _FIELDS]
    reads = [f"(r->>{i})::{kind}" if kind else f"r->>{i}" for i, kind in enumerate(types, start=1)]
    sets = ", ".join(f"{name} = {read}" for name, read in zip(_FIELDS, reads, strict=True))
    where = f"{table}.id = (r->>0)::bigint"
    instants = [i for i, kind in enumerate(types, start=1) if kind == "timestamptz"]
    rows = []
    for task in tasks:
        row = [task.pk, *(getattr(task, name) for name in _FIELDS)]
        for i in instants:
            row[i] = _instant(row[i])
        if seen is not None:
            row.extend(map(_instant, seen[task.pk]))
        rows.append(row)
    if seen is not None:
        slot, changed = len(_FIELDS) + 1, len(_FIELDS) + 2
        where += (
            f" AND {table}.enabled"
            f" AND {table}.next_slot_at IS NOT DISTINCT FROM (r->>{slot})::timestamptz"
            f" AND {table}.changed_at = (r->>{changed})::timestamptz"
        )
    # The LIMIT (the number of rows, so it drops none) tells the planner how many rows the
    # document holds: it assumes 100 for any jsonb_array_elements, and for a round of a few
    # tasks on a table it has not analysed yet it chose a hash join over a scan of every task
    # (10,000 tasks: 740,000 rows read a second in a steady stream).
    sql = (
        f"UPDATE {table} SET {sets} FROM (SELECT value AS r FROM "
        f"jsonb_array_elements(%s::jsonb) LIMIT {len(rows)}) AS document "
        f"WHERE {where} RETURNING {table}.id"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, [json.dumps(rows, separators=(",", ":"))])
        return {row[0] for row in cursor.fetchall()}


def id_set(ids: Sequence[int], using: str) -> Any:
    """For ``pk__in``: on PostgreSQL one array parameter (``IN (SELECT unnest(…))``, built as
    text in one join), where a list of 500 ids is 500 parameters Django prepares and psycopg
    quotes one by one; elsewhere the list itself."""
    if connections[using].vendor != "postgresql":
        return list(ids)
    from django.db.models.expressions import RawSQL

    text = "{" + ",".join(map(str, map(int, ids))) + "}"
    return RawSQL("SELECT unnest(%s::bigint[])", [text])
