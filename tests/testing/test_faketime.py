"""The skewed-clock harness: children really read a shifted wall clock, nothing else shifts.

Every child here is a real Python process started with LD_PRELOAD of libfaketime
(plus our shim). Skips only when libfaketime or a C compiler is missing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import celery
import pytest

from celery_driftsafe.testing import faketime
from celery_driftsafe.testing.faketime import (
    FaketimeUnavailable,
    build_shim,
    cleanup_killed,
    libfaketime_path,
    measure_offset,
    skewed_env,
    verify_skew,
)
from tests import settings as test_settings

pytestmark = pytest.mark.skew  # a missing libfaketime fails the run (tests/conftest.py)

CHILD_TIMEOUT = 30


@pytest.fixture(scope="module", autouse=True)
def faketime_ready() -> None:
    try:
        libfaketime_path()
        build_shim()
    except FaketimeUnavailable as exc:
        pytest.skip(str(exc))


def run_python(script: str, env: dict[str, str]) -> str:
    """Run ``script`` in a child with ``env``; return its last stdout line."""
    result = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()[-1]


def libfaketime_only(offset: float) -> dict[str, str]:
    """Like skewed_env(offset) but without the shim: plain upstream behaviour."""
    env = skewed_env(offset)
    env["LD_PRELOAD"] = str(libfaketime_path())
    return env


# --- the wall clock is shifted, the monotonic clock is not ----------------------------


@pytest.mark.parametrize("offset", [2.5, -4.0, 3600.0])
def test_child_wall_clock_is_shifted_by_the_offset(offset: float) -> None:
    measured = verify_skew(skewed_env(offset), expected=offset)

    assert measured == pytest.approx(offset, abs=0.25)


def test_zero_offset_is_a_plain_process() -> None:
    env = skewed_env(0, base={"PATH": os.environ["PATH"], "LD_PRELOAD": "/x/libfaketime.so.1"})

    assert "LD_PRELOAD" not in env
    assert not any(key.startswith("FAKETIME") for key in env)
    assert verify_skew(env, expected=0) == pytest.approx(0, abs=0.25)


def test_verify_skew_reports_a_wrong_offset() -> None:
    with pytest.raises(AssertionError, match=r"wall clock is \+2\.5\d\d s off, expected \+0\.000"):
        verify_skew(skewed_env(2.5), expected=0)


def test_verify_skew_reports_a_faked_monotonic_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    env = skewed_env(2.5)
    del env["FAKETIME_DONT_FAKE_MONOTONIC"]  # libfaketime then fakes monotonic time too
    monkeypatch.setattr(faketime, "_PROBE_TIMEOUT", 2.0)  # its waits hang

    with pytest.raises(AssertionError, match=r"monotonic clock is \+\d+\.\d+ s off") as failure:
        verify_skew(env, expected=2.5)
    assert "no answer within 2 s" in str(failure.value)


def test_measure_offset_tells_offsets_apart() -> None:
    assert measure_offset(skewed_env(-4)) - measure_offset(skewed_env(2.5)) == pytest.approx(
        -6.5, abs=0.05
    )


# --- timed waits keep real durations under the preload --------------------------------

# Each entry waits 0.2 s for something that never comes; the child reports how long
# each took on its monotonic clock (which is not faked), or the error it raised.
WAITS_SCRIPT = """
import json, os, queue, select, socket, threading, time

read_end, write_end = os.pipe()

def lock_acquire():
    lock = threading.Lock()
    lock.acquire()
    lock.acquire(timeout=0.2)

def condition_wait():
    condition = threading.Condition()
    with condition:
        condition.wait(0.2)

def queue_get():
    try:
        queue.Queue().get(timeout=0.2)
    except queue.Empty:
        pass

def poll():
    poller = select.poll()
    poller.register(read_end, select.POLLIN)
    poller.poll(200)

def epoll():
    with select.epoll() as poller:
        poller.register(read_end, select.EPOLLIN)
        poller.poll(0.2)

def socket_recv():
    left, right = socket.socketpair()
    with left, right:
        left.settimeout(0.2)
        try:
            left.recv(1)
        except TimeoutError:
            pass

