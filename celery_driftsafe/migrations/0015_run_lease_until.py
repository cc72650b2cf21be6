"""Until when the worker running a started run holds its lease (``lease_until``), renewed with
its lock: a takeover needs it past as well as the lock free, so a lock that Redis lost while
the run ran (a flush, a restart that kept no data) does not let a second worker in. A nullable
column: adding it rewrites no row, and a run without it is judged by its lock alone."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("celery_driftsafe", "0014_run_lock_store"),
    ]

    operations = [
        migrations.AddField(
            model_name="run",
            name="lease_until",
            field=models.DateTimeField(
                blank=True,
                help_text="Until when the worker running it holds its lease, renewed with its "
                "lock: nobody takes a started run over before then, even if the lock itself was "
                "lost (a Redis flush or restart). Empty: not started, or started before this "
                "was recorded.",
                null=True,
            ),
        ),
    ]
