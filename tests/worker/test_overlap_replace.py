"""Overlap policy ``replace`` in-process, against the real database and Redis (and the
database's locks): deliveries are simulated by pushing the request a worker would build
(:mod:`tests.support.overlap`), as for ``buffer_one``. A body that runs on in a thread is what a
pool that cannot terminate it (threads) leaves; a body whose process a prefork worker killed is
a running lock held under the run's name that nobody gives back."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from celery.app.task import Context
from celery.exceptions import Ignore

from celery_driftsafe.conf import get_settings
from celery_driftsafe.locks import lock_backend, running_lock
from celery_driftsafe.models import PeriodicTask, Run, RunStatus
from celery_driftsafe.store.clock import authority_clock
from celery_driftsafe.worker.overlap import REPLACING_WHY, replaced_body_killed
from tests.support import drain, wait_until
from tests.support.factories import interval_task
from tests.support.overlap import (
    body_running,
    deliver_published,
    held_for,
    overlap_task,
    recover,
    slot_run,
)
from tests.support.overlap import delivery as unslotted_delivery

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def revokes(record: Any, monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[str], bool]]:
    """The revokes the workers are asked for (task ids, terminate): Celery's broadcast still
    goes out to the broker; this only writes down what it said."""
    control = record.app.control
    original = control.revoke
    sent: list[tuple[list[str], bool]] = []

    def revoke(task_ids: Any, **options: Any) -> Any:
        sent.append((list(task_ids), bool(options.get("terminate"))))
        return original(task_ids, **options)

    monkeypatch.setattr(control, "revoke", revoke)
    return sent


@contextmanager
def delivery(task: Any, run: Run, token: int = 0, retries: int = 0) -> Iterator[None]:
    """A delivery of ``run``'s message, with its slot in the headers as a beat sends it."""
    with unslotted_delivery(task, run, token, retries):
        task.request.driftsafe_slot = run.slot.isoformat()
        yield


def _reason(run: Run) -> str:
    return f"the run of slot {run.slot.isoformat()} (run {run.pk})"


def test_the_next_slot_replaces_a_running_run_and_runs_once_its_body_is_gone(
    record: Any,
    calls: list[Any],
    redis_client: Any,
    revokes: list[tuple[list[str], bool]],
    path: str,
    locks: str,
) -> None:
    """The second slot comes while the first runs: it waits (its message acknowledged), marks
    the first replaced and asks for it to be revoked, terminated. The first's body runs on
    here (a pool that cannot terminate it): nothing else starts meanwhile. When it ends, the
    first is recorded ``revoked``, naming the slot that replaced it (not ``succeeded``), and
    its delivery publishes the second, handing it the running lock; the second runs."""
    periodic = overlap_task("replaced", "replace")
    first, second = (slot_run(periodic, s) for s in (1, 2))
    drain()
    with body_running(record, first, "a", redis_client):
        with delivery(record, second), pytest.raises(Ignore):
            record("b")
        second.refresh_from_db()
        assert second.status == RunStatus.WAITING, second.error
        assert second.error == REPLACING_WHY
        first.refresh_from_db()
        assert first.status == RunStatus.STARTED, "its body runs on"
        assert first.replaced_by == second.pk
        assert revokes == [([first.celery_task_id], True)]
        assert drain() == [], "nothing published while the replaced body runs"
    first.refresh_from_db()
    assert first.status == RunStatus.REVOKED, first.error
    assert first.error == f"revoked: replaced by {_reason(second)} (overlap policy 'replace')"
    assert first.finished_at is not None
    second.refresh_from_db()
    assert second.status == RunStatus.DISPATCHED, second.error
    assert held_for(redis_client, second) == f"heir:run:{second.pk}"
    assert deliver_published(record, second, "x") == "x"
    assert calls == ["a", "x"]
    assert Run.objects.get(pk=second.pk).status == RunStatus.SUCCEEDED


