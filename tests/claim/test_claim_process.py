"""A beat's claim process (``celery_driftsafe.claim.helper_process``): in a wave, batches are
claimed
by a helper process of the beat's own, on the real test database (PostgreSQL or MariaDB: it
needs ``SKIP LOCKED``), while the beat publishes; every slot goes out once, also when the
helper is killed, and the helper ends with the beat or when the beat is gone."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from celery_driftsafe.beat import nodes
from celery_driftsafe.claim.helper_process import ClaimProcess, spare_cores
from celery_driftsafe.models import Run, RunStatus
from celery_driftsafe.scheduler import DriftSafeScheduler
from celery_driftsafe.testing import FakeClock
from tests.skip_guard import configuration
from tests.support import T0, drain, wait_until
from tests.support.factories import interval_task

pytestmark = pytest.mark.django_db(transaction=True)


def _needs_skip_locked() -> None:
    """SQLite has no claim process (no ``SKIP LOCKED``: the beat claims in one thread); on
    PostgreSQL and MariaDB, which the CI runs these tests on, it must be there."""
    from django.db import connection

    if connection.vendor == "sqlite":
        pytest.skip(
            configuration("the claim process is for databases with SKIP LOCKED (not SQLite)")
        )
    assert connection.features.has_select_for_update_skip_locked, connection.vendor


def _wave_scheduler(settings: Any, broker_app: Any, clock: FakeClock) -> DriftSafeScheduler:
    """A scheduler claiming 20 tasks a round, with its claim process on (not started)."""
    _needs_skip_locked()
    settings.DRIFTSAFE = {**settings.DRIFTSAFE, "RUN_EXPIRES_SECONDS": None}
    settings.DRIFTSAFE_INTERNALS = {
        **settings.DRIFTSAFE_INTERNALS,
        "CLAIM_BATCH_SIZE": 20,
        "CLAIM_PROCESS": True,
    }
    return DriftSafeScheduler(
        app=broker_app, clock=clock, authority=clock, install_signal_handlers=False
    )


@pytest.fixture
def wave_beat(settings: Any, broker_app: Any, clock: FakeClock) -> Iterator[DriftSafeScheduler]:
    """A scheduler claiming 20 tasks a round, with its claim process on and ready."""
    sched = _wave_scheduler(settings, broker_app, clock)
    helper = sched._prefetcher.process
    assert helper is not None
    helper.start()
    wait_until(lambda: helper.ready, "the claim process to get ready")
    yield sched
    sched.close()


def _rounds_until_idle(sched: DriftSafeScheduler, limit: int = 100) -> int:
    """Rounds as the beat's loop runs them (errors logged and backed off, not raised) until
    nothing is due, nothing is claimed ahead and the last round went well."""
    for n in range(1, limit + 1):
        wait = sched._guarded_round()
        if wait > 0 and not sched._prefetcher.pending and sched._outage is None:
            return n
    raise AssertionError(f"still busy after {limit} rounds")


def _published_once(count: int) -> None:
    ids = [m["id"] for m in drain()]
    assert len(ids) == len(set(ids)) == count
    assert set(ids) == set(Run.objects.values_list("celery_task_id", flat=True))
    assert Run.objects.filter(status=RunStatus.DISPATCHED).count() == count


def test_a_wave_is_claimed_in_the_helper_process_and_every_slot_goes_out_once(
    wave_beat: DriftSafeScheduler,
) -> None:
    """300 tasks due at one instant, 20 a batch: the helper claims batches beside the beat's
    thread; each slot is published once, and the helper ends with the beat."""
    for i in range(300):
        interval_task(f"w{i:03d}", 60, anchor=T0, next_slot_at=T0)
    _rounds_until_idle(wave_beat)
    helper = wave_beat._prefetcher.process
    assert helper is not None
    assert helper.claims >= 3  # not all batches went to the thread
    _published_once(300)
    process = helper._process
    wave_beat.close()
    assert process is not None and not process.is_alive()


def test_a_beat_set_up_with_settings_configure_has_its_helper_too(
    monkeypatch: pytest.MonkeyPatch,
    settings: Any,
    broker_app: Any,
    clock: FakeClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A project that calls ``settings.configure()`` has no settings module for the helper to
    import (no ``DJANGO_SETTINGS_MODULE``): the helper is configured with the beat's installed
    apps, time zone, database and ``DRIFTSAFE`` instead, and claims its share of the wave."""
    monkeypatch.delenv("DJANGO_SETTINGS_MODULE")
    sched = _wave_scheduler(settings, broker_app, clock)
    try:
        helper = sched._prefetcher.process
        assert helper is not None
        with caplog.at_level(logging.WARNING, logger="celery_driftsafe"):
            helper.start()
            wait_until(lambda: helper.ready or helper.unavailable is not None, "the claim process")
        assert helper.unavailable is None and "not used" not in caplog.text
        for i in range(200):
            interval_task(f"c{i:03d}", 60, anchor=T0, next_slot_at=T0)
        _rounds_until_idle(sched)
        assert helper.claims >= 2
        _published_once(200)
    finally:
        sched.close()


