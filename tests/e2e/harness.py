"""Start real beats (clocks skewed with libfaketime), record every published message, count.

The processes are started and stopped with :mod:`celery_driftsafe.testing.processes`, and
messages recorded with :mod:`celery_driftsafe.testing.recording` (both shared with the
benchmarks and the demo). The recorder pops messages off the broker's Redis list as they
arrive and stamps each with the test process's own wall clock, which is the machine's real
clock: the clock of the PostgreSQL and Redis servers that act as authority. A message stamped
before its slot was published early.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis

from celery_driftsafe.core.schedules import Crontab, Interval, Schedule
from celery_driftsafe.testing.processes import (
    Child,
    Children,
    RedisServer,
    handles_sigterm,
    postgres_exec,
    start_redis,
    wait_until_handles_sigterm,
)
from celery_driftsafe.testing.recording import QueueRecorder, percentile
from tests import settings as test_settings
from tests.support import wait_until

__all__ = [
    "OPEN",
    "OWN_REDIS_OPTIONS",
    "E2ERun",
    "Received",
    "TaskReport",
    "analyse",
    "handles_sigterm",
    "port_open",
    "real_now",
    "restart_redis",
    "table",
    "wait_port",
    "wait_until_handles_sigterm",
]

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[2]
BROKER_DB = test_settings.REDIS_DB + 2
# Locks, notifications and the Redis authority of e2e runs: a database no test flushes (runs
# are told apart by their key prefix and clean up after themselves).
E2E_REDIS_DB = test_settings.REDIS_DB + 4
SCHEDULER = "celery_driftsafe.scheduler:DriftSafeScheduler"
#: How long after a run's ``start`` its beats may begin claiming (the nodes' earliest
#: ``claiming_since``) with the slots due meanwhile excused (:func:`analyse`). The callers
#: start the window 2-3 s after every beat's start-up line (:meth:`E2ERun.wait_until_claiming`),
#: and a beat's first round follows that line at once: claiming begins before ``start``,
#: unless the machine is so loaded that a first round comes seconds late. Beyond this bound
#: it is not a slow start: the beats' slots went unclaimed, and each is reported missed.
LATE_START = timedelta(seconds=3)
#: A run's statuses before its end.
OPEN = frozenset({"claimed", "dispatched", "started", "retrying", "waiting"})
#: The commands of ``tests.e2e.tool`` that one process of a run's answers (they only read).
SERVED = frozenset({"dump", "run"})


#: Per test process and backend: a database migrated once, which each run's database is a copy
#: of (PostgreSQL's ``CREATE DATABASE … TEMPLATE``, a file copy for SQLite). Migrating took
#: 2.4 s of a run's start on this machine (1.7 s of CPU), a copy 0.3 s.
_TEMPLATES: dict[str, str] = {}


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def wait_port(port: int, up: bool = True, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while port_open(port) != up:
        assert time.monotonic() < deadline, f"port {port} did not come {'up' if up else 'down'}"
        time.sleep(0.1)


#: A run's own Redis (``start_redis(..., options=OWN_REDIS_OPTIONS)``, passed to
#: :class:`E2ERun` as ``redis_server``): as many databases as the harness numbers for this test
#: process.
OWN_REDIS_OPTIONS = (
    "--databases",
    str(max(16, test_settings.REDIS_DB + test_settings.REDIS_DBS_PER_PROCESS)),
)


def restart_redis(server: RedisServer, workdir: Path) -> RedisServer:
    """Shut a run's own Redis down (nothing is kept on disk) and start it again on its port."""
    port = int(server.url.rsplit(":", 1)[1])
    server.stop()
    wait_port(port, up=False)
    return start_redis(workdir, options=OWN_REDIS_OPTIONS, port=port)


def real_now() -> datetime:
    """The test process's (unskewed) wall clock: the servers' clock on this machine."""
    return datetime.now(UTC)


@dataclass
class Received:
    periodic_task_id: int
    slot: datetime
    celery_task_id: str
    received_at: datetime


