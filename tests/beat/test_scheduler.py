"""The scheduler in-process, against the real database and a real Redis broker, with a fake
clock as the authority so every instant is exact."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from celery.schedules import crontab

from celery_driftsafe.claim.outbox import celery_task_id
from celery_driftsafe.core.headers import HEADER_FENCING_TOKEN, HEADER_RUN_ID, HEADER_SLOT
from celery_driftsafe.models import BeatNode, PeriodicTask, Run, RunStatus
from celery_driftsafe.scheduler import DriftSafeScheduler
from celery_driftsafe.testing import FakeClock
from tests import settings as test_settings
from tests.skip_guard import configuration
from tests.support import QUEUE, T0, drain, wait_until
from tests.support.factories import interval_task, real_deadlock

S = timedelta(seconds=1)


@pytest.mark.django_db(transaction=True)
def test_round_publishes_due_runs_with_deterministic_ids_and_headers(
    scheduler: DriftSafeScheduler, clock: FakeClock
) -> None:
    task = interval_task("add", 10, anchor=T0, next_slot_at=T0, args=[2, 3], queue="")
    wait = scheduler.run_round()
    messages = drain()
    assert len(messages) == 1
    msg = messages[0]
    run = Run.objects.get()
    assert msg["id"] == celery_task_id(task.pk, T0) == run.celery_task_id
    assert msg["task"] == "tests.add" and msg["args"] == [2, 3]
    assert msg[HEADER_RUN_ID] == run.pk
    assert msg[HEADER_SLOT] == T0.isoformat()
    assert msg[HEADER_FENCING_TOKEN] == 0
    assert run.status == RunStatus.DISPATCHED and run.dispatched_at == T0
    assert run.claimed_by == scheduler.node_id
    assert wait == pytest.approx(1.0)  # next slot in 10 s, capped by MAX_LOOP_INTERVAL_SECONDS
    # nothing more until the next slot, which fires exactly at its instant, not before
    clock.advance(10 * S - timedelta(microseconds=1))
    scheduler.run_round()
    assert drain() == []
    clock.advance(timedelta(microseconds=1))
    scheduler.run_round()
    assert [m[HEADER_SLOT] for m in drain()] == [(T0 + 10 * S).isoformat()]


@pytest.mark.django_db(transaction=True)
def test_wait_is_time_until_next_slot_by_authority(
    scheduler: DriftSafeScheduler, clock: FakeClock
) -> None:
    interval_task(
        "add",
        10,
        anchor=T0 + timedelta(milliseconds=300),
        next_slot_at=T0 + timedelta(milliseconds=300),
    )
    assert scheduler.run_round() == pytest.approx(0.3)
    assert drain() == []


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("spacing", [0.02, 0.0])
def test_slots_a_few_ms_apart_share_a_round_after_min_round_interval(
    settings: Any, broker_app: Any, clock: FakeClock, spacing: float
) -> None:
    """MIN_ROUND_INTERVAL_SECONDS: a slot due 5 ms after a round began waits for the next
    round, 20 ms after the first; with 0 the beat comes back at its instant. Slots are never
    early either way, and a full batch still comes back at once."""
    settings.DRIFTSAFE_INTERNALS = {
        **settings.DRIFTSAFE_INTERNALS,
        "MIN_ROUND_INTERVAL_SECONDS": spacing,
        "CLAIM_BATCH_SIZE": 2,
    }
    ms = timedelta(milliseconds=1)
    for i, at in enumerate((T0, T0 + 5 * ms, T0 + 8 * ms)):
        interval_task(f"t{i}", 60, anchor=at, next_slot_at=at)
    sched = DriftSafeScheduler(
        app=broker_app, clock=clock, authority=clock, install_signal_handlers=False
    )
    try:
        assert sched.run_round() == pytest.approx(max(0.005, spacing))
        assert [m["task"] for m in drain()] == ["tests.add"]
        clock.advance(timedelta(seconds=max(0.005, spacing)))
        if not spacing:
            assert sched.run_round() == pytest.approx(0.003)  # the third, 3 ms on
            assert len(drain()) == 1
            clock.advance(3 * ms)
            assert sched.run_round() == pytest.approx(1.0)
            assert len(drain()) == 1
        else:
            assert sched.run_round() == 0.0  # both others together: a full batch
            assert sorted(m[HEADER_SLOT] for m in drain()) == [
                (T0 + 5 * ms).isoformat(),
                (T0 + 8 * ms).isoformat(),
            ]
        assert Run.objects.filter(status=RunStatus.DISPATCHED).count() == 3
    finally:
        sched.close()


@pytest.mark.django_db(transaction=True)
def test_a_jittered_task_is_published_at_its_jittered_instant_under_its_slot(
    scheduler: DriftSafeScheduler, clock: FakeClock
) -> None:
    from celery_driftsafe.core.jitter import offset

    name = next(
        n
        for n in (f"j{i}" for i in range(1000))
        if timedelta(milliseconds=200) < offset(n, T0, 2) < timedelta(milliseconds=900)
    )
    shift = offset(name, T0, 2)
    task = interval_task(name, 10, anchor=T0, next_slot_at=T0, jitter_seconds=2, queue="")
    # the beat sleeps until the jittered instant, not the slot
    assert scheduler.run_round() == pytest.approx(shift.total_seconds())
    assert drain() == []
    clock.advance(shift - timedelta(microseconds=1))
    scheduler.run_round()
    assert drain() == []
    clock.advance(timedelta(microseconds=1))
    scheduler.run_round()
    messages = drain()
    assert [(m["id"], m[HEADER_SLOT]) for m in messages] == [
        (celery_task_id(task.pk, T0), T0.isoformat())
    ]
    assert Run.objects.get().slot == T0


@pytest.mark.django_db(transaction=True)
def test_task_the_beat_has_not_imported_is_published_by_name_with_the_apps_routes(
    scheduler: DriftSafeScheduler,
) -> None:
    # Rolling deploys and slim beat processes: the beat's app does not register the task;
    # it goes out by name, routed by task_routes, as Celery beat does.
    routed = f"{QUEUE}-routed"
    scheduler.app.conf.task_routes = {"elsewhere.*": {"queue": routed}}
    interval_task("ghost", 10, anchor=T0, next_slot_at=T0, task="elsewhere.report", args=[7])
    interval_task("real", 10, anchor=T0, next_slot_at=T0)
    scheduler.run_round()
    assert [m["task"] for m in drain()] == ["tests.add"]
    sent = drain(routed)
    assert [(m["task"], m["args"]) for m in sent] == [("elsewhere.report", [7])]
    ghost = Run.objects.get(task_name="elsewhere.report")
    assert ghost.status == RunStatus.DISPATCHED and sent[0]["id"] == ghost.celery_task_id


@pytest.mark.django_db(transaction=True)
def test_node_registered_and_stopped(scheduler: DriftSafeScheduler) -> None:
    node = BeatNode.objects.get(node_id=scheduler.node_id)
    assert node.started_at == T0 and node.stopped_at is None
    scheduler.run_round()
    scheduler.close()
    node.refresh_from_db()
    assert node.stopped_at == T0


@pytest.mark.django_db(transaction=True)
def test_beat_schedule_synced_once_by_several_beats(broker_app: Any, clock: FakeClock) -> None:
    broker_app.conf.beat_schedule = {
        "every-5": {"task": "tests.add", "schedule": 5.0, "args": (1, 2)},
        "nightly": {"task": "tests.add", "schedule": crontab(minute=30, hour=2), "args": (3, 4)},
        "broken": {"task": "tests.add", "schedule": 0},
    }
    broker_app.conf.timezone = "Europe/Berlin"
    beats = [
        DriftSafeScheduler(
            app=broker_app, clock=clock, authority=clock, install_signal_handlers=False
        )
        for _ in range(3)
    ]
    try:
        assert PeriodicTask.objects.count() == 2
        every5 = PeriodicTask.objects.get(name="every-5")
        assert every5.interval_every == 5 and every5.interval_anchor == T0
        assert every5.next_slot_at == T0 + 5 * S and every5.args == [1, 2]
        nightly = PeriodicTask.objects.get(name="nightly")
        assert (nightly.crontab_minute, nightly.crontab_hour) == ("30", "2")
        assert nightly.timezone == "Europe/Berlin"
        # a restart later does not move the anchor
        clock.advance(timedelta(hours=1))
        again = DriftSafeScheduler(
            app=broker_app, clock=clock, authority=clock, install_signal_handlers=False
        )
        again.close()
        every5.refresh_from_db()
        assert every5.interval_anchor == T0
    finally:
        for beat in beats:
            beat.close()


@pytest.mark.django_db(transaction=True)
def test_an_entry_removed_from_beat_schedule_is_disabled_and_enabled_when_it_is_back(
    broker_app: Any, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """As Celery's own beat drops an entry removed from ``beat_schedule``, a starting beat
    disables the task its app synced from it, and enables it again when the entry is back (at
    its first slot after now). Another app's tasks and tasks synced before the app was
    recorded are only named in a warning; tasks from the admin are never touched."""

    def start() -> None:
        DriftSafeScheduler(
            app=broker_app, clock=clock, authority=clock, install_signal_handlers=False
        ).close()

    entry = {"task": "tests.add", "schedule": 5.0, "args": (1, 2)}
    broker_app.conf.beat_schedule = {"kept": entry, "dropped": entry}
    start()
    assert set(PeriodicTask.objects.values_list("source_app", flat=True)) == {broker_app.main}
    interval_task("from-the-admin", 5, anchor=T0)
    for name, app in (("other-apps", "another-app"), ("synced-long-ago", None)):
        interval_task(name, 5, anchor=T0, source="beat_schedule", source_app=app)
    del broker_app.conf.beat_schedule["dropped"]
    with caplog.at_level("WARNING", logger="celery_driftsafe.beat_schedule"):
        start()
    dropped = PeriodicTask.objects.get(name="dropped")
    assert (dropped.enabled, dropped.disabled_reason, dropped.next_slot_at) == (
        False,
        "removed from beat_schedule",
        None,
    )
    assert PeriodicTask.objects.filter(enabled=True).count() == 4  # every other task
    assert [r.getMessage() for r in caplog.records] == [
        "task dropped disabled: app 'driftsafe-tests''s beat_schedule no longer has it (put "
        "the entry back to enable it again)",
        "enabled tasks from beat_schedule that this app's beat_schedule does not have: "
        "other-apps, synced-long-ago; they keep firing (another Celery app's, or synced "
        "before the app was recorded): disable or delete them in the admin if they are gone "
        "from the code",
    ]
    Run.objects.create(
        periodic_task=dropped, task_name="tests.add", slot=T0 + 100 * S, status="succeeded"
    )
    clock.advance(60 * S)
    broker_app.conf.beat_schedule["dropped"] = entry
    start()
    dropped.refresh_from_db()
    assert (dropped.enabled, dropped.disabled_reason) == (True, "")
    assert dropped.next_slot_at == T0 + 105 * S  # after now and after its last run


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("policy", "fired", "missed"),
    [
        # The beat claims again after a day: the slot due at that very round fires (it fell
        # due as the beat claimed); the 86,400 of the day fell due while no beat claimed, and
        # those that do not fire are one row (a span): fire_all fires its latest 100 of them
        ("fire_once", 1, 86_400),
        ("fire_all", 1 + 100, 86_400 - 100),
        ("skip", 1, 86_400),
    ],
)
def test_misfire_policies_after_one_day_outage_of_one_second_task(
    scheduler: DriftSafeScheduler, clock: FakeClock, policy: str, fired: int, missed: int
) -> None:
    task = interval_task("every-second", 1, anchor=T0, next_slot_at=T0, misfire_policy=policy)
    clock.advance(timedelta(days=1))
    while scheduler.run_round() == 0.0:  # full batches first
        pass
    messages = drain()
    assert len(messages) == fired
    assert len({m["id"] for m in messages}) == fired
    runs = Run.objects.filter(periodic_task=task)
    assert runs.filter(status=RunStatus.DISPATCHED).count() == fired
    span = runs.get(status=RunStatus.MISSED)  # one row
    assert span.slot == T0 and span.missed_count == missed
    assert span.missed_until == T0 + timedelta(seconds=missed - 1)
    assert f"{missed} slots from {T0.isoformat()}" in span.error
    task.refresh_from_db()
    assert task.next_slot_at == T0 + timedelta(days=1, seconds=1)
    # the next round fires only the next slot: no storm
    clock.advance(S)
    scheduler.run_round()
    assert len(drain()) == 1


@pytest.mark.django_db(transaction=True)
def test_terminate_during_a_round_finishes_the_round_then_exits(
    scheduler: DriftSafeScheduler, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    interval_task("add", 10, anchor=T0, next_slot_at=T0)
    real_dispatch = scheduler.dispatcher.dispatch

    def dispatch_with_signal(runs: Any) -> Any:
        scheduler._on_terminate(15, None)  # SIGTERM arrives mid-round: must not raise here
        return real_dispatch(runs)

    monkeypatch.setattr(scheduler.dispatcher, "dispatch", dispatch_with_signal)
    with pytest.raises(SystemExit):
        scheduler.tick()
    assert len(drain()) == 1
    assert Run.objects.get().status == RunStatus.DISPATCHED  # published and marked


@pytest.mark.django_db(transaction=True)
def test_terminate_while_waiting_exits_at_once(scheduler: DriftSafeScheduler) -> None:
    # The handler may interrupt anything (a lock, a query), so it only sets a flag and wakes
    # the wait: it never raises. The wait returns at once and the tick stops, claiming nothing.
    scheduler._on_terminate(15, None)
    assert scheduler._wake.wait(60)
    with pytest.raises(SystemExit):
        scheduler.tick()
    assert scheduler.rounds == 0


def test_wakeup_set_from_another_thread_ends_a_wait() -> None:
    import threading

    from celery_driftsafe.beat.wakeup import Wakeup

    wakeup = Wakeup()
    assert not wakeup.wait(0)
    threading.Thread(target=wakeup.set).start()
    assert wakeup.wait(60)
    wakeup.clear()
    assert not wakeup.is_set() and not wakeup.wait(0)


@pytest.mark.django_db(transaction=True)
def test_dead_node_is_marked_and_its_claims_republished_without_waiting_for_the_lease(
    scheduler: DriftSafeScheduler, clock: FakeClock
) -> None:
    from celery_driftsafe.beat.nodes import register
    from celery_driftsafe.claim.claimers import claimer_for

    task = interval_task("add", 3600, anchor=T0, next_slot_at=T0)
    register("dead-node", T0)
    claimer_for().claim(T0, "dead-node")  # claimed, then the node died before publishing
    clock.advance(31)  # NODE_DEAD_AFTER_SECONDS = 30, LEASE_SECONDS = 30 -> lease not yet over
    Run.objects.filter(periodic_task=task).update(claimed_at=T0 + 20 * S)
    scheduler.run_round()
    node = BeatNode.objects.get(node_id="dead-node")
    assert node.stopped_at == T0 + 31 * S
    assert "marked dead by" in node.claiming_paused_reason
    messages = drain()
    assert [m["id"] for m in messages] == [celery_task_id(task.pk, T0)]
    run = Run.objects.get(periodic_task=task)
    assert run.status == RunStatus.DISPATCHED and run.claimed_by == scheduler.node_id


@pytest.mark.django_db(transaction=True)
def test_absurd_clock_answer_stops_claiming_on_that_node_only(
    broker_app: Any, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    from celery_driftsafe.store.clock import AuthorityClock

    interval_task("add", 10, anchor=T0, next_slot_at=T0)
    # This node's wall clock reads thirty hours ahead of the authority (bound: a day).
    skewed = AuthorityClock(
        clock,
        samples=1,
        monotonic=clock.monotonic,
        sleeper=clock.sleep,
        wall=lambda: clock.now() + timedelta(hours=30),
    )
    broken = DriftSafeScheduler(
        app=broker_app, clock=skewed, authority=clock, install_signal_handlers=False
    )
    healthy = DriftSafeScheduler(
        app=broker_app, clock=clock, authority=clock, install_signal_handlers=False
    )
    try:
        broken.run_round()
        assert drain() == []
        node = BeatNode.objects.get(node_id=broken.node_id)
        assert "exceeds HARD_CLOCK_OFFSET_SECONDS" in node.claiming_paused_reason
        assert "claiming paused" in caplog.text
        healthy.run_round()
        assert len(drain()) == 1
    finally:
        broken.close()
        healthy.close()


class FlakyAuthority:
    """An authority that can be switched off and on (a database or Redis outage)."""

    name = "flaky"

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.down = False

    def read(self) -> datetime:
        from celery_driftsafe.exceptions import ClockError

        if self.down:
            raise ClockError("authority unreachable (outage)")
        return self.clock.now()


@pytest.mark.django_db(transaction=True)
def test_outage_logs_once_per_state_change_backs_off_and_catches_up(
    broker_app: Any, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    authority = FlakyAuthority(clock)
    sched = DriftSafeScheduler(
        app=broker_app, clock=clock, authority=authority, install_signal_handlers=False
    )
    try:
        interval_task("add", 10, anchor=T0, next_slot_at=T0)
        authority.down = True
        waits = []
        for _ in range(6):
            waits.append(sched._guarded_round())
            clock.advance(10)
        # said at once and again every 30 s while it lasts (rounds at 0, 10, … 50 s), at ERROR,
        # naming what is out of reach and what that stops
        paused = [r for r in caplog.records if "claiming paused" in r.getMessage()]
        assert [r.levelname for r in paused] == ["ERROR", "ERROR"]
        assert (
            paused[0]
            .getMessage()
            .startswith(
                "claiming paused, the time authority (flaky) is unreachable (authority unreachable"
            )
        )
        assert paused[1].getMessage().startswith("claiming paused for 30 s, the time authority")
        assert "no slot is claimed or published until it answers" in paused[1].getMessage()
        assert waits[-1] > waits[0]  # exponential backoff (with jitter)
        assert all(w <= 30.0 for w in waits)
        authority.down = False
        sched._guarded_round()
        (resumed,) = [r for r in caplog.records if "claiming resumed" in r.getMessage()]
        assert resumed.getMessage().startswith(
            "claiming resumed: the time authority (flaky) answers again after 60 s"
        )
        # 60 s of outage: the slots due meanwhile fell due while no round claimed, within the
        # grace or not; under fire_once the one due as claiming resumed fires, the rest are
        # recorded missed
        assert [m[HEADER_SLOT] for m in drain()] == [(T0 + 60 * S).isoformat()]
        missed = Run.objects.get(status=RunStatus.MISSED)
        assert (missed.slot, missed.missed_until, missed.missed_count) == (T0, T0 + 50 * S, 6)
    finally:
        sched.close()


@pytest.mark.django_db(transaction=True)
def test_a_broker_outage_pauses_claiming_and_the_misfire_policy_decides_after_it(
    clock: FakeClock, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """The broker is out of reach for five minutes of a task every 10 s. The first round's
    run stays claimed for the outbox, and claiming pauses: the beat only asks the broker, once
    a round, whether it is back. Then the slots due meanwhile meet the misfire policy (the
    default, fire once): one catch-up run and one row for the missed span, not thirty runs
    published at once, as when the beat claimed every slot on time and the outbox sent them
    all when the broker came back."""
    import redis
    from celery import Celery

    from celery_driftsafe.testing.processes import NoRedis, free_port, start_redis

    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    app = Celery("outage-broker", broker=url, set_as_current=False)
    app.conf.update(
        broker_connection_retry=False, task_publish_retry=False, task_default_queue="outage"
    )
    sched = DriftSafeScheduler(app=app, clock=clock, authority=clock, install_signal_handlers=False)
    server = None
    try:
        task = interval_task("add", 10, anchor=T0, next_slot_at=T0)
        sched._guarded_round()
        run = Run.objects.get()
        assert (run.status, run.dispatched_at) == (RunStatus.CLAIMED, None)
        assert "stay claimed for the outbox" in caplog.text
        assert "claiming paused, the broker is unreachable" in caplog.text
        for _ in range(30):
            clock.advance(10 * S)
            sched._guarded_round()
        assert Run.objects.count() == 1, "claimed while the broker was away"
        try:
            server = start_redis(tmp_path / "redis", port=port)
        except NoRedis as exc:
            pytest.fail(f"{exc} (apt-get install redis-server)")
        client = redis.Redis.from_url(url)
        clock.advance(10 * S)
        sched._guarded_round()
        assert "claiming resumed: the broker answers again after 310 s" in caplog.text
        rows = list(Run.objects.order_by("slot").values_list("slot", "status", "missed_count"))
        assert rows[0][:2] == (T0, RunStatus.DISPATCHED)  # the outbox: past the lease
        # Fire once with a grace of 60 s: the slots older than the grace (10 s … 240 s) are one
        # missed span, the seven within it (250 s … 310 s, now) fire.
        now, grace = T0 + 310 * S, 60 * S
        assert rows[1][1:] == (RunStatus.MISSED, 24), rows
        fired = rows[2:]
        assert [slot for slot, _, _ in fired] == [T0 + k * 10 * S for k in range(25, 32)]
        assert all(
            status == RunStatus.DISPATCHED and slot >= now - grace for slot, status, _ in fired
        )
        assert client.llen("outage") == 1 + len(fired)  # not 31
        client.close()
        task.refresh_from_db()
        assert task.next_slot_at == T0 + 320 * S
    finally:
        sched.close()
        app.close()
        if server is not None:
            server.stop()


@pytest.mark.django_db(transaction=True)
def test_run_started_before_it_was_marked_keeps_status_and_gets_dispatch_time(
    scheduler: DriftSafeScheduler, monkeypatch: pytest.MonkeyPatch
) -> None:
    interval_task("add", 10, anchor=T0, next_slot_at=T0)
    real_record = scheduler.dispatcher._record

    def worker_was_faster(result: Any, runs: Any) -> None:
        Run.objects.update(status=RunStatus.STARTED)  # a worker started it meanwhile
        real_record(result, runs)

    monkeypatch.setattr(scheduler.dispatcher, "_record", worker_was_faster)
    scheduler.run_round()
    run = Run.objects.get()
    assert run.status == RunStatus.STARTED
    assert run.dispatched_at == T0


@pytest.mark.django_db(transaction=True)
def test_run_a_worker_ended_before_it_was_marked_keeps_its_outcome_and_why(
    scheduler: DriftSafeScheduler, monkeypatch: pytest.MonkeyPatch
) -> None:
    interval_task("add", 10, anchor=T0, next_slot_at=T0)
    real_record = scheduler.dispatcher._record
    why = "skipped: the previous run of this task is still running (overlap policy 'skip')"

    def worker_was_faster(result: Any, runs: Any) -> None:
        # a worker received it and skipped it (overlap) before the beat marked it dispatched
        Run.objects.update(status=RunStatus.SKIPPED, finished_at=T0, error=why)
        real_record(result, runs)

    monkeypatch.setattr(scheduler.dispatcher, "_record", worker_was_faster)
    scheduler.run_round()
    run = Run.objects.get()
    assert (run.status, run.error) == (RunStatus.SKIPPED, why)
    assert run.dispatched_at == T0


@pytest.mark.django_db(transaction=True)
def test_rounds_keep_their_connection_and_replace_a_dead_one_without_an_outage(
    scheduler: DriftSafeScheduler, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """With Django's default CONN_MAX_AGE = 0 a round is not a request: the beat keeps its
    connection from round to round (it reopened one every round), and one the server ended
    meanwhile is replaced before the round, which then claims as usual."""
    from django.db import connection

    if connection.vendor != "postgresql":
        pytest.skip(configuration("the server ends a backend here with pg_terminate_backend"))
    assert connection.settings_dict["CONN_MAX_AGE"] == 0

    def backend() -> int:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            pid: int = cursor.fetchone()[0]
        return pid

    interval_task("add", 10, anchor=T0, next_slot_at=T0)
    scheduler._guarded_round()
    first = backend()
    clock.advance(10 * S)
    scheduler._guarded_round()
    assert backend() == first
    assert [m[HEADER_SLOT] for m in drain()] == [T0.isoformat(), (T0 + 10 * S).isoformat()]

    import psycopg

    params = connection.get_connection_params()
    with psycopg.connect(**params, autocommit=True) as other:
        other.execute("SELECT pg_terminate_backend(%s)", [first])
    clock.advance(10 * S)
    scheduler._guarded_round()
    assert backend() != first
    assert [m[HEADER_SLOT] for m in drain()] == [(T0 + 20 * S).isoformat()]
    assert "claiming paused" not in caplog.text


@pytest.mark.django_db(transaction=True)
def test_runs_without_an_outcome_are_reconciled_once_a_minute_not_every_outbox_pass(
    scheduler: DriftSafeScheduler, clock: FakeClock
) -> None:
    """The outbox's pass runs every few seconds; looking for runs that will never hear from a
    worker (a day-old expiry, an hour-old start) reads every run still waiting for an outcome,
    so it runs at most once a minute (the beat's first round included), in a thread of its
    own."""
    from celery_driftsafe.conf import get_settings

    scheduler.run_round()
    scheduler.reconciler.join()
    old = T0 - timedelta(days=2)
    run = Run.objects.create(
        task_name="tests.add",
        slot=old,
        status=RunStatus.DISPATCHED,
        claimed_at=old,
        claimed_by=scheduler.node_id,
        expires_at=old + timedelta(days=1),
    )
    clock.advance(10 * S)  # the outbox's pass runs again (every 5 s at most) ...
    scheduler.run_round()
    scheduler.reconciler.join()
    run.refresh_from_db()
    assert run.status == RunStatus.DISPATCHED  # ... without reconciling
    clock.advance(timedelta(seconds=get_settings().reconcile_interval_seconds) - 10 * S)
    scheduler.run_round()  # ... and a minute after the first, in its own thread
    scheduler.reconciler.join()
    run.refresh_from_db()
    assert run.status == RunStatus.EXPIRED


@pytest.mark.django_db(transaction=True)
def test_a_slow_reconciliation_does_not_hold_up_the_round(
    scheduler: DriftSafeScheduler, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from celery_driftsafe.beat import recovery

    release, round_over, passes = threading.Event(), threading.Event(), []
    over_when_released: list[bool] = []

    def slow(*args: Any, **kwargs: Any) -> None:
        passes.append(args[0])
        release.wait(10)
        over_when_released.append(round_over.is_set())

    monkeypatch.setattr(recovery, "reconcile", slow)
    interval_task("add", 10, anchor=T0, next_slot_at=T0)
    scheduler.run_round()
    round_over.set()
    assert [m[HEADER_SLOT] for m in drain()] == [T0.isoformat()]
    clock.advance(120 * S)
    scheduler.run_round()  # a pass still in flight: no second one
    release.set()
    scheduler.reconciler.join(5)
    assert passes == [T0]
    assert over_when_released == [True], "the round waited for the pass"


@pytest.mark.django_db(transaction=True)
def test_a_missing_table_or_column_is_named_not_taken_for_an_outage() -> None:
    """A beat started before ``migrate`` (or after an upgrade not migrated yet) waits, as
    through an outage, and its log says what is missing rather than "unreachable"."""
    from django.db import DatabaseError, OperationalError, connection

    from celery_driftsafe.exceptions import ClockError
    from celery_driftsafe.scheduler import outage_text

    table = PeriodicTask._meta.db_table
    for sql in ("SELECT * FROM driftsafe_no_such_table", f"SELECT no_such_column FROM {table}"):
        with pytest.raises(DatabaseError) as info, connection.cursor() as cursor:
            cursor.execute(sql)
        text = outage_text(info.value)
        assert text.startswith(
            "the database lacks celery_driftsafe's tables or columns (run migrate): "
        ), text
        assert "\n" not in text
    assert outage_text(OperationalError("connection refused")) == (
        "the database is unreachable (connection refused): no slot is claimed or published "
        "until it answers, and slots due meanwhile meet the misfire policy"
    )
    assert outage_text(ClockError("redis clock unreachable"), "redis").startswith(
        "the time authority (redis) is unreachable (redis clock unreachable)"
    )
    # the database as the time authority: its clock's error is the database's
    assert outage_text(ClockError("no answer"), "database").startswith("the database is ")


@pytest.mark.django_db(transaction=True)
@pytest.mark.skipif(
    test_settings.TEST_DB == "sqlite", reason=configuration("SQLite has no deadlocks")
)
def test_a_round_rolled_back_for_a_concurrent_transaction_runs_again_at_once(
    scheduler: DriftSafeScheduler, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A claim round the database rolled back as a deadlock's victim (a real one's error)
    changed nothing, and the database is there: the round runs again at once, with a warning,
    instead of an outage's ERROR ("unreachable") and backoff. Only a fourth in a row is taken
    for an outage."""
    from celery_driftsafe.scheduler import ROLLED_BACK_ROUNDS

    deadlock = real_deadlock()
    run_round, failures = scheduler.run_round, [ROLLED_BACK_ROUNDS]

    def rolled_back_round() -> float:
        if failures[0]:
            failures[0] -= 1
            raise deadlock
        return run_round()

    monkeypatch.setattr(scheduler, "run_round", rolled_back_round)
    interval_task("add", 10, anchor=T0, next_slot_at=T0)
    waits = [scheduler._guarded_round() for _ in range(ROLLED_BACK_ROUNDS + 1)]
    assert waits[:-1] == [0.0] * ROLLED_BACK_ROUNDS and waits[-1] > 0
    assert [m[HEADER_SLOT] for m in drain()] == [T0.isoformat()]
    assert caplog.text.count("rolled back for a concurrent transaction") == ROLLED_BACK_ROUNDS
    assert "claiming paused" not in caplog.text
    failures[0] = ROLLED_BACK_ROUNDS + 1  # after a round that went through: three more again
    waits = [scheduler._guarded_round() for _ in range(ROLLED_BACK_ROUNDS + 1)]
    assert waits[:-1] == [0.0] * ROLLED_BACK_ROUNDS and waits[-1] > 0
    assert caplog.text.count("claiming paused") == 1


@pytest.mark.django_db(transaction=True)
def test_a_step_of_the_authoritys_clock_is_followed_at_once(
    broker_app: Any, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """The time authority's clock steps 60 s forward (NTP on the database server, say); the
    beat's estimate, extrapolated since its last measurement, is 60 s behind. The round's
    reading shows it: the beat measures again and heartbeats before it judges who is dead, so
    its heartbeat is the new time and it publishes its own claims (its heartbeat stayed at the
    old time before; that a node never marks itself dead is the next test's)."""
    from celery_driftsafe.store.clock import AuthorityClock

    estimate = AuthorityClock(clock, samples=1, monotonic=clock.monotonic, wall=clock.now)
    sched = DriftSafeScheduler(
        app=broker_app, clock=estimate, authority=clock, install_signal_handlers=False
    )
    try:
        task = interval_task("add", 10, anchor=T0, next_slot_at=T0)
        sched.run_round()
        assert [m[HEADER_SLOT] for m in drain()] == [T0.isoformat()]
        clock.set(T0 + 60 * S)  # the step: the monotonic clock does not move
        sched.run_round()
        assert "the time authority's clock is +60.0 s from this beat's estimate" in caplog.text
        me = BeatNode.objects.get(node_id=sched.node_id)
        assert me.stopped_at is None and me.last_heartbeat_at == T0 + 60 * S
        assert "marked beat nodes dead" not in caplog.text
        assert "taken over by another node" not in caplog.text
        slots = {m[HEADER_SLOT] for m in drain()}
        assert (T0 + 60 * S).isoformat() in slots  # this beat published its own claims
        task.refresh_from_db()
        assert task.next_slot_at == T0 + 70 * S
    finally:
        sched.close()


@pytest.mark.django_db
def test_a_node_never_marks_itself_dead() -> None:
    """Judging the others by a reading its own heartbeat lags (a step, a slow round), a node
    is alive whatever its last heartbeat says: only the others are marked."""
    from celery_driftsafe.beat import nodes

    nodes.register("me", T0)
    nodes.register("peer", T0)
    assert nodes.mark_dead(T0 + 60 * S, timedelta(seconds=30), "me") == ["peer"]
    assert BeatNode.objects.get(node_id="me").stopped_at is None


@pytest.mark.django_db(transaction=True)
def test_the_beat_banner_names_the_node_that_registers_and_the_loop_s_interval(
    settings: Any, broker_app: Any, clock: FakeClock
) -> None:
    """``celery beat`` prints its banner from a lazy scheduler of its own, then makes the one
    that runs: the banner names that one's node, registers nothing itself, and shows the
    loop's real longest wait (Celery's ``beat_max_loop_interval``, here 2.5 s)."""
    from celery.apps.beat import Beat
    from celery.beat import Service

    broker_app.conf.beat_max_loop_interval = 2.5
    made = partial(DriftSafeScheduler, clock=clock, authority=clock, install_signal_handlers=False)
    service = Service(app=broker_app, scheduler_cls=made)
    banner = Beat(app=broker_app, no_color=True).startup_info(service)
    assert not BeatNode.objects.exists()
    running = service.scheduler
    try:
        assert list(BeatNode.objects.values_list("node_id", flat=True)) == [running.node_id]
        assert f"    . driftsafe node -> {running.node_id}\n" in banner
        assert "    . maxinterval -> 2.50 seconds (2.5s)" in banner
        assert running.max_interval == 2.5
        # The announced id is taken once: a later scheduler of this process is another node.
        other = made(app=broker_app)
        other.close()
        assert other.node_id != running.node_id
    finally:
        running.close()


def test_a_beat_says_while_its_redis_is_away_and_once_when_it_is_back(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """The change listener of a beat whose Redis does not answer logs it at ERROR, naming
    the Redis and what that stops, at once and again at the repeat interval (30 s; shortened
    here) while it lasts; when Redis answers again, one line says so."""
    import threading

    import redis

    from celery_driftsafe.beat import wakeup
    from celery_driftsafe.conf import get_settings
    from celery_driftsafe.testing.processes import free_port, start_redis

    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    settings = dataclasses.replace(get_settings(), redis_url=url)
    client = redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)
    monkeypatch.setattr(wakeup, "OUTAGE_REPEAT_SECONDS", 0.4)
    shutdown, wake = threading.Event(), wakeup.Wakeup()
    health = wakeup.RedisHealth()  # what the beat's heartbeat records on its node
    listener = threading.Thread(
        target=wakeup._listen, args=(client, settings, wake, shutdown, health)
    )
    server = None
    with caplog.at_level("WARNING", logger="celery_driftsafe.scheduler"):
        listener.start()
        try:
            wait_until(
                lambda: sum(r.action == "redis-unavailable" for r in caplog.records) >= 3,
                "three outage lines",
                timeout=20,
            )
            assert health.failing is not None and "Connection refused" in health.failing[1]
            server = start_redis(tmp_path / "redis", port=port)
            wait_until(
                lambda: any(r.action == "redis-restored" for r in caplog.records),
                "the line that Redis is back",
                timeout=30,
            )
        finally:
            shutdown.set()
            listener.join(10)
            client.close()
            if server is not None:
                server.stop()
    outage = [r for r in caplog.records if r.action == "redis-unavailable"]
    assert all(r.levelname == "ERROR" for r in outage)
    first = outage[0].getMessage()
    assert f"Redis at {url} does not answer" in first and "slots are still claimed" in first
    assert " for " in outage[-1].getMessage()  # the repeats say how long it has lasted
    restored = [r for r in caplog.records if r.action == "redis-restored"]
    assert len(restored) == 1 and "answers again" in restored[0].getMessage()
    assert health.failing is None
