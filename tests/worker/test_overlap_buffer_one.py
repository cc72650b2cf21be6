"""Overlap policy ``buffer_one`` in-process, against the real database and Redis: deliveries
are simulated by pushing the request a worker would build; what a worker publishes lands on the
real Redis broker, where the tests read it back (:func:`tests.conftest.drain`)."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from celery.exceptions import Ignore

from celery_driftsafe.conf import get_settings
from celery_driftsafe.locks import lock_backend, lock_identity
from celery_driftsafe.models import PeriodicTask, Run, RunStatus
from celery_driftsafe.store.clock import authority_clock
from tests import settings as test_settings
from tests.support import drain
from tests.support.overlap import (
    body_running,
    deliver,
    deliver_published,
    delivery,
    held_for,
    overlap_task,
    recover,
    slot_run,
)

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize("value", ["a", "boom"])
def test_one_slot_waits_further_ones_skip_and_the_waiting_one_runs_when_the_running_ends(
    record: Any, calls: list[Any], redis_client: Any, value: str, path: str
) -> None:
    """The first slot runs; the second, delivered meanwhile, waits (its message acknowledged,
    no worker held); the third is skipped, saying another waits. When the first ends (in
    success or failure) its worker publishes the waiting run's message again, same Celery task
    id, and that delivery runs it. On both of the worker's paths."""
    periodic = overlap_task("buffered", "buffer_one")
    first, second, third = (slot_run(periodic, s) for s in (1, 2, 3))
    drain()
    with body_running(record, first, value, redis_client):
        with delivery(record, second), pytest.raises(Ignore):
            record("b")
        second.refresh_from_db()
        assert second.status == RunStatus.WAITING, second.error
        assert "published again when it ends" in second.error
        assert second.worker == "" and second.started_at is None
        with delivery(record, third), pytest.raises(Ignore):
            record("c")
        third.refresh_from_db()
        assert third.status == RunStatus.SKIPPED
        assert "another run of it is already waiting" in third.error
        assert drain() == []  # nothing published while the first runs
    first.refresh_from_db()
    assert first.status == (RunStatus.SUCCEEDED if value == "a" else RunStatus.FAILED)
    second.refresh_from_db()
    assert second.status == RunStatus.DISPATCHED, second.error
    assert second.claimed_by == "worker:worker-1"
    messages = drain()
    assert [m["id"] for m in messages] == [second.celery_task_id]
    assert messages[0]["driftsafe_run_id"] == second.pk
    assert messages[0]["args"] == ["x"]  # the message captured at its claim
    with delivery(record, second, token=messages[0]["driftsafe_fencing_token"]):
        assert record("x") == "x"
    assert calls == [value, "x"]
    second.refresh_from_db()
    assert second.status == RunStatus.SUCCEEDED
    assert Run.objects.get(pk=third.pk).status == RunStatus.SKIPPED


def test_a_copy_of_the_waiting_runs_message_leaves_it_waiting(
    record: Any, calls: list[Any], redis_client: Any, path: str
) -> None:
    """A second delivery of the waiting run's own message (Celery delivers at least once)
    while the first still runs: the run still waits (it is the one waiting), not skipped."""
    periodic = overlap_task("copy", "buffer_one")
    first, second = (slot_run(periodic, s) for s in (1, 2))
    with body_running(record, first, "a", redis_client):
        for _ in range(2):
            with delivery(record, second), pytest.raises(Ignore):
                record("b")
            assert Run.objects.get(pk=second.pk).status == RunStatus.WAITING
    assert Run.objects.get(pk=second.pk).status == RunStatus.DISPATCHED
    assert calls == ["a"]


def test_a_run_that_ends_while_the_next_one_decides_to_wait_does_not_strand_it(
    record: Any, calls: list[Any], monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """The race between an end and a wait: the running run gives its lock back and finds no
    run waiting, in the instant between the next run's finding the lock held and its being
    recorded waiting. The waiting run looks at the lock once it waits, finds it free, and
    publishes itself again at once (not a lease later, by a beat)."""
    from celery_driftsafe.ledger.run_ledger import Ledger

    settings = get_settings()
    periodic = overlap_task("ends-meanwhile", "buffer_one")
    second = slot_run(periodic, 2)
    running_lock = lock_backend(settings).lock(
        f"task-running:{periodic.pk}", ttl=settings.lease_seconds
    )
    assert running_lock.acquire(blocking=False)  # the running run's
    original = Ledger.wait

    def ends_meanwhile(self: Ledger, *args: Any, **kwargs: Any) -> bool:
        running_lock.release()  # it ends, and finds nothing waiting yet
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Ledger, "wait", ends_meanwhile)
    drain()
    with delivery(record, second), pytest.raises(Ignore):
        record("b")
    second.refresh_from_db()
    assert second.status == RunStatus.DISPATCHED, second.error
    assert second.claimed_by == "worker:worker-1"
    [message] = drain()
    assert message["id"] == second.celery_task_id
    monkeypatch.undo()
    with delivery(record, second, token=message["driftsafe_fencing_token"]):
        assert record("x") == "x"
    assert calls == ["x"]


