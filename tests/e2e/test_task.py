"""End-to-end: DriftSafeTask with real ``celery worker`` processes, real Redis and the real
database. Bodies record in Redis when they run to the end; the ledger says who won."""

from __future__ import annotations

import itertools
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests import settings as test_settings
from tests.e2e.harness import Beat, E2ERun
from tests.skip_guard import configuration

# One database is enough here (the worker's ledger statements on SQLite are covered in-process
# by tests/worker/test_celery_features.py and tests/worker/test_task.py): the suite must stay
# under 10 minutes.
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        test_settings.TEST_DB != "postgres", reason=configuration("runs on the PostgreSQL pass")
    ),
]
BACKEND = "postgresql" if test_settings.TEST_DB == "postgres" else "sqlite"


def _ready(run: E2ERun, *workers: Beat) -> None:
    """Wait until each worker logged Celery's ``ready.`` line: it takes messages from then on
    (a fixed few seconds were too few on a loaded machine, and too many on an idle one)."""
    for worker in workers:
        run.wait_for(
            lambda w=worker: "ready." in w.log.read_text(), f"{worker.name} ready", timeout=60
        )


def _publish(
    run: E2ERun, made: dict[str, Any], marker: str, seconds: float, copies: int = 1
) -> None:
    app = run.publisher()
    headers = {"driftsafe_run_id": made["id"], "driftsafe_fencing_token": 0}
    with app.producer_or_acquire() as producer:
        for _ in range(copies):
            app.send_task(
                "e2e.work",
                args=[marker, seconds],
                task_id=made["celery_task_id"],
                headers=headers,
                producer=producer,
            )
    app.close()


