"""Indexes for the admin's run list and its filters (newest first, by status, by node, manual
and ad-hoc runs), so that they read a page of the index instead of sorting the ledger.

On PostgreSQL they are built with ``CREATE INDEX CONCURRENTLY``: a big ledger keeps taking
claims while they are built (the migration is therefore not atomic)."""

from django.db import migrations, models


class AddIndexConcurrently(migrations.AddIndex):
    """``AddIndex``, built without blocking writes on PostgreSQL; plain elsewhere."""

    def database_forwards(self, app_label, schema_editor, from_state, to_state):
        model = to_state.apps.get_model(app_label, self.model_name)
        if not self.allow_migrate_model(schema_editor.connection.alias, model):
            return
        if schema_editor.connection.vendor == "postgresql":
            schema_editor.add_index(model, self.index, concurrently=True)
        else:
            schema_editor.add_index(model, self.index)

    def database_backwards(self, app_label, schema_editor, from_state, to_state):
        model = from_state.apps.get_model(app_label, self.model_name)
        if not self.allow_migrate_model(schema_editor.connection.alias, model):
            return
        if schema_editor.connection.vendor == "postgresql":
            schema_editor.remove_index(model, self.index, concurrently=True)
        else:
            schema_editor.remove_index(model, self.index)


class Migration(migrations.Migration):

    atomic = False

    dependencies = [
        ('celery_driftsafe', '0009_bounds_jitter_description'),
    ]

    operations = [
        AddIndexConcurrently(
            model_name='run',
            index=models.Index(fields=['-slot', '-id'], name='driftsafe_run_recent'),
        ),
        AddIndexConcurrently(
            model_name='run',
            index=models.Index(fields=['status', '-slot', '-id'], name='driftsafe_run_status_recent'),
        ),
        AddIndexConcurrently(
            model_name='run',
            index=models.Index(fields=['claimed_by', '-slot', '-id'], name='driftsafe_run_node_recent'),
        ),
        AddIndexConcurrently(
            model_name='run',
            index=models.Index(condition=models.Q(('kind__in', ['manual', 'adhoc'])), fields=['-slot', '-id'], name='driftsafe_run_unscheduled'),
        ),
    ]