@pytest.mark.parametrize("policy", ["buffer_one", "buffer_all", "replace"])
def test_a_run_that_waits_once_the_ending_run_looked_is_published_as_the_lock_is_given_up(
    record: Any,
    calls: list[Any],
    redis_client: Any,
    monkeypatch: pytest.MonkeyPatch,
    path: str,
    locks: str,
    policy: str,
) -> None:
    """The race's other side: the running run's end looks for a waiting run and finds none;
    the next slot's delivery then waits and finds the running lock still held (not given up
    yet), so it leaves its turn to the holder. Having given the lock up handed to nobody, the
    ending run looks once more and publishes the waiting run. Before, it waited for a beat's
    recovery pass (a chaos run whose beats had stopped left such a run waiting for good)."""
    from celery_driftsafe.claim import outbox

    periodic = overlap_task(f"waits-after-the-look-{policy}", policy)
    first, second = (slot_run(periodic, s) for s in (1, 2))
    original = outbox.release_waiting
    seen: list[str] = []

    def waits_after_the_look(*args: Any, **kwargs: Any) -> Any:
        runs = original(*args, **kwargs)
        if not seen:
            comes = threading.Thread(target=deliver, args=(record, second, "b"))
            comes.start()
            comes.join()
            seen.append(Run.objects.get(pk=second.pk).status)
        return runs

    drain()
    with body_running(record, first, "a", redis_client):
        monkeypatch.setattr(outbox, "release_waiting", waits_after_the_look)
    monkeypatch.undo()
    assert seen == [RunStatus.WAITING], "the next slot waited while the lock was held"
    second.refresh_from_db()
    assert second.status == RunStatus.DISPATCHED, second.error
    assert second.claimed_by == "worker:worker-1"
    assert deliver_published(record, second, "x") == "x"
    assert calls == ["a", "x"]
    assert Run.objects.get(pk=second.pk).status == RunStatus.SUCCEEDED


def _first_ran_while_second_waited(
    record: Any, redis_client: Any, name: str, meanwhile: Any = None
) -> tuple[Run, Run]:
    """Two slots of a ``buffer_one`` task: the first runs (body "a"), the second is delivered
    meanwhile and waits, ``meanwhile()`` is called, then the first ends."""
    periodic = overlap_task(name, "buffer_one")
    first, second = (slot_run(periodic, s) for s in (1, 2))
    drain()
    with body_running(record, first, "a", redis_client):
        with delivery(record, second), pytest.raises(Ignore):
            record("b")
        assert Run.objects.get(pk=second.pk).status == RunStatus.WAITING
        if meanwhile is not None:
            meanwhile()
    return first, second


def test_a_later_slot_delivered_as_the_running_run_ends_does_not_go_before_the_waiting_one(
    record: Any,
    calls: list[Any],
    redis_client: Any,
    monkeypatch: pytest.MonkeyPatch,
    path: str,
    locks: str,
) -> None:
    """A later slot's delivery comes in the instant the running run ends, just before that run
    takes the waiting run back. The running lock is still held then (it is given up after, and
    handed to the waiting run): the later slot is skipped, another run waiting, and does not
    start in the waiting run's place. Before, the lock was given back first and the later
    slot ran, the waiting one after it, or skipped."""
    from celery_driftsafe.claim import outbox

    original = outbox.release_waiting
    later: list[Run] = []

    def a_later_slot_comes_first(*args: Any, **kwargs: Any) -> Any:
        if not later:
            later.append(slot_run(PeriodicTask.objects.get(name="ends-as-one-comes"), 3))
            late = threading.Thread(target=deliver, args=(record, later[0], "c"))
            late.start()
            late.join()
        return original(*args, **kwargs)

    _, second = _first_ran_while_second_waited(
        record,
        redis_client,
        "ends-as-one-comes",
        lambda: monkeypatch.setattr(outbox, "release_waiting", a_later_slot_comes_first),
    )
    [third] = later
    third.refresh_from_db()
    assert third.status == RunStatus.SKIPPED, third.error
    assert "already waiting" in third.error
    assert held_for(redis_client, second) == f"heir:run:{second.pk}"
    assert deliver_published(record, second, "x") == "x"
    assert calls == ["a", "x"]
    assert Run.objects.get(pk=second.pk).status == RunStatus.SUCCEEDED
    assert held_for(redis_client, second) is None, "given back at the end"


