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

from celery_driftsafe.claim.claimers import claimer_for
from celery_driftsafe.claim.outbox import celery_task_id, reclaim_stale, run_message
from celery_driftsafe.models import PeriodicTask, Run, RunKind, RunStatus
from celery_driftsafe.publish.backfill import _insert, backfill_actor, plan_backfill, run_backfill
from celery_driftsafe.publish.dispatcher import Dispatcher
from celery_driftsafe.testing import FakeClock, inject_authority_clock
from tests.support import QUEUE, T0, drain
from tests.support.factories import at_once, crontab_task, interval_task

M = timedelta(minutes=1)
S = timedelta(seconds=1)


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
    with pytest.raises(CommandError, match=r"no periodic task named 'nope' \(of 1; the admin"):
        backfill("--task", "nope", "--from", T0.isoformat(), "--to", (T0 + M).isoformat())
    typo = task.name[:-1] + "x"
    with pytest.raises(CommandError, match=f"named '{typo}'; did you mean '{task.name}'\\?"):
        backfill("--task", typo, "--from", T0.isoformat(), "--to", (T0 + M).isoformat())
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
def test_racing_backfills_and_a_beat_run_each_slot_once(app: Any) -> None:
    """Two backfills of the same range and a beat claiming (and publishing) the same slots on
    time, at once: each slot has one run and one message on the broker."""
    task = interval_task("raced", 60, anchor=T0, next_slot_at=T0, queue=QUEUE)
    end = T0 + 30 * M

    def racer(n: int) -> int:
        if n == 2:  # the beat: each slot at its instant, published as a beat publishes
            claimer = claimer_for()
            dispatcher = Dispatcher(app, FakeClock(end))
            claimed = 0
            for k in range(30):
                now = T0 + k * M
                # on time: a beat claims again while the task is locked by a backfill's chunk
                # (the skip-locked claimer passes over it), until its next slot is past now
                while PeriodicTask.objects.get(pk=task.pk).next_slot_at <= now:
                    runs = claimer.claim(now, "beat-node").runs
                    dispatcher.dispatch(runs)
                    claimed += len(runs)
            return claimed
        fresh = PeriodicTask.objects.get(pk=task.pk)
        return run_backfill(plan_backfill(fresh, T0, end), app=app).inserted

    # chunks of 2 runs, so that the racers take turns within the range
    with override_settings(
        DRIFTSAFE_INTERNALS={**settings.DRIFTSAFE_INTERNALS, "PUBLISH_BATCH_SIZE": 2}
    ):
        counts = at_once(3, racer)
    assert sum(counts) == 30
    slots = list(Run.objects.values_list("slot", flat=True))
    assert sorted(slots) == [T0 + k * M for k in range(30)]
    kinds = set(Run.objects.values_list("kind", flat=True))
    assert kinds <= {RunKind.BACKFILL, RunKind.SCHEDULED}
    messages = drain(QUEUE)
    assert sorted(m["id"] for m in messages) == sorted(
        celery_task_id(task.pk, slot) for slot in slots
    )


# -- the admin ---------------------------------------------------------------------------------

TASKS = "/admin/celery_driftsafe/periodictask/"
RUNS = "/admin/celery_driftsafe/run/"


def _post(client: Any, task: PeriodicTask, **fields: str) -> Any:
    data = {"action": "backfill", "_selected_action": [task.pk], **fields}
    return client.post(TASKS, data, follow=True)


