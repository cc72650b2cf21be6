"""End-to-end behind PgBouncer in transaction pooling, as many Django deployments run.

Three real beats and a worker reach PostgreSQL through one PgBouncer (``pool_mode =
transaction``) that keeps at most two server connections for the database: every transaction
of every process may land on a server connection another process used a moment before. The
beats claim each slot once, the worker runs each slot's body once, and nothing fails.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from celery_driftsafe.testing.processes import free_port, postgres_exec
from tests import settings as test_settings
from tests.e2e.harness import E2ERun, analyse, assert_exactly_once, real_now, table
from tests.skip_guard import configuration

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.pgbouncer,  # tests/run.sh runs these beside the PostgreSQL pass, not in it
    pytest.mark.skipif(
        test_settings.TEST_DB != "postgres", reason=configuration("PgBouncer fronts PostgreSQL")
    ),
]

#: The test PostgreSQL (the PostgreSQL pass's own settings): PgBouncer's server.
PG = test_settings.DATABASES["default"]
#: Server connections PgBouncer keeps for the database and a user: fewer than the clients.
POOL_SIZE = 2


def _pgbouncer() -> str:
    path = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
    if not os.access(path, os.X_OK):
        pytest.skip("PgBouncer is not installed: apt-get install pgbouncer")
    return path


class Bouncer:
    """A running PgBouncer: its port, and the users it lets in."""

    def __init__(self, process: subprocess.Popen[bytes], folder: Path, port: int) -> None:
        self.process = process
        self.folder = folder
        self.port = port

    def allow(self, user: str) -> None:
        """Let ``user`` in too (PgBouncer re-reads its user list on SIGHUP)."""
        with open(self.folder / "users.txt", "a") as users:
            users.write(f'"{user}" ""\n')
        self.process.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while _read(self.folder / "pgbouncer.log").count("got SIGHUP") < 1:
            assert time.monotonic() < deadline, _read(self.folder / "pgbouncer.log")
            time.sleep(0.05)


@pytest.fixture
def pgbouncer() -> Iterator[Bouncer]:
    """A PgBouncer in transaction pooling in front of the test PostgreSQL."""
    binary = _pgbouncer()
    # PgBouncer refuses to run as root: there it runs as the postgres user, which must read
    # its folder (a test's tmp_path is private to root).
    folder = Path(tempfile.mkdtemp(prefix="driftsafe-pgbouncer-"))
    port = free_port()
    (folder / "users.txt").write_text(f'"{PG["USER"]}" ""\n')
    (folder / "pgbouncer.ini").write_text(
        "[databases]\n"
        f"* = host={PG['HOST']} port={PG['PORT']}\n"
        "[pgbouncer]\n"
        "listen_addr = 127.0.0.1\n"
        f"listen_port = {port}\n"
        "auth_type = trust\n"
        f"auth_file = {folder / 'users.txt'}\n"
        "pool_mode = transaction\n"
        f"default_pool_size = {POOL_SIZE}\n"
        "max_client_conn = 200\n"
        "unix_socket_dir =\n"
        f"logfile = {folder / 'pgbouncer.log'}\n"
        "ignore_startup_parameters = extra_float_digits\n"
    )
    command = [binary, str(folder / "pgbouncer.ini")]
    if os.geteuid() == 0:
        folder.chmod(0o755)
        shutil.chown(folder, "postgres")
        for child in folder.iterdir():
            shutil.chown(child, "postgres")
        command[1:1] = ["-u", "postgres"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while "listening on" not in _read(folder / "pgbouncer.log"):
            assert process.poll() is None, f"PgBouncer exited:\n{_read(folder / 'pgbouncer.log')}"
            assert time.monotonic() < deadline, _read(folder / "pgbouncer.log")
            time.sleep(0.05)
        yield Bouncer(process, folder, port)
    finally:
        process.terminate()
        process.wait(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _backends(db_name: str) -> list[tuple[Any, ...]]:
    """The database's server connections now (read off PostgreSQL itself), a row each."""
    return postgres_exec(
        "SELECT pid, usename, backend_start, state, left(query, 80) FROM pg_stat_activity "
        f"WHERE datname = '{db_name}' AND pid <> pg_backend_pid()"
    )


def _server_connections_held(db_name: str) -> tuple[int, int]:
    """Server connections the database has now and still has a moment later, and the most of
    the two readings: a backend whose connection PgBouncer just let go of (it replaces a server
    connection a client left unclean) is listed until its process has exited, which takes
    milliseconds, so one reading can count it beside its successor (seen in CI once: 3 of a
    pool of 2, for an instant); a client connected past PgBouncer holds its connection for
    longer than that."""
    first = len(_backends(db_name))
    time.sleep(0.1)
    second = len(_backends(db_name))
    return min(first, second), max(first, second)


def _default_level(bouncer: Bouncer, db_name: str, user: str) -> str:
    """The isolation level a session of ``user`` defaults to, asked through PgBouncer."""
    import psycopg

    with psycopg.connect(
        host="127.0.0.1", port=bouncer.port, dbname=db_name, user=user, autocommit=True
    ) as connection:
        row = connection.execute("SHOW default_transaction_isolation").fetchone()
    assert row is not None
    return str(row[0])


