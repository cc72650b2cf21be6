"""The Celery app of the end-to-end runs, configured the way a Django project does it."""

from __future__ import annotations

import json
import os
import time
from typing import Any

from celery import Celery

from celery_driftsafe.task import DriftSafeTask

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.e2e.settings")

app = Celery("e2e")
app.config_from_object("django.conf:settings", namespace="CELERY")

if os.environ.get("DRIFTSAFE_E2E_TRACING"):  # tests/e2e/test_tracing.py
    from tests.e2e.tracing import install

    install(os.environ["DRIFTSAFE_E2E_TRACING"])


@app.task(name="e2e.tick")
def tick(*args: Any, **kwargs: Any) -> None:
    """Does nothing: the test counts messages, not work."""


@app.task(name="e2e.quiet", ignore_result=True)
def quiet(*args: Any, **kwargs: Any) -> str:
    """A plain task whose results are ignored: only its worker can tell how its runs ended."""
    return "done"


@app.task(name="e2e.work", base=DriftSafeTask, acks_late=True, reject_on_worker_lost=True)
def work(marker: str, seconds: float = 0.0) -> str:
    """Records that its body began (``E2ERun.began``: a test that acts while a body runs
    looks there, at once), sleeps, then records that it ran to the end (in Redis, for the
    test to count), with when it began and ended on this machine's clock, which every worker
    shares."""
    import redis

    _began(marker)
    began = time.time()
    time.sleep(seconds)
    client = redis.Redis.from_url(os.environ["DRIFTSAFE_E2E_REDIS"])
    client.rpush(
        f"{os.environ['DRIFTSAFE_E2E_PREFIX']}:executions",
        json.dumps({"marker": marker, "pid": os.getpid(), "began": began, "ended": time.time()}),
    )
    client.close()
    return marker


@app.task(
    name="e2e.slot_work", base=DriftSafeTask, bind=True, acks_late=True, reject_on_worker_lost=True
)
def slot_work(self: Any, seconds: float = 0.0, timed: bool = False) -> None:
    """Sleeps, then appends "<periodic task id> <slot> <pid>" to a file (a file, because the
    chaos test restarts Redis); ``timed``: then " <began> <ended>", this machine's clock."""
    began = time.time()
    time.sleep(seconds)
    line = f"{self.request.driftsafe_periodic_task_id} {self.request.driftsafe_slot} {os.getpid()}"
    if timed:
        line += f" {began} {time.time()}"
    with open(os.environ["DRIFTSAFE_E2E_EXEC_LOG"], "a") as log:
        log.write(line + "\n")


@app.task(
    name="e2e.slot_phases",
    base=DriftSafeTask,
    bind=True,
    acks_late=True,
    reject_on_worker_lost=True,
)
def slot_phases(
    self: Any, seconds: float, die_on_term: bool = False, record_cut: bool = False
) -> None:
    """Appends "begin <periodic task id> <slot> <pid> <time>" to a file as its body begins, and
    "end ..." as it ends after ``seconds`` (a revoke that terminates it leaves no end line);
    <time>: this machine's clock, which every worker shares. ``die_on_term``: a SIGTERM ends
    its (prefork pool) process at once, as SIGKILL would, with no ``finally`` run in it (a
    pool process otherwise unwinds its stack first). ``record_cut``: a body cut short by an
    exception (the SIGTERM of a terminating revoke, as its pool process unwinds) appends
    "cut ..." as its stack unwinds: its code ran no further than that instant.

    With ``die_on_term``, a body's process ends where its body does (it ran to its end, or it
    died), so as it begins the body also appends "alive <task> <slot> <pid> <time>" for each
    body of its task begun before it (in another process) with no end line whose process
    still runs: two bodies at once, seen on the machine itself, no clocks compared."""
    if die_on_term:
        import signal

        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    request = self.request
    exec_log = os.environ["DRIFTSAFE_E2E_EXEC_LOG"]

    def line(phase: str, pid: int | None = None, slot: str | None = None) -> None:
        with open(exec_log, "a") as log:
            log.write(
                f"{phase} {request.driftsafe_periodic_task_id} {slot or request.driftsafe_slot} "
                f"{pid or os.getpid()} {time.time()}\n"
            )

    if die_on_term:
        for slot, pid in _unfinished_elsewhere(exec_log, str(request.driftsafe_periodic_task_id)):
            if _runs(pid):
                line("alive", pid, slot)
    line("begin")
    try:
        time.sleep(seconds)
    except BaseException:
        if record_cut:
            line("cut")
        raise
    line("end")


def _unfinished_elsewhere(exec_log: str, task: str) -> set[tuple[str, int]]:
    """(slot, pid) of the bodies of periodic task ``task`` that began in another process and
    wrote no end line (``e2e.slot_phases``' lines; none yet: no file)."""
    begun: set[tuple[str, int]] = set()
    ended: set[tuple[str, int]] = set()
    if not os.path.exists(exec_log):
        return begun
    with open(exec_log) as log:
        for fields in map(str.split, log):
            if len(fields) == 5 and fields[1] == task and fields[0] in ("begin", "end"):
                (begun if fields[0] == "begin" else ended).add((fields[2], int(fields[3])))
    return {(slot, pid) for slot, pid in begun - ended if pid != os.getpid()}


