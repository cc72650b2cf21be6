"""Overlap policy ``buffer_all`` in-process, against the real database and Redis (or database
locks: the ``locks`` fixture), on both of the worker's paths (the ``path`` fixture). It is
``buffer_one``'s mechanism with several runs waiting, so these tests use that suite's
deliveries and runs (:mod:`tests.support.overlap`) and show what differs: the
order of release, the bound, a slot that must not overtake the waiting ones, a beat's
recovery, and a task switched away from ``buffer_all`` while runs wait."""

from __future__ import annotations

import logging
import threading
from datetime import timedelta
from typing import Any

import pytest
from celery.exceptions import Ignore

from celery_driftsafe.conf import get_settings
from celery_driftsafe.core.stored_names import BUFFER_ALL_MAX_WAITING
from celery_driftsafe.locks import lock_identity
from celery_driftsafe.models import PeriodicTask, Run, RunStatus
from celery_driftsafe.store.clock import authority_clock
from tests.support import drain, wait_until
from tests.support.overlap import (
    body_running,
    deliver_published,
    delivery,
    held_for,
    overlap_task,
    recover,
    running,
    slot_run,
)

pytestmark = pytest.mark.django_db(transaction=True)


def _wait(record: Any, run: Run) -> None:
    """``run``'s delivery, which finds the task running (or runs waiting): the run waits."""
    with delivery(record, run), pytest.raises(Ignore):
        record(f"s{run.slot.second}")
    run.refresh_from_db()
    assert run.status == RunStatus.WAITING, run.error


def _run_released(record: Any, expected: Run) -> None:
    """The one message published, ``expected``'s, delivered: its body runs (its value the
    slot's second) and succeeds."""
    deliver_published(record, expected, f"s{expected.slot.second}")
    assert Run.objects.get(pk=expected.pk).status == RunStatus.SUCCEEDED


def _statuses(*runs: Run) -> list[str]:
    return [Run.objects.get(pk=run.pk).status for run in runs]


def test_every_slot_waits_and_they_run_one_at_a_time_in_slot_order(
    record: Any, calls: list[Any], redis_client: Any, path: str, locks: str
) -> None:
    """Slots delivered while the first runs, out of slot order (4, 2, 3), all wait. When the
    first ends, the earliest waiting slot (2) is taken back, published and handed the running
    lock; the others keep waiting. Each released run, as it ends, releases the next, so the
    bodies run one at a time in slot order: 2, 3, 4."""
    periodic = overlap_task("all-in-order", "buffer_all")
    first, second, third, fourth = (slot_run(periodic, s) for s in (1, 2, 3, 4))
    drain()
    with body_running(record, first, "a", redis_client):
        for run in (fourth, second, third):
            _wait(record, run)
        assert "in slot order (overlap policy 'buffer_all')" in Run.objects.get(pk=third.pk).error
        assert drain() == []
    assert _statuses(second, third, fourth) == [
        RunStatus.DISPATCHED,
        RunStatus.WAITING,
        RunStatus.WAITING,
    ]
    assert held_for(redis_client, second) == f"heir:run:{second.pk}"
    for run in (second, third, fourth):
        _run_released(record, run)
    assert drain() == []
    assert calls == ["a", "s2", "s3", "s4"]
    assert not Run.objects.filter(status=RunStatus.WAITING).exists()


def test_past_the_bound_a_slot_is_skipped_naming_the_bound_and_the_policy(
    record: Any, calls: list[Any], redis_client: Any, path: str
) -> None:
    """While the first runs, BUFFER_ALL_MAX_WAITING slots wait; the next is skipped, its
    reason naming the bound and the policy. The ones that waited all run, in slot order."""
    periodic = overlap_task("all-bounded", "buffer_all")
    first = slot_run(periodic, 1)
    queued = [slot_run(periodic, 10 + i) for i in range(BUFFER_ALL_MAX_WAITING)]
    past_the_bound = slot_run(periodic, 50)
    drain()
    with body_running(record, first, "a", redis_client):
        for run in queued:
            _wait(record, run)
        with delivery(record, past_the_bound), pytest.raises(Ignore):
            record("too many")
    past_the_bound.refresh_from_db()
    assert past_the_bound.status == RunStatus.SKIPPED
    assert (
        f"{BUFFER_ALL_MAX_WAITING} runs of it are already waiting, the most that may wait "
        "(overlap policy 'buffer_all')"
    ) in past_the_bound.error
    for run in queued:
        _run_released(record, run)
    assert calls == ["a", *(f"s{run.slot.second}" for run in queued)]


