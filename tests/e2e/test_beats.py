"""End-to-end: several real ``celery beat`` processes, wall clocks really skewed apart with
libfaketime, one database and one Redis. Every published message is counted.

PostgreSQL: K=3 beats at 0 / +2.5 / -4 s, one of them SIGKILLed half-way, with the database's
clock as the time authority; and a run with one beat an hour off, once with each authority (the
database's clock, Redis's). SQLite: K=2 beats at +2.5 / -4 s with Redis as the time authority
(SQLite's "now" is each process's own wall clock).
"""

from __future__ import annotations

import re
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from tests import settings as test_settings
from tests.e2e.harness import E2ERun, TaskReport, analyse, real_now, table
from tests.skip_guard import configuration

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("needs_faketime")]

BACKEND = "postgresql" if test_settings.TEST_DB == "postgres" else "sqlite"


def _specs(crontabs: bool = True) -> list[dict[str, Any]]:
    specs: list[dict[str, Any]] = [
        {
            "name": f"every-{1 + i % 3}s-{i:02d}",
            "schedule_kind": "interval",
            "interval_every": 1 + i % 3,
            "interval_unit": "seconds",
        }
        for i in range(20)
    ]
    if crontabs:
        specs += [
            {
                "name": "cron-utc",
                "schedule_kind": "crontab",
                "crontab_minute": "*",
                "timezone": "UTC",
            },
            {
                "name": "cron-kolkata",
                "schedule_kind": "crontab",
                "crontab_minute": "*",
                "timezone": "Asia/Kolkata",
            },
        ]
    return specs


def _sleep_until(instant: Any) -> None:
    time.sleep(max((instant - real_now()).total_seconds(), 0))


def _assert_exactly_once(run: E2ERun, reports: dict[int, TaskReport], dump: dict[str, Any]) -> None:
    attempts = {(r["task_id"], r["slot"]): r["attempts"] for r in dump["runs"]}
    for task_id, report in reports.items():
        assert not report.missed, f"{report.name}: missed {report.missed}\n{run.logs()}"
        assert not report.unexpected, f"{report.name}: not a slot {report.unexpected}"
        assert not report.early, f"{report.name}: published early {report.early}\n{run.logs()}"
        assert report.expected > 0
        assert report.fired >= report.expected
        if report.duplicates:
            # Only a run the outbox re-published after a kill may arrive twice, with one id.
            doubles = [m for m in run.received if m.periodic_task_id == task_id]
            by_slot: dict[Any, set[str]] = {}
            for m in doubles:
                by_slot.setdefault(m.slot, set()).add(m.celery_task_id)
            for slot, ids in by_slot.items():
                assert len(ids) == 1, f"{report.name} {slot}: two task ids {ids}"
            for m in doubles:
                if sum(1 for d in doubles if d.slot == m.slot) > 1:
                    assert attempts[(task_id, m.slot.isoformat())] > 1, (
                        f"{report.name} {m.slot}: published twice without a re-publish"
                    )
    all_slots = [(r["task_id"], r["slot"]) for r in dump["runs"]]
    assert len(all_slots) == len(set(all_slots)), "two run rows for one slot"


def _assert_offsets(run: E2ERun, dump: dict[str, Any], alive: list[int]) -> None:
    """Each beat measured (and stored) its own offset: authority - local = -skew."""
    nodes = {int(n["node_id"].split(":")[1]): n for n in dump["nodes"]}
    for index in alive:
        beat = run.beats[index]
        node = nodes[beat.process.pid]
        assert node["offset"] == pytest.approx(-beat.offset, abs=0.25), (node, beat.offset)
        assert node["stopped"] is not None, f"beat {index} did not shut down gracefully"


