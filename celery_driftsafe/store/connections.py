"""A beat's database connection from one round to the next.

Django's ``close_old_connections()`` ends a connection after every "request" when
``CONN_MAX_AGE`` is 0, its default. A beat's round is no request: closing there made every
round open a new connection (a new PostgreSQL backend, started and warmed up again, a few
milliseconds on the round's path; tens of rounds a second in a steady stream). So between
rounds the beat keeps a connection that still answers, whatever ``CONN_MAX_AGE`` says when it
is 0; a positive age (or ``None``, for ever) is the project's choice and is honoured as Django
does.
"""

from __future__ import annotations

import sqlite3
from contextlib import suppress
from typing import Any

from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.signals import connection_created


def returns_rows(connection: BaseDatabaseWrapper) -> bool:
    """Whether the database has ``UPDATE … RETURNING`` (PostgreSQL, SQLite 3.35+; not MySQL
    or MariaDB): a conditional write that also reads the row it changed, in one statement."""
    return connection.vendor == "postgresql" or (
        connection.vendor == "sqlite" and sqlite3.sqlite_version_info >= (3, 35)
    )


def refresh_between_rounds(alias: str) -> None:
    """Before a round on database ``alias`` (in the thread that runs it): keep its open
    connection if it still answers (one round trip) and its autocommit is as configured, else
    close it so that the round opens a new one; every other database's connection is treated as
    ``close_old_connections()`` does."""
    connection = connections[alias]
    for other in connections.all(initialized_only=True):
        if other is not connection:
            other.close_if_unusable_or_obsolete()
    if connection.connection is None or connection.settings_dict["CONN_MAX_AGE"] != 0:
        connection.close_if_unusable_or_obsolete()
        return
    if connection.get_autocommit() != connection.settings_dict["AUTOCOMMIT"] or not (
        connection.is_usable()
    ):
        connection.close()
        return
    connection.errors_occurred = False
    connection.health_check_done = True  # type: ignore[attr-defined]  # (Django 4.1+)


def order_from_indexes(alias: str) -> None:
    """For the rest of the current transaction on database ``alias``: on PostgreSQL, take the
    rows of an ``ORDER BY … LIMIT`` from an index in that order rather than sorting them.

    The claim and building ahead read the first due tasks by ``(due_at, id)``, which the
    ``(enabled, due_at, id)`` index gives in order. On a task table PostgreSQL has no
    statistics for (autovacuum off, a restored dump, tasks created a moment ago) it planned
    instead to read every due task and sort them: with 100,000 tasks due at one instant a
    20 MB sort on disk, about 90 ms of the server's time a round, where the index takes 1 ms.
    ``SET LOCAL enable_sort = off`` makes a sort the planner's last resort, so these reads do
    not depend on the table's statistics; a statement that can only be answered by sorting
    still sorts. Nothing on other databases, or outside a transaction (where ``SET LOCAL``
    would not last to the next statement)."""
    connection = connections[alias]
    if connection.vendor != "postgresql" or not connection.in_atomic_block:
        return
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_sort = off")


#: MySQL/MariaDB error numbers (mysqlclient gives no SQLSTATE) whose SQLSTATE callers act on:
#: ER_LOCK_DEADLOCK, which InnoDB reports with 40001 and for which it rolled the whole
#: transaction back.
_MYSQL_SQLSTATES = {1213: "40001"}


def sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE of a database error Django raised, from its driver's error: psycopg 3's
    ``sqlstate`` or psycopg 2's ``pgcode``; for mysqlclient, whose errors carry only MySQL's
    error number, the SQLSTATE of the numbers in :data:`_MYSQL_SQLSTATES` (None otherwise, and
    for other drivers)."""
    cause = exc.__cause__
    code = getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)
    if code is None and cause is not None and cause.args and isinstance(cause.args[0], int):
        code = _MYSQL_SQLSTATES.get(cause.args[0])
    return code if isinstance(code, str) else None


def rolled_back(exc: BaseException) -> bool:
    """The database rolled the statement (and its transaction) back for a concurrent
    transaction, SQLSTATE class 40: PostgreSQL's serialization failures and deadlocks, MySQL's
    deadlocks. It changed nothing, and the same statement may be run again."""
    code = sqlstate(exc)
    return code is not None and code.startswith("40")


#: What the databases say of a table or column that is not there: PostgreSQL's SQLSTATEs,
#: MySQL's error numbers, SQLite's messages.
_NO_SCHEMA = ({"42P01", "42703"}, {1146, 1054}, ("no such table", "no such column"))


def missing_schema(exc: BaseException) -> str | None:
    """For a database error naming a table or column that is not there (a process started
    before ``migrate``, or an upgrade's code before its migrations): what to tell the
    operator. None for any other error."""
    cause = exc.__cause__
    sqlstates, numbers, texts = _NO_SCHEMA
    number = cause.args[0] if cause is not None and cause.args else None
    if (
        sqlstate(exc) in sqlstates
        or (isinstance(number, int) and number in numbers)
        or (str(exc).startswith(texts))
    ):
        first = str(exc).splitlines()[0]
        return f"the database lacks celery_driftsafe's tables or columns (run migrate): {first}"
    return None


def read_committed_connections() -> None:
    """In a beat's process (and its claim process): every database connection, the ones open
    now (outside a transaction) and every one opened later, runs its transactions at READ
    COMMITTED, whatever the project's ``OPTIONS["isolation_level"]`` or the server's default.

    The claim, the outbox's marks, heartbeats and reconciliation are short transactions that
    beats and workers run at once on the same rows, written for READ COMMITTED: a locking read
    or an update sees the latest committed row and waits for a holder. At REPEATABLE READ or
    SERIALIZABLE, PostgreSQL refuses such a statement instead ("could not serialize access due
    to concurrent update"), which a beat could only take for an outage. A beat runs no code of
    the project's in a transaction, so its connections can be set so; a worker's are left as
    the project configured them (task bodies run there)."""
    connection_created.connect(_read_committed, dispatch_uid="celery_driftsafe.read_committed")
    for connection in connections.all(initialized_only=True):
        if connection.connection is not None and not connection.in_atomic_block:
            try:
                read_committed(connection)
            except Exception:  # broken (inherited across a fork, say); the driver's own error
                with suppress(Exception):
                    connection.close()  # the next statement opens a new one, set up then


def _read_committed(sender: Any, connection: BaseDatabaseWrapper, **kwargs: Any) -> None:
    read_committed(connection)


def read_committed(connection: BaseDatabaseWrapper) -> None:
    """Set the open ``connection``'s transactions to READ COMMITTED (PostgreSQL, MySQL;
    SQLite has one writer at a time and no such levels). On PostgreSQL the driver's level goes
    into each ``BEGIN`` (as Django's ``OPTIONS`` level does), and the session's default, which
    statements outside a transaction run at, is set only when it is another (a database or
    role default): behind a PgBouncer in transaction pooling a session setting would stay on
    a server connection other clients share (see docs/howto/run-several-beats.md)."""
    if connection.vendor == "postgresql":
        from django.db.backends.postgresql.psycopg_any import IsolationLevel

        level = IsolationLevel.READ_COMMITTED
        connection.isolation_level = level  # type: ignore[attr-defined]
        connection.connection.isolation_level = level
        with connection.cursor() as cursor:
            cursor.execute("SHOW default_transaction_isolation")
            if cursor.fetchone()[0] != "read committed":
                cursor.execute(
                    "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL READ COMMITTED"
                )
    elif connection.vendor == "mysql":
        if connection.isolation_level == "read committed":  # type: ignore[attr-defined]
            return  # Django's own default: its connection set-up has set it already
        with connection.cursor() as cursor:
            cursor.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
        connection.isolation_level = "read committed"  # type: ignore[attr-defined]
