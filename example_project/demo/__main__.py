"""The demo: three beats whose clocks disagree, one worker, and every slot exactly once.

``bash example_project/demo/demo.sh`` builds a virtual environment and runs this module; in an
environment that already has ``celery-driftsafe[results,admin]`` and matplotlib run it from
``example_project/``::

    cd example_project
    python -m demo          # the demo (exit 0: nothing doubled, missed, early)
    python -m demo admin    # the Django admin on the demo's data

Steps: a Redis (:func:`celery_driftsafe.testing.processes.provide_redis`) -> migrate, reset
and seed the example database -> skew the beats' clocks (libfaketime, verified in a child
first; else the clock seam) -> start a worker and the beats -> watch for ``DEMO_SECONDS`` ->
stop -> count (:mod:`demo.report`) -> table, picture, exit status (0 clean, 1 a slot doubled,
missed or early, 2 the demo could not run).

Environment: ``DEMO_SECONDS`` (60), ``DEMO_OUTPUT`` (logs and picture; default
``example_project/demo-output``), ``DEMO_SKEW=seam`` (skip libfaketime), and the example
project's ``EXAMPLE_REDIS_URL`` / ``EXAMPLE_REDIS_DB`` (use that Redis instead of starting one),
``EXAMPLE_DATABASE`` (PostgreSQL instead of SQLite) and ``EXAMPLE_SQLITE_PATH``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from celery_driftsafe.testing.processes import Children, NoRedis, provide_redis
from demo import report as demo_report

#: example_project/: the Django project the demo runs (the beats and the worker run here)
PROJECT = Path(__file__).resolve().parents[1]
ROOT = PROJECT.parent

#: The beats: a label and how far off each one's wall clock is, in seconds.
BEATS = (("A", 0.0), ("B", 2.5), ("C", -4.0))
#: Tasks added as an operator would in the admin (the others come from CELERY_BEAT_SCHEDULE).
SEEDED = (
    {
        "name": "sync-inventory-every-5s",
        "task": "shop.tasks.sync_inventory",
        "schedule_kind": "interval",
        "interval_every": 5,
        "kwargs": {"warehouse": "berlin"},
    },
    {
        "name": "expire-carts-every-3s",
        "task": "shop.tasks.expire_carts",
        "schedule_kind": "interval",
        "interval_every": 3,
        "kwargs": {"older_than_minutes": 30},
    },
)
SETTLE_SECONDS = 2.0  # after the window: let its last slots be claimed before beats stop
SEAM_SCHEDULER = "example_project.skewed_clock:SkewedClockScheduler"


class DemoFailed(Exception):
    """The demo could not run (a process did not come up or died); the message says why."""


def say(message: str = "") -> None:
    print(message, flush=True)


def setup_django() -> None:
    os.environ["DJANGO_SETTINGS_MODULE"] = "example_project.settings"  # children inherit it
    import django

    django.setup()


def prepare_database() -> str:
    """Migrate, clear what an earlier demo left, seed two tasks; describe the database."""
    from django.conf import settings
    from django.core.management import call_command
    from django.db import connection
    from django_celery_results.models import TaskResult
    from shop.models import Execution

    from celery_driftsafe.models import BeatNode, Lock, PeriodicTask, Run

    call_command("migrate", verbosity=0, interactive=False)
    for model in (Execution, Run, PeriodicTask, BeatNode, Lock, TaskResult):
        model.objects.all().delete()
    for spec in SEEDED:
        task = PeriodicTask(**spec)
        task.full_clean(exclude=["interval_anchor"])
        task.save()  # the first slot is set from the time authority, as in the admin
    database = settings.DATABASES["default"]
    if connection.vendor == "sqlite":
        return f"SQLite {database['NAME']}"
    return f"PostgreSQL {database['NAME']} on {database['HOST']}:{database['PORT']}"


def reset_redis() -> None:
    """Forget the demo's keys and queued messages (a configured Redis may hold old ones)."""
    import redis
    from example_project.celery import app

    from celery_driftsafe.conf import get_settings

    settings = get_settings()
    client = redis.Redis.from_url(settings.redis_url)
    try:
        for key in client.scan_iter(f"{settings.key_prefix}:*"):
            client.delete(key)
    finally:
        client.close()
    app.control.purge()


