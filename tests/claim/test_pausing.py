"""Pause after failures (``pause_after_failures``), against the real database and Redis: runs
ended by :class:`~celery_driftsafe.task.DriftSafeTask` deliveries in-process (the worker's own
path), real races between threads, and real claim rounds recording missed slots."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import connection
from django.test import override_settings

from celery_driftsafe.claim.claimers import CompareAndSwapClaimer, SkipLockedClaimer
from celery_driftsafe.claim.pausing import count_outcome
from celery_driftsafe.models import PeriodicTask, Run, RunKind, RunStatus
from celery_driftsafe.signals import task_paused
from tests.skip_guard import configuration
from tests.support import T0
from tests.support.factories import at_once, interval_task

pytestmark = pytest.mark.django_db(transaction=True)

S = timedelta(seconds=1)


@pytest.fixture
def paused() -> Iterator[list[dict[str, Any]]]:
    """What each ``task_paused`` signal carried (the task as the receiver saw it)."""
    got: list[dict[str, Any]] = []

    def receiver(sender: Any, task: PeriodicTask, reason: str, failures: int, **_: Any) -> None:
        got.append(
            {
                "sender": sender,
                "name": task.name,
                "enabled": task.enabled,
                "reason": reason,
                "failures": failures,
            }
        )

    task_paused.connect(receiver, weak=False, dispatch_uid="test-paused")
    yield got
    task_paused.disconnect(dispatch_uid="test-paused")


def _task(name: str, pause: int | None, **fields: Any) -> PeriodicTask:
    fields.setdefault("task", "tests.record")
    fields.setdefault("args", [])
    return interval_task(name, 60, anchor=T0, pause_after_failures=pause, **fields)


def _run(task: PeriodicTask, k: int) -> Run:
    return Run.objects.create(
        periodic_task=task,
        kind=RunKind.SCHEDULED,
        slot=T0 + k * 60 * S,
        task_name=task.task,
        status=RunStatus.DISPATCHED,
        celery_task_id=str(uuid.uuid4()),
    )


@contextmanager
def delivery(task: Any, run: Run) -> Iterator[None]:
    """The request a worker builds for the run's message."""
    task.push_request(
        id=run.celery_task_id,
        hostname="worker-1",
        delivery_info={},
        args=[],
        kwargs={},
        driftsafe_run_id=run.pk,
        driftsafe_fencing_token=0,
        driftsafe_periodic_task_id=run.periodic_task_id,
    )
    try:
        yield
    finally:
        task.pop_request()


def deliver(record: Any, run: Run, value: str) -> None:
    """Deliver ``run`` to the ``record`` task's body with ``value`` (``"boom"`` raises)."""
    with delivery(record, run):
        try:
            record(value)
        except ValueError:
            assert value == "boom"


def _state(task: PeriodicTask) -> tuple[bool, int, str]:
    task.refresh_from_db()
    return task.enabled, task.consecutive_failures, task.disabled_reason


def test_n_failed_runs_in_a_row_pause_the_task_once_and_a_success_starts_again(
    record: Any, paused: list[dict[str, Any]]
) -> None:
    task = _task("flaky", 3)
    runs = [_run(task, k) for k in range(7)]
    deliver(record, runs[0], "boom")
    deliver(record, runs[1], "boom")
    assert _state(task) == (True, 2, "")
    deliver(record, runs[2], "fine")  # a success: the count starts again
    assert _state(task) == (True, 0, "")
    for run in runs[3:6]:
        deliver(record, run, "boom")
    enabled, count, reason = _state(task)
    assert (enabled, count) == (False, 3)
    assert reason.startswith("disabled by the scheduler: paused after 3 failed or missed runs")
    assert "(pause_after_failures=3)" in reason
    assert task.next_slot_at is None and task.due_at is None  # as the claim leaves it
    assert [p["failures"] for p in paused] == [3]
    assert paused[0]["sender"] is PeriodicTask
    assert paused[0]["name"] == "flaky" and paused[0]["enabled"] is False
    assert paused[0]["reason"] == reason
    # A run already under way when the task paused still ends failed, and counts nothing.
    deliver(record, runs[6], "boom")
    assert Run.objects.get(pk=runs[6].pk).status == RunStatus.FAILED
    assert _state(task)[:2] == (False, 3) and len(paused) == 1


