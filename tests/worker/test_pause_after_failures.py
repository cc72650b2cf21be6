"""Pause after failures with a real in-process Celery worker (the fixtures of
:mod:`tests.worker.test_celery_features`): only a run's last attempt counts, and a plain task's
failures (no base class) count as the base class's do."""

from __future__ import annotations

from typing import Any

from celery_driftsafe.models import PeriodicTask, RunStatus
from tests.support.factories import finished, new_run
from tests.worker import test_celery_features as features

pytestmark = features.pytestmark
make_env = features.make_env  # the fixture: an in-process worker with the module's tasks


def _limit(run: Any, pause: int) -> PeriodicTask:
    PeriodicTask.objects.filter(pk=run.periodic_task_id).update(pause_after_failures=pause)
    return PeriodicTask.objects.get(pk=run.periodic_task_id)


def test_attempts_ending_in_a_retry_are_no_failures(make_env: Any) -> None:
    """``sem.auto`` fails three attempts (two retries, then the last): one failed run, one
    failure counted; a limit of 2 is not reached."""
    env = make_env()
    run = new_run("sem.auto", "scheduled")
    task = _limit(run, 2)
    env.publish_run(run, ["a"])
    run = finished(run)
    assert run.status == RunStatus.FAILED and run.attempt == 2
    task.refresh_from_db()
    assert (task.enabled, task.consecutive_failures) == (True, 1)


def test_a_plain_tasks_failed_run_counts_and_pauses(make_env: Any) -> None:
    env = make_env(backend=None)
    run = new_run("sem.broken", "scheduled")
    task = _limit(run, 1)
    env.publish_run(run, ["b"])
    assert finished(run).status == RunStatus.FAILED
    task.refresh_from_db()
    assert (task.enabled, task.consecutive_failures) == (False, 1)
    assert "paused after 1 failed or missed runs in a row" in task.disabled_reason