@pytest.mark.django_db(transaction=True)
def test_admin_action_lists_runs_and_skips_and_writes_nothing_before_confirming(
    admin_client: Any, app: Any
) -> None:
    task = _task()
    taken = Run.objects.create(
        periodic_task=task, task_name=task.task, slot=T0 + M, status=RunStatus.SUCCEEDED
    )
    page = _post(admin_client, task).content.decode()
    assert "Backfill past slots" not in page and 'name="backfill_from"' in page
    range_ = {"backfill_from": T0.isoformat(), "backfill_to": (T0 + 3 * M).isoformat()}
    listed = _post(admin_client, task, backfill_step="list", **range_)
    text = listed.content.decode()
    assert "2 slots to run, 1 skipped" in text
    assert T0.isoformat() in text and (T0 + 2 * M).isoformat() in text
    assert f"skipped: run #{taken.pk} (scheduled, succeeded)" in text
    assert "Run the backfill (2 runs)" in text
    assert Run.objects.count() == 1 and drain(QUEUE) == []
    # a bad instant or range is an error on the page, nothing written
    bad = _post(admin_client, task, backfill_step="confirm", backfill_from="soon", backfill_to="x")
    assert "not an ISO 8601 instant" in bad.content.decode() and Run.objects.count() == 1
    done = _post(admin_client, task, backfill_step="confirm", **range_)
    messages = [str(m) for m in done.context["messages"]]
    assert any("2 runs inserted, 2 published, 1 skipped" in m for m in messages)
    backfilled = Run.objects.filter(kind=RunKind.BACKFILL)
    assert sorted(r.slot for r in backfilled) == [T0, T0 + 2 * M]
    assert all(r.claimed_by.startswith("backfill:admin:admin:") for r in backfilled)
    assert len(drain(QUEUE)) == 2


@pytest.mark.django_db
def test_admin_action_takes_one_task_at_a_time(admin_client: Any, app: Any) -> None:
    tasks = [_task("one"), _task("two")]
    response = admin_client.post(
        TASKS, {"action": "backfill", "_selected_action": [t.pk for t in tasks]}, follow=True
    )
    assert any("one task at a time" in str(m) for m in response.context["messages"])


@pytest.mark.django_db
def test_run_list_filters_backfill_runs(admin_client: Any, app: Any) -> None:
    task = _task()
    scheduled = Run.objects.create(periodic_task=task, task_name=task.task, slot=T0)
    backfilled = Run.objects.create(
        periodic_task=task, task_name=task.task, slot=T0 + M, kind=RunKind.BACKFILL
    )
    page = admin_client.get(RUNS, {"kind__exact": "backfill"}).content.decode()
    assert f"#{backfilled.pk}<" in page or f"#{backfilled.pk} " in page
    assert f"#{scheduled.pk}<" not in page and f"#{scheduled.pk} " not in page
    assert "Backfill" in admin_client.get(RUNS).content.decode()


@pytest.mark.django_db(transaction=True)
def test_inside_a_transaction_the_runs_are_published_when_it_commits(app: Any) -> None:
    from django.db import transaction

    task = _task()
    with transaction.atomic():
        result = run_backfill(plan_backfill(task, T0, T0 + 3 * M), app=app)
        assert result.deferred == 3 and result.published == 0
        assert drain(QUEUE) == []
    assert len(drain(QUEUE)) == 3
    assert Run.objects.filter(kind=RunKind.BACKFILL, status=RunStatus.DISPATCHED).count() == 3


@pytest.mark.django_db(transaction=True)
def test_runs_of_a_backfill_that_died_before_publishing_are_published_by_the_outbox(
    app: Any,
) -> None:
    """A backfill killed between a chunk's insert and its publish leaves that chunk claimed:
    a beat's outbox publishes each run once, after the lease, under its slot's task id."""
    task = _task()
    slots = plan_backfill(task, T0, T0 + 3 * M).to_run
    mine = _insert(task, slots, run_message(task), T0, backfill_actor("killed"), "default")
    assert [run.status for run in mine] == [RunStatus.CLAIMED] * 3
    lease = timedelta(seconds=30)
    assert reclaim_stale(T0 + 29 * S, "beat", lease=lease) == []
    taken = reclaim_stale(T0 + 31 * S, "beat", lease=lease)
    assert sorted(run.slot for run in taken) == slots
    clock = FakeClock(T0 + 31 * S)
    with inject_authority_clock(clock):
        assert len(Dispatcher(app, clock).dispatch(taken).published) == 3
    assert sorted(m["id"] for m in drain(QUEUE)) == sorted(
        celery_task_id(task.pk, slot) for slot in slots
    )
    assert reclaim_stale(T0 + 99 * S, "beat", lease=lease) == []
