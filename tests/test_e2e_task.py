"""End-to-end: DriftSafeTask with real ``celery worker`` processes, real Redis and the real
database. Bodies record in Redis when they run to the end; the ledger says who won."""

from __future__ import annotations

import itertools
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests import settings as test_settings
from tests.e2e.harness import E2ERun

# One database is enough here (the worker's ledger statements on SQLite are covered in-process
# by tests/test_task_celery.py and tests/test_task.py): the suite must stay under 15 minutes.
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(test_settings.TEST_DB != "postgres", reason="runs on the PostgreSQL pass"),
]
BACKEND = "postgresql" if test_settings.TEST_DB == "postgres" else "sqlite"


def _wait(condition: Callable[[], Any], timeout: float, what: str, run: E2ERun) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}\n{run.logs()}")


def _publish(run: E2ERun, made: dict[str, Any], marker: str, seconds: float,
             copies: int = 1) -> None:
    app = run.publisher()
    headers = {"driftsafe_run_id": made["id"], "driftsafe_fencing_token": 0}
    with app.producer_or_acquire() as producer:
        for _ in range(copies):
            app.send_task("e2e.work", args=[marker, seconds], task_id=made["celery_task_id"],
                          headers=headers, producer=producer)
    app.close()


def _status(run: E2ERun, made: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = run.tool("run", {"id": made["id"]})
    return result


def test_same_run_delivered_five_times_to_two_workers_executes_once(tmp_path: Path) -> None:
    run = E2ERun(BACKEND, tmp_path, lease=3.0)
    try:
        run.start_worker("w1")
        run.start_worker("w2")
        made = run.tool("make_run", {"task": "e2e.work"})
        time.sleep(4)  # workers up
        _publish(run, made, "five", 1.5, copies=5)
        _wait(lambda: _status(run, made)["duplicates"] >= 4, 40, "4 duplicates counted", run)
        time.sleep(1)
        state = _status(run, made)
        print(f"\nrun after 5 deliveries to 2 workers: {state}")
        assert state["status"] == "succeeded"
        assert state["duplicates"] == 4
        assert [e["marker"] for e in run.executions()] == ["five"]
        assert "Traceback" not in run.logs()
    finally:
        run.close()


def test_worker_paused_past_its_lease_cannot_record_over_its_successor(tmp_path: Path) -> None:
    run = E2ERun(BACKEND, tmp_path, lease=2.0)
    try:
        first = run.start_worker("w1")
        made = run.tool("make_run", {"task": "e2e.work"})
        time.sleep(3)
        _publish(run, made, "paused", 4.0)
        _wait(lambda: _status(run, made)["status"] == "started", 20, "w1 to start", run)
        first.process.send_signal(signal.SIGSTOP)
        try:
            time.sleep(3.0)  # w1's lease (2 s) runs out while it is stopped
            run.start_worker("w2")
            time.sleep(3)
            _publish(run, made, "successor", 1.0)  # the redelivery reaches w2
            _wait(lambda: _status(run, made)["status"] == "succeeded", 30, "w2 to finish", run)
            successor = _status(run, made)
            assert successor["worker"].startswith("w2@")
        finally:
            first.process.send_signal(signal.SIGCONT)
        _wait(lambda: "discarded" in first.log.read_text(), 30, "w1's outcome discarded", run)
        final = _status(run, made)
        print(f"\nafter w1 resumed: {final}")
        assert final == successor, "the paused worker overwrote its successor's record"
        assert "outcome succeeded discarded" in first.log.read_text()
        # Both bodies ran to the end (w1's could not be stopped while paused): fencing makes
        # sure only the successor's outcome is recorded.
        assert sorted(e["marker"] for e in run.executions()) == ["paused", "successor"]
    finally:
        run.close()


def test_worker_killed_mid_run_is_retried_not_lost_not_doubled(tmp_path: Path) -> None:
    run = E2ERun(BACKEND, tmp_path, lease=2.0)
    try:
        worker = run.start_worker("w1", pool="prefork")
        made = run.tool("make_run", {"task": "e2e.work"})
        time.sleep(4)
        # The body runs 8 s: time for the test to see it started (each look is a Django
        # process, slow on a busy machine) and kill it mid-run, not after it ended.
        _publish(run, made, "killed", 8.0)
        _wait(lambda: _status(run, made)["status"] == "started", 20, "the run to start", run)
        children = subprocess.run(["pgrep", "-P", str(worker.process.pid)], capture_output=True,
                                  text=True, check=False).stdout.split()
        assert children, "prefork worker has no child process"
        for child in children:
            subprocess.run(["kill", "-KILL", child], check=False)
        _wait(lambda: _status(run, made)["status"] == "succeeded", 40, "the retry to finish", run)
        final = _status(run, made)
        print(f"\nafter the child was killed mid-run: {final}")
        assert final["fencing_token"] >= 2
        assert [e["marker"] for e in run.executions()] == ["killed"]
        assert "WorkerLostError" in worker.log.read_text()
    finally:
        run.close()


def test_overlap_skip_with_a_task_slower_than_its_interval(tmp_path: Path) -> None:
    """A beat fires a 1-second task whose body takes 2.5 s, to two workers: with overlap
    policy 'skip' no two runs overlap, and the slots that came while one ran are recorded
    skipped."""
    from datetime import datetime, timedelta

    from tests.e2e.harness import real_now

    run = E2ERun(BACKEND, tmp_path, lease=5.0)
    try:
        start = real_now() + timedelta(seconds=6)
        run.seed([{"name": "slow", "task": "e2e.work", "args": ["slow", 2.5],
                   "schedule_kind": "interval", "interval_every": 1,
                   "interval_unit": "seconds", "overlap_policy": "skip"}], start)
        run.start_worker("w1")
        run.start_worker("w2")
        run.start_beat(0.0)
        time.sleep(6 + 10)
        run.stop()
        time.sleep(4)  # the last run finishes
        runs = run.tool("dump")["runs"]
        ran = sorted(
            (datetime.fromisoformat(r["started"]), datetime.fromisoformat(r["finished"]))
            for r in runs if r["status"] == "succeeded"
        )
        skipped = [r for r in runs if r["status"] == "skipped"]
        print(f"\n{len(ran)} runs executed, {len(skipped)} slots skipped")
        assert len(ran) >= 3
        assert len(skipped) >= 5
        assert all("still running" in r["error"] for r in skipped)
        for (_, finished), (started, _) in itertools.pairwise(ran):
            assert started >= finished, f"runs overlap: {started} < {finished}"
        assert len(run.executions()) == len(ran)
    finally:
        run.close()


# -- Celery's own semantics with real workers ---------------------------------------------------


def _results_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **kwargs: Any) -> E2ERun:
    """An E2ERun whose workers store results in Redis (the run's broker database)."""
    results = f"{test_settings.REDIS_SERVER}/{test_settings.REDIS_DB + 2}"
    monkeypatch.setenv("DRIFTSAFE_E2E_RESULTS", results)
    return E2ERun(BACKEND, tmp_path, **kwargs)


