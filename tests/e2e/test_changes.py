"""End-to-end: schedule edits reach every running beat while it sleeps much longer
(MAX_LOOP_INTERVAL_SECONDS = 30, the next slot an hour away): the Redis notification wakes
them. "Reach" is shown by what fires, not by a lateness: a new task fires its very first slot
(never early), an edited one fires its first slots after the edit on the new schedule, and
neither waits for the beats' 30-s sleep to end (the test waits at most half of it)."""

from __future__ import annotations

import itertools
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from tests import settings as test_settings
from tests.e2e.harness import E2ERun, real_now
from tests.skip_guard import configuration

# One database is enough here (change notifications do not depend on the database; the SQLite
# claim path has its own end-to-end run in tests/e2e/test_beats.py): the suite must stay under
# 15 minutes.
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        test_settings.TEST_DB != "postgres", reason=configuration("runs on the PostgreSQL pass")
    ),
]
BACKEND = "postgresql" if test_settings.TEST_DB == "postgres" else "sqlite"


#: The beats sleep this long when nothing is due (their MAX_LOOP_INTERVAL_SECONDS here).
MAX_LOOP = 30.0


#: How long the test waits for a change to take effect: half the beats' sleep, so that a beat
#: the change notification did not wake would still be asleep.
WOKEN_WITHIN = MAX_LOOP / 2
NOT_WOKEN = f" (within half the beats' {MAX_LOOP:g} s sleep: not woken?)"


def test_new_edited_disabled_and_deleted_tasks_take_effect_without_waiting_for_the_loop(
    tmp_path: Path,
) -> None:
    run = E2ERun(BACKEND, tmp_path, max_loop=MAX_LOOP)
    try:
        start = real_now()
        run.seed(
            [
                {
                    "name": "slow",
                    "schedule_kind": "interval",
                    "interval_every": 3600,
                    "interval_unit": "seconds",
                }
            ],
            start + timedelta(hours=1),
        )
        run.start_recorder()
        run.start_beat(0.0)
        run.start_beat(0.0)
        run.wait_for(
            lambda: len(run.tool("dump")["nodes"]) == 2,
            "two beats registered" + NOT_WOKEN,
            timeout=WOKEN_WITHIN,
        )
        time.sleep(2)  # their first rounds are over: asleep (the next slot is an hour away)

        # a new task: first slot = authority now + 2 s; must fire on time, not 30 s later
        run.tool(
            "add",
            [
                {
                    "name": "new",
                    "schedule_kind": "interval",
                    "interval_every": 2,
                    "interval_unit": "seconds",
                }
            ],
        )
        new = run.wait_for(
            lambda: run.received_for("new")[:2] or None,
            "message of the new task" + NOT_WOKEN,
            timeout=WOKEN_WITHIN,
        )
        (task,) = [t for t in run.tool("dump")["tasks"] if t["name"] == "new"]
        first_slot = datetime.fromisoformat(task["anchor"]) + timedelta(seconds=2)
        assert new[0].slot == first_slot, "the new task's first slot did not fire"
        assert new[0].received_at >= new[0].slot, "the new task fired early"

        # an edit of the schedule (every 2 s -> every 1 s): the slots after it are 1 s apart;
        # meanwhile a task to delete below fires its first slots
        run.tool("update", {"name": "new", "fields": {"interval_every": 1}})
        edited_at = real_now()
        run.tool(
            "add",
            [
                {
                    "name": "doomed",
                    "schedule_kind": "interval",
                    "interval_every": 1,
                    "interval_unit": "seconds",
                }
            ],
        )

        def three_after_the_edit() -> list[Any] | None:
            after = [m for m in run.received_for("new") if m.slot > edited_at]
            return after if len(after) >= 3 else None

        after = run.wait_for(
            three_after_the_edit, "three slots after the edit" + NOT_WOKEN, timeout=WOKEN_WITHIN
        )
        gaps = {(b.slot - a.slot).total_seconds() for a, b in itertools.pairwise(after)}
        assert gaps == {1.0}, gaps
        doomed = run.wait_for(
            lambda: run.received_for("doomed"),
            "message of the task to delete" + NOT_WOKEN,
            timeout=WOKEN_WITHIN,
        )
        doomed_ids = {m.periodic_task_id for m in doomed}

        # disabling stops a task, and deleting one does too: nothing whose slot is over 1 s
        # after the commit (one wait for both)
        run.tool("update", {"name": "new", "fields": {"enabled": False}})
        disabled_at = real_now()
        run.tool("delete", {"name": "doomed"})
        deleted_at = real_now()
        time.sleep(3)
        late = [m for m in run.received_for("new") if m.slot > disabled_at + timedelta(seconds=1)]
        assert late == []
        after_delete = [
            m
            for m in run.received
            if m.periodic_task_id in doomed_ids and m.slot > deleted_at + timedelta(seconds=1)
        ]
        assert after_delete == []
        codes = run.stop()
        assert set(codes.values()) == {0}, run.logs()
        slots = [(m.periodic_task_id, m.slot) for m in run.received]
        assert len(slots) == len(set(slots)), "a slot was published twice"
    finally:
        run.close()
