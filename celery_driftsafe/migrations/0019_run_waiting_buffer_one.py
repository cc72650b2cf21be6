"""Overlap policy ``buffer_one``: the run status ``waiting`` and the partial unique index that
lets at most one run of a task wait (``WHERE status = 'waiting'``; not created on MySQL, which
has no partial indexes), built concurrently on PostgreSQL. Not atomic, for that. The index is
the database's alone, as migration 0012's: no model state."""

import celery_driftsafe.core.stored_names
from django.db import migrations, models

from celery_driftsafe.migration_operations import PartialUniqueIndex


class Migration(migrations.Migration):

    atomic = False

    dependencies = [
        ('celery_driftsafe', '0018_run_operator_index'),
    ]

    operations = [
        migrations.AlterField(
            model_name='periodictask',
            name='overlap_policy',
            field=models.CharField(choices=[('allow', 'Allow overlapping runs'), ('skip', 'Skip a slot while the previous run is running'), ('buffer_one', 'Keep one slot waiting while the previous run is running (skip any further)')], default=celery_driftsafe.core.stored_names.OverlapPolicy['ALLOW'], help_text="What a slot does while the task's previous run is still running: allow: run beside it; skip: record the slot skipped; buffer_one: wait (one slot at most, further ones are skipped) and run as soon as the running one ends.", max_length=16),
        ),
        migrations.AlterField(
            model_name='run',
            name='status',
            field=models.CharField(choices=[('claimed', 'Claimed'), ('dispatched', 'Dispatched'), ('started', 'Started'), ('retrying', 'Retry scheduled'), ('waiting', 'Waiting for the running run'), ('succeeded', 'Succeeded'), ('failed', 'Failed'), ('skipped', 'Skipped'), ('missed', 'Missed'), ('expired', 'Expired'), ('revoked', 'Revoked')], default=celery_driftsafe.core.stored_names.RunStatus['CLAIMED'], max_length=16),
        ),
        migrations.AlterField(
            model_name='runattempt',
            name='outcome',
            field=models.CharField(choices=[('claimed', 'Claimed'), ('dispatched', 'Dispatched'), ('started', 'Started'), ('retrying', 'Retry scheduled'), ('waiting', 'Waiting for the running run'), ('succeeded', 'Succeeded'), ('failed', 'Failed'), ('skipped', 'Skipped'), ('missed', 'Missed'), ('expired', 'Expired'), ('revoked', 'Revoked')], max_length=16),
        ),
        PartialUniqueIndex(
            model_name='run',
            name='driftsafe_run_one_waiting',
            columns=['periodic_task_id'],
            where="status = 'waiting'",
        ),
    ]
