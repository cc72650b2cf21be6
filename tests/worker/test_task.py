"""DriftSafeTask in-process, against the real database and Redis: deliveries are simulated by
pushing the request a worker would build (headers become request attributes)."""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import timedelta
from typing import Any

import pytest
from celery.exceptions import Ignore
from django.test import override_settings

from celery_driftsafe.core.headers import read_headers
from celery_driftsafe.locks.database import DatabaseLockBackend
from celery_driftsafe.models import PeriodicTask, Run, RunKind, RunStatus
from celery_driftsafe.task import DriftSafeTask
from tests import settings as test_settings
from tests.skip_guard import configuration
from tests.support import T0, drain, wait_until
from tests.support.factories import interval_task, real_deadlock

#: The package's Redis keys in these tests start with it (the tests' KEY_PREFIX).
PREFIX = test_settings.DRIFTSAFE["KEY_PREFIX"]

pytestmark = pytest.mark.django_db(transaction=True)


def _run(task_name: str = "tests.record", **fields: Any) -> Run:
    return Run.objects.create(
        kind=fields.pop("kind", RunKind.MANUAL),
        task_name=task_name,
        status=fields.pop("status", RunStatus.DISPATCHED),
        celery_task_id=fields.pop("celery_task_id", str(uuid.uuid4())),
        **fields,
    )


def _two_slots_of_a_skipping_task(name: str) -> tuple[Run, Run]:
    """Runs of the slots 00:00:01 and 00:00:02 of a 1-second task whose overlap policy is
    ``skip``."""
    from datetime import UTC, datetime

    periodic = interval_task(
        name,
        1,
        anchor=datetime(2026, 3, 1, tzinfo=UTC),
        task="tests.record",
        overlap_policy="skip",
    )
    first, second = (
        _run(
            periodic_task=periodic,
            kind=RunKind.SCHEDULED,
            slot=datetime(2026, 3, 1, 0, 0, s, tzinfo=UTC),
        )
        for s in (1, 2)
    )
    return first, second


@contextmanager
def delivery(task: Any, run: Run | None = None, **headers: Any) -> Iterator[None]:
    request = {
        "id": run.celery_task_id if run else str(uuid.uuid4()),
        "hostname": "worker-1",
        "delivery_info": {},
        "args": [],
        "kwargs": {},
    }
    if run is not None:
        request.update(
            driftsafe_run_id=run.pk,
            driftsafe_fencing_token=0,
            driftsafe_periodic_task_id=run.periodic_task_id,
        )
    request.update(headers)
    task.push_request(**request)
    try:
        yield
    finally:
        task.pop_request()


def test_plain_call_without_headers_is_a_plain_task(record: Any, calls: list[Any]) -> None:
    with delivery(record):
        assert record("x") == "x"
    assert calls == ["x"]
    assert Run.objects.count() == 0