def test_a_slot_delivered_before_the_released_run_waits_behind_it(
    record: Any, calls: list[Any], redis_client: Any, path: str, locks: str
) -> None:
    """The running run ended and published the waiting run again; a later slot's delivery
    reaches a worker before it (the broker, a worker's prefetch, a busy pool). The running
    lock was handed to the released run: the later slot cannot take it, so it waits; the
    released run takes the lock handed to it and runs, then hands it on to the later slot,
    which runs next. Before, the later slot took the free lock and ran first."""
    first, second = _first_ran_while_second_waited(record, redis_client, "overtaken")
    [released] = drain()
    assert released["id"] == second.celery_task_id
    third = slot_run(first.periodic_task, 3)  # claimed after the release: not dropped
    with delivery(record, third), pytest.raises(Ignore):
        record("c")
    third.refresh_from_db()
    assert third.status == RunStatus.WAITING, third.error
    assert drain() == [], "the lock is not free: the waiting slot does not publish itself"
    with delivery(record, second, token=released["driftsafe_fencing_token"]):
        assert record("x") == "x"
    [next_one] = drain()
    assert next_one["id"] == third.celery_task_id
    assert held_for(redis_client, third) == f"heir:run:{third.pk}"
    with delivery(record, third, token=next_one["driftsafe_fencing_token"]):
        assert record("y") == "y"
    assert calls == ["a", "x", "y"]
    assert [Run.objects.get(pk=run.pk).status for run in (first, second, third)] == [
        RunStatus.SUCCEEDED
    ] * 3


def test_a_released_run_that_expired_passes_its_turn_on(
    record: Any, calls: list[Any], redis_client: Any, path: str
) -> None:
    """The running lock was handed to the released run, whose message then expired before a
    worker took it: its delivery records it expired and hands the lock on to the run that
    waits meanwhile, published at once, rather than leave the task's slots waiting until the
    handed lock's lease runs out."""
    first, second = _first_ran_while_second_waited(record, redis_client, "expired-heir")
    [released] = drain()
    third = slot_run(first.periodic_task, 3)
    with delivery(record, third), pytest.raises(Ignore):
        record("c")
    assert Run.objects.get(pk=third.pk).status == RunStatus.WAITING
    past = authority_clock().now() - timedelta(seconds=1)
    Run.objects.filter(pk=second.pk).update(expires_at=past)
    with (
        delivery(record, second, token=released["driftsafe_fencing_token"]),
        pytest.raises(Ignore),
    ):
        record("x")
    assert Run.objects.get(pk=second.pk).status == RunStatus.EXPIRED
    [next_one] = drain()
    assert next_one["id"] == third.celery_task_id
    with delivery(record, third, token=next_one["driftsafe_fencing_token"]):
        assert record("y") == "y"
    assert calls == ["a", "y"]


def test_a_released_run_takes_the_lock_handed_to_it_after_the_policy_became_skip(
    record: Any, calls: list[Any], redis_client: Any, path: str
) -> None:
    """The task's overlap policy is changed to ``skip`` while the running lock is handed to
    the released run: its delivery still takes the lock handed to it and runs (no run of the
    task runs), rather than be skipped and leave the task's slots skipped until the handed
    lock's lease runs out."""
    first, second = _first_ran_while_second_waited(record, redis_client, "became-skip")
    [released] = drain()
    PeriodicTask.objects.filter(pk=first.periodic_task_id).update(overlap_policy="skip")
    with delivery(record, second, token=released["driftsafe_fencing_token"]):
        assert record("x") == "x"
    assert calls == ["a", "x"]
    assert held_for(redis_client, second) is None, "freed at the end (skip hands nothing on)"