def _send(run: E2ERun, made: dict[str, Any], task: str, args: list[Any],
          **options: Any) -> Any:
    from celery import Celery

    app = Celery("e2e-publisher", broker=run.env["DRIFTSAFE_E2E_BROKER"],
                 backend=run.env["DRIFTSAFE_E2E_RESULTS"], set_as_current=False)
    app.conf.task_default_queue = run.queue
    app.send_task(task, args=args, task_id=made["celery_task_id"],
                  headers={"driftsafe_run_id": made["id"], "driftsafe_fencing_token": 0},
                  **options)
    return app


@pytest.mark.filterwarnings("ignore:Call to deprecated setex:DeprecationWarning")
def test_retries_hop_between_two_workers_and_a_stale_copy_is_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = _results_run(tmp_path, monkeypatch, lease=3.0)
    try:
        run.start_worker("w1")
        run.start_worker("w2")
        made = run.tool("make_run", {"task": "e2e.flaky"})
        time.sleep(4)
        app = _send(run, made, "e2e.flaky", ["hop", 2])
        assert app.AsyncResult(made["celery_task_id"]).get(timeout=40) == "hop:2"
        state = _status(run, made)
        print(f"\nrun after two retries: {state}; attempts: {run.executions()}")
        assert state["status"] == "succeeded"
        assert [e["retries"] for e in run.executions()] == [0, 1, 2]
        # a redelivered copy of the first attempt (as after a visibility timeout)
        _send(run, made, "e2e.flaky", ["hop", 2]).close()
        _wait(lambda: _status(run, made)["duplicates"] == 1, 20, "the copy dropped", run)
        assert len(run.executions()) == 3
        assert app.AsyncResult(made["celery_task_id"]).get(timeout=5) == "hop:2"
        assert _status(run, made)["status"] == "succeeded"
        app.close()
    finally:
        run.close()


@pytest.mark.filterwarnings("ignore:Call to deprecated setex:DeprecationWarning")
def test_soft_and_hard_time_limits_are_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = _results_run(tmp_path, monkeypatch, lease=3.0)
    try:
        run.start_worker("w1", pool="prefork")
        soft = run.tool("make_run", {"task": "e2e.soft_limited"})
        hard = run.tool("make_run", {"task": "e2e.hard_limited"})
        time.sleep(4)
        app = _send(run, soft, "e2e.soft_limited", ["soft", 3.0])
        _send(run, hard, "e2e.hard_limited", ["hard", 3.0]).close()
        _wait(lambda: _status(run, soft)["status"] == "failed", 30, "soft limit recorded", run)
        _wait(lambda: _status(run, hard)["status"] == "failed", 30, "hard limit recorded", run)
        print(f"\nsoft: {_status(run, soft)}\nhard: {_status(run, hard)}")
        assert "SoftTimeLimitExceeded" in _status(run, soft)["error"]
        assert "hard time limit (1" in _status(run, hard)["error"]
        assert run.executions() == []  # neither body reached its end
        assert app.AsyncResult(soft["celery_task_id"]).state == "FAILURE"
        assert app.AsyncResult(hard["celery_task_id"]).state == "FAILURE"
        app.close()
    finally:
        run.close()


@pytest.mark.filterwarnings("ignore:Call to deprecated setex:DeprecationWarning")
def test_lost_pool_process_without_reject_on_worker_lost_is_recorded_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = _results_run(tmp_path, monkeypatch, lease=2.0)
    try:
        worker = run.start_worker("w1", pool="prefork")
        made = run.tool("make_run", {"task": "e2e.fragile"})
        time.sleep(4)
        app = _send(run, made, "e2e.fragile", ["lost", 3.0])
        _wait(lambda: _status(run, made)["status"] == "started", 20, "the run to start", run)
        children = subprocess.run(["pgrep", "-P", str(worker.process.pid)], capture_output=True,
                                  text=True, check=False).stdout.split()
        assert children, "prefork worker has no child process"
        for child in children:
            subprocess.run(["kill", "-KILL", child], check=False)
        _wait(lambda: _status(run, made)["status"] == "failed", 20, "the loss recorded", run)
        print(f"\nafter the pool process was lost: {_status(run, made)}")
        assert "worker lost" in _status(run, made)["error"]
        assert run.executions() == []
        assert app.AsyncResult(made["celery_task_id"]).state == "FAILURE"
        app.close()
    finally:
        run.close()