@dataclass
class Skew:
    """How the beats' clocks are skewed: each beat's environment and the offset verified in a
    child with that environment (None: not verified); ``seam`` says why libfaketime is not
    used (empty: it is)."""

    envs: dict[str, dict[str, str]] = field(default_factory=dict)
    verified: dict[str, float | None] = field(default_factory=dict)
    seam: str = ""


def skew_clocks(base: dict[str, str]) -> Skew:
    """Real skew through libfaketime, verified in a child first; else the clock seam."""
    from celery_driftsafe.testing.faketime import FaketimeUnavailable, skewed_env, verify_skew

    skew = Skew()
    if os.environ.get("DEMO_SKEW") == "seam":
        skew.seam = "DEMO_SKEW=seam"
    else:
        try:
            for label, offset in BEATS:
                skew.envs[label] = skewed_env(offset, base)
                skew.verified[label] = verify_skew(skew.envs[label], offset) if offset else None
            return skew
        except (FaketimeUnavailable, RuntimeError, AssertionError, OSError) as exc:
            skew.seam = str(exc).splitlines()[0]
    for label, offset in BEATS:
        skew.envs[label] = {**base, "EXAMPLE_CLOCK_SKEW_SECONDS": str(offset)}
        skew.verified[label] = None
    return skew