def test_a_released_replacement_not_started_yet_is_replaced_by_the_next_slot(
    record: Any,
    calls: list[Any],
    redis_client: Any,
    revokes: list[tuple[list[str], bool]],
    path: str,
    locks: str,
) -> None:
    """The second slot replaced the first, whose body ended: the second is released, the
    running lock handed to it, and its message is on its way. The third slot comes first: the
    latest slot wins, so the second ends ``revoked`` before it starts (naming the third) and
    the third waits; the second's delivery then finds it finished and passes the lock on to
    the third, which runs. Before, the third waited behind the second, whose whole body ran
    (a slot later on a body longer than the interval)."""
    periodic = overlap_task("released-replaced", "replace")
    first, second, third = (slot_run(periodic, s) for s in (1, 2, 3))
    drain()
    with (
        body_running(record, first, "a", redis_client),
        delivery(record, second),
        pytest.raises(Ignore),
    ):
        record("b")
    [message] = drain()  # the second, released, the running lock handed to it
    assert message["id"] == second.celery_task_id
    assert held_for(redis_client, second) == f"heir:run:{second.pk}"
    with delivery(record, third), pytest.raises(Ignore):
        record("c")
    second.refresh_from_db()
    assert second.status == RunStatus.REVOKED, second.error
    assert second.error.startswith(f"revoked: replaced before it started by {_reason(third)}")
    assert Run.objects.get(pk=third.pk).status == RunStatus.WAITING
    assert drain() == [], "the lock is the second's: the third waits for it"
    with delivery(record, second, token=message["driftsafe_fencing_token"]), pytest.raises(Ignore):
        record("b")  # finished: its turn goes on to the third
    assert deliver_published(record, third, "z") == "z"
    assert calls == ["a", "z"]
    assert Run.objects.get(pk=third.pk).status == RunStatus.SUCCEEDED
    assert held_for(redis_client, third) is None, "given back at the end"


def test_a_failing_replaced_body_ends_revoked_too(
    record: Any, calls: list[Any], redis_client: Any, revokes: Any, path: str
) -> None:
    """Whatever order the ends come in: the replaced body fails after its replacement marked
    it; it is still recorded ``revoked``, naming its replacement."""
    periodic = overlap_task("fails", "replace")
    first, second = (slot_run(periodic, s) for s in (1, 2))
    with (
        body_running(record, first, "boom", redis_client),
        delivery(record, second),
        pytest.raises(Ignore),
    ):
        record("b")
    first.refresh_from_db()
    assert (first.status, first.replaced_by) == (RunStatus.REVOKED, second.pk)
    assert _reason(second) in first.error
    assert Run.objects.get(pk=second.pk).status == RunStatus.DISPATCHED


def test_a_later_slot_replaces_the_waiting_one_and_every_slot_is_accounted_for(
    record: Any, calls: list[Any], redis_client: Any, revokes: Any, path: str
) -> None:
    """The body runs on while two more slots come: the third replaces the second, which had
    not started yet (it ends ``revoked``, replaced before it started), and the running run is
    marked replaced by the third. When the body ends, the third runs: one body at a time, and
    each slot ends once."""
    periodic = overlap_task("latest-wins", "replace")
    first, second, third = (slot_run(periodic, s) for s in (1, 2, 3))
    drain()
    with body_running(record, first, "a", redis_client):
        for run, value in ((second, "b"), (third, "c")):
            with delivery(record, run), pytest.raises(Ignore):
                record(value)
        second.refresh_from_db()
        assert second.status == RunStatus.REVOKED
        assert second.error == (
            f"revoked: replaced before it started by {_reason(third)} (overlap policy 'replace')"
        )
        assert Run.objects.get(pk=third.pk).status == RunStatus.WAITING
        assert Run.objects.get(pk=first.pk).replaced_by == third.pk
    deliver_published(record, third, "z")
    assert calls == ["a", "z"]
    statuses = [Run.objects.get(pk=run.pk).status for run in (first, second, third)]
    assert statuses == [RunStatus.REVOKED, RunStatus.REVOKED, RunStatus.SUCCEEDED]


