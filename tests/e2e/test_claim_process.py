"""End to end: a real beat works through waves with its claim process (``CLAIM_PROCESS``).

400 interval tasks every 10 s, all due at the same instants, and a beat claiming 20 tasks a
batch: the first wave starts the helper process, the later ones are claimed partly by it. Every
message is recorded off the real Redis broker: each slot of the window goes out exactly once,
none early. A SIGTERM stops the beat cleanly (exit code 0), and the helper with it: its
process is gone, and the beat's log says how many batches it claimed.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from tests import settings as test_settings
from tests.e2e.harness import SCHEDULER, Beat, E2ERun, real_now, wait_until_handles_sigterm
from tests.skip_guard import configuration

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        test_settings.TEST_DB != "postgres", reason=configuration("runs on the PostgreSQL pass")
    ),
]

TASKS = 400
EVERY = 10


def _ended(pid: int) -> bool:
    """Whether process ``pid`` is gone (or a zombie nobody reaped: it has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _seed_waves(run: E2ERun, prefix: str, beat: Beat) -> datetime:
    """Once ``beat`` is up: TASKS tasks every EVERY seconds, all first due at one instant a
    few seconds from now (returned), and the recorder started. Seeded before the beat is up,
    on a loaded machine whose beat starts slowly, the first waves fell due while no beat
    claimed: downtime, one run for them (the misfire policy), not a wave each."""
    run.wait_until_claiming(beat)
    start = (real_now() + timedelta(seconds=5)).replace(microsecond=0)
    run.seed(
        [
            {
                "name": f"{prefix}-{i:03d}",
                "schedule_kind": "interval",
                "interval_every": EVERY,
                "interval_unit": "seconds",
            }
            for i in range(TASKS)
        ],
        start,
    )
    run.start_recorder()
    return start


def test_a_beat_claims_its_waves_with_its_claim_process_and_stops_it(tmp_path: Path) -> None:
    run = E2ERun("postgresql", tmp_path, lease=30.0)
    try:
        beat = run.start_beat(0.0, env={"DRIFTSAFE_E2E_CLAIM_BATCH_SIZE": "20"})
        assert wait_until_handles_sigterm(beat.process)
        start = _seed_waves(run, "wave", beat)
        waves = 3
        end = start + timedelta(seconds=EVERY * (waves - 1))
        deadline = time.monotonic() + (end - real_now()).total_seconds() + 30
        while len(run.received) < TASKS * waves and time.monotonic() < deadline:
            time.sleep(0.5)
        codes = run.stop()
        log = beat.log.read_text(errors="replace")
        assert codes == {beat.name: 0}, log[-3000:]
        received = [m for m in run.received if m.slot is not None and m.slot <= end]
        per_slot = Counter((m.periodic_task_id, m.slot) for m in received)
        assert len(per_slot) == TASKS * waves, log[-3000:]
        assert max(per_slot.values()) == 1  # no slot twice
        assert all(m.received_at >= m.slot for m in received)  # none early
        started = re.search(r"starting a claim process \(pid (\d+)\)", log)
        assert started, log[-3000:]
        stopped = re.search(
            r"stopping the claim process \(pid \d+\): the beat stops; (\d+) batches", log
        )
        assert stopped and int(stopped.group(1)) >= 1, log[-3000:]
        helper = int(started.group(1))
        for _ in range(40):
            if _ended(helper):
                break
            time.sleep(0.25)
        assert _ended(helper)
    finally:
        run.close()


def test_an_embedded_beat_claims_with_its_helper_and_stops_it_with_the_worker(
    tmp_path: Path,
) -> None:
    """``celery worker -B``: the beat runs in a child process of the worker (billiard's), and
    starts its claim process from there; a SIGTERM to the worker ends the beat and the
    helper."""
    run = E2ERun("postgresql", tmp_path, lease=30.0)
    try:
        # the worker consumes another queue: the beat's messages stay for the recorder
        worker = run.children.start(
            "worker-embedded",
            [
                "-A",
                "tests.e2e.celery_app",
                "worker",
                "-B",
                "--scheduler",  # a worker's -S is its state database, not the scheduler
                SCHEDULER,
                "-s",
                str(tmp_path / "embedded-beat"),
                "-P",
                "solo",
                "-Q",
                f"{run.queue}-unused",
                "--loglevel",
                "INFO",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
            ],
            {**run.env, "DRIFTSAFE_E2E_CLAIM_BATCH_SIZE": "20"},
        )
        start = _seed_waves(run, "embedded", worker)
        waves = 2
        end = start + timedelta(seconds=EVERY * (waves - 1))
        deadline = time.monotonic() + (end - real_now()).total_seconds() + 30
        while len(run.received) < TASKS * waves and time.monotonic() < deadline:
            time.sleep(0.5)
        codes = run.children.stop(worker, timeout=60)
        log = worker.log.read_text(errors="replace")
        assert codes == {worker.name: 0}, log[-3000:]
        received = [m for m in run.received if m.slot is not None and m.slot <= end]
        per_slot = Counter((m.periodic_task_id, m.slot) for m in received)
        assert len(per_slot) == TASKS * waves, log[-3000:]
        assert max(per_slot.values()) == 1
        assert all(m.received_at >= m.slot for m in received)
        started = re.search(r"starting a claim process \(pid (\d+)\)", log)
        assert started, log[-3000:]
        assert "the claim process is not used" not in log, log[-3000:]
        helper = int(started.group(1))
        for _ in range(40):
            if _ended(helper):
                break
            time.sleep(0.25)
        assert _ended(helper), log[-3000:]
    finally:
        run.close()