class Processes:
    """The worker and the beats (``celery -A example_project ...``), each a child in its own
    session, logging to ``output``."""

    def __init__(self, output: Path) -> None:
        self.output = output
        self.children = Children(output, cwd=PROJECT, new_session=True)

    def start(self, name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        # the environment is skewed already (skew_clocks): no offset here
        return self.children.start(name, ["-A", "example_project", *args], env).process

    def log(self, name: str) -> str:
        return (self.output / f"{name}.log").read_text(errors="replace")

    def died(self) -> str | None:
        child = self.children.died()
        if child is None:
            return None
        tail = "\n".join(self.log(child.name).splitlines()[-15:])
        return f"{child.name} exited with {child.process.returncode}:\n{tail}"

    def stop(self, *names: str, timeout: float = 20) -> None:
        """SIGTERM (a beat finishes its round, a worker its tasks), then SIGKILL."""
        chosen = [c for c in self.children.children if not names or c.name in names]
        if chosen:
            self.children.stop(*chosen, timeout=timeout, wait_for_handler=False)


def wait_until(what: str, ready: Any, processes: Processes, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        problem = processes.died()
        if problem:
            raise DemoFailed(f"{problem}\n{what} did not come up.")
        if time.monotonic() > deadline:
            raise DemoFailed(f"{what} not up after {timeout:.0f} s; logs in {processes.output}")
        time.sleep(0.2)


def beats_claiming(pids: list[int]) -> bool:
    """Every beat measured its clock and began claiming (its first round is over): slots that
    fall due from now on fall due while the beats claim. A slot that fell due before any beat
    claimed is downtime, which the misfire policy answers with one run, not one a slot."""
    from celery_driftsafe.models import BeatNode

    claiming = BeatNode.objects.filter(
        pid__in=pids, clock_offset_seconds__isnull=False, claiming_since__isnull=False
    )
    return claiming.count() == len(pids)


def progress_line(clock: Any, start: datetime, end: datetime, beats: list[demo_report.Beat]) -> str:
    from django.db.models import Count, Q
    from shop.models import Execution

    from celery_driftsafe.models import BeatNode, PeriodicTask, Run

    now = min(clock.now(), end)
    due = sum(len(list(t.schedule.slots_between(start, now))) for t in PeriodicTask.objects.all())
    runs = Run.objects.filter(
        Q(dispatched_at__isnull=False) | Q(started_at__isnull=False), slot__gte=start, slot__lt=end
    )
    per_node = dict(runs.values_list("claimed_by").annotate(n=Count("id")))
    ran = Execution.objects.filter(slot__gte=start, slot__lt=end)
    doubled = ran.values("run_id").annotate(n=Count("id")).filter(n__gt=1).count()
    node_ids = dict(BeatNode.objects.values_list("pid", "node_id"))
    by_beat = "  ".join(f"{b.label} {per_node.get(node_ids.get(b.pid), 0)}" for b in beats)
    elapsed = (now - start).total_seconds()
    return (
        f"  {elapsed:4.0f}/{(end - start).total_seconds():.0f} s   due {due:4}   fired "
        f"{sum(per_node.values()):4}   ran {ran.count():4}   doubled {doubled}   "
        f"fired by beat: {by_beat}"
    )


def watch(
    seconds: float, clock: Any, beats: list[demo_report.Beat], processes: Processes
) -> datetime:
    """Show progress for ``seconds``; one line rewritten in place on a terminal, a line every
    5 s otherwise. Returns the window's start (authority time)."""
    start = clock.now()
    end = start + timedelta(seconds=seconds)
    finish = time.monotonic() + seconds
    tty = sys.stdout.isatty()
    while True:
        problem = processes.died()
        if problem:
            raise DemoFailed(f"\n{problem}")
        line = progress_line(clock, start, end, beats)
        if tty:
            print("\r" + line, end="\033[K", flush=True)
        else:
            say(line)
        left = finish - time.monotonic()
        if left <= 0:
            break
        time.sleep(min(0.5 if tty else 5.0, left))
    if tty:
        print(flush=True)
    return start


def wait_for_runs(timeout: float) -> None:
    """Until every dispatched run has finished (the worker drains its queue)."""
    from celery_driftsafe.models import Run, RunStatus

    pending = (RunStatus.DISPATCHED, RunStatus.STARTED)
    deadline = time.monotonic() + timeout
    while Run.objects.filter(status__in=pending).exists() and time.monotonic() < deadline:
        time.sleep(0.3)


def run_demo(seconds: float, output: Path) -> int:
    from celery_driftsafe import authority_clock

    say(f"  database  {prepare_database()} (migrated; earlier demo runs cleared)")
    reset_redis()
    base = dict(os.environ)  # the children run in example_project/, where its packages are
    skew = skew_clocks(base)
    if skew.seam:
        say(f"  clocks    no real skew: {skew.seam}")
        say("            so the clock seam instead: each beat measures its offset against a")
        say(f"            wall clock shifted by its skew ({SEAM_SCHEDULER});")
        say("            due-ness never reads a node's wall clock, skewed or not")
    else:
        say("  clocks    libfaketime: each beat's whole process reads a skewed wall clock")
    for label, offset in BEATS:
        check = skew.verified[label]
        checked = "" if check is None else f"   (verified in a child: {check:+.3f} s)"
        say(f"            beat {label}  {offset:+.1f} s{checked}")
    say(f"  output    {output}/ (worker.log, beat-A.log, ..., timeline.png)")
    processes = Processes(output)
    beats: list[demo_report.Beat] = []
    try:
        processes.start(
            "worker",
            [
                "worker",
                "--loglevel",
                "INFO",
                "--concurrency",
                "2",
                "--hostname",
                "demo-worker@%h",
                "--without-gossip",
                "--without-mingle",
            ],
            base,
        )
        scheduler = ["-S", SEAM_SCHEDULER] if skew.seam else []
        for label, offset in BEATS:
            process = processes.start(
                f"beat-{label}", ["beat", "--loglevel", "INFO", *scheduler], skew.envs[label]
            )
            beats.append(demo_report.Beat(label, offset, skew.verified[label], process.pid))
        say("  starting  worker and 3 beats ...")
        wait_until("the worker", lambda: " ready." in processes.log("worker"), processes)
        wait_until("the beats", lambda: beats_claiming([b.pid for b in beats]), processes)
        clock = authority_clock()
        say(f"  running   for {seconds:g} s; slots due from now on are counted")
        start = watch(seconds, clock, beats, processes)
        time.sleep(SETTLE_SECONDS)
        processes.stop(*[f"beat-{label}" for label, _ in BEATS])
        wait_for_runs(timeout=30)
    finally:
        processes.stop()
    result = demo_report.count(start, start + timedelta(seconds=seconds), beats)
    report = demo_report.table(result)
    say()
    say(report)
    picture = output / "timeline.png"
    why_not = demo_report.picture(result, picture)
    say()
    say(f"Timeline picture: {picture}" if why_not is None else why_not)
    (output / "report.txt").write_text(report + "\n")
    verdict = demo_report.verdict(result)
    if result.problems:
        say(f"FAILED: {verdict}. Logs: {output}/")
        return 1
    say(f"RESULT: every due slot ran exactly once, none early: {verdict}.")
    return 0


def open_admin(port: int) -> int:
    """Migrate, make sure the superuser exists with the printed password, run the server."""
    from django.contrib.auth import get_user_model
    from django.core.management import call_command

    call_command("migrate", verbosity=0, interactive=False)
    username = os.environ.setdefault("DJANGO_SUPERUSER_USERNAME", "admin")
    password = os.environ.setdefault("DJANGO_SUPERUSER_PASSWORD", "driftsafe-demo")
    os.environ.setdefault("DJANGO_SUPERUSER_EMAIL", "admin@example.com")
    user = get_user_model().objects.filter(username=username).first()
    if user is None:
        call_command("createsuperuser", interactive=False, verbosity=0)
    else:
        user.set_password(password)
        user.save()
    say(f"\n  Admin: http://127.0.0.1:{port}/admin/   user {username!r}, password {password!r}")
    say("  (DJANGO_SUPERUSER_USERNAME / DJANGO_SUPERUSER_PASSWORD choose others; Ctrl-C stops)\n")
    server = subprocess.Popen(
        [sys.executable, "manage.py", "runserver", f"127.0.0.1:{port}", "--noreload"],
        cwd=PROJECT,
        env={**os.environ},
    )
    try:
        return server.wait()
    except KeyboardInterrupt:  # a terminal's Ctrl-C reaches the server too; a kill -INT not
        server.terminate()
        server.wait()
        return 0


def main(argv: list[str]) -> int:
    command = argv[0] if argv else "demo"
    if command not in ("demo", "admin"):
        say(__doc__ or "")
        return 2
    try:
        seconds = float(os.environ.get("DEMO_SECONDS", "60"))
    except ValueError:
        seconds = 0
    if not 0 < seconds < 86400:
        say(f"DEMO_SECONDS={os.environ['DEMO_SECONDS']!r}: give the length in seconds, e.g. 60")
        return 2
    output = Path(os.environ.get("DEMO_OUTPUT", PROJECT / "demo-output")).resolve()
    output.mkdir(parents=True, exist_ok=True)
    if command == "demo":
        say(
            f"celery_driftsafe demo: {len(BEATS)} beats with skewed clocks, 1 worker, {seconds:g} s"
        )
    try:
        redis = provide_redis(
            os.environ.get("EXAMPLE_REDIS_URL"),
            output,
            cache=ROOT / ".cache" / "redis-server",
            label="EXAMPLE_REDIS_URL",
        )
    except NoRedis as exc:
        say(f"No Redis for the demo: {exc}")
        return 2
    say(f"  redis     {redis.description}" + ("; stopped at the end" if redis.process else ""))
    os.environ["EXAMPLE_REDIS_URL"] = redis.url
    try:
        setup_django()
        if command == "admin":
            return open_admin(int(os.environ.get("EXAMPLE_ADMIN_PORT", "8000")))
        return run_demo(seconds, output)
    except DemoFailed as exc:
        say(f"The demo could not run: {exc}")
        return 2
    except KeyboardInterrupt:
        say("\ninterrupted; children and Redis stopped")
        return 130
    finally:
        redis.stop()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