def test_a_delivery_that_came_late_does_not_replace_a_later_slots_run(
    record: Any, calls: list[Any], redis_client: Any, revokes: Any, path: str
) -> None:
    """An earlier slot's message reaches a worker after a later slot's run started (a worker's
    prefetch, a message sent again): it is skipped, saying why, and the running run goes on,
    not replaced. A later slot that comes replaces the running run and, before they start, the
    earlier slots' runs whose messages are still on their way (the latest slot wins): such a
    run ends revoked, naming it, and its delivery changes nothing; the later slot's run keeps
    waiting."""
    periodic = overlap_task("late-delivery", "replace")
    first, busy, third, fourth = (slot_run(periodic, s) for s in (1, 2, 3, 4))
    with body_running(record, busy, "b", redis_client):
        with delivery(record, first), pytest.raises(Ignore):
            record("a")  # a later slot's run runs
        with delivery(record, fourth), pytest.raises(Ignore):
            record("d")
        assert Run.objects.get(pk=fourth.pk).status == RunStatus.WAITING
        third.refresh_from_db()
        assert third.status == RunStatus.REVOKED, third.error
        assert third.error.startswith(f"revoked: replaced before it started by {_reason(fourth)}")
        with delivery(record, third), pytest.raises(Ignore):
            record("c")  # its run was replaced before it started
        first.refresh_from_db()
        assert first.status == RunStatus.SKIPPED
        assert "a run of a later slot of this task runs or waits" in first.error
        assert Run.objects.get(pk=third.pk).status == RunStatus.REVOKED
        assert Run.objects.get(pk=fourth.pk).status == RunStatus.WAITING, "still waiting"
        assert Run.objects.get(pk=busy.pk).replaced_by == fourth.pk
        assert revokes == [([busy.celery_task_id], True)]
    assert calls == ["b"]


def test_a_replaced_run_whose_body_retries_does_not_come_back(
    record: Any, broker_app: Any, redis_client: Any, revokes: Any, path: str
) -> None:
    """The replaced body calls ``retry()`` after its replacement marked it: the retry is not
    sent (no message for a next attempt; Celery rejects the delivery), and the run ends
    ``revoked``."""
    from celery.exceptions import Reject
    from django.db import connections

    from celery_driftsafe.task import DriftSafeTask

    @broker_app.task(name="tests.retrying", base=DriftSafeTask, shared=False, bind=True)
    def retrying(self: Any, value: str) -> None:
        self.gate.wait(10)
        raise self.retry(countdown=0, max_retries=3)

    retrying.gate = threading.Event()
    periodic = interval_task(
        "retries",
        1,
        anchor=datetime(2026, 3, 1, tzinfo=UTC),
        task="tests.retrying",
        overlap_policy="replace",
    )
    first, second = (slot_run(periodic, s) for s in (1, 2))
    Run.objects.filter(pk__in=(first.pk, second.pk)).update(task_name="tests.retrying")
    drain()
    ended: list[BaseException] = []

    def body() -> None:
        retrying.push_request(
            id=first.celery_task_id,
            retries=0,
            hostname="worker-1",
            called_directly=False,
            delivery_info={},
            args=["a"],
            kwargs={},
            driftsafe_run_id=first.pk,
            driftsafe_fencing_token=0,
            driftsafe_periodic_task_id=periodic.pk,
        )
        try:
            retrying("a")
        except Reject as exc:
            ended.append(exc)
        finally:
            retrying.pop_request()
            connections.close_all()

    worker = threading.Thread(target=body)
    worker.start()
    wait_until(
        lambda: (
            Run.objects.get(pk=first.pk).status == RunStatus.STARTED
            and held_for(redis_client, first) is not None
        ),
        "the first run started holding the task's running lock",
    )
    try:
        with delivery(retrying, second), pytest.raises(Ignore):
            retrying("b")
    finally:
        retrying.gate.set()
        worker.join()
    assert ended, "the retry was not sent: Celery rejects the delivery"
    first.refresh_from_db()
    assert first.status == RunStatus.REVOKED, first.error
    assert _reason(second) in first.error
    messages = drain()
    assert [m["id"] for m in messages] == [second.celery_task_id], "no retry of the first"


def test_a_run_between_two_attempts_is_replaced_and_its_retry_is_dropped(
    record: Any, calls: list[Any], redis_client: Any, revokes: Any, path: str
) -> None:
    """The previous run is between two attempts (``retrying``: no body runs) when the next
    slot comes: the next slot runs at once, and the run that was retrying ends ``revoked``;
    its retry's message, when it comes, is dropped as a copy of a finished run."""
    periodic = overlap_task("retry-replaced", "replace")
    first = slot_run(periodic, 1, status=RunStatus.RETRYING, attempt=1)
    second = slot_run(periodic, 2)
    with delivery(record, second):
        assert record("b") == "b"
    first.refresh_from_db()
    assert first.status == RunStatus.REVOKED
    assert first.error == (
        f"revoked: replaced before its retry by {_reason(second)} (overlap policy 'replace')"
    )
    with delivery(record, first, retries=1), pytest.raises(Ignore):
        record("a")
    assert calls == ["b"]
    assert revokes == []


