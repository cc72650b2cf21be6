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
