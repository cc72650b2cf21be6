"""End-to-end: overlap policy ``buffer_all`` with two real ``celery beat`` processes (clocks
apart) and two real ``celery worker`` processes, one of the prefork pool and one of the threads
pool, each on its own queue with a task of its own, real Redis and PostgreSQL. Each task fires
every second and its body takes 2.5 s: the slots queue up, and the ledger and the bodies' own
record show them run one at a time per task, the waiting ones in slot order, each slot either
run or skipped for the bound, none left waiting once the beats stop and the backlog drains."""

from __future__ import annotations

import itertools
import time
from collections import Counter, defaultdict
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from tests import settings as test_settings
from tests.e2e.harness import E2ERun, real_now
from tests.skip_guard import configuration

BACKEND = "postgresql" if test_settings.TEST_DB == "postgres" else "sqlite"
_instant = datetime.fromisoformat

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        BACKEND != "postgresql", reason=configuration("buffer_all's e2e runs on PostgreSQL")
    ),
]
#: The reason of a slot skipped for the bound (overlap policy ``buffer_all``).
BOUND = "the most that may wait (overlap policy 'buffer_all')"
BODY_SECONDS = 2.5


def _queued(name: str, queue: str) -> dict[str, Any]:
    """A 1-second task on ``queue`` whose body takes 2.5 s, overlap policy ``buffer_all``;
    ``fire_all``: a slot a loaded beat reaches late still goes out, so that the overlap
    policy alone decides how each slot ends (``fire_once`` would record it missed)."""
    return {
        "name": name,
        "task": "e2e.slot_work",
        "args": [BODY_SECONDS, True],
        "queue": queue,
        "schedule_kind": "interval",
        "interval_every": 1,
        "interval_unit": "seconds",
        "overlap_policy": "buffer_all",
        "misfire_policy": "fire_all",
    }


def _released_in_slot_order(runs: list[dict[str, Any]], began: dict[datetime, float]) -> list[str]:
    """What one task's succeeded runs, in the order their bodies began (``began``: the bodies'
    own record, one machine's clock), say against "the waiting runs run in slot order, each
    released by the end of the run before it": every run a worker took back into the outbox
    (``claimed_by`` ``worker:…``: it waited) has a later slot than the released runs before it,
    and was taken back at or after the run before it finished (both instants written by that
    run's process, on its reading of the authority's clock). Ledger instants of two processes
    are not compared: each process reads the authority's clock with an error of its own (half
    a round trip, tens of milliseconds on a loaded machine), while the bodies' own record shows
    them one at a time. A run whose first delivery found the lock free ran without waiting:
    under load a slot's message may reach the worker after a later slot's, which then runs
    first (the documented order covers runs that wait)."""
    ran = sorted(
        (r for r in runs if r["status"] == "succeeded"), key=lambda r: began[_instant(r["slot"])]
    )
    problems = []
    last_released: datetime | None = None
    for before, after in itertools.pairwise(ran):
        if not after["claimed_by"].startswith("worker:"):
            continue
        slot = _instant(after["slot"])
        if last_released is not None and not last_released < slot:
            problems.append(f"run {after['id']} (slot {slot}) was released after a later slot")
        last_released = slot
        if not _instant(before["finished"]) <= _instant(after["claimed_at"]):
            problems.append(f"run {after['id']} was taken back before run {before['id']} ended")
    return problems


