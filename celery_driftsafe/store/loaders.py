"""psycopg's C loader for ``timestamptz`` when the claim reads its due tasks.

Django's PostgreSQL backend reads every ``timestamptz`` with a loader of its own, written in
Python on top of psycopg's Python implementation, so that it can attach the connection's time
zone: about 4.7 µs a value where psycopg's C loader takes 0.4 µs. A claim round reads seven
instants a task (500 tasks a round in a burst), so this was a tenth of the claim's time. When
the connection's time zone is UTC (Django's setting with ``USE_TZ = True``, which this package
requires, and no ``TIME_ZONE`` of the database's own), both loaders return the same value: an
aware datetime whose ``tzinfo`` is :data:`datetime.timezone.utc` (``tests/claim/test_claim.py``
compares them). :func:`load_models` then runs the queryset's own SQL on a cursor given the C
loader (that cursor only: Django's loader stays the connection's) and builds the instances as
Django's model iterable does (or, where nothing can tell the difference, by setting their
attributes: see :func:`_plain_instances`); on any other connection (another time zone,
psycopg 2, psycopg without its C extension, another database) it is ``list(queryset)``.

Each of the three can be switched off on its own (``OPTIMISATIONS_OFF``): ``c_timestamps``
(the cursor keeps Django's loader), ``plain_instances`` (every instance through ``from_db``),
``json_columns`` (Django's converter for every JSON column); with all three off the statement
is still the kept one (:mod:`celery_driftsafe.store.statement_cache`), read as Django reads it.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from django.db import connections
from django.db.models.base import ModelState

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
    return _read(connection, _Reading.now(loader), compiler, sql, params)


def load_kept_models(
    using: str, key: Hashable, values: Sequence[Any], build: Callable[[], Any]
) -> list[Any]:
    """:func:`load_models` of the queryset ``build()`` makes for ``values``, its SQL compiled
    once per connection under ``key`` (:mod:`celery_driftsafe.store.statement_cache`)."""
    connection = connections[using]
    loader = _loader_for(connection)
    if loader is None:
        return list(build())
    return _read(connection, _Reading.now(loader), *compiled(using, key, values, build))


class _Reading:
    """How one read goes: the ``timestamptz`` loader given to its cursor (None: Django's),
    and whether the JSON columns and the instances take the short ways (the
    ``OPTIMISATIONS_OFF`` names ``c_timestamps``, ``json_columns``, ``plain_instances``, read
    once a read)."""

    __slots__ = ("json", "loader", "plain")

    def __init__(self, loader: type | None, *, json: bool, plain: bool) -> None:
        self.loader, self.json, self.plain = loader, json, plain

    @classmethod
    def now(cls, loader: type) -> _Reading:
        settings = get_settings()
        return cls(
            loader if settings.optimised(Optimisation.C_TIMESTAMPS) else None,
            json=settings.optimised(Optimisation.JSON_COLUMNS),
            plain=settings.optimised(Optimisation.PLAIN_INSTANCES),
        )


def _read(
    connection: Any, reading: _Reading, compiler: Any, sql: str, params: Sequence[Any]
) -> list[Any]:
    with connection.cursor() as cursor:
        if reading.loader is not None:
            cursor.cursor.adapters.register_loader("timestamptz", reading.loader)
        cursor.execute(sql, params)
        rows = cursor.fetchall()
    info = compiler.klass_info
    assert info is not None and not compiler.annotation_col_map
    start, end = info["select_fields"][0], info["select_fields"][-1] + 1
    names = [column[0].target.attname for column in compiler.select[start:end]]
    model, db = info["model"], connection.alias
    converted = _converted(compiler, rows) if reading.json else compiler.results_iter([rows])
    values = [row[start:end] for row in converted]
    if not (reading.plain and _plain_instances(model, tuple(names))):
        return [model.from_db(db, names, row) for row in values]
    # What from_db and Model.__init__ leave for a full row, without their per-field loop
    # (a third of reading a task): the state, then each field's value under its attname,
    # then what the model's own from_db adds to Django's (FROM_DB_THEN).
    new, instances = model.__new__, []
    then = getattr(model, FROM_DB_THEN, None)
    for row in values:
        instance = new(model)
        state = instance._state = ModelState()
        state.adding, state.db = False, db
        instance.__dict__.update(zip(names, row, strict=True))
        if then is not None:
            then(instance)
        instances.append(instance)
    return instances


#: JSON texts a task's arguments and options mostly are, and what each reads as (a new one).
_EMPTY_JSON: dict[str, Callable[[], Any]] = {"[]": list, "{}": dict}


def _json(value: Any) -> Any:
    """What Django's ``JSONField.from_db_value`` gives for a column's text (its decoder being
    ``json``'s): the commonest texts without parsing them."""
    if value is None:
        return None
    empty = _EMPTY_JSON.get(value)
    if empty is not None:
        return empty()
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def _converted(compiler: Any, rows: Sequence[Any]) -> list[list[Any]]:
    """``compiler.results_iter([rows])``: Django's converters applied to each column that has
    them, but a plain ``JSONField``'s (no decoder of the project's) replaced by :func:`_json`,
    which gives the same values. Django's conversion of the three JSON columns was a tenth of
    reading a task."""
    from django.db.models import JSONField

    fields = [column[0] for column in compiler.select[0 : compiler.col_count]]
    if compiler.has_composite_fields(fields):
        return list(compiler.results_iter([rows]))
    plan: list[tuple[int, Any, Any]] = []
    for position, (converters, expression) in compiler.get_converters(fields).items():
        field = getattr(converters[0], "__self__", None) if len(converters) == 1 else None
        plain_json = (
            type(field) is JSONField
            and field.decoder is None
            and converters[0].__func__ is JSONField.from_db_value
        )
        plan.append((position, None if plain_json else converters, expression))
    connection, converted = compiler.connection, []
    for row in map(list, rows):
        for position, converters, expression in plan:
            value = row[position]
            if converters is None:
                row[position] = _json(value)
                continue
            for converter in converters:
                value = converter(value, expression, connection)
            row[position] = value
        converted.append(row)
    return converted


#: The attribute by which a model says that its ``from_db`` is Django's followed by a call of
#: one method of the new instance (the attribute's value): instances built here get it too.
FROM_DB_THEN = "from_db_then"


def _plain_instances(model: Any, names: tuple[str, ...]) -> bool:
    """Whether an instance of ``model`` read with every concrete field (``names``) can be
    built by setting its attributes: ``from_db`` is Django's (or Django's followed by the
    method the model names in ``FROM_DB_THEN``) and ``__init__`` is too, no receiver
    listens to ``pre_init``/``post_init`` for it, and no field's attribute is a descriptor
    that does more than read the instance's ``__dict__`` (a foreign key's is). Only on the
    Django versions whose ``from_db`` this was compared with (up to 5.2; later ones may keep
    more state on the instance)."""
    from django.db.models import signals

    return (
        not signals.pre_init.has_listeners(model)
        and not signals.post_init.has_listeners(model)
        and _plain_class(model, names)
    )


@functools.lru_cache(maxsize=8)
def _plain_class(model: Any, names: tuple[str, ...]) -> bool:
    """The part of :func:`_plain_instances` that a model class settles once (receivers may
    come and go)."""
    import django
    from django.db.models import Model
    from django.db.models.query_utils import DeferredAttribute

    from_db = inspect.getattr_static(model, "from_db")
    return (
        django.VERSION[:2] <= (5, 2)
        and (
            from_db is inspect.getattr_static(Model, "from_db")
            or callable(getattr(model, FROM_DB_THEN, None))
        )
        and model.__init__ is Model.__init__
        and names == tuple(field.attname for field in model._meta.concrete_fields)
        and all(
            type(inspect.getattr_static(model, name, None)) is DeferredAttribute for name in names
        )
    )