waits = {
    "time.sleep": lambda: time.sleep(0.2),
    "threading.Event.wait": lambda: threading.Event().wait(0.2),
    "threading.Lock.acquire": lock_acquire,
    "threading.Condition.wait": condition_wait,
    "queue.Queue.get": queue_get,
    "select.select": lambda: select.select([read_end], [], [], 0.2),
    "select.poll": poll,
    "select.epoll": epoll,
    "socket.recv": socket_recv,
}
took = {}
for name, wait in waits.items():
    start = time.monotonic()
    try:
        wait()
        took[name] = time.monotonic() - start
    except OSError as exc:
        took[name] = repr(exc)
print(json.dumps(took))
"""
WAITS = (
    "time.sleep",
    "threading.Event.wait",
    "threading.Lock.acquire",
    "threading.Condition.wait",
    "queue.Queue.get",
    "select.select",
    "select.poll",
    "select.epoll",
    "socket.recv",
)


@pytest.fixture(scope="module", params=[-4.0, 3600.0], ids=["behind-4s", "ahead-1h"])
def wait_durations(request: pytest.FixtureRequest) -> dict[str, float | str]:
    durations: dict[str, float | str] = json.loads(
        run_python(WAITS_SCRIPT, skewed_env(request.param))
    )
    return durations


#: A 0.2-s timed wait on the monotonic clock never ends sooner (a little slack for the
#: millisecond timeouts of poll and epoll).
WAIT_FLOOR = 0.19
#: ... and a wait the skew mangled ends at once, or after the skew (4 s, an hour) or the
#: server's 5 s; ending before this (less than any of those) is a real wait, however loaded
#: the machine. No tighter bound: how much later than asked a wait ends is the scheduler's.
WAIT_CEILING = 3.5


def real_wait(took: float) -> bool:
    """Whether a 0.2-s timed wait that took ``took`` s waited in real time."""
    return WAIT_FLOOR <= took < WAIT_CEILING


@pytest.mark.parametrize("wait", WAITS)
def test_timed_wait_takes_real_time(wait_durations: dict[str, float | str], wait: str) -> None:
    took = wait_durations[wait]

    assert isinstance(took, float), f"{wait}(0.2 s) raised {took}"
    assert real_wait(took), f"{wait}(0.2 s) took {took:.3f} s"


# Two threads spin; count how often the GIL changes hands in one second. With a
# 50 ms switch interval that is about 20 times; when the GIL's timed condvar
# wait returns at once, it is hundreds to tens of thousands of times.
GIL_SCRIPT = """
import json, sys, threading
sys.setswitchinterval(0.05)
state = {"running": True, "owner": None, "switches": 0}

def spin(tag):
    while state["running"]:
        if state["owner"] != tag:
            state["owner"] = tag
            state["switches"] += 1

threads = [threading.Thread(target=spin, args=(tag,)) for tag in "ab"]
for thread in threads:
    thread.start()
threading.Event().wait(1.0)
state["running"] = False
for thread in threads:
    thread.join()
print(json.dumps(state["switches"]))
"""


def test_gil_switch_interval_is_kept() -> None:
    switches = json.loads(run_python(GIL_SCRIPT, skewed_env(-4)))

    assert switches < 60, f"GIL changed hands {switches} times in 1 s (interval 50 ms)"


# --- what runs in the skewed processes -------------------------------------------------

REDIS_SCRIPT = """
import json, time, redis
from redis.backoff import NoBackoff
from redis.retry import Retry

client = redis.Redis.from_url(URL, socket_timeout=0.2, retry=Retry(NoBackoff(), 0))
seconds, microseconds = client.time()
local = time.time()
start = time.monotonic()
try:
    client.blpop(KEY, timeout=5)  # the server would wait 5 s; the client gives up first
except redis.TimeoutError:
    pass
