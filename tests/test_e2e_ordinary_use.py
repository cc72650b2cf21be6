"""End-to-end: what a project does to real beats in its first week.

* stale saves (ORM and the admin form) racing three claiming beats, while malformed rows are
  written with raw SQL: every slot of every good task exactly once, the bad rows disabled with
  their reason, no beat exits;
* a beat frozen (SIGSTOP) between committing its claims and publishing them, for twice
  ``NODE_DEAD_AFTER_SECONDS``, with a plain task: every slot published exactly once;
* a beat whose Celery app imports no task module: slots published by name and executed by a
  worker that has it.

PostgreSQL only: the claim paths that differ on SQLite (compare-and-swap, rows the ORM cannot
read) are covered by tests/test_ordinary_use.py on both databases.
"""

from __future__ import annotations

import signal
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from tests import settings as test_settings
from tests.e2e.harness import E2ERun, analyse, assert_exactly_once, real_now, table

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        test_settings.TEST_DB != "postgres",
        reason="runs on the PostgreSQL pass (see the module docstring)",
    ),
]


def _sleep_until(instant: Any) -> None:
    time.sleep(max((instant - real_now()).total_seconds(), 0))


_CORRUPTIONS = {
    "bad-args": ("args = '\"1, 2\"'::jsonb", "args:"),
    "bad-kwargs": ("kwargs = '[1, 2]'::jsonb", "kwargs:"),
    "bad-headers": ('headers = \'{"id": "x", "task": "y"}\'::jsonb', "headers:"),
    "bad-interval": ("interval_every = 2000000000, interval_unit = 'days'", "interval_every:"),
    "bad-zone": ("schedule_kind = 'crontab', timezone = 'Nowhere/Atlantis'", "timezone"),
    "bad-grace": ("misfire_grace_seconds = -5", "misfire_grace_seconds:"),
    "bad-expiry": ("expires_seconds = -1", "expires_seconds:"),
}


def test_stale_saves_and_malformed_rows_never_wedge_or_double_the_beats(tmp_path: Path) -> None:
    run = E2ERun("postgresql", tmp_path)
    try:
        start = real_now() + timedelta(seconds=8)
        edited = {
            "name": "edited-1s",
            "schedule_kind": "interval",
            "interval_every": 1,
            "interval_unit": "seconds",
        }
        untouched = [
            {
                "name": f"untouched-{s}s",
                "schedule_kind": "interval",
                "interval_every": s,
                "interval_unit": "seconds",
            }
            for s in (1, 2, 3)
        ]
        bad = [
            {
                "name": name,
                "schedule_kind": "interval",
                "interval_every": 1,
                "interval_unit": "seconds",
            }
            for name in _CORRUPTIONS
        ]
        run.seed([edited, *untouched, *bad], start)
        run.start_recorder()
        for _ in range(3):
            run.start_beat(0.0)
        _sleep_until(start + timedelta(seconds=3))
        saved: dict[str, Any] = {}
        saver = threading.Thread(
            target=lambda: saved.update(
                run.tool("stale_saves", {"name": "edited-1s", "seconds": 30, "pause": 0.4})
            )
        )
        saver.start()
        time.sleep(2)
        run.tool(
            "corrupt", [{"name": name, "set": change} for name, (change, _) in _CORRUPTIONS.items()]
        )
        saver.join(timeout=90)
        end = real_now()
        time.sleep(2)
        running = [b.process.poll() is None for b in run.beats]
        codes = run.stop()
        dump = run.tool("dump")
        good = {**dump, "tasks": [t for t in dump["tasks"] if t["name"] not in _CORRUPTIONS]}
        reports = analyse(good, run.received, start=start, until=end - timedelta(seconds=1.5))
        print(f"\n{saved.get('saves')} stale saves; beats running: {running}\n{table(reports)}")
        assert saved.get("saves", 0) >= 40, saved
        assert all(running), f"a beat exited\n{run.logs()}"
        assert all(code == 0 for code in codes.values()), f"{codes}\n{run.logs()}"
        assert_exactly_once(run, reports, {"edited-1s", *(t["name"] for t in untouched)})
        tasks = {t["name"]: t for t in dump["tasks"]}
        for name, (_, field) in _CORRUPTIONS.items():
            assert not tasks[name]["enabled"], name
            assert field in tasks[name]["disabled_reason"], (name, tasks[name])
        slots = [(r["task_id"], r["slot"]) for r in dump["runs"]]
        assert len(slots) == len(set(slots))
        assert "slot-taken" not in run.logs() and "Traceback" not in run.logs(), run.logs()
    finally:
        run.close()


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] == "T"


