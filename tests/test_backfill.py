"""Backfill (``driftsafe_backfill`` and :mod:`celery_driftsafe.publish.backfill`): each slot of
a range runs once, slots with a run are skipped, racing backfills insert each slot once."""

from __future__ import annotations

import io
from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings
from django.core.management import CommandError, call_command
from django.test import override_settings

from celery_driftsafe.claim.outbox import celery_task_id
from celery_driftsafe.models import PeriodicTask, Run, RunKind, RunStatus
from celery_driftsafe.publish.backfill import plan_backfill, run_backfill
from celery_driftsafe.testing import FakeClock, inject_authority_clock
from tests.conftest import QUEUE, T0, drain
from tests.factories import at_once, crontab_task, interval_task

M = timedelta(minutes=1)


def backfill(*args: str) -> str:
    out = io.StringIO()
    call_command("driftsafe_backfill", *args, stdout=out, stderr=io.StringIO(), no_color=True)
    return out.getvalue()


def _task(name: str = "minutely") -> PeriodicTask:
    return interval_task(name, 60, anchor=T0, queue=QUEUE)


@pytest.mark.django_db(transaction=True)
def test_dry_run_lists_the_slots_and_writes_nothing(app: Any) -> None:
    task = _task()
    out = backfill(
        "--task", task.name, "--from", T0.isoformat(), "--to", (T0 + 3 * M).isoformat(), "--dry-run"
    )
    assert "3 slots to run, 0 skipped" in out and "dry run: nothing written" in out
    assert (T0 + 2 * M).isoformat() in out
    assert not Run.objects.exists() and drain(QUEUE) == []


@pytest.mark.django_db(transaction=True)
def test_backfill_runs_each_slot_once_and_skips_slots_with_a_run(app: Any) -> None:
    task = _task()
    Run.objects.create(
        periodic_task=task, task_name=task.task, slot=T0 + M, status=RunStatus.SUCCEEDED
    )
    out = backfill("--task", task.name, "--from", T0.isoformat(), "--to", (T0 + 4 * M).isoformat())
    assert "3 slots to run, 1 skipped" in out and "inserted 3 runs, published 3" in out
    runs = Run.objects.filter(kind=RunKind.BACKFILL).order_by("slot")
    assert [run.slot for run in runs] == [T0, T0 + 2 * M, T0 + 3 * M]
    assert {run.status for run in runs} == {RunStatus.DISPATCHED}
    messages = drain(QUEUE)
    assert sorted(m["id"] for m in messages) == sorted(
        celery_task_id(task.pk, r.slot) for r in runs
    )
    # again: every slot has a run now, nothing is written or published
    out = backfill("--task", task.name, "--from", T0.isoformat(), "--to", (T0 + 4 * M).isoformat())
    assert "0 slots to run, 4 skipped" in out
    assert Run.objects.count() == 4 and drain(QUEUE) == []
    # the schedule is left as it was
    assert PeriodicTask.objects.get(pk=task.pk).run_count == task.run_count


@pytest.mark.django_db(transaction=True)
def test_naive_instants_are_in_the_task_s_zone(app: Any) -> None:
    task = crontab_task("berlin", "0 * * * *", timezone="Europe/Berlin", queue=QUEUE)
    # 13:00 to 15:00 in Berlin (UTC+1 in March) is 12:00 to 14:00 UTC: two slots
    out = backfill(
        "--task", task.name, "--from", "2026-03-01T13:00", "--to", "2026-03-01T15:00", "--dry-run"
    )
    assert "2 slots to run" in out and T0.isoformat() in out and (T0 + 60 * M).isoformat() in out


@pytest.mark.django_db
def test_clear_errors(app: Any) -> None:
    task = _task()
    with pytest.raises(CommandError, match="no periodic task named 'nope'"):
        backfill("--task", "nope", "--from", T0.isoformat(), "--to", (T0 + M).isoformat())
    with pytest.raises(CommandError, match="the range is empty"):
        backfill("--task", task.name, "--from", T0.isoformat(), "--to", T0.isoformat())
    with pytest.raises(CommandError, match="not an ISO 8601 instant"):
        backfill("--task", task.name, "--from", "yesterday", "--to", T0.isoformat())
    with pytest.raises(CommandError, match="--rate"):
        backfill(
            "--task",
            task.name,
            "--from",
            T0.isoformat(),
            "--to",
            (T0 + M).isoformat(),
            "--rate",
            "fast",
        )


@pytest.mark.django_db
def test_a_range_of_more_slots_than_the_cap_is_refused_naming_the_setting(app: Any) -> None:
    task = _task()
    with override_settings(DRIFTSAFE={**settings.DRIFTSAFE, "BACKFILL_MAX_SLOTS": 5}):
        with pytest.raises(CommandError, match="BACKFILL_MAX_SLOTS = 5"):
            backfill(
                "--task", task.name, "--from", T0.isoformat(), "--to", (T0 + 6 * M).isoformat()
            )
        backfill(
            "--task",
            task.name,
            "--from",
            T0.isoformat(),
            "--to",
            (T0 + 5 * M).isoformat(),
            "--dry-run",
        )
    assert not Run.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_rate_paces_the_publishing_on_the_injected_clock(app: Any) -> None:
    task = _task()
    clock = FakeClock(T0 + 100 * M)
    with inject_authority_clock(clock):
        backfill(
            "--task",
            task.name,
            "--from",
            T0.isoformat(),
            "--to",
            (T0 + 10 * M).isoformat(),
            "--rate",
            "2/s",
        )
    # chunks of 2 runs, a second apart: 4 waits of 1 s after the first chunk
    assert clock.sleeps == [pytest.approx(1.0)] * 4
    assert Run.objects.filter(kind=RunKind.BACKFILL, status=RunStatus.DISPATCHED).count() == 10
    assert len(drain(QUEUE)) == 10


@pytest.mark.django_db(transaction=True)
def test_racing_backfills_run_each_slot_once(app: Any) -> None:
    task = _task()
    end = T0 + 30 * M

    def racer(n: int) -> int:
        fresh = PeriodicTask.objects.get(pk=task.pk)
        return run_backfill(plan_backfill(fresh, T0, end), app=app).inserted

    inserted = at_once(3, racer)
    assert sum(inserted) == 30
    slots = list(Run.objects.values_list("slot", flat=True))
    assert len(slots) == len(set(slots)) == 30
    messages = drain(QUEUE)
    assert len(messages) == 30 and len({m["id"] for m in messages}) == 30
