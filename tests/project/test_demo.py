"""The README's demo, shortened: ``python -m demo`` (``example_project/demo/``) run in
``example_project/`` for 20 s with this interpreter, as ``example_project/demo/demo.sh`` runs it.

Three beats with skewed clocks and a worker on the example project; the demo itself counts
every due slot and exits non-zero if one was doubled, missed or early. It gets its own
database (an SQLite file here, or a fresh PostgreSQL database on the PostgreSQL pass) and its
own ``redis-server`` (or, when none is installed, two databases of the test Redis that nothing
else uses), so it shares nothing with the rest of the suite.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import settings as test_settings

pytestmark = pytest.mark.e2e

PROJECT = Path(__file__).resolve().parents[2] / "example_project"
SECONDS = 20


@pytest.fixture
def redis_for_demo() -> dict[str, str]:
    """Nothing: the demo starts a Redis of its own (``redis-server``, which the suite needs)."""
    if not shutil.which("redis-server"):
        pytest.skip("redis-server is not installed: apt-get install redis-server")
    return {}


@pytest.fixture
def database_for_demo(tmp_path: Path) -> Iterator[dict[str, str]]:
    """An SQLite file in ``tmp_path``, or on the PostgreSQL pass a database of its own."""
    if test_settings.TEST_DB != "postgres":
        yield {"EXAMPLE_SQLITE_PATH": str(tmp_path / "demo.sqlite3")}
        return
    from celery_driftsafe.testing.processes import postgres_exec as run

    name = f"driftsafe_demo_{os.getpid()}"
    server = test_settings.postgres_server()
    host, port, user = server["HOST"], server["PORT"], server["USER"]
    run(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    run(f"CREATE DATABASE {name}")
    try:
        yield {"EXAMPLE_DATABASE": f"postgres://{user}@{host}:{port}/{name}"}
    finally:
        run(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def test_demo_fires_every_slot_once(
    redis_for_demo: dict[str, str], database_for_demo: dict[str, str], tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EXAMPLE_", "DEMO_"))}
    env.pop("DJANGO_SETTINGS_MODULE", None)  # the demo uses the example project's settings
    env.update(
        redis_for_demo,
        **database_for_demo,
        DEMO_SECONDS=str(SECONDS),
        DEMO_OUTPUT=str(tmp_path / "out"),
    )
    began = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "demo"],
        cwd=PROJECT,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    took = time.monotonic() - began
    output = result.stdout + result.stderr
    print(output, f"\n(the demo took {took:.0f} s)")
    assert result.returncode == 0, output
    assert "never early" in output and "p99 late" in output, "no table printed"
    for task in ("heartbeat-every-2s", "sync-inventory-every-5s", "expire-carts-every-3s"):
        assert task in output
    verdict = re.search(r"(\d+) slots due, 0 doubled, 0 missed, 0 early \(3 beats\)", output)
    assert verdict, output
    assert int(verdict[1]) >= SECONDS, "fewer slots due than the schedules give"
    assert "RESULT: every due slot ran exactly once" in output
    # The skew was really applied: each beat measured its offset from the authority as minus
    # its skew (offset = authority - node clock), within the measurement's error and 0.25 s.
    beats = re.findall(
        r"^([ABC])\s+([+-]\d+\.\d) s\s+(?:-|[+-]\d+\.\d+ s)\s+([+-]\d+\.\d+) s\s+([\d.]+) ms",
        output,
        re.M,
    )
    assert [b[0] for b in beats] == ["A", "B", "C"], output
    skews = {label: float(skew) for label, skew, _, _ in beats}
    assert skews == {"A": 0.0, "B": 2.5, "C": -4.0}
    for label, skew, offset, error_ms in beats:
        off_by = abs(float(offset) + float(skew))
        assert off_by <= 0.25 + float(error_ms) / 1000, f"beat {label}: skew {skew} s not seen"
    for label in "ABC":
        assert (tmp_path / "out" / f"beat-{label}.log").is_file()
    picture = tmp_path / "out" / "timeline.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "no picture: matplotlib is not installed" in output
    else:
        assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", "no PNG written"
