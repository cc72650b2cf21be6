"""The deadline check's indexes on MySQL and MariaDB, which have no partial indexes: there
Django builds ``driftsafe_task_deadline`` without its condition (a plain index on ``id``), and
the check, every 2 s in every beat, read the whole task table. Two plain indexes, on
``deadline_seconds`` and on ``stale_since``, let those databases read only the tasks the
check watches (an index merge of the two ranges ``IS NOT NULL``). Other databases keep the
partial index and get nothing here: two more indexes of the task table would cost every
claim's update of it. The indexes are the database's alone: no model state."""

from django.db import migrations

from celery_driftsafe.migration_operations import IndexWithoutPartialIndexes


class Migration(migrations.Migration):

    dependencies = [
        ('celery_driftsafe', '0019_run_waiting_buffer_one'),
    ]

    operations = [
        IndexWithoutPartialIndexes(
            model_name='periodictask',
            name='driftsafe_task_deadline_s',
            columns=['deadline_seconds'],
        ),
        IndexWithoutPartialIndexes(
            model_name='periodictask',
            name='driftsafe_task_stale_since',
            columns=['stale_since'],
        ),
    ]
