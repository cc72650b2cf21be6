"""Overlap policy ``replace``: the policy's choice, and the run that replaced a running run
(``Run.replaced_by``, a run id: the replaced run ends ``revoked`` whatever its body did)."""

import celery_driftsafe.core.stored_names
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('celery_driftsafe', '0023_overlap_buffer_all'),
    ]

    operations = [
        migrations.AddField(
            model_name='run',
            name='replaced_by',
            field=models.BigIntegerField(blank=True, help_text='Overlap policy replace: the id of the run (of a later slot) that replaced this one while it ran; the run ends revoked, whatever its body did. Empty: not replaced.', null=True),
        ),
        migrations.AlterField(
            model_name='periodictask',
            name='overlap_policy',
            field=models.CharField(choices=[('allow', 'Allow overlapping runs'), ('skip', 'Skip a slot while the previous run is running'), ('buffer_one', 'Keep one slot waiting while the previous run is running (skip any further)'), ('buffer_all', 'Keep every slot waiting while the previous run is running; run them in slot order'), ('replace', 'Replace the running run: revoke it (terminate where the pool can), then run')], default=celery_driftsafe.core.stored_names.OverlapPolicy['ALLOW'], help_text="What a slot does while the task's previous run is still running: allow: run beside it; skip: record the slot skipped; buffer_one: wait (one slot at most, further ones are skipped) and run as soon as the running one ends; buffer_all: wait, every slot (up to 10 at once, further ones are skipped), and run one at a time in slot order; replace: revoke the running run and run once its body is gone (a prefork worker terminates it; gevent and eventlet kill it at its next yield); replace on a threads pool (or solo) waits for the running body to end, then runs. Never two bodies at once.", max_length=16),
        ),
    ]