def _runs(pid: int) -> bool:
    """Whether process ``pid`` still runs (it exists and is not a zombie, whose code has
    stopped and which only waits to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


@app.task(name="e2e.fail", base=DriftSafeTask)
def fail(marker: str) -> None:
    """Always fails (tests/e2e/test_deadlines.py)."""
    raise RuntimeError(f"{marker} fails, as it always does")


if os.environ.get("DRIFTSAFE_E2E_SIGNALS"):  # tests/e2e/test_deadlines.py
    # The beat's receivers of the deadline signals, connected as a project connects its
    # alerts: each writes a line (with when it got it, on this machine's clock) to the file.
    from celery_driftsafe.signals import run_deadline_missed, task_became_stale

    def _write(line: dict[str, Any]) -> None:
        with open(os.environ["DRIFTSAFE_E2E_SIGNALS"], "a") as out:
            out.write(json.dumps({**line, "received": time.time(), "pid": os.getpid()}) + "\n")

    def _late(sender: Any, run: Any, task: Any, deadline: Any, late_at: Any, **kw: Any) -> None:
        _write(
            {
                "signal": "late",
                "task": task.name,
                "run": run.pk,
                "status": run.status,
                "deadline": deadline.timestamp(),
                "late_at": late_at.timestamp(),
            }
        )

    def _stale(sender: Any, task: Any, since: Any, slots: int, **kw: Any) -> None:
        _write({"signal": "stale", "task": task.name, "since": since.timestamp(), "slots": slots})

    run_deadline_missed.connect(_late, weak=False)
    task_became_stale.connect(_stale, weak=False)

    # tests/e2e/test_pause_after_failures.py: connected in workers too (a failed run pauses)
    from celery_driftsafe.signals import task_paused

    def _paused(sender: Any, task: Any, reason: str, failures: int, **kw: Any) -> None:
        _write(
            {
                "signal": "paused",
                "task": task.name,
                "enabled": task.enabled,
                "reason": reason,
                "failures": failures,
            }
        )

    task_paused.connect(_paused, weak=False)


# A result backend when the test asks for one (the semantics tests read results back).
if os.environ.get("DRIFTSAFE_E2E_RESULTS"):
    app.conf.result_backend = os.environ["DRIFTSAFE_E2E_RESULTS"]


def _began(marker: str) -> None:
    import redis

    client = redis.Redis.from_url(os.environ["DRIFTSAFE_E2E_REDIS"])
    client.rpush(f"{os.environ['DRIFTSAFE_E2E_PREFIX']}:began", marker)
    client.close()


def _executed(marker: str, **extra: Any) -> None:
    import redis

    client = redis.Redis.from_url(os.environ["DRIFTSAFE_E2E_REDIS"])
    client.rpush(
        f"{os.environ['DRIFTSAFE_E2E_PREFIX']}:executions",
        json.dumps({"marker": marker, "pid": os.getpid(), **extra}),
    )
    client.close()


@app.task(
    name="e2e.flaky", base=DriftSafeTask, bind=True, acks_late=True, reject_on_worker_lost=True
)
def flaky(self: Any, marker: str, fail_times: int) -> str:
    """Retries itself ``fail_times`` times, recording every attempt that reaches the end."""
    _executed(marker, retries=self.request.retries, worker=self.request.hostname)
    if self.request.retries < fail_times:
        raise self.retry(countdown=0.3, max_retries=fail_times)
    return f"{marker}:{self.request.retries}"


@app.task(name="e2e.phased", base=DriftSafeTask, acks_late=True, reject_on_worker_lost=True)
def phased(marker: str, seconds: float) -> str:
    """Records when its body begins and when it ends (a revoke can stop it in between)."""
    _executed(marker, phase="begin")
    time.sleep(seconds)
    _executed(marker, phase="end")
    return marker


@app.task(
    name="e2e.retry_once", base=DriftSafeTask, bind=True, acks_late=True, reject_on_worker_lost=True
)
def retry_once(self: Any, marker: str) -> str:
    """A scheduled body that retries its first attempt (``countdown=1``); records every
    attempt with its run, slot and retry count."""
    slot = self.request.driftsafe_slot
    _executed(marker, run=self.request.driftsafe_run_id, slot=slot, retries=self.request.retries)
    if self.request.retries == 0:
        raise self.retry(countdown=1, max_retries=1)
    return f"{marker}:{slot}:{self.request.retries}"


@app.task(
    name="e2e.soft_limited",
    base=DriftSafeTask,
    acks_late=True,
    reject_on_worker_lost=True,
    soft_time_limit=1,
    time_limit=30,
)
def soft_limited(marker: str, seconds: float) -> str:
    time.sleep(seconds)
    _executed(marker)
    return marker


@app.task(
    name="e2e.hard_limited",
    base=DriftSafeTask,
    acks_late=True,
    reject_on_worker_lost=True,
    time_limit=1,
)
def hard_limited(marker: str, seconds: float) -> str:
    time.sleep(seconds)
    _executed(marker)
    return marker


@app.task(name="e2e.fragile", base=DriftSafeTask, acks_late=True)
def fragile(marker: str, seconds: float) -> str:
    """Late ack, but no reject_on_worker_lost: a lost pool process is a failure for Celery."""
    _began(marker)
    time.sleep(seconds)
    _executed(marker)
    return marker
