"""Excluded dates: a task's own list, shared calendars of dates (and an optional crontab of
wall times), and the copy of its calendars' exclusions the claim reads in the task's row."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('celery_driftsafe', '0024_overlap_replace'),
    ]

    operations = [
        migrations.AddField(
            model_name='periodictask',
            name='calendar_exclusions',
            field=models.JSONField(blank=True, editable=False, help_text="What the task's calendars exclude ({dates, crontabs}), kept by the calendars. Empty: no calendar.", null=True),
        ),
        migrations.AddField(
            model_name='periodictask',
            name='excluded_dates',
            field=models.JSONField(blank=True, default=list, help_text="Dates (YYYY-MM-DD) in the task's time zone on which no slot fires; such a slot is not recorded missed either."),
        ),
        migrations.CreateModel(
            name='Calendar',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('name', models.CharField(help_text='Unique, e.g. "public holidays DE".', max_length=200)),
                ('description', models.TextField(blank=True, help_text='Notes for people.')),
                ('dates', models.JSONField(blank=True, default=list, help_text='Excluded dates (YYYY-MM-DD), each read in the time zone of the task: no slot on such a date fires or is recorded missed.')),
                ('crontab', models.CharField(blank=True, help_text="Optional: wall times excluded, as a crontab expression read in the task's time zone. Five fields exclude whole minutes (* * * * sat,sun: weekends); six, with the seconds first, exclude whole seconds (*/3 * * * * *). Empty: dates only.", max_length=200)),
                ('changed_at', models.DateTimeField(auto_now=True)),
            ],
            options={
                'ordering': ['name'],
                'constraints': [models.UniqueConstraint(fields=('name',), name='driftsafe_calendar_name')],
            },
        ),
        migrations.AddField(
            model_name='periodictask',
            name='calendars',
            field=models.ManyToManyField(blank=True, help_text='Shared calendars whose dates (and crontab) are excluded too.', related_name='tasks', to='celery_driftsafe.calendar'),
        ),
    ]