def test_a_killed_helper_loses_no_slot_and_doubles_none(
    wave_beat: DriftSafeScheduler, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """The helper is killed while it claims: the beat says so, claims in its thread from then
    on, and a batch the helper had committed stays claimed until the outbox publishes it
    (after the lease), once. The first wave ``RESTART_SECONDS`` after the loss starts another
    helper, which claims its share of that wave."""
    from celery_driftsafe.claim.helper_process import RESTART_SECONDS

    for i in range(300):
        interval_task(f"k{i:03d}", 60, anchor=T0, next_slot_at=T0)
    helper = wave_beat._prefetcher.process
    assert helper is not None
    assert wave_beat._guarded_round() == 0.0  # the first batch, and the next asked of both
    assert helper.busy
    killed = helper._process
    os.kill(killed.pid, signal.SIGKILL)
    with caplog.at_level(logging.WARNING, logger="celery_driftsafe"):
        _rounds_until_idle(wave_beat)
    assert helper.unavailable is not None and helper.losses == 1
    lost = [r.getMessage() for r in caplog.records if "claim process was lost" in r.getMessage()]
    assert len(lost) == 1, lost
    # Killed during its claim, the beat waits for a batch that never comes; killed after it
    # sent its batch back (a batch of 20 can be claimed before the kill lands), the beat finds
    # it dead when it asks for the next. Either way it says so once and claims on itself.
    assert (
        "it ended during a claim (exit code -9)" in lost[0] or "it could not be reached" in lost[0]
    ), lost[0]
    assert f"a wave {RESTART_SECONDS:g} s from now or later starts another" in lost[0]
    clock.advance(wave_beat.settings.lease_seconds + 10)
    _rounds_until_idle(wave_beat)  # the outbox takes what the helper committed, if anything
    _published_once(300)
    first = list(Run.objects.values_list("id", flat=True))
    assert helper.unavailable is not None  # no wave yet: no new helper
    clock.advance(RESTART_SECONDS)
    claims = helper.claims
    for i in range(300):
        interval_task(f"n{i:03d}", 3600, anchor=clock.now(), next_slot_at=clock.now())
    wave_beat._guarded_round()
    assert helper.unavailable is None and helper.running and helper._process is not killed
    wait_until(lambda: helper.ready, "the new claim process to get ready")
    _rounds_until_idle(wave_beat)
    assert helper.claims > claims
    ids = [m["id"] for m in drain()]  # the new wave, and the killed wave's tasks' next slots
    assert len(ids) == len(set(ids))
    dispatched = Run.objects.filter(status=RunStatus.DISPATCHED)
    assert set(ids) == set(
        dispatched.exclude(id__in=first).values_list("celery_task_id", flat=True)
    )
    assert dispatched.filter(periodic_task__name__startswith="n").count() == 300
    assert not Run.objects.filter(status=RunStatus.CLAIMED).exists()


def test_a_helper_idle_since_its_wave_stops_and_the_next_wave_starts_another(
    wave_beat: DriftSafeScheduler, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A helper that has had no batch to claim for ``IDLE_SECONDS`` stops (its memory is not
    held between hourly waves); the next wave starts a new one, and each slot goes out once."""
    from celery_driftsafe.claim.helper_process import IDLE_SECONDS

    for i in range(100):
        interval_task(f"i{i:03d}", 3600, anchor=T0, next_slot_at=T0)
    _rounds_until_idle(wave_beat)
    helper = wave_beat._prefetcher.process
    assert helper is not None and helper.claims >= 1
    first = helper._process
    clock.advance(IDLE_SECONDS / 2)
    wave_beat._guarded_round()
    assert helper.running  # not idle long enough yet
    clock.advance(IDLE_SECONDS / 2 + 1)
    with caplog.at_level(logging.INFO, logger="celery_driftsafe"):
        wave_beat._guarded_round()
    assert not helper.running and first is not None and not first.is_alive()
    assert f"no batch to claim for {IDLE_SECONDS:g} s" in caplog.text
    _published_once(100)
    clock.advance(3600 - IDLE_SECONDS - 1)  # the next wave
    wave_beat._guarded_round()
    assert helper.running and helper._process is not first


def test_a_helper_started_by_a_short_wave_is_kept_for_the_next(
    settings: Any, broker_app: Any, clock: FakeClock
) -> None:
    """A wave too short for the helper to get ready in: the rounds after it keep the helper
    (it is idle from its start, not from before), so the next wave finds it ready."""
    _needs_skip_locked()
    settings.DRIFTSAFE_INTERNALS = {
        **settings.DRIFTSAFE_INTERNALS,
        "CLAIM_BATCH_SIZE": 20,
        "CLAIM_PROCESS": True,
    }
    clock.advance(10 * 3600)  # a beat that has been up for hours: its monotonic clock is large
    sched = DriftSafeScheduler(
        app=broker_app, clock=clock, authority=clock, install_signal_handlers=False
    )
    try:
        for i in range(60):
            interval_task(f"s{i:02d}", 60, anchor=clock.now(), next_slot_at=clock.now())
        _rounds_until_idle(sched)
        helper = sched._prefetcher.process
        assert helper is not None and helper.running
        sched._guarded_round()
        assert helper.running
        wait_until(lambda: helper.ready, "the claim process to get ready")
        clock.advance(60)
        _rounds_until_idle(sched)
        assert helper.claims >= 1
        _published_once(120)
    finally:
        sched.close()


def test_a_helper_gone_between_waves_costs_no_round(
    wave_beat: DriftSafeScheduler, caplog: pytest.LogCaptureFixture
) -> None:
    """The helper is killed while idle: the next wave's first round still publishes its batch
    (asking the dead helper for the next one fails there, quietly for the round), the beat
    says so, and its thread claims the rest, each slot once. The lost helper is reaped
    without being reported as stopped."""
    helper = wave_beat._prefetcher.process
    assert helper is not None and helper._process is not None
    lost = helper._process
    lost.kill()
    lost.join(10)
    for i in range(100):
        interval_task(f"g{i:03d}", 60, anchor=T0, next_slot_at=T0)
    with caplog.at_level(logging.INFO, logger="celery_driftsafe"):
        assert wave_beat._guarded_round() == 0.0
        assert wave_beat._outage is None  # the round went through
        assert len(drain()) == 20  # its batch is out
        _rounds_until_idle(wave_beat)
    assert helper.unavailable is not None
    assert "the claim process was lost" in caplog.text
    assert "claim round failed" not in caplog.text
    assert "stopping the claim process" not in caplog.text  # it was lost, not stopped
    assert Run.objects.filter(status=RunStatus.DISPATCHED).count() == 100
    assert not Run.objects.filter(status=RunStatus.CLAIMED).exists()


def test_the_helper_ends_when_the_beat_is_gone(settings: Any) -> None:
    """A beat killed outright cannot stop its helper: the helper sees the beat's end of the
    pipe close and ends by itself."""
    _needs_skip_locked()
    helper = ClaimProcess("default", "gone-node")
    helper.start()
    wait_until(lambda: helper.ready, "the claim process to get ready")
    process = helper._process
    helper._conn.close()  # what the beat's death does to its end
    process.join(20)
    assert not process.is_alive()


def test_settings_that_cannot_reach_a_process_leave_the_beat_claiming_in_a_thread(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Database options that cannot be pickled (an SSL context object, say) cannot be sent
    to the helper: the beat says so once and claims in its thread."""
    import ssl

    from celery_driftsafe.claim import helper_process as claim_process

    _needs_skip_locked()
    real_dumps = claim_process.pickle.dumps

    class Pickle:
        loads = staticmethod(claim_process.pickle.loads)

        @staticmethod
        def dumps(value: Any) -> bytes:
            using, node, database, *rest = value
            database = {**database, "OPTIONS": {"ssl_context": ssl.create_default_context()}}
            return real_dumps((using, node, database, *rest))

    monkeypatch.setattr(claim_process, "pickle", Pickle)
    helper = ClaimProcess("default", "odd-node")
    with caplog.at_level(logging.WARNING, logger="celery_driftsafe"):
        helper.start()
    assert helper.unavailable is not None and "cannot be sent to a process" in helper.unavailable
    assert not helper.ready and helper._process is None
    assert "this beat claims in a thread" in caplog.text


def test_a_beat_and_its_helper_each_want_a_core() -> None:
    assert spare_cores(1, cores=2) is None
    assert spare_cores(2, cores=4) is None
    assert spare_cores(2, cores=2) == (
        "2 beat(s) and their helpers would outnumber the 2 cores this beat may use"
    )
    assert spare_cores(3, cores=4) is not None
    assert spare_cores(0, cores=1) is not None  # the beat itself, even before it registered


def test_beats_sharing_a_machine_leave_its_cores_to_each_other(
    settings: Any, broker_app: Any, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """As many other live beats on this machine as it has cores: at its first wave the beat
    starts no helper (it says why, once) and claims the wave in its thread, each slot once."""
    import socket

    _needs_skip_locked()
    settings.DRIFTSAFE = {**settings.DRIFTSAFE, "RUN_EXPIRES_SECONDS": None}
    settings.DRIFTSAFE_INTERNALS = {
        **settings.DRIFTSAFE_INTERNALS,
        "CLAIM_BATCH_SIZE": 20,
        "CLAIM_PROCESS": True,
    }
    for n in range(len(os.sched_getaffinity(0))):
        node = nodes.register(f"{socket.gethostname()}:{90000 + n}:neighbour", clock.now())
        assert node.hostname == socket.gethostname()
    sched = DriftSafeScheduler(
        app=broker_app, clock=clock, authority=clock, install_signal_handlers=False
    )
    try:
        for i in range(100):
            interval_task(f"n{i:03d}", 60, anchor=T0, next_slot_at=T0)
        with caplog.at_level(logging.INFO, logger="celery_driftsafe"):
            _rounds_until_idle(sched)
        helper = sched._prefetcher.process
        assert helper is not None and helper._process is None and helper.claims == 0
        assert helper.unavailable is not None and "cores" in helper.unavailable
        assert caplog.text.count("no claim process:") == 1
        _published_once(100)
    finally:
        sched.close()


def test_a_helper_that_cannot_be_started_leaves_nothing_to_stop(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A start that fails (here as when the machine has no process to spare) is said once;
    the beat claims in its thread, and stopping the beat later has no helper to wait for (it
    used to fail the beat's close with ``can only join a started process``)."""
    import multiprocessing.context

    _needs_skip_locked()

    def no_process(self: Any) -> None:
        raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(multiprocessing.context.SpawnProcess, "start", no_process)
    helper = ClaimProcess("default", "crowded-node")
    with caplog.at_level(logging.WARNING, logger="celery_driftsafe"):
        helper.start()
    assert helper.unavailable is not None and "could not be started" in helper.unavailable
    assert not helper.running and not helper.ready
    helper.stop()  # nothing to stop, nothing raised
    assert "this beat claims in a thread" in caplog.text


def _spawn_from_a_billiard_child(queue: Any) -> None:
    import multiprocessing

    from celery_driftsafe.claim.helper_process import _spawnable_authkey

    _spawnable_authkey()
    context = multiprocessing.get_context("spawn")
    process = context.Process(target=os.getpid, daemon=True)
    try:
        process.start()
        process.join(30)
        queue.put(process.exitcode)
    except Exception as exc:
        queue.put(repr(exc))


def test_a_beat_in_a_billiard_process_can_spawn_its_helper() -> None:
    """The beat of ``celery worker -B`` runs in a process billiard started, whose key
    multiprocessing's spawn would not pickle: made spawnable, the helper starts there (a real
    worker with an embedded beat: ``tests/e2e/test_claim_process.py``)."""
    import billiard

    queue = billiard.Queue()
    child = billiard.Process(target=_spawn_from_a_billiard_child, args=(queue,))
    child.start()
    child.join(60)
    assert queue.get(timeout=5) == 0