def _status(run: E2ERun, made: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = run.tool("run", {"id": made["id"]})
    return result


def _body_started(run: E2ERun, made: dict[str, Any], workers: list[Beat]) -> bool:
    """Whether a worker began the run's body: its row says ``started``, or a worker logged
    that it received the message (a solo worker runs it at once). The log is read too because
    a look at the row goes through the run's helper process, which on a slow, loaded machine
    answered too late to see a 6-s body running."""
    received = f"[{made['celery_task_id']}] received"
    if any(received in worker.log.read_text() for worker in workers):
        return True
    return bool(_status(run, made)["status"] == "started")


def _skipping(name: str, seconds: float) -> dict[str, Any]:
    """A 1-second task, overlap policy ``skip``, whose body (``e2e.work``, marked ``name``)
    takes ``seconds``."""
    return {
        "name": name,
        "task": "e2e.work",
        "args": [name, seconds],
        "schedule_kind": "interval",
        "interval_every": 1,
        "interval_unit": "seconds",
        "overlap_policy": "skip",
    }


def _runs_once_ended(run: E2ERun, but: int | None = None) -> list[dict[str, Any]]:
    """Every run once none is still waiting or running (the runs of periodic task ``but``
    aside) and two looks in a row read them alike: a worker records a run's outcome, then its
    last attempt's row, and a look between the two (the looks are 0.1 s apart) saw the
    outcome without the row."""
    waiting = {"claimed", "dispatched", "started", "retrying"}
    last: list[list[dict[str, Any]]] = []

    def ended() -> list[dict[str, Any]] | None:
        runs: list[dict[str, Any]] = run.tool("dump")["runs"]
        watched = [r for r in runs if r["task_id"] != but]
        if any(r["status"] in waiting for r in watched):
            last.clear()
            return None
        settled = bool(last) and last[-1] == watched
        last[:] = [watched]
        return runs if settled else None

    result: list[dict[str, Any]] = run.wait_for(ended, "every run to end", timeout=30)
    return result


def _assert_one_body_at_a_time(executions: list[dict[str, Any]], marker: str, ran: int) -> None:
    """The bodies marked ``marker`` ran ``ran`` times, one after the other. Each worker
    process stamps the ledger on its own estimate of the authority's clock (off by up to half
    its best round trip, which a loaded machine makes long), so overlap is judged on the
    bodies' own stamps, taken on the one clock this machine's processes share."""
    bodies = sorted((e["began"], e["ended"]) for e in executions if e["marker"] == marker)
    assert len(bodies) == ran
    for (_, ended), (began, _) in itertools.pairwise(bodies):
        assert began >= ended, f"two bodies overlap: {began} < {ended}"


def test_same_run_delivered_five_times_to_two_workers_executes_once(tmp_path: Path) -> None:
    """One copy first; once a worker runs its body (6 s, and a solo worker takes nothing else
    meanwhile), four more: the other worker receives them while the body runs, and the first
    may take some after. Both workers receive a copy, the body runs once."""
    run = E2ERun(BACKEND, tmp_path, lease=3.0)
    try:
        workers = [run.start_worker("w1"), run.start_worker("w2")]
        made = run.tool("make_run", {"task": "e2e.work"})
        _ready(run, *workers)
        _publish(run, made, "five", 6.0)
        run.wait_for(lambda: _body_started(run, made, workers), "the body to start", timeout=20)
        _publish(run, made, "five", 6.0, copies=4)
        run.wait_for(
            lambda: _status(run, made)["duplicates"] >= 4, "4 duplicates counted", timeout=40
        )
        run.wait_for(
            lambda: _status(run, made)["status"] == "succeeded", "the body to end", timeout=20
        )
        state = _status(run, made)
        print(f"\nrun after 5 deliveries to 2 workers: {state}")
        received = f"Task e2e.work[{made['celery_task_id']}] received"
        copies = {w.name: w.log.read_text().count(received) for w in workers}
        print(f"copies received: {copies}")
        # (a copy that came while the body ran may be received again after a retry)
        assert all(copies.values()), f"a worker received no copy: {copies}"
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
        _ready(run, first)
        # The body runs 10 s, and the test sees it begin in Redis (a look at the ledger is a
        # Django process, which a loaded machine made outlast the body): w1 is stopped mid-run.
        _publish(run, made, "paused", 10.0)
        run.wait_for(lambda: "paused" in run.began(), "w1's body to begin", timeout=30)
        first.process.send_signal(signal.SIGSTOP)
        try:
            assert not run.executions(), "w1's body ended before w1 was stopped"
            assert _status(run, made)["status"] == "started"
            time.sleep(3.0)  # w1's lease (2 s) runs out while it is stopped
            _ready(run, run.start_worker("w2"))
            _publish(run, made, "successor", 1.0)  # the redelivery reaches w2
            run.wait_for(
                lambda: _status(run, made)["status"] == "succeeded", "w2 to finish", timeout=30
            )
            successor = _status(run, made)
            assert successor["worker"].startswith("w2@")
        finally:
            first.process.send_signal(signal.SIGCONT)
        run.wait_for(
            lambda: "discarded" in first.log.read_text(), "w1's outcome discarded", timeout=30
        )
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
        _ready(run, worker)
        # The body runs 8 s, and the test sees it begin in Redis (a look at the ledger is a
        # Django process, seconds on a loaded machine): it is killed mid-run.
        _publish(run, made, "killed", 8.0)
        run.wait_for(lambda: "killed" in run.began(), "the body to begin", timeout=30)
        children = subprocess.run(
            ["pgrep", "-P", str(worker.process.pid)], capture_output=True, text=True, check=False
        ).stdout.split()
        assert children, "prefork worker has no child process"
        assert not run.executions(), "the body ended before it was killed"
        for child in children:
            subprocess.run(["kill", "-KILL", child], check=False)
        run.wait_for(
            lambda: _status(run, made)["status"] == "succeeded", "the retry to finish", timeout=40
        )
        final = _status(run, made)
        print(f"\nafter the child was killed mid-run: {final}")
        assert final["fencing_token"] >= 2
        assert [e["marker"] for e in run.executions()] == ["killed"]
        assert "WorkerLostError" in worker.log.read_text()
    finally:
        run.close()


@pytest.mark.filterwarnings("ignore:Call to deprecated setex:DeprecationWarning")
def test_real_beat_overlap_skip_and_a_retrying_scheduled_task(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One real beat, two workers, three periodic tasks (one beat and its workers for all, to
    keep the suite short):

    * a 1-second task whose body takes 2.5 s, with overlap policy 'skip': no two runs
      overlap, and the slots that came while one ran are recorded skipped;
    * a 3-second task whose body calls ``self.retry(countdown=1)`` on its first attempt: per
      slot the body runs twice (attempt 0, then 1), the run ends ``succeeded`` at attempt 1
      with its first attempt recorded, and the result backend holds the body's return;
    * a 2-second plain task (no base class) whose results are ignored: the worker that ran
      each run records it ``succeeded`` (such runs used to end ``expired`` a day later).
    """
    from datetime import datetime, timedelta

    from tests.e2e.harness import real_now

    run = _results_run(tmp_path, monkeypatch, lease=5.0)
    try:
        run.start_worker("w1")
        run.start_worker("w2")
        run.start_beat(0.0)
        run.wait_until_claiming()  # the slots below fall due while the beat claims
        start = real_now() + timedelta(seconds=3)
        run.seed(
            [
                _skipping("slow", 2.5),
                {
                    "name": "retry-once",
                    "task": "e2e.retry_once",
                    "args": ["retry"],
                    "schedule_kind": "interval",
                    "interval_every": 3,
                    "interval_unit": "seconds",
                },
                {
                    "name": "plain",
                    "task": "e2e.quiet",
                    "schedule_kind": "interval",
                    "interval_every": 2,
                    "interval_unit": "seconds",
                },
            ],
            start,
        )
        time.sleep(max((start - real_now()).total_seconds(), 0) + 11)
        stopped = real_now()
        run.stop()
        ids = {t["name"]: t["id"] for t in run.tool("dump")["tasks"]}

        # the last slow run, the retries (the plain task's runs: see below)
        runs = _runs_once_ended(run, but=ids["plain"])
        plain = [r for r in runs if r["task_id"] == ids["plain"]]
        settle_by = stopped - timedelta(seconds=5)
        settled = [r for r in plain if datetime.fromisoformat(r["slot"]) < settle_by]
        print(f"plain task: {[(r['slot'], r['status']) for r in plain]}")
        assert len(settled) >= 3, plain
        for row in settled:  # claimed 5 s or more before the beat stopped: ran and recorded
            assert row["status"] == "succeeded", row
            assert row["error"] == "" and row["worker"] and row["started"] <= row["finished"], row
        executions = run.executions()

        slow = [r for r in runs if r["task_id"] == ids["slow"]]
        ran = sum(r["status"] == "succeeded" for r in slow)
        skipped = [r for r in slow if r["status"] == "skipped"]
        print(f"\n{ran} runs executed, {len(skipped)} slots skipped")
        assert ran >= 3
        assert len(skipped) >= 5
        assert all("still running" in r["error"] for r in skipped)
        _assert_one_body_at_a_time(executions, "slow", ran)

        retried = [r for r in runs if r["task_id"] == ids["retry-once"]]
        print(
            f"retrying task: {len(retried)} slots: "
            f"{[(r['slot'], r['status'], r['attempt_rows']) for r in retried]}"
        )
        assert len(retried) >= 3
        app = run.publisher()
        app.conf.result_backend = run.env["DRIFTSAFE_E2E_RESULTS"]
        for row in retried:
            bodies = [e for e in executions if e["marker"] == "retry" and e["run"] == row["id"]]
            assert [e["retries"] for e in bodies] == [0, 1], f"slot {row['slot']}: {bodies}"
            assert {datetime.fromisoformat(e["slot"]) for e in bodies} == {
                datetime.fromisoformat(row["slot"])
            }
            assert row["status"] == "succeeded", row
            assert row["attempt"] == 1
            assert row["attempt_rows"] == [[0, "retrying"], [1, "succeeded"]]
            assert app.AsyncResult(row["celery_task_id"]).get(timeout=5) == (
                f"retry:{bodies[0]['slot']}:1"
            )
        assert len([e for e in executions if e["marker"] == "retry"]) == 2 * len(retried)
        app.close()
    finally:
        run.close()


# -- Celery's own semantics with real workers ---------------------------------------------------


def _results_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **kwargs: Any) -> E2ERun:
    """An E2ERun whose workers store results in Redis (the run's broker database)."""
    results = f"{test_settings.REDIS_SERVER}/{test_settings.REDIS_DB + 2}"
    monkeypatch.setenv("DRIFTSAFE_E2E_RESULTS", results)
    return E2ERun(BACKEND, tmp_path, **kwargs)


def _send(run: E2ERun, made: dict[str, Any], task: str, args: list[Any], **options: Any) -> Any:
    from celery import Celery

    app = Celery(
        "e2e-publisher",
        broker=run.env["DRIFTSAFE_E2E_BROKER"],
        backend=run.env["DRIFTSAFE_E2E_RESULTS"],
        set_as_current=False,
    )
    app.conf.task_default_queue = run.queue
    app.send_task(
        task,
        args=args,
        task_id=made["celery_task_id"],
        headers={"driftsafe_run_id": made["id"], "driftsafe_fencing_token": 0},
        **options,
    )
    return app


@pytest.mark.filterwarnings("ignore:Call to deprecated setex:DeprecationWarning")
def test_retries_hop_between_two_workers_and_a_stale_copy_is_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = _results_run(tmp_path, monkeypatch, lease=3.0)
    try:
        workers = [run.start_worker("w1"), run.start_worker("w2")]
        made = run.tool("make_run", {"task": "e2e.flaky"})
        _ready(run, *workers)
        app = _send(run, made, "e2e.flaky", ["hop", 2])
        assert app.AsyncResult(made["celery_task_id"]).get(timeout=40) == "hop:2"
        state = _status(run, made)
        print(f"\nrun after two retries: {state}; attempts: {run.executions()}")
        assert state["status"] == "succeeded"
        assert [e["retries"] for e in run.executions()] == [0, 1, 2]
        # a redelivered copy of the first attempt (as after a visibility timeout)
        _send(run, made, "e2e.flaky", ["hop", 2]).close()
        run.wait_for(lambda: _status(run, made)["duplicates"] == 1, "the copy dropped", timeout=20)
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
        worker = run.start_worker("w1", pool="prefork")
        soft = run.tool("make_run", {"task": "e2e.soft_limited"})
        hard = run.tool("make_run", {"task": "e2e.hard_limited"})
        _ready(run, worker)
        app = _send(run, soft, "e2e.soft_limited", ["soft", 3.0])
        _send(run, hard, "e2e.hard_limited", ["hard", 3.0]).close()
        run.wait_for(
            lambda: _status(run, soft)["status"] == "failed", "soft limit recorded", timeout=30
        )
        run.wait_for(
            lambda: _status(run, hard)["status"] == "failed", "hard limit recorded", timeout=30
        )
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
        _ready(run, worker)
        # Killed once seen begun (in Redis: a look at the ledger is a Django process, seconds
        # on a loaded machine, and at 3 s the body once ended first); the body runs 10 s.
        app = _send(run, made, "e2e.fragile", ["lost", 10.0])
        run.wait_for(lambda: "lost" in run.began(), "the body to begin", timeout=30)
        children = subprocess.run(
            ["pgrep", "-P", str(worker.process.pid)], capture_output=True, text=True, check=False
        ).stdout.split()
        assert children, "prefork worker has no child process"
        assert not run.executions(), "the body ended before it was killed"
        for child in children:
            subprocess.run(["kill", "-KILL", child], check=False)
        run.wait_for(
            lambda: _status(run, made)["status"] == "failed", "the loss recorded", timeout=20
        )
        print(f"\nafter the pool process was lost: {_status(run, made)}")
        assert "worker lost" in _status(run, made)["error"]
        assert run.executions() == []
        assert app.AsyncResult(made["celery_task_id"]).state == "FAILURE"
        app.close()
    finally:
        run.close()


@pytest.mark.filterwarnings("ignore:Call to deprecated setex:DeprecationWarning")
def test_revoke_terminate_stops_a_running_body_in_a_prefork_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``revoke(terminate=True)`` while the body runs in a prefork pool process: the worker's
    main process (free while the body runs, unlike a solo worker's) kills the body, records
    the run ``revoked`` and stores ``REVOKED``. A copy delivered later to a worker that never
    heard of the revoke (a worker keeps revoked ids in memory) is dropped by the ledger."""
    import os

    import redis

    run = _results_run(tmp_path, monkeypatch, lease=2.0)
    try:
        first = run.start_worker("w1", pool="prefork")
        made = run.tool("make_run", {"task": "e2e.phased"})
        task_id = made["celery_task_id"]
        app = _send(run, made, "e2e.phased", ["revoked", 20.0])
        run.wait_for(lambda: run.executions(), "the body to begin", timeout=20)
        started = _status(run, made)
        assert started["status"] == "started"
        body_pid = run.executions()[0]["pid"]
        replies = app.control.revoke(task_id, terminate=True, reply=True, limit=1, timeout=10)
        assert replies == [{f"w1@e2e-{run.token}": {"ok": f"terminate: {task_id}"}}]
        run.wait_for(
            lambda: _status(run, made)["status"] == "revoked", "the run revoked", timeout=10
        )
        revoked = _status(run, made)
        print(f"\nafter revoke(terminate=True): {revoked}")
        assert revoked["error"] == "revoked: terminated by a revoke"
        assert revoked["fencing_token"] == started["fencing_token"]
        assert app.AsyncResult(task_id).state == "REVOKED"

        def body_gone() -> bool:
            try:
                os.kill(body_pid, 0)
            except ProcessLookupError:
                return True
            return False

        run.wait_for(body_gone, "the body's pool process to end", timeout=10)
        # The killed holder could not release the run's lock: it lapses with the lease (2 s).
        # The run is finished, so whoever takes the lock next can only drop a copy.
        lock = f"{run.env['DRIFTSAFE_E2E_PREFIX']}:lock:run:{made['id']}"
        keys = redis.Redis.from_url(run.env["DRIFTSAFE_E2E_REDIS"])
        run.wait_for(lambda: not keys.exists(lock), "the dead holder's lease to lapse", timeout=10)
        keys.close()
        # A copy of the message reaching a worker that missed the revoke: w1 is restarted
        # (a worker's revoked ids live in its memory), and w2 knows nothing of it.
        first.process.terminate()
        first.process.wait(timeout=30)
        second = run.start_worker("w2")
        _ready(run, second)
        _send(run, made, "e2e.phased", ["copy", 0.0]).close()
        run.wait_for(lambda: _status(run, made)["duplicates"] == 1, "the copy dropped", timeout=20)
        final = _status(run, made)
        assert final == {**revoked, "duplicates": 1}
        assert [(e["marker"], e["phase"]) for e in run.executions()] == [("revoked", "begin")]
        assert app.AsyncResult(task_id).state == "REVOKED"
        assert "Traceback" not in run.logs()
        app.close()
    finally:
        run.close()


@pytest.mark.parametrize(("pool", "concurrency"), [("prefork", 4), ("gevent", 8), ("eventlet", 8)])
def test_a_backlog_of_a_skipping_task_reaching_a_worker_at_once_runs_one(
    tmp_path: Path, pool: str, concurrency: int
) -> None:
    """Overlap policy ``skip``, a 1-second task whose body takes 4 s, and no worker for the
    first five slots: when a worker starts (prefork with 4 processes, or gevent or eventlet
    with 8 greenlets in one process, where the leases' watchdogs and the database connections
    are greenlets' too), the queued slots reach it at the same moment. Exactly one of them runs
    (the one started first), the others are skipped, and no two bodies ever overlap; then
    the task goes on as usual, and no process logs an error.
    (The race of two starts within a few milliseconds that could skip both is shown
    in-process: ``test_task.py::test_of_two_runs_started_at_once_under_skip_the_earlier_runs``.)"""
    from datetime import datetime, timedelta

    from tests.e2e.harness import real_now

    run = E2ERun(BACKEND, tmp_path, lease=5.0)
    try:
        run.start_beat(0.0)
        run.wait_until_claiming()  # the backlog's slots fall due while the beat claims
        start = real_now() + timedelta(seconds=3)
        run.seed(
            [_skipping("backlog", 4.0)],
            start,
        )
        time.sleep(max((start - real_now()).total_seconds(), 0) + 4.5)
        worker_at = real_now()
        run.start_worker("w1", pool=pool, concurrency=concurrency)
        # Until a second body has ended (the backlog's one, then the task going on): a loaded
        # machine starts the worker late, and 12 s after its start once saw only the first.
        run.wait_for(
            lambda: sum(e["marker"] == "backlog" for e in run.executions()) >= 2,
            "two bodies to end",
            timeout=90,
        )
        run.stop()

        runs = _runs_once_ended(run)
        executions = run.executions()
        logs = run.logs()
    finally:
        run.close()
    # The backlog: every slot due before the first body began, which the worker took at once
    # (a loaded machine starts the worker seconds after ``worker_at``, so its backlog can hold
    # a slot or two more; which of them runs is the one started first, not the earliest slot).
    began = [e["began"] for e in executions if e["marker"] == "backlog"]
    assert began, (runs, executions)
    first_began = min(began)
    queued = [r for r in runs if datetime.fromisoformat(r["slot"]).timestamp() < first_began]
    print(f"\n{len(queued)} slots queued before the worker: {[r['status'] for r in queued]}")
    assert sum(datetime.fromisoformat(r["slot"]) < worker_at for r in queued) >= 4, queued
    assert {r["status"] for r in queued} <= {"succeeded", "skipped"}, queued
    assert sum(r["status"] == "succeeded" for r in queued) == 1, queued
    ran = sum(r["status"] == "succeeded" for r in runs)
    assert ran >= 2, runs  # one of the backlog, then the task goes on (a slow CI starts late)
    _assert_one_body_at_a_time(executions, "backlog", ran)
    troubles = [line for line in logs.splitlines() if "Traceback" in line or "ERROR/" in line]
    assert not troubles, troubles