def test_a_run_whose_running_lock_was_lost_leaves_the_waiting_run_to_a_beat(
    record: Any,
    calls: list[Any],
    redis_client: Any,
    broker_app: Any,
    monkeypatch: pytest.MonkeyPatch,
    path: str,
) -> None:
    """The running run's lock was declared lost by the time its body ended (its lease ran out
    while the worker was paused, say): the lock is no longer its to hand over, so it does not
    take the waiting run back; a beat's recovery does, once the lock is free and the run's
    lease in the ledger over, and hands the lock to it."""
    from celery_driftsafe.worker.overlap import Overlap

    original = Overlap._take_back_waiting

    def lost_meanwhile(self: Overlap, periodic_task_id: int, held: Any) -> None:
        held._mark_lost("the lease ran out while the worker was paused")
        original(self, periodic_task_id, held)

    monkeypatch.setattr(Overlap, "_take_back_waiting", lost_meanwhile)
    _, second = _first_ran_while_second_waited(record, redis_client, "lost-at-the-end")
    assert Run.objects.get(pk=second.pk).status == RunStatus.WAITING
    assert drain() == []
    assert held_for(redis_client, second) is None, "freed, not handed"
    recover(broker_app)
    [message] = drain()
    assert message["id"] == second.celery_task_id
    assert held_for(redis_client, second) == f"heir:run:{second.pk}"
    monkeypatch.undo()
    with delivery(record, second, token=message["driftsafe_fencing_token"]):
        assert record("x") == "x"
    assert calls == ["a", "x"]


@pytest.mark.parametrize("policy", ["buffer_one", "buffer_all"])
def test_a_retrys_attempt_does_not_wait_it_is_skipped_saying_why(
    record: Any, calls: list[Any], redis_client: Any, path: str, policy: str
) -> None:
    """A retry's attempt (its run ``retrying``) finds the task running: it does not wait (its
    message would come back as the first attempt's, and be dropped as a copy of it); it is
    skipped as under ``skip``, saying so, under either buffering policy."""
    periodic = overlap_task("retrying", policy)
    first = slot_run(periodic, 1)
    second = slot_run(periodic, 2, status=RunStatus.RETRYING, attempt=1)
    with (
        body_running(record, first, "a", redis_client),
        delivery(record, second, retries=1),
        pytest.raises(Ignore),
    ):
        record("b")
    second.refresh_from_db()
    assert second.status == RunStatus.SKIPPED
    assert "a retry's attempt does not wait" in second.error
    assert f"(overlap policy '{policy}')" in second.error
    assert not Run.objects.filter(status=RunStatus.WAITING).exists()
    assert calls == ["a"]


def test_two_deliveries_at_once_while_one_runs_leave_one_waiting_one_skipped(
    record: Any, calls: list[Any], redis_client: Any, path: str
) -> None:
    """Two slots' deliveries reach two workers at the same moment while the task runs: the
    database lets one wait; the other is skipped. Repeated, for the race to be a race."""
    periodic = overlap_task("race", "buffer_one")
    first = slot_run(periodic, 1)
    with body_running(record, first, "a", redis_client):
        for round_ in range(5):
            pair = [slot_run(periodic, 10 + 2 * round_ + i) for i in (0, 1)]
            barrier = threading.Barrier(2)

            def at_once(run: Run, barrier: threading.Barrier) -> None:
                barrier.wait()
                deliver(record, run, "late")

            threads = [threading.Thread(target=at_once, args=(run, barrier)) for run in pair]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            statuses = sorted(Run.objects.get(pk=run.pk).status for run in pair)
            assert statuses == [RunStatus.SKIPPED, RunStatus.WAITING], statuses
            # the next round: the waiting one is skipped by hand, as if its slot had passed
            Run.objects.filter(status=RunStatus.WAITING).update(status=RunStatus.SKIPPED)
    assert calls == ["a"]


