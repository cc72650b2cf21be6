"""Chaos, end to end: three skewed beats and two workers for a minute while beats are
SIGKILLed and restarted every few seconds, a worker is SIGSTOPped past its lock lease, the
run's Redis restarts once and PostgreSQL restarts once. Afterwards every slot in the window
must have exactly one run row and have run at most once, and:

* a slot that fell due while every beat was down may be recorded missed (or fire once: what
  the misfire policy does after downtime). Every beat is down only while PostgreSQL restarts:
  no beat can claim then. A killed beat is one of three (the other two claim), and the Redis
  restart takes locks and wake-ups away, not the claims (the time authority is the
  database). So "down" is the PostgreSQL restart: from the instant the test began it
  (widened by ``CLAIM_SLACK`` before it: a slot due a moment before may not have been claimed
  yet) to the first claim the ledger records once it was back. The beats retry with a backoff,
  so claiming resumes a little after PostgreSQL is back: within the backoff a beat can have
  reached while PostgreSQL was away (:func:`reconnect_bound`), plus ``RESUME_SLACK``. That
  bound, not the time left before the beats stop, caps the slots excused: the run goes on
  ``AFTER_RESUME`` past it, and a slot due after it must have run. A missed slot's row must
  have been written after the restart began;
* every other slot ran exactly once (status succeeded, one execution): nothing else may be
  missed, whatever the misfire grace (30 s here; the restart lasts a few seconds, so under a
  policy that fires on-time slots late nothing is missed at all).

Every beat still running at the end stops with exit code 0 on SIGTERM.

The same run holds a task of each policy added since, beside the ten (``chaos-00`` to
``chaos-09``, ``e2e.slot_work`` with a 0.3 s body every 2 or 3 s); each prefork worker runs two
bodies at once, so that the long bodies below leave room for the ten:

* pause after failures: each of the ten is ``pause_after_failures=3`` under misfire policy
  ``fire_once``, and none is paused: at the end each is enabled, with no reason and
  ``consecutive_failures`` 0, and no run of theirs ended failed. Exact, not likely: no run of
  theirs fails (each slot succeeds or is missed, above; a run on the frozen worker is late, not
  lost, which a beat would declare only ``STUCK_RUN_SECONDS``, an hour, after its claim), and
  missed slots count only when the claim that records them fires no run of the task, which
  ``fire_once`` never does: a claim that finds slots missed fires the latest of them, or the
  slots on time;
* ``fails``: ``e2e.fail`` (it always raises) every 4 s from the start, ``pause_after_failures=2``,
  on a queue of its own that a solo worker serves, so its runs end one after the other and the
  order of their recorded ends is the order in which the count saw them. It is paused exactly
  once: at the end it is disabled, saying "paused after 2 failed or missed runs in a row
  (pause_after_failures=2), at T", with ``consecutive_failures`` 2, and one ``task_paused``
  signal (failures 2, that reason) was sent, by any process; every run of it ended failed, one
  per slot, its slots consecutive from its first; exactly 2 of them ended at or before T, the
  later one at T; and no run of it was claimed after T (its claim instant) nor is of a slot due
  after T, through all the chaos that follows (the kills and restarts of beats, the Redis
  restart, which takes the wake-ups away, and the PostgreSQL restart). Two ledger facts bound
  that exactness: a claim stamped after T would have to take the task's row in the
  milliseconds between the pausing worker reading its clock and its update, that is, a slot of
  the task falling due just as a run of it ends (its runs end a fraction of a second after
  their slots, 4 s before the next); and a run's claim instant is written again when a beat
  takes over a claim a killed beat had not published, which for this task could only be a
  claim made in the milliseconds before a kill (the first comes seconds after the pause);
* ``buffer-all``: a 2.4 s body every 3 s under overlap policy ``buffer_all`` (runs wait only
  when the chaos delays one). Every slot in the window has exactly one run row, which ended
  ``succeeded`` (executed once), ``missed`` by the rule above (not executed), or ``skipped``
  for the bound, saying so (not executed; never expected here, but the policy's own end); no
  run of the task is left waiting or under way once the workers drained (one ``claimed`` by
  a beat that was killed or stopped before it published it is left only for a slot after the
  window: no beat remains to publish it); no slot executed twice; no two bodies ran at once
  (each body's span is its begin and end, recorded by the body on this machine's clock);
* ``replace``: a 4.5 s body every 3 s under overlap policy ``replace``, so that each slot
  replaces the run before it: the revoke's SIGTERM cuts the body, which records "cut" as its
  pool process unwinds. Every slot in the window has exactly one run row, which ended
  ``succeeded`` (its body began and ended once), ``revoked`` with ``replaced_by`` naming a run
  of a later slot of the task (replaced while it ran) or with the reason "replaced before it
  started by the run of slot X", X a later slot of the task with a run (its body never began),
  ``skipped`` with one of replace's reasons (never began), or ``missed`` by the rule above
  (never began); nothing of the task is left waiting or under way, as for ``buffer-all``; no
  slot's body began twice; no two bodies ran at once, each body's span running from its begin
  to its end or its cut (its code ran no further), or, with neither recorded (its process
  killed outright), to its run's end in the ledger;
* ``calendar``: a per-second crontab (``* * * * * *``) on a calendar excluding every third
  second (``*/3 * * * * *``): no run row of it has an excluded slot, of any status (a missed
  span counts the slots it covers that are not excluded), and every other slot follows the rule
  of the ten.

Bodies overlap by their spans, with one exception, the frozen worker: a body that ran in one of
its pool processes across the instant it was stopped is frozen past its lease, and a task's
run counts as running only while its lease lasts (docs/howto/overlap-policies.md; the same
exception as at most once's), so a body of the task that began after the freeze began may
overlap it. Every other pair may not.

The broker is RabbitMQ, so a Redis restart (Redis here keeps nothing on disk) takes locks,
notifications and fencing counters away, not queued messages. PostgreSQL only: its restart is
part of the test, so it runs only on a cluster of its own: ``DRIFTSAFE_TEST_PG_DATA`` names
its data folder, restarted with ``pg_ctl``, and ``DRIFTSAFE_TEST_POSTGRES_URL`` its server
(``tests/run.sh`` starts such a cluster and runs the test beside the other passes). Its Redis
is a ``redis-server`` of its own; RabbitMQ is ``DRIFTSAFE_TEST_RABBITMQ_URL``. Without them
the test fails, saying what is missing.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from celery_driftsafe.core.schedules import Interval
from celery_driftsafe.testing.processes import start_redis
from tests import settings as test_settings
from tests.e2e.harness import (
    OPEN,
    OWN_REDIS_OPTIONS,
    E2ERun,
    real_now,
    restart_redis,
    wait_port,
    wait_until_handles_sigterm,
)
from tests.skip_guard import configuration

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.chaos,
    pytest.mark.skipif(
        test_settings.TEST_DB != "postgres", reason=configuration("restarts PostgreSQL")
    ),
]

#: MISFIRE_GRACE_SECONDS of the beats: a slot claimed later than this after it is missed.
GRACE = timedelta(seconds=30)
#: A slot due this long before the PostgreSQL restart began may still be waiting for its claim
#: when the restart begins (a beat claims a few milliseconds after the slot; the machine is
#: loaded): it may be caught in the outage too.
CLAIM_SLACK = timedelta(seconds=1)
#: The window's end before the beats are stopped: a slot due later may not have been claimed.
WINDOW_MARGIN = timedelta(seconds=3)
#: The beats' backoff through an outage (``DriftSafeScheduler._back_off`` in scheduler.py):
#: after each failed round a beat waits a random 50-100 % of a backoff that starts at 0.5 s and
#: doubles up to 30 s.
BACKOFF_FIRST, BACKOFF_CAP = 0.5, 30.0
#: Beyond the wait for its retry: the round that reconnects (a new connection, the clock
#: sample, the heartbeat, the claim) on two loaded cores.
RESUME_SLACK = timedelta(seconds=3)
#: How long the run goes on past the latest instant claiming may resume: slots due then must
#: all run, so a beat that never came back fails the run.
AFTER_RESUME = timedelta(seconds=6)
#: The data folder of the PostgreSQL cluster of the test's own (``DRIFTSAFE_TEST_POSTGRES_URL``
#: is that cluster), which it restarts; tests/run.sh starts it.
PG_DATA = os.environ.get("DRIFTSAFE_TEST_PG_DATA")

#: The ten plain tasks, each ``pause_after_failures`` 3, and the tasks of the other policies.
PLAIN = tuple(f"chaos-{i:02d}" for i in range(10))
PLAIN_PAUSE_AFTER = 3
BUFFERED, REPLACED, CALENDAR, FAILING = "buffer-all", "replace", "calendar", "fails"
#: ``buffer-all``: its interval, and its body a little shorter.
BUFFER_EVERY, BUFFER_BODY = 3, 2.4
#: ``replace``: its interval, and its body longer: each slot comes while the one before runs.
REPLACE_EVERY, REPLACE_BODY = 3, 4.5
#: ``fails``: its interval and its ``pause_after_failures``.
FAIL_EVERY, FAIL_PAUSE_AFTER = 4, 2
#: The reason of a ``buffer_all`` slot skipped for the bound.
BOUND = "the most that may wait (overlap policy 'buffer_all')"
#: How the reason of a ``replace`` run replaced while it waited begins (the slot follows).
REPLACED_WAITING = "revoked: replaced before it started by the run of slot "
REPLACED_RUNNING = "revoked: replaced by the run of slot "
#: Runs of a task under way (OPEN but ``claimed``, which is left when no beat remains to
#: publish a claim: see the module docstring).
UNDER_WAY = OPEN - {"claimed"}


def reconnect_bound(outage: timedelta) -> timedelta:
    """The longest a beat may still wait for its next try once PostgreSQL is back, after it
    was away for ``outage``: the backoff of the wait under way then. Each wait lasts at least
    half its backoff, so the waits before that one, at least half of each, fit in the
    outage."""
    backoff, elapsed = BACKOFF_FIRST, 0.0
    while elapsed + backoff / 2 <= outage.total_seconds():
        elapsed += backoff / 2
        backoff = min(backoff * 2, BACKOFF_CAP)
    return timedelta(seconds=backoff)


def restart_postgresql(data: str) -> None:
    command = [_pg_ctl(), "-D", data, "-l", f"{data}.log", "-m", "fast", "-w", "restart"]
    owner = Path(data).owner()
    if os.geteuid() == 0 and owner != "root":
        command = ["runuser", "-u", owner, "--", *command]
    subprocess.run(command, check=True, timeout=120, capture_output=True)
    wait_port(int(test_settings.postgres_server()["PORT"]))


def _pg_ctl() -> str:
    found = shutil.which("pg_ctl") or sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"))
    if not found:
        pytest.fail("pg_ctl is not found: apt-get install postgresql")
    return str(found if isinstance(found, str) else found[-1])


def _specs(fail_queue: str) -> list[dict[str, Any]]:
    """The tasks of the run (see the module docstring); ``fails`` on ``fail_queue``."""
    every: dict[str, Any] = {
        "schedule_kind": "interval",
        "interval_unit": "seconds",
        "misfire_policy": "fire_once",
    }
    plain = [
        {
            **every,
            "name": name,
            "task": "e2e.slot_work",
            "args": [0.3],
            "interval_every": 2 + i % 2,
            "pause_after_failures": PLAIN_PAUSE_AFTER,
        }
        for i, name in enumerate(PLAIN)
    ]
    return [
        *plain,
        {
            **every,
            "name": BUFFERED,
            "task": "e2e.slot_work",
            "args": [BUFFER_BODY, True],  # timed: its body's begin and end
            "interval_every": BUFFER_EVERY,
            "overlap_policy": "buffer_all",
        },
        {
            **every,
            "name": REPLACED,
            "task": "e2e.slot_phases",
            "args": [REPLACE_BODY, False, True],  # a cut body unwinds, and says so
            "interval_every": REPLACE_EVERY,
            "overlap_policy": "replace",
        },
        {
            "name": CALENDAR,
            "task": "e2e.slot_work",
            "schedule_kind": "crontab",
            "crontab_second": "*",
            "crontab_minute": "*",
            "calendars": ["thirds"],
            "misfire_policy": "fire_once",
        },
        {
            **every,
            "name": FAILING,
            "task": "e2e.fail",
            "args": [FAILING],
            "interval_every": FAIL_EVERY,
            "queue": fail_queue,
            "pause_after_failures": FAIL_PAUSE_AFTER,
        },
    ]


def _excluded(slot: datetime) -> bool:
    """Whether the ``thirds`` calendar excludes ``slot``."""
    return slot.second % 3 == 0


def _slots(task: dict[str, Any]) -> Callable[[datetime, datetime], list[datetime]]:
    """The task's slots ``s`` with ``first <= s < end``: its interval's, or for ``calendar``
    every whole second the calendar does not exclude (worked out here, not by the package)."""
    if task["kind"] == "interval":
        schedule = Interval(
            timedelta(seconds=task["every"]), datetime.fromisoformat(task["anchor"])
        )
        return lambda first, end: list(schedule.slots_between(first, end))
    assert task["name"] == CALENDAR, task

    def seconds(first: datetime, end: datetime) -> list[datetime]:
        slot = first.replace(microsecond=0)
        slot += timedelta(seconds=slot < first)
        found = []
        while slot < end:
            if not _excluded(slot):
                found.append(slot)
            slot += timedelta(seconds=1)
        return found

    return seconds


@dataclass(frozen=True)
class Freeze:
    """The prefork worker stopped past its lease: its pool processes, and the instants just
    before and just after they were sent SIGSTOP (this machine's clock, as the bodies')."""

    pids: frozenset[int] = frozenset()
    since: float = 0.0
    until: float = 0.0

    def froze(self, body: Body) -> bool:
        """Whether ``body`` ran in a stopped pool process across the stop."""
        return body.pid in self.pids and body.began < self.until and body.ended > self.since


@dataclass(frozen=True)
class Body:
    """One body of a task, as it recorded itself: when it began and when it ran no further
    (its end, or its cut), on this machine's clock."""

    slot: str
    pid: int
    began: float
    ended: float
    how: str


