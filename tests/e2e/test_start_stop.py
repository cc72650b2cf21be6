"""End to end: how real beats start and stop.

A beat whose configuration fails a check refuses to start with the check's message, not a
traceback.

A SIGTERM (what every deploy sends) stops a beat cleanly at any moment: twelve real
``celery beat`` processes, a few at a time, each get one SIGTERM at a random moment after they
became able to handle signals: during the set-up (node registration, clock measurement,
``beat_schedule`` sync), inside claim rounds, while waiting. Every one must exit with code 0
and leave its node row marked stopped, with no traceback in its log.

"Able to handle signals" is read from ``/proc/<pid>/status`` (``SigCgt``): before any handler
is installed, the kernel's default action ends the process with -SIGTERM before it has a node
row, and nothing in Python can change that.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest

from celery_driftsafe.testing.faketime import FaketimeUnavailable, libfaketime_path
from tests import settings as test_settings
from tests.e2e.harness import (
    ROOT,
    SCHEDULER,
    Beat,
    E2ERun,
    real_now,
    wait_until_handles_sigterm,
)
from tests.skip_guard import configuration

# One database is enough here (start-up and shut-down do not depend on the database): the suite
# must stay under 15 minutes.
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        test_settings.TEST_DB != "postgres", reason=configuration("runs on the PostgreSQL pass")
    ),
]

BACKEND = "postgresql" if test_settings.TEST_DB == "postgres" else "sqlite"
BEATS = 12
AT_ONCE = 4
SEED = 20261130


def _terminate_after(beat: Beat, delay: float) -> str:
    """Wait until ``beat`` handles SIGTERM, then ``delay`` seconds, then send it one."""
    if not wait_until_handles_sigterm(beat.process):
        return f"exited with {beat.process.returncode} before handling signals"
    time.sleep(delay)
    beat.process.send_signal(signal.SIGTERM)
    return ""


def test_sigterm_at_any_moment_stops_cleanly(tmp_path: Path) -> None:
    try:
        libfaketime_path()
    except FaketimeUnavailable as exc:
        pytest.skip(str(exc))
    rng = random.Random(SEED)
    # A third land in the first 0.15 s (the set-up: connecting, measuring the clock,
    # registering the node), a third in the first rounds, a third later (rounds and waits).
    spans = [(0.0, 0.15), (0.15, 1.0), (1.0, 4.0)]
    delays = [rng.uniform(*spans[i % 3]) for i in range(BEATS)]
    run = E2ERun(BACKEND, tmp_path)
    outcomes: list[tuple[int, float, Beat, str]] = []
    try:
        run.seed(
            [
                {
                    "name": f"every-1s-{i:02d}",
                    "schedule_kind": "interval",
                    "interval_every": 1,
                    "interval_unit": "seconds",
                }
                for i in range(10)
            ],
            real_now() + timedelta(seconds=2),
        )
        for wave in range(0, BEATS, AT_ONCE):
            indexes = range(wave, min(wave + AT_ONCE, BEATS))
            # Every other beat's clock is skewed, as in the other end-to-end runs.
            beats = [run.start_beat(2.5 if i % 2 else 0.0) for i in indexes]
            with ThreadPoolExecutor(len(beats)) as pool:
                notes = list(pool.map(_terminate_after, beats, [delays[i] for i in indexes]))
            for i, beat, note in zip(indexes, beats, notes, strict=True):
                try:
                    beat.process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    note = note or "did not exit within 60 s of SIGTERM"
                outcomes.append((i, delays[i], beat, note))
        dump = run.tool("dump")
    finally:
        run.close()
    nodes: dict[int, list[dict[str, object]]] = {}
    for node in dump["nodes"]:
        nodes.setdefault(int(str(node["node_id"]).split(":")[1]), []).append(node)
    problems = []
    for i, delay, beat, note in outcomes:
        own = nodes.get(beat.process.pid, [])
        where = f"beat {i} (SIGTERM {delay:.3f} s after it handled signals)"
        if note:
            problems.append(f"{where}: {note}")
        elif beat.process.returncode != 0:
            problems.append(f"{where}: exit code {beat.process.returncode}")
        elif not own:
            problems.append(f"{where}: no node row")
        elif any(node["stopped"] is None for node in own):
            problems.append(f"{where}: node not marked stopped {own}")
        elif "Traceback" in beat.log.read_text():
            problems.append(f"{where}: traceback in its log")
        if problems and problems[-1].startswith(where):
            problems[-1] += "\n" + beat.log.read_text()[-2500:]
    print(
        f"\n{len(outcomes)} beats, SIGTERM after "
        + ", ".join(f"{delay:.2f}" for _, delay, _, _ in outcomes)
        + " s"
    )
    assert not problems, "\n\n".join(problems)


def test_beat_with_use_tz_off_refuses_to_start_with_the_check_message(tmp_path: Path) -> None:
    run = E2ERun(BACKEND, tmp_path)
    try:
        beat = subprocess.run(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "tests.e2e.celery_app",
                "beat",
                "-S",
                SCHEDULER,
                "--loglevel",
                "INFO",
                "-s",
                str(tmp_path / "beat"),
            ],
            cwd=ROOT,
            env={**run.env, "DRIFTSAFE_E2E_USE_TZ": "false"},
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        run.close()
    output = beat.stdout + beat.stderr
    assert beat.returncode == 1, output
    assert "celery_driftsafe.E010: USE_TZ = False" in beat.stderr, output
    assert "HINT: set USE_TZ = True" in beat.stderr, output
    assert "Traceback" not in output, output
