"""Retention: finished runs past their retention are pruned in bounded batches, with their
attempts, lock rows and fencing counters; runs in flight and each task's latest run stay; a
fencing counter that expires cannot let a stale holder win; the beats prune in the background
under one lock; ``driftsafe_prune`` for cron. Real database and Redis, fake clock."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime, timedelta
from io import StringIO
from typing import Any

import pytest
from django.conf import settings
from django.core.management import call_command
from django.test import override_settings

from celery_driftsafe import checks
from celery_driftsafe.beat.recovery import reconcile
from celery_driftsafe.conf import build_settings, get_settings
from celery_driftsafe.ledger.retention import (
    PRUNE_LOCK,
    Pruner,
    Retention,
)
from celery_driftsafe.ledger.run_ledger import Ledger, Start
from celery_driftsafe.locks import RedisLockBackend, fence_ttl_seconds, lock_backend, lock_identity
from celery_driftsafe.models import Lock, PeriodicTask, Run, RunAttempt, RunKind, RunStatus
from celery_driftsafe.store.redis import key_prefix
from celery_driftsafe.testing import FakeClock
from tests.support import T0
from tests.support.factories import interval_task

DAY = timedelta(days=1)
IN_FLIGHT = (RunStatus.CLAIMED, RunStatus.DISPATCHED, RunStatus.STARTED, RunStatus.RETRYING)
#: Short retention for the tests: a day for finished runs, three for those that did not succeed.
RETENTION = {
    "RUN_RETENTION_SECONDS": DAY.total_seconds(),
    "FAILED_RUN_RETENTION_SECONDS": 3 * DAY.total_seconds(),
}


@pytest.fixture
def retention() -> Iterator[None]:
    with override_settings(DRIFTSAFE={**settings.DRIFTSAFE, **RETENTION}):
        yield


def run(
    task: PeriodicTask | None,
    slot: datetime,
    status: str,
    claimed: datetime | None = None,
    **fields: Any,
) -> Run:
    return Run.objects.create(
        periodic_task=task,
        task_name="tests.add",
        slot=slot,
        status=status,
        claimed_at=claimed or slot,
        **fields,
    )


def ids(*runs: Run) -> set[int]:
    return {r.pk for r in runs}


def left() -> set[int]:
    return set(Run.objects.values_list("pk", flat=True))


# -- what goes and what stays ------------------------------------------------------------------


def test_retention_cutoffs_per_status_and_off_with_none() -> None:
    policy = Retention(done=DAY, not_succeeded=3 * DAY)
    cutoffs = dict(policy.cutoffs(T0))
    assert cutoffs["succeeded"] == cutoffs["skipped"] == cutoffs["revoked"] == T0 - DAY
    assert cutoffs["failed"] == cutoffs["missed"] == cutoffs["expired"] == T0 - 3 * DAY
    assert not set(cutoffs) & set(IN_FLIGHT)
    assert dict(Retention(done=DAY, not_succeeded=None).cutoffs(T0)).keys() == {
        "succeeded",
        "skipped",
        "revoked",
    }
    assert Retention(None, None).cutoffs(T0) == [] and Retention(None, None).keeps_everything


@pytest.mark.django_db
def test_prune_deletes_finished_runs_past_retention_and_nothing_in_flight(
    retention: None,
) -> None:
    task = interval_task("t", 60, anchor=T0 - 10 * DAY)
    old = T0 - 5 * DAY
    minute = timedelta(minutes=1)
    done_old = [
        run(task, old + i * minute, s)
        for i, s in enumerate((RunStatus.SUCCEEDED, RunStatus.SKIPPED, RunStatus.REVOKED))
    ]
    failed_old = [
        run(task, old + (3 + i) * minute, s)
        for i, s in enumerate((RunStatus.FAILED, RunStatus.MISSED, RunStatus.EXPIRED))
    ]
    # Older than any retention, but still in flight: never pruned.
    flying = [run(task, old + (6 + i) * minute, s) for i, s in enumerate(IN_FLIGHT)]
    failed_recent = run(task, T0 - 2 * DAY, RunStatus.FAILED)  # within its 3 days
    done_recent = run(task, T0 - DAY + minute, RunStatus.SUCCEEDED)  # within its day
    at_cutoff = run(task, T0 - DAY - minute, RunStatus.SUCCEEDED, claimed=T0 - DAY)  # not before
    adhoc_old = Run.objects.create(
        task_name="tests.add",
        kind=RunKind.ADHOC,
        idempotency_key="k",
        status=RunStatus.SUCCEEDED,
        claimed_at=old,
    )
    latest = run(task, T0 - minute, RunStatus.SUCCEEDED)

    pending = Pruner().pending(T0)
    assert sum(pending.values()) == 7 and pending["failed"] == 1

    done = Pruner().prune(T0)
    assert done.runs == 7 and done.by_status == {
        "succeeded": 2,
        "skipped": 1,
        "revoked": 1,
        "failed": 1,
        "missed": 1,
        "expired": 1,
    }
    assert left() == ids(*flying, failed_recent, done_recent, at_cutoff, latest)
    assert ids(*done_old, *failed_old, adhoc_old) & left() == set()
    # A second pass finds nothing.
    assert Pruner().prune(T0).runs == 0


@pytest.mark.django_db
def test_the_latest_run_of_a_task_stays_whatever_its_age(retention: None) -> None:
    """Editing or re-enabling a task reads its latest run to start after every slot that
    fired; a task deleted since has nothing to protect."""
    quiet = interval_task("quiet", 60, anchor=T0 - 10 * DAY, enabled=False)
    older = run(quiet, T0 - 9 * DAY, RunStatus.SUCCEEDED)
    newest = run(quiet, T0 - 8 * DAY, RunStatus.SUCCEEDED)
    gone = interval_task("gone", 60, anchor=T0 - 10 * DAY)
    orphan = run(gone, T0 - 8 * DAY, RunStatus.SUCCEEDED)
    gone.delete()
    Pruner().prune(T0)
    assert ids(newest) <= left() and not (ids(older, orphan) & left())


@pytest.mark.django_db
def test_each_batch_is_bounded(retention: None) -> None:
    task = interval_task("t", 60, anchor=T0 - 10 * DAY)
    runs = [run(task, T0 - 5 * DAY + timedelta(minutes=i), RunStatus.SUCCEEDED) for i in range(8)]
    pruner = Pruner(batch_size=3)
    first = pruner.prune(T0, max_batches=1)
    assert (first.runs, first.batches) == (3, 1)
    assert ids(*runs[:3]) & left() == set()  # oldest claims first
    rest = pruner.prune(T0, pause=0)
    assert (rest.runs, rest.batches) == (4, 2)  # 3 + 1; the last run is the task's latest
    assert left() == ids(runs[-1])


@pytest.mark.django_db
def test_nothing_is_pruned_when_runs_are_kept_forever() -> None:
    task = interval_task("t", 60, anchor=T0 - 400 * DAY)
    runs = [run(task, T0 - 300 * DAY + timedelta(minutes=i), RunStatus.SUCCEEDED) for i in range(3)]
    forever = {"RUN_RETENTION_SECONDS": None, "FAILED_RUN_RETENTION_SECONDS": None}
    with override_settings(DRIFTSAFE={**settings.DRIFTSAFE, **forever}):
        assert Pruner().prune(T0).runs == 0
    assert left() == ids(*runs)


@pytest.mark.django_db
def test_attempts_free_lock_rows_and_fencing_counters_go_with_their_run(
    retention: None, redis_client: Any
) -> None:
    task = interval_task("t", 60, anchor=T0 - 10 * DAY)
    pruned, held_lock, kept = (run(task, T0 - (5 - i) * DAY, RunStatus.SUCCEEDED) for i in range(3))
    kept.slot = T0  # the latest
    kept.save()
    for r in (pruned, held_lock, kept):
        RunAttempt.objects.create(run=r, number=0, outcome=RunStatus.RETRYING)
    Lock.objects.create(name=f"run:{pruned.pk}", token="", fencing_token=3, expires_at=T0 - DAY)
    # A duplicate delivery holds this one right now: the row stays (the run goes).
    Lock.objects.create(
        name=f"run:{held_lock.pk}",
        token="abc",
        fencing_token=4,
        expires_at=T0 + timedelta(seconds=30),
    )
    prefix = key_prefix(get_settings())
    for r in (pruned, held_lock, kept):
        redis_client.set(f"{prefix}:fence:run:{r.pk}", 7)

    done = Pruner().prune(T0)

    assert (done.runs, done.attempts, done.lock_rows, done.fences) == (2, 2, 1, 2)
    assert left() == ids(kept)
    assert list(RunAttempt.objects.values_list("run_id", flat=True)) == [kept.pk]
    assert list(Lock.objects.values_list("name", flat=True)) == [f"run:{held_lock.pk}"]
    assert redis_client.exists(f"{prefix}:fence:run:{pruned.pk}") == 0
    assert redis_client.exists(f"{prefix}:fence:run:{kept.pk}") == 1


# -- fencing counters that expire ----------------------------------------------------------


def test_fence_ttl_follows_the_shorter_retention_and_outlives_a_waiting_run() -> None:
    from celery_driftsafe.conf import build_settings

    assert fence_ttl_seconds(build_settings(RETENTION)) == DAY.total_seconds() + 30
    week = build_settings({"RUN_RETENTION_SECONDS": 7 * 86400.0})
    assert fence_ttl_seconds(week) == 7 * 86400.0
    forever = build_settings({"RUN_RETENTION_SECONDS": None, "FAILED_RUN_RETENTION_SECONDS": None})
    assert fence_ttl_seconds(forever) == 7 * 86400.0
    short = build_settings(
        {"RUN_RETENTION_SECONDS": 60.0, "RUN_EXPIRES_SECONDS": None},
        internals={"STUCK_RUN_SECONDS": 7200.0},
    )
    assert fence_ttl_seconds(short) == 7200.0 + 30


@pytest.mark.django_db
def test_the_settings_lock_backend_gives_fencing_counters_a_ttl(
    retention: None, redis_client: Any
) -> None:
    locks = lock_backend()
    assert isinstance(locks, RedisLockBackend)
    lock = locks.lock("run:1", ttl=5)
    assert lock.acquire()
    ttl_ms = redis_client.pttl(locks.fence_key("run:1"))
    assert (DAY.total_seconds() + 29) * 1000 < ttl_ms <= (DAY.total_seconds() + 30) * 1000
    lock.release()


@pytest.mark.django_db
def test_a_counter_that_expired_cannot_let_a_stale_holder_win(
    retention: None, redis_client: Any
) -> None:
    """Holder A starts the run under token t and is paused past its lease; the counter expires
    (or is pruned) and starts again at 0. B's first token is below the run's, so the database
    refuses it; B takes the lock again above the run's token and takes the run over; A's late
    outcome is refused."""
    task = interval_task("t", 60, anchor=T0)
    r = run(task, T0, RunStatus.DISPATCHED)
    ledger = Ledger()
    locks = lock_backend()
    a = locks.lock(f"run:{r.pk}", ttl=0.05)
    for _ in range(3):  # a few earlier holders: the counter is at 3
        assert a.acquire()
        a.release()
    assert a.acquire()
    token_a = a.fencing_token
    assert token_a == 4 and ledger.start(Start(r.pk, token_a, T0, "worker-a", 0, lock_identity()))
    assert isinstance(locks, RedisLockBackend)
    redis_client.delete(locks.fence_key(f"run:{r.pk}"), locks.lock_key(f"run:{r.pk}"))  # expired

    b = locks.lock(f"run:{r.pk}", ttl=30)  # its floor: the message's header (0)
    assert b.acquire() and b.fencing_token == 1
    # below the run's token: refused
    assert not ledger.start(Start(r.pk, 1, T0, "worker-b", 0, lock_identity()))
    row = ledger.load(r.pk)
    assert row is not None and row.fencing_token == token_a
    b.release()
    b = locks.lock(f"run:{r.pk}", ttl=30, fencing_floor=row.fencing_token)
    assert b.acquire() and b.fencing_token == token_a + 1
    # B takes the run over:
    assert ledger.start(Start(r.pk, token_a + 1, T0, "worker-b", 0, lock_identity()))
    assert not ledger.finish(r.pk, token_a, "succeeded", T0, "")  # A's late outcome: refused
    assert ledger.finish(r.pk, token_a + 1, "succeeded", T0, "")
    b.release()


@pytest.mark.django_db
def test_reconcile_fails_a_lost_run_even_when_its_counter_expired(redis_client: Any) -> None:
    task = interval_task("t", 60, anchor=T0)
    r = run(task, T0, RunStatus.STARTED, started_at=T0, fencing_token=9, worker="w")
    assert redis_client.exists(lock_backend().fence_key(f"run:{r.pk}")) == 0  # type: ignore[attr-defined]
    done = reconcile(T0 + timedelta(hours=2), lease=timedelta(seconds=30))
    assert done.lost == [r.pk]
    r.refresh_from_db()
    assert r.status == RunStatus.FAILED and r.fencing_token == 10


@pytest.mark.django_db(transaction=True)
def test_reconcile_leaves_a_run_whose_lease_in_the_ledger_lasts(redis_client: Any) -> None:
    """A started run whose lock is free but whose worker's lease in the ledger lasts (Redis
    lost the lock while the body runs) is not a lost worker; once the lease is over, it is."""
    task = interval_task("t", 60, anchor=T0)
    now = T0 + timedelta(hours=2)
    r = run(task, T0, RunStatus.STARTED, started_at=T0, fencing_token=9, worker="w")
    Run.objects.filter(pk=r.pk).update(lease_until=now + timedelta(seconds=20))
    assert reconcile(now, lease=timedelta(seconds=30)).lost == []
    assert Run.objects.get(pk=r.pk).status == RunStatus.STARTED
    assert reconcile(now + timedelta(seconds=20), lease=timedelta(seconds=30)).lost == [r.pk]


@pytest.mark.django_db(transaction=True)
def test_reconcile_looks_for_a_runs_lock_where_its_starter_took_it(redis_client: Any) -> None:
    """A beat that locks in Redis judges each started run in its starter's store: the
    database's locks (every process reaches them), another prefix on its Redis (a fleet that
    moved its ``KEY_PREFIX``), its own store, and runs started before the store was recorded.
    A run whose lock is held there stays; one whose lock is free is recorded failed. A store
    out of its reach (named only by a digest; Redis for a beat without ``REDIS_URL``) is left
    for a beat that reaches it."""
    from dataclasses import replace

    from celery_driftsafe.locks import DatabaseLockBackend

    task = interval_task("t", 60, anchor=T0)
    other = "redis:another-prefix"
    stores = ["database", "database", other, other, lock_identity(), None, "redis-sha256:ab"]
    runs = [
        run(task, T0 + timedelta(minutes=i), RunStatus.STARTED, started_at=T0, fencing_token=9)
        for i in range(len(stores))
    ]
    for r, store in zip(runs, stores, strict=True):
        Run.objects.filter(pk=r.pk).update(lock_store=store)
    elsewhere = lock_backend(replace(get_settings(), key_prefix="another-prefix"))
    held = [
        DatabaseLockBackend().lock(f"run:{runs[1].pk}", ttl=60),
        elsewhere.lock(f"run:{runs[3].pk}", ttl=60),
    ]
    assert all(lock.acquire(blocking=False) for lock in held)
    try:
        done = reconcile(T0 + timedelta(hours=2), lease=timedelta(seconds=30))
    finally:
        for lock in held:
            lock.release()
    assert sorted(done.lost) == sorted(runs[i].pk for i in (0, 2, 4, 5))
    assert done.unreachable == [runs[6].pk]
    statuses = Run.objects.filter(pk__in=[r.pk for r in runs]).order_by("slot")
    assert [r.status == RunStatus.FAILED for r in statuses] == [
        True, False, True, False, True, True, False
    ]  # fmt: skip

    # A beat without Redis reaches the database's locks only.
    more = [
        run(task, T0 + timedelta(hours=1, minutes=i), RunStatus.STARTED, started_at=T0)
        for i in range(2)
    ]
    Run.objects.filter(pk=more[0].pk).update(lock_store=other)
    Run.objects.filter(pk=more[1].pk).update(lock_store="database")
    done = reconcile(
        T0 + timedelta(hours=2),
        lease=timedelta(seconds=30),
        settings=replace(get_settings(), redis_url=None),
    )
    assert sorted(done.lost) == sorted([runs[1].pk, more[1].pk])  # runs[1]'s lock is free now
    assert sorted(done.unreachable) == sorted([more[0].pk, runs[3].pk, runs[6].pk])


# -- the beats and the command -------------------------------------------------------------


def _committed_old_runs(count: int) -> tuple[PeriodicTask, list[Run]]:
    task = interval_task("old", 60, anchor=T0 - 10 * DAY)
    runs = [
        run(task, T0 - 5 * DAY + timedelta(minutes=i), RunStatus.SUCCEEDED) for i in range(count)
    ]
    return task, runs


@pytest.mark.django_db(transaction=True)
def test_a_beat_prunes_in_the_background_once_an_interval_has_passed(
    scheduler: Any, clock: FakeClock
) -> None:
    beat_settings = {**RETENTION, "PRUNE_INTERVAL_SECONDS": 60.0}
    with override_settings(
        DRIFTSAFE={**settings.DRIFTSAFE, **beat_settings},
        DRIFTSAFE_INTERNALS={**settings.DRIFTSAFE_INTERNALS, "PRUNE_BATCH_SIZE": 2},
    ):
        _, runs = _committed_old_runs(5)
        scheduler.run_round()
        scheduler.pruner.join(10)
        assert len(left()) == 5  # the first pass comes one interval after the start
        clock.advance(61)
        scheduler.run_round()
        scheduler.pruner.join(10)
        assert left() == ids(runs[-1])
        last = scheduler.pruner.last
        assert last is not None and (last.runs, last.batches) == (4, 3)


@pytest.mark.django_db(transaction=True)
def test_only_one_beat_prunes_at_a_time(scheduler: Any, clock: FakeClock) -> None:
    beat_settings = {**RETENTION, "PRUNE_INTERVAL_SECONDS": 60.0}
    with override_settings(DRIFTSAFE={**settings.DRIFTSAFE, **beat_settings}):
        _committed_old_runs(3)
        other_beat = lock_backend().lock(PRUNE_LOCK, ttl=30)
        assert other_beat.acquire()
        try:
            clock.advance(61)
            scheduler.run_round()
            scheduler.pruner.join(10)
            assert len(left()) == 3 and scheduler.pruner.last is None
        finally:
            other_beat.release()


@pytest.mark.django_db(transaction=True)
def test_beats_do_not_prune_when_told_not_to(scheduler: Any, clock: FakeClock) -> None:
    beat_settings = {**RETENTION, "PRUNE_INTERVAL_SECONDS": None}
    with override_settings(DRIFTSAFE={**settings.DRIFTSAFE, **beat_settings}):
        _committed_old_runs(3)
        clock.advance(3600)
        scheduler.run_round()
        scheduler.pruner.join(10)
        assert len(left()) == 3


@pytest.mark.django_db
def test_prune_command_dry_run_then_prune_with_a_summary(retention: None) -> None:
    _, runs = _committed_old_runs(4)
    # The command reads the authority's now: the runs are days older than that.
    out = StringIO()
    call_command("driftsafe_prune", "--dry-run", stdout=out)
    assert "dry run: would delete 3 runs" in out.getvalue()
    assert len(left()) == 4
    out = StringIO()
    call_command("driftsafe_prune", "--batch-size", "2", stdout=out)
    assert "deleted 3 runs (succeeded 3)" in out.getvalue() and "in 2 batches" in out.getvalue()
    assert left() == ids(runs[-1])
    out = StringIO()
    call_command("driftsafe_prune", "--json", stdout=out)
    assert json.loads(out.getvalue())["deleted"]["runs"] == 0


@pytest.mark.django_db
def test_prune_command_says_when_retention_is_off() -> None:
    forever = {"RUN_RETENTION_SECONDS": None, "FAILED_RUN_RETENTION_SECONDS": None}
    with override_settings(DRIFTSAFE={**settings.DRIFTSAFE, **forever}):
        out = StringIO()
        call_command("driftsafe_prune", stdout=out)
    assert "retention is off" in out.getvalue()


@pytest.mark.parametrize(
    "key", ["RUN_RETENTION_SECONDS", "FAILED_RUN_RETENTION_SECONDS", "PRUNE_INTERVAL_SECONDS"]
)
def test_retention_settings_must_be_positive_or_none(key: str) -> None:
    with override_settings(DRIFTSAFE={key: 0}):
        errors = checks.check_settings()
    assert [e.id for e in errors] == ["celery_driftsafe.E004"] and key in errors[0].msg
    with override_settings(DRIFTSAFE={key: None}):
        assert checks.check_settings() == []
    with override_settings(DRIFTSAFE_INTERNALS={"PRUNE_BATCH_SIZE": 0}):
        assert [e.id for e in checks.check_settings()] == ["celery_driftsafe.E004"]


@pytest.mark.parametrize("duty", [0, -0.5, 1.5, "0.5", None, True])
def test_prune_duty_cycle_must_be_a_share(duty: Any) -> None:
    with override_settings(DRIFTSAFE_INTERNALS={"PRUNE_DUTY_CYCLE": duty}):
        errors = checks.check_settings()
    assert [e.id for e in errors] == ["celery_driftsafe.E023"]
    assert "PRUNE_DUTY_CYCLE" in errors[0].msg and "at most 1" in errors[0].msg
    for fine in (1, 0.1, 0.25):
        with override_settings(DRIFTSAFE_INTERNALS={"PRUNE_DUTY_CYCLE": fine}):
            assert checks.check_settings() == []


def test_the_pause_after_a_batch_follows_the_duty_cycle() -> None:
    for duty, pause in ((1.0, 0.0), (0.5, 0.2), (0.25, 0.6), (0.1, 1.8)):
        pruner = Pruner(build_settings({}, internals={"PRUNE_DUTY_CYCLE": duty}))
        assert pruner.pause_after(0.2) == pytest.approx(pause)
