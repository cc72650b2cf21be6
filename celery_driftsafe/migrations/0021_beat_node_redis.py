"""Each beat node records whether its Redis answers it (since when, and why), for the admin's
dashboard and ``driftsafe_status``."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('celery_driftsafe', '0020_deadline_indexes_without_partial'),
    ]

    operations = [
        migrations.AddField(
            model_name='beatnode',
            name='redis_error',
            field=models.TextField(blank=True, help_text="Why this node's REDIS_URL does not answer (its last error)."),
        ),
        migrations.AddField(
            model_name='beatnode',
            name='redis_unreachable_since',
            field=models.DateTimeField(blank=True, help_text="Since when this node's REDIS_URL has not answered (authority time); empty while it answers or none is configured.", null=True),
        ),
    ]
