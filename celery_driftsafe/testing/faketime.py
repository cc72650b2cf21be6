"""Child processes whose wall clock is really skewed, through libfaketime.

``skewed_env(offset)`` returns an environment for ``subprocess``: the child's
``time.time()`` (and every other wall-clock reading) is the real time plus
``offset`` seconds, while its monotonic clock, sleeps and timeouts stay real.

How: ``LD_PRELOAD=<shim>:libfaketime.so.1`` with ``FAKETIME=+2.500000`` (an
offset in seconds, ``.`` as the decimal point) and
``FAKETIME_DONT_FAKE_MONOTONIC=1``. The shim (``faketime_shim.c``, compiled on
first use) repairs the two monotonic waits that libfaketime 0.9.10 gets wrong in
that mode: ``clock_nanosleep`` with an absolute monotonic deadline (behind
``time.sleep``) and ``pthread_cond_timedwait`` on a monotonic condvar (behind the
GIL). See the C file for details.

Debian packages: ``faketime`` (pulls in ``libfaketime``), ``gcc`` and
``libc6-dev``.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

INSTALL_HINT = "install it with `apt-get install -y faketime gcc libc6-dev`"

_LIBRARY = "libfaketime.so.1"
_MULTIARCH = sysconfig.get_config_var("MULTIARCH") or "x86_64-linux-gnu"
LIBFAKETIME_CANDIDATES: tuple[Path, ...] = tuple(
    Path(prefix, *arch, "faketime", _LIBRARY)
    for prefix in ("/usr/lib", "/usr/local/lib", "/usr/lib64")
    for arch in ((_MULTIARCH,), ())
)

SHIM_SOURCE = Path(__file__).with_name("faketime_shim.c")
_CFLAGS = ("-shared", "-fPIC", "-O2", "-Wall")
_LDLIBS = ("-ldl",)  # part of libc since glibc 2.34, needed before

# Environment variables that belong to libfaketime; dropped from inherited envs.
_FAKETIME_PREFIX = "FAKETIME"
_OUR_PRELOADS = ("libfaketime", "faketime_shim")  # file name prefixes


class FaketimeUnavailable(RuntimeError):
    """libfaketime or a C compiler is missing on this machine."""


def libfaketime_path() -> Path:
    """Return the installed libfaketime preload library."""
    for candidate in LIBFAKETIME_CANDIDATES:
        if candidate.is_file():
            return candidate
    looked = ", ".join(str(path) for path in LIBFAKETIME_CANDIDATES)
    raise FaketimeUnavailable(f"libfaketime is not installed (looked for {looked}); {INSTALL_HINT}")


def build_shim(cache_dir: Path | None = None) -> Path:
    """Compile ``faketime_shim.c`` once and return the shared object.

    The result is cached in ``cache_dir`` (default: ``celery-driftsafe-<uid>`` in the temp
    dir) under a name derived from the source and flags, so an edited source is rebuilt and
    concurrent test processes share one build.

    The shared object is preloaded into every skewed child, so only a private copy is used:
    the folder must be a directory (not a symbolic link) owned by this user that neither its
    group nor others may write to, and a cached build a regular file of the same kind. A
    folder that is not (another local user made it first in the shared temp dir, or opened
    it up) is left alone with a warning (``faketime-shim``): the shim is built in a fresh
    private folder of this process's instead. A cached build that is not is built again.
    """
    source = SHIM_SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join(_CFLAGS + _LDLIBS).encode()).hexdigest()[:16]
    cache_dir = cache_dir or Path(tempfile.gettempdir()) / f"celery-driftsafe-{os.getuid()}"
    with contextlib.suppress(OSError):  # judged below, whatever went wrong
        cache_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    problem = privacy_problem(cache_dir, directory=True)
    if problem:
        logger.warning(
            "not using %s for the faketime shim: %s; building it in a private folder instead",
            cache_dir,
            problem,
            extra={"action": "faketime-shim"},
        )
        cache_dir = _own_dir()
    target = cache_dir / f"faketime_shim-{digest}.so"
    if not privacy_problem(target, directory=False):
        return target

    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise FaketimeUnavailable(
            f"no C compiler (cc or gcc) to build {SHIM_SOURCE.name}; {INSTALL_HINT}"
        )
    partial = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    command = [compiler, *_CFLAGS, "-o", str(partial), str(SHIM_SOURCE), *_LDLIBS]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr}")
    partial.chmod(0o755)  # whatever the umask: nobody else writes what gets preloaded
    partial.replace(target)  # atomic: a concurrent build just wins or loses the rename
    return target


def privacy_problem(path: Path, *, directory: bool) -> str:
    """Why ``path`` is not this user's own directory (or regular file) that nobody else may
    write to; empty when it is. Symbolic links are not followed (a link is not private)."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return "it does not exist"
    except OSError as exc:
        return f"it cannot be examined ({exc})"
    kind, is_kind = ("directory", stat.S_ISDIR) if directory else ("regular file", stat.S_ISREG)
    if not is_kind(info.st_mode):
        return f"it is not a {kind}"
    if info.st_uid != os.getuid():
        return f"it is owned by uid {info.st_uid}, not by this user (uid {os.getuid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"its group or others may write to it (mode {stat.S_IMODE(info.st_mode):o})"
    return ""


