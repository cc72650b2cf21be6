"""Fewer index entries for every claimed run and every task a claim moves on.

* The run's ``idempotency_key`` was ``unique=True``: on PostgreSQL a unique index plus a
  ``varchar_pattern_ops`` twin, each taking an entry (NULL) for every scheduled run, at its
  insert and again at its publish's update. It becomes one unique index over the runs that
  have a key (``WHERE idempotency_key IS NOT NULL``), built first, concurrently on PostgreSQL;
  then the old ones are dropped. MySQL has no partial indexes and keeps its unique index.
* The task's ``name`` keeps its uniqueness through a constraint, which has no LIKE twin.

Not atomic: PostgreSQL builds the new run index concurrently.
"""

from django.db import migrations, models

from celery_driftsafe.migration_operations import UniqueWhereSet


class Migration(migrations.Migration):

    atomic = False

    dependencies = [
        ('celery_driftsafe', '0011_run_fewer_indexes'),
    ]

    operations = [
        UniqueWhereSet(
            model_name='run',
            name='idempotency_key',
            field=models.CharField(blank=True, max_length=255, null=True),
            index='driftsafe_run_idempotency_key',
        ),
        migrations.AddConstraint(
            model_name='periodictask',
            constraint=models.UniqueConstraint(fields=('name',), name='driftsafe_task_name_once'),
        ),
        migrations.AlterField(
            model_name='periodictask',
            name='name',
            field=models.CharField(help_text='Unique, human-chosen name.', max_length=200),
        ),
    ]