@dataclass
class Record:
    """What the bodies wrote to the run's executions log."""

    #: (periodic task id, slot) -> bodies that ran to their end (``e2e.slot_work``) or began
    #: (``e2e.slot_phases``)
    executed: Counter[tuple[str, str]] = field(default_factory=Counter)
    #: periodic task id -> the bodies that recorded when they began and ended
    bodies: dict[str, list[Body]] = field(default_factory=dict)
    #: ``e2e.slot_phases`` bodies: (periodic task id, slot, pid) -> phase -> instants
    phases: dict[tuple[str, str, int], dict[str, list[float]]] = field(default_factory=dict)


def _read(log: Path) -> Record:
    record = Record()
    for line in log.read_text().splitlines():
        fields = line.split()
        if fields[0] in ("begin", "end", "cut"):  # e2e.slot_phases
            phase, task_id, slot, pid, at = fields
            slot = datetime.fromisoformat(slot).isoformat()
            phases = record.phases.setdefault((task_id, slot, int(pid)), {})
            phases.setdefault(phase, []).append(float(at))
            record.executed[(task_id, slot)] += phase == "begin"
            continue
        task_id, slot, pid, *times = fields  # e2e.slot_work
        slot = datetime.fromisoformat(slot).isoformat()
        record.executed[(task_id, slot)] += 1
        if times:
            began, ended = map(float, times)
            record.bodies.setdefault(task_id, []).append(Body(slot, int(pid), began, ended, "end"))
    return record