@pytest.mark.parametrize("policy", ["buffer_one", "buffer_all"])
def test_the_database_lets_as_many_runs_wait_as_may_of_many_at_once(policy: str) -> None:
    """The ledger's statement alone, seven threads more than may wait (``buffer_one``: one,
    ``buffer_all``: its bound), each on its own run and connection, released at once: as many
    wait as may; the others learn that many wait already. The index that decided for
    ``buffer_one`` is gone (migration 0022): the statement holds the task's row."""
    from django.db import connections

    from celery_driftsafe.core.stored_names import MAX_WAITING, OverlapPolicy
    from celery_driftsafe.ledger.run_ledger import Ledger

    limit = MAX_WAITING[OverlapPolicy(policy)]
    periodic = overlap_task("many", policy)
    for round_ in range(3):
        runs = [slot_run(periodic, (limit + 7) * round_ + i) for i in range(limit + 7)]
        barrier = threading.Barrier(len(runs))
        results: dict[int, bool] = {}

        def wait(run: Run, barrier: threading.Barrier, results: dict[int, bool]) -> None:
            try:
                barrier.wait()
                results[run.pk] = Ledger().wait(
                    run.pk, 1, periodic.pk, "waiting", store="database", started=False, limit=limit
                )
            finally:
                connections.close_all()

        threads = [threading.Thread(target=wait, args=(run, barrier, results)) for run in runs]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert sorted(results.values()) == [False] * 7 + [True] * limit
        waiting = Run.objects.filter(status=RunStatus.WAITING)
        assert sorted(waiting.values_list("pk", flat=True)) == sorted(
            pk for pk, waited in results.items() if waited
        )
        waiting.update(status=RunStatus.SKIPPED)


def test_overlap_skip_still_skips_and_never_waits(
    record: Any, calls: list[Any], redis_client: Any
) -> None:
    periodic = overlap_task("skipper", policy="skip")
    first, second = (slot_run(periodic, s) for s in (1, 2))
    with (
        body_running(record, first, "a", redis_client),
        delivery(record, second),
        pytest.raises(Ignore),
    ):
        record("b")
    assert Run.objects.get(pk=second.pk).status == RunStatus.SKIPPED
    assert drain() == []


@pytest.mark.parametrize("policy", ["buffer_one", "buffer_all"])
def test_without_a_run_lock_a_run_does_not_wait_it_is_skipped_saying_why(
    record: Any, calls: list[Any], policy: str
) -> None:
    """Redis away and ``REDIS_UNAVAILABLE = "fail_open"``: the database's conditional start
    alone decides, and no shared running lock would tell when to go on, so a run that finds
    the task running is skipped as under ``skip``, saying why; it does not wait."""
    from django.test import override_settings

    periodic = overlap_task("open", policy)
    running, late = (slot_run(periodic, s) for s in (1, 2))
    Run.objects.filter(pk=running.pk).update(status=RunStatus.STARTED, worker="other")
    dead_redis = {
        **test_settings.DRIFTSAFE,
        "REDIS_URL": "redis://127.0.0.1:1/0",
        "TIME_AUTHORITY": "database",
        "REDIS_UNAVAILABLE": "fail_open",
    }
    with override_settings(DRIFTSAFE=dead_redis), delivery(record, late), pytest.raises(Ignore):
        record("a")
    late.refresh_from_db()
    assert late.status == RunStatus.SKIPPED
    assert "without a run lock a run does not wait" in late.error
    assert f"(overlap policy '{policy}')" in late.error
    assert not Run.objects.filter(status=RunStatus.WAITING).exists()
    assert calls == []


@pytest.mark.parametrize("policy", ["buffer_one", "buffer_all", "replace"])
def test_a_beat_publishes_a_waiting_run_once_the_running_ones_worker_is_gone(
    broker_app: Any, redis_client: Any, policy: str
) -> None:
    """The worker of the running run died before it could publish the waiting run: while the
    task's running lock is held, or the running run's lease in the ledger lasts, a beat's
    recovery leaves the waiting run alone; once both are over it publishes it (same task id,
    the token it waited under), and only once, handing it the lock. The same under every
    policy whose runs wait (``replace``: the run that replaced the lost one)."""
    settings = get_settings()
    periodic = overlap_task("orphan", policy)
    now = authority_clock().now()
    lost = slot_run(
        periodic,
        1,
        status=RunStatus.STARTED,
        worker="dead-worker",
        fencing_token=3,
        lock_store=lock_identity(settings),
        started_at=now - timedelta(seconds=5),
        lease_until=now + timedelta(seconds=30),
    )
    waiting = slot_run(
        periodic, 2, status=RunStatus.WAITING, fencing_token=4, lock_store=lock_identity(settings)
    )
    drain()
    recover(broker_app)  # the running run's lease lasts
    assert Run.objects.get(pk=waiting.pk).status == RunStatus.WAITING
    Run.objects.filter(pk=lost.pk).update(lease_until=now - timedelta(seconds=1))
    running_lock = lock_backend(settings).lock(
        f"task-running:{periodic.pk}", ttl=settings.lease_seconds
    )
    assert running_lock.acquire(blocking=False)
    try:
        recover(broker_app)  # its lock is still held (its lease in Redis lasts)
        assert Run.objects.get(pk=waiting.pk).status == RunStatus.WAITING
    finally:
        running_lock.release()
    assert drain() == []
    recover(broker_app)
    recover(broker_app)
    waiting.refresh_from_db()
    assert waiting.status == RunStatus.DISPATCHED
    assert waiting.claimed_by == "beat-1"
    messages = drain()
    assert [(m["id"], m["driftsafe_fencing_token"]) for m in messages] == [
        (waiting.celery_task_id, 4)
    ]
    # and the running lock was handed to it: no later slot starts before it
    assert held_for(redis_client, waiting) == f"heir:run:{waiting.pk}"
    assert not running_lock.acquire(blocking=False)


