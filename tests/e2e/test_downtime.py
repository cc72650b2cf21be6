"""End-to-end: a real ``celery beat`` starting after eight minutes in which no beat ran. Each
``fire_once`` task fires once for the downtime (its latest slot), however many of its slots
are within the grace, and a ``fire_all`` task at most ``FIRE_ALL_MAX`` times; every other slot
of the downtime is recorded missed, and from the first run on every slot fires, once.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from tests import settings as test_settings
from tests.e2e.harness import E2ERun, real_now, schedule_of

pytestmark = [pytest.mark.e2e]

BACKEND = "postgresql" if test_settings.TEST_DB == "postgres" else "sqlite"
#: The beats' FIRE_ALL_MAX (the default).
FIRE_ALL_MAX = 100


def _missed_slots(dump: dict[str, Any], task: dict[str, Any]) -> list[datetime]:
    """The slots the ledger records missed for ``task``, a span's slots listed one by one."""
    schedule = schedule_of(task)
    slots: list[datetime] = []
    for row in dump["runs"]:
        if row["task_id"] != task["id"] or row["status"] != "missed":
            continue
        first = datetime.fromisoformat(row["slot"])
        last = datetime.fromisoformat(row["missed_until"] or row["slot"])
        covered = list(schedule.slots_between(first, last + timedelta(microseconds=1)))
        assert len(covered) == (row["missed_count"] or 1), row
        slots += covered
    return slots


def test_a_beat_back_after_downtime_fires_each_task_once_then_every_slot(tmp_path: Path) -> None:
    run = E2ERun(BACKEND, tmp_path)
    try:
        down_since = real_now() - timedelta(minutes=8)
        run.seed(
            [
                {
                    "name": name,
                    "schedule_kind": "interval",
                    "interval_every": every,
                    "interval_unit": "seconds",
                    "misfire_policy": policy,
                }
                for name, every, policy in (
                    ("once-3s", 3, "fire_once"),
                    ("once-1s", 1, "fire_once"),
                    ("all-1s", 1, "fire_all"),
                )
            ],
            down_since,
        )
        run.start_recorder()
        started = real_now()  # no beat claimed before this instant
        run.start_beat(0.0)
        time.sleep(14)
        end = real_now()
        codes = run.stop()
        dump = run.tool("dump")
    finally:
        run.close()
    assert set(codes.values()) == {0}, f"exit codes {codes}\n{run.logs()}"
    until = end - timedelta(seconds=1.5)  # later slots may still be on their way
    problems: list[str] = []
    for task in sorted(dump["tasks"], key=lambda t: t["name"]):
        name = task["name"]
        schedule = schedule_of(task)
        due = list(schedule.slots_between(down_since, until))
        published = sorted(m.slot for m in run.received if m.periodic_task_id == task["id"])
        assert len(published) == len(set(published)), f"{name}: a slot published twice"
        missed = _missed_slots(dump, task)
        assert len(missed) == len(set(missed)), f"{name}: a slot recorded missed twice"
        assert not set(missed) & set(published), f"{name}: a missed slot was published"
        # Every slot is accounted for: the downtime's are missed but the first run, and from
        # the first run on every slot fires.
        first_run = published[0]
        assert [s for s in due if s < first_run] == sorted(missed), name
        assert [s for s in due if s >= first_run] == [s for s in published if s <= until], name
        for_downtime = len([s for s in published if s < started])
        print(f"{name}: {for_downtime} runs for the downtime, {len(missed)} missed")
        if name.startswith("once"):
            # One run for the downtime: not one for each slot within the (30 s) grace.
            if for_downtime > 1 or len(missed) < 8 * 60 // task["every"] - 1:
                problems.append(f"{name}: {for_downtime} runs for the downtime")
        elif not 0 < for_downtime <= FIRE_ALL_MAX:
            problems.append(f"{name}: {for_downtime} runs for the downtime")
    assert not problems, problems
