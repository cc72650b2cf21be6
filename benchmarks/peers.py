"""One small adapter per benchmarked scheduler: how it is started, seeded and edited.

The parent side (``benchmarks/compare.py``) only needs each adapter's ``key``, ``label``,
``scheduler`` (the ``celery beat -S`` value) and ``tuned_env``. Seeding and editing run in a
child process configured like a beat (``python -m benchmarks.peers <key> <command>``, JSON on
stdin and stdout), because they need the trial's Django settings and Celery app.

Every entry is ``bench-<index>``, calls ``bench.tick`` with ``args = [index, version]`` and runs
on an interval of ``every`` seconds whose first due instant is ``first_due`` (true time). The
recorder reads ``args`` back from each published message, so messages are told apart the same
way for every scheduler.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

#: Start-up flags shared by every beat (as shipped: no log level, so Celery's WARNING).
BEAT_ARGS = ("-A", "benchmarks.bench_app", "beat")


@dataclass(frozen=True)
class Entry:
    """One periodic entry as the benchmark defines it, before any scheduler sees it."""

    index: int
    every: int
    first_due: datetime
    enabled: bool = True

    @property
    def name(self) -> str:
        return entry_name(self.index)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "first_due": self.first_due.isoformat()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Entry:
        return cls(**{**data, "first_due": datetime.fromisoformat(data["first_due"])})


def entry_name(index: int) -> str:
    return f"bench-{index:06d}"


class Peer:
    """A scheduler under test. Subclasses fill in the class attributes and the child side."""

    key = ""
    label = ""
    scheduler = ""
    #: Settings of the "tuned" failover run, as environment for ``bench_settings``.
    tuned: dict[str, str] = {}
    #: What "tuned" means, for the report.
    tuned_note = ""
    #: The settings that matter, as shipped, for the report.
    shipped_note = ""
    #: Distribution name on PyPI, for the version line.
    dist = ""

    # -- child side: runs inside the trial's settings ----------------------------------------

    def seed(self, entries: list[Entry]) -> None:
        raise NotImplementedError

    def set_interval(self, index: int, every: int) -> datetime | None:
        """Change entry ``index`` to run every ``every`` seconds, as an operator would (the
        documented way: ORM save / entry save). Returns the first due instant the scheduler
        will use if it lies in the future (a slot grid), else None (due at once)."""
        raise NotImplementedError


class DriftSafe(Peer):
    key = "driftsafe"
    label = "celery_driftsafe"
    scheduler = "celery_driftsafe.scheduler:DriftSafeScheduler"
    dist = "celery-driftsafe"
    shipped_note = (
        "all beats active; MAX_LOOP_INTERVAL_SECONDS 1, LEASE_SECONDS 30, "
        "NODE_DEAD_AFTER_SECONDS 30, wake-ups over Redis pub/sub"
    )

    def seed(self, entries: list[Entry]) -> None:
        from benchmarks.bench_app import TASK
        from celery_driftsafe.models import PeriodicTask

        PeriodicTask.objects.bulk_create(
            (
                PeriodicTask(
                    name=e.name,
                    task=TASK,
                    args=[e.index, 0],
                    schedule_kind="interval",
                    interval_every=e.every,
                    interval_unit="seconds",
                    interval_anchor=e.first_due,
                    next_slot_at=e.first_due,
                    enabled=e.enabled,
                )
                for e in entries
            ),
            batch_size=5000,
        )

    def set_interval(self, index: int, every: int) -> datetime | None:
        from celery_driftsafe.models import PeriodicTask

        task = PeriodicTask.objects.get(name=entry_name(index))
        task.interval_every = every
        task.save()  # recomputes next_slot_at from the authority, wakes every beat
        task.refresh_from_db(fields=["next_slot_at"])
        return task.next_slot_at


class DjangoCeleryBeat(Peer):
    key = "django-celery-beat"
    label = "django-celery-beat"
    scheduler = "django_celery_beat.schedulers:DatabaseScheduler"
    dist = "django-celery-beat"
    tuned = {"BENCH_MAX_LOOP": "1"}
    tuned_note = "beat_max_loop_interval = 1 s (no lock to tune: every beat fires)"
    shipped_note = (
        "no coordination between beats; beat_max_loop_interval 5 s "
        "(the scheduler's DEFAULT_MAX_INTERVAL); schedule re-read when "
        "PeriodicTasks.last_update changes"
    )

    def seed(self, entries: list[Entry]) -> None:
        from django_celery_beat.models import IntervalSchedule, PeriodicTask, PeriodicTasks

        from benchmarks.bench_app import TASK

        intervals = {
            every: IntervalSchedule.objects.get_or_create(
                every=every, period=IntervalSchedule.SECONDS
            )[0]
            for every in {e.every for e in entries}
        }
        PeriodicTask.objects.bulk_create(
            (
                PeriodicTask(
                    name=e.name,
                    task=TASK,
                    interval=intervals[e.every],
                    args=json.dumps([e.index, 0]),
                    kwargs="{}",
                    enabled=e.enabled,
                    # due when last_run_at + every is reached: at first_due
                    last_run_at=e.first_due - timedelta(seconds=e.every),
                )
                for e in entries
            ),
            batch_size=5000,
        )
        PeriodicTasks.update_changed()  # the documented call after bulk changes

    def set_interval(self, index: int, every: int) -> datetime | None:
        from django_celery_beat.models import IntervalSchedule, PeriodicTask

        task = PeriodicTask.objects.get(name=entry_name(index))
        task.interval = IntervalSchedule.objects.get_or_create(
            every=every, period=IntervalSchedule.SECONDS
        )[0]
        task.save()  # bumps PeriodicTasks.last_update
        return None


class RedBeat(Peer):
    key = "redbeat"
    label = "RedBeat"
    scheduler = "redbeat.RedBeatScheduler"
    dist = "celery-redbeat"
    tuned = {"BENCH_MAX_LOOP": "1", "BENCH_REDBEAT_LOCK": "5"}
    tuned_note = (
        "beat_max_loop_interval = 1 s and redbeat_lock_timeout = 5 s "
        "(a standby retries the lock every loop interval)"
    )
    shipped_note = (
        "one active beat holding a Redis lock; redbeat_lock_timeout = 5 x "
        "beat_max_loop_interval = 1500 s; standbys retry the lock every 300 s"
    )

    def seed(self, entries: list[Entry]) -> None:
        from celery.schedules import schedule
        from redbeat.decoder import RedBeatJSONEncoder, to_timestamp
        from redbeat.schedulers import RedBeatSchedulerEntry, get_redis

        from benchmarks.bench_app import TASK, app

        client = get_redis(app)
        schedule_key = app.redbeat_conf.schedule_key
        for start in range(0, len(entries), 2000):
            with client.pipeline(transaction=False) as pipe:
                for e in entries[start : start + 2000]:
                    every = timedelta(seconds=e.every)
                    entry = RedBeatSchedulerEntry(
                        e.name,
                        TASK,
                        schedule(every, app=app),
                        args=[e.index, 0],
                        enabled=e.enabled,
                        app=app,
                    )
                    definition = {
                        "name": entry.name,
                        "task": entry.task,
                        "args": entry.args,
                        "kwargs": entry.kwargs,
                        "options": entry.options,
                        "schedule": entry.schedule,
                        "enabled": entry.enabled,
                    }
                    meta = {"last_run_at": e.first_due - every}
                    pipe.hset(
                        entry.key,
                        mapping={
                            "definition": json.dumps(definition, cls=RedBeatJSONEncoder),
                            "meta": json.dumps(meta, cls=RedBeatJSONEncoder),
                        },
                    )
                    # the score RedBeat itself stores after a run at last_run_at
                    pipe.zadd(schedule_key, {entry.key: to_timestamp(e.first_due)})
                pipe.execute()

    def set_interval(self, index: int, every: int) -> datetime | None:
        from celery.schedules import schedule
        from redbeat.schedulers import RedBeatSchedulerEntry, ensure_conf

        from benchmarks.bench_app import app

        ensure_conf(app)
        key = RedBeatSchedulerEntry.generate_key(app, entry_name(index))
        entry = RedBeatSchedulerEntry.from_key(key, app=app)
        entry.schedule = schedule(timedelta(seconds=every), app=app)
        entry.save()  # the documented way to edit an entry
        return None


PEERS: dict[str, Peer] = {p.key: p for p in (DriftSafe(), DjangoCeleryBeat(), RedBeat())}


def _child(key: str, command: str) -> None:
    import django

    django.setup()
    peer = PEERS[key]
    payload = json.load(sys.stdin)
    if command == "seed":
        peer.seed([Entry.from_json(e) for e in payload["entries"]])
        json.dump({}, sys.stdout)
    elif command == "set_interval":
        # one edit after another, each at its planned real time; each edit is stamped with
        # this process's (unskewed) clock right after it committed
        import time

        done = []
        for edit in payload["edits"]:
            at = datetime.fromisoformat(edit["at"])
            time.sleep(max(0.0, (at - datetime.now(UTC)).total_seconds()))
            due = peer.set_interval(edit["index"], edit["every"])
            done.append(
                {
                    "index": edit["index"],
                    "edited_at": datetime.now(UTC).isoformat(),
                    "due_at": due.isoformat() if due else None,
                }
            )
        json.dump({"edits": done}, sys.stdout)
    else:
        raise SystemExit(f"unknown command {command!r}: use seed or set_interval")


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