def test_run_executes_once_and_duplicates_are_skipped_and_counted(
    record: Any, calls: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    run = _run()
    with delivery(record, run):
        assert record("a") == "a"
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED
    assert run.started_at is not None and run.finished_at >= run.started_at
    assert run.fencing_token >= 1 and run.worker == "worker-1"
    for _ in range(4):
        with delivery(record, run), pytest.raises(Ignore):
            record("a")
    assert calls == ["a"]
    run.refresh_from_db()
    assert run.duplicate_deliveries == 4
    assert "duplicate delivery of run" in caplog.text


def test_failure_is_recorded_with_the_error_and_raised(record: Any) -> None:
    run = _run()
    with delivery(record, run), pytest.raises(ValueError, match="boom"):
        record("boom")
    run.refresh_from_db()
    assert run.status == RunStatus.FAILED
    assert "ValueError: boom" in run.error


@pytest.mark.parametrize(
    ("headers", "reason"),
    [
        ({"driftsafe_run_id": 999_999}, "unknown run 999999"),
        ({"driftsafe_run_id": "12x"}, "is not a whole number"),
        ({"driftsafe_fencing_token": "abc"}, "driftsafe_fencing_token='abc' is not a whole number"),
        ({"driftsafe_run_id": True}, "is not a whole number"),
        ({"driftsafe_run_id": -3}, "is negative"),
        ({"id": "not-the-run's-id"}, "has Celery task id"),
        ({"driftsafe_periodic_task_id": 424242}, "is not a run of periodic task 424242"),
    ],
)
def test_forged_or_malformed_headers_are_rejected_never_executed(
    record: Any,
    calls: list[Any],
    caplog: pytest.LogCaptureFixture,
    headers: dict[str, Any],
    reason: str,
) -> None:
    run = _run(periodic_task=interval_task("forged", 60, anchor=T0, task="tests.record"))
    with caplog.at_level(logging.ERROR), delivery(record, run, **headers), pytest.raises(Ignore):
        record("a")
    assert calls == []
    assert reason in caplog.text
    run.refresh_from_db()
    assert run.status == RunStatus.DISPATCHED


def test_run_of_another_task_is_rejected(
    record: Any, calls: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    run = _run(task_name="tests.other")
    with delivery(record, run), pytest.raises(Ignore):
        record("a")
    assert calls == []
    assert "belongs to task 'tests.other'" in caplog.text


def test_concurrent_deliveries_execute_once(record: Any, calls: list[Any]) -> None:
    """While one delivery runs, four more arrive: they find the lock held and are re-sent
    (same id and headers) for after the lease, never executed alongside."""
    run = _run()
    record.gate.clear()
    first = threading.Thread(target=lambda: _deliver(record, run))
    first.start()
    wait_until(lambda: Run.objects.get(pk=run.pk).status == RunStatus.STARTED, "the run started")
    for _ in range(4):
        with delivery(record, run), pytest.raises(Ignore):
            record("a")
    record.gate.set()
    first.join()
    assert calls == ["a"]
    resent = drain()
    assert len(resent) == 4
    assert {m["id"] for m in resent} == {run.celery_task_id}
    assert {m["driftsafe_run_id"] for m in resent} == {run.pk}
    assert all(m["eta"] for m in resent)
    # the re-sent copies, delivered after the run finished, are dropped as duplicates
    with delivery(record, run), pytest.raises(Ignore):
        record("a")
    assert calls == ["a"]


def _deliver(task: Any, run: Run) -> None:
    from django.db import connections

    try:
        with delivery(task, run):
            task("a")
    finally:
        connections.close_all()


def test_stale_started_run_is_taken_over_with_a_newer_token(
    record: Any, calls: list[Any], redis_client: Any
) -> None:
    """A worker died mid-run: the row says started, but nobody holds the lock any more."""
    run = _run(status=RunStatus.STARTED, fencing_token=7)
    redis_client.set(f"{PREFIX}:fence:run:{run.pk}", 7)
    with delivery(record, run):
        assert record("a") == "a"
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED and run.error == ""
    assert run.fencing_token == 8


@contextmanager
def _running_with_a_short_lease(record: Any, run: Run) -> Iterator[None]:
    """The block runs while the run's body runs in a thread of its own (its lock held, its
    lease 1.5 s), which then finishes."""
    record.gate.clear()
    with override_settings(
        DRIFTSAFE_INTERNALS={**test_settings.DRIFTSAFE_INTERNALS, "LEASE_SECONDS": 1.5}
    ):
        first = threading.Thread(target=lambda: _deliver(record, run))
        first.start()
        try:
            wait_until(
                lambda: Run.objects.get(pk=run.pk).status == RunStatus.STARTED, "the run started"
            )
            yield
        finally:
            record.gate.set()
            first.join()


def _logged(caplog: pytest.LogCaptureFixture, action: str) -> bool:
    return any(getattr(r, "action", "") == action for r in caplog.records)


def test_a_lock_redis_lost_while_the_body_runs_lets_no_copy_run_it_again(
    record: Any, calls: list[Any], redis_client: Any
) -> None:
    """Redis loses the lock of a run whose body runs (a flush, a restart that kept nothing)
    and a copy of the run is delivered. The copy takes the free lock, but the ledger's lease,
    renewed with the lock, refuses the takeover: the copy gives the lock back and comes again
    once that lease is over. The holder sets its lock again at its next renewal, and the body
    runs once."""
    run = _run()
    key = f"{PREFIX}:lock:run:{run.pk}"
    with _running_with_a_short_lease(record, run):
        leased = Run.objects.get(pk=run.pk).lease_until
        assert leased is not None
        wait_until(
            lambda: Run.objects.get(pk=run.pk).lease_until > leased, "the lease renewed"
        )  # renewed
        redis_client.delete(key)
        with delivery(record, run), pytest.raises(Ignore):
            record("copy")
        assert [m["id"] for m in drain()] == [run.celery_task_id], "re-sent for later"
        wait_until(
            lambda: redis_client.get(key) is not None, "the holder's lock set again"
        )  # the holder's, set again
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED and calls == ["a"]


def test_a_holder_whose_renewal_is_refused_keeps_its_lease_until_the_body_ends(
    record: Any, calls: list[Any], redis_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A copy holds the run's key (which Redis had lost) for the moment of its refused start
    just as the holder renews: the renewal is refused and the holder's lock declared lost,
    while its body runs on. The holder goes on renewing its lease in the ledger, so a copy
    delivered after the lease as it stood at the loss has run out is still refused, and the
    body runs once."""
    import time

    from celery_driftsafe.store.clock import authority_clock

    run = _run()
    key = f"{PREFIX}:lock:run:{run.pk}"
    with _running_with_a_short_lease(record, run):
        redis_client.set(key, "a copy's token", px=5000)
        wait_until(lambda: _logged(caplog, "lock-lost"), "the lock-lost log line")
        redis_client.delete(key)  # the copy gave it back
        leased = Run.objects.get(pk=run.pk).lease_until
        assert leased is not None
        time.sleep(max(0.0, (leased - authority_clock().now()).total_seconds()) + 0.2)
        with delivery(record, run), pytest.raises(Ignore):
            record("copy")
        assert [m["id"] for m in drain()] == [run.celery_task_id], "re-sent for later"
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED and calls == ["a"]
    assert run.lease_until is not None and run.lease_until > leased
    assert not _logged(caplog, "lease-taken-over")


def test_a_holder_taken_over_while_away_stops_keeping_its_lease(
    record: Any, calls: list[Any], redis_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A holder whose lock was lost and whose run a newer holder took over meanwhile (it was
    paused past its lease) stops renewing the lease in the ledger, says so, and its outcome
    is refused."""
    run = _run()
    with _running_with_a_short_lease(record, run):
        token = Run.objects.get(pk=run.pk).fencing_token
        redis_client.set(f"{PREFIX}:lock:run:{run.pk}", "the newer holder's", px=5000)
        Run.objects.filter(pk=run.pk).update(fencing_token=token + 1, worker="newer")
        wait_until(lambda: _logged(caplog, "lease-taken-over"), "the lease-taken-over log line")
    run.refresh_from_db()
    assert (run.status, run.worker, calls) == (RunStatus.STARTED, "newer", ["a"])
    assert _logged(caplog, "fenced-out")


def test_outcome_of_a_fenced_out_holder_is_discarded(
    record: Any, calls: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """While a holder runs, a successor with a newer token takes the row over (as after the
    holder was paused past its lease): the holder's outcome must not overwrite it."""
    run = _run()
    record.gate.clear()
    first = threading.Thread(target=lambda: _deliver(record, run))
    first.start()
    wait_until(lambda: Run.objects.get(pk=run.pk).status == RunStatus.STARTED, "the run started")
    token = Run.objects.get(pk=run.pk).fencing_token
    Run.objects.filter(pk=run.pk).update(
        fencing_token=token + 1, status=RunStatus.SUCCEEDED, error="recorded by the successor"
    )
    record.gate.set()
    first.join()
    run.refresh_from_db()
    assert run.fencing_token == token + 1
    assert run.error == "recorded by the successor"
    assert "outcome succeeded discarded" in caplog.text


def test_overlap_skip_records_skipped_slot_while_previous_runs(
    record: Any, calls: list[Any]
) -> None:
    first, second = _two_slots_of_a_skipping_task("slow")
    record.gate.clear()
    worker = threading.Thread(target=lambda: _deliver(record, first))
    worker.start()
    wait_until(
        lambda: Run.objects.get(pk=first.pk).status == RunStatus.STARTED, "the first run started"
    )
    with delivery(record, second), pytest.raises(Ignore):
        record("a")
    second.refresh_from_db()
    assert second.status == RunStatus.SKIPPED
    assert "previous run of this task is still running" in second.error
    record.gate.set()
    worker.join()
    assert calls == ["a"]
    assert Run.objects.get(pk=first.pk).status == RunStatus.SUCCEEDED


def test_overlap_skip_holds_when_redis_loses_the_running_lock(
    record: Any, calls: list[Any], redis_client: Any
) -> None:
    """Overlap policy ``skip``: Redis loses the task's running lock while the first slot's
    body runs (a flush, an eviction, a restart that kept no data). The second slot's run
    takes the free lock, but the ledger has the first started with its worker's lease
    lasting: the second is skipped, not run beside it."""
    first, second = _two_slots_of_a_skipping_task("lost-running-lock")
    record.gate.clear()
    worker = threading.Thread(target=lambda: _deliver(record, first))
    worker.start()
    running_lock = f"{PREFIX}:lock:task-running:{first.periodic_task_id}"
    # both the running lock and the run's start: the fast path takes the lock right after
    # the start, the slow path (where UPDATE ... RETURNING is missing: MariaDB) just before it
    wait_until(
        lambda: (
            redis_client.exists(running_lock)
            and Run.objects.get(pk=first.pk).status == RunStatus.STARTED
        ),
        "the first run started holding the running lock",
    )
    assert redis_client.delete(running_lock)
    try:
        with delivery(record, second), pytest.raises(Ignore):
            record("b")
    finally:
        record.gate.set()
        worker.join()
    second.refresh_from_db()
    assert second.status == RunStatus.SKIPPED, second.error
    assert calls == ["a"]
    assert Run.objects.get(pk=first.pk).status == RunStatus.SUCCEEDED


def test_of_two_runs_started_at_once_under_skip_the_earlier_runs(
    record: Any, calls: list[Any]
) -> None:
    """Overlap policy ``skip``, two slots' deliveries at once (a backlog reaching a worker of
    concurrency 2): the second slot's run was started in the ledger a moment after the first's
    and its worker has not taken the task's running lock yet. The first takes the lock and
    runs; it is not skipped for the later start (which then finds the lock held and skips).
    Before, each could skip for the other's start, and neither slot ran."""
    from celery_driftsafe.store.clock import authority_clock

    first, second = _two_slots_of_a_skipping_task("started-at-once")
    later = authority_clock().now() + timedelta(seconds=5)
    Run.objects.filter(pk=second.pk).update(
        status=RunStatus.STARTED,
        started_at=later,
        lease_until=later + timedelta(seconds=30),
        fencing_token=1,
    )
    with delivery(record, first):
        assert record("a") == "a"
    assert calls == ["a"]
    assert Run.objects.get(pk=first.pk).status == RunStatus.SUCCEEDED


def test_a_run_taken_over_while_the_next_one_runs_ends_failed_not_skipped(
    record: Any, calls: list[Any], redis_client: Any
) -> None:
    """Overlap policy ``skip``: the first slot's worker died mid-body, and the second slot's
    run now holds the task's running lock. A redelivered copy of the first takes its run over
    (one conditional start, the fast path) and must not run the body beside the second; the
    run ran in part, so it ends failed, not skipped (a skipped run never ran), and that
    failure counts towards ``pause_after_failures``. A first start that finds the running lock
    held is still skipped."""
    from celery_driftsafe.ledger.run_ledger import Ledger
    from celery_driftsafe.locks import lock_backend

    first, second = _two_slots_of_a_skipping_task("taken-over")
    PeriodicTask.objects.filter(pk=first.periodic_task_id).update(pause_after_failures=1)
    Run.objects.filter(pk=first.pk).update(
        status=RunStatus.STARTED, worker="dead-worker", fencing_token=1, started_at=T0
    )
    redis_client.set(f"{PREFIX}:fence:run:{first.pk}", 1)  # as the dead worker left it
    running = lock_backend().lock(f"task-running:{first.periodic_task_id}", ttl=30)
    assert running.acquire(blocking=False)  # the second run's body
    try:
        for run in (first, second):
            with delivery(record, run), pytest.raises(Ignore):
                record("again")
    finally:
        running.release()
    first.refresh_from_db()
    second.refresh_from_db()
    assert calls == []
    if Ledger().can_return:  # the fast path: one conditional start, which took the run over
        assert first.status == RunStatus.FAILED, first.error
        assert "worker that started it was lost" in first.error and first.fencing_token > 1
        task = PeriodicTask.objects.get(pk=first.periodic_task_id)
        assert not task.enabled and "paused after 1 failed" in task.disabled_reason
    else:  # MySQL: the run is read first and left started, for a reconcile pass to fail
        assert (first.status, first.worker) == (RunStatus.STARTED, "dead-worker")
    assert second.status == RunStatus.SKIPPED
    assert "previous run of this task is still running" in second.error


def test_a_run_whose_periodic_task_was_deleted_meanwhile_still_runs_once(
    record: Any, calls: list[Any]
) -> None:
    """A run dispatched before its periodic task was deleted (the run row stays, its link to
    the task set to null) is still that run: the worker runs it once, as Celery runs a message
    already sent, rather than reject it as a message that does not match its run."""
    periodic = interval_task("deleted-meanwhile", 60, anchor=T0, task="tests.record")
    run = _run(periodic_task=periodic, kind=RunKind.SCHEDULED, slot=T0)
    deleted_id = periodic.pk
    periodic.delete()
    with delivery(record, run):
        assert record("a") == "a"
    with delivery(record, run), pytest.raises(Ignore):
        record("a")
    run.refresh_from_db()
    assert (run.status, run.periodic_task_id, calls) == (RunStatus.SUCCEEDED, None, ["a"])
    adhoc = _run(kind=RunKind.ADHOC)  # never made for a periodic task: a header naming one lies
    with delivery(record, adhoc, driftsafe_periodic_task_id=deleted_id), pytest.raises(Ignore):
        record("b")
    assert calls == ["a"]


def test_overlap_allow_runs_side_by_side(record: Any, calls: list[Any]) -> None:
    from datetime import UTC, datetime

    periodic = interval_task(
        "fast", 1, anchor=datetime(2026, 3, 1, tzinfo=UTC), task="tests.record"
    )
    assert periodic.overlap_policy == "allow"
    first, second = (
        _run(
            periodic_task=periodic,
            kind=RunKind.SCHEDULED,
            slot=datetime(2026, 3, 1, 0, 0, s, tzinfo=UTC),
        )
        for s in (1, 2)
    )
    record.gate.clear()
    worker = threading.Thread(target=lambda: _deliver(record, first))
    worker.start()
    wait_until(
        lambda: Run.objects.get(pk=first.pk).status == RunStatus.STARTED, "the first run started"
    )
    record.gate.set()
    with delivery(record, second):
        assert record("b") == "b"
    worker.join()
    assert sorted(calls) == ["a", "b"]


def test_idempotency_key_records_once_and_publishes_once(record: Any) -> None:
    first = record.apply_async(("a",), idempotency_key="order-42")
    second = record.apply_async(("a",), idempotency_key="order-42")
    assert first.id == second.id
    messages = drain()
    assert len(messages) == 1
    run = Run.objects.get(idempotency_key="order-42")
    assert run.kind == RunKind.ADHOC and run.status == RunStatus.DISPATCHED
    assert messages[0]["driftsafe_run_id"] == run.pk
    assert messages[0]["id"] == run.celery_task_id == first.id


def test_idempotency_key_of_another_task_is_refused(record: Any) -> None:
    _run(task_name="tests.other", idempotency_key="shared")
    with pytest.raises(ValueError, match=r"already used for task 'tests\.other'"):
        record.apply_async(("a",), idempotency_key="shared")


def test_without_key_apply_async_is_plain(record: Any) -> None:
    record.apply_async(("a",))
    messages = drain()
    assert len(messages) == 1
    assert "driftsafe_run_id" not in messages[0]
    assert Run.objects.count() == 0


_DEAD_REDIS = {
    **test_settings.DRIFTSAFE,
    "REDIS_URL": "redis://127.0.0.1:1/0",
    "TIME_AUTHORITY": "database",
}


def test_redis_unreachable_fail_closed_resends_and_does_not_execute(
    record: Any, calls: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    run = _run()
    with override_settings(DRIFTSAFE=_DEAD_REDIS), delivery(record, run), pytest.raises(Ignore):
        record("a")
    assert calls == []
    assert [m["id"] for m in drain()] == [run.celery_task_id]
    assert "fail_closed" in caplog.text


def test_redis_unreachable_fail_open_runs_once_on_database_checks(
    record: Any, calls: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    run = _run()
    with override_settings(DRIFTSAFE={**_DEAD_REDIS, "REDIS_UNAVAILABLE": "fail_open"}):
        with delivery(record, run):
            assert record("a") == "a"
        with delivery(record, run), pytest.raises(Ignore):
            record("a")
    assert calls == ["a"]
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED
    assert "fail_open" in caplog.text


def test_read_headers_none_without_run_header() -> None:
    class Request:
        pass

    assert read_headers(Request()) is None


def test_run_links_to_its_celery_result_without_copying() -> None:
    from django_celery_results.models import TaskResult

    run = _run()
    assert run.task_result is None
    stored = TaskResult.objects.create(task_id=run.celery_task_id, status="SUCCESS", result='"a"')
    assert run.task_result == stored
    assert _run(celery_task_id="").task_result is None


# -- degraded modes keep their promises ---------------------------------------------------------


def test_lost_fence_counter_continues_the_runs_sequence(
    record: Any, calls: list[Any], redis_client: Any
) -> None:
    """Redis lost its fencing counter (restart without persistence): the next lock's token
    still goes above the run's, so the take-over of a dead holder's run is recorded."""
    run = _run(status=RunStatus.STARTED, fencing_token=9, worker="dead-worker")
    assert redis_client.get(f"{PREFIX}:fence:run:{run.pk}") is None
    with delivery(record, run):
        assert record("a") == "a"
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED and run.fencing_token == 10
    assert calls == ["a"]


def test_fail_open_continues_the_same_sequence(record: Any, calls: list[Any]) -> None:
    run = _run(fencing_token=4)
    with (
        override_settings(DRIFTSAFE={**_DEAD_REDIS, "REDIS_UNAVAILABLE": "fail_open"}),
        delivery(record, run),
    ):
        assert record("a") == "a"
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED and run.fencing_token == 5
    assert run.worker == "worker-1 (no lock)"


def test_fail_open_applies_the_overlap_policy_on_the_ledger(
    record: Any, calls: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    running, late = _two_slots_of_a_skipping_task("slow-open")
    Run.objects.filter(pk=running.pk).update(status=RunStatus.STARTED, worker="other")
    with (
        caplog.at_level(logging.INFO),
        override_settings(DRIFTSAFE={**_DEAD_REDIS, "REDIS_UNAVAILABLE": "fail_open"}),
    ):
        with delivery(record, late), pytest.raises(Ignore):
            record("a")
        late.refresh_from_db()
        assert late.status == RunStatus.SKIPPED
        assert "previous run of this task is still running" in late.error
        Run.objects.filter(pk=running.pk).update(status=RunStatus.SUCCEEDED)
        third = _run(
            periodic_task=running.periodic_task,
            kind=RunKind.SCHEDULED,
            slot=running.slot + timedelta(seconds=2),
        )
        with delivery(record, third):
            assert record("b") == "b"
    assert calls == ["b"]
    assert "overlap checked on the ledger and the database's running lock (fail_open)" in (
        caplog.text
    )
    assert _database_running_lock_free(running.periodic_task_id)


def _database_running_lock_free(periodic_task_id: int | None) -> bool:
    lock = DatabaseLockBackend().lock(f"task-running:{periodic_task_id}")
    if not lock.acquire(blocking=False):
        return False
    lock.release()
    return True


def test_fail_open_skips_while_another_holds_the_database_running_lock(
    record: Any, calls: list[Any]
) -> None:
    """Two ``fail_open`` deliveries of a skipping task at once: the first holds the task's
    running lock in the database and has not written its start yet. The second finds the
    ledger empty but the lock held, and is skipped. Before, the ledger alone decided, and
    both ran."""
    first, second = _two_slots_of_a_skipping_task("open-at-once")
    running = DatabaseLockBackend().lock(f"task-running:{first.periodic_task_id}", ttl=30)
    assert running.acquire(blocking=False)
    try:
        with (
            override_settings(DRIFTSAFE={**_DEAD_REDIS, "REDIS_UNAVAILABLE": "fail_open"}),
            delivery(record, second),
            pytest.raises(Ignore),
        ):
            record("b")
    finally:
        running.release()
    second.refresh_from_db()
    assert second.status == RunStatus.SKIPPED and calls == []


@pytest.mark.skipif(
    test_settings.DATABASES["default"]["ENGINE"].endswith("sqlite3"),
    reason=configuration("SQLite serialises every write: no two starts are at once"),
)
def test_two_fail_open_deliveries_at_once_run_one_body(record: Any, calls: list[Any]) -> None:
    """Two slots of a skipping task reach two worker threads at once with Redis away
    (``fail_open``): exactly one body runs, the other run is recorded skipped, and the
    database's running lock is free again once the body ended."""
    first, second = _two_slots_of_a_skipping_task("open-threads")
    record.gate.clear()
    go = threading.Barrier(2)

    def deliver(run: Run) -> None:
        go.wait(5)
        with suppress(Ignore):
            _deliver(record, run)

    with override_settings(DRIFTSAFE={**_DEAD_REDIS, "REDIS_UNAVAILABLE": "fail_open"}):
        threads = [threading.Thread(target=deliver, args=(run,)) for run in (first, second)]
        for thread in threads:
            thread.start()
        wait_until(
            lambda: (
                sorted(
                    Run.objects.filter(pk__in=[first.pk, second.pk]).values_list(
                        "status", flat=True
                    )
                )
                == [RunStatus.SKIPPED, RunStatus.STARTED]
            ),
            "one run started and the other skipped",
        )
        record.gate.set()
        for thread in threads:
            thread.join()
    statuses = sorted(
        Run.objects.filter(pk__in=[first.pk, second.pk]).values_list("status", flat=True)
    )
    assert statuses == [RunStatus.SKIPPED, RunStatus.SUCCEEDED] and calls == ["a"]
    assert _database_running_lock_free(first.periodic_task_id)


def test_a_lock_holder_skips_while_a_run_started_without_a_lock_runs(
    record: Any, calls: list[Any]
) -> None:
    """Overlap ``skip`` across the two sides of ``fail_open``: a run of the task was started
    without a lock (its worker could not reach Redis) and runs; it has no lease in the
    ledger and holds no running lock in Redis. A worker that reaches Redis gets the next
    slot: it skips it. Before, it counted only runs with a lasting lease, and ran beside."""
    from celery_driftsafe.store.clock import authority_clock

    first, second = _two_slots_of_a_skipping_task("open-and-locked")
    Run.objects.filter(pk=first.pk).update(
        status=RunStatus.STARTED,
        started_at=authority_clock().now() + timedelta(seconds=5),  # its worker's clock ran fast
        fencing_token=1,
        worker="w9 (no lock)",
    )
    with delivery(record, second), pytest.raises(Ignore):
        record("b")
    second.refresh_from_db()
    assert second.status == RunStatus.SKIPPED and calls == []


def test_a_run_started_without_a_lock_is_never_taken_over(record: Any, calls: list[Any]) -> None:
    """A lock holder cannot tell whether an unlocked (fail_open, eager) start still runs."""
    run = _run(status=RunStatus.STARTED, fencing_token=3, worker="w9 (no lock)")
    with delivery(record, run), pytest.raises(Ignore):
        record("a")
    run.refresh_from_db()
    assert run.status == RunStatus.STARTED and run.fencing_token == 3
    assert calls == []


def test_unreachable_lock_backend_is_recorded_on_the_run_and_expiry_ends_it(
    record: Any, calls: list[Any]
) -> None:
    from datetime import timedelta

    from celery_driftsafe.task import authority_clock

    run = _run()
    with override_settings(DRIFTSAFE=_DEAD_REDIS):
        with delivery(record, run), pytest.raises(Ignore):
            record("a")
        run.refresh_from_db()
        assert run.status == RunStatus.DISPATCHED
        assert run.error.startswith("waiting: lock backend unreachable")
        Run.objects.filter(pk=run.pk).update(
            expires_at=authority_clock().now() - timedelta(seconds=1)
        )
        with delivery(record, run), pytest.raises(Ignore):
            record("a")
    run.refresh_from_db()
    assert run.status == RunStatus.EXPIRED
    assert calls == []
    assert len(drain()) == 1  # only the first delivery was re-sent


def test_copy_of_an_earlier_attempt_is_a_duplicate(record: Any, calls: list[Any]) -> None:
    run = _run(status=RunStatus.RETRYING, attempt=2)
    with delivery(record, run, retries=1), pytest.raises(Ignore):
        record("a")
    with delivery(record, run, retries=2):
        assert record("a") == "a"
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED and run.attempt == 2
    assert run.duplicate_deliveries == 1
    assert calls == ["a"]


def test_admin_run_page_shows_the_attempts(admin_client: Any) -> None:
    from django.urls import reverse

    from celery_driftsafe.models import RunAttempt

    run = _run(status=RunStatus.SUCCEEDED, attempt=2)
    for number, outcome in ((0, "retrying"), (1, "retrying"), (2, "succeeded")):
        RunAttempt.objects.create(
            run=run,
            number=number,
            outcome=outcome,
            worker="w1@host",
            error=f"attempt {number} said so",
        )
    page = admin_client.get(reverse("admin:celery_driftsafe_run_change", args=[run.pk]))
    assert page.status_code == 200
    html = page.content.decode()
    assert "Attempts (Celery retries of this run)" in html
    assert all(f"attempt {n} said so" in html for n in range(3))
    assert "Retry scheduled" in html
    listing = admin_client.get(reverse("admin:celery_driftsafe_run_changelist"))
    assert listing.status_code == 200 and "attempts" in listing.content.decode()


def test_body_rejecting_with_requeue_gives_the_run_back(broker_app: Any) -> None:
    from celery.exceptions import Reject

    @broker_app.task(name="tests.rejecting", base=DriftSafeTask, shared=False)
    def rejecting() -> None:
        raise Reject("not now", requeue=True)

    run = _run(task_name="tests.rejecting")
    with delivery(rejecting, run), pytest.raises(Reject):
        rejecting()
    run.refresh_from_db()
    assert run.status == RunStatus.DISPATCHED and "requeued" in run.error


def test_a_start_rolled_back_for_a_concurrent_update_runs_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A database whose default is SERIALIZABLE (``ALTER DATABASE … SET
    default_transaction_isolation``): a worker's start meets the beat's mark of the same run,
    committed under it, and PostgreSQL rolls the statement back ("could not serialize access
    due to concurrent update"; at READ COMMITTED it would have waited and gone on). The ledger
    runs it again instead of taking the database for unreachable."""
    import time

    from django.db import connection, transaction
    from django.db.backends.signals import connection_created

    from celery_driftsafe.ledger.run_ledger import Ledger, Start

    if connection.vendor != "postgresql":
        pytest.skip(configuration("PostgreSQL's serialization failures"))
    # A worker keeps the project's level: undo what a beat set up earlier in this process.
    connection_created.disconnect(dispatch_uid="celery_driftsafe.read_committed")
    run = Run.objects.create(task_name="tests.add", status=RunStatus.DISPATCHED)
    database = connection.ops.quote_name(connection.settings_dict["NAME"])
    with connection.cursor() as cursor:
        cursor.execute(
            f"ALTER DATABASE {database} SET default_transaction_isolation = serializable"
        )
    outcome: list[Any] = []
    backend: list[int] = []

    def worker() -> None:
        from django.db import connections

        try:
            with connection.cursor() as cursor:  # this thread's own, new connection
                cursor.execute("SHOW transaction_isolation")
                outcome.append(cursor.fetchone()[0])
                cursor.execute("SELECT pg_backend_pid()")
                backend.append(cursor.fetchone()[0])
            outcome.append(Ledger().start(Start(run.pk, 1, T0, "w1", 0, "database")) is not None)
        except Exception as exc:
            outcome.append(exc)
        finally:
            connections.close_all()

    thread = threading.Thread(target=worker)
    try:
        with caplog.at_level("DEBUG", logger="celery_driftsafe.ledger"):
            with transaction.atomic():
                # the beat's mark, holding the row (this connection predates the default)
                Run.objects.filter(pk=run.pk).update(dispatch_attempts=1)
                thread.start()
                deadline = time.monotonic() + 10
                with connection.cursor() as cursor:
                    while True:  # until the worker's start waits for this transaction's lock
                        # (other test processes' waits on the same server do not count)
                        cursor.execute(
                            "SELECT cardinality(pg_blocking_pids(%s))",
                            [backend[0] if backend else 0],
                        )
                        if cursor.fetchone()[0] or time.monotonic() > deadline:
                            break
                        time.sleep(0.02)
            thread.join(10)  # the start is run again after the commit: still logged here
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"ALTER DATABASE {database} RESET default_transaction_isolation")
    assert outcome == ["serializable", True]
    assert caplog.text.count("could not serialize access due to concurrent update") == 1
    fresh = Run.objects.get(pk=run.pk)
    assert (fresh.status, fresh.dispatch_attempts, fresh.fencing_token) == ("started", 1, 1)


@pytest.mark.skipif(
    test_settings.TEST_DB == "sqlite", reason=configuration("SQLite has no deadlocks")
)
def test_a_deadlock_counts_as_rolled_back_for_a_concurrent_update() -> None:
    """A real deadlock's victim: PostgreSQL says SQLSTATE 40P01; mysqlclient's error carries
    only MySQL's number, ER_LOCK_DEADLOCK (1213), which InnoDB reports with SQLSTATE 40001.
    Either way the database rolled the victim's transaction back, and the ledger runs such a
    statement again (the retry itself: the test above)."""
    from celery_driftsafe.store.connections import rolled_back, sqlstate

    deadlock = real_deadlock()
    if test_settings.TEST_DB == "mysql":
        assert deadlock.__cause__ is not None and deadlock.__cause__.args[0] == 1213
        assert sqlstate(deadlock) == "40001"
    else:
        assert sqlstate(deadlock) == "40P01"
    assert rolled_back(deadlock)


@pytest.mark.django_db(transaction=True)
def test_a_worker_before_its_upgrades_migration_says_run_migrate() -> None:
    """Workers of a new version started before ``migrate``: the ledger's statements name a
    column the database does not have yet. The delivery is tried again later, as in an outage
    (nothing ran), and the reason says what is missing rather than "unreachable"; once the
    column is there the same start goes through."""
    from django.db import connection

    from celery_driftsafe.exceptions import LedgerUnavailable
    from celery_driftsafe.ledger.run_ledger import Ledger, Start

    run = Run.objects.create(task_name="tests.add", status=RunStatus.DISPATCHED)
    table = connection.ops.quote_name(Run._meta.db_table)
    rename = f"ALTER TABLE {table} RENAME COLUMN {{}} TO {{}}"
    with connection.cursor() as cursor:
        cursor.execute(rename.format("lock_store", "lock_store_not_yet"))
    try:
        with pytest.raises(LedgerUnavailable) as info:
            Ledger().start(Start(run.pk, 1, T0, "w1", 0, "database"))
        assert str(info.value).startswith(
            "the database lacks celery_driftsafe's tables or columns (run migrate): "
        ), info.value
    finally:
        with connection.cursor() as cursor:
            cursor.execute(rename.format("lock_store_not_yet", "lock_store"))
    assert Ledger().start(Start(run.pk, 1, T0, "w1", 0, "database"))
    assert Run.objects.get(pk=run.pk).lock_store == "database"


@pytest.mark.django_db(transaction=True)
def test_a_start_without_a_lock_records_no_store() -> None:
    """An attempt started without a lock (eager, ``fail_open``, ``lock-mismatch``) clears the
    store an earlier attempt's lock holder recorded: that store says nothing of this one."""
    from celery_driftsafe.ledger.run_ledger import Ledger, Start

    run = Run.objects.create(
        task_name="tests.add", status=RunStatus.DISPATCHED, attempt=0, lock_store="redis:x"
    )
    assert Ledger().start(Start(run.pk, 1, T0, "w1", 1, None)) is not None
    run.refresh_from_db()
    assert (run.status, run.lock_store, run.worker) == (RunStatus.STARTED, None, "w1 (no lock)")


def test_a_ledger_transaction_rolled_back_for_a_concurrent_one_is_run_again() -> None:
    """At REPEATABLE READ, PostgreSQL rolls back a transaction that changes a row another one
    changed after its snapshot ("could not serialize access", SQLSTATE 40001): nothing of it
    was written. ``Ledger.together`` (an attempt's end and its row) runs it again, as single
    ledger statements are, and it then writes."""
    from django.db import connection, connections

    from celery_driftsafe.ledger.run_ledger import Ledger

    if connection.vendor != "postgresql":
        pytest.skip(configuration("PostgreSQL's serialization failure at REPEATABLE READ"))
    run = Run.objects.create(
        task_name="tests.record",
        kind=RunKind.ADHOC,
        status=RunStatus.STARTED,
        celery_task_id=str(uuid.uuid4()),
        fencing_token=1,
    )
    ledger = Ledger()
    calls: list[str] = []

    def other_transaction() -> None:
        try:
            Run.objects.filter(pk=run.pk).update(worker="another")  # this thread's connection
        finally:
            connections.close_all()

    def write() -> bool:
        with connection.cursor() as cursor:
            cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            cursor.execute(f"SELECT status FROM {ledger.runs} WHERE id = %s", [run.pk])
            calls.append(cursor.fetchone()[0])  # the snapshot is taken
        if len(calls) == 1:  # the first time, another transaction changes the row meanwhile
            thread = threading.Thread(target=other_transaction)
            thread.start()
            thread.join(10)
        return ledger.finish(run.pk, 1, RunStatus.SUCCEEDED, T0, "")

    assert ledger.together(write) is True
    assert calls == [RunStatus.STARTED, RunStatus.STARTED]  # rolled back once, then again
    run.refresh_from_db()
    assert (run.status, run.worker) == (RunStatus.SUCCEEDED, "another")
