"""The run ledger's statements on a worker's path, as plain SQL: this is the per-execution hot
path, where compiling ORM queries would cost more than the round trips.

Every write is conditional on what the writer may change: a start on the run still waiting (or,
for a lock holder, started by a holder that locks in the same place and may be dead) and on a
fencing token below the writer's; an outcome on the writer's own token; an early end (expired,
revoked, skipped) on a run nobody started. So a writer that lost the run changes nothing.

Each statement is one plain SQL statement on Django's connection, run again when the database
rolled it back for a concurrent update; an unreachable or unmigrated database is a
:class:`~celery_driftsafe.exceptions.LedgerUnavailable`. Writes that must not land one without
the other (an attempt's end and its row) share a transaction (:meth:`Ledger.together`).

Status names are spelled out (not imported from the models): a Celery app module imports
:mod:`celery_driftsafe.task` before Django's app registry is ready.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

from celery_driftsafe.core.stored_names import PRE_START, TAKEN_OVER
from celery_driftsafe.exceptions import LedgerUnavailable
from celery_driftsafe.store.connections import missing_schema, returns_rows, rolled_back

logger = logging.getLogger("celery_driftsafe.ledger")

#: Times a ledger statement the database rolled back for a concurrent update is run again.
ROLLED_BACK_RETRIES = 3

#: A message may write its run only when it is the run's own: the run's Celery task id is the
#: message's (a run that never recorded one, ``''``, is judged by its other columns). The one
#: condition of the body's start and of every outcome recorded beside the body.
OWN_MESSAGE = "(celery_task_id = '' OR celery_task_id = %s)"

#: Appended to ``worker`` when a run was started without a lock (eager mode, ``fail_open``):
#: such a start is never taken over by a lock holder, who cannot know whether it still runs.
UNLOCKED = " (no lock)"

#: How a run's end is written (two parameters: its error, then its status): a run another run
#: replaced while it ran (overlap policy ``replace``) ends ``revoked``, with the reason the
#: replacement wrote (:meth:`Ledger.replace_running`), whatever its body did and whenever its
#: end comes. (``error`` first: MySQL assigns left to right.)
REPLACED_END = (
    "error = CASE WHEN replaced_by IS NULL THEN %s ELSE error END, "
    "status = CASE WHEN replaced_by IS NULL THEN %s ELSE 'revoked' END"
)

T = TypeVar("T")


@dataclass(frozen=True)
class RunRow:
    status: str
    task_name: str
    celery_task_id: str
    periodic_task_id: int | None
    overlap_policy: str | None
    fencing_token: int
    attempt: int
    expires_at: datetime | None
    #: Where the worker that started the run locks (:func:`~celery_driftsafe.locks.lock_identity`);
    #: None: not started by a lock holder of this version.
    lock_store: str | None = None
    #: Until when its worker holds its lease in the ledger (renewed with its lock); None:
    #: not recorded (judged by the lock alone).
    lease_until: datetime | None = None
    #: ``scheduled``, ``manual`` (both made for a periodic task) or ``adhoc``.
    kind: str = ""

    @property
    def task_deleted(self) -> bool:
        """Whether the run was made for a periodic task deleted since (its link set null)."""
        return self.periodic_task_id is None and self.kind != "adhoc"


@dataclass(frozen=True)
class Start:
    """A start of ``attempt`` of run ``run_id`` at ``now`` by ``worker``, under ``token``: a
    lock's, taken in ``store``, its lease in the ledger until ``lease_until``; or, without a
    lock (``store`` None: eager calls, ``fail_open``, a publisher locking elsewhere), the run's
    own token one up, read with the run before.

    ``task``, ``task_id`` and ``periodic_task_id`` are what the delivery's message says the
    run is (its task's name, its Celery task id, the periodic task it was claimed for); the
    start is refused when the run is another (None: not checked)."""

    run_id: int
    token: int
    now: datetime
    worker: str
    attempt: int
    store: str | None
    lease_until: datetime | None = None
    task: str | None = None
    task_id: str | None = None
    periodic_task_id: int | None = None


@dataclass(frozen=True)
class Started:
    """What a start read of the run it started: its periodic task and that task's overlap
    policy (None: no periodic task), and whether the run had been started before (taken over
    from a worker that was lost: its ``error`` says so until it ends)."""

    periodic_task_id: int | None
    overlap_policy: str | None
    took_over: bool


def _aware(value: Any) -> datetime | None:
    """A datetime column as read by a raw cursor (SQLite gives text), aware UTC."""
    if value is None:
        return None
    if isinstance(value, str):
        from django.utils.dateparse import parse_datetime

        parsed = parse_datetime(value)
        if parsed is None:
            raise ValueError(f"unreadable instant {value!r} in the run ledger")
        value = parsed
    assert isinstance(value, datetime)
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def _unavailable(exc: BaseException) -> str:
    """Why a ledger statement failed: the schema missing (run migrate), or the database away."""
    return missing_schema(exc) or f"database unreachable: {exc}"


class Ledger:
    """The run ledger as a worker writes it: the connection, the quoted table names, the
    statements, and the runner of each (:meth:`_execute`)."""

    def __init__(self) -> None:
        from django.db import connection

        from celery_driftsafe.models import PeriodicTask, Run, RunAttempt

        self.connection = connection
        quote = connection.ops.quote_name
        self.runs = quote(Run._meta.db_table)
        self.tasks = quote(PeriodicTask._meta.db_table)
        self.attempts = quote(RunAttempt._meta.db_table)
        #: UPDATE … RETURNING (PostgreSQL, SQLite 3.35+): the start checks and reads at once.
        self.can_return = returns_rows(connection)
        self._pre_start = ", ".join(f"'{status}'" for status in PRE_START)

    def _execute(self, sql: str, params: list[Any], *, fetch: bool, many: bool = False) -> Any:
        """Run one statement. Outside a transaction a statement the database rolled back for a
        concurrent update (SQLSTATE class 40: a serialization failure, a deadlock) is run
        again, at most :data:`ROLLED_BACK_RETRIES` times: it changed nothing. PostgreSQL does
        so where the project's database defaults to REPEATABLE READ or SERIALIZABLE, when a
        beat's mark of the same run commits under it (at READ COMMITTED it would have waited
        and gone on); InnoDB when it picks the statement as a deadlock's victim."""
        from django.db import DatabaseError, IntegrityError

        for tries_left in range(ROLLED_BACK_RETRIES, -1, -1):
            try:
                with self.connection.cursor() as cursor:
                    cursor.execute(sql, params)
                    if fetch:
                        return cursor.fetchall() if many else cursor.fetchone()
                    return int(cursor.rowcount)
            except IntegrityError as exc:
                raise LedgerUnavailable(f"database refused the statement: {exc}") from exc
            except DatabaseError as exc:
                why = _unavailable(exc)
                if self.connection.in_atomic_block:
                    raise LedgerUnavailable(why) from exc
                if tries_left and rolled_back(exc):
                    logger.debug("ledger statement rolled back (%s); running it again", exc)
                    continue
                self.connection.close()  # the next statement reconnects
                raise LedgerUnavailable(why) from exc
        raise AssertionError("unreachable")

    def together(self, write: Callable[[], T]) -> T:
        """``write()``'s statements in one transaction: they stand or fall together (a run's
        outcome and its attempt's row, say: never one without the other). A database error in
        it, or at its commit, is a :class:`LedgerUnavailable`, and none of them was written;
        a transaction the database rolled back for a concurrent one is run again, as a single
        statement is (:meth:`_execute`)."""
        from django.db import DatabaseError, transaction

        for tries_left in range(ROLLED_BACK_RETRIES, -1, -1):
            again = tries_left > 0 and not self.connection.in_atomic_block  # not the caller's
            try:
                with transaction.atomic():
                    return write()
            except LedgerUnavailable as exc:  # a ledger statement's: its cause says why
                cause = exc.__cause__
                if not (again and cause is not None and rolled_back(cause)):
                    raise
            except DatabaseError as exc:  # the commit's, or a statement of ``write``'s own
                if not (again and rolled_back(exc)):
                    raise LedgerUnavailable(_unavailable(exc)) from exc
                cause = exc
            logger.debug("ledger transaction rolled back (%s); running it again", cause)
        raise AssertionError("unreachable")

    def _write(self, sql: str, params: list[Any]) -> int:
        """Rows changed."""
        changed: int = self._execute(sql, params, fetch=False)
        return changed

    def _fetch(self, sql: str, params: list[Any]) -> tuple[Any, ...] | None:
        """The first row."""
        row: tuple[Any, ...] | None = self._execute(sql, params, fetch=True)
        return row

    def _at(self, instant: datetime) -> Any:
        return self.connection.ops.adapt_datetimefield_value(instant)

    def load(self, run_id: int) -> RunRow | None:
        row = self._fetch(
            f"SELECT r.status, r.task_name, r.celery_task_id, r.periodic_task_id, "
            f"t.overlap_policy, r.fencing_token, r.attempt, r.expires_at, r.lock_store, "
            f"r.lease_until, r.kind "
            f"FROM {self.runs} r "
            f"LEFT JOIN {self.tasks} t ON t.id = r.periodic_task_id WHERE r.id = %s",
            [run_id],
        )
        if row is None:
            return None
        (
            status,
            name,
            task_id,
            periodic_task,
            overlap,
            token,
            attempt,
            expires,
            store,
            lease,
            kind,
        ) = row
        return RunRow(
            status,
            name,
            task_id,
            periodic_task,
            overlap,
            int(token),
            int(attempt),
            _aware(expires),
            store,
            _aware(lease),
            kind,
        )

    def start(self, start: Start) -> Started | None:
        """Start the run: the one statement every start is (with a lock or without, the run
        read before or not). None when refused (:meth:`load` says why). A run another one
        replaced (overlap policy ``replace``) never starts again.

        It starts a run that is not started yet (claimed, dispatched, retrying, waiting) and
        whose fencing token is below ``start.token``, at an attempt up to ``start.attempt``,
        that is the message's run (``start.task``, ``task_id``, ``periodic_task_id``; a run
        whose periodic task was deleted since counts as that task's), and whose
        ``expires_at`` has not passed. A lock holder (``start.store`` set) also takes over a
        run started by a holder locking in that store (or by an earlier version, which did not
        record where) whose lease is over, both in the ledger and by the holder's own lock: a
        holder locking elsewhere may still hold its lock, nobody here can tell, and a run
        started without a lock is never taken over (nothing tells whether it still runs).

        Where the database returns what it updated (PostgreSQL, SQLite 3.35+) the statement
        reads the :class:`Started` at once; elsewhere a read follows it."""
        at = self._at(start.now)
        locked = start.store is not None
        worker = start.worker if locked else start.worker + UNLOCKED
        lease = None if start.lease_until is None else self._at(start.lease_until)
        # (``error`` first: MySQL assigns left to right, and the CASE reads the old status)
        sql = (
            f"UPDATE {self.runs} SET error = CASE WHEN status = 'started' THEN %s ELSE '' END, "
            "status = 'started', started_at = %s, fencing_token = %s, worker = %s, "
            "attempt = %s, lock_store = %s, lease_until = %s "
            "WHERE id = %s AND fencing_token < %s AND attempt <= %s "
            f"AND (status IN ({self._pre_start}) OR (%s AND status = 'started' "
            "AND worker NOT LIKE %s AND (lock_store IS NULL OR lock_store = %s) "
            "AND (lease_until IS NULL OR lease_until <= %s))) "
            "AND (%s IS NULL OR task_name = %s) "
            f"AND (%s IS NULL OR {OWN_MESSAGE}) "
            "AND (%s IS NULL OR periodic_task_id = %s "
            "OR (periodic_task_id IS NULL AND kind <> 'adhoc')) "
            "AND (expires_at IS NULL OR expires_at > %s OR status = 'started') "
            "AND replaced_by IS NULL"
        )
        params = [
            TAKEN_OVER,
            at,
            start.token,
            worker,
            start.attempt,
            start.store,
            lease,
            start.run_id,
            start.token,
            start.attempt,
            locked,
            f"%{UNLOCKED}",
            start.store,
            at,
            start.task,
            start.task,
            start.task_id,
            start.task_id,
            start.periodic_task_id,
            start.periodic_task_id,
            at,
        ]
        read = (
            f"periodic_task_id, (SELECT t.overlap_policy FROM {self.tasks} t "
            f"WHERE t.id = {self.runs}.periodic_task_id), error"
        )
        if self.can_return:
            row = self._fetch(f"{sql} RETURNING {read}", params)
        elif self._write(sql, params) == 1:
            row = self._fetch(f"SELECT {read} FROM {self.runs} WHERE id = %s", [start.run_id])
        else:
            row = None
        if row is None:
            return None
        return Started(row[0], row[1], row[2] == TAKEN_OVER)

    def renew_lease(self, run_id: int, token: int, until: datetime) -> bool:
        """The started run's worker, still holding its lock under ``token``, keeps its lease
        in the ledger until ``until``."""
        return (
            self._write(
                f"UPDATE {self.runs} SET lease_until = %s "
                f"WHERE id = %s AND fencing_token = %s AND status = 'started'",
                [self._at(until), run_id, token],
            )
            == 1
        )

    def other_running(
        self,
        periodic_task_id: int,
        run_id: int,
        now: datetime,
        *,
        starts_at: datetime | None = None,
        locks_seen: bool = True,
    ) -> bool:
        """Whether another run of the periodic task runs, by the ledger: it is ``started``
        and its worker was not lost (its lease in the ledger lasts at ``now``). A run
        started without a lock counts whatever else: it has no lease, and its start was
        written only once its worker had decided to run it. A run started by a lock holder
        that recorded no lease (an earlier version) is judged by its lock: it counts only
        when the caller sees no locks (``locks_seen`` False).

        ``starts_at``: this run starts (or started) then; only runs started before it count
        (or at it, with a smaller id), so of two runs started at once one comes first. None:
        this run does not start now, and every started run counts."""
        sql = (
            f"SELECT 1 FROM {self.runs} WHERE periodic_task_id = %s AND status = 'started' "
            "AND id <> %s AND ((lease_until IS NULL AND worker LIKE %s) OR ("
            "(lease_until > %s OR (lease_until IS NULL AND %s))"
        )
        params: list[Any] = [
            periodic_task_id,
            run_id,
            f"%{UNLOCKED}",
            self._at(now),
            not locks_seen,
        ]
        if starts_at is not None:
            sql += " AND (started_at < %s OR (started_at = %s AND id < %s))"
            params += [self._at(starts_at), self._at(starts_at), run_id]
        return self._fetch(sql + "))", params) is not None

    def others_waiting(self, periodic_task_id: int, run_id: int) -> bool:
        """Whether another run of the periodic task waits (overlap policy ``buffer_all``: a
        run that finds the task's running lock free while others wait queues behind them)."""
        sql = (
            f"SELECT 1 FROM {self.runs} WHERE periodic_task_id = %s AND status = 'waiting' "
            "AND id <> %s"
        )
        return self._fetch(sql, [periodic_task_id, run_id]) is not None

    def later_running(
        self, periodic_task_id: int, run_id: int, slot: datetime, now: datetime
    ) -> bool:
        """Overlap policy ``replace``: whether a run of a slot after ``slot`` runs (started,
        its worker's lease lasting or not recorded): an earlier slot does not replace it."""
        return (
            self._fetch(
                f"SELECT 1 FROM {self.runs} WHERE periodic_task_id = %s AND id <> %s "
                "AND status = 'started' AND slot > %s "
                "AND (lease_until IS NULL OR lease_until > %s)",
                [periodic_task_id, run_id, self._at(slot), self._at(now)],
            )
            is not None
        )

    def replace_running(
        self, periodic_task_id: int, run_id: int, now: datetime, why: str
    ) -> list[str]:
        """Overlap policy ``replace``: run ``run_id`` replaces the task's running runs (started,
        and their worker's lease in the ledger lasting or not recorded): each is marked
        replaced by it (``replaced_by``, ``why`` as its error; a run an earlier replacement
        marked is marked again, by the later one), one conditional update a run, on its still
        being started, so a run that ended meanwhile keeps its own outcome. From then on it
        ends ``revoked`` whatever its body does (:data:`REPLACED_END`), and neither retries
        nor starts again. Returns the Celery task ids of the runs marked, to revoke."""
        rows = self._execute(
            f"SELECT id, celery_task_id FROM {self.runs} WHERE periodic_task_id = %s "
            "AND status = 'started' AND id <> %s AND (lease_until IS NULL OR lease_until > %s)",
            [periodic_task_id, run_id, self._at(now)],
            fetch=True,
            many=True,
        )
        marked = []
        for other, task_id in rows:
            if self._write(
                f"UPDATE {self.runs} SET replaced_by = %s, error = %s "
                "WHERE id = %s AND status = 'started' "
                "AND (replaced_by IS NULL OR replaced_by < %s)",
                [run_id, why, other, run_id],
            ):
                marked.append(str(task_id or ""))
        return [task_id for task_id in marked if task_id]

    def revoke_pending(
        self,
        periodic_task_id: int,
        run_id: int,
        statuses: tuple[str, ...],
        now: datetime,
        why: str,
        *,
        before: datetime | None = None,
        kind: str | None = None,
    ) -> int:
        """Overlap policy ``replace``: the task's other runs in ``statuses`` (``retrying``:
        between two attempts; ``waiting``, ``claimed``, ``dispatched``: an earlier slot's run
        not started yet, a replacement released to run next among them), of a slot before
        ``before`` (None: any) and of ``kind`` (None: any), end ``revoked`` with ``why``: run
        ``run_id`` replaces them, and their next delivery finds them finished (and passes on
        the running lock handed to it). Rows changed."""
        marks = ", ".join(["%s"] * len(statuses))
        sql = (
            f"UPDATE {self.runs} SET status = 'revoked', finished_at = %s, error = %s "
            f"WHERE periodic_task_id = %s AND id <> %s AND status IN ({marks})"
        )
        params: list[Any] = [self._at(now), why, periodic_task_id, run_id, *statuses]
        if before is not None:
            sql += " AND slot < %s"
            params.append(self._at(before))
        if kind is not None:
            sql += " AND kind = %s"
            params.append(kind)
        return self._write(sql, params)

    def replaced_by(self, run_id: int) -> int | None:
        """The run that replaced run ``run_id`` (overlap policy ``replace``); None: none."""
        row = self._fetch(f"SELECT replaced_by FROM {self.runs} WHERE id = %s", [run_id])
        return None if row is None or row[0] is None else int(row[0])

    def wait(
        self,
        run_id: int,
        token: int,
        periodic_task_id: int,
        why: str,
        *,
        store: str,
        started: bool,
        limit: int = 1,
    ) -> bool:
        """Overlap policies ``buffer_one`` and ``buffer_all``: the run, whose delivery holds
        its lock under ``token``, waits for the task's running run (``waiting``, with ``why``;
        ``store``: where that run's running lock is, for a beat to look), unless ``limit``
        other runs of the task wait already (False). ``started``: the delivery started it (the
        fast path), under that very token; else it is not started, and its token is below.

        The database decides between deliveries that try at once: the statement runs holding
        the task's row (:meth:`_holding_task`), so the second of two waits for the first to
        commit and then counts its waiting run (a claim of the task in that instant skips it
        for a round, or waits for it). SQLite, which writes one transaction at a time, counts
        under its write lock."""
        if started:
            mine = "fencing_token = %s AND status = 'started'"
        else:
            mine = f"fencing_token < %s AND status IN ({self._pre_start})"
        # (the inner SELECT in a derived table: MySQL cannot read the table it updates)
        sql = (
            f"UPDATE {self.runs} SET status = 'waiting', error = %s, fencing_token = %s, "
            f"lock_store = %s, started_at = NULL, lease_until = NULL, worker = '' "
            f"WHERE id = %s AND {mine} "
            f"AND (SELECT COUNT(*) FROM (SELECT id FROM {self.runs} "
            f"WHERE periodic_task_id = %s AND status = 'waiting' AND id <> %s) AS other) < %s"
        )
        params = [why, token, store, run_id, token, periodic_task_id, run_id, limit]
        if self.connection.vendor == "sqlite":
            changed: int = self._execute(sql, params, fetch=False)
            return changed == 1
        return self._holding_task(periodic_task_id, sql, params) == 1

    def _holding_task(self, periodic_task_id: int, sql: str, params: list[Any]) -> int:
        """Rows ``sql`` changed, run in a transaction that first locks the task's row (a
        task deleted meanwhile has none to lock: the statement then runs alone); rolled back
        for a deadlock, it is run again (:meth:`together`)."""

        def holding() -> int:
            with self.connection.cursor() as cursor:
                cursor.execute(
                    f"SELECT id FROM {self.tasks} WHERE id = %s FOR UPDATE", [periodic_task_id]
                )
                cursor.execute(sql, params)
                return int(cursor.rowcount)

        return self.together(holding)

    def finish(self, run_id: int, token: int, status: str, now: datetime, error: str) -> bool:
        """Record the outcome under ``token``; a run another one replaced meanwhile (overlap
        policy ``replace``) ends ``revoked`` instead, keeping the reason that names its
        replacement (:data:`REPLACED_END`)."""
        return (
            self._write(
                f"UPDATE {self.runs} SET {REPLACED_END}, finished_at = %s "
                f"WHERE id = %s AND fencing_token = %s",
                [error, status, self._at(now), run_id, token],
            )
            == 1
        )

    def hand_over(self, run_id: int, token: int, next_attempt: int, error: str) -> bool:
        """The attempt under ``token`` ends in a retry: the run waits for ``next_attempt``.
        Refused for a run another one replaced (overlap policy ``replace``): its retry does
        not come back."""
        return (
            self._write(
                f"UPDATE {self.runs} SET status = 'retrying', attempt = %s, error = %s "
                f"WHERE id = %s AND fencing_token = %s AND status = 'started' "
                "AND replaced_by IS NULL",
                [next_attempt, error, run_id, token],
            )
            == 1
        )

    def requeue(self, run_id: int, token: int, error: str) -> bool:
        """The attempt under ``token`` gave its message back (``Reject(requeue=True)``);
        refused for a replaced run, as a retry is."""
        return (
            self._write(
                f"UPDATE {self.runs} SET status = 'dispatched', error = %s "
                f"WHERE id = %s AND fencing_token = %s AND status = 'started' "
                "AND replaced_by IS NULL",
                [error, run_id, token],
            )
            == 1
        )

    def end_waiting(
        self,
        run_id: int,
        status: str,
        now: datetime,
        error: str,
        *,
        token: int | None = None,
        task_id: str | None = None,
    ) -> bool:
        """End a run nobody started (expired, skipped, revoked); with ``token``, also record
        that token (a lock holder's decision); with ``task_id``, only a run that message is
        for (:data:`OWN_MESSAGE`)."""
        sql = f"UPDATE {self.runs} SET status = %s, finished_at = %s, error = %s"
        params: list[Any] = [status, self._at(now), error]
        if token is not None:
            sql += ", fencing_token = %s"
            params.append(token)
        sql += f" WHERE id = %s AND status IN ({self._pre_start})"
        params.append(run_id)
        if task_id is not None:
            sql += f" AND {OWN_MESSAGE}"
            params.append(task_id)
        if token is not None:
            sql += " AND fencing_token < %s"
            params.append(token)
        return self._write(sql, params) == 1

    def end_by_worker(
        self,
        run_id: int,
        task_id: str,
        attempt: int,
        worker: str,
        status: str,
        now: datetime,
        error: str,
    ) -> bool:
        """End ``attempt`` of a run from the worker's main process (hard time limit, a lost
        pool process, a terminating revoke): waiting, or started by that worker, and the
        run of the message ``task_id`` (:data:`OWN_MESSAGE`). A replaced run ends ``revoked``
        with the reason naming its replacement (:data:`REPLACED_END`)."""
        return (
            self._write(
                f"UPDATE {self.runs} SET {REPLACED_END}, finished_at = %s "
                f"WHERE id = %s AND {OWN_MESSAGE} AND attempt = %s "
                f"AND (status IN ({self._pre_start}) "
                f"OR (status = 'started' AND worker IN (%s, %s)))",
                [
                    error,
                    status,
                    self._at(now),
                    run_id,
                    task_id,
                    attempt,
                    worker,
                    worker + UNLOCKED,
                ],
            )
            == 1
        )

    def end_plain(
        self,
        run_id: int,
        task_name: str,
        task_id: str,
        attempt: int,
        worker: str,
        status: str,
        started_at: datetime | None,
        finished_at: datetime,
        error: str,
    ) -> bool:
        """Record the outcome of a plain task's body (no base class, no lock, no token): only
        a waiting run of that task, of the message ``task_id`` (:data:`OWN_MESSAGE`), at that
        attempt or an earlier one, takes it."""
        return (
            self._write(
                f"UPDATE {self.runs} SET status = %s, started_at = %s, finished_at = %s, "
                f"worker = %s, attempt = %s, error = %s WHERE id = %s AND task_name = %s "
                f"AND {OWN_MESSAGE} AND attempt <= %s AND status IN ({self._pre_start})",
                [
                    status,
                    None if started_at is None else self._at(started_at),
                    self._at(finished_at),
                    worker,
                    attempt,
                    error,
                    run_id,
                    task_name,
                    task_id,
                    attempt,
                ],
            )
            == 1
        )

    def note(self, run_id: int, error: str) -> None:
        """Say on a waiting run why it is still waiting."""
        self._write(
            f"UPDATE {self.runs} SET error = %s WHERE id = %s AND status IN ({self._pre_start})",
            [error, run_id],
        )

    def count_duplicate(self, run_id: int) -> None:
        self._write(
            f"UPDATE {self.runs} SET duplicate_deliveries = duplicate_deliveries + 1 WHERE id = %s",
            [run_id],
        )

    def record_attempt(
        self,
        run_id: int,
        number: int,
        outcome: str,
        worker: str,
        started_at: datetime | None,
        finished_at: datetime,
        token: int,
        error: str,
    ) -> None:
        """Keep ``number`` of a run that has more than one attempt (idempotent)."""
        from django.db import IntegrityError, transaction

        from celery_driftsafe.models import RunAttempt

        try:
            with transaction.atomic():
                RunAttempt.objects.create(
                    run_id=run_id,
                    number=number,
                    outcome=outcome,
                    worker=worker,
                    started_at=started_at,
                    finished_at=finished_at,
                    fencing_token=token,
                    error=error,
                )
        except IntegrityError:  # a taken-over attempt of the same number: keep the newer
            RunAttempt.objects.filter(run_id=run_id, number=number).update(
                outcome=outcome,
                worker=worker,
                started_at=started_at,
                finished_at=finished_at,
                fencing_token=token,
                error=error,
            )
