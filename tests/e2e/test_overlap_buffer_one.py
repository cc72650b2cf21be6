"""End-to-end: overlap policy ``buffer_one`` with a real ``celery beat`` and real ``celery
worker`` processes (prefork, gevent, eventlet), real Redis and the real database: a task whose
body takes longer than its interval runs one body at a time, keeps at most one slot waiting,
and starts the waiting one as soon as the running one ends; a worker killed mid-body does not
lose the waiting slot."""

from __future__ import annotations

import itertools
import subprocess
import threading
import time
from collections import Counter
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from celery_driftsafe.testing.processes import start_redis
from tests import settings as test_settings
from tests.e2e.harness import OWN_REDIS_OPTIONS, E2ERun, real_now, restart_redis
from tests.skip_guard import configuration

pytestmark = pytest.mark.e2e
BACKEND = "postgresql" if test_settings.TEST_DB == "postgres" else "sqlite"


def _instant(text: str) -> datetime:
    return datetime.fromisoformat(text)


def _handed_on(runs: list[dict[str, Any]]) -> list[str]:
    """What the ledger's succeeded runs, in the order they started, say against "the waiting
    slot next": each after the first was taken back into the outbox by a worker (``claimed_by``
    ``worker:…``, not a beat's recovery after the lease) at or after the run before it finished
    (both instants written by that run's process). Ledger instants of two processes are not
    compared: each reads the authority's clock with an error of its own (half a round trip,
    tens of milliseconds on a loaded machine); the bodies' own record, one machine's clock,
    shows them one at a time, and runs seconds apart start in the ledger's order. (Not slot
    order: when two slots' deliveries meet, the later slot may start first and the earlier one
    wait for it.)"""
    ran = sorted((r for r in runs if r["status"] == "succeeded"), key=lambda r: r["started"])
    problems = []
    for before, after in itertools.pairwise(ran):
        if not after["claimed_by"].startswith("worker:"):
            problems.append(f"run {after['id']} was released by {after['claimed_by']!r}")
        elif not _instant(before["finished"]) <= _instant(after["claimed_at"]):
            problems.append(f"run {after['id']} was not released by run {before['id']}'s end")
    return problems


def _buffering(name: str, task: str, args: list[Any]) -> dict[str, Any]:
    """A 1-second task, overlap policy ``buffer_one``."""
    return {
        "name": name,
        "task": task,
        "args": args,
        "schedule_kind": "interval",
        "interval_every": 1,
        "interval_unit": "seconds",
        "overlap_policy": "buffer_one",
    }


class WaitingWatch:
    """Looks at the ledger every 0.2 s from a thread: the most runs of one task seen
    ``waiting`` at once, and how many looks saw one."""

    def __init__(self, run: E2ERun) -> None:
        self.run = run
        self.most = 0
        self.looks_waiting = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            runs = self.run.tool("dump")["runs"]
            waiting = Counter(r["task_id"] for r in runs if r["status"] == "waiting")
            if waiting:
                self.looks_waiting += 1
                self.most = max(self.most, *waiting.values())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


#: The green pools run on the PostgreSQL pass only: the worker's ledger statements are the same
#: whatever the pool, and the suite must stay short.
ON_POSTGRES = pytest.mark.skipif(
    BACKEND != "postgresql", reason=configuration("green pools run on the PostgreSQL pass")
)


