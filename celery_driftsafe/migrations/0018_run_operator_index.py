"""The partial index of the runs an operator asked for takes backfilled runs too: the admin's
run list filtered by kind ``backfill`` read the whole ledger (a sequential scan, and another for
the filtered count), where the other kinds read a page of an index.

``driftsafe_run_unscheduled`` (``kind IN ('manual', 'adhoc')``) becomes
``driftsafe_run_operator`` (``kind IN ('manual', 'adhoc', 'backfill')``), which still serves
the filters and the search of manual and ad hoc runs. The new index is built first, then the
old one dropped; on PostgreSQL concurrently, so the migration is not atomic."""

from django.db import migrations, models

from celery_driftsafe.migration_operations import AddIndexConcurrently, RemoveIndexConcurrently


class Migration(migrations.Migration):

    atomic = False

    dependencies = [
        ('celery_driftsafe', '0017_deadlines'),
    ]

    operations = [
        AddIndexConcurrently(
            model_name='run',
            index=models.Index(condition=models.Q(('kind__in', ['manual', 'adhoc', 'backfill'])), fields=['-slot', '-id'], name='driftsafe_run_operator'),
        ),
        RemoveIndexConcurrently(
            model_name='run',
            name='driftsafe_run_unscheduled',
        ),
    ]
