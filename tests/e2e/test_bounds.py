"""End-to-end: bounds, run limits and jitter with several real ``celery beat`` processes whose
wall clocks are really skewed apart (libfaketime), one database and one Redis. Every published
message is counted: each jittered slot once and never before its jittered instant, a limited
task exactly as often as allowed, nothing outside the bounds.
"""

from __future__ import annotations

import time
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from celery_driftsafe.core.jitter import offset
from celery_driftsafe.core.schedules import Interval
from tests import settings as test_settings
from tests.e2e.harness import E2ERun, real_now
from tests.skip_guard import configuration

# On the PostgreSQL pass only: bounds, limits and jitter do not depend on the database (the
# SQLite claim path has its own end-to-end run in tests/e2e/test_beats.py), and the suite must
# stay under 15 minutes.
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.usefixtures("needs_faketime"),
    pytest.mark.skipif(
        test_settings.TEST_DB != "postgres", reason=configuration("runs on the PostgreSQL pass")
    ),
]

BACKEND = "postgresql" if test_settings.TEST_DB == "postgres" else "sqlite"
S = timedelta(seconds=1)


def test_skewed_beats_honour_bounds_limits_and_jitter(tmp_path: Path) -> None:
    offsets = [0.0, 2.5, -4.0]
    run = E2ERun(BACKEND, tmp_path)
    try:
        run.start_recorder()
        for skew in offsets:
            run.start_beat(skew)
        run.wait_until_claiming()  # the slots below fall due while the beats claim
        start = real_now().replace(microsecond=0) + 4 * S
        end = start + 24 * S
        jittered = [f"jitter-{i}" for i in range(8)]
        specs: list[dict[str, Any]] = [
            {
                "name": name,
                "schedule_kind": "interval",
                "interval_every": 3,
                "interval_unit": "seconds",
                "jitter_seconds": 2.5,
            }
            for name in jittered
        ]
        specs += [
            {
                "name": "three-runs",
                "schedule_kind": "interval",
                "interval_every": 1,
                "interval_unit": "seconds",
                "max_runs": 3,
            },
            {
                "name": "once",
                "schedule_kind": "crontab",
                "crontab_second": "*/2",
                "crontab_minute": "*",
                "run_once": True,
            },
            {
                "name": "window",
                "schedule_kind": "interval",
                "interval_every": 1,
                "interval_unit": "seconds",
                "valid_from": (start + 5 * S).isoformat(),
                "valid_until": (start + 12 * S).isoformat(),
            },
        ]
        run.seed(specs, start)
        time.sleep(max((end - real_now()).total_seconds(), 0))
        codes = run.stop()
        dump = run.tool("dump")
        assert set(codes.values()) == {0}, f"exit codes {codes}\n{run.logs()}"
        assert "Traceback" not in run.logs(), run.logs()
        tasks = {t["name"]: t for t in dump["tasks"]}
        by_name: dict[str, list[Any]] = {name: [] for name in tasks}
        names = {t["id"]: t["name"] for t in dump["tasks"]}
        for message in run.received:
            by_name[names[message.periodic_task_id]].append(message)
        print("\n" + "\n".join(f"{n}: {len(m)} messages" for n, m in by_name.items()))

        # jitter: every slot up to the end once, under its slot, never before its instant
        for name in jittered:
            schedule = Interval(3 * S, start)
            expected = list(schedule.slots_between(start, end - 5 * S))
            counts = Counter(m.slot for m in by_name[name])
            assert all(counts[s] == 1 for s in expected), (name, counts, run.logs())
            assert all(c == 1 for c in counts.values()), (name, counts)
            for m in by_name[name]:
                due = m.slot + offset(name, m.slot, 2.5)
                assert m.received_at >= due, (name, m.slot, due, m.received_at)
        # the instants differ between tasks: the wave at each slot is spread
        assert len({offset(name, start, 2.5) for name in jittered}) == len(jittered)

        # max runs: exactly three, the first three slots, then disabled with the reason
        three = sorted(m.slot for m in by_name["three-runs"])
        assert three == [start, start + S, start + 2 * S], three
        assert not tasks["three-runs"]["enabled"]
        assert tasks["three-runs"]["disabled_reason"].startswith("finished: max runs")

        # run once (a crontab with seconds): one message, then disabled
        assert len(by_name["once"]) == 1
        assert not tasks["once"]["enabled"]
        assert tasks["once"]["disabled_reason"] == "finished: run once: it fired its run"

        # bounds: every slot in [from, until) once, nothing outside
        window = sorted(m.slot for m in by_name["window"])
        assert window == [start + k * S for k in range(5, 12)], window
        assert not tasks["window"]["enabled"]
        assert tasks["window"]["disabled_reason"].startswith("finished: valid until")
        slots = [(r["task_id"], r["slot"]) for r in dump["runs"]]
        assert len(slots) == len(set(slots)), "two run rows for one slot"
    finally:
        run.close()
