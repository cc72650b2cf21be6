"""The statements every round runs, compiled to SQL once per connection and run again with
new values.

Django compiles a queryset to SQL each time it runs it: 0.3 to 0.6 ms of CPU a statement here,
five of them in every claim round. At moderate load that is most of what a round costs (10,000
tasks a minute fire a slot every 6 ms, a round or two each), and it does not shrink with the
work. These statements keep their SQL per database connection, under a key that names
everything Django writes into the SQL text (the statement, the LIMIT); the values vary and go
as parameters.

A statement is kept only when the parameters Django compiled are exactly the values the caller
says it passes, in that order. Where they are not (another database, whose driver is given
values converted to text; a Django version that writes a value into the SQL or orders the
parameters differently) the statement is compiled every time, as the ORM would.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

from django.db import connections, transaction

from celery_driftsafe.conf import get_settings
from celery_driftsafe.core.stored_names import Optimisation

#: The attribute of a connection wrapper (one per alias and thread, so the statements go with
#: it) that holds key -> (compiler, SQL).
_KEPT = "_driftsafe_kept_statements"


def compiled(
    using: str, key: Hashable | None, values: Sequence[Any], build: Callable[[], Any]
) -> tuple[Any, str, Sequence[Any]]:
    """The compiler, SQL and parameters of the statement ``build()`` makes (a queryset, or a
    query) for ``values``. ``build`` runs only when no SQL is kept for ``key`` on this
    connection: everything but ``values`` must be the same for one key (and their number,
    which is part of the key). A key of None keeps nothing."""
    kept = kept_statements(using)
    if not get_settings().optimised(Optimisation.STATEMENT_CACHE):
        key = None  # compiled each time, as the ORM does
    if key is not None:
        key = (key, len(values))
        entry = kept.get(key)
        if entry is not None:
            return entry[0], entry[1], values
    made = build()
    query = getattr(made, "query", made)
    compiler = query.get_compiler(using=using)
    sql, params = compiler.as_sql()
    if key is not None and list(params) == list(values):
        kept[key] = (compiler, sql)
    return compiler, sql, params


def kept_statements(using: str) -> dict[Hashable, tuple[Any, str]]:
    """The statements kept on this thread's connection ``using``: key -> (compiler, SQL)."""
    connection = connections[using]
    kept: dict[Hashable, tuple[Any, str]] | None = getattr(connection, _KEPT, None)
    if kept is None:
        kept = {}
        setattr(connection, _KEPT, kept)
    return kept


def select_rows(
    using: str, key: Hashable | None, values: Sequence[Any], build: Callable[[], Any]
) -> list[Any]:
    """The rows of the select ``build()`` makes, converted as the ORM converts them (a
    ``values_list`` queryset gives tuples of its columns)."""
    compiler, sql, params = compiled(using, key, values, build)
    with connections[using].cursor() as cursor:
        cursor.execute(sql, params)
        rows = cursor.fetchall()
    return list(compiler.results_iter([rows]))


def update(
    using: str, key: Hashable | None, values: Sequence[Any], build: Callable[[], Any]
) -> int:
    """Run the update ``build()`` makes (see :func:`update_query`); the rows it changed."""
    _, sql, params = compiled(using, key, values, build)
    with transaction.mark_for_rollback_on_error(using), connections[using].cursor() as cursor:
        cursor.execute(sql, params)
        return int(cursor.rowcount)


def update_query(queryset: Any, **changes: Any) -> Any:
    """The query ``queryset.update(**changes)`` runs, unrun (for a queryset without
    annotations in its ordering, which that method would inline)."""
    from django.db.models.sql import UpdateQuery

    query = queryset.query.chain(UpdateQuery)
    query.add_update_values(changes)
    query.clear_select_clause()
    return query