def test_two_beats_a_prefork_and_a_threads_worker_run_every_slot_one_at_a_time_in_slot_order(
    tmp_path: Path,
) -> None:
    """Two tasks, each every second with a 2.5 s body under ``buffer_all``, one on the prefork
    worker's queue and one on the threads worker's; two beats, 0.6 s apart. After about five
    slots the beats stop and the backlog drains. Per task, from the ledger and the bodies'
    own record: every slot from the first to the last has its row, each succeeded or was
    skipped for the bound (saying so), none is left waiting; each body ran once, on its
    queue's worker, one at a time, the waiting ones in slot order; several slots waited at
    once (more than ``buffer_one`` keeps), each released by the run before it."""
    run = E2ERun(BACKEND, tmp_path, lease=3.0, dead_after=3.0)
    threads_queue = f"{run.queue}-threads"
    try:
        workers = {
            "prefork": run.start_worker("prefork", pool="prefork", concurrency=2),
            "threads": run.start_worker(
                "threads", pool="threads", concurrency=2, queue=threads_queue
            ),
        }
        run.start_beat(0.0)
        run.start_beat(0.6)
        run.wait_until_claiming()
        for worker in workers.values():
            run.wait_ready(worker)
        start = real_now() + timedelta(seconds=1)
        run.seed([_queued("prefork", run.queue), _queued("threads", threads_queue)], start)
        # five slots or more: at the fifth, slot 1 runs and 2, 3 and 4 wait (at least two of
        # them when a delivery lags), while buffer_one would keep one
        time.sleep(max((start - real_now()).total_seconds(), 0) + 4)
        at_stop = run.tool("dump")["runs"]  # (the beats go on meanwhile: a second or two)
        run.stop()
        dump_runs = run.all_ended(timeout=60)
        tasks = {t["id"]: t["name"] for t in run.tool("dump")["tasks"]}
        logs = run.logs()
    finally:
        run.close()

    lines = [line.split() for line in (tmp_path / "executions.log").read_text().splitlines()]
    bodies: dict[str, list[tuple[float, float]]] = defaultdict(list)
    ran = Counter((tasks[int(task_id)], _instant(slot)) for task_id, slot, *_ in lines)
    for task_id, _, _, began, ended in lines:
        bodies[tasks[int(task_id)]].append((float(began), float(ended)))
    waiting_at_stop = Counter(tasks[r["task_id"]] for r in at_stop if r["status"] == "waiting")
    by_task: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in dump_runs:
        by_task[tasks[r["task_id"]]].append(r)
    for name in ("prefork", "threads"):
        runs = sorted(by_task[name], key=lambda r: r["slot"])
        statuses = Counter(r["status"] for r in runs)
        released = [r for r in runs if r["status"] == "succeeded" and r["attempts"] >= 2]
        spans = sorted(bodies[name])
        print(
            f"\n{name}: {len(runs)} slots {dict(statuses)}; {len(released)} ran after waiting; "
            f"{waiting_at_stop[name]} waiting when the beats stopped"
        )
        # every slot from the first to the last has its row: none lost
        slots = [_instant(r["slot"]) for r in runs]
        assert len(slots) >= 5, runs
        assert all(b - a == timedelta(seconds=1) for a, b in itertools.pairwise(slots)), slots
        # each ran, or was skipped for the bound, saying so; none is left waiting
        assert set(statuses) <= {"succeeded", "skipped"}, runs
        assert all(BOUND in r["error"] for r in runs if r["status"] == "skipped"), runs
        # each body ran once, on the worker of the task's queue, one at a time, in slot order
        assert all(
            ran[(name, slot)] == 1
            for r, slot in zip(runs, slots, strict=True)
            if r["status"] == "succeeded"
        ), ran
        assert sum(ran[(name, slot)] for slot in slots) == statuses["succeeded"], ran
        assert sum(count for (task, _), count in ran.items() if task == name) == len(spans)
        assert all(r["worker"].startswith(f"{name}@") for r in runs if r["status"] == "succeeded")
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), f"overlap: {spans}"
        began = {
            _instant(slot): float(start)
            for task_id, slot, _, start, _ in lines
            if tasks[int(task_id)] == name
        }
        problems = _released_in_slot_order(runs, began)
        assert not problems, (problems, runs)
        # the slots queued: several waited, each released by the run before it
        assert len(released) >= 2, runs
    assert max(waiting_at_stop.values(), default=0) >= 2, at_stop  # more than buffer_one keeps
    assert "Traceback" not in logs
