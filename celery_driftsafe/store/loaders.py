"""psycopg's C loader for ``timestamptz`` when the claim reads its due tasks.

Django's PostgreSQL backend reads every ``timestamptz`` with a loader of its own, written in
Python on top of psycopg's Python implementation, so that it can attach the connection's time
zone: about 4.7 µs a value where psycopg's C loader takes 0.4 µs. A claim round reads seven
instants a task (500 tasks a round in a burst), so this was a tenth of the claim's time. When
the connection's time zone is UTC (Django's setting with ``USE_TZ = True``, which this package
requires, and no ``TIME_ZONE`` of the database's own), both loaders return the same value: an
aware datetime whose ``tzinfo`` is :data:`datetime.timezone.utc` (``tests/test_claim.py``
compares them). :func:`load_models` then runs the queryset's own SQL on a cursor given the C
loader (that cursor only: Django's loader stays the connection's) and builds the instances as
Django's model iterable does (its converters, then ``from_db``); on any other connection
(another time zone, psycopg 2, psycopg without its C extension, another database) it is
``list(queryset)``. ``OPTIMISATIONS_OFF`` ``c_timestamps`` switches the C loader off: the
statement is still the kept one (:mod:`celery_driftsafe.store.statement_cache`), read as
Django reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

from django.db import connections

from celery_driftsafe.conf import get_settings
from celery_driftsafe.core.stored_names import Optimisation
from celery_driftsafe.store.statement_cache import compiled


def c_timestamp_loader() -> type | None:
    """psycopg's C ``timestamptz`` text loader, or None without psycopg 3's C extension."""
    try:
        import psycopg
        from psycopg.pq import Format
    except ImportError:
        return None
    if psycopg.pq.__impl__ not in ("c", "binary"):
        return None
    loader: type | None = psycopg.adapters.get_loader(
        psycopg.postgres.types["timestamptz"].oid, Format.TEXT
    )
    return loader


def _loader_for(connection: Any) -> type | None:
    if connection.vendor != "postgresql" or connection.timezone_name != "UTC":
        return None
    raw = connection.connection
    if raw is None or not hasattr(raw, "adapters"):  # not open, or psycopg 2
        return None
    if raw.info.parameter_status("TimeZone") != "UTC":
        return None
    return c_timestamp_loader()


def read_instants_in_c(connection: Any, cursor: Any) -> None:
    """Give ``cursor`` (a Django cursor of ``connection``) psycopg's C ``timestamptz`` loader
    where that changes no value; otherwise (or with ``c_timestamps`` off) leave it as it is."""
    loader = _loader_for(connection)
    if loader is not None and get_settings().optimised(Optimisation.C_TIMESTAMPS):
        cursor.cursor.adapters.register_loader("timestamptz", loader)


def load_models(queryset: Any) -> list[Any]:
    """The model instances of ``queryset`` (no ``select_related``, no annotations), the same
    as ``list(queryset)``, read with psycopg's C ``timestamptz`` loader where that changes no
    value. Call with the connection open (inside the claim's transaction)."""
    connection = connections[queryset.db]
    loader = _loader_for(connection)
    if loader is None:
        return list(queryset)
    compiler = queryset.query.get_compiler(using=queryset.db)
    sql, params = compiler.as_sql()
    return _read(connection, _timestamps(loader), compiler, sql, params)


def load_kept_models(
    using: str, key: Hashable, values: Sequence[Any], build: Callable[[], Any]
) -> list[Any]:
    """:func:`load_models` of the queryset ``build()`` makes for ``values``, its SQL compiled
    once per connection under ``key`` (:mod:`celery_driftsafe.store.statement_cache`)."""
    connection = connections[using]
    loader = _loader_for(connection)
    if loader is None:
        return list(build())
    return _read(connection, _timestamps(loader), *compiled(using, key, values, build))


def _timestamps(loader: type) -> type | None:
    """The ``timestamptz`` loader a read gives its cursor: ``loader``, or None (Django's) with
    ``c_timestamps`` off."""
    return loader if get_settings().optimised(Optimisation.C_TIMESTAMPS) else None


def _read(
    connection: Any, loader: type | None, compiler: Any, sql: str, params: Sequence[Any]
) -> list[Any]:
    with connection.cursor() as cursor:
        if loader is not None:
            cursor.cursor.adapters.register_loader("timestamptz", loader)
        cursor.execute(sql, params)
        rows = cursor.fetchall()
    info = compiler.klass_info
    assert info is not None and not compiler.annotation_col_map
    start, end = info["select_fields"][0], info["select_fields"][-1] + 1
    names = [column[0].target.attname for column in compiler.select[start:end]]
    model, db = info["model"], connection.alias
    return [model.from_db(db, names, row[start:end]) for row in compiler.results_iter([rows])]
