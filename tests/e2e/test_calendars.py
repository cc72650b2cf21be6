"""End-to-end: excluded dates and calendars with two real ``celery beat`` processes (clocks
skewed apart) and two real workers of different pools (prefork and threads, each on a queue of
its own), one PostgreSQL database and one Redis. A calendar excludes every third second (a
six-field crontab), so exclusion is exercised within seconds; another task's own excluded dates
cover the whole run. From the ledger: every slot not excluded ran once and succeeded, no
excluded slot has a run row of any status (not even missed), nothing ran twice.
"""

from __future__ import annotations

from collections import Counter
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from tests import settings as test_settings
from tests.e2e.harness import E2ERun, real_now
from tests.skip_guard import configuration

# On the PostgreSQL pass only (the claim's exclusions do not depend on the database; the claim
# tests run them on every database), so that the suite stays short.
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.usefixtures("needs_faketime"),
    pytest.mark.skipif(
        test_settings.TEST_DB != "postgres", reason=configuration("runs on the PostgreSQL pass")
    ),
]

S = timedelta(seconds=1)


def test_two_beats_and_two_workers_never_run_an_excluded_slot(tmp_path: Path) -> None:
    run = E2ERun("postgresql", tmp_path)
    try:
        prefork, threads = f"{run.queue}-prefork", f"{run.queue}-threads"
        run.start_worker("prefork", pool="prefork", concurrency=2, queue=prefork)
        run.start_worker("threads", pool="threads", concurrency=2, queue=threads)
        for skew in (0.0, 1.3):
            run.start_beat(skew)
        run.wait_until_claiming()  # the slots below fall due while the beats claim
        run.tool("calendars", [{"name": "thirds", "crontab": "*/3 * * * * *"}])
        start = real_now().replace(microsecond=0) + 3 * S
        end = start + 12 * S
        every_second: dict[str, Any] = {
            "task": "e2e.slot_work",
            "schedule_kind": "interval",
            "interval_every": 1,
            "interval_unit": "seconds",
        }
        days = sorted({start.date().isoformat(), (end + 60 * S).date().isoformat()})
        run.seed(
            [
                {**every_second, "name": "interval", "queue": prefork, "calendars": ["thirds"]},
                {
                    "name": "crontab",
                    "task": "e2e.slot_work",
                    "schedule_kind": "crontab",
                    "crontab_second": "*",
                    "crontab_minute": "*",
                    "queue": threads,
                    "calendars": ["thirds"],
                },
                {**every_second, "name": "dated", "queue": prefork, "excluded_dates": days},
            ],
            start,
        )
        tasks = {t["name"]: t["id"] for t in run.tool("dump")["tasks"]}
        expected = {
            name: [start + k * S for k in range(12) if (start + k * S).second % 3]
            for name in ("interval", "crontab")
        }

        def ran() -> dict[str, set[datetime]]:
            runs = run.tool("dump")["runs"]
            return {
                name: {
                    datetime.fromisoformat(r["slot"])
                    for r in runs
                    if r["task_id"] == tasks[name] and r["status"] == "succeeded"
                }
                for name in expected
            }

        # facts from the ledger, however slowly the loaded machine gets there
        run.wait_for(
            lambda: all(set(expected[n]) <= done for n, done in ran().items()),
            "every slot not excluded succeeded",
            timeout=120,
        )
        codes = run.stop()
        dump = run.tool("dump")
        assert set(codes.values()) == {0}, f"exit codes {codes}\n{run.logs()}"
        assert "Traceback" not in run.logs(), run.logs()
        names = {t["id"]: t["name"] for t in dump["tasks"]}
        rows: dict[str, list[dict[str, Any]]] = {name: [] for name in tasks}
        for r in dump["runs"]:
            rows[names[r["task_id"]]].append(r)
        executed = Counter(
            tuple(line.split()[:2])
            for line in (tmp_path / "executions.log").read_text().splitlines()
        )
        print(
            "\n"
            + "\n".join(
                f"{name}: {len(found)} run rows, {Counter(r['status'] for r in found)}"
                for name, found in rows.items()
            )
        )
        assert all(count == 1 for count in executed.values()), "a slot executed twice"
        for name in ("interval", "crontab"):
            slots = [datetime.fromisoformat(r["slot"]) for r in rows[name]]
            assert len(slots) == len(set(slots)), f"{name}: two run rows for one slot"
            # no excluded slot has a row: not fired, not skipped, not recorded missed
            assert all(slot.second % 3 for slot in slots), (name, sorted(slots))
            assert all(r["status"] != "missed" for r in rows[name]), rows[name]
            by_slot = {datetime.fromisoformat(r["slot"]): r for r in rows[name]}
            for slot in expected[name]:
                assert by_slot[slot]["status"] == "succeeded", (name, slot, by_slot[slot])
                assert executed[(str(tasks[name]), slot.isoformat())] == 1, (name, slot)
        # the prefork worker ran the interval's slots, the threads worker the crontab's
        workers = {name: {r["worker"].split("@")[0] for r in rows[name]} for name in expected}
        assert workers == {"interval": {"prefork"}, "crontab": {"threads"}}, workers
        # a task whose own excluded dates cover the run: no row at all, still enabled
        assert rows["dated"] == []
        dated = next(t for t in dump["tasks"] if t["name"] == "dated")
        assert dated["enabled"], dated
    finally:
        run.close()
