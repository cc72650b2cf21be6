"""Models and migrations agree, on every database the suite runs against."""

from __future__ import annotations

import pytest
from django.core.management import call_command


@pytest.mark.django_db
def test_models_and_migrations_agree() -> None:
    try:
        call_command("makemigrations", "celery_driftsafe", "--check", "--dry-run", verbosity=0)
    except SystemExit as exc:  # makemigrations --check exits 1 when a migration is missing
        pytest.fail(f"models changed without a migration (makemigrations --check: {exc.code})")


@pytest.mark.django_db(transaction=True)
def test_migrations_apply_and_unapply() -> None:
    call_command("migrate", "celery_driftsafe", "zero", verbosity=0)
    call_command("migrate", "celery_driftsafe", verbosity=0)


@pytest.mark.django_db(transaction=True)
def test_bounds_migration_makes_every_task_due_at_its_next_slot() -> None:
    """Tasks stored before due_at existed are due at their next slot afterwards (no jitter
    yet), so the claim's due query finds them."""
    from datetime import UTC, datetime

    from django.db import connection
    from django.db.migrations.executor import MigrationExecutor

    slot = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
    before = [("celery_driftsafe", "0008_crontab_second")]
    after = [("celery_driftsafe", "0009_bounds_jitter_description")]
    executor = MigrationExecutor(connection)
    executor.migrate(before)
    old = executor.loader.project_state(before).apps.get_model("celery_driftsafe", "PeriodicTask")
    old.objects.create(name="waiting", task="tests.add", schedule_kind="crontab", next_slot_at=slot)
    old.objects.create(name="none", task="tests.add", schedule_kind="crontab")
    executor = MigrationExecutor(connection)
    executor.migrate(after)
    new = executor.loader.project_state(after).apps.get_model("celery_driftsafe", "PeriodicTask")
    assert dict(new.objects.values_list("name", "due_at")) == {"waiting": slot, "none": None}
    call_command("migrate", "celery_driftsafe", verbosity=0)
