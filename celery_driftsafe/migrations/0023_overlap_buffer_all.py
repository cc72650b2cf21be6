"""Overlap policy ``buffer_all``: the policy among the task's choices, and the partial unique
index of migration 0019 (at most one ``waiting`` run a task) dropped, since several runs of a
``buffer_all`` task wait at once. The ledger's statement that makes a run wait now counts the
waiting runs while it holds the task's row on every database (as it did on MySQL, which never
had the index), so ``buffer_one`` still lets one wait. Not atomic: the index is dropped
concurrently on PostgreSQL."""

import celery_driftsafe.core.stored_names
from django.db import migrations, models

from celery_driftsafe.migration_operations import DropPartialUniqueIndex


class Migration(migrations.Migration):

    atomic = False

    dependencies = [
        ('celery_driftsafe', '0022_pause_after_failures'),
    ]

    operations = [
        migrations.AlterField(
            model_name='periodictask',
            name='overlap_policy',
            field=models.CharField(choices=[('allow', 'Allow overlapping runs'), ('skip', 'Skip a slot while the previous run is running'), ('buffer_one', 'Keep one slot waiting while the previous run is running (skip any further)'), ('buffer_all', 'Keep every slot waiting while the previous run is running; run them in slot order')], default=celery_driftsafe.core.stored_names.OverlapPolicy['ALLOW'], help_text="What a slot does while the task's previous run is still running: allow: run beside it; skip: record the slot skipped; buffer_one: wait (one slot at most, further ones are skipped) and run as soon as the running one ends; buffer_all: wait, every slot (up to 10 at once, further ones are skipped), and run one at a time in slot order.", max_length=16),
        ),
        DropPartialUniqueIndex(
            model_name='run',
            name='driftsafe_run_one_waiting',
            columns=['periodic_task_id'],
            where="status = 'waiting'",
        ),
    ]