def test_without_pause_after_failures_nothing_is_counted_or_paused(
    record: Any, paused: list[dict[str, Any]]
) -> None:
    never, zero = _task("never", None), _task("zero", 0)
    for task in (never, zero):
        for k in range(4):
            deliver(record, _run(task, k), "boom")
        assert _state(task) == (True, 0, "")
    assert paused == []


def test_skipped_expired_and_revoked_neither_count_nor_reset() -> None:
    task = _task("mixed", 5)
    runs = [_run(task, k) for k in range(5)]
    now = T0 + 10 * 60 * S
    for run in runs:
        Run.objects.filter(pk=run.pk).update(status=RunStatus.FAILED)
    count_outcome("default", runs[0].pk, RunStatus.FAILED, now)
    for status in (RunStatus.SKIPPED, RunStatus.EXPIRED, RunStatus.REVOKED, RunStatus.RETRYING):
        count_outcome("default", runs[1].pk, status, now)
    assert _state(task) == (True, 1, "")
    count_outcome("default", runs[2].pk, RunStatus.FAILED, now)
    assert _state(task) == (True, 2, "")


def test_failures_ending_at_once_on_many_workers_are_all_counted(record: Any) -> None:
    """Eight deliveries of eight runs, failing at once in eight threads: every one counted
    (an ``UPDATE … + 1`` each; a read-then-write would lose some)."""
    task = _task("crowd", 100)
    runs = [_run(task, k) for k in range(8)]
    at_once(8, lambda n: deliver(record, runs[n], "boom"))
    assert set(Run.objects.filter(periodic_task=task).values_list("status", flat=True)) == {
        RunStatus.FAILED
    }
    assert _state(task) == (True, 8, "")


def test_of_failures_ending_at_once_past_the_limit_one_pauses_and_signals(
    record: Any, paused: list[dict[str, Any]]
) -> None:
    task = _task("stampede", 5)
    runs = [_run(task, k) for k in range(8)]
    at_once(8, lambda n: deliver(record, runs[n], "boom"))
    enabled, count, reason = _state(task)
    assert (enabled, count) == (False, 5)  # the failures after the pause count nothing
    assert "paused after 5 failed or missed runs" in reason
    assert [p["failures"] for p in paused] == [5]


def test_the_metric_counts_each_pause(record: Any) -> None:
    from prometheus_client import REGISTRY

    name = "driftsafe_tasks_paused_total"
    task = _task("metered", 2)
    before = REGISTRY.get_sample_value(name, {"task": "metered"}) or 0.0
    with override_settings(DRIFTSAFE={**settings.DRIFTSAFE, "WORKER_METRICS_PORT": 0}):
        for k in range(3):
            deliver(record, _run(task, k), "boom")
    assert REGISTRY.get_sample_value(name, {"task": "metered"}) == before + 1