@pytest.mark.parametrize(
    ("pool", "concurrency"),
    [
        ("prefork", 2),
        pytest.param("gevent", 4, marks=ON_POSTGRES),
        pytest.param("eventlet", 4, marks=ON_POSTGRES),
    ],
)
def test_real_beat_buffer_one_runs_one_at_a_time_and_the_waiting_slot_next(
    tmp_path: Path, pool: str, concurrency: int
) -> None:
    """A 1-second task whose body takes 3 s, on a worker of several slots (so slots'
    deliveries meet): no two bodies at once, never more than one run waiting, every body
    after the first is a run that waited, released by the end of the one before it (by its
    worker, not left to a beat) and started next, and every slot ends succeeded or skipped
    (none lost, none left waiting)."""
    run = E2ERun(BACKEND, tmp_path, lease=3.0, dead_after=3.0)
    watch: WaitingWatch | None = None
    try:
        worker = run.start_worker("w1", pool=pool, concurrency=concurrency)
        run.start_beat(0.0)
        run.wait_until_claiming()
        run.wait_ready(worker)
        start = real_now() + timedelta(seconds=1)
        run.seed([_buffering("buffered", "e2e.work", ["buffered", 3.0])], start)
        watch = WaitingWatch(run)
        time.sleep(max((start - real_now()).total_seconds(), 0) + 8)
        run.stop()
        runs = run.all_ended()
        watch.stop()
        bodies = sorted((e["began"], e["ended"]) for e in run.executions())
        statuses = Counter(r["status"] for r in runs)
        gaps = [began - ended for (_, ended), (began, _) in itertools.pairwise(bodies)]
        print(
            f"\n{pool}: {statuses}; bodies {len(bodies)}; gaps between bodies "
            f"{[round(g, 3) for g in gaps]}; most waiting at once {watch.most} "
            f"({watch.looks_waiting} looks saw one)"
        )
        assert set(statuses) <= {"succeeded", "skipped"}, runs
        assert statuses["succeeded"] == len(bodies) >= 3
        assert all(g >= 0 for g in gaps), f"two bodies overlap: {bodies}"
        # The ending body releases the waiting run, which starts next: the ledger's order of
        # finishes, releases and starts (a run left for a beat to publish after its lease
        # would be released by the beat).
        problems = _handed_on(runs)
        assert not problems, (problems, runs)
        assert watch.most == 1 and watch.looks_waiting > 0
        # The waiting slot runs next: every body but the first is a run that waited (the
        # running lock is handed to it), none a later slot that came as the running one ended.
        released = [r for r in runs if r["status"] == "succeeded" and r["attempts"] >= 2]
        assert len(released) == len(bodies) - 1, f"a run that never waited ran: {runs}"
        skipped = [r for r in runs if r["status"] == "skipped"]
        assert skipped and all("already waiting" in r["error"] for r in skipped), skipped
        assert "Traceback" not in run.logs()
    finally:
        if watch is not None:
            watch.stop()
        run.close()


def test_worker_killed_mid_body_with_a_slot_waiting_the_slot_still_runs_once(
    tmp_path: Path,
) -> None:
    """The worker running a body is killed (SIGKILL, the whole worker) while another slot
    waits: nobody is left to publish it but a beat, once the task's running lock and the dead
    run's lease have run out. Another worker runs it, exactly once."""

    run = E2ERun(BACKEND, tmp_path, lease=2.0, dead_after=3.0)
    try:
        first = run.start_worker("w1", pool="prefork", concurrency=2)
        run.start_beat(0.0)
        run.wait_until_claiming()
        run.wait_ready(first)
        # the ledger's reader starts before the first slot: started on the first look (a
        # process setting up Django, seconds on a loaded machine), it read a run "started"
        # when that body was nearly over, and the kill came after its end (a CI run's failure)
        run.tool("dump")
        run.seed([_buffering("killed", "e2e.slot_work", [4.0])], real_now())

        def one_waiting() -> tuple[dict[str, Any], dict[str, Any]] | None:
            runs = run.tool("dump")["runs"]
            started = [r for r in runs if r["status"] == "started"]
            waiting = [r for r in runs if r["status"] == "waiting"]
            return (started[0], waiting[0]) if started and waiting else None

        lost, waiting = run.wait_for(one_waiting, "a slot waiting beside a started one", timeout=30)
        children = subprocess.run(
            ["pgrep", "-P", str(first.process.pid)], capture_output=True, text=True, check=False
        ).stdout.split()
        run.kill(first)
        for child in children:
            subprocess.run(["kill", "-KILL", child], check=False)
        log_path = tmp_path / "executions.log"
        ended_before = log_path.read_text().splitlines() if log_path.exists() else []
        lost_slot = datetime.fromisoformat(lost["slot"])
        assert all(datetime.fromisoformat(line.split()[1]) != lost_slot for line in ended_before), (
            f"the body of run {lost['id']} ended before the kill: the test's reading came late"
        )
        # the beat goes on claiming slots for a moment, queued with no worker to take them:
        # when it publishes the waiting run again, behind them, they are dropped, and the
        # waiting one runs next (without that, the first of them started in its place)
        time.sleep(1.5)
        run.tool("update", {"name": "killed", "fields": {"enabled": False}})

        def waiting_run() -> dict[str, Any]:
            runs: list[dict[str, Any]] = run.tool("dump")["runs"]
            return next(r for r in runs if r["id"] == waiting["id"])

        # no worker is left: only the beat can publish it, once the lock and lease are over
        run.wait_for(
            lambda: waiting_run()["status"] == "dispatched", "a beat to publish it", timeout=20
        )
        published = waiting_run()
        assert not published["claimed_by"].startswith("worker:"), published
        run.wait_ready(run.start_worker("w2", pool="prefork", concurrency=2))
        run.wait_for(
            lambda: waiting_run()["status"] == "succeeded", "the waiting slot to run", timeout=40
        )
        run.stop()
        row = waiting_run()
        print(f"\nkilled run {lost['id']}; the slot waiting then: {row}")
        assert row["worker"].startswith("w2@")
        assert row["attempts"] >= 2  # published again after it waited
        log = log_path.read_text().splitlines()
        ran = Counter(datetime.fromisoformat(line.split()[1]) for line in log)
        assert ran[datetime.fromisoformat(row["slot"])] == 1, log
        assert ran[lost_slot] == 0, log  # killed before its end, never run again
        assert all(count == 1 for count in ran.values()), log
    finally:
        run.close()


