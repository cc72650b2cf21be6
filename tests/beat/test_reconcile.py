"""Runs of plain tasks (no base class records an outcome) leave ``dispatched`` through the
beats' reconciliation: by expiry, or from the result backend. A project firing a thousand plain
task runs a minute must see them settle as fast as they come, not 200 a minute while the rest
pile up. Real database, real Redis result backend, django-celery-results' own tables."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from celery import Celery, states

from celery_driftsafe.beat.recovery import BackgroundReconciler, reconcile
from celery_driftsafe.models import PeriodicTask, Run, RunStatus
from tests import settings as test_settings
from tests.skip_guard import configuration
from tests.support import T0
from tests.support.factories import at_once, interval_task

pytestmark = pytest.mark.django_db(transaction=True)  # a reconciler's pass has its own thread

S = timedelta(seconds=1)
LEASE = timedelta(seconds=30)
#: More runs than one statement settles, so that a pass has to go on to the next batch.
MANY = 1_200


def _waiting(
    task: PeriodicTask, count: int, *, status: str = RunStatus.DISPATCHED, **fields: Any
) -> list[Run]:
    Run.objects.bulk_create(
        Run(
            periodic_task=task,
            task_name="tests.plain",
            slot=T0 + i * S,
            status=status,
            claimed_at=T0 + i * S,
            celery_task_id=f"plain-{task.pk}-{i}",
            **fields,
        )
        for i in range(count)
    )
    return list(Run.objects.filter(periodic_task=task).order_by("slot"))


@pytest.fixture
def redis_results(redis_client: Any) -> Iterator[Celery]:
    app = Celery(
        "driftsafe-results",
        broker="memory://",
        backend=f"{test_settings.REDIS_URL}",
        set_as_current=False,
    )
    app.conf.result_expires = None  # stored with SET (redis-py warns that SETEX is deprecated)
    yield app
    app.backend.client.close()


def test_one_pass_expires_every_run_past_its_expiry_not_only_the_first_batch() -> None:
    task = interval_task("t", 1, anchor=T0)
    runs = _waiting(task, MANY, expires_at=T0 + timedelta(hours=1))
    fresh = _waiting(interval_task("fresh", 1, anchor=T0), 3, expires_at=T0 + timedelta(days=2))
    done = reconcile(T0 + timedelta(hours=2), lease=LEASE)
    assert sorted(done.expired) == sorted(run.pk for run in runs)
    assert set(Run.objects.filter(periodic_task=task).values_list("status", flat=True)) == {
        RunStatus.EXPIRED
    }
    expired = Run.objects.filter(periodic_task=task).first()
    assert expired is not None and expired.finished_at == T0 + timedelta(hours=2)
    # the expiry instant, in the database's text form of a timestamp
    assert (T0 + timedelta(hours=1)).strftime("%Y-%m-%d %H:%M:%S") in expired.error, expired.error
    assert all(
        run.status == RunStatus.DISPATCHED
        for run in Run.objects.filter(pk__in=[r.pk for r in fresh])
    )


def test_claimed_and_dispatched_runs_expire_in_one_pass_and_so_do_runs_made_by_hand() -> None:
    """A few expired runs of one status do not end the pass before the other status; a row
    without a claim instant (written by hand) expires too."""
    claimed = _waiting(interval_task("c", 1, anchor=T0), 3, status=RunStatus.CLAIMED)
    dispatched = _waiting(interval_task("d", 1, anchor=T0), 3)
    by_hand = Run.objects.create(
        task_name="tests.plain", slot=T0, status=RunStatus.DISPATCHED, expires_at=T0
    )
    Run.objects.exclude(pk=by_hand.pk).update(expires_at=T0 + timedelta(hours=1))
    done = reconcile(T0 + timedelta(hours=2), lease=LEASE)
    assert sorted(done.expired) == sorted(r.pk for r in [*claimed, *dispatched, by_hand])


def test_a_pass_stops_at_its_time_budget_and_the_next_goes_on() -> None:
    task = interval_task("t", 1, anchor=T0)
    _waiting(task, MANY, expires_at=T0 + timedelta(hours=1))
    first = reconcile(T0 + timedelta(hours=2), lease=LEASE, budget=0.0)
    assert 0 < len(first.expired) < MANY  # one batch, then the budget is spent
    second = reconcile(T0 + timedelta(hours=2), lease=LEASE)
    assert len(first.expired) + len(second.expired) == MANY
    assert not set(first.expired) & set(second.expired)


def test_outcomes_come_from_a_redis_result_backend_in_batches(redis_results: Celery) -> None:
    task = interval_task("t", 1, anchor=T0)
    runs = _waiting(task, MANY)
    outcomes = {states.SUCCESS: RunStatus.SUCCEEDED, states.FAILURE: RunStatus.FAILED}
    for i, run in enumerate(runs[:-1]):  # the last one has no record: it stays
        state = states.FAILURE if i % 10 == 0 else states.SUCCESS
        redis_results.backend.store_result(
            run.celery_task_id, ValueError("boom") if state == states.FAILURE else i, state
        )

    def one_at_a_time(key: Any) -> Any:
        raise AssertionError(f"read one key at a time: {key!r}")

    redis_results.backend.get = one_at_a_time  # a batch is one MGET
    done = reconcile(T0 + timedelta(hours=2), lease=LEASE, app=redis_results)
    assert len(done.from_results) == MANY - 1
    by_id = dict(Run.objects.filter(periodic_task=task).values_list("pk", "status"))
    for i, run in enumerate(runs[:-1]):
        assert by_id[run.pk] == outcomes[states.FAILURE if i % 10 == 0 else states.SUCCESS]
    assert by_id[runs[-1].pk] == RunStatus.DISPATCHED
    failed = Run.objects.get(pk=runs[0].pk)
    assert failed.error == "outcome taken from the result backend: FAILURE"
    assert failed.finished_at == T0 + timedelta(hours=2)


def test_outcomes_come_from_django_celery_results_tables() -> None:
    from django_celery_results.models import TaskResult

    app = Celery(
        "driftsafe-db-results", broker="memory://", backend="django-db", set_as_current=False
    )
    task = interval_task("t", 1, anchor=T0)
    runs = _waiting(task, 5)
    for run in runs[:4]:
        TaskResult.objects.create(task_id=run.celery_task_id, status=states.SUCCESS)
    TaskResult.objects.create(task_id=runs[4].celery_task_id, status=states.STARTED)
    done = reconcile(T0 + timedelta(hours=2), lease=LEASE, app=app)
    assert sorted(done.from_results) == sorted(run.pk for run in runs[:4])
    assert Run.objects.get(pk=runs[4].pk).status == RunStatus.DISPATCHED  # still running


def test_runs_the_backend_knows_nothing_of_do_not_hide_the_runs_behind_them(
    redis_results: Celery,
) -> None:
    """The oldest stuck runs have no record (a task with ``ignore_result``, say): passes go on
    past them to the runs that have one, instead of reading the same ones every minute."""
    silent = _waiting(interval_task("silent", 1, anchor=T0), MANY)
    later = interval_task("later", 1, anchor=T0)
    Run.objects.bulk_create(
        Run(
            periodic_task=later,
            task_name="tests.plain",
            slot=T0 + timedelta(minutes=30) + i * S,
            status=RunStatus.DISPATCHED,
            claimed_at=T0 + timedelta(minutes=30) + i * S,
            celery_task_id=f"later-{i}",
        )
        for i in range(10)
    )
    for i in range(10):
        redis_results.backend.store_result(f"later-{i}", i, states.SUCCESS)
    reconciler = BackgroundReconciler(app=redis_results, monotonic=lambda: 0.0, budget=0.0)
    settled: list[int] = []
    for _ in range(2 * MANY // 500 + 2):  # a pass of one batch each: the budget is spent
        reconciler.next_at = 0.0
        reconciler.maybe_start(T0 + timedelta(hours=2))
        reconciler.join()
        assert reconciler.last is not None
        settled += reconciler.last.from_results
    assert len(settled) == 10
    assert Run.objects.filter(periodic_task=later, status=RunStatus.SUCCEEDED).count() == 10
    assert (
        Run.objects.filter(pk__in=[r.pk for r in silent], status=RunStatus.DISPATCHED).count()
        == MANY
    )


def test_look_ups_that_settle_nothing_stop_early(
    redis_results: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runs the backend knows nothing of are read again each time round until they expire:
    a pass gives them a small share of its time, not its whole budget."""
    from celery_driftsafe.beat import recovery as module

    _waiting(interval_task("silent", 1, anchor=T0), MANY)
    monkeypatch.setattr(module, "RECONCILE_IDLE_SECONDS", 0.0)
    done = reconcile(T0 + timedelta(hours=2), lease=LEASE, app=redis_results)
    first = Run.objects.filter(status=RunStatus.DISPATCHED).order_by("claimed_at", "pk")[499]
    assert done.backend_after == (first.claimed_at, first.pk)  # one batch read, then stopped
    monkeypatch.setattr(module, "RECONCILE_IDLE_SECONDS", 60.0)
    assert reconcile(T0 + timedelta(hours=2), lease=LEASE, app=redis_results).backend_after is None