def _phased_bodies(
    record: Record, task_id: str, runs: dict[str, dict[str, Any]]
) -> tuple[list[Body], list[str]]:
    """The task's ``e2e.slot_phases`` bodies, each to its end or its cut, or, with neither,
    to its run's end in the ledger (``runs``: by slot); and what is wrong with their record."""
    bodies, problems = [], []
    for (owner, slot, pid), phases in sorted(record.phases.items()):
        if owner != task_id:
            continue
        began, ends, cuts = phases.get("begin", []), phases.get("end", []), phases.get("cut", [])
        if len(began) != 1 or len(ends) + len(cuts) > 1:
            problems.append(f"{slot} in process {pid}: recorded {phases}")
            continue
        if ends or cuts:
            bodies.append(Body(slot, pid, began[0], (ends or cuts)[0], "end" if ends else "cut"))
            continue
        finished = runs.get(slot, {}).get("finished")
        ended = datetime.fromisoformat(finished).timestamp() if finished else float("inf")
        bodies.append(Body(slot, pid, began[0], ended, "ledger"))
    return bodies, problems


def _overlaps(bodies: list[Body], freeze: Freeze) -> tuple[list[str], list[str]]:
    """The pairs of ``bodies`` that ran at once against the rule, and those the freeze excuses
    (see the module docstring)."""
    problems, excused = [], []
    ordered = sorted(bodies, key=lambda body: body.began)
    for i, first in enumerate(ordered):
        for second in ordered[i + 1 :]:
            if second.began >= first.ended:
                continue
            pair = (
                f"slot {first.slot} ({first.how} {first.ended - first.began:.2f} s after its "
                f"begin, process {first.pid}) and slot {second.slot} (began "
                f"{second.began - first.began:.2f} s after it, process {second.pid})"
            )
            if (freeze.froze(first) and second.began >= freeze.since) or (
                freeze.froze(second) and first.began >= freeze.since
            ):
                excused.append(pair)
            else:
                problems.append(f"bodies at once: {pair}")
    return problems, excused


