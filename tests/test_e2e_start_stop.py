"""End to end: how real beats start and stop.

A beat whose configuration fails a check refuses to start with the check's message, not a
traceback.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests import settings as test_settings
from tests.e2e.harness import ROOT, SCHEDULER, E2ERun

pytestmark = pytest.mark.e2e

BACKEND = "postgresql" if test_settings.TEST_DB == "postgres" else "sqlite"


def test_beat_with_use_tz_off_refuses_to_start_with_the_check_message(tmp_path: Path) -> None:
    run = E2ERun(BACKEND, tmp_path)
    try:
        beat = subprocess.run(
            [sys.executable, "-m", "celery", "-A", "tests.e2e.celery_app", "beat", "-S",
             SCHEDULER, "--loglevel", "INFO", "-s", str(tmp_path / "beat")],
            cwd=ROOT, env={**run.env, "DRIFTSAFE_E2E_USE_TZ": "false"}, capture_output=True,
            text=True, timeout=120, check=False,
        )
    finally:
        run.close()
    output = beat.stdout + beat.stderr
    assert beat.returncode == 1, output
    assert "celery_driftsafe.E010: USE_TZ = False" in beat.stderr, output
    assert "HINT: set USE_TZ = True" in beat.stderr, output
    assert "Traceback" not in output, output