def test_slots_delivered_before_the_released_one_wait_behind_it_in_slot_order(
    record: Any, calls: list[Any], redis_client: Any, path: str, locks: str
) -> None:
    """The first ends and releases slot 2 (slot 3 keeps waiting). Before slot 2's message
    reaches a worker, slot 5 is delivered, then slot 4 (claimed before the release: under
    ``buffer_all`` it is not dropped, as ``buffer_one`` drops it, it waits its turn): neither
    takes the lock handed to slot 2, both wait. Then 2, 3, 4, 5 run, in slot order."""
    periodic = overlap_task("all-overtaken", "buffer_all")
    first, second, third, fourth = (slot_run(periodic, s) for s in (1, 2, 3, 4))
    drain()
    with body_running(record, first, "a", redis_client):
        _wait(record, second)
        _wait(record, third)
    assert _statuses(second, third, fourth) == [
        RunStatus.DISPATCHED,
        RunStatus.WAITING,
        RunStatus.DISPATCHED,  # not dropped
    ]
    [released] = drain()
    assert released["id"] == second.celery_task_id
    fifth = slot_run(periodic, 5)
    _wait(record, fifth)
    _wait(record, fourth)
    assert drain() == [], "the lock is handed to slot 2: nothing else is published"
    with delivery(record, second, token=released["driftsafe_fencing_token"]):
        record("s2")
    for run in (third, fourth, fifth):
        _run_released(record, run)
    assert calls == ["a", "s2", "s3", "s4", "s5"]


@pytest.mark.parametrize("second", [4, 1], ids=["later-slot", "earlier-slot"])
def test_a_slot_that_finds_the_lock_free_while_runs_wait_does_not_overtake_them(
    record: Any, calls: list[Any], redis_client: Any, path: str, locks: str, second: int
) -> None:
    """Slots 2 and 3 wait, and the task's running lock is free (the run before them ended
    without handing it on: its worker was lost, and no beat has released them yet). A slot
    delivered then does not run in their place: it waits too, and the earliest waiting slot
    is published and handed the lock at once. A later slot (4) goes after 2 and 3; an earlier
    one (1, its message late) goes first: slot order, whatever the order of delivery."""
    periodic = overlap_task("all-lock-free", "buffer_all")
    store = lock_identity(get_settings())
    waiting = [
        slot_run(periodic, s, status=RunStatus.WAITING, fencing_token=1, lock_store=store)
        for s in (2, 3)
    ]
    late = slot_run(periodic, second)
    drain()
    with delivery(record, late), pytest.raises(Ignore):
        record("late")
    assert calls == [], "it did not run in the waiting runs' place"
    in_order = sorted([*waiting, late], key=lambda run: run.slot)
    assert _statuses(*in_order) == [RunStatus.DISPATCHED, RunStatus.WAITING, RunStatus.WAITING]
    assert held_for(redis_client, in_order[0]) == f"heir:run:{in_order[0].pk}"
    for run in in_order:
        _run_released(record, run)
    assert calls == [f"s{run.slot.second}" for run in in_order]