#: A started beat or worker (``offset``, ``measured``, ``process``, ``log``).
Beat = Child


def _received(raw: bytes, stamp: float) -> Received:
    headers = json.loads(raw)["headers"]
    return Received(
        periodic_task_id=int(headers["driftsafe_periodic_task_id"]),
        slot=datetime.fromisoformat(headers["driftsafe_slot"]),
        celery_task_id=headers["id"],
        received_at=datetime.fromtimestamp(stamp, UTC),
    )


@dataclass
class TaskReport:
    name: str
    expected: int = 0
    fired: int = 0
    duplicates: int = 0
    missed: list[datetime] = field(default_factory=list)
    #: Slots not in ``expected``: due before the beats began claiming, at most
    #: :data:`LATE_START` after the start, and recorded missed in the ledger (see
    #: :func:`analyse`).
    excused: list[datetime] = field(default_factory=list)
    unexpected: list[datetime] = field(default_factory=list)
    early: list[tuple[datetime, float]] = field(default_factory=list)
    lateness: list[float] = field(default_factory=list)


class E2ERun:
    """One end-to-end run: its own database, key prefix and broker list; ``redis_server`` is the
    Redis its beats and workers use (by default the test Redis)."""

    def __init__(
        self,
        backend: str,
        workdir: Path,
        *,
        authority: str | None = None,
        beat_schedule: dict[str, float] | None = None,
        max_loop: float = 1.0,
        lease: float = 5.0,
        broker: str = "redis",
        dead_after: float = 5.0,
        redis_server: str = test_settings.REDIS_SERVER,
    ) -> None:
        self.backend = backend
        self.workdir = workdir
        self.token = uuid.uuid4().hex[:8]
        self.children = Children(workdir, cwd=ROOT)
        self.beats: list[Beat] = []
        self.workers: list[Beat] = []
        self._recorder: QueueRecorder[Received] | None = None
        self._server: subprocess.Popen[str] | None = None
        self._server_lock = threading.Lock()
        redis_broker = f"{redis_server}/{BROKER_DB}"
        self.broker_url = redis_broker
        self.broker = redis.Redis.from_url(redis_broker)
        if broker == "redis":
            broker_url = redis_broker
        elif test_settings.RABBITMQ_URL is None:
            pytest.fail(test_settings.RABBITMQ_MISSING)
        else:
            broker_url = test_settings.RABBITMQ_URL
        self.queue = f"e2e-{self.token}"
        if backend == "postgresql":
            self.db_name = f"driftsafe_e2e_{self.token}"
            db = f"postgresql:{self.db_name}"
        else:
            db = f"sqlite:{workdir / 'e2e.sqlite3'}"
        self.env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "tests.e2e.settings",
            # the children run from the repository root (``python -m``): ``tests`` imports
            "DRIFTSAFE_E2E_DB": db,
            "DRIFTSAFE_E2E_BROKER": broker_url,
            "DRIFTSAFE_E2E_EXEC_LOG": str(workdir / "executions.log"),
            "DRIFTSAFE_E2E_QUEUE": self.queue,
            "DRIFTSAFE_E2E_REDIS": f"{redis_server}/{E2E_REDIS_DB}",
            "DRIFTSAFE_E2E_PREFIX": f"{test_settings.RUN_PREFIX}-e2e-{self.token}",
            "DRIFTSAFE_E2E_AUTHORITY": authority
            or ("database" if backend == "postgresql" else "redis"),
            "DRIFTSAFE_E2E_BEAT_SCHEDULE": json.dumps(beat_schedule or {}),
            "DRIFTSAFE_E2E_MAX_LOOP": str(max_loop),
            "DRIFTSAFE_E2E_LEASE": str(lease),
            "DRIFTSAFE_E2E_DEAD_AFTER": str(dead_after),
        }
        template = self._migrated_template()
        if backend == "postgresql":
            self._pg(f"CREATE DATABASE {self.db_name} TEMPLATE {template}")
        else:
            shutil.copyfile(template, workdir / "e2e.sqlite3")

    # -- plumbing -----------------------------------------------------------------------------

    def _pg(self, sql: str) -> None:
        postgres_exec(sql)

    def _migrated_template(self) -> str:
        """This process's migrated database for this run's backend (its name, or its file),
        made by the first run that needs it and dropped when the process exits."""
        if self.backend not in _TEMPLATES:
            if self.backend == "postgresql":
                template = f"driftsafe_e2e_template_{os.getpid()}"
                self._pg(f"DROP DATABASE IF EXISTS {template}")
                self._pg(f"CREATE DATABASE {template}")
                atexit.register(postgres_exec, f"DROP DATABASE IF EXISTS {template} WITH (FORCE)")
                db = f"postgresql:{template}"
            else:
                folder = tempfile.mkdtemp(prefix="driftsafe-e2e-template-")
                atexit.register(shutil.rmtree, folder, True)
                template = os.path.join(folder, "e2e.sqlite3")
                db = f"sqlite:{template}"
            self.tool("migrate", env={**self.env, "DRIFTSAFE_E2E_DB": db})
            _TEMPLATES[self.backend] = template
        return _TEMPLATES[self.backend]

    def tool(self, command: str, payload: Any = None, env: dict[str, str] | None = None) -> Any:
        """Run ``tests.e2e.tool command`` with ``payload`` (JSON) on its stdin; what it printed,
        parsed. The looks the tests poll with (:data:`SERVED`) go to one process of the run's
        (``tests.e2e.tool serve``), the others each get a process of their own (a command
        may run beside another, as ``stale_saves`` does)."""
        if command in SERVED and env is None:
            return self._served(command, payload)
        result = subprocess.run(
            [sys.executable, "-m", "tests.e2e.tool", command],
            cwd=ROOT,
            env=env or self.env,
            input=json.dumps(payload).encode() if payload is not None else None,
            capture_output=True,
            timeout=120,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(f"tests.e2e.tool {command} failed:\n{result.stderr.decode()}")
        return json.loads(result.stdout) if result.stdout.strip() else None

    def _served(self, command: str, payload: Any) -> Any:
        with self._server_lock:
            server = self._server
            if server is None or server.poll() is not None:
                with (self.workdir / "tool-serve.log").open("ab") as log:
                    server = self._server = subprocess.Popen(
                        [sys.executable, "-m", "tests.e2e.tool", "serve"],
                        cwd=ROOT,
                        env=self.env,
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=log,
                        text=True,
                    )
            assert server.stdin is not None and server.stdout is not None
            server.stdin.write(json.dumps({"command": command, "payload": payload}) + "\n")
            server.stdin.flush()
            line = server.stdout.readline()
        if not line:
            log = (self.workdir / "tool-serve.log").read_text(errors="replace")
            raise RuntimeError(f"tests.e2e.tool serve exited during {command}:\n{log}")
        answer = json.loads(line)
        if not answer["ok"]:
            raise RuntimeError(f"tests.e2e.tool {command} failed:\n{answer['error']}")
        out: str = answer["out"]
        return json.loads(out) if out.strip() else None

    def _stop_server(self) -> None:
        with self._server_lock:
            server, self._server = self._server, None
        if server is None:
            return
        assert server.stdin is not None and server.stdout is not None
        server.stdin.close()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        server.stdout.close()

    def received_for(self, name: str) -> list[Received]:
        """Messages of the task called ``name`` (looked up in the database)."""
        ids = {t["id"] for t in self.tool("dump")["tasks"] if t["name"] == name}
        return [m for m in self.received if m.periodic_task_id in ids]

    def seed(self, specs: list[dict[str, Any]], start: datetime) -> None:
        self.tool("seed", [{**spec, "start": start.isoformat()} for spec in specs])

    def start_beat(
        self,
        offset: float,
        *,
        scheduler: str = SCHEDULER,
        app: str = "tests.e2e.celery_app",
        env: dict[str, str] | None = None,
    ) -> Beat:
        """Start one beat whose wall clock is ``offset`` seconds off; the skew is verified in
        a child with the very same environment first."""
        n = len(self.beats)
        beat = self.children.start(
            f"beat-{n}",
            [
                "-A",
                app,
                "beat",
                "-S",
                scheduler,
                "--loglevel",
                "INFO",
                "-s",
                str(self.workdir / f"beat-{n}"),
            ],
            {**self.env, **(env or {})},
            offset=offset,
        )
        self.beats.append(beat)
        return beat

    def wait_until_claiming(self, *beats: Beat, timeout: float = 120.0) -> None:
        """Wait until every beat started so far (or each of ``beats``: a ``celery worker -B``
        started by hand, whose log has its beat's lines) is up (its start-up line logged; its
        first round follows at once). Tasks seeded after this have their slots fall due while
        a beat claims; seeded before, on a loaded machine whose beats start slowly, their first
        slots can fall due while no beat claims yet: downtime, which the misfire policy answers
        with one run (``tests/e2e/test_downtime.py``)."""
        deadline = time.monotonic() + timeout
        for beat in beats or self.beats:
            while not (beat.log.exists() and " up (authority " in beat.log.read_text("utf-8")):
                assert beat.process.poll() is None, f"{beat.name} exited\n{self.logs()}"
                assert time.monotonic() < deadline, f"{beat.name} not up\n{self.logs()}"
                time.sleep(0.1)

    def start_worker(
        self,
        name: str,
        *,
        pool: str = "solo",
        concurrency: int = 1,
        env: dict[str, str] | None = None,
        queue: str | None = None,
    ) -> Beat:
        """Start one ``celery worker`` on this run's queue, or on ``queue`` (``env``: more
        environment)."""
        worker = self.children.start(
            f"worker-{name}",
            [
                "-A",
                "tests.e2e.celery_app",
                "worker",
                "-P",
                pool,
                "-c",
                str(concurrency),
                # a node name of the run's own: two runs side by side on one RabbitMQ (the
                # chaos test beside the PostgreSQL pass) must not share a remote-control
                # (pidbox) queue, which a worker of the same name declares exclusively
                "-n",
                f"{name}@e2e-{self.token}",
                "-Q",
                queue or self.queue,
                "--loglevel",
                "INFO",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
            ],
            {**self.env, **(env or {})},
        )
        self.workers.append(worker)
        return worker

    def publisher(self) -> Any:
        """A Celery app in this process that publishes to the run's broker and queue."""
        from celery import Celery

        app = Celery("e2e-publisher", broker=self.env["DRIFTSAFE_E2E_BROKER"], set_as_current=False)
        app.conf.task_default_queue = self.queue
        return app

    def executions(self) -> list[dict[str, Any]]:
        """What the e2e.work bodies recorded when they ran to the end."""
        raw = redis.Redis.from_url(self.env["DRIFTSAFE_E2E_REDIS"]).lrange(
            f"{self.env['DRIFTSAFE_E2E_PREFIX']}:executions", 0, -1
        )
        return [json.loads(item) for item in raw]

    def began(self) -> list[str]:
        """The markers of the e2e.work bodies that began, in order: read in a millisecond,
        where a look at the ledger is a Django process, seconds on a loaded machine."""
        raw = redis.Redis.from_url(self.env["DRIFTSAFE_E2E_REDIS"]).lrange(
            f"{self.env['DRIFTSAFE_E2E_PREFIX']}:began", 0, -1
        )
        return [item.decode() for item in raw]

    def start_recorder(self) -> None:
        self._recorder = QueueRecorder(self.broker_url, self.queue, _received).start()

    @property
    def received(self) -> list[Received]:
        """Every message recorded so far (stamped with :func:`real_now`'s clock)."""
        return self._recorder.messages if self._recorder is not None else []

    def kill(self, beat: Beat) -> None:
        self.children.kill(beat)  # SIGKILL, then libfaketime's shared memory is cleaned up

    def stop(self, timeout: float = 90.0) -> dict[str, int | None]:
        """SIGTERM every beat, wait, stop the recorder. Returns each beat's exit code (None:
        still running ``timeout`` seconds after the signal, then killed). The bound is only
        against a hang: a clean stop takes a round and a second or two, but two shared cores
        may run much else at the same time."""
        codes = self.children.stop(*self.beats, timeout=timeout) if self.beats else {}
        if self._recorder is not None:
            self._recorder.stop(timeout=10, delete=False)
        return codes

    def close(self) -> None:
        self._stop_server()
        self.children.close()
        if self._recorder is not None:
            self._recorder.stop(timeout=1)
        self.broker.delete(self.queue)
        self.broker.close()
        keys = redis.Redis.from_url(self.env["DRIFTSAFE_E2E_REDIS"])
        for key in keys.scan_iter(f"{self.env['DRIFTSAFE_E2E_PREFIX']}:*"):
            keys.delete(key)
        keys.close()
        if self.backend == "postgresql":
            self._pg(f"DROP DATABASE IF EXISTS {self.db_name} WITH (FORCE)")

    def logs(self) -> str:
        return self.children.logs()

    def wait_ready(self, worker: Beat) -> None:
        """Wait until ``worker`` (:meth:`start_worker`) says it is ready."""
        self.wait_for(
            lambda: "ready." in worker.log.read_text(), f"{worker.name} ready", timeout=60
        )

    def all_ended(self, timeout: float = 30) -> list[dict[str, Any]]:
        """Every run of the ledger, once none is open (:data:`OPEN`) and two looks in a row
        read them alike."""
        last: list[list[dict[str, Any]]] = []

        def ended() -> list[dict[str, Any]] | None:
            runs: list[dict[str, Any]] = self.tool("dump")["runs"]
            if any(r["status"] in OPEN for r in runs):
                last.clear()
                return None
            settled = bool(last) and last[-1] == runs
            last[:] = [runs]
            return runs if settled else None

        return self.wait_for(ended, "every run to end", timeout=timeout)

    def wait_for(
        self,
        condition: Callable[[], T],
        what: str,
        timeout: float,
        seen: Callable[[], str] | None = None,
    ) -> T:
        """:func:`tests.support.wait_until` for a condition read from this run's ledger or
        processes: looked at every 0.1 s (each look may start a process or query the ledger),
        and in the failure what ``seen()`` says of the last look, then this run's logs."""

        def context() -> str:
            return (f"{seen()}\n" if seen is not None else "") + self.logs()

        return wait_until(condition, what, timeout=timeout, interval=0.1, context=context)


def schedule_of(task: dict[str, Any]) -> Schedule:
    if task["kind"] == "interval":
        return Interval(timedelta(seconds=task["every"]), datetime.fromisoformat(task["anchor"]))
    return Crontab(minute=task["minute"], hour=task["hour"], timezone=task["timezone"])


def analyse(
    dump: dict[str, Any],
    received: list[Received],
    *,
    start: datetime,
    until: datetime,
) -> dict[int, TaskReport]:
    """Compare what arrived with every slot due in ``[start, until]`` (beat_schedule tasks:
    after their anchor). Slots after ``until`` may or may not have fired, but never twice.

    Every slot counts, with one exception, bounded and reported: a slot that fell due before
    the beats began claiming (the earliest ``claiming_since`` of the nodes, on a machine so
    loaded that their first round came after ``start``) is downtime, which the misfire policy
    answers by firing one run for all such slots and recording the others missed
    (``tests/e2e/test_downtime.py``). Such a slot is ``excused``, not expected, only if it did
    not arrive, the ledger records it missed, and it fell due at most :data:`LATE_START` after
    ``start``; every other slot that did not arrive is ``missed``. The policy's one run (under
    the latest slot before claiming began, or an on-time slot in its place) is expected like
    any slot."""
    began = min(
        (datetime.fromisoformat(n["claiming_since"]) for n in dump["nodes"] if n["claiming_since"]),
        default=None,
    )
    # slots due before this are downtime, which the ledger may record missed
    excusable_before = None
    if began is not None and began > start:
        excusable_before = min(began, start + LATE_START)
        print(
            f"the beats began claiming {(began - start).total_seconds():.1f} s after the start: "
            f"slots due by {LATE_START.total_seconds():g} s after it that the ledger records "
            "missed are excused, any others that did not arrive are missed"
        )
    by_task: dict[int, list[Received]] = defaultdict(list)
    for message in received:
        by_task[message.periodic_task_id].append(message)
    reports: dict[int, TaskReport] = {}
    for task in dump["tasks"]:
        schedule = schedule_of(task)
        report = reports[task["id"]] = TaskReport(task["name"])
        first = start
        if task["source"] == "beat_schedule":
            first = datetime.fromisoformat(task["anchor"]) + timedelta(microseconds=1)
        expected = list(schedule.slots_between(first, until))
        recorded_missed = _recorded_missed(dump, task["id"], schedule)
        counts = Counter(m.slot for m in by_task[task["id"]])
        for slot in expected:
            if slot in counts:
                continue
            if excusable_before is not None and slot < excusable_before and slot in recorded_missed:
                report.excused.append(slot)
            else:
                report.missed.append(slot)
        report.expected = len(expected) - len(report.excused)
        report.fired = len(counts)
        report.duplicates = sum(c - 1 for c in counts.values())
        valid = set(schedule.slots_between(first, until + timedelta(hours=1)))
        report.unexpected = [s for s in counts if s not in valid]
        for message in by_task[task["id"]]:
            late = (message.received_at - message.slot).total_seconds()
            report.lateness.append(late)
            if late < 0:
                report.early.append((message.slot, late))
    return reports


def _recorded_missed(dump: dict[str, Any], task_id: int, schedule: Schedule) -> set[datetime]:
    """The slots of the task that the ledger records missed (a row each, or a row for a span
    of them: its slot to ``missed_until``)."""
    slots: set[datetime] = set()
    for row in dump["runs"]:
        if row["task_id"] != task_id or row["status"] != "missed":
            continue
        slot = datetime.fromisoformat(row["slot"])
        slots.add(slot)
        if row["missed_until"]:
            last = datetime.fromisoformat(row["missed_until"])
            slots.update(schedule.slots_between(slot, last + timedelta(microseconds=1)))
    return slots


def table(reports: dict[int, TaskReport]) -> str:
    lines = [
        f"{'task':<22}{'due':>5}{'fired':>7}{'dup':>5}{'missed':>8}{'excused':>9}{'early':>7}"
        f"{'p50 late':>10}{'max late':>10}"
    ]
    for report in reports.values():
        late = sorted(report.lateness) or [0.0]
        lines.append(
            f"{report.name:<22}{report.expected:>5}{report.fired:>7}{report.duplicates:>5}"
            f"{len(report.missed):>8}{len(report.excused):>9}{len(report.early):>7}"
            f"{percentile(late, 50):>10.3f}{late[-1]:>10.3f}"
        )
    return "\n".join(lines)


def assert_exactly_once(run: E2ERun, reports: dict[int, TaskReport], names: set[str]) -> None:
    """Every task named in ``names`` is in ``reports`` and fired each due slot once: none
    missed, doubled, early or off its schedule (slots due while the beats were slow to begin
    claiming are the only excuse, bounded and checked against the ledger: see :func:`analyse`)."""
    checked = 0
    for report in reports.values():
        if report.name not in names:
            continue
        checked += 1
        assert report.expected > 0, report.name
        assert not report.missed, (
            f"{report.name}: missed {report.missed} (excused {report.excused})\n{run.logs()}"
        )
        assert report.duplicates == 0, f"{report.name}: {report.duplicates} duplicates"
        assert not report.unexpected and not report.early, report.name
    assert checked == len(names), f"tasks not found: {names}"
