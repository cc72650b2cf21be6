"""End-to-end: overlap policy ``replace`` with two real ``celery beat`` processes (clocks 0.7 s
apart) and four real ``celery worker`` processes side by side, a prefork one, a gevent one, an
eventlet one and a threads one, each on a queue of its own with a task of its own: a 2-second
task whose body takes far longer. On prefork each slot's run replaces the previous one, whose
body is terminated (its pool process killed outright, so the worker's main process hands the
task on); on gevent and eventlet the revoke kills the body's greenlet, which unwinds and hands
the task on itself; on threads, which cannot terminate a body, the next run waits for the
running body to end. Every fact is read from the ledger and from the lines the bodies write."""

from __future__ import annotations

import itertools
import time
from collections import defaultdict
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from tests import settings as test_settings
from tests.e2e.harness import E2ERun, real_now
from tests.skip_guard import configuration

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        test_settings.TEST_DB != "postgres",
        reason=configuration("the replace end-to-end test runs on the PostgreSQL pass"),
    ),
]

INTERVAL = 2
#: Slots of each task.
SLOTS = 3
#: The prefork task's body: two and a half intervals (it runs to its end only the last time).
PREFORK_BODY = 5.0
#: The threads task's body: longer than the interval, short enough to run to its end.
THREADS_BODY = 3.0
#: The pools whose revoke kills the body's greenlet: it unwinds (and says so), handing the
#: lock on itself.
GREEN_POOLS = ("gevent", "eventlet")
#: Each worker's pool -> its task's name and ``e2e.slot_phases`` arguments. On prefork the
#: body's process is killed outright by the revoke: its delivery cannot hand the lock on, the
#: worker's main process does.
TASKS: dict[str, tuple[str, list[Any]]] = {
    "prefork": ("cut", [PREFORK_BODY, True]),
    "threads": ("waits", [THREADS_BODY]),
    "gevent": ("greenlet", [PREFORK_BODY, False, True]),
    "eventlet": ("eventlet-greenlet", [PREFORK_BODY, False, True]),
}


def _replacing(name: str, args: list[Any], queue: str) -> dict[str, Any]:
    """A 2-second task under ``replace`` on ``queue`` (``e2e.slot_phases(*args)``), for
    :data:`SLOTS` slots."""
    return {
        "max_runs": SLOTS,
        "name": name,
        "task": "e2e.slot_phases",
        "args": args,
        "queue": queue,
        "schedule_kind": "interval",
        "interval_every": INTERVAL,
        "interval_unit": "seconds",
        "overlap_policy": "replace",
        # a slot a beat reaches late still goes out: the overlap policy alone decides
        "misfire_policy": "fire_all",
    }


def _bodies(log: Path) -> dict[tuple[int, str], dict[str, list[float]]]:
    """(periodic task id, slot) -> {"begin": [times], "end": [times], "cut": [times], "alive":
    [times]} from the bodies' lines ("cut": the body was cut short as it unwound; "alive": a
    later body began while this one's process still ran)."""
    bodies: dict[tuple[int, str], dict[str, list[float]]] = defaultdict(_no_lines)
    for line in log.read_text().splitlines():
        phase, task_id, slot, _pid, at = line.split()
        key = (int(task_id), datetime.fromisoformat(slot).isoformat())
        bodies[key][phase].append(float(at))
    return bodies


def _no_lines() -> dict[str, list[float]]:
    return {"begin": [], "end": [], "cut": [], "alive": []}


def _slot_named(error: str) -> str:
    """The slot a revoked run's reason names as its replacement's."""
    return error.split("the run of slot ", 1)[1].split(" ", 1)[0]


