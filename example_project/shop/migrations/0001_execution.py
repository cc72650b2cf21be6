from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True

    dependencies: list[tuple[str, str]] = []

    operations = [
        migrations.CreateModel(
            name="Execution",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("task_name", models.CharField(max_length=200)),
                (
                    "run_id",
                    models.BigIntegerField(
                        blank=True,
                        db_index=True,
                        help_text="celery_driftsafe Run id, if any.",
                        null=True,
                    ),
                ),
                (
                    "slot",
                    models.DateTimeField(
                        blank=True, help_text="The slot this run fired for.", null=True
                    ),
                ),
                ("celery_task_id", models.CharField(blank=True, max_length=255)),
                (
                    "worker",
                    models.CharField(
                        blank=True, help_text="Worker host name and pid.", max_length=255
                    ),
                ),
                (
                    "executed_at",
                    models.DateTimeField(help_text="The worker's own clock when the body ran."),
                ),
            ],
            options={"ordering": ["-executed_at"]},
        ),
    ]
