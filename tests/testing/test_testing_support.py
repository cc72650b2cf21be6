"""The process and recording helpers of ``celery_driftsafe.testing`` (shared by the end-to-end
tests, the benchmarks and the demo), and the benchmarks' registry.

Real processes, a real Redis: a child that handles SIGTERM exits 0, one that ignores it is
killed and reported as such; the recorder keeps arrival order and stamps from its clock.
"""

from __future__ import annotations

import itertools
import os
import shutil
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from celery_driftsafe.testing.processes import (
    Children,
    NoRedis,
    proc_stats,
    provide_redis,
    start_redis,
    wait_for_redis,
)
from celery_driftsafe.testing.recording import QueueRecorder, percentile
from tests import settings as test_settings
from tests.support import wait_until

CLEAN = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
    "while time.process_time() < 0.1: pass\n"  # CPU time for proc_stats to see
    "print('up', flush=True)\n"
    "time.sleep(60)\n"
)
STUBBORN = (
    "import signal, time\n"
    "signal.signal(signal.SIGTERM, lambda *_: None)\n"
    "print('up', flush=True)\n"
    "time.sleep(60)\n"
)


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([3.0, 1.0, 2.0], 50, 2.0),
        ([1.0, 2.0, 3.0, 4.0], 50, 2.0),
        ([1.0, 2.0, 3.0, 4.0], 75, 3.0),
        (list(map(float, range(1, 101))), 99, 99.0),
        ([5.0], 99, 5.0),
        ([1.0, 9.0], 100, 9.0),
        ([1.0, 9.0], 0, 1.0),
    ],
)
def test_percentile_is_nearest_rank(values: list[float], q: float, expected: float) -> None:
    assert percentile(values, q) == expected


def test_percentile_of_nothing_is_nan() -> None:
    assert percentile([], 50) != percentile([], 50)


def _logged(path: Path, text: str) -> bool:
    return text in (path.read_text() if path.exists() else "")


def test_children_stop_with_sigterm_and_kill_what_ignores_it(tmp_path: Path) -> None:
    children = Children(tmp_path)
    try:
        clean = children.start("clean", [], {}, command=[sys.executable, "-c", CLEAN])
        stubborn = children.start("stubborn", [], {}, command=[sys.executable, "-c", STUBBORN])
        for child in (clean, stubborn):
            wait_until(partial(_logged, child.log, "up"), f"{child.log.name}: up", timeout=20)
        rss, cpu = proc_stats(clean.pid)
        assert rss > 1000 and cpu >= 0.08  # the 0.1 s it spent, counted in clock ticks
        assert children.died() is None
        codes = children.stop(timeout=1.0)
        assert codes == {"clean": 0, "stubborn": None}
        assert not clean.alive() and not stubborn.alive()
        assert "--- clean.log (offset +0.0)\nup" in children.logs()
    finally:
        children.close()


def test_children_kill_records_the_time(tmp_path: Path) -> None:
    children = Children(tmp_path)
    try:
        child = children.start("victim", [], {}, command=[sys.executable, "-c", CLEAN])
        wait_until(lambda: _logged(child.log, "up"), f"{child.log.name}: up", timeout=20)
        before = time.time()
        at = children.kill(child)
        assert before <= at <= time.time() and child.killed_at == at
        assert child.process.returncode == -9
        assert children.died() is child
    finally:
        children.close()


def test_queue_recorder_keeps_arrival_order_and_its_clock(redis_client: Any) -> None:
    queue = "recorder-test"
    ticks = itertools.count(1000)
    recorder: QueueRecorder[tuple[bytes, float]] = QueueRecorder(
        test_settings.REDIS_URL,
        queue,
        lambda raw, stamp: None if raw == b"skip" else (raw, stamp),
        clock=lambda: float(next(ticks)),
    )
    recorder.start()
    try:
        redis_client.lpush(queue, b"first")
        deadline = time.monotonic() + 10
        while recorder.received < 1:
            assert time.monotonic() < deadline, "nothing recorded"
            time.sleep(0.01)
        # a burst: LPUSH puts the newest at the head, as Celery's Redis transport does
        for item in (b"a", b"skip", b"b", b"c"):
            redis_client.lpush(queue, item)
    finally:
        recorder.stop(timeout=10)
    messages = recorder.messages
    assert [raw for raw, _ in messages] == [b"first", b"a", b"b", b"c"]
    stamps = [stamp for _, stamp in messages]
    assert stamps == sorted(stamps) and all(s >= 1000 for s in stamps)
    assert recorder.received == 5


@pytest.mark.skipif(
    shutil.which("redis-server") is None,
    reason="no redis-server on PATH (apt-get install redis-server)",
)
def test_start_redis_runs_a_private_server_and_stops_it(tmp_path: Path) -> None:
    server = start_redis(tmp_path)
    try:
        wait_for_redis(server.url, server.process, timeout=5)
        assert server.process is not None and "127.0.0.1" in server.description
        same = provide_redis(server.url, tmp_path, cache=tmp_path, label="TEST_URL")
        assert same.process is None and same.description == f"{server.url} (TEST_URL)"
    finally:
        server.stop()
    assert server.process is not None and server.process.poll() is not None
    with pytest.raises(NoRedis):
        wait_for_redis(server.url, timeout=0.3)


def test_every_registered_benchmark_resolves(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each name imports its module and finds its function (modules set their Django
    defaults in os.environ on import: kept to this test)."""
    from benchmarks import REGISTRY
    from benchmarks.__main__ import resolve

    monkeypatch.setattr(os, "environ", dict(os.environ))
    assert {"compare", "burst", "recovery", "skew", "burst-profile", "task", "slots"} <= set(
        REGISTRY
    )
    for name in REGISTRY:
        assert callable(resolve(name)), name
    with pytest.raises(LookupError):
        resolve("no-such-benchmark")


@pytest.mark.django_db
@pytest.mark.parametrize("skew", [5.0, -2.5])
def test_a_skewed_authority_clock_measures_its_skew_and_keeps_the_authoritys_time(
    settings: Any, skew: float
) -> None:
    """The clock a demo gives a beat that believes its wall clock is off: the offset it
    measures is the skew (authority minus wall), and its time is still the authority's."""
    from celery_driftsafe import authority_clock
    from celery_driftsafe.testing import skewed_authority_clock

    settings.DRIFTSAFE = {**settings.DRIFTSAFE, "TIME_AUTHORITY": "database"}
    clock = skewed_authority_clock(skew)
    sample = clock.sync()
    assert sample.offset == pytest.approx(-skew, abs=1.0)  # a round trip under load
    assert abs((clock.now() - authority_clock().now()).total_seconds()) < 1.0