_own: Path | None = None
_own_lock = threading.Lock()


def _own_dir() -> Path:
    """A private folder of this process's (mode 0700), removed when it exits."""
    global _own
    with _own_lock:
        if _own is None:
            _own = Path(tempfile.mkdtemp(prefix=f"celery-driftsafe-{os.getuid()}-"))
            atexit.register(shutil.rmtree, _own, ignore_errors=True)
        return _own


def skewed_env(offset_seconds: float, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for a child whose wall clock reads real time + ``offset_seconds``.

    Starts from ``base`` (default ``os.environ``) without any libfaketime
    settings it may carry. An offset of 0 gives a plain, unpreloaded process.
    """
    env = {
        key: value
        for key, value in (os.environ if base is None else base).items()
        if not key.startswith(_FAKETIME_PREFIX)
    }
    # ld.so accepts both colons and spaces between LD_PRELOAD entries.
    preload = [
        entry
        for entry in env.pop("LD_PRELOAD", "").replace(":", " ").split()
        if not Path(entry).name.startswith(_OUR_PRELOADS)
    ]
    if offset_seconds:
        preload[:0] = [str(build_shim()), str(libfaketime_path())]
        # libfaketime reads this with strtod in the C locale: "+2.5" works, "+2,5" means +2.
        env["FAKETIME"] = f"{offset_seconds:+.6f}"
        env["FAKETIME_DONT_FAKE_MONOTONIC"] = "1"
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


def cleanup_killed(pid: int) -> None:
    """Remove the shared-memory objects libfaketime made for process ``pid``.

    Every preloaded process creates ``/dev/shm/faketime_shm_<pid>`` and
    ``/dev/shm/sem.faketime_sem_<pid>`` and removes them when it exits normally.
    After a SIGKILL they stay behind; if only the first is still there when the
    pid is reused, libfaketime aborts that new process at start-up
    ("shm_open failed: File exists"). Call this after killing a skewed process.
    """
    for name in (f"faketime_shm_{pid}", f"sem.faketime_sem_{pid}"):
        Path("/dev/shm", name).unlink(missing_ok=True)


# The child answers each newline on stdin with its wall and monotonic clocks,
# then, if asked, times two 0.2 s waits on its monotonic clock; last line is JSON.
_PROBE = """
import json, sys, threading, time
rounds, check_waits = int(sys.argv[1]), sys.argv[2] == "waits"
print("ready", flush=True)
for _ in range(rounds):
    sys.stdin.readline()
    print(time.time(), time.monotonic(), flush=True)
waits = {}
if check_waits:
    for name, wait in [
        ("time.sleep(0.2)", lambda: time.sleep(0.2)),
        ("threading.Event().wait(0.2)", lambda: threading.Event().wait(0.2)),
    ]:
        start = time.monotonic()
        try:
            wait()
            waits[name] = time.monotonic() - start
        except OSError as exc:
            waits[name] = f"raised {exc!r}"
print(json.dumps(waits), flush=True)
"""

_PROBE_ROUNDS = 3
_PROBE_TIMEOUT = 20.0
WAIT_SECONDS, WAIT_TOLERANCE = 0.2, 0.1
#: Probes of a child whose timed waits only came back late (see verify_skew).
LATE_WAIT_PROBES = 3


@dataclass(frozen=True)
class _Probe:
    wall_offset: float
    monotonic_offset: float
    waits: dict[str, float | str]


def _probe(env: Mapping[str, str], python: str, check_waits: bool) -> _Probe:
    """Run the probe child; keep the round trip with the narrowest bracket."""
    command = [python, "-c", _PROBE, str(_PROBE_ROUNDS), "waits" if check_waits else "clocks"]
    samples: list[tuple[float, float, float]] = []
    with subprocess.Popen(
        command,
        env=dict(env),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as child:
        assert child.stdin is not None
        assert child.stdout is not None
        assert child.stderr is not None
        timed_out = threading.Event()

        def kill() -> None:
            timed_out.set()
            child.kill()

        watchdog = threading.Timer(_PROBE_TIMEOUT, kill)
        watchdog.start()
        try:
            if child.stdout.readline() == "ready\n":
                for _ in range(_PROBE_ROUNDS):
                    wall_before, mono_before = time.time(), time.monotonic()
                    child.stdin.write("\n")
                    child.stdin.flush()
                    line = child.stdout.readline()
                    wall_after, mono_after = time.time(), time.monotonic()
                    if not line:
                        break
                    child_wall, child_mono = map(float, line.split())
                    samples.append(
                        (
                            wall_after - wall_before,
                            child_wall - (wall_before + wall_after) / 2,
                            child_mono - (mono_before + mono_after) / 2,
                        )
                    )
        except BrokenPipeError:
            pass  # the child died; its exit status and stderr tell why
        finally:
            with contextlib.suppress(BrokenPipeError):
                child.stdin.close()
            # Not communicate(): it reads the pipes directly and would miss buffered lines.
            rest, errors = child.stdout.read(), child.stderr.read()
            child.wait()
            watchdog.cancel()
    if timed_out.is_set():
        cleanup_killed(child.pid)
        failure = f"no answer within {_PROBE_TIMEOUT:g} s, child killed"
    else:
        failure = f"child exited with {child.returncode}:\n{errors}"
    if len(samples) < _PROBE_ROUNDS:
        raise RuntimeError(f"clock probe under {_describe(env)} failed: {failure}")
    _, wall_offset, monotonic_offset = min(samples)
    if child.returncode != 0:
        return _Probe(wall_offset, monotonic_offset, {"the timed waits": failure})
    return _Probe(wall_offset, monotonic_offset, json.loads(rest.splitlines()[-1]))


def _describe(env: Mapping[str, str]) -> str:
    keys = ("LD_PRELOAD", "FAKETIME", "FAKETIME_DONT_FAKE_MONOTONIC")
    return " ".join(f"{key}={env[key]}" for key in keys if key in env) or "no preload"


def measure_offset(env: Mapping[str, str], python: str = sys.executable) -> float:
    """Seconds by which a child started with ``env`` reads the wall clock ahead of us."""
    return _probe(env, python, check_waits=False).wall_offset


def verify_skew(
    env: Mapping[str, str],
    expected: float,
    tolerance: float = 0.25,
    python: str = sys.executable,
) -> float:
    """Check that a child with ``env`` is skewed by ``expected`` seconds and nothing else.

    Its wall clock must be ``expected`` ± ``tolerance`` seconds off ours, its
    monotonic clock not off at all (± ``tolerance``), and ``time.sleep(0.2)``
    and ``threading.Event().wait(0.2)`` must take 0.2 ± 0.1 s of real time.
    A wait that only came back late is measured again, up to twice, in a new child: a
    busy machine delays a wait now and then, while libfaketime's faults (a wait that
    returns at once, or is off by the skew) come back every time.
    Returns the measured wall-clock offset; raises AssertionError otherwise.
    """
    for _ in range(LATE_WAIT_PROBES):
        try:
            probe = _probe(env, python, check_waits=True)
        except RuntimeError as exc:
            raise AssertionError(str(exc)) from exc
        problems: list[str] = []
        late: list[str] = []
        if abs(probe.wall_offset - expected) > tolerance:
            problems.append(
                f"wall clock is {probe.wall_offset:+.3f} s off,"
                f" expected {expected:+.3f} ± {tolerance} s"
            )
        if abs(probe.monotonic_offset) > tolerance:
            problems.append(f"monotonic clock is {probe.monotonic_offset:+.3f} s off, expected 0")
        for name, took in probe.waits.items():
            if isinstance(took, str):
                problems.append(f"{name}: {took}")
            elif abs(took - WAIT_SECONDS) > WAIT_TOLERANCE:
                (late if took > WAIT_SECONDS else problems).append(
                    f"{name} took {took:.3f} s, expected {WAIT_SECONDS} ± {WAIT_TOLERANCE} s"
                )
        problems += late
        if not late or len(problems) > len(late):
            break  # fine, or wrong in a way a busy machine does not explain
    if problems:
        raise AssertionError(f"child with {_describe(env)}: " + "; ".join(problems))
    return probe.wall_offset
