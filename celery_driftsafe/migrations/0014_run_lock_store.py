"""Where the worker that started a run holds its lock (``lock_store``), so that only a worker
locking in the same place takes a started run over: a worker locking elsewhere cannot see
whether the starter's lock is still held. A nullable column: adding it rewrites no row, and
runs inserted by raw SQL leave it out."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("celery_driftsafe", "0013_periodictask_source_app"),
    ]

    operations = [
        migrations.AddField(
            model_name="run",
            name="lock_store",
            field=models.CharField(
                blank=True,
                help_text="Where the worker that started the run holds its lock (the "
                "driftsafe_locks header's value): only a worker locking there may take the "
                "run over. Empty: not started, or started before this was recorded.",
                max_length=200,
                null=True,
            ),
        ),
    ]