@pytest.mark.parametrize(
    "beat_role",
    [False, True],
    ids=["server default", "database at repeatable read, the beats' own role"],
)
def test_beats_and_a_worker_behind_pgbouncer_in_transaction_pooling(
    tmp_path: Path, pgbouncer: Bouncer, beat_role: bool
) -> None:
    """With ``beat_role``, the database defaults to REPEATABLE READ (the worker's bodies run
    at it) and the beats log in as a role of their own that defaults to READ COMMITTED, as
    docs/howto/run-several-beats.md advises behind PgBouncer: no beat then sets a session
    level on a server connection."""
    run = E2ERun("postgresql", tmp_path, dead_after=5.0)
    through_pgbouncer = {
        "DRIFTSAFE_E2E_PG_HOST": "127.0.0.1",
        "DRIFTSAFE_E2E_PG_PORT": str(pgbouncer.port),
    }
    beats_env = dict(through_pgbouncer)
    role = f"driftsafe_e2e_beat_{run.token}"
    if beat_role:
        postgres_exec(
            f"ALTER DATABASE {run.db_name} SET default_transaction_isolation = 'repeatable read'"
        )
        postgres_exec(f"CREATE ROLE {role} LOGIN")
        postgres_exec(f"ALTER ROLE {role} SET default_transaction_isolation = 'read committed'")
        for what in ("TABLES", "SEQUENCES"):
            postgres_exec(f"GRANT ALL ON ALL {what} IN SCHEMA public TO {role}", run.db_name)
        pgbouncer.allow(role)
        beats_env["DRIFTSAFE_E2E_PG_USER"] = role
    # the bodies' messages go to the worker, the plain ones to the recorder, which counts them
    work_queue = f"{run.queue}-work"
    try:
        run.start_recorder()
        run.start_worker("w1", env=through_pgbouncer, queue=work_queue)
        for offset in (0.0, 1.5, -2.0):
            run.start_beat(offset, env=beats_env)
        # Seeded once the beats are up: every slot counted below falls due while they claim
        # (before, it is downtime, one run for it, and the rest recorded missed, not executed).
        run.wait_until_claiming()
        start = real_now() + timedelta(seconds=3)
        run.seed(
            [
                {
                    "name": f"work-{i}",
                    "task": "e2e.slot_work",
                    "queue": work_queue,
                    "schedule_kind": "interval",
                    "interval_every": 1 + i % 2,
                    "interval_unit": "seconds",
                }
                for i in range(4)
            ]
            + [
                {
                    "name": f"plain-{i}",
                    "schedule_kind": "interval",
                    "interval_every": 1 + i % 3,
                    "interval_unit": "seconds",
                }
                for i in range(6)
            ],
            start,
        )
        time.sleep(max((start - real_now()).total_seconds(), 0) + 4)
        # every process is connected and claiming or running bodies by now
        busiest, instant, seen = 0, 0, ""
        for _ in range(20):
            held, most = _server_connections_held(run.db_name)
            instant = max(instant, most)
            if held > busiest:
                busiest, seen = held, "\n".join(map(str, _backends(run.db_name)))
            time.sleep(0.5)
        if beat_role:  # the levels each side's sessions start at, as the test means them
            assert _default_level(pgbouncer, run.db_name, PG["USER"]) == "repeatable read"
            assert _default_level(pgbouncer, run.db_name, role) == "read committed"
        time.sleep(2)
        end = real_now()
        time.sleep(4)  # the worker runs what the last rounds published
        codes = run.stop()
        dump = run.tool("dump")
    finally:
        run.broker.delete(work_queue)
        run.close()
        if beat_role:
            postgres_exec(f"DROP ROLE IF EXISTS {role}")
    reports = analyse(dump, run.received, start=start, until=end - timedelta(seconds=1.5))
    # the recorder sees the plain tasks' messages; the worker takes the bodies' (counted below)
    plain = {k: r for k, r in reports.items() if r.name.startswith("plain-")}
    print(
        f"\nbehind PgBouncer ({POOL_SIZE} server connections, {busiest} seen, {instant} for an "
        f"instant)\n{table(plain)}"
    )
    logs = run.logs()
    assert codes == {"beat-0": 0, "beat-1": 0, "beat-2": 0}, f"{codes}\n{logs}"
    assert "Traceback" not in logs and "ERROR" not in logs, logs
    # the clients shared the pool: never more server connections than PgBouncer keeps
    assert 0 < busiest <= POOL_SIZE * (2 if beat_role else 1), f"{busiest}:\n{seen}"
    assert_exactly_once(run, plain, {f"plain-{i}" for i in range(6)})
    slots = [(r["task_id"], r["slot"]) for r in dump["runs"]]
    assert len(slots) == len(set(slots)), "two run rows for one slot"
    claimers = {r["claimed_by"] for r in dump["runs"]}
    assert len(claimers) == 3, f"every beat should take part in claiming: {claimers}"
    executed = Counter(
        tuple(line.split()[:2]) for line in (tmp_path / "executions.log").read_text().splitlines()
    )
    assert executed and max(executed.values()) == 1, executed.most_common(3)
    work_ids = {t["id"] for t in dump["tasks"] if t["name"].startswith("work-")}
    due = {
        (str(r["task_id"]), r["slot"])
        for r in dump["runs"]
        if r["task_id"] in work_ids and r["slot"] <= (end - timedelta(seconds=1.5)).isoformat()
    }
    ran = {(task_id, slot) for task_id, slot in executed}
    assert due and due <= ran, f"not executed: {sorted(due - ran)[:5]}\n{logs}"
