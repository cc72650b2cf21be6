"""Pause after failures: a task's ``pause_after_failures`` (N) and the count of its failed or
missed runs in a row, ``consecutive_failures`` (written by the outcome and the claim only)."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('celery_driftsafe', '0021_beat_node_redis'),
    ]

    operations = [
        migrations.AddField(
            model_name='periodictask',
            name='pause_after_failures',
            field=models.PositiveIntegerField(blank=True, help_text='Disable (pause) the task once this many of its runs in a row ended failed (retries exhausted) or its slots were missed; a success starts the count again, re-enabling the task clears it. Empty or 0: never pause.', null=True),
        ),
        migrations.AddField(
            model_name='periodictask',
            name='consecutive_failures',
            field=models.PositiveIntegerField(default=0, help_text='Runs in a row that ended failed or slots missed since the last success (counted for pause_after_failures only; cleared on re-enabling).'),
        ),
    ]
