"""End-to-end: a preview taken before a save is what real, skewed ``celery beat`` processes
fire after it. A new interval task (every 0.5 s, a jitter of 1.5 s: three periods, so some
slot waits for the one before) is previewed at the authority's now, saved as the admin's form
saves it (counting from the preview's anchor), and fired by three beats; the ledger's run rows
are the previewed slots, each claimed and dispatched never before the instant the preview said
it fires (and so never before its own jittered instant)."""

from __future__ import annotations

from collections import Counter
from datetime import datetime
from pathlib import Path

import pytest

from tests import settings as test_settings
from tests.e2e.harness import E2ERun
from tests.skip_guard import configuration

# On the PostgreSQL pass only: what a preview promises does not depend on the database (the
# SQLite claim path has its own end-to-end run in tests/e2e/test_beats.py).
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.usefixtures("needs_faketime"),
    pytest.mark.skipif(
        test_settings.TEST_DB != "postgres", reason=configuration("runs on the PostgreSQL pass")
    ),
]

BACKEND = "postgresql" if test_settings.TEST_DB == "postgres" else "sqlite"
RUNS = 8


def test_a_preview_before_a_save_is_what_skewed_beats_fire_after_it(tmp_path: Path) -> None:
    run = E2ERun(BACKEND, tmp_path)
    try:
        run.start_recorder()
        for skew in (0.0, 0.7, -1.3):
            run.start_beat(skew)
        run.wait_until_claiming()
        previewed = run.tool(
            "preview_and_add",
            {
                "names": [f"tight-{n}" for n in range(20)],
                "schedule_kind": "interval",
                "interval_every": 500_000,
                "interval_unit": "microseconds",
                "jitter_seconds": 1.5,
                "max_runs": RUNS,
            },
        )
        rows = previewed["rows"]
        assert len(rows) == RUNS
        assert any(row["held"] for row in rows), previewed  # some slot waits for the one before
        # saved as previewed: counting from the preview's instant, from its first slot on
        assert previewed["anchor"] == previewed["previewed_at"]
        assert previewed["next_slot"] == rows[0]["slot"], previewed

        def fired() -> list[dict[str, str]] | None:
            dump = run.tool("dump")
            (task,) = [t for t in dump["tasks"] if t["name"] == previewed["name"]]
            runs = [r for r in dump["runs"] if r["task_id"] == task["id"]]
            done = len(runs) == RUNS and all(r["dispatched_at"] for r in runs)
            return sorted(runs, key=lambda r: r["slot"]) if done else None

        runs = run.wait_for(fired, f"{RUNS} runs dispatched", timeout=60)
        codes = run.stop()
        assert set(codes.values()) == {0}, f"exit codes {codes}\n{run.logs()}"
        assert [r["slot"] for r in runs] == [row["slot"] for row in rows]
        for r, row in zip(runs, rows, strict=True):
            fires_at = datetime.fromisoformat(row["fires_at"])
            claimed = datetime.fromisoformat(r["claimed_at"])
            dispatched = datetime.fromisoformat(r["dispatched_at"])
            assert datetime.fromisoformat(row["due"]) <= fires_at <= claimed <= dispatched, (
                r,
                row,
            )
        # each slot published once, received never before the instant previewed
        fires = {datetime.fromisoformat(row["slot"]): row["fires_at"] for row in rows}
        mine = [m for m in run.received if m.slot in fires]
        assert Counter(m.slot for m in mine) == Counter(list(fires)), mine
        assert all(m.received_at >= datetime.fromisoformat(fires[m.slot]) for m in mine), mine
    finally:
        run.close()
