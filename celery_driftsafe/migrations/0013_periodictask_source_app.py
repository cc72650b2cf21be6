"""Which Celery app's ``beat_schedule`` a task mirrors (``source_app``), so that a beat can
disable the tasks its app's ``beat_schedule`` no longer has without touching another app's.
A nullable column: adding it rewrites no row, and rows written by raw SQL may leave it out."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("celery_driftsafe", "0012_unique_indexes_without_twins"),
    ]

    operations = [
        migrations.AddField(
            model_name="periodictask",
            name="source_app",
            field=models.CharField(
                blank=True,
                help_text="For a task from beat_schedule: the Celery app (its main name) whose "
                "beat_schedule has it. Empty: not known (synced before this was recorded).",
                max_length=200,
                null=True,
            ),
        ),
    ]