def test_a_run_waiting_when_its_periodic_task_is_deleted_is_published_and_runs_once(
    record: Any, calls: list[Any], broker_app: Any
) -> None:
    """The task is deleted while a run of it waits: its runs are kept (their task set null),
    nothing of the task runs any more to publish the waiting one, so a beat does; it runs
    once, as a run already sent of a deleted task does."""
    periodic = overlap_task("deleted", "buffer_one")
    waiting = slot_run(
        periodic, 2, status=RunStatus.WAITING, fencing_token=4, lock_store=lock_identity()
    )
    periodic.delete()
    drain()
    recover(broker_app)
    waiting.refresh_from_db()
    assert waiting.status == RunStatus.DISPATCHED
    assert deliver_published(record, waiting, "x") == "x"
    assert calls == ["x"]
    assert Run.objects.get(pk=waiting.pk).status == RunStatus.SUCCEEDED


def test_a_waiting_run_past_its_expiry_is_recorded_expired(broker_app: Any) -> None:
    """A run that waited past its message's expiry is not run late: a reconcile pass records
    it expired, and a beat does not publish it."""
    from celery_driftsafe.beat.recovery import reconcile

    periodic = overlap_task("expiring", "buffer_one")
    now = authority_clock().now()
    waiting = slot_run(
        periodic,
        1,
        status=RunStatus.WAITING,
        claimed_at=now - timedelta(seconds=120),
        expires_at=now - timedelta(seconds=60),
    )
    done = reconcile(now, lease=timedelta(seconds=30))
    assert done.expired == [waiting.pk]
    waiting.refresh_from_db()
    assert waiting.status == RunStatus.EXPIRED
    assert "expired" in waiting.error


def test_releasing_the_waiting_run_drops_the_later_slots_queued_behind_the_running_one() -> None:
    """A worker busy (or dead) with the running run leaves the task's later slots queued; the
    waiting run, published again when the running one ends, would come after them, and the
    first of them would start in its place. Released, it goes first: the later slots not
    started are skipped, a started one is left alone, another task's are not touched."""
    from celery_driftsafe.claim.outbox import DROPPED_WHY, release_waiting

    periodic, other = overlap_task("busy", "buffer_one"), overlap_task("bystander", "buffer_one")
    slot_run(periodic, 1, status=RunStatus.SUCCEEDED)  # the run that ended
    waiting = slot_run(periodic, 2, status=RunStatus.WAITING, fencing_token=1)
    queued = [slot_run(periodic, s) for s in (3, 4)]
    claimed = slot_run(periodic, 5, status=RunStatus.CLAIMED)
    bystander = slot_run(other, 3)
    now = datetime(2026, 3, 1, 0, 0, 6, tzinfo=UTC)
    released = release_waiting(now, "worker:w1", periodic_task_id=periodic.pk)
    assert [run.run_id for run in released] == [waiting.pk]
    assert Run.objects.get(pk=waiting.pk).status == RunStatus.CLAIMED
    for run in (*queued, claimed):
        row = Run.objects.get(pk=run.pk)
        assert (row.status, row.error) == (RunStatus.SKIPPED, DROPPED_WHY)
    assert Run.objects.get(pk=bystander.pk).status == RunStatus.DISPATCHED
    # a slot claimed after the release is the next one's business, not dropped
    later = slot_run(periodic, 7)
    assert release_waiting(now, "worker:w1", periodic_task_id=periodic.pk) == []
    assert Run.objects.get(pk=later.pk).status == RunStatus.DISPATCHED
