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

The broker is RabbitMQ, so a Redis restart (Redis here keeps nothing on disk) takes locks,
notifications and fencing counters away, not queued messages. PostgreSQL only: its restart is
part of the test, so it runs only on a cluster of its own: ``DRIFTSAFE_TEST_PG_DATA`` names
its data folder, restarted with ``pg_ctl``, and ``DRIFTSAFE_TEST_POSTGRES_URL`` its server
(``tests/run.sh`` starts such a cluster and runs the test beside the other passes). Its Redis
is a ``redis-server`` of its own; RabbitMQ is ``DRIFTSAFE_TEST_RABBITMQ_URL``. Without them
the test fails, saying what is missing.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import time
from collections import Counter
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from celery_driftsafe.core.schedules import Interval
from celery_driftsafe.testing.processes import start_redis
from tests import settings as test_settings
from tests.e2e.harness import (
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
    rng = random.Random(20261129)
    log: list[str] = []
    #: (what, first instant it was down, instant it was back), on the servers' clock
    outages: list[tuple[str, datetime, datetime]] = []
    codes: list[int | None] = []
    try:
        workers = [run.start_worker("w1", pool="prefork"), run.start_worker("w2", pool="prefork")]
        alive: list[Any] = [run.start_beat(offset) for offset in offsets]
        run.wait_until_claiming()  # the slots below fall due while the beats claim
        start = real_now() + timedelta(seconds=3)
        run.seed(
            [
                {
                    "name": f"chaos-{i:02d}",
                    "task": "e2e.slot_work",
                    "args": [0.3],
                    "schedule_kind": "interval",
                    "interval_every": 2 + i % 2,
                    "interval_unit": "seconds",
                }
                for i in range(10)
            ],
            start,
        )
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
                for pid in [workers[0].process.pid, *_children(workers[0].process.pid)]:
                    os.kill(pid, signal.SIGSTOP)
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
        dump = run.tool("dump")
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
    executed = Counter(
        tuple(line.split()[:2]) for line in (tmp_path / "executions.log").read_text().splitlines()
    )
    schedules = {
        task["id"]: Interval(
            timedelta(seconds=task["every"]), datetime.fromisoformat(task["anchor"])
        )
        for task in dump["tasks"]
    }
    by_slot: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for row in dump["runs"]:
        by_slot.setdefault((row["task_id"], row["slot"]), []).append(row)
        if row["missed_until"]:  # one row for a span of missed slots: it stands for each
            first = datetime.fromisoformat(row["slot"])
            last = datetime.fromisoformat(row["missed_until"])
            covered = list(
                schedules[row["task_id"]].slots_between(first, last + timedelta(microseconds=1))
            )
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

    rows = ["task        due  outage  succeeded  missed  other  executed  doubled"]
    totals = Counter[str]()
    problems: list[str] = []
    for task in dump["tasks"]:
        due = list(schedules[task["id"]].slots_between(start, window_end))
        counts = Counter[str]()
        for slot in due:
            found = by_slot.get((task["id"], slot.isoformat()), [])
            ran = executed[(str(task["id"]), slot.isoformat())]
            status = found[0]["status"] if found else "none"
            counts["outage"] += down_from <= slot <= down_until
            counts[status if status in ("succeeded", "missed") else "other"] += 1
            counts["executed"] += ran
            counts["doubled"] += ran > 1
            where = f"{task['name']} {slot.isoformat()}"
            if len(found) != 1:
                problems.append(f"{where}: {len(found)} run rows")
            elif status == "succeeded" and ran != 1:
                problems.append(f"{where}: succeeded but executed {ran} times")
            elif status == "missed" and ran:
                problems.append(f"{where}: recorded missed but executed {ran} times")
            elif status == "missed" and not missable(slot, found[0]):
                problems.append(
                    f"{where}: recorded missed (claimed at {found[0]['claimed_at']}) outside the "
                    f"time no beat could claim {down_from.isoformat()}.."
                    f"{down_until.isoformat()}: "
                    f"{found[0]['error']}"
                )
            elif status not in ("succeeded", "missed"):
                problems.append(f"{where}: left {status} ({found[0]['error']})")
        totals.update(counts)
        totals["due"] += len(due)
        # at most the slots due between the restart's start and the bound on resuming
        totals["excusable"] += sum(down_from <= slot <= resume_by for slot in due)
        rows.append(
            f"{task['name']:<10}{len(due):>5}{counts['outage']:>8}{counts['succeeded']:>11}"
            f"{counts['missed']:>8}{counts['other']:>7}{counts['executed']:>10}"
            f"{counts['doubled']:>9}"
        )
    rows.append(
        f"{'all':<10}{totals['due']:>5}{totals['outage']:>8}{totals['succeeded']:>11}"
        f"{totals['missed']:>8}{totals['other']:>7}{totals['executed']:>10}"
        f"{totals['doubled']:>9}"
    )
    if any(code != 0 for code in codes):
        problems.append(f"beats' exit codes after SIGTERM: {codes} (None: did not exit)")
    print("\nchaos timeline:\n  " + "\n  ".join(log))
    print(
        "outages: "
        + ", ".join(f"{what} {down:%H:%M:%S.%f}-{back:%H:%M:%S.%f}" for what, down, back in outages)
        + f"; claiming resumed {resumed:%H:%M:%S.%f}, by {resume_by:%H:%M:%S.%f} at the latest"
    )
    print("\n".join(rows))
    assert totals["due"] > 150
    assert totals["missed"] <= totals["excusable"], (
        f"{totals['missed']} slots recorded missed; the restart and the resume allow "
        f"{totals['excusable']}"
    )
    assert not problems, "\n".join(problems[:40])
    # Most slots fell due with beats up: they ran, every one (the outage's slots aside).
    assert totals["succeeded"] >= totals["due"] - totals["outage"]


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False)
    return [int(p) for p in out.stdout.split()]