@ON_POSTGRES
def test_buffer_one_through_a_redis_restart_keeps_one_body_at_a_time_and_strands_nothing(
    tmp_path: Path,
) -> None:
    """The Redis that holds the locks restarts (keeping nothing) while a ``buffer_one`` task
    runs back to back: the running lock, and a lock handed to a waiting run, are lost with it.
    The ledger still keeps the bodies one at a time (a run started under a lasting lease runs
    whatever the lock says), a released run whose handed lock is gone takes the lock as any
    run does, and the hand-over goes on after the restart; every slot ends succeeded or
    skipped, each body ran at most once, none is left waiting. The broker is RabbitMQ (the
    restart takes locks away, not queued messages)."""
    redis_dir = tmp_path / "redis"
    server = start_redis(redis_dir, options=OWN_REDIS_OPTIONS)
    run = E2ERun(
        BACKEND, tmp_path, lease=2.0, dead_after=3.0, broker="amqp", redis_server=server.url
    )
    try:
        worker = run.start_worker("w1", pool="prefork", concurrency=2)
        run.start_beat(0.0)
        run.wait_until_claiming()
        run.wait_ready(worker)
        start = real_now() + timedelta(seconds=1)
        # fire_all: a slot the beat reaches late (the machine loaded, a round held up by the
        # restart) still goes out, so that the overlap policy alone decides how each slot
        # ends; under fire_once a 1-second task a second behind records one slot missed
        buffered = _buffering("restarted", "e2e.slot_work", [1.5, True])
        run.seed([{**buffered, "misfire_policy": "fire_all"}], start)
        time.sleep(max((start - real_now()).total_seconds(), 0) + 5)
        restarted = time.time()
        server = restart_redis(server, redis_dir)
        time.sleep(7)
        run.stop()
        runs = run.all_ended()
    finally:
        run.close()
        server.stop()
    lines = [line.split() for line in (tmp_path / "executions.log").read_text().splitlines()]
    ran = Counter(slot for _, slot, *_ in lines)
    bodies = sorted((float(began), float(ended)) for *_, began, ended in lines)
    gaps = [began - ended for (_, ended), (began, _) in itertools.pairwise(bodies)]
    statuses = Counter(r["status"] for r in runs)
    after = [began for began, _ in bodies if began > restarted]
    slots_after = {
        datetime.fromisoformat(slot) for _, slot, _, began, _ in lines if float(began) > restarted
    }
    released_after = [
        r for r in runs if datetime.fromisoformat(r["slot"]) in slots_after and r["attempts"] >= 2
    ]
    print(
        f"\n{statuses}; bodies {len(bodies)} ({len(after)} after the restart, "
        f"{len(released_after)} of them runs that waited); gaps {[round(g, 3) for g in gaps]}"
    )
    assert set(statuses) <= {"succeeded", "skipped"}, runs
    assert all(count == 1 for count in ran.values()), ran
    assert statuses["succeeded"] == len(bodies), (statuses, bodies)
    assert all(g >= 0 for g in gaps), f"two bodies overlap: {bodies}"
    assert len(after) >= 3, f"the task did not go on after the restart: {bodies}"
    assert released_after, "no run waited and was handed the lock after the restart"
