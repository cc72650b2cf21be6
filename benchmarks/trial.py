"""Process and database plumbing of the comparison: one :class:`Services` per benchmark run,
one :class:`Trial` per (scheduler, scenario, size).

A trial gets its own PostgreSQL database (a copy of a template migrated once per run, so every
trial starts from the same empty tables), its own key prefix in the schedule store, its own
broker queue and a :class:`~benchmarks.recorder.Recorder` on it. Beats are real
``celery beat`` processes started with :mod:`celery_driftsafe.testing.processes` (shared
with the end-to-end tests and the demo); a skewed one runs under libfaketime, its skew
verified before it starts. A sampler thread reads each beat's CPU time and resident memory
from ``/proc`` twice a second.

The schedule store (RedBeat's schedule and lock, celery_driftsafe's locks and wake-ups) and the
broker are two ``redis-server`` processes of the run's own, so the store's command counter
counts only the schedulers' traffic. Without ``redis-server`` on PATH both are the Redis
database that ``DRIFTSAFE_BENCH_REDIS_URL`` names, if set (a server of the machine's is never
written to unasked); otherwise the run stops, saying so.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import redis

from benchmarks.peers import BEAT_ARGS, Entry, Peer, entry_name
from benchmarks.recorder import Recorder
from celery_driftsafe.testing.processes import (
    Child,
    Children,
    RedisServer,
    postgres_exec,
    proc_stats,
    start_redis,
)

ROOT = Path(__file__).resolve().parents[1]
#: A Redis database the run may write to when it cannot start its own (no ``redis-server``).
BROKER_URL = os.environ.get("DRIFTSAFE_BENCH_REDIS_URL")


def pg_exec(sql: str, dbname: str = "postgres") -> list[tuple[Any, ...]]:
    return postgres_exec(sql, dbname)


def _postmaster_start() -> Any:
    return pg_exec("SELECT pg_postmaster_start_time()")[0][0]


class Disturbed(RuntimeError):
    """Something outside the benchmark restarted PostgreSQL during a trial."""


def code_root() -> Path:
    """Where the schedulers' processes run from (``python -m``, so the package and
    ``benchmarks`` import there): this checkout, or the one ``DRIFTSAFE_BENCH_CODE`` names
    (``python -m benchmarks ablation --against``)."""
    return Path(os.environ.get("DRIFTSAFE_BENCH_CODE") or ROOT)


def _child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BENCH_", "DJANGO_"))}
    # children run from the repository root (``python -m``), so ``benchmarks`` imports there
    env.update(DJANGO_SETTINGS_MODULE="benchmarks.bench_settings", PYTHONUNBUFFERED="1", **extra)
    return env


class Services:
    """Shared by every trial of one run: template database, Redis servers, work directory."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.token = uuid.uuid4().hex[:6]
        self._ids = itertools.count(1)
        self.template = f"dsbench_{self.token}_template"
        self.redis_servers: list[RedisServer] = []
        # Two servers of the run's own: the store's command counter then counts only the
        # schedulers' traffic, and nothing else on the machine (a test restarting the shared
        # Redis) can disturb the broker. Without redis-server both are BROKER_URL.
        self.store_url = self._start_redis("store")
        self.broker_url = self._start_redis("broker")
        pg_exec(f"CREATE DATABASE {self.template}")
        result = subprocess.run(
            [sys.executable, "-m", "django", "migrate", "--verbosity", "0"],
            cwd=ROOT,
            env=_child_env(BENCH_DB=self.template, BENCH_STORE_URL=self.store_url),
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode:
            self.close()
            raise RuntimeError(f"migrate failed:\n{result.stderr}")

    def _start_redis(self, name: str) -> str:
        if shutil.which("redis-server") is None:
            if BROKER_URL is None:
                self.close()
                raise RuntimeError(
                    "redis-server is not on PATH, so the comparison cannot start Redis servers "
                    "of its own: install it (bash tests/services.sh --install, or apt-get "
                    "install redis-server), or set DRIFTSAFE_BENCH_REDIS_URL to a Redis "
                    "database the comparison may write to"
                )
            return BROKER_URL
        server = start_redis(self.workdir / f"redis-{name}")
        self.redis_servers.append(server)
        return f"{server.url}/0"

    @property
    def own_redis(self) -> bool:
        return bool(self.redis_servers)

    def next_id(self) -> int:
        return next(self._ids)

    def close(self) -> None:
        pg_exec(f"DROP DATABASE IF EXISTS {self.template} WITH (FORCE)")
        for server in self.redis_servers:
            server.stop()


@dataclass
class Beat:
    """One started beat and what the sampler read of it."""

    child: Child
    cpu: float = 0.0  # user + system seconds, last sample, its child processes' included
    #: The beat's child processes (its claim process, multiprocessing's resource tracker):
    #: pid -> CPU seconds at their last sample (kept once they end).
    children_cpu: dict[int, float] = field(default_factory=dict)
    cpu_mark: float = 0.0  # at Trial.mark()
    peak_rss_kb: int = 0

    @property
    def pid(self) -> int:
        return self.child.pid

    @property
    def process(self) -> subprocess.Popen[bytes]:
        return self.child.process

    @property
    def offset(self) -> float:
        return self.child.offset

    @property
    def measured_offset(self) -> float:
        return self.child.measured

    @property
    def log(self) -> Path:
        return self.child.log

    @property
    def killed_at(self) -> float | None:
        return self.child.killed_at


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
        self.code = code_root()
        self.children = Children(self.dir, cwd=self.code)
        pg_exec(f"CREATE DATABASE {self.db} TEMPLATE {self.services.template}")
        self.env = _child_env(
            BENCH_DB=self.db,
            BENCH_STORE_URL=self.services.store_url,
            BENCH_BROKER_URL=self.services.broker_url,
            BENCH_PREFIX=self.prefix,
            BENCH_QUEUE=self.queue,
            **(self.peer.tuned if self.tuned else {}),
        )
        self.postgres_started = _postmaster_start()
        self.recorder = Recorder(self.services.broker_url, self.queue)
        self.recorder.start()
        self.store = redis.Redis.from_url(self.services.store_url)
        self._server_first: dict[int, float] = {}
        self._server_last: dict[int, tuple[str, float]] = {}
        self._server_seen = False
        self._postmaster: int | None = None
        self._reaped_first: float | None = None
        self._reaped = 0.0
        self._sampling = threading.Event()
        self._sampler = threading.Thread(target=self._sample_loop, daemon=True)
        self._sampler.start()

    # -- seeding and edits (in a child process with the trial's settings) ---------------------

    def _child(self, command: str, payload: dict[str, Any], timeout: float) -> Any:
        result = subprocess.run(
            [sys.executable, "-m", "benchmarks.peers", self.peer.key, command],
            cwd=self.code,
            env=self.env,
            input=json.dumps(payload),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if result.returncode:
            raise RuntimeError(f"{self.peer.key} {command} failed:\n{result.stderr[-3000:]}")
        return json.loads(result.stdout)

    def seed(self, entries: list[Entry]) -> float:
        """Store ``entries`` the scheduler's documented way; returns the seconds it took."""
        began = time.time()
        self._child("seed", {"entries": [e.to_json() for e in entries]}, timeout=900)
        return time.time() - began

    def sql_seed(self, tasks: int, every: int, start: datetime, spread: float) -> float:
        """celery_driftsafe only: the rows :meth:`seed` would store for ``Entry(i, every,
        start + spread * i / tasks)``, i = 0 .. tasks - 1, written by ONE ``INSERT … SELECT …
        FROM generate_series`` in PostgreSQL (a million rows in well under a minute; the ORM
        takes ~0.2 ms a row). Entry 0 is stored the documented way; every other row copies
        its columns and sets its own name, args and instants (``interval_anchor``,
        ``next_slot_at`` and ``due_at``: the first slot, no jitter, as ``bulk_create`` does).
        Returns the seconds it took."""
        if self.peer.key != "driftsafe":
            raise ValueError(f"--sql-seed seeds celery_driftsafe only, not {self.peer.key}")
        began = time.time()
        self.seed([Entry(0, every, start)])
        table = "celery_driftsafe_periodictask"
        columns = [
            r[0]
            for r in pg_exec(
                "SELECT column_name FROM information_schema.columns "
                f"WHERE table_name = '{table}' AND column_name <> 'id' ORDER BY ordinal_position",
                self.db,
            )
        ]
        # whole microseconds, rounded as Python's timedelta rounds (exact but for a tie)
        instant = (
            f"'{start.isoformat()}'::timestamptz + make_interval(secs => "
            f"round(i::numeric * {round(spread * 1_000_000)} / {tasks}) / 1000000)"
        )
        values = {
            "name": "'bench-' || lpad(i::text, 6, '0')",
            "args": "jsonb_build_array(i, 0)",
            "interval_anchor": instant,
            "next_slot_at": instant,
            "due_at": instant,
        }
        missing = set(values) - set(columns)
        if missing:
            raise RuntimeError(f"{table} has no column(s) {sorted(missing)}: update sql_seed")
        pg_exec(
            f"INSERT INTO {table} ({', '.join(columns)}) "
            f"SELECT {', '.join(values.get(c, f't.{c}') for c in columns)} "
            f"FROM (SELECT * FROM {table} WHERE name = '{entry_name(0)}') AS t, "
            f"generate_series(1, {tasks - 1}) AS i",
            self.db,
        )
        pg_exec(f"ANALYZE {table}", self.db)
        return time.time() - began

    def set_intervals(self, edits: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Apply ``edits`` ({index, every, at}) one by one at their planned true times; each
        comes back stamped with the true time right after it committed."""
        wait = max(
            0.0, max(datetime.fromisoformat(e["at"]).timestamp() for e in edits) - time.time()
        )
        done: list[dict[str, Any]] = self._child(
            "set_interval", {"edits": edits}, timeout=wait + 120
        )["edits"]
        return done

    # -- beats ------------------------------------------------------------------------------

    def start_beat(self, offset: float = 0.0, *, wait_banner: float = 0.0) -> Beat:
        """Start one ``celery beat`` whose wall clock is ``offset`` seconds off (verified
        first); with ``wait_banner``, wait until it printed its banner, then that long more."""
        i = len(self.beats)
        child = self.children.start(
            f"beat-{i}",
            [*BEAT_ARGS, "-S", self.peer.scheduler, "-s", str(self.dir / f"beat-{i}-schedule")],
            self.env,
            offset=offset,
        )
        beat = Beat(child)
        self.beats.append(beat)
        process = child.process
        log = child.log
        if wait_banner:
            deadline = time.time() + 30
            while (
                time.time() < deadline
                and process.poll() is None
                and b"Configuration" not in log.read_bytes()
            ):
                time.sleep(0.05)
            time.sleep(wait_banner)
        return beat

    def beat_by_pid(self, pid: int | None) -> Beat | None:
        return next((b for b in self.beats if b.pid == pid), None)

    def kill(self, beat: Beat) -> float:
        """SIGKILL ``beat``; returns the true time of the kill."""
        return self.children.kill(beat.child)

    def stop(self) -> None:
        """SIGTERM every beat (SIGKILL after 15 s), then let the recorder drain."""
        self.children.stop(timeout=15, wait_for_handler=False)
        self._sampling.set()
        self.recorder.stop()

    def check_undisturbed(self) -> None:
        """Raise :class:`Disturbed` if PostgreSQL restarted since the trial began (the
        machine is shared; other test suites restart it)."""
        if _postmaster_start() != self.postgres_started:
            raise Disturbed("PostgreSQL was restarted during the trial")

    def close(self) -> None:
        self.children.close()
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
        return "\n".join(
            f"--- {b.log.name}\n{b.log.read_text(errors='replace')[-tail:]}" for b in self.beats
        )

    # -- measurements -----------------------------------------------------------------------

    def _sample_servers(self) -> None:
        """Record the CPU seconds of this trial's live PostgreSQL backends (a backend's process
        title names its database; one first seen after the start counts from zero), of the
        PostgreSQL server's exited children (the postmaster's ``cutime + cstime``: the beats
        reconnect every round, so most backends live too short to be sampled) and of the
        run's own Redis servers (store and broker)."""
        found: dict[int, str] = {
            s.process.pid: "redis"
            for s in self.services.redis_servers
            if s.process is not None and s.process.poll() is None
        }
        marker = f" {self.db} ".encode()
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit() or int(entry.name) in found:
                continue
            with contextlib.suppress(OSError):
                with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                    title = f.read().replace(b"\0", b" ")
                if title.startswith(b"postgres") and marker in title:
                    found[int(entry.name)] = "pg"
                    if self._postmaster is None:
                        with open(f"/proc/{entry.name}/stat") as stat:
                            self._postmaster = int(stat.read().rsplit(")", 1)[1].split()[1])
        alive: dict[int, tuple[str, float]] = {}
        for pid, kind in found.items():
            with contextlib.suppress(OSError, ValueError, IndexError):
                used = proc_stats(pid)[1]
                self._server_first.setdefault(pid, used if not self._server_seen else 0.0)
                alive[pid] = (kind, used)
        if self._postmaster is not None:
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{self._postmaster}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
                reaped = (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")
                if self._reaped_first is None:
                    self._reaped_first = reaped
                self._reaped = reaped
        self._server_seen = True
        self._server_last = alive

    def server_cpu(self) -> dict[str, float]:
        """CPU seconds so far: ``pg``, this trial's live PostgreSQL backends plus every
        PostgreSQL child that exited meanwhile (of any database: an upper bound on a shared
        server); ``redis``, the run's own Redis servers (0 when the run uses a shared one)."""
        self._sample_servers()
        totals = {"pg": self._reaped - (self._reaped_first or 0.0), "redis": 0.0}
        for pid, (kind, used) in self._server_last.items():
            totals[kind] += used - self._server_first.get(pid, 0.0)
        return totals

    def _sample_loop(self) -> None:
        while not self._sampling.wait(0.5):
            with contextlib.suppress(OSError):
                self._sample_servers()
            for beat in list(self.beats):
                if beat.process.poll() is not None:
                    continue
                with contextlib.suppress(OSError, ValueError, IndexError):
                    rss, own = proc_stats(beat.pid)
                    beat.peak_rss_kb = max(beat.peak_rss_kb, rss)
                    for child in _children(beat.pid):
                        with contextlib.suppress(OSError, ValueError, IndexError):
                            _rss, beat.children_cpu[child] = proc_stats(child)
                    beat.cpu = own + sum(beat.children_cpu.values())

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
        return Counters(
            time.time(),
            int(row[0]),
            int(row[1]),
            int(row[2]),
            int(info["total_commands_processed"]),
        )

    def lock_ttl(self) -> float | None:
        """Seconds left on RedBeat's lock (None when there is none)."""
        ttl = self.store.pttl(f"{self.prefix}:redbeat::lock")
        return ttl / 1000 if ttl and ttl > 0 else None


def _children(pid: int) -> list[int]:
    """The child processes of ``pid`` (of any of its threads), from /proc."""
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as children:
                found.extend(int(child) for child in children.read().split())
    return found
