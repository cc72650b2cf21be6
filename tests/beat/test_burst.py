"""Bursts and outages through real claim rounds (a scheduler driven by a fake authority clock,
real database and Redis broker): a wave the beats drain late but without a break misses nothing;
slots that fell due while no beat ran get their misfire policy, as one span row; pipelined
publishing sends each message once and a failed pipelined write leaves its runs to the outbox."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from celery_driftsafe.beat import nodes
from celery_driftsafe.claim.claimers import claimer_for
from celery_driftsafe.claim.outbox import reclaim_stale
from celery_driftsafe.models import BeatNode, Run, RunStatus
from celery_driftsafe.publish.dispatcher import Dispatcher
from celery_driftsafe.scheduler import DriftSafeScheduler
from celery_driftsafe.testing import FakeClock
from celery_driftsafe.testing.processes import NoRedis, start_redis
from tests.skip_guard import configuration
from tests.support import T0, drain
from tests.support.factories import interval_task

pytestmark = pytest.mark.django_db(transaction=True)

S = timedelta(seconds=1)


@pytest.fixture
def small_rounds(settings: Any, broker_app: Any, clock: FakeClock) -> Iterator[DriftSafeScheduler]:
    """A scheduler that claims 10 tasks a round, with a misfire grace of 5 s."""
    settings.DRIFTSAFE = {
        **settings.DRIFTSAFE,
        "MISFIRE_GRACE_SECONDS": 5.0,
        "RUN_EXPIRES_SECONDS": None,
    }
    settings.DRIFTSAFE_INTERNALS = {**settings.DRIFTSAFE_INTERNALS, "CLAIM_BATCH_SIZE": 10}
    sched = DriftSafeScheduler(
        app=broker_app, clock=clock, authority=clock, install_signal_handlers=False
    )
    yield sched
    sched.close()


def test_a_wave_drained_past_the_grace_without_a_break_misses_nothing(
    small_rounds: DriftSafeScheduler, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """50 tasks due at one instant, 10 a round, 2 s a round: the last ones go out 8 s after
    their slot, past the 5 s grace, even under the ``skip`` policy; the beat says it is
    saturated, on its log and on its node row."""
    for _ in range(10):  # the beat was up and idle before the wave: a round a second
        small_rounds.run_round()
        clock.advance(S)
    wave = T0 + 10 * S
    tasks = [
        interval_task(f"w{i:02d}", 60, anchor=wave, next_slot_at=wave, misfire_policy="skip")
        for i in range(50)
    ]
    with caplog.at_level(logging.WARNING, logger="celery_driftsafe.scheduler"):
        while small_rounds.run_round() == 0.0:
            clock.advance(2 * S)
    sent = drain()
    assert len(sent) == 50 and len({m["id"] for m in sent}) == 50
    assert Run.objects.filter(status=RunStatus.MISSED).count() == 0
    assert Run.objects.filter(periodic_task__in=tasks, slot=wave).count() == 50
    saturated = [r for r in caplog.records if getattr(r, "action", "") == "saturated"]
    assert len(saturated) == 1, [r.getMessage() for r in caplog.records]
    assert "6.0 s after they fell due" in saturated[0].getMessage()  # once, when first past
    small_rounds._heartbeat()
    node = BeatNode.objects.get(node_id=small_rounds.node_id)
    assert node.lag_seconds == 8.0 and node.claiming_since == T0


def test_slots_that_fell_due_while_no_beat_ran_are_missed_as_one_span(
    small_rounds: DriftSafeScheduler, clock: FakeClock
) -> None:
    """The beat stops claiming for an hour (paused, or the database was away): its next round
    starts a new stretch, so what fell due meanwhile is missed, not late, and recorded as one
    span per task."""
    small_rounds.run_round()
    task = interval_task(
        "minutely", 60, anchor=T0 + 30 * S, next_slot_at=T0 + 30 * S, misfire_policy="skip"
    )
    clock.advance(timedelta(hours=1))
    small_rounds.run_round()
    assert drain() == []
    span = Run.objects.get(periodic_task=task)
    assert span.status == RunStatus.MISSED and span.missed_count == 60
    assert (span.slot, span.missed_until) == (T0 + 30 * S, T0 + timedelta(minutes=59, seconds=30))
    node = BeatNode.objects.get(node_id=small_rounds.node_id)
    assert node.claiming_since == T0 + timedelta(hours=1)


def test_another_live_beat_that_kept_claiming_makes_a_late_slot_late_not_missed(
    small_rounds: DriftSafeScheduler, clock: FakeClock
) -> None:
    """This beat has just started, but another one has been claiming for a minute: a slot 20 s
    old (past the 5 s grace) was late because the cluster was busy, so it fires."""
    nodes.register("peer", T0 - 60 * S)
    BeatNode.objects.filter(node_id="peer").update(
        claiming_since=T0 - 60 * S, last_heartbeat_at=T0 - S
    )
    interval_task("late", 60, anchor=T0 - 20 * S, next_slot_at=T0 - 20 * S, misfire_policy="skip")
    small_rounds.run_round()
    assert [m["driftsafe_slot"] for m in drain()] == [(T0 - 20 * S).isoformat()]


# -- pipelined publishing -----------------------------------------------------------------


def test_pipelined_batches_publish_each_run_once_in_order(
    settings: Any, broker_app: Any, clock: FakeClock
) -> None:
    settings.DRIFTSAFE = {**settings.DRIFTSAFE, "RUN_EXPIRES_SECONDS": None}
    settings.DRIFTSAFE_INTERNALS = {**settings.DRIFTSAFE_INTERNALS, "PUBLISH_BATCH_SIZE": 7}
    for i in range(30):
        interval_task(f"p{i:02d}", 60, anchor=T0, next_slot_at=T0, args=[i, i])
    nodes.register("n1", T0)
    runs = claimer_for().claim(T0, "n1").runs
    result = Dispatcher(broker_app, clock).dispatch(runs)
    assert result.published == [r.run_id for r in runs] and not result.deferred
    sent = drain()
    assert [m["id"] for m in sent] == [r.celery_task_id for r in runs]
    assert all(m["argsrepr"] == repr(m["args"]) for m in sent)
    assert Run.objects.filter(status=RunStatus.DISPATCHED).count() == 30


@pytest.fixture
def tight_redis(tmp_path: Path) -> Iterator[str]:
    """A private redis-server without eviction, whose memory limit a test can lower so that
    it refuses every write, without touching the shared server."""
    try:
        server = start_redis(tmp_path / "redis", options=["--maxmemory-policy", "noeviction"])
    except NoRedis as exc:
        pytest.fail(f"{exc} (apt-get install redis-server)")
    yield f"{server.url}/0"
    server.stop()


def test_a_failed_pipelined_write_leaves_its_runs_to_the_outbox(
    settings: Any, clock: FakeClock, tight_redis: str
) -> None:
    """Redis refuses the batch's writes (out of memory): no run is marked dispatched, all stay
    claimed; once Redis takes writes again the outbox publishes each exactly once."""
    import redis
    from celery import Celery

    settings.DRIFTSAFE = {**settings.DRIFTSAFE, "RUN_EXPIRES_SECONDS": None}
    app = Celery("tight", broker=tight_redis, set_as_current=False)
    app.conf.task_default_queue = "tight"
    app.conf.broker_connection_retry_on_startup = False
    client = redis.Redis.from_url(tight_redis)
    try:
        interval_task("first", 60, anchor=T0, next_slot_at=T0)
        nodes.register("n1", T0)
        dispatcher = Dispatcher(app, clock)
        assert len(dispatcher.dispatch(claimer_for().claim(T0, "n1").runs).published) == 1
        for i in range(5):
            interval_task(f"t{i}", 60, anchor=T0 + S, next_slot_at=T0 + S)
        client.config_set("maxmemory", 1)  # every write is refused: out of memory
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            client.lpush("tight", b"probe")
        runs = claimer_for().claim(T0 + S, "n1").runs
        result = dispatcher.dispatch(runs)
        assert result.published == [] and sorted(result.deferred) == sorted(r.run_id for r in runs)
        assert Run.objects.filter(status=RunStatus.CLAIMED).count() == 5
        assert client.llen("tight") == 1
        client.config_set("maxmemory", 0)
        clock.advance(40 * S)
        taken = reclaim_stale(clock.now(), "n2", lease=timedelta(seconds=30))
        assert sorted(r.run_id for r in taken) == sorted(r.run_id for r in runs)
        assert len(Dispatcher(app, clock).dispatch(taken).published) == 5
        assert client.llen("tight") == 6
        assert Run.objects.filter(status=RunStatus.DISPATCHED).count() == 6
    finally:
        client.close()
        app.close()


def test_a_beat_claims_the_next_batch_while_publishing_and_publishes_it_when_stopping(
    small_rounds: DriftSafeScheduler,
) -> None:
    """With a full batch, the next one is claimed ahead (in a thread, while the current one is
    published); a beat that stops then publishes what it claimed ahead before it records itself
    stopped, so nothing it committed waits for another beat's outbox."""
    from django.db import connection

    if not connection.features.has_select_for_update_skip_locked:
        pytest.skip(configuration("claiming ahead is for databases with SKIP LOCKED (not SQLite)"))
    for i in range(25):
        interval_task(f"a{i:02d}", 60, anchor=T0, next_slot_at=T0)
    assert small_rounds.run_round() == 0.0  # a full batch: 10 published, 10 claimed ahead
    assert len(drain()) == 10
    small_rounds.close()
    assert len(drain()) == 10
    assert Run.objects.filter(status=RunStatus.DISPATCHED).count() == 20
    assert not Run.objects.filter(status=RunStatus.CLAIMED).exists()
    assert BeatNode.objects.get(node_id=small_rounds.node_id).stopped_at is not None