def test_a_beat_releases_the_earliest_waiting_run_when_the_running_ones_worker_died(
    record: Any, calls: list[Any], redis_client: Any, broker_app: Any, locks: str
) -> None:
    """The worker of the running run died (its lease in the ledger over, its running lock
    lapsed) with three runs waiting, stored out of slot order. A beat's recovery releases the
    earliest (slot 2) only, and hands it the lock; another pass releases nothing more (the
    lock is handed). The released run's end releases the next: 2, 3, 4."""
    settings = get_settings()
    periodic = overlap_task("all-orphans", "buffer_all")
    now = authority_clock().now()
    slot_run(
        periodic,
        1,
        status=RunStatus.STARTED,
        worker="dead-worker",
        fencing_token=3,
        lock_store=lock_identity(settings),
        started_at=now - timedelta(seconds=60),
        lease_until=now - timedelta(seconds=1),
    )
    fourth, second, third = (
        slot_run(
            periodic,
            s,
            status=RunStatus.WAITING,
            fencing_token=4,
            lock_store=lock_identity(settings),
        )
        for s in (4, 2, 3)
    )
    drain()
    recover(broker_app)
    recover(broker_app)
    assert _statuses(second, third, fourth) == [
        RunStatus.DISPATCHED,
        RunStatus.WAITING,
        RunStatus.WAITING,
    ]
    assert Run.objects.get(pk=second.pk).claimed_by == "beat-1"
    assert held_for(redis_client, second) == f"heir:run:{second.pk}"
    for run in (second, third, fourth):
        _run_released(record, run)
    assert calls == ["s2", "s3", "s4"]


@pytest.mark.parametrize("policy", ["allow", "skip"])
def test_runs_waiting_when_the_task_leaves_buffer_all_are_released_and_meet_its_new_policy(
    record: Any,
    calls: list[Any],
    redis_client: Any,
    broker_app: Any,
    caplog: pytest.LogCaptureFixture,
    policy: str,
) -> None:
    """The task's overlap policy is changed from ``buffer_all`` to ``allow`` or ``skip`` while
    its first run runs and two slots wait. Under the new policy nothing waits, so a beat's
    next recovery pass releases both at once, without waiting for the running run; each then
    meets the new policy: under ``allow`` both run beside the running one, under ``skip``
    both are skipped while it runs. None is left waiting."""
    periodic = overlap_task(f"all-to-{policy}", "buffer_all")
    first, second, third = (slot_run(periodic, s) for s in (1, 2, 3))
    drain()
    worker = running(record, first, "a", redis_client)
    deliveries: list[threading.Thread] = []
    try:
        _wait(record, second)
        _wait(record, third)
        PeriodicTask.objects.filter(pk=periodic.pk).update(overlap_policy=policy)
        with caplog.at_level(logging.INFO, logger="celery_driftsafe.dispatch"):
            recover(broker_app)
        messages = drain()
        assert [m["id"] for m in messages] == [second.celery_task_id, third.celery_task_id]
        said = [r.getMessage() for r in caplog.records if r.action == "release-waiting"]
        assert len(said) == 2
        assert f"the task's overlap policy is now '{policy}', under which no run waits" in said[0]
        for run, message in zip((second, third), messages, strict=True):
            deliveries.append(
                threading.Thread(target=_deliver_released, args=(record, run, message))
            )
            deliveries[-1].start()
        if policy == "allow":  # all three bodies at once, held at the gate
            wait_until(
                lambda: _statuses(first, second, third) == [RunStatus.STARTED] * 3,
                "the released runs started beside the running one",
            )
        else:
            for thread in deliveries:
                thread.join()
            assert _statuses(first, second, third) == [
                RunStatus.STARTED,
                RunStatus.SKIPPED,
                RunStatus.SKIPPED,
            ]
    finally:
        record.gate.set()
        worker.join()
        for thread in deliveries:
            thread.join()
    expected = ["a", "s2", "s3"] if policy == "allow" else ["a"]
    assert sorted(calls) == expected
    assert not Run.objects.filter(status=RunStatus.WAITING).exists()


def _deliver_released(record: Any, run: Run, message: dict[str, Any]) -> None:
    """``run``'s published message delivered in a thread of its own (a worker elsewhere)."""
    from django.db import connections

    try:
        with delivery(record, run, token=message["driftsafe_fencing_token"]):
            record(f"s{run.slot.second}")
    except Ignore:
        pass
    finally:
        connections.close_all()
