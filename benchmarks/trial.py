"""Process and database plumbing of the comparison: one :class:`Services` per benchmark run,
one :class:`Trial` per (scheduler, scenario, size).

A trial gets its own PostgreSQL database (a copy of a template migrated once per run, so every
trial starts from the same empty tables), its own key prefix in the schedule store, its own
broker queue and a :class:`~benchmarks.recorder.Recorder` on it. Beats are real
``celery beat`` processes; a skewed one runs under libfaketime
(:mod:`celery_driftsafe.testing.faketime`), its skew verified before it starts. A sampler
thread reads each beat's CPU time and resident memory from ``/proc`` twice a second.

The schedule store (RedBeat's schedule and lock, celery_driftsafe's locks and wake-ups) and the
broker are two ``redis-server`` processes of the run's own, so the store's command counter
counts only the schedulers' traffic. Without ``redis-server`` on PATH both fall back to
``DRIFTSAFE_BENCH_REDIS_URL`` (default database 9 of the local Redis, which no test uses).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
import redis

from benchmarks.peers import BEAT_ARGS, Entry, Peer
from benchmarks.recorder import Recorder
from celery_driftsafe.testing.faketime import cleanup_killed, skewed_env, verify_skew

ROOT = Path(__file__).resolve().parents[1]
PG = {
    "host": os.environ.get("DRIFTSAFE_TEST_PG_HOST", "127.0.0.1"),
    "port": os.environ.get("DRIFTSAFE_TEST_PG_PORT", "5432"),
    "user": os.environ.get("DRIFTSAFE_TEST_PG_USER", "postgres"),
}
BROKER_URL = os.environ.get("DRIFTSAFE_BENCH_REDIS_URL", "redis://127.0.0.1:6379/9")
_TICKS = os.sysconf("SC_CLK_TCK")


def pg_exec(sql: str, dbname: str = "postgres") -> list[tuple[Any, ...]]:
    with psycopg.connect(**PG, dbname=dbname, autocommit=True) as conn:
        cursor = conn.execute(sql)
        return cursor.fetchall() if cursor.description else []


def _postmaster_start() -> Any:
    return pg_exec("SELECT pg_postmaster_start_time()")[0][0]


class Disturbed(RuntimeError):
    """Something outside the benchmark restarted PostgreSQL during a trial."""


def _child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BENCH_", "DJANGO_"))}
    env.update(DJANGO_SETTINGS_MODULE="benchmarks.bench_settings", PYTHONPATH=str(ROOT),
               PYTHONUNBUFFERED="1", **extra)
    return env


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Services:
    """Shared by every trial of one run: template database, Redis servers, work directory."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.token = uuid.uuid4().hex[:6]
        self._ids = itertools.count(1)
        self.template = f"dsbench_{self.token}_template"
        self.redis_processes: list[subprocess.Popen[bytes]] = []
        # Two servers of the run's own: the store's command counter then counts only the
        # schedulers' traffic, and nothing else on the machine (a test restarting the shared
        # Redis) can disturb the broker. Without redis-server both fall back to BROKER_URL.
        self.store_url = self._start_redis("store")
        self.broker_url = self._start_redis("broker")
        pg_exec(f"CREATE DATABASE {self.template}")
        result = subprocess.run(
            [sys.executable, "-m", "django", "migrate", "--verbosity", "0"], cwd=ROOT,
            env=_child_env(BENCH_DB=self.template, BENCH_STORE_URL=self.store_url),
            capture_output=True, text=True, check=False,
        )
        if result.returncode:
            self.close()
            raise RuntimeError(f"migrate failed:\n{result.stderr}")

    def _start_redis(self, name: str) -> str:
        server = shutil.which("redis-server")
        if server is None:
            return BROKER_URL
        port = _free_port()
        folder = self.workdir / f"redis-{name}"
        folder.mkdir()
        self.redis_processes.append(subprocess.Popen(
            [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(folder)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        ))
        url = f"redis://127.0.0.1:{port}/0"
        client = redis.Redis.from_url(url)
        for _ in range(200):
            with contextlib.suppress(redis.ConnectionError):
                if client.ping():
                    break
            time.sleep(0.05)
        client.close()
        return url

    @property
    def own_redis(self) -> bool:
        return bool(self.redis_processes)

    def next_id(self) -> int:
        return next(self._ids)

    def close(self) -> None:
        pg_exec(f"DROP DATABASE IF EXISTS {self.template} WITH (FORCE)")
        for process in self.redis_processes:
            process.terminate()
            process.wait(timeout=10)


@dataclass
class Beat:
    offset: float
    process: subprocess.Popen[bytes]
    log: Path
    launched: float
    measured_offset: float
    cpu: float = 0.0  # user + system seconds, last sample
    cpu_mark: float = 0.0  # at Trial.mark()
    peak_rss_kb: int = 0
    killed_at: float | None = None

    @property
    def pid(self) -> int:
        return self.process.pid


@dataclass
class Counters:
    """Cumulative counters of the trial's database and of the schedule store."""

    at: float
    xacts: int
    rows_read: int
    rows_written: int
    store_commands: int


@dataclass
class Trial:
    """One scheduler in one scenario: its database, prefix, queue, recorder and beats."""

    services: Services
    peer: Peer
    tuned: bool = False
    beats: list[Beat] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = self.services.next_id()
        self.db = f"dsbench_{self.services.token}_{n}"
        self.prefix = f"dsbench-{self.services.token}-{n}"
        self.queue = f"{self.prefix}:queue"
        self.dir = self.services.workdir / f"{n:02d}-{self.peer.key}"
        self.dir.mkdir()
        pg_exec(f"CREATE DATABASE {self.db} TEMPLATE {self.services.template}")
        self.env = _child_env(
            BENCH_DB=self.db, BENCH_STORE_URL=self.services.store_url,
            BENCH_BROKER_URL=self.services.broker_url, BENCH_PREFIX=self.prefix,
            BENCH_QUEUE=self.queue,
            **(self.peer.tuned if self.tuned else {}),
        )
        self.postgres_started = _postmaster_start()
        self.recorder = Recorder(self.services.broker_url, self.queue)
        self.recorder.start()
        self.store = redis.Redis.from_url(self.services.store_url)
        self._sampling = threading.Event()
        self._sampler = threading.Thread(target=self._sample_loop, daemon=True)
        self._sampler.start()

    # -- seeding and edits (in a child process with the trial's settings) ---------------------

    def _child(self, command: str, payload: dict[str, Any], timeout: float) -> Any:
        result = subprocess.run(
            [sys.executable, "-m", "benchmarks.peers", self.peer.key, command], cwd=ROOT,
            env=self.env, input=json.dumps(payload), capture_output=True, text=True,
            timeout=timeout, check=False,
        )
        if result.returncode:
            raise RuntimeError(f"{self.peer.key} {command} failed:\n{result.stderr[-3000:]}")
        return json.loads(result.stdout)

    def seed(self, entries: list[Entry]) -> float:
        """Store ``entries`` the scheduler's documented way; returns the seconds it took."""
        began = time.time()
        self._child("seed", {"entries": [e.to_json() for e in entries]}, timeout=900)
        return time.time() - began

    def set_intervals(self, edits: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Apply ``edits`` ({index, every, at}) one by one at their planned true times; each
        comes back stamped with the true time right after it committed."""
        wait = max(0.0, max(datetime.fromisoformat(e["at"]).timestamp() for e in edits)
                   - time.time())
        done: list[dict[str, Any]] = self._child("set_interval", {"edits": edits},
                                                 timeout=wait + 120)["edits"]
        return done

    # -- beats ------------------------------------------------------------------------------

    def start_beat(self, offset: float = 0.0, *, wait_banner: float = 0.0) -> Beat:
        """Start one ``celery beat`` whose wall clock is ``offset`` seconds off (verified
        first); with ``wait_banner``, wait until it printed its banner, then that long more."""
        env = skewed_env(offset, self.env)
        measured = verify_skew(env, offset) if offset else 0.0
        i = len(self.beats)
        log = self.dir / f"beat-{i}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "celery", *BEAT_ARGS, "-S", self.peer.scheduler,
                 "-s", str(self.dir / f"beat-{i}-schedule")],
                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
            )
        beat = Beat(offset, process, log, time.time(), measured)
        self.beats.append(beat)
        if wait_banner:
            deadline = time.time() + 30
            while time.time() < deadline and process.poll() is None \
                    and b"Configuration" not in log.read_bytes():
                time.sleep(0.05)
            time.sleep(wait_banner)
        return beat

    def beat_by_pid(self, pid: int | None) -> Beat | None:
        return next((b for b in self.beats if b.pid == pid), None)

    def kill(self, beat: Beat) -> float:
        """SIGKILL ``beat``; returns the true time of the kill."""
        at = time.time()
        beat.process.send_signal(signal.SIGKILL)
        beat.process.wait(timeout=10)
        beat.killed_at = at
        cleanup_killed(beat.pid)  # libfaketime's shared memory outlives a SIGKILL
        return at

    def stop(self) -> None:
        """SIGTERM every beat (SIGKILL after 15 s), then let the recorder drain."""
        for beat in self.beats:
            if beat.process.poll() is None:
                beat.process.send_signal(signal.SIGTERM)
        for beat in self.beats:
            try:
                beat.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                beat.process.kill()
                beat.process.wait()
                cleanup_killed(beat.pid)
        self._sampling.set()
        self.recorder.stop()

    def check_undisturbed(self) -> None:
        """Raise :class:`Disturbed` if PostgreSQL restarted since the trial began (the
        machine is shared; other test suites restart it)."""
        if _postmaster_start() != self.postgres_started:
            raise Disturbed("PostgreSQL was restarted during the trial")

    def close(self) -> None:
        for beat in self.beats:
            if beat.process.poll() is None:
                beat.process.kill()
                beat.process.wait()
                cleanup_killed(beat.pid)
        self._sampling.set()
        self.recorder.stop(timeout=1)
        batch: list[bytes] = []
        for key in self.store.scan_iter(f"{self.prefix}:*", count=5000):
            batch.append(key)
            if len(batch) == 5000:
                self.store.delete(*batch)
                batch.clear()
        if batch:
            self.store.delete(*batch)
        self.store.close()
        pg_exec(f"DROP DATABASE IF EXISTS {self.db} WITH (FORCE)")

    def logs(self, tail: int = 2000) -> str:
        return "\n".join(f"--- {b.log.name}\n{b.log.read_text(errors='replace')[-tail:]}"
                         for b in self.beats)

    # -- measurements -----------------------------------------------------------------------

    def _sample_loop(self) -> None:
        while not self._sampling.wait(0.5):
            for beat in list(self.beats):
                if beat.process.poll() is not None:
                    continue
                with contextlib.suppress(OSError, ValueError, IndexError):
                    with open(f"/proc/{beat.pid}/stat") as stat:
                        fields = stat.read().rsplit(")", 1)[1].split()
                    beat.cpu = (int(fields[11]) + int(fields[12])) / _TICKS
                    with open(f"/proc/{beat.pid}/status") as status:
                        for line in status:
                            if line.startswith("VmRSS:"):
                                beat.peak_rss_kb = max(beat.peak_rss_kb, int(line.split()[1]))

    def mark(self) -> None:
        """Start of the measured window for CPU time."""
        for beat in self.beats:
            beat.cpu_mark = beat.cpu

    def counters(self) -> Counters:
        row = pg_exec(
            "SELECT xact_commit + xact_rollback, tup_returned + tup_fetched, "
            "tup_inserted + tup_updated + tup_deleted FROM pg_stat_database "
            f"WHERE datname = '{self.db}'"
        )[0]
        info = self.store.info("stats")
        return Counters(time.time(), int(row[0]), int(row[1]), int(row[2]),
                        int(info["total_commands_processed"]))

    def lock_ttl(self) -> float | None:
        """Seconds left on RedBeat's lock (None when there is none)."""
        ttl = self.store.pttl(f"{self.prefix}:redbeat::lock")
        return ttl / 1000 if ttl and ttl > 0 else None