def test_beats_reconciling_at_once_settle_each_run_once() -> None:
    """Two beats' passes over the same backlog at the same moment: every run is expired once,
    by one of them, and neither fails (each change is conditional on the status it read)."""
    from django.db import connection

    if connection.vendor == "sqlite":
        pytest.skip(configuration("SQLite serialises writers: nothing runs at once"))
    task = interval_task("t", 1, anchor=T0)
    runs = _waiting(task, 5 * MANY, expires_at=T0 + timedelta(hours=1))
    results = at_once(2, lambda n: reconcile(T0 + timedelta(hours=2, microseconds=n), lease=LEASE))
    first, second = (set(result.expired) for result in results)
    assert not first & second
    assert first | second == {run.pk for run in runs}


def test_a_stopping_beat_ends_its_pass_after_the_batch_in_flight() -> None:
    import threading

    task = interval_task("t", 1, anchor=T0)
    _waiting(task, MANY, expires_at=T0 + timedelta(hours=1))
    stopping = threading.Event()
    stopping.set()
    done = reconcile(T0 + timedelta(hours=2), lease=LEASE, stop=stopping)
    assert len(done.expired) == 500  # one batch, not the pass's 20 s
    reconciler = BackgroundReconciler(app=None, monotonic=lambda: 0.0)
    reconciler.close()
    assert not reconciler.maybe_start(T0 + timedelta(hours=2))  # a closed one starts none