def _killed_body(periodic: PeriodicTask, run: Run) -> None:
    """``run`` started, its body in a pool process a prefork worker killed: its running lock
    (taken for it, so naming it) and its lease are still held, and nobody gives them back."""
    settings = get_settings()
    held = running_lock(lock_backend(settings), periodic.pk, settings, run_id=run.pk)
    assert held.acquire(blocking=False)
    _started(run)


def _started(run: Run) -> None:
    """``run``'s start as its delivery writes it: by ``worker-0``, token 1, under a lease."""
    now = authority_clock().now()
    Run.objects.filter(pk=run.pk).update(
        status=RunStatus.STARTED,
        started_at=now,
        worker="worker-0",
        fencing_token=1,
        lease_until=now + timedelta(seconds=get_settings().lease_seconds),
    )


def test_the_main_process_publishes_the_replacement_once_the_killed_body_is_gone(
    record: Any,
    calls: list[Any],
    broker_app: Any,
    redis_client: Any,
    revokes: Any,
    path: str,
    locks: str,
) -> None:
    """The replaced run's body was killed (a prefork worker's terminating revoke): its
    delivery cannot hand the running lock on. The worker's main process, once its pool saw
    the process end, takes the lock from the killed holder and publishes the replacement with
    the lock handed to it, at once (not a lease later); the replacement runs."""
    periodic = overlap_task("killed", "replace")
    first, second = (slot_run(periodic, s) for s in (1, 2))
    _killed_body(periodic, first)
    drain()
    with delivery(record, second), pytest.raises(Ignore):
        record("b")
    assert Run.objects.get(pk=second.pk).status == RunStatus.WAITING
    assert drain() == [], "the lock is held: nobody publishes it yet"
    context = Context(
        id=first.celery_task_id,
        hostname="worker-0",
        retries=0,
        driftsafe_run_id=first.pk,
        driftsafe_fencing_token=0,
        driftsafe_periodic_task_id=periodic.pk,
    )
    replaced_body_killed(broker_app, context)
    second.refresh_from_db()
    assert second.status == RunStatus.DISPATCHED, second.error
    assert second.claimed_by == "worker:worker-0"
    assert held_for(redis_client, second) == f"heir:run:{second.pk}"
    assert deliver_published(record, second, "x") == "x"
    assert calls == ["x"]


def _lease_over(run: Run) -> None:
    """The lease of started ``run`` ran out (nobody renews it: its delivery is gone)."""
    Run.objects.filter(pk=run.pk).update(lease_until=authority_clock().now() - timedelta(seconds=1))


def test_a_replaced_run_whose_delivery_is_gone_is_recorded_revoked_by_a_beat(
    record: Any,
    calls: list[Any],
    broker_app: Any,
    redis_client: Any,
    revokes: Any,
    path: str,
    locks: str,
) -> None:
    """The chaos run's case: the first run's start was written, then its delivery went away
    with no outcome, giving its locks back (the database failed it just after the start, and
    it re-sent its message for later, a message the revoke of the run's id makes its worker
    discard unrecorded); the second slot replaces it and waits. Nothing is done
    while the first's lease lasts (a body may run under it). Once it is over, a beat's
    recovery records the first ``revoked``, naming its replacement (before, it stayed
    ``started`` beside the replacement that ran, until the reconciliation recorded it
    ``failed`` an hour later, a failure towards ``pause_after_failures``), and publishes the
    second, which runs."""
    periodic = overlap_task("gone", "replace")
    first, second = (slot_run(periodic, s) for s in (1, 2))
    _started(first)
    drain()
    with delivery(record, second), pytest.raises(Ignore):
        record("b")
    assert revokes == [([first.celery_task_id], True)]
    recover(broker_app)
    assert Run.objects.get(pk=first.pk).status == RunStatus.STARTED, "its lease lasts"
    assert Run.objects.get(pk=second.pk).status == RunStatus.WAITING
    assert drain() == []
    _lease_over(first)
    recover(broker_app)
    first.refresh_from_db()
    assert first.status == RunStatus.REVOKED, first.error
    assert first.error == f"revoked: replaced by {_reason(second)} (overlap policy 'replace')"
    assert first.finished_at is not None and first.fencing_token > 1
    assert deliver_published(record, second, "x") == "x"
    assert calls == ["x"]
    periodic.refresh_from_db()
    assert periodic.consecutive_failures == 0


