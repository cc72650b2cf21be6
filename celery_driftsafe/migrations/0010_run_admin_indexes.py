"""Indexes for the admin's run list and its filters (newest first, by status, by node, manual
and ad-hoc runs), so that they read a page of the index instead of sorting the ledger.

On PostgreSQL they are built with ``CREATE INDEX CONCURRENTLY``: a big ledger keeps taking
claims while they are built (the migration is therefore not atomic)."""

from django.db import migrations, models

from celery_driftsafe.migration_operations import AddIndexConcurrently


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