def _named_slot(error: str, prefix: str) -> str | None:
    """The slot a ``replace`` reason starting with ``prefix`` names (None: it does not start so)."""
    if not error.startswith(prefix):
        return None
    return datetime.fromisoformat(error[len(prefix) :].split(" ", 1)[0]).isoformat()


def _replace_end(
    row: dict[str, Any], began: int, ended: int, runs: dict[int, dict[str, Any]]
) -> str | None:
    """What is wrong with how a run of ``replace`` ended (not missed) whose body began
    ``began`` times and ran to its end ``ended`` times (None: nothing)."""
    status, error = row["status"], row["error"] or ""
    if status == "succeeded":
        return None if began == ended == 1 else f"succeeded, began {began}, ended {ended} times"
    if status == "revoked" and row["replaced_by"] is not None:
        other = runs.get(row["replaced_by"])
        if other is None or other["task_id"] != row["task_id"]:
            return f"revoked, replaced by run {row['replaced_by']}, no run of the task"
        if not datetime.fromisoformat(other["slot"]) > datetime.fromisoformat(row["slot"]):
            return f"revoked, replaced by run {other['id']} of slot {other['slot']}, no later"
        if _named_slot(error, REPLACED_RUNNING) != other["slot"]:
            return f"revoked, replaced by run {other['id']} of slot {other['slot']}: {error}"
        return None
    if status == "revoked":
        named = _named_slot(error, REPLACED_WAITING)
        slots = {r["slot"] for r in runs.values() if r["task_id"] == row["task_id"]}
        if (
            named is None
            or named not in slots
            or datetime.fromisoformat(named) <= datetime.fromisoformat(row["slot"])
        ):
            return f"revoked before it started, but by no later slot's run: {error}"
        return f"revoked before it started, yet its body began {began} times" if began else None
    if status == "skipped":
        if not (error.startswith("skipped: ") and error.endswith("(overlap policy 'replace')")):
            return f"skipped, not for replace: {error}"
        return f"skipped, yet its body began {began} times" if began else None
    return f"left {status} ({error})"