print(json.dumps({
    "ahead_of_redis": local - (seconds + microseconds / 1e6),
    "socket_timeout_took": time.monotonic() - start,
}))
"""


@pytest.mark.redis
def test_redis_client_in_skewed_process() -> None:
    key = f"{test_settings.RUN_PREFIX}:faketime:{uuid.uuid4().hex}"
    script = REDIS_SCRIPT.replace("KEY", repr(key)).replace("URL", repr(test_settings.REDIS_URL))

    report = json.loads(run_python(script, skewed_env(2.5)))

    assert report["ahead_of_redis"] == pytest.approx(2.5, abs=0.25)
    assert real_wait(report["socket_timeout_took"]), report  # not the server's 5 s


def test_celery_command_runs_in_skewed_process() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "celery", "--version"],
        env=skewed_env(3600),
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT,
        check=False,
    )

    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[0] == celery.__version__


# --- upstream libfaketime 0.9.10 bugs the shim works around -----------------------------
# These document the bugs: they run WITHOUT the shim and expect the failure. If one of
# them fails, libfaketime got fixed and the matching function in faketime_shim.c may go.


def test_upstream_bug_without_shim_time_sleep_fails() -> None:
    """libfaketime issue 426: clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME) mangled."""
    script = """
import time
try:
    time.sleep(0.2)
    print("slept")
except OSError as exc:
    print(exc.errno)
"""

    assert run_python(script, libfaketime_only(2.5)) == "22"  # EINVAL


# A timed wait on a condition variable that runs on CLOCK_MONOTONIC, as CPython's GIL waits
# for its switch interval, through the process' global namespace (where LD_PRELOAD puts
# libfaketime's wrapper first).
CONDVAR_SCRIPT = """
import ctypes, json, time
libc = ctypes.CDLL(None, use_errno=True)  # the global namespace: preloaded symbols first
class timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]
attr, cond, mutex = (ctypes.create_string_buffer(128) for _ in range(3))
libc.pthread_condattr_init(attr)
libc.pthread_condattr_setclock(attr, 1)  # CLOCK_MONOTONIC, as CPython's GIL condvar
libc.pthread_cond_init(cond, attr)
libc.pthread_mutex_init(mutex, None)
now = timespec()
libc.clock_gettime(1, ctypes.byref(now))
deadline = timespec(*divmod(now.tv_sec * 10**9 + now.tv_nsec + 200_000_000, 10**9))
libc.pthread_mutex_lock(mutex)
start = time.monotonic()
rc = libc.pthread_cond_timedwait(cond, mutex, ctypes.byref(deadline))
print(json.dumps({"rc": rc, "took": time.monotonic() - start}))
"""


def test_upstream_bug_without_shim_gil_thrashes() -> None:
    """pthread_cond_timedwait on a CLOCK_MONOTONIC condvar times out at once, so the GIL's
    switch interval collapses and two spinning threads hand it over thousands of times a
    second. Shown on the condvar itself: counting hand-overs depends on how much CPU the
    machine leaves the spinners (46 in a second at load 12), a wait's length does not."""
    without_shim = json.loads(run_python(CONDVAR_SCRIPT, libfaketime_only(-4)))
    with_shim = json.loads(run_python(CONDVAR_SCRIPT, skewed_env(-4)))

    assert without_shim["took"] < WAIT_FLOOR, f"a 0.2 s timed wait took {without_shim}"
    assert real_wait(with_shim["took"]), with_shim


# --- the helpers themselves ------------------------------------------------------------


def test_skewed_env_replaces_inherited_faketime_settings() -> None:
    base = {
        "PATH": "/bin",
        "FAKETIME": "+99",
        "FAKETIME_SHARED": "/faketime_sem_1 /faketime_shm_1",
        "LD_PRELOAD": "/old/faketime_shim-0.so /old/libfaketime.so.1:/other/libfoo.so",
    }

    env = skewed_env(-0.5, base=base)

    assert env["LD_PRELOAD"].split(":") == [
        str(build_shim()),
        str(libfaketime_path()),
        "/other/libfoo.so",
    ]
    assert env["FAKETIME"] == "-0.500000"
    assert env["FAKETIME_DONT_FAKE_MONOTONIC"] == "1"
    assert "FAKETIME_SHARED" not in env
    assert env["PATH"] == "/bin"


