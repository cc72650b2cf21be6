"""End-to-end: ``driftsafe_backfill`` commands (real processes) racing real ``celery beat``
processes over the same slots; the command's ``--rate`` and ``BACKFILL_MAX_SLOTS`` on the real
clock.

The race: a task every second whose next slot is moved back to the start of the range (as a
restore or a hand edit would), with the ``fire_all`` misfire policy, so the beats catch up the
very slots two backfills of the range are inserting at the same time; the range ends after
now, so the beats' slots on time fall inside it too. Every slot of the range must have one run
row and one message on the broker (by its slot and its Celery task id): none twice, none lost.
"""

from __future__ import annotations

import re
import sys
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from tests import settings as test_settings
from tests.e2e.harness import E2ERun, real_now
from tests.support import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("needs_faketime")]

BACKEND = "postgresql" if test_settings.TEST_DB == "postgres" else "sqlite"
S = timedelta(seconds=1)
SAID = re.compile(r"inserted (\d+) runs, published (\d+); (\d+) slots were taken meanwhile")


def _backfill_command(*args: str) -> list[str]:
    # --skip-checks: the e2e settings are a beat's and a worker's, with no admin middleware
    return [sys.executable, "-m", "django", "driftsafe_backfill", "--skip-checks", *args]


def _seed_every_second(run: E2ERun, name: str, start: Any) -> dict[str, Any]:
    """A task every second from ``start`` (its anchor and next slot); its row in the dump."""
    spec = {
        "name": name,
        "schedule_kind": "interval",
        "interval_every": 1,
        "interval_unit": "seconds",
        "misfire_policy": "fire_all",
    }
    run.seed([spec], start)
    return next(t for t in run.tool("dump")["tasks"] if t["name"] == name)


def _move_next_slot(run: E2ERun, name: str, instant: Any) -> None:
    """Set the task's next slot (and when it is due) by SQL, as a restore or a psql session."""
    value = instant.isoformat(sep=" ")
    run.tool("corrupt", [{"name": name, "set": f"next_slot_at = '{value}', due_at = '{value}'"}])


def test_backfills_racing_beats_run_each_slot_of_the_range_once(tmp_path: Path) -> None:
    offsets = [0.0, 1.5, -2.0] if BACKEND == "postgresql" else [1.5, -2.0]
    name = "raced"
    run = E2ERun(BACKEND, tmp_path)
    try:
        run.start_recorder()
        # Seeded before any beat runs, its next slot far ahead: nothing claims it until the
        # backfills have begun.
        start = (real_now() - 30 * S).replace(microsecond=0)
        task = _seed_every_second(run, name, start)
        _move_next_slot(run, name, start + timedelta(days=1))
        for offset in offsets:
            run.start_beat(offset)
        run.wait_until_claiming()
        # some seconds after now, so that the beats' slots on time are in it too, however long
        # the beats took to start on a loaded machine (the range is then longer)
        seconds = max(45, int((real_now() - start).total_seconds()) + 10)
        end = start + seconds * S
        assert end > real_now() + 5 * S
        expected = [start + k * S for k in range(seconds)]
        window = ["--task", name, "--from", start.isoformat(), "--to", end.isoformat()]
        # Two runs a second each: the backfills are still going when the beats catch up.
        backfills = [
            run.children.start(
                f"backfill-{n}", [], run.env, command=_backfill_command(*window, "--rate", "2/s")
            )
            for n in range(2)
        ]
        # The first backfilled message is on the broker: the schedule moves back to the start
        # of the range, and the beats catch up (fire_all) the slots the backfills are taking.
        wait_until(
            lambda: (
                any(m.periodic_task_id == task["id"] for m in run.received)
                or any(b.process.poll() for b in backfills)
            ),
            "a backfilled message on the broker (or a backfill to exit)",
            timeout=60,
            context=run.logs,
        )
        _move_next_slot(run, name, start)
        for backfill in backfills:
            assert backfill.process.wait(timeout=60) == 0, run.logs()
        time.sleep(max((end - real_now()).total_seconds(), 0) + 2)
        codes = run.stop()
        assert set(codes.values()) == {0}, f"exit codes {codes}\n{run.logs()}"
        assert "Traceback" not in run.logs(), run.logs()

        dump = run.tool("dump")
        runs = [r for r in dump["runs"] if r["task_id"] == task["id"]]
        in_range = [r for r in runs if start.isoformat() <= r["slot"] < end.isoformat()]
        rows = Counter(r["slot"] for r in in_range)
        assert sorted(rows) == [slot.isoformat() for slot in expected], "a slot has no run"
        assert set(rows.values()) == {1}, f"two run rows for one slot: {rows}"
        messages = [
            m for m in run.received if m.periodic_task_id == task["id"] and start <= m.slot < end
        ]
        published = Counter(m.slot for m in messages)
        doubled = {slot: n for slot, n in published.items() if n > 1}
        assert not doubled, f"published twice: {doubled}\n{run.logs()}"
        assert sorted(published) == expected, "a slot of the range was not published"
        ids = {r["slot"]: r["celery_task_id"] for r in in_range}
        for message in messages:
            assert message.celery_task_id == ids[message.slot.isoformat()]
        assert len({m.celery_task_id for m in messages}) == len(expected)

        # Both sides took slots: the backfills and the beats raced over the range. A run is the
        # backfills' by its kind: a beat's outbox takes over a backfill's claim left unpublished
        # past the lease (a slow machine), and then it is the beat's claim.
        backfilled = [r for r in in_range if r["run_kind"] == "backfill"]
        by_beats = [r for r in in_range if r["run_kind"] != "backfill"]
        taken_over = [r for r in backfilled if not r["claimed_by"].startswith("backfill:")]
        print(
            f"\n{BACKEND}: {len(backfilled)} slots backfilled "
            f"({len({r['claimed_by'] for r in backfilled})} backfills), "
            f"{len(by_beats)} claimed by the beats"
        )
        assert backfilled and by_beats, "no race: one side took every slot"
        # What each command said: the runs it inserted (and published), and the slots of its
        # plan that a beat or the other backfill took before it got there.
        said = [SAID.search(b.log.read_text()) for b in backfills]
        assert all(said), run.logs()
        counts = [tuple(int(n) for n in m.groups()) for m in said if m]
        assert sum(inserted for inserted, _, _ in counts) == len(backfilled)
        # each inserted run was published by its backfill or, taken over, by a beat (once:
        # no slot was published twice, above)
        published_by_backfills = sum(published for _, published, _ in counts)
        assert published_by_backfills + len(taken_over) == len(backfilled), (counts, taken_over)
        assert sum(lost for _, _, lost in counts) > 0, "no backfill met a slot taken meanwhile"
    finally:
        run.close()


