"""Migration operations that build and drop indexes without blocking a busy ledger.

On PostgreSQL, ``CREATE INDEX CONCURRENTLY`` and ``DROP INDEX CONCURRENTLY``: beats keep
claiming while an index of a table with millions of runs is built. A migration using them must
not be atomic. Other databases get the plain operations.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.db import migrations


def _concurrently(schema_editor: Any) -> dict[str, bool]:
    return {"concurrently": True} if schema_editor.connection.vendor == "postgresql" else {}


class AddIndexConcurrently(migrations.AddIndex):
    """``AddIndex``, built without blocking writes on PostgreSQL; plain elsewhere."""

    def database_forwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        model = to_state.apps.get_model(app_label, self.model_name)
        if self.allow_migrate_model(schema_editor.connection.alias, model):
            schema_editor.add_index(model, self.index, **_concurrently(schema_editor))

    def database_backwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        model = from_state.apps.get_model(app_label, self.model_name)
        if self.allow_migrate_model(schema_editor.connection.alias, model):
            schema_editor.remove_index(model, self.index, **_concurrently(schema_editor))


class RemoveIndexConcurrently(migrations.RemoveIndex):
    """``RemoveIndex``, dropped without blocking writes on PostgreSQL; plain elsewhere."""

    def database_forwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        model = from_state.apps.get_model(app_label, self.model_name)
        if self.allow_migrate_model(schema_editor.connection.alias, model):
            index = from_state.models[app_label, self.model_name_lower].get_index_by_name(self.name)
            schema_editor.remove_index(model, index, **_concurrently(schema_editor))

    def database_backwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        model = to_state.apps.get_model(app_label, self.model_name)
        if self.allow_migrate_model(schema_editor.connection.alias, model):
            index = to_state.models[app_label, self.model_name_lower].get_index_by_name(self.name)
            schema_editor.add_index(model, index, **_concurrently(schema_editor))


class UniqueWhereSet(migrations.AlterField):
    """``AlterField`` from ``unique=True`` to a plain field whose values stay unique where set:
    one unique index, ``index``, over the rows where the column is not NULL, so a row without a
    value adds no entry to it (nor, on PostgreSQL, to the LIKE twin ``unique=True`` made).

    PostgreSQL builds the new index concurrently before the old constraint and its twin are
    dropped, so uniqueness never lapses. SQLite rebuilds the table, then indexes. A database
    without partial indexes (MySQL) is left as it is: its unique index allows many NULLs. The
    index is the database's alone: a conditional ``UniqueConstraint`` would make Django warn on
    MySQL that it is not created, where the old index still does the work.
    """

    def __init__(self, model_name: str, name: str, field: Any, index: str) -> None:
        super().__init__(model_name, name, field)
        self.index = index

    def deconstruct(self) -> tuple[str, Sequence[Any], dict[str, Any]]:
        name, args, kwargs = super().deconstruct()
        return name, args, {**kwargs, "index": self.index}

    def describe(self) -> str:
        return f"Make {self.model_name}.{self.name} unique where set ({self.index})"

    def database_forwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        model = _model_here(
            self, schema_editor, to_state.apps.get_model(app_label, self.model_name)
        )
        if model is None:
            return
        column = model._meta.get_field(self.name).column
        if schema_editor.connection.vendor != "postgresql":
            super().database_forwards(app_label, schema_editor, from_state, to_state)
            self._create(schema_editor, model, column)
            return
        self._create(schema_editor, model, column)
        old = schema_editor._constraint_names(
            model, [column], unique=True, primary_key=False, exclude={self.index}
        )
        for constraint in old:
            schema_editor.execute(schema_editor._delete_unique_sql(model, constraint))
        twin = schema_editor._create_index_name(model._meta.db_table, [column], suffix="_like")
        schema_editor.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {schema_editor.quote_name(twin)}")

    def database_backwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        if _model_here(self, schema_editor, to_state.apps.get_model(app_label, self.model_name)):
            # AlterField goes back by altering forwards between the swapped states.
            super().database_forwards(app_label, schema_editor, from_state, to_state)
            how = _how(schema_editor)
            quoted = schema_editor.quote_name(self.index)
            schema_editor.execute(f"DROP INDEX{how} IF EXISTS {quoted}")

    def _create(self, schema_editor: Any, model: Any, column: str) -> None:
        quote, table = schema_editor.quote_name, model._meta.db_table
        schema_editor.execute(
            f"CREATE UNIQUE INDEX{_how(schema_editor)} {quote(self.index)} ON {quote(table)} "
            f"({quote(column)}) WHERE {quote(column)} IS NOT NULL"
        )


def _model_here(operation: Any, schema_editor: Any, model: Any) -> Any | None:
    """``model`` where ``operation`` (of a partial index) changes the database (partial
    indexes, and the model migrates on this connection), else None."""
    connection = schema_editor.connection
    if connection.features.supports_partial_indexes and operation.allow_migrate_model(
        connection.alias, model
    ):
        return model
    return None


def _how(schema_editor: Any) -> str:
    """``_concurrently`` as SQL: the word where the index is built without blocking writes."""
    return " CONCURRENTLY" if _concurrently(schema_editor) else ""


class _DatabaseIndex(migrations.operations.base.Operation):
    """An index ``name`` on ``columns`` of ``model_name``'s table that is the database's alone
    (no model state), built where :meth:`_here` says: its subclasses say how."""

    reversible = True

    def __init__(self, model_name: str, name: str, columns: Sequence[str]) -> None:
        self.model_name = model_name
        self.name = name
        self.columns = list(columns)

    def deconstruct(self) -> tuple[str, Sequence[Any], dict[str, Any]]:
        kwargs = {"model_name": self.model_name, "name": self.name, "columns": self.columns}
        return self.__class__.__name__, [], kwargs

    def state_forwards(self, app_label: str, state: Any) -> None:
        pass  # the database's alone

    def database_forwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        model = to_state.apps.get_model(app_label, self.model_name)
        if self._here(schema_editor, model):
            quote = schema_editor.quote_name
            columns = ", ".join(quote(column) for column in self.columns)
            table = quote(model._meta.db_table)
            schema_editor.execute(self._create(schema_editor, quote(self.name), table, columns))

    def database_backwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        model = from_state.apps.get_model(app_label, self.model_name)
        if self._here(schema_editor, model):
            quote = schema_editor.quote_name
            table = quote(model._meta.db_table)
            schema_editor.execute(self._drop(schema_editor, quote(self.name), table))

    def _here(self, schema_editor: Any, model: Any) -> bool:
        raise NotImplementedError

    def _create(self, schema_editor: Any, name: str, table: str, columns: str) -> str:
        raise NotImplementedError

    def _drop(self, schema_editor: Any, name: str, table: str) -> str:
        raise NotImplementedError


class PartialUniqueIndex(_DatabaseIndex):
    """A unique index ``name`` on ``columns`` of the rows that match ``where`` (SQL), the
    database's alone: no model state (a conditional ``UniqueConstraint`` would make Django warn
    on MySQL that it is not created). Built without blocking writes on PostgreSQL, plainly on
    SQLite; a database without partial indexes (MySQL) gets nothing. A migration using it must
    not be atomic."""

    def __init__(self, model_name: str, name: str, columns: Sequence[str], where: str) -> None:
        super().__init__(model_name, name, columns)
        self.where = where

    def deconstruct(self) -> tuple[str, Sequence[Any], dict[str, Any]]:
        name, args, kwargs = super().deconstruct()
        return name, args, {**kwargs, "where": self.where}

    def describe(self) -> str:
        return f"Create unique index {self.name} on {self.model_name} where {self.where}"

    def _here(self, schema_editor: Any, model: Any) -> bool:
        return _model_here(self, schema_editor, model) is not None

    def _create(self, schema_editor: Any, name: str, table: str, columns: str) -> str:
        how = _how(schema_editor)
        return f"CREATE UNIQUE INDEX{how} {name} ON {table} ({columns}) WHERE {self.where}"

    def _drop(self, schema_editor: Any, name: str, table: str) -> str:
        return f"DROP INDEX{_how(schema_editor)} IF EXISTS {name}"


class DropPartialUniqueIndex(PartialUniqueIndex):
    """:class:`PartialUniqueIndex` undone: dropped going forwards (without blocking writes on
    PostgreSQL; nothing on a database without partial indexes, which never had it), built
    again going back. Its arguments are the index's, as it was created."""

    def describe(self) -> str:
        return f"Drop unique index {self.name} on {self.model_name} where {self.where}"

    def database_forwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        super().database_backwards(app_label, schema_editor, from_state, to_state)

    def database_backwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        super().database_forwards(app_label, schema_editor, from_state, to_state)


class IndexWithoutPartialIndexes(_DatabaseIndex):
    """A plain index ``name`` on ``columns``, the database's alone (no model state), built only
    on a database without partial indexes (MySQL, MariaDB): there it serves a query that a
    partial index serves elsewhere, where it would only cost every write of the table."""

    def describe(self) -> str:
        return f"Create index {self.name} on {self.model_name} where partial indexes are missing"

    def _here(self, schema_editor: Any, model: Any) -> bool:
        connection = schema_editor.connection
        return not connection.features.supports_partial_indexes and self.allow_migrate_model(
            connection.alias, model
        )

    def _create(self, schema_editor: Any, name: str, table: str, columns: str) -> str:
        return f"CREATE INDEX {name} ON {table} ({columns})"

    def _drop(self, schema_editor: Any, name: str, table: str) -> str:
        return f"DROP INDEX {name} ON {table}"