def test_a_plain_tasks_outcome_is_taken_a_minute_after_its_claim_not_an_hour(
    redis_results: Celery,
) -> None:
    """``RESULT_LOOKUP_SECONDS`` (60 s): a run claimed 90 s ago with an outcome in the backend
    takes it; one claimed 30 s ago is left for the next pass (a worker may still be on it)."""
    task = interval_task("t", 1, anchor=T0)
    older, newer = _waiting(task, 2)
    now = older.claimed_at + timedelta(seconds=90)
    Run.objects.filter(pk=newer.pk).update(claimed_at=now - timedelta(seconds=30))
    for run in (older, newer):
        redis_results.backend.store_result(run.celery_task_id, 1, states.SUCCESS)
    done = reconcile(now, lease=LEASE, app=redis_results)
    assert done.from_results == [older.pk]
    assert Run.objects.get(pk=newer.pk).status == RunStatus.DISPATCHED


def test_an_app_without_a_result_backend_reads_no_runs_for_it() -> None:
    """No result backend (Celery's default): the pass asks nothing about the runs, where it
    read and locked a batch only to find that out."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    app = Celery("driftsafe-no-results", broker="memory://", set_as_current=False)
    _waiting(interval_task("t", 1, anchor=T0), 3)
    with CaptureQueriesContext(connection) as without_app:
        reconcile(T0 + timedelta(hours=2), lease=LEASE)
    with CaptureQueriesContext(connection) as with_app:
        done = reconcile(T0 + timedelta(hours=2), lease=LEASE, app=app)
    assert len(with_app) == len(without_app), [q["sql"] for q in with_app]
    assert done.from_results == [] and done.backend_after is None


def test_outcomes_from_the_backend_are_logged_at_info_an_expiry_warns(
    redis_results: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    """A plain task's runs take the backend's outcome every minute: that is no warning."""
    import logging

    task = interval_task("t", 1, anchor=T0)
    (run,) = _waiting(task, 1)
    redis_results.backend.store_result(run.celery_task_id, 1, states.SUCCESS)
    with caplog.at_level(logging.INFO, logger="celery_driftsafe.reconcile"):
        reconcile(T0 + timedelta(hours=2), lease=LEASE, app=redis_results)
        _waiting(interval_task("late", 1, anchor=T0), 1, expires_at=T0)
        reconcile(T0 + timedelta(hours=2), lease=LEASE, app=redis_results)
    said = [(r.levelname, r.getMessage()) for r in caplog.records if "reconciled" in r.getMessage()]
    assert [level for level, _ in said] == ["INFO", "WARNING"]
    assert "1 from the result backend" in said[0][1] and "1 expired" in said[1][1]