def test_a_receiver_that_raises_is_logged_and_the_pause_stands(
    record: Any, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(**_: Any) -> None:
        raise RuntimeError("alerting is down")

    task_paused.connect(broken, weak=False, dispatch_uid="test-broken")
    try:
        task = _task("alerting", 1)
        deliver(record, _run(task, 0), "boom")
    finally:
        task_paused.disconnect(dispatch_uid="test-broken")
    assert _state(task)[:2] == (False, 1)
    assert any(
        getattr(r, "action", None) == "pause-receiver-failed" and "alerting is down" in r.message
        for r in caplog.records
    )


# -- re-enabling --------------------------------------------------------------------------------


def _paused_task(record: Any, name: str) -> PeriodicTask:
    task = _task(name, 1)
    deliver(record, _run(task, 0), "boom")
    assert _state(task)[:2] == (False, 1)
    return task


def test_re_enabling_by_save_or_update_clears_the_count(record: Any) -> None:
    saved = _paused_task(record, "saved")
    saved.enabled = True
    saved.save()
    assert _state(saved) == (True, 0, "")
    assert saved.next_slot_at is not None  # scheduled again
    updated = _paused_task(record, "updated")
    PeriodicTask.objects.filter(pk=updated.pk).update(enabled=True)
    assert _state(updated)[:2] == (True, 0)
    # A save that does not re-enable leaves the count to the scheduler: an instance loaded
    # before a failure does not write its stale count back.
    task = _task("stale-instance", 3)
    loaded = PeriodicTask.objects.get(pk=task.pk)
    deliver(record, _run(task, 0), "boom")
    loaded.description = "edited"
    loaded.save()
    assert _state(task) == (True, 1, "")


@pytest.mark.parametrize("value", [-1, "3", 2.5, True])
def test_pause_after_failures_must_be_a_whole_number(value: Any) -> None:
    task = PeriodicTask(
        name="bad",
        task="tests.add",
        schedule_kind="interval",
        interval_every=5,
        interval_anchor=T0,
        pause_after_failures=value,
    )
    with pytest.raises(ValidationError) as info:
        task.clean()
    messages = info.value.message_dict["pause_after_failures"]
    assert "whole number of failed or missed runs in a row" in messages[0]


# -- missed slots (the claim) ------------------------------------------------------------------


def _claimer(kind: str) -> Any:
    if kind == "cas" and connection.vendor == "mysql":
        pytest.skip(configuration("MySQL has no UPDATE … RETURNING (the cas claimer)"))
    if kind == "skip_locked" and not connection.features.has_select_for_update_skip_locked:
        pytest.skip(configuration(f"{connection.vendor} has no SKIP LOCKED"))
    return CompareAndSwapClaimer() if kind == "cas" else SkipLockedClaimer()


@pytest.mark.parametrize("kind", ["cas", "skip_locked"])
def test_missed_slots_with_no_run_fired_count_one_each_and_pause(
    kind: str, paused: list[dict[str, Any]]
) -> None:
    """Policy ``skip`` after a downtime of four slots (the latest past the grace): four missed
    slots, nothing fires, the task with a limit of 3 is paused by the claim, and no later
    round claims it. With a limit of 10 the same four count and the task goes on."""
    claimer = _claimer(kind)
    strict = _task("strict", 3, misfire_policy="skip", misfire_grace_seconds=5)
    lenient = _task("lenient", 10, misfire_policy="skip", misfire_grace_seconds=5)
    for task in (strict, lenient):
        PeriodicTask.objects.filter(pk=task.pk).update(next_slot_at=T0)
    now = T0 + 3 * 60 * S + 30 * S
    result = claimer.claim(now, "node", busy_since=now)
    assert result.runs == [] and result.missed == 8
    enabled, count, reason = _state(strict)
    assert (enabled, count) == (False, 4)
    assert "paused after 4 failed or missed runs in a row (pause_after_failures=3)" in reason
    assert strict.next_slot_at is None
    assert [(p["name"], p["failures"]) for p in paused] == [("strict", 4)]
    assert _state(lenient) == (True, 4, "")
    later = claimer.claim(now + 10 * 60 * S, "node", busy_since=now)
    assert all(r.periodic_task_id != strict.pk for r in later.runs)
    assert not Run.objects.filter(periodic_task=strict, slot__gt=T0 + 3 * 60 * S).exists()


@pytest.mark.parametrize("kind", ["cas", "skip_locked"])
def test_a_catch_up_run_stands_for_the_slots_it_covers(
    kind: str, record: Any, paused: list[dict[str, Any]]
) -> None:
    """``fire_once`` after a downtime of a thousand slots: one run fires for them, so the
    missed slots do not count; the run's outcome does."""
    claimer = _claimer(kind)
    task = _task("catch-up", 3)  # the default policy, fire_once
    PeriodicTask.objects.filter(pk=task.pk).update(next_slot_at=T0)
    now = T0 + 1000 * 60 * S
    result = claimer.claim(now, "node", busy_since=now)
    assert len(result.runs) == 1 and result.missed == 1000
    assert _state(task) == (True, 0, "")
    catch_up = Run.objects.filter(pk=result.runs[0].run_id)
    catch_up.update(status=RunStatus.DISPATCHED, expires_at=None)  # as if published in time
    deliver(record, catch_up.get(), "boom")
    assert _state(task) == (True, 1, "")
    assert paused == []


# -- outcomes a beat's reconciliation gives -----------------------------------------------------


def test_runs_whose_worker_was_lost_count_and_pause(
    redis_client: Any, paused: list[dict[str, Any]]
) -> None:
    """Two started runs nobody holds a lock of, their worker gone: the reconciliation records
    them failed, and they count (here, to the limit of 2)."""
    from celery_driftsafe.beat.recovery import reconcile

    task = _task("abandoned", 2)
    runs = [_run(task, k) for k in range(2)]
    Run.objects.filter(pk__in=[r.pk for r in runs]).update(
        status=RunStatus.STARTED, started_at=T0, fencing_token=5, worker="gone"
    )
    done = reconcile(T0 + timedelta(hours=2), lease=timedelta(seconds=30))
    assert sorted(done.lost) == sorted(r.pk for r in runs)
    enabled, count, reason = _state(task)
    assert (enabled, count) == (False, 2) and "pause_after_failures=2" in reason
    assert [(p["name"], p["failures"]) for p in paused] == [("abandoned", 2)]


def test_a_run_the_worker_ended_for_a_hard_time_limit_counts() -> None:
    """What a worker's main process records when it killed a body (hard time limit) or lost
    its pool process: the run failed, and it counts."""
    from types import SimpleNamespace

    from celery_driftsafe.worker.request import record_from_worker

    task = _task("killed", 5)
    run = _run(task, 0)
    Run.objects.filter(pk=run.pk).update(status=RunStatus.STARTED, worker="worker-1")
    request = SimpleNamespace(
        id=run.celery_task_id,
        retries=0,
        hostname="worker-1",
        driftsafe_run_id=run.pk,
        driftsafe_fencing_token=0,
        driftsafe_periodic_task_id=task.pk,
    )
    assert record_from_worker(request, RunStatus.FAILED, "hard time limit", started_too=True)
    assert Run.objects.get(pk=run.pk).status == RunStatus.FAILED
    assert _state(task) == (True, 1, "")


def test_outcomes_read_from_the_result_backend_count_per_task(
    redis_client: Any, paused: list[dict[str, Any]]
) -> None:
    """A plain task's runs no worker recorded take the result backend's state at the
    reconciliation: its failures count, and its successes reset, a batch at a time."""
    from celery import Celery, states

    from celery_driftsafe.beat.recovery import reconcile
    from tests import settings as test_settings

    results = Celery("pause-results", broker="memory://", backend=test_settings.REDIS_URL)
    results.conf.result_expires = None
    failing, mending = _task("failing", 3), _task("mending", 3)
    PeriodicTask.objects.filter(pk=mending.pk).update(consecutive_failures=2)
    for task, state in ((failing, states.FAILURE), (mending, states.SUCCESS)):
        for k in range(3):
            run = _run(task, k)
            Run.objects.filter(pk=run.pk).update(claimed_at=T0 + k * S)
            result = ValueError("boom") if state == states.FAILURE else k
            results.backend.store_result(run.celery_task_id, result, state)
    try:
        reconcile(T0 + timedelta(hours=2), lease=timedelta(seconds=30), app=results)
    finally:
        results.backend.client.close()
    assert _state(failing)[:2] == (False, 3)
    assert _state(mending) == (True, 0, "")
    assert [(p["name"], p["failures"]) for p in paused] == [("failing", 3)]