def test_build_shim_reuses_the_cached_build(tmp_path: Path) -> None:
    first = build_shim(tmp_path)
    built_at = first.stat().st_mtime_ns

    assert build_shim(tmp_path) == first
    assert first.stat().st_mtime_ns == built_at


def _cached_build(cache_dir: Path) -> Path:
    """Where build_shim would cache its build in ``cache_dir``."""
    digest = faketime.hashlib.sha256(
        faketime.SHIM_SOURCE.read_bytes() + " ".join(faketime._CFLAGS + faketime._LDLIBS).encode()
    ).hexdigest()[:16]
    return cache_dir / f"faketime_shim-{digest}.so"


@pytest.mark.parametrize(
    ("owner", "mode"),
    [(65534, 0o700), (None, 0o777), (None, 0o770)],
    ids=["owned-by-nobody", "world-writable", "group-writable"],
)
def test_a_planted_cache_folder_is_not_used(
    tmp_path: Path, owner: int | None, mode: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Another local user made the shim's folder first (or opened it up) and put a library
    there under the build's name: it is never handed to LD_PRELOAD."""
    planted = tmp_path / "shared"
    planted.mkdir()
    bait = _cached_build(planted)
    bait.write_bytes(b"not the shim")
    bait.chmod(0o755)
    planted.chmod(mode)
    if owner is not None:
        os.chown(planted, owner, owner)
        os.chown(bait, owner, owner)

    built = build_shim(planted)

    assert built.parent != planted and built.read_bytes() != b"not the shim"
    folder = built.parent.lstat()
    assert folder.st_uid == os.getuid() and folder.st_mode & 0o077 == 0
    assert bait.read_bytes() == b"not the shim"  # left alone
    (record,) = [r for r in caplog.records if getattr(r, "action", "") == "faketime-shim"]
    assert str(planted) in record.getMessage()
    assert build_shim(planted) == built  # the private folder is kept for this process


@pytest.mark.parametrize(
    ("owner", "mode"), [(65534, 0o755), (None, 0o777)], ids=["owned-by-nobody", "world-writable"]
)
def test_a_planted_build_in_a_private_folder_is_built_again(
    tmp_path: Path, owner: int | None, mode: int
) -> None:
    target = _cached_build(tmp_path)
    target.write_bytes(b"not the shim")
    target.chmod(mode)
    if owner is not None:
        os.chown(target, owner, owner)

    assert build_shim(tmp_path) == target
    info = target.lstat()
    assert info.st_uid == os.getuid() and info.st_mode & 0o022 == 0
    assert target.read_bytes() != b"not the shim" and target.read_bytes()[:4] == b"\x7fELF"


def test_a_symbolic_link_in_place_of_the_cache_folder_is_not_followed(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    link = tmp_path / "cache"
    link.symlink_to(elsewhere)

    built = build_shim(link)

    assert built.parent not in (link, elsewhere) and not list(elsewhere.iterdir())


def test_missing_libfaketime_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(faketime, "LIBFAKETIME_CANDIDATES", (tmp_path / "libfaketime.so.1",))

    with pytest.raises(FaketimeUnavailable, match="apt-get install -y faketime"):
        libfaketime_path()


def test_missing_compiler_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)

    with pytest.raises(FaketimeUnavailable, match="gcc"):
        build_shim(tmp_path)


def test_cleanup_killed_removes_what_libfaketime_leaves_behind() -> None:
    script = "import sys\nprint('ready', flush=True)\nsys.stdin.readline()"
    with subprocess.Popen(
        [sys.executable, "-c", script],
        env=skewed_env(2.5),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as child:
        assert child.stdout is not None
        assert child.stdout.readline() == "ready\n"
        child.send_signal(signal.SIGKILL)
        child.wait()
    leftovers = [
        Path(f"/dev/shm/faketime_shm_{child.pid}"),
        Path(f"/dev/shm/sem.faketime_sem_{child.pid}"),
    ]
    assert all(path.exists() for path in leftovers)

    cleanup_killed(child.pid)

    assert not any(path.exists() for path in leftovers)
