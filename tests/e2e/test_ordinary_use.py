"""End-to-end: what a project does to real beats in its first week.

* stale saves (ORM and the admin form) racing three claiming beats, while malformed rows are
  written with raw SQL: every slot of every good task exactly once, the bad rows disabled with
  their reason, no beat exits;
* a beat frozen (SIGSTOP) between committing its claims and publishing them, for twice
  ``NODE_DEAD_AFTER_SECONDS``, with a plain task: every slot published exactly once;
* a beat whose Celery app imports no task module: slots published by name and executed by a
  worker that has it;
* rows whose claim state a beat cannot use (a full run count, no next slot, an interval past
  the calendar), on PostgreSQL and on SQLite: disabled once, and the beat never backs off.

Run in the PostgreSQL pass (the last test runs a SQLite beat there too): the claim paths that
differ on SQLite (compare-and-swap, rows the ORM cannot read) are covered by
tests/usage/test_ordinary_use.py on both databases.
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
from tests.skip_guard import configuration

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        test_settings.TEST_DB != "postgres",
        reason=configuration("runs on the PostgreSQL pass (see the module docstring)"),
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
    # run_count + 1 failed the claim's ::bigint cast, taken for an outage: every beat backed
    # off, for every task, in every round
    "bad-run-count": (f"run_count = {2**63 - 1}", "run_count:"),
    "bad-next-slot": ("next_slot_at = NULL", "next_slot_at:"),
}


def test_stale_saves_and_malformed_rows_never_wedge_or_double_the_beats(tmp_path: Path) -> None:
    run = E2ERun("postgresql", tmp_path)
    try:
        run.start_recorder()
        for _ in range(3):
            run.start_beat(0.0)
        run.wait_until_claiming()  # the slots below fall due while the beats claim
        start = real_now() + timedelta(seconds=3)
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
        run.start_recorder()
        frozen = run.start_beat(
            0.0,
            scheduler="tests.e2e.pausing:PausingScheduler",
            env={"DRIFTSAFE_E2E_PAUSE_FLAG": str(flag)},
        )
        run.start_beat(0.0)
        run.wait_until_claiming()  # the slots below fall due while the beats claim
        start = real_now() + timedelta(seconds=3)
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


#: Rows whose claim state a beat cannot use, written with raw SQL before the beat starts:
#: name -> (SET clause, the field the reason names), by the database's backend.
_CLAIM_STATE_CORRUPTIONS: dict[str, dict[str, tuple[str, str]]] = {
    "postgresql": {
        # run_count + 1 failed the claim's ::bigint cast, taken for an outage in every round
        "full-count": (f"run_count = {2**63 - 1}", "run_count:"),
        "no-next-slot": ("next_slot_at = NULL", "next_slot_at:"),
        "past-calendar": ("interval_every = 2147483647, interval_unit = 'days'", "every:"),
    },
    "sqlite": {
        # OverflowError in every round; a TypeError for text
        "full-count": (f"run_count = {2**63 - 1}", "run_count:"),
        "text-count": ("run_count = 'many'", "run_count:"),
        # never won by the compare-and-swap: an ERROR line each round, forever
        "no-next-slot": ("next_slot_at = NULL", "next_slot_at:"),
        "past-calendar": ("interval_every = 2147483647, interval_unit = 'days'", "every:"),
    },
}


@pytest.mark.parametrize("backend", ["postgresql", "sqlite"])
def test_rows_a_real_beat_cannot_claim_are_disabled_once_and_never_slow_it(
    tmp_path: Path, backend: str
) -> None:
    """One real beat, a one-second task and rows it cannot claim: each bad row is disabled in
    the beat's first round with its reason, logged once, and the beat never pauses or backs
    off (it did in every round, for every task) while the good task fires every slot once.
    Runs in the PostgreSQL pass for both backends."""
    corruptions = _CLAIM_STATE_CORRUPTIONS[backend]
    run = E2ERun(backend, tmp_path)
    try:
        every_second = {
            "schedule_kind": "interval",
            "interval_every": 1,
            "interval_unit": "seconds",
        }
        # the bad rows are there before the beat; the good task is seeded once it claims, so
        # each of its slots counted falls due while it does (before: downtime, one run)
        run.seed([{"name": name, **every_second} for name in corruptions], real_now())
        run.tool(
            "corrupt", [{"name": name, "set": change} for name, (change, _) in corruptions.items()]
        )
        run.start_recorder()
        run.start_beat(0.0)
        run.wait_until_claiming()
        start = real_now() + timedelta(seconds=2)
        run.seed([{"name": "good", **every_second}], start)
        _sleep_until(start + timedelta(seconds=6))
        end = real_now()
        time.sleep(1.5)
        codes = run.stop()
        dump = run.tool("dump")
        good = {**dump, "tasks": [t for t in dump["tasks"] if t["name"] == "good"]}
        reports = analyse(good, run.received, start=start, until=end - timedelta(seconds=1))
        logs = run.logs()
        print(f"\n{table(reports)}")
        assert codes == {"beat-0": 0}, logs
        assert_exactly_once(run, reports, {"good"})
        tasks = {t["name"]: t for t in dump["tasks"]}
        for name, (_, field) in corruptions.items():
            assert not tasks[name]["enabled"], (name, logs)
            assert field in tasks[name]["disabled_reason"], (name, tasks[name])
            assert logs.count(f"task {name} disabled") == 1, (name, logs)
        assert not {r["task_id"] for r in dump["runs"]} - {tasks["good"]["id"]}
        for sign in ("claiming paused", "failed unexpectedly", "Traceback"):
            assert sign not in logs, logs
    finally:
        run.close()