def test_a_beat_frozen_before_publishing_past_dead_after_publishes_nothing_twice(
    tmp_path: Path,
) -> None:
    dead_after = 3.0
    run = E2ERun("postgresql", tmp_path, dead_after=dead_after, lease=5.0)
    flag = tmp_path / "pause-now"
    try:
        start = real_now() + timedelta(seconds=8)
        run.seed(
            [
                {
                    "name": f"plain-{i}",
                    "schedule_kind": "interval",
                    "interval_every": 1,
                    "interval_unit": "seconds",
                }
                for i in range(5)
            ],
            start,
        )
        run.start_recorder()
        frozen = run.start_beat(
            0.0,
            scheduler="tests.e2e.pausing:PausingScheduler",
            env={"DRIFTSAFE_E2E_PAUSE_FLAG": str(flag)},
        )
        run.start_beat(0.0)
        _sleep_until(start + timedelta(seconds=4))
        flag.touch()  # the frozen beat stops itself after its next claim, before publishing
        deadline = time.monotonic() + 15
        while not _stopped(frozen.process.pid):
            assert time.monotonic() < deadline, f"the beat never paused\n{run.logs()}"
            time.sleep(0.05)
        time.sleep(2 * dead_after + 2)  # marked dead; its claims taken over and published
        frozen.process.send_signal(signal.SIGCONT)
        time.sleep(6)
        end = real_now()
        codes = run.stop()
        dump = run.tool("dump")
        reports = analyse(dump, run.received, start=start, until=end - timedelta(seconds=1.5))
        print(f"\nbeat 0 frozen for {2 * dead_after + 2:.0f} s before publishing\n{table(reports)}")
        assert all(code == 0 for code in codes.values()), f"{codes}\n{run.logs()}"
        assert_exactly_once(run, reports, {f"plain-{i}" for i in range(5)})
        log = run.beats[0].log.read_text()
        assert "taken over by another node" in log, log[-3000:]
        assert "re-registering" in log, log[-3000:]
    finally:
        run.close()


def test_a_beat_without_the_task_module_publishes_by_name(tmp_path: Path) -> None:
    run = E2ERun("postgresql", tmp_path)
    try:
        run.start_worker("w1")
        run.start_beat(0.0, app="tests.e2e.slim_app")
        run.wait_until_claiming()  # the slots below fall due while the beat claims
        start = real_now() + timedelta(seconds=3)
        run.seed(
            [
                {
                    "name": "work",
                    "task": "e2e.slot_work",
                    "schedule_kind": "interval",
                    "interval_every": 1,
                    "interval_unit": "seconds",
                }
            ],
            start,
        )
        _sleep_until(start + timedelta(seconds=10))
        end = real_now()
        time.sleep(3)
        codes = run.stop()
        dump = run.tool("dump")
        executed = [line.split() for line in (tmp_path / "executions.log").read_text().splitlines()]
        slots = [slot for _, slot, _ in executed]
        due = [r["slot"] for r in dump["runs"] if r["slot"] <= end.isoformat()]
        print(f"\n{len(due)} slots due, {len(executed)} executions")
        assert codes == {"beat-0": 0}, run.logs()
        assert len(due) >= 8
        assert sorted(set(slots)) == sorted(slots), "a slot executed twice"
        assert set(due) <= set(slots), f"not executed: {set(due) - set(slots)}\n{run.logs()}"
        assert {r["status"] for r in dump["runs"] if r["slot"] in due} == {"succeeded"}
    finally:
        run.close()