def test_the_reconciliation_records_a_gone_replaced_run_revoked_not_failed(
    record: Any, redis_client: Any, revokes: Any
) -> None:
    """A replaced run left started by a delivery that is gone, its lease over: the minute's
    reconciliation (a beat that has not run its recovery yet) records it ``revoked`` too,
    at once, not ``failed`` once ``STUCK_RUN_SECONDS`` have gone; a run nobody replaced is
    left for then. Neither counts towards ``pause_after_failures``."""
    from celery_driftsafe.beat.recovery import reconcile

    periodic = overlap_task("gone-reconciled", "replace", pause_after_failures=1)
    first, second = (slot_run(periodic, s) for s in (1, 2))
    alone = slot_run(overlap_task("not-replaced-gone", "replace"), 1)
    _started(first)
    _started(alone)
    with delivery(record, second), pytest.raises(Ignore):
        record("b")
    _lease_over(first)
    _lease_over(alone)
    done = reconcile(authority_clock().now(), lease=timedelta(seconds=get_settings().lease_seconds))
    assert (done.replaced, done.lost) == ([first.pk], [])
    assert done.outcomes()["replaced"] == 1
    assert Run.objects.get(pk=first.pk).status == RunStatus.REVOKED
    assert Run.objects.get(pk=alone.pk).status == RunStatus.STARTED
    periodic.refresh_from_db()
    assert (periodic.enabled, periodic.consecutive_failures) == (True, 0)


def test_the_main_process_leaves_a_run_nobody_replaced_alone(
    record: Any, broker_app: Any, redis_client: Any, path: str
) -> None:
    """A pool process lost under a run that was not replaced: its running lock stays held
    (a beat's recovery frees the task after the lease, as before)."""
    periodic = overlap_task("not-replaced", "replace")
    first = slot_run(periodic, 1)
    _killed_body(periodic, first)
    context = Context(
        id=first.celery_task_id,
        hostname="worker-0",
        driftsafe_run_id=first.pk,
        driftsafe_fencing_token=0,
        driftsafe_periodic_task_id=periodic.pk,
    )
    replaced_body_killed(broker_app, context)
    assert (held_for(redis_client, first) or "").startswith(f"run:{first.pk}#")


@pytest.mark.parametrize(
    ("pool", "terminates"),
    [
        ("celery.concurrency.thread:TaskPool", False),
        ("celery.concurrency.solo:TaskPool", False),
        ("celery.concurrency.gevent:TaskPool", True),
    ],
)
def test_which_pools_terminate_a_body(pool: str, terminates: bool) -> None:
    """The worker's main process asks its pool: threads and solo keep Celery's
    ``terminate_job``, which raises (the revoke would fail); gevent kills the greenlet."""
    from celery.utils.imports import symbol_by_name

    from celery_driftsafe.worker.request import _can_terminate

    instance = symbol_by_name(pool)(limit=1)
    assert _can_terminate(instance) is terminates


def test_releasing_the_waiting_run_drops_no_later_slot_the_latest_replaces_it() -> None:
    """Under ``buffer_one`` the later slots queued behind the running run are dropped when the
    waiting run is released (it goes first); under ``replace`` the latest slot wins, so they
    stay queued, and the first of them to come replaces the released run in turn."""
    from celery_driftsafe.claim.outbox import release_waiting

    periodic = overlap_task("queued-behind", "replace")
    slot_run(periodic, 1, status=RunStatus.REVOKED)  # the run it replaced
    waiting = slot_run(periodic, 2, status=RunStatus.WAITING, fencing_token=1)
    queued = [slot_run(periodic, s) for s in (3, 4)]
    now = datetime(2026, 3, 1, 0, 0, 5, tzinfo=UTC)
    released = release_waiting(now, "worker:w1", periodic_task_id=periodic.pk)
    assert [run.run_id for run in released] == [waiting.pk]
    assert [Run.objects.get(pk=run.pk).status for run in queued] == [RunStatus.DISPATCHED] * 2
