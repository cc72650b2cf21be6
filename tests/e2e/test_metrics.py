"""End-to-end: a real ``celery beat`` with ``METRICS_PORT`` set, its wall clock skewed with
libfaketime, scraped over HTTP while it fires: the counters move with the slots it fires, the
lateness histogram fills, the clock offset gauge shows the skew, and the port closes when the
beat stops. And a real prefork worker in prometheus-client's multiprocess mode: its main
process serves the executions its two pool processes counted."""

from __future__ import annotations

import time
import urllib.error
from collections import Counter
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from celery_driftsafe.testing.processes import free_port
from tests import settings as test_settings
from tests.e2e.harness import E2ERun, real_now
from tests.support.metrics import scrape, value

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("needs_faketime")]
BACKEND = "postgresql" if test_settings.TEST_DB == "postgres" else "sqlite"
SKEW = 0.8


def _scrape_until(port: int, ready: Any, run: E2ERun, timeout: float = 60.0) -> dict[Any, float]:
    deadline = time.monotonic() + timeout
    samples: dict[Any, float] | None = None
    while True:
        try:
            samples = scrape(port)
            if ready(samples):
                return samples
        except (urllib.error.URLError, ConnectionError):
            pass  # not serving yet
        assert time.monotonic() < deadline, (
            f"the metrics on port {port} never got there; last scrape: {samples}\n{run.logs()}"
        )
        time.sleep(0.2)


def test_a_real_beat_serves_figures_that_move_as_its_slots_fire(tmp_path: Path) -> None:
    """Each task fires ``runs`` runs and is then done (``max_runs``), so the figures come to
    rest at a number known in advance: the beat claims and publishes each run once and counts
    it once, and each of them reaches the broker once."""
    port = free_port()
    run = E2ERun(BACKEND, tmp_path)
    tasks, runs = 3, 5
    total = tasks * runs
    try:
        start = real_now() + timedelta(seconds=2)
        run.seed(
            [
                {
                    "name": f"every-1s-{i}",
                    "schedule_kind": "interval",
                    "interval_every": 1,
                    "interval_unit": "seconds",
                    "max_runs": runs,
                }
                for i in range(tasks)
            ],
            start,
        )
        run.start_recorder()
        run.start_beat(SKEW, env={"DRIFTSAFE_E2E_METRICS_PORT": str(port)})
        first = _scrape_until(
            port, lambda s: value(s, "driftsafe_beat_slots_published_total") >= 3, run
        )
        # every run of every task claimed: nothing more is due, the figures are at rest (a
        # round counts its claims once it has published them and counted that)
        later = _scrape_until(
            port, lambda s: value(s, "driftsafe_beat_slots_claimed_total") >= total, run
        )
        codes = run.stop()
        assert codes == {"beat-0": 0}, run.logs()
        published = value(later, "driftsafe_beat_slots_published_total")
        assert value(first, "driftsafe_beat_slots_published_total") < published
        assert value(later, "driftsafe_beat_slots_claimed_total") == published == total
        assert value(later, "driftsafe_beat_slots_failed_total") == 0
        assert value(later, "driftsafe_beat_dispatch_lateness_seconds_count") == published
        assert value(later, "driftsafe_beat_round_duration_seconds_count") > value(
            first, "driftsafe_beat_round_duration_seconds_count"
        )
        # authority minus the node's clock: the node runs SKEW ahead
        assert value(later, "driftsafe_beat_clock_offset_seconds") == pytest.approx(-SKEW, abs=0.25)
        assert value(later, "driftsafe_beat_nodes_alive") == 1
        assert value(later, "driftsafe_beat_claiming_paused") == 0
        last_round = value(later, "driftsafe_beat_last_round_timestamp_seconds")
        assert abs(last_round - real_now().timestamp()) < 30
        # every run the ledger holds as fired was published once and counted once: the
        # recorder (drained by stop) saw each of its slots once, and nothing else
        fired = {
            (row["task_id"], datetime.fromisoformat(row["slot"]))
            for row in run.tool("dump")["runs"]
            if row["status"] != "missed"
        }
        seen = Counter((m.periodic_task_id, m.slot) for m in run.received)
        assert set(seen) == fired, (sorted(seen), sorted(fired))
        assert len(run.received) == len(seen) == published, seen.most_common(3)
        with pytest.raises(urllib.error.URLError):
            scrape(port)  # the stopped beat no longer serves
    finally:
        run.close()


def test_a_prefork_worker_serves_what_its_pool_processes_counted(tmp_path: Path) -> None:
    beat_port, worker_port = free_port(), free_port()
    multiproc = tmp_path / "prometheus"
    multiproc.mkdir()
    run = E2ERun(BACKEND, tmp_path)
    try:
        start = real_now() + timedelta(seconds=2)
        run.seed(
            [
                {
                    "name": "slot-work",
                    "schedule_kind": "interval",
                    "interval_every": 1,
                    "interval_unit": "seconds",
                    "task": "e2e.slot_work",
                    "kwargs": {"seconds": 1.3},
                }
            ],
            start,
        )
        run.start_worker(
            "pf",
            pool="prefork",
            concurrency=2,
            env={
                "DRIFTSAFE_E2E_WORKER_METRICS_PORT": str(worker_port),
                "PROMETHEUS_MULTIPROC_DIR": str(multiproc),
            },
        )
        run.start_beat(0.0, env={"DRIFTSAFE_E2E_METRICS_PORT": str(beat_port)})
        executions = "driftsafe_worker_executions_total"

        def succeeded(samples: dict[Any, float]) -> float:
            return value(samples, executions, task="e2e.slot_work", outcome="succeeded")

        _scrape_until(worker_port, lambda s: succeeded(s) >= 6, run)
        run.stop()  # the beat; the worker finishes what was published
        log_path = Path(run.env["DRIFTSAFE_E2E_EXEC_LOG"])

        def all_counted(samples: dict[Any, float]) -> bool:
            return succeeded(samples) == len(log_path.read_text().splitlines())

        got = _scrape_until(worker_port, all_counted, run)  # every body run, counted once
        log = log_path.read_text().splitlines()
        pids = {line.split()[2] for line in log}
        # bodies take longer than the interval, so both pool processes ran some
        assert len(pids) == 2, f"both pool processes should have run bodies: {log}"
        assert len(list(multiproc.glob("counter_*.db"))) >= 2  # one file per process
        assert value(got, "driftsafe_worker_fenced_out_total", task="e2e.slot_work") == 0
    finally:
        run.close()
