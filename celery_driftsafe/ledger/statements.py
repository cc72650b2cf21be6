"""How the run ledger's statements run (:class:`Statements`, the base of
:class:`~celery_driftsafe.ledger.run_ledger.Ledger`): one plain SQL statement on Django's
connection, run
again when the database rolled it back for a concurrent update, and an unreachable or
unmigrated database turned into :class:`~celery_driftsafe.exceptions.LedgerUnavailable`."""

from __future__ import annotations

import logging
import sqlite3
from datetime import datetime
from typing import Any

from celery_driftsafe.exceptions import LedgerUnavailable
from celery_driftsafe.store.connections import missing_schema, rolled_back

logger = logging.getLogger("celery_driftsafe.ledger")

#: Times a ledger statement the database rolled back for a concurrent update is run again.
ROLLED_BACK_RETRIES = 3


class Statements:
    """The connection, the quoted table names and the statement runners."""

    def __init__(self) -> None:
        from django.db import connection

        from celery_driftsafe.models import PeriodicTask, Run, RunAttempt

        self.connection = connection
        quote = connection.ops.quote_name
        self.runs = quote(Run._meta.db_table)
        self.tasks = quote(PeriodicTask._meta.db_table)
        self.attempts = quote(RunAttempt._meta.db_table)
        #: UPDATE … RETURNING (PostgreSQL, SQLite 3.35+): the start checks and reads at once.
        self.can_return = connection.vendor == "postgresql" or (
            connection.vendor == "sqlite" and sqlite3.sqlite_version_info >= (3, 35)
        )

    def _execute(self, sql: str, params: list[Any], *, fetch: bool) -> Any:
        """Run one statement. Outside a transaction a statement the database rolled back for a
        concurrent update (SQLSTATE class 40: a serialization failure, a deadlock) is run
        again, at most :data:`ROLLED_BACK_RETRIES` times: it changed nothing. PostgreSQL does
        so where the project's database defaults to REPEATABLE READ or SERIALIZABLE, when a
        beat's mark of the same run commits under it (at READ COMMITTED it would have waited
        and gone on); InnoDB when it picks the statement as a deadlock's victim."""
        from django.db import DatabaseError

        for tries_left in range(ROLLED_BACK_RETRIES, -1, -1):
            try:
                with self.connection.cursor() as cursor:
                    cursor.execute(sql, params)
                    return cursor.fetchone() if fetch else int(cursor.rowcount)
            except DatabaseError as exc:
                why = missing_schema(exc) or f"database unreachable: {exc}"
                if self.connection.in_atomic_block:
                    raise LedgerUnavailable(why) from exc
                if tries_left and rolled_back(exc):
                    logger.debug("ledger statement rolled back (%s); running it again", exc)
                    continue
                self.connection.close()  # the next statement reconnects
                raise LedgerUnavailable(why) from exc
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