def test_the_command_paces_by_rate_and_refuses_a_range_over_the_cap(tmp_path: Path) -> None:
    """No beat: the command alone, on the real clock, with ``BACKFILL_MAX_SLOTS = 20``."""
    run = E2ERun(BACKEND, tmp_path)
    run.env["DRIFTSAFE_E2E_BACKFILL_MAX_SLOTS"] = "20"
    try:
        run.start_recorder()
        start = (real_now() - 3600 * S).replace(microsecond=0)
        task = _seed_every_second(run, "paced", start)
        _move_next_slot(run, "paced", start + timedelta(days=1))  # no beat, but be sure

        def command(slots: int, *more: str) -> Any:
            window = ["--from", start.isoformat(), "--to", (start + slots * S).isoformat()]
            child = run.children.start(
                f"backfill-{slots}",
                [],
                run.env,
                command=_backfill_command("--task", "paced", *window, *more),
            )
            child.process.wait(timeout=60)
            return child

        refused = command(21)
        assert refused.process.returncode != 0
        assert "BACKFILL_MAX_SLOTS = 20" in refused.log.read_text(), refused.log.read_text()
        assert not [r for r in run.tool("dump")["runs"] if r["task_id"] == task["id"]]

        # 20 slots at 5 per second: chunks of 5, due 0 s, 1 s, 2 s and 3 s after the start.
        launched = real_now()  # the command's start is later: its pacing counts from there
        paced = command(20, "--rate", "5/s")
        assert paced.process.returncode == 0, paced.log.read_text()
        wait_until(
            lambda: len(run.received) >= 20, "all 20 published", timeout=30, context=run.logs
        )
        stamps = sorted(m.received_at for m in run.received)
        assert len(stamps) == 20
        # Never faster than the rate: chunk k (its first message, stamped on this machine's
        # clock as it reached the broker) not before k seconds after the command was launched.
        # Without pacing all twenty arrive within milliseconds of each other. (A chunk late on a
        # loaded machine shortens the gap to the next, due on time: gaps are not judged.)
        early = [(k, stamps[5 * k]) for k in (1, 2, 3) if stamps[5 * k] < launched + k * S]
        assert not early, f"published faster than 5/s (launched {launched}): {early}, {stamps}"
    finally:
        run.close()
