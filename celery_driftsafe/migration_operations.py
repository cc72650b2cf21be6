"""Migration operations that build and drop indexes without blocking a busy ledger.

On PostgreSQL, ``CREATE INDEX CONCURRENTLY`` and ``DROP INDEX CONCURRENTLY``: beats keep
claiming while an index of a table with millions of runs is built. A migration using them must
not be atomic. Other databases get the plain operations.
"""

from __future__ import annotations

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
