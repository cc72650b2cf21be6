"""Fewer indexes on the run table: each costs every claimed run an index entry, twice (the
claim's insert and the publish's update).

* ``periodic_task_id`` loses its own index: the unique ``(periodic_task, slot)`` constraint's
  index leads with it;
* ``driftsafe_run_task_recent`` ``(periodic_task, -slot)`` goes: the same unique index, read
  backwards, gives a task's runs newest first;
* ``celery_task_id`` keeps one plain index (it is looked up by exact id only) instead of
  ``db_index``'s two on PostgreSQL (the second, ``varchar_pattern_ops``, serves ``LIKE``).

The new index is built first, then the others are dropped; on PostgreSQL concurrently, so the
migration is not atomic.
"""

import django.db.models.deletion
from django.db import migrations, models

from celery_driftsafe.migration_operations import AddIndexConcurrently, RemoveIndexConcurrently


class Migration(migrations.Migration):

    atomic = False

    dependencies = [
        ('celery_driftsafe', '0010_run_admin_indexes'),
    ]

    operations = [
        AddIndexConcurrently(
            model_name='run',
            index=models.Index(fields=['celery_task_id'], name='driftsafe_run_celery_id'),
        ),
        migrations.AlterField(
            model_name='run',
            name='celery_task_id',
            field=models.CharField(blank=True, max_length=255),
        ),
        migrations.AlterField(
            model_name='run',
            name='periodic_task',
            field=models.ForeignKey(blank=True, db_index=False, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='runs', to='celery_driftsafe.periodictask'),
        ),
        RemoveIndexConcurrently(
            model_name='run',
            name='driftsafe_run_task_recent',
        ),
    ]