def test_skewed_beats_fire_every_slot_exactly_once_never_early(tmp_path: Path) -> None:
    offsets = [0.0, 2.5, -4.0] if BACKEND == "postgresql" else [2.5, -4.0]
    # The crontabs (a minute boundary in two zones) on PostgreSQL only: they do not depend on
    # the database, and waiting for the boundary made the SQLite run 30-65 s.
    crontabs = BACKEND == "postgresql"
    run = E2ERun(BACKEND, tmp_path, beat_schedule={"from-beat-schedule": 2})
    try:
        run.start_recorder()
        for offset in offsets:
            run.start_beat(offset)
        run.wait_until_claiming()  # the slots below fall due while the beats claim
        start = real_now() + timedelta(seconds=3)
        # at least 30 s, and long enough that a minute boundary (the crontabs) falls inside
        minute = (start + timedelta(seconds=62)).replace(second=0, microsecond=0)
        end = start + timedelta(seconds=30)
        if crontabs:
            end = max(end, minute + timedelta(seconds=3))
        run.seed(_specs(crontabs), start)
        killed = None
        if BACKEND == "postgresql":
            _sleep_until(start + (end - start) / 2)
            killed = 1
            run.kill(run.beats[killed])
        _sleep_until(end)
        codes = run.stop()
        dump = run.tool("dump")
        reports = analyse(dump, run.received, start=start, until=end - timedelta(seconds=1.5))
        print(f"\n{BACKEND}, beats at {offsets}, killed: {killed}\n{table(reports)}")
        print("nodes:", [(n["node_id"], n["offset"], n["rtt"]) for n in dump["nodes"]])
        alive = [i for i in range(len(offsets)) if i != killed]
        for i in alive:
            assert codes[f"beat-{i}"] == 0, f"exit codes {codes} (None: no exit)\n{run.logs()}"
        assert "Traceback" not in run.logs(), run.logs()
        synced = [t for t in dump["tasks"] if t["source"] == "beat_schedule"]
        assert len(synced) == 1, "beat_schedule entry created more than once"
        cron = [r for r in reports.values() if r.name.startswith("cron")]
        assert len(cron) == (2 if crontabs else 0) and all(r.expected >= 1 for r in cron)
        _assert_exactly_once(run, reports, dump)
        _assert_offsets(run, dump, alive)
        claimers = {r["claimed_by"].split(":")[1] for r in dump["runs"]}
        assert len(claimers) == len(offsets), "every beat should take part in claiming"
    finally:
        run.close()


@pytest.mark.skipif(
    BACKEND != "postgresql", reason=configuration("the hour-off run uses PostgreSQL")
)
@pytest.mark.parametrize("authority", ["database", "redis"])
def test_beat_an_hour_off_changes_nothing(tmp_path: Path, authority: str) -> None:
    """PostgreSQL with each time authority it supports: its own clock (as the run above) and
    Redis's (as on SQLite), so every database meets every authority it has end to end."""
    offsets = [0.0, 3600.0]
    run = E2ERun(BACKEND, tmp_path, authority=authority)
    try:
        run.start_recorder()
        for offset in offsets:
            run.start_beat(offset)
        run.wait_until_claiming()  # the slots below fall due while the beats claim
        start = real_now() + timedelta(seconds=3)
        end = start + timedelta(seconds=20)
        run.seed(_specs(crontabs=False), start)
        _sleep_until(end)
        codes = run.stop()
        dump = run.tool("dump")
        reports = analyse(dump, run.received, start=start, until=end - timedelta(seconds=1.5))
        print(f"\nbeats at {offsets}, {authority} clock\n{table(reports)}")
        assert set(codes.values()) == {0}, f"exit codes {codes} (None: no exit)\n{run.logs()}"
        _assert_exactly_once(run, reports, dump)
        _assert_offsets(run, dump, [0, 1])
        # the offset as measured, to the millisecond: -3600.000 or, a read's latency off, -3599.999
        logged = re.search(r"wall clock is (-\d+\.\d+) s off", run.beats[1].log.read_text())
        assert logged is not None and abs(float(logged.group(1)) + 3600) < 0.5, logged
        assert not any(r.duplicates for r in reports.values())
    finally:
        run.close()
