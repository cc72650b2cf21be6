"""End-to-end: schedule edits reach every running beat within a second, even when the beats
are sleeping for much longer (MAX_LOOP_INTERVAL_SECONDS = 30): the Redis notification wakes
them."""

from __future__ import annotations

import itertools
import time
from datetime import timedelta
from pathlib import Path

import pytest

from tests import settings as test_settings
from tests.e2e.harness import E2ERun, real_now
from tests.skip_guard import configuration

# One database is enough here (change notifications do not depend on the database; the SQLite
# claim path has its own end-to-end run in tests/test_e2e_beats.py): the suite must stay under
# 15 minutes.
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        test_settings.TEST_DB != "postgres", reason=configuration("runs on the PostgreSQL pass")
    ),
]
BACKEND = "postgresql" if test_settings.TEST_DB == "postgres" else "sqlite"


def test_new_edited_disabled_and_deleted_tasks_take_effect_within_a_second(
    tmp_path: Path,
) -> None:
    run = E2ERun(BACKEND, tmp_path, max_loop=30.0)
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
        time.sleep(6)  # both beats up and asleep (next slot is an hour away)

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
        time.sleep(4.5)
        new = run.received_for("new")
        assert len(new) >= 2, run.logs()
        first_late = (new[0].received_at - new[0].slot).total_seconds()
        assert 0 <= first_late < 1.0, f"new task fired {first_late:.3f} s late"

        # an edit of the schedule (every 2 s -> every 1 s) shows in the cadence within 1 s
        run.tool("update", {"name": "new", "fields": {"interval_every": 1}})
        edited_at = real_now()
        time.sleep(3.5)
        after = [m for m in run.received_for("new") if m.received_at > edited_at]
        assert len(after) >= 3, [m.slot for m in after]
        gaps = {(b.slot - a.slot).total_seconds() for a, b in itertools.pairwise(after)}
        assert gaps == {1.0}, gaps

        # disabling stops it: nothing whose slot is over 1 s after the commit
        run.tool("update", {"name": "new", "fields": {"enabled": False}})
        disabled_at = real_now()
        time.sleep(3)
        late = [m for m in run.received_for("new") if m.slot > disabled_at + timedelta(seconds=1)]
        assert late == []

        # deleting stops it too
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
        time.sleep(2.5)
        doomed_ids = {m.periodic_task_id for m in run.received_for("doomed")}
        assert doomed_ids
        run.tool("delete", {"name": "doomed"})
        deleted_at = real_now()
        time.sleep(2.5)
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
