"""End-to-end: pause after failures with two real ``celery beat`` processes and two real
``celery worker``s, a prefork one and a threads one, each on its own queue and each running a
task that always fails, every second, with ``pause_after_failures`` 3. The workers' receivers
of ``task_paused`` (connected in tests/e2e/celery_app.py) write what they get to a file; the
workers serve their metrics. PostgreSQL pass only."""

from __future__ import annotations

import json
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from celery_driftsafe.testing.processes import free_port
from tests import settings as test_settings
from tests.e2e.harness import E2ERun, real_now
from tests.skip_guard import configuration
from tests.support.metrics import scrape, value

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        test_settings.TEST_DB != "postgres", reason=configuration("runs on the PostgreSQL pass")
    ),
]

LIMIT = 3
#: Statuses of a run not ended yet.
UNDER_WAY = ("claimed", "dispatched", "started", "retrying", "waiting")
S = timedelta(seconds=1)
REASON = f"failed or missed runs in a row (pause_after_failures={LIMIT}), at "


def _spec(name: str, queue: str) -> dict[str, Any]:
    return {
        "name": name,
        "task": "e2e.fail",
        "args": [name],
        "queue": queue,
        "schedule_kind": "interval",
        "interval_every": 1,
        "interval_unit": "seconds",
        "pause_after_failures": LIMIT,
    }


def test_two_beats_and_a_prefork_and_a_threads_worker_pause_each_task_once(
    tmp_path: Path,
) -> None:
    signals = tmp_path / "signals.jsonl"
    multiproc = tmp_path / "prometheus"
    multiproc.mkdir()
    ports = {"prefork": free_port(), "threads": free_port()}
    run = E2ERun("postgresql", tmp_path, lease=3.0)
    try:
        queues = {pool: f"{run.queue}-{pool}" for pool in ports}
        for pool, port in ports.items():
            env = {
                "DRIFTSAFE_E2E_SIGNALS": str(signals),
                "DRIFTSAFE_E2E_WORKER_METRICS_PORT": str(port),
            }
            if pool == "prefork":
                env["PROMETHEUS_MULTIPROC_DIR"] = str(multiproc)
            run.start_worker(pool, pool=pool, concurrency=1, env=env, queue=queues[pool])
        run.start_beat(0.0)
        run.start_beat(0.0)
        run.wait_until_claiming()
        run.seed([_spec(pool, queue) for pool, queue in queues.items()], real_now() + 2 * S)

        def both_paused() -> dict[str, Any] | None:
            dump = run.tool("dump")
            return dump if not any(t["enabled"] for t in dump["tasks"]) else None

        at_pause = run.wait_for(both_paused, "both tasks paused", timeout=60)
        time.sleep(3)  # slots fall due meanwhile: no beat claims one of a paused task

        def all_ended() -> dict[str, Any] | None:
            dump = run.tool("dump")
            return dump if all(r["status"] not in UNDER_WAY for r in dump["runs"]) else None

        dump = run.wait_for(all_ended, "the runs under way to end", timeout=30)
        samples = {pool: scrape(port) for pool, port in ports.items()}
        run.stop()
        logs = run.logs()
    finally:
        run.close()

    # No slot claimed once the pause was seen (a claim holds the task's row until it commits,
    # so a claim before the pause committed is in the first look).
    assert {r["id"] for r in dump["runs"]} == {r["id"] for r in at_pause["runs"]}, logs
    lines = [json.loads(line) for line in signals.read_text().splitlines()]
    for task in dump["tasks"]:
        name = task["name"]
        runs = [r for r in dump["runs"] if r["task_id"] == task["id"]]
        # Disabled once, with the reason: the count, the limit and the instant of the pause.
        assert task["enabled"] is False and task["consecutive_failures"] == LIMIT, (task, logs)
        prefix = f"disabled by the scheduler: paused after {LIMIT} "
        assert task["disabled_reason"].startswith(prefix + REASON), task
        paused_at = datetime.fromisoformat(task["disabled_reason"].rpartition(", at ")[2])
        # Exactly three runs had failed when it paused (each worker runs one body at a time,
        # so its runs end one after the other), the third at the instant of the pause; every
        # run failed, one slot each; a run claimed before the pause and still under way then
        # (on a loaded machine) ended failed after it, and counted nothing.
        assert {r["status"] for r in runs} == {"failed"}, (runs, logs)
        assert len({r["slot"] for r in runs}) == len(runs)
        before = [r for r in runs if datetime.fromisoformat(r["finished"]) <= paused_at]
        assert len(before) == LIMIT, (paused_at, runs, logs)
        assert max(datetime.fromisoformat(r["finished"]) for r in before) == paused_at
        # Run by this task's worker only (its own queue and pool).
        assert {r["worker"].partition("@")[0] for r in runs} == {name}, runs
        # The signal reached a receiver once, from the worker's process, the task paused.
        heard = [line for line in lines if line["task"] == name]
        assert len(heard) == 1, (lines, logs)
        assert heard[0]["failures"] == LIMIT and heard[0]["enabled"] is False
        assert heard[0]["reason"] == task["disabled_reason"]
        # The metric of the worker that paused it counts it once.
        got = value(samples[name], "driftsafe_tasks_paused_total", task=name)
        assert got == 1, samples[name]
