"""Models and migrations agree, on every database the suite runs against."""

from __future__ import annotations

from typing import Any

import pytest
from django.conf import settings
from django.core.management import call_command

from tests.skip_guard import configuration


@pytest.mark.django_db
def test_models_and_migrations_agree() -> None:
    try:
        call_command("makemigrations", "celery_driftsafe", "--check", "--dry-run", verbosity=0)
    except SystemExit as exc:  # makemigrations --check exits 1 when a migration is missing
        pytest.fail(f"models changed without a migration (makemigrations --check: {exc.code})")


def _package_schema() -> dict[str, Any]:
    """The package's tables as the database describes them: each table's columns (name, type,
    nullability) and its constraints and indexes (columns, unique, primary key, foreign key)."""
    from django.db import connection

    with connection.cursor() as cursor:
        tables = sorted(
            info.name
            for info in connection.introspection.get_table_list(cursor)
            if info.name.startswith("celery_driftsafe_")
        )
        schema: dict[str, Any] = {}
        for table in tables:
            columns = sorted(
                (column.name, column.type_code, bool(column.null_ok))
                for column in connection.introspection.get_table_description(cursor, table)
            )
            constraints = sorted(
                (
                    tuple(c["columns"] or ()),
                    bool(c["unique"]),
                    bool(c["primary_key"]),
                    str(c["foreign_key"]),
                    bool(c["index"]),
                )
                for c in connection.introspection.get_constraints(cursor, table).values()
            )
            schema[table] = {"columns": columns, "constraints": constraints}
    return schema


@pytest.mark.django_db(transaction=True)
def test_migrations_unapply_to_nothing_and_reapply_to_the_same_schema() -> None:
    """Unapplying every migration leaves none of the package's tables; applying them again
    gives back every table with the same columns, constraints and indexes."""
    from django.apps import apps

    applied = _package_schema()
    model_tables = {
        model._meta.db_table for model in apps.get_app_config("celery_driftsafe").get_models()
    }
    assert model_tables <= set(applied), (
        f"tables missing after migrate: {model_tables - set(applied)}"
    )
    call_command("migrate", "celery_driftsafe", "zero", verbosity=0)
    assert _package_schema() == {}, "migrate to zero left tables of the package behind"
    call_command("migrate", "celery_driftsafe", verbosity=0)
    assert _package_schema() == applied


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


def _indexes_on(table: str, column: str) -> dict[str, dict]:
    from django.db import connection

    with connection.cursor() as cursor:
        found = connection.introspection.get_constraints(cursor, table)
    return {name: c for name, c in found.items() if c["columns"] == [column]}


@pytest.mark.django_db(transaction=True)
def test_unique_where_set_keeps_keys_unique_and_takes_no_entry_for_a_run_without_one() -> None:
    """Migration 0012: one unique index for idempotency keys, over the rows that have one, and
    the task name's uniqueness without a LIKE twin; going back restores the unique field."""
    from django.db import IntegrityError, connection, transaction
    from django.db.migrations.executor import MigrationExecutor

    from celery_driftsafe.models import PeriodicTask, Run

    def states() -> tuple[dict, dict]:
        return (
            _indexes_on("celery_driftsafe_run", "idempotency_key"),
            _indexes_on("celery_driftsafe_periodictask", "name"),
        )

    migrated = runs, names = states()
    assert all(c["unique"] for c in runs.values()) and all(c["unique"] for c in names.values())
    if connection.vendor == "postgresql":
        assert list(runs) == ["driftsafe_run_idempotency_key"]
        assert list(names) == ["driftsafe_task_name_once"]
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT indexdef FROM pg_indexes WHERE indexname = 'driftsafe_run_idempotency_key'"
            )
            assert cursor.fetchone()[0].endswith("WHERE (idempotency_key IS NOT NULL)")
    else:
        assert len(runs) == 1 and len(names) == 1
    Run.objects.create(task_name="a", kind="adhoc")
    Run.objects.create(task_name="a", kind="adhoc")  # many runs without a key
    Run.objects.create(task_name="a", kind="adhoc", idempotency_key="order-42")
    with pytest.raises(IntegrityError), transaction.atomic():
        Run.objects.create(task_name="b", kind="adhoc", idempotency_key="order-42")
    PeriodicTask.objects.create(name="once", task="tests.add", schedule_kind="crontab")
    with pytest.raises(IntegrityError), transaction.atomic():
        PeriodicTask.objects.create(name="once", task="tests.add", schedule_kind="crontab")
    Run.objects.all().delete()
    PeriodicTask.objects.all().delete()

    executor = MigrationExecutor(connection)
    executor.migrate([("celery_driftsafe", "0011_run_fewer_indexes")])
    runs, names = states()
    assert any(c["unique"] for c in runs.values()) and any(c["unique"] for c in names.values())
    assert "driftsafe_run_idempotency_key" not in runs
    if connection.vendor == "postgresql":  # unique=True's LIKE twins are back
        assert len(runs) == 2 and len(names) == 2
    call_command("migrate", "celery_driftsafe", verbosity=0)
    assert states() == migrated


@pytest.mark.skipif(
    settings.DATABASES["default"]["ENGINE"].endswith("mysql"),
    reason=configuration("MySQL has no partial index: there the ledger holds the task's row"),
)
@pytest.mark.django_db(transaction=True)
def test_the_one_waiting_index_is_built_by_0019_and_dropped_by_0023_both_ways() -> None:
    """Migration 0019 builds the partial unique index that let one run of a task wait (built
    concurrently on PostgreSQL, where a failed concurrent build would leave it invalid);
    migration 0023 drops it (overlap policy ``buffer_all``: several wait), and going back
    builds it again."""
    from django.db import connection
    from django.db.migrations.executor import MigrationExecutor

    name = "driftsafe_run_one_waiting"
    assert name not in _indexes_on("celery_driftsafe_run", "periodic_task_id")
    executor = MigrationExecutor(connection)
    executor.migrate([("celery_driftsafe", "0021_beat_node_redis")])
    indexes = _indexes_on("celery_driftsafe_run", "periodic_task_id")
    assert indexes[name]["unique"]
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT pg_indexes.indexdef, pg_index.indisvalid FROM pg_indexes "
                "JOIN pg_class ON pg_class.relname = pg_indexes.indexname "
                "JOIN pg_index ON pg_index.indexrelid = pg_class.oid "
                "WHERE pg_indexes.indexname = %s",
                [name],
            )
            definition, valid = cursor.fetchone()
        assert definition.endswith("WHERE ((status)::text = 'waiting'::text)"), definition
        assert valid
    executor = MigrationExecutor(connection)
    executor.migrate([("celery_driftsafe", "0016_run_kind_backfill")])
    assert name not in _indexes_on("celery_driftsafe_run", "periodic_task_id")
    call_command("migrate", "celery_driftsafe", verbosity=0)
    assert name not in _indexes_on("celery_driftsafe_run", "periodic_task_id")