def test_real_beats_replace_terminates_on_prefork_and_green_pools_and_waits_on_threads(
    tmp_path: Path,
) -> None:
    run = E2ERun("postgresql", tmp_path, lease=10.0, dead_after=3.0)
    queues = {pool: run.queue if pool == "prefork" else f"{run.queue}-{pool}" for pool in TASKS}
    try:
        workers = {
            pool: run.start_worker(pool, pool=pool, concurrency=2, queue=queues[pool])
            for pool in TASKS
        }
        run.start_beat(0.0)
        run.start_beat(0.7)
        run.wait_until_claiming()
        for worker in workers.values():
            run.wait_ready(worker)
        start = real_now() + timedelta(seconds=1)
        run.seed(
            [_replacing(name, args, queues[pool]) for pool, (name, args) in TASKS.items()],
            start,
        )
        last_slot = start + timedelta(seconds=(SLOTS - 1) * INTERVAL)
        time.sleep(max((last_slot - real_now()).total_seconds(), 0))
        runs = run.all_ended(timeout=60)  # nothing left waiting or started
        dump = run.tool("dump")
        logs = run.logs()
        threads_log = workers["threads"].log.read_text()
    finally:
        run.close()
    ids = {t["name"]: t["id"] for t in dump["tasks"]}
    bodies = _bodies(tmp_path / "executions.log")
    by_id = {r["id"]: r for r in runs}
    for pool, (name, _args) in TASKS.items():
        mine = sorted((r for r in runs if r["task_id"] == ids[name]), key=lambda r: r["slot"])
        print(f"\n{pool}:")
        for r in mine:
            body = dict(bodies.get((ids[name], r["slot"]), {}))
            print(" ", r["id"], r["slot"][11:22], r["status"], r["claimed_by"], r["error"], body)
        slots = [datetime.fromisoformat(r["slot"]) for r in mine]
        # every slot from the first to the last has its one run, which ended revoked or
        # succeeded: none lost, none doubled, none skipped
        assert len(mine) == SLOTS, (pool, mine)
        assert all(b - a == timedelta(seconds=INTERVAL) for a, b in itertools.pairwise(slots))
        assert {r["status"] for r in mine} <= {"revoked", "succeeded", "skipped"}, (pool, mine)
        for r in mine:
            body = bodies.get((ids[name], r["slot"]), _no_lines())
            assert len(body["begin"]) <= 1 and len(body["end"]) <= 1, f"doubled: {r}"
            # (prefork: a later body began while this one's process still ran; threads and
            # the green pools, one process each, are judged by their spans below)
            assert not body["alive"], f"a later body began beside this one: {r}"
            if r["status"] == "skipped":  # its delivery came after a later slot's
                assert "a run of a later slot of this task runs or waits" in r["error"], r
                assert not body["begin"], f"a skipped run ran: {r}"
            elif r["status"] == "revoked":
                # the reason names the later slot that replaced it, and that slot is a run
                named = _slot_named(r["error"])
                assert named > r["slot"] and any(o["slot"] == named for o in mine), r
                if r["replaced_by"] is not None:  # replaced while it ran
                    other = by_id[r["replaced_by"]]
                    assert r["error"].startswith("revoked: replaced by the run of slot"), r
                    assert other["slot"] > r["slot"], (r, other)
                else:  # replaced while it waited
                    assert r["error"].startswith("revoked: replaced before it started"), r
                    assert not body["begin"], f"a run replaced before it started ran: {r}"
            else:
                assert body["begin"] and body["end"], f"succeeded without its body: {r}"
        # a run that waited was published again (a second dispatch) by a worker (the main
        # process of the prefork one, the body's end or unwinding on threads and the green
        # pools), not by a beat after the lease
        ran = [r for r in mine if bodies.get((ids[name], r["slot"]), {}).get("begin")]
        assert len(ran) >= 2, (pool, ran)
        released = [r for r in mine if r["attempts"] >= 2]
        assert released, f"{pool}: no run waited and was published again: {mine}"
        for later in released:
            assert later["claimed_by"].startswith(f"worker:{pool}@"), later
        replaced_running = [r for r in ran if r["replaced_by"] is not None]
        assert replaced_running, f"{pool}: no running run was replaced: {mine}"
        ended = [r for r in ran if bodies[(ids[name], r["slot"])]["end"]]
        if pool == "threads":
            # threads cannot terminate: every body ran to its end
            assert ended == ran, "a threads body was cut short"
        else:
            # each run replaced while its body ran was cut short (terminated): no end line
            # (gevent, eventlet: its greenlet unwound, and said so)
            assert all(not bodies[(ids[name], r["slot"])]["end"] for r in replaced_running)
            assert ended == [mine[-1]], "only the last body ran to its end"
        if pool in GREEN_POOLS:
            assert all(bodies[(ids[name], r["slot"])]["cut"] for r in replaced_running)
        if pool != "prefork":
            # one process: its bodies' spans (to the end, or to the cut) one after the other
            spans = sorted(
                (
                    bodies[(ids[name], r["slot"])]["begin"][0],
                    max(
                        bodies[(ids[name], r["slot"])]["end"]
                        + bodies[(ids[name], r["slot"])]["cut"]
                    ),
                )
                for r in ran
            )
            assert all(b[0] >= a[1] for a, b in itertools.pairwise(spans)), (
                f"two bodies overlap: {spans}"
            )
    assert "cannot terminate a running body" in threads_log
    assert "Traceback" not in logs