@pytest.fixture(autouse=True)
def _runs_alone() -> None:
    """Its PostgreSQL restart would break other tests on PostgreSQL: never next to other
    workers of a pass."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or "1")
    if workers > 1:
        pytest.fail(
            f"the chaos test restarts PostgreSQL under the other {workers - 1} "
            "test workers: run it on its own (pytest -m chaos, as tests/run.sh does "
            "beside the other passes), and the rest with -m 'not chaos'"
        )


@pytest.fixture
def pg_data() -> str:
    """The cluster the test restarts: its own, never one it was not given."""
    if not PG_DATA:
        pytest.fail(
            "the chaos test restarts PostgreSQL, so it runs only on a cluster of its own: "
            "DRIFTSAFE_TEST_PG_DATA names its data folder and DRIFTSAFE_TEST_POSTGRES_URL its "
            "server (tests/run.sh starts one: bash tests/run.sh -m chaos)"
        )
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not on PATH: apt-get install redis-server")
    if test_settings.RABBITMQ_URL is None:
        pytest.fail(test_settings.RABBITMQ_MISSING)
    return PG_DATA


def test_chaos_loses_nothing_and_doubles_nothing(tmp_path: Path, pg_data: str) -> None:
    offsets = [0.0, 2.5, -4.0]
    redis_dir = tmp_path / "redis"
    server = start_redis(redis_dir, options=OWN_REDIS_OPTIONS)
    run = E2ERun("postgresql", tmp_path, lease=3.0, broker="amqp", redis_server=server.url)
    run.env["DRIFTSAFE_E2E_MISFIRE_GRACE"] = str(GRACE.total_seconds())
    signals = tmp_path / "signals.jsonl"  # task_paused, heard in whichever process sent it
    run.env["DRIFTSAFE_E2E_SIGNALS"] = str(signals)
    fail_queue = f"{run.queue}-fails"
    rng = random.Random(20261129)
    log: list[str] = []
    #: (what, first instant it was down, instant it was back), on the servers' clock
    outages: list[tuple[str, datetime, datetime]] = []
    codes: list[int | None] = []
    freeze = Freeze()
    try:
        workers = [
            run.start_worker("w1", pool="prefork", concurrency=2),
            run.start_worker("w2", pool="prefork", concurrency=2),
        ]
        run.start_worker("fails", pool="solo", queue=fail_queue)
        alive: list[Any] = [run.start_beat(offset) for offset in offsets]
        run.tool("calendars", [{"name": "thirds", "crontab": "*/3 * * * * *"}])
        run.wait_until_claiming()  # the slots below fall due while the beats claim
        start = real_now() + timedelta(seconds=3)
        run.seed(_specs(fail_queue), start)
        time.sleep(max((start - real_now()).total_seconds(), 0) + 3)
        began = time.monotonic()

        def at(second: float) -> None:
            time.sleep(max(0.0, began + second - time.monotonic()))

        plan = [(t, "kill-beat") for t in range(4, 60, 5)]
        plan += [(12, "stop-worker"), (20, "cont-worker"), (26, "redis"), (42, "postgresql")]
        for second, action in sorted(plan):
            at(second)
            if action == "kill-beat":
                index = rng.randrange(len(alive))
                victim = alive[index]
                run.kill(victim)
                time.sleep(1.0)
                alive[index] = run.start_beat(victim.offset)
            elif action == "stop-worker":
                pool = _children(workers[0].process.pid)
                since = real_now().timestamp()
                for pid in [workers[0].process.pid, *pool]:
                    os.kill(pid, signal.SIGSTOP)
                freeze = Freeze(frozenset(pool), since, real_now().timestamp())
            elif action == "cont-worker":
                for pid in [workers[0].process.pid, *_children(workers[0].process.pid)]:
                    os.kill(pid, signal.SIGCONT)
            elif action == "redis":
                down = real_now()
                server = restart_redis(server, redis_dir)
                outages.append((action, down, real_now()))
            elif action == "postgresql":
                down = real_now()
                restart_postgresql(pg_data)
                outages.append((action, down, real_now()))
            log.append(f"{time.monotonic() - began:5.1f}s {action}")
        (pg_down, pg_back) = next((d, b) for what, d, b in outages if what == "postgresql")
        # Claiming resumes by this instant; the run goes on well past it (a slow restart
        # makes the run longer), so that the slots due after it show it did.
        resume_by = pg_back + reconnect_bound(pg_back - pg_down) + RESUME_SLACK
        at(62)
        time.sleep(max((resume_by + AFTER_RESUME + WINDOW_MARGIN - real_now()).total_seconds(), 0))
        stopped_at = real_now()
        for beat in alive:
            # A beat restarted a moment ago may still be starting Python: a SIGTERM before it
            # has any handler ends it by the default action (see handles_sigterm).
            wait_until_handles_sigterm(beat.process)
            beat.process.send_signal(signal.SIGTERM)
        for beat in alive:
            try:
                codes.append(beat.process.wait(timeout=90))
            except subprocess.TimeoutExpired:
                codes.append(None)
        time.sleep(12)  # workers drain what is queued, re-sent or redelivered

        busy: list[dict[str, Any]] = []

        def drained() -> dict[str, Any] | None:
            """The ledger, once no run of the overlap tasks is under way (their waiting runs
            are published by the workers, which need no beat)."""
            dump: dict[str, Any] = run.tool("dump")
            ids = {t["id"]: t["name"] for t in dump["tasks"] if t["name"] in (BUFFERED, REPLACED)}
            busy[:] = [
                {"task": ids[r["task_id"]], **r}
                for r in dump["runs"]
                if r["task_id"] in ids and r["status"] in UNDER_WAY
            ]
            return None if busy else dump

        def still_under_way() -> str:
            """The runs under way at the last look, and every run of their tasks."""
            tasks = {r["task_id"] for r in busy}
            ledger = sorted(
                (r for r in run.tool("dump")["runs"] if r["task_id"] in tasks),
                key=lambda r: (r["task_id"], r["slot"], r["id"]),
            )
            return "\n".join(
                ["runs under way:", *map(str, busy), "every run of their tasks:", *map(str, ledger)]
            )

        dump = run.wait_for(
            drained, "the overlap tasks' runs to end", timeout=60, seen=still_under_way
        )
        assert dump is not None  # (what the condition gave once it held)
    finally:
        run.close()
        server.stop()

    window_end = stopped_at - WINDOW_MARGIN
    # No beat claimed from the restart's start until the first claim once PostgreSQL was back
    # (the ledger's own record of when claiming resumed), made before the beats were stopped.
    claims_after = sorted(
        claimed
        for row in dump["runs"]
        if row["claimed_at"]
        and pg_back <= (claimed := datetime.fromisoformat(row["claimed_at"])) < stopped_at
    )
    assert claims_after, (
        f"claiming never resumed after the PostgreSQL restart ({pg_back:%H:%M:%S.%f} back, "
        f"beats stopped {stopped_at:%H:%M:%S.%f})"
    )
    resumed = claims_after[0]
    assert resumed <= resume_by, (
        f"claiming resumed {(resumed - pg_back).total_seconds():.1f} s after PostgreSQL was "
        f"back; the beats' backoff allows {(resume_by - pg_back).total_seconds():.1f} s"
    )
    assert window_end - resume_by >= AFTER_RESUME, "the run ended too soon after the restart"
    down_from, down_until = pg_down - CLAIM_SLACK, resumed
    record = _read(tmp_path / "executions.log")
    tasks = {task["name"]: task for task in dump["tasks"]}
    slots = {task["id"]: _slots(task) for task in dump["tasks"]}
    runs_by_id = {row["id"]: row for row in dump["runs"]}
    by_slot: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for row in dump["runs"]:
        by_slot.setdefault((row["task_id"], row["slot"]), []).append(row)
        if row["missed_until"]:  # one row for a span of missed slots: it stands for each
            first = datetime.fromisoformat(row["slot"])
            last = datetime.fromisoformat(row["missed_until"])
            covered = slots[row["task_id"]](first, last + timedelta(microseconds=1))
            assert len(covered) == row["missed_count"], row
            for slot in covered[1:]:
                by_slot.setdefault((row["task_id"], slot.isoformat()), []).append(
                    {**row, "slot": slot.isoformat()}
                )

    def missable(slot: datetime, row: dict[str, Any]) -> bool:
        """Due while every beat was down (the PostgreSQL restart), and recorded after it
        began: the only slots that may be recorded missed."""
        claimed = datetime.fromisoformat(row["claimed_at"]) if row["claimed_at"] else None
        in_outage = down_from <= slot <= down_until
        return in_outage and (claimed is None or claimed >= pg_down)

    rows = ["task           due  outage  succeeded  missed  other  executed  doubled"]
    totals = Counter[str]()  # of the tasks under the rule alone: the ten and calendar
    missed = excusable = 0  # of every task but fails
    problems: list[str] = []
    for name in (*PLAIN, CALENDAR, BUFFERED, REPLACED):
        task = tasks[name]
        task_id = str(task["id"])
        mine = {row["slot"]: row for row in dump["runs"] if row["task_id"] == task["id"]}
        due = slots[task["id"]](start, window_end)
        counts = Counter[str]()
        for slot in due:
            found = by_slot.get((task["id"], slot.isoformat()), [])
            ran = record.executed[(task_id, slot.isoformat())]
            status = found[0]["status"] if found else "none"
            counts["outage"] += down_from <= slot <= down_until
            counts[status if status in ("succeeded", "missed") else "other"] += 1
            counts["executed"] += ran
            counts["doubled"] += ran > 1
            where = f"{name} {slot.isoformat()}"
            if len(found) != 1:
                problems.append(f"{where}: {len(found)} run rows")
            elif status == "missed" and ran:
                problems.append(f"{where}: recorded missed but executed {ran} times")
            elif status == "missed" and not missable(slot, found[0]):
                problems.append(
                    f"{where}: recorded missed (claimed at {found[0]['claimed_at']}) outside the "
                    f"time no beat could claim {down_from.isoformat()}.."
                    f"{down_until.isoformat()}: "
                    f"{found[0]['error']}"
                )
            elif status == "missed":
                pass
            elif name == REPLACED:
                ended = sum(
                    len(phases.get("end", []))
                    for (owner, at, _), phases in record.phases.items()
                    if (owner, at) == (task_id, slot.isoformat())
                )
                wrong = _replace_end(found[0], ran, ended, runs_by_id)
                if wrong:
                    problems.append(f"{where}: {wrong}")
            elif status == "succeeded" and ran != 1:
                problems.append(f"{where}: succeeded but executed {ran} times")
            elif name == BUFFERED and status == "skipped":
                if BOUND not in (found[0]["error"] or "") or ran:
                    problems.append(f"{where}: skipped, executed {ran} times: {found[0]['error']}")
            elif status != "succeeded":
                problems.append(f"{where}: left {status} ({found[0]['error']})")
        if name in (*PLAIN, CALENDAR):  # the rule alone: each slot succeeded or missed
            totals.update(counts)
            totals["due"] += len(due)
        missed += counts["missed"]
        # at most the slots due between the restart's start and the bound on resuming
        excusable += sum(down_from <= slot <= resume_by for slot in due)
        rows.append(
            f"{name:<13}{len(due):>5}{counts['outage']:>8}{counts['succeeded']:>11}"
            f"{counts['missed']:>8}{counts['other']:>7}{counts['executed']:>10}"
            f"{counts['doubled']:>9}"
        )
        # beyond the window too: no slot executed twice, nothing of the overlap tasks under
        # way, and nothing left claimed within the window
        problems += [
            f"{name} {slot}: executed {count} times"
            for (owner, slot), count in record.executed.items()
            if owner == task_id and count > 1
        ]
        if name in (BUFFERED, REPLACED):
            problems += [
                f"{name} {slot}: left {row['status']} ({row['error']})"
                for slot, row in mine.items()
                if row["status"] in OPEN
                and (row["status"] != "claimed" or datetime.fromisoformat(slot) <= window_end)
            ]
    rows.append(
        f"{'plain':<13}{totals['due']:>5}{totals['outage']:>8}{totals['succeeded']:>11}"
        f"{totals['missed']:>8}{totals['other']:>7}{totals['executed']:>10}"
        f"{totals['doubled']:>9}"
    )

    # buffer_all and replace: no two bodies of the task at once (the freeze aside)
    excused: list[str] = []
    for name in (BUFFERED, REPLACED):
        task_id = str(tasks[name]["id"])
        if name == BUFFERED:
            bodies = record.bodies.get(task_id, [])
        else:
            mine = {r["slot"]: r for r in dump["runs"] if r["task_id"] == tasks[name]["id"]}
            bodies, unclear = _phased_bodies(record, task_id, mine)
            problems += [f"{name} {what}" for what in unclear]
        assert len(bodies) >= 5, f"{name}: {len(bodies)} bodies recorded"
        overlapping, freed = _overlaps(bodies, freeze)
        problems += [f"{name}: {what}" for what in overlapping]
        excused += [f"{name}: {what}" for what in freed]
        ends = Counter(
            f"{r['status']}{' (replaced running)' if r['replaced_by'] else ''}"
            for r in dump["runs"]
            if r["task_id"] == tasks[name]["id"]
        )
        print(f"{name}: runs {dict(ends)}; bodies {dict(Counter(b.how for b in bodies))}")

    # calendar: no row of an excluded slot (a missed span's slots are the ones not excluded)
    problems += [
        f"{CALENDAR} {row['slot']}: a run row ({row['status']}) of an excluded slot"
        for row in dump["runs"]
        if row["task_id"] == tasks[CALENDAR]["id"]
        and _excluded(datetime.fromisoformat(row["slot"]))
    ]

    # pause after failures: none of the ten paused or counting
    for name in PLAIN:
        task = tasks[name]
        if not task["enabled"] or task["disabled_reason"] or task["consecutive_failures"]:
            problems.append(
                f"{name}: enabled {task['enabled']}, {task['consecutive_failures']} failures "
                f"counted ({task['disabled_reason']})"
            )
        problems += [
            f"{name} {row['slot']}: failed ({row['error']})"
            for row in dump["runs"]
            if row["task_id"] == task["id"] and row["status"] == "failed"
        ]
    pauses = [
        line
        for line in map(json.loads, signals.read_text().splitlines() if signals.exists() else [])
        if line["signal"] == "paused"
    ]
    problems += [f"{line['task']}: paused ({line})" for line in pauses if line["task"] != FAILING]

    if any(code != 0 for code in codes):
        problems.append(f"beats' exit codes after SIGTERM: {codes} (None: did not exit)")
    print("\nchaos timeline:\n  " + "\n  ".join(log))
    print(
        "outages: "
        + ", ".join(f"{what} {down:%H:%M:%S.%f}-{back:%H:%M:%S.%f}" for what, down, back in outages)
        + f"; claiming resumed {resumed:%H:%M:%S.%f}, by {resume_by:%H:%M:%S.%f} at the latest"
    )
    print("\n".join(rows))
    print("bodies at once, excused by the freeze:", *excused or ["none"], sep="\n  ")
    assert totals["due"] > 150
    assert missed <= excusable, (
        f"{missed} slots recorded missed; the restart and the resume allow {excusable}\n"
        + "\n".join(problems[:40])
    )
    assert not problems, "\n".join(problems[:40])
    # Most slots fell due with beats up: they ran, every one (the outage's slots aside).
    assert totals["succeeded"] >= totals["due"] - totals["outage"]
    _assert_paused_once(tasks[FAILING], dump["runs"], pauses, start)


def _assert_paused_once(
    task: dict[str, Any],
    all_runs: list[dict[str, Any]],
    pauses: list[dict[str, Any]],
    start: datetime,
) -> None:
    """``fails`` was paused once, after exactly its first two failures, and never claimed
    again (see the module docstring)."""
    runs = sorted((r for r in all_runs if r["task_id"] == task["id"]), key=lambda r: r["slot"])
    assert len(runs) >= FAIL_PAUSE_AFTER, (task, runs)
    prefix = (
        f"disabled by the scheduler: paused after {FAIL_PAUSE_AFTER} failed or missed runs in a "
        f"row (pause_after_failures={FAIL_PAUSE_AFTER}), at "
    )
    reason = task["disabled_reason"] or ""
    assert not task["enabled"] and reason.startswith(prefix), (task, runs)
    assert task["consecutive_failures"] == FAIL_PAUSE_AFTER, (task, runs)
    paused_at = datetime.fromisoformat(reason.removeprefix(prefix))
    heard = [line for line in pauses if line["task"] == FAILING]
    assert len(heard) == 1, heard
    assert heard[0]["failures"] == FAIL_PAUSE_AFTER and heard[0]["reason"] == reason, heard
    assert heard[0]["enabled"] is False, heard
    # every run failed, one a slot, the slots consecutive from the task's first
    assert {r["status"] for r in runs} == {"failed"}, runs
    schedule = Interval(timedelta(seconds=task["every"]), datetime.fromisoformat(task["anchor"]))
    slots = [datetime.fromisoformat(r["slot"]) for r in runs]
    first = schedule.first_at_or_after(start)
    assert first is not None
    assert slots == list(schedule.slots_between(first, slots[-1] + timedelta(microseconds=1))), runs
    # exactly two ended by the pause, the later one at its instant; none claimed after it
    finished = sorted(datetime.fromisoformat(r["finished"]) for r in runs)
    assert [at for at in finished if at <= paused_at] == finished[:FAIL_PAUSE_AFTER], runs
    assert finished[FAIL_PAUSE_AFTER - 1] == paused_at, (paused_at, runs)
    late = [
        r
        for r in runs
        if max(datetime.fromisoformat(r["claimed_at"]), datetime.fromisoformat(r["slot"]))
        > paused_at
    ]
    assert not late, (paused_at, late)
    print(f"{FAILING}: {len(runs)} runs, paused at {paused_at:%H:%M:%S.%f}")


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False)
    return [int(p) for p in out.stdout.split()]
