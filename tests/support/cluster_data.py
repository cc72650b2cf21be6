"""An hour of a realistic cluster for the dashboard tests and its screenshot: three live beats
(one with its clock 1.3 s off), one that died twenty minutes ago, tasks every 30 s, 1 min and
5 min fired by whichever beat won each slot, mostly within milliseconds, a slow patch with
second-long lateness, two missed slots and a few runs still in flight."""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta

from celery_driftsafe import __version__
from celery_driftsafe.models import BeatNode, PeriodicTask, Run, RunKind, RunStatus
from tests.support.factories import crontab_task, interval_task

BEATS = (  # host, pid, clock offset, seconds since the last heartbeat
    ("beat-a", 4101, 0.0031, 1.2),
    ("beat-b", 4102, 0.412, 2.5),
    ("beat-c", 4103, -1.284, 3.1),
    ("beat-d", 3999, 0.002, 1200.0),
)


def beat_node(
    now: datetime, host: str, pid: int, offset: float, age: float, **fields: object
) -> BeatNode:
    """A beat node started three hours ago whose clock is ``offset`` s off, last heard from
    ``age`` s before ``now``."""
    return BeatNode.objects.create(
        node_id=f"{host}:{pid}:5f2a",
        hostname=host,
        pid=pid,
        version=__version__,
        started_at=now - timedelta(hours=3),
        last_heartbeat_at=now - timedelta(seconds=age),
        clock_offset_seconds=offset,
        clock_rtt_seconds=0.0009,
        clock_measured_at=now - timedelta(seconds=age),
        **fields,
    )


@dataclass
class Seeded:
    nodes: list[BeatNode]
    tasks: list[PeriodicTask]
    runs: list[Run]


def seed_cluster(now: datetime, *, seed: int = 7) -> Seeded:
    rng = random.Random(seed)
    nodes = [
        beat_node(now, host, pid, offset, age, lag_seconds=0.004)
        for host, pid, offset, age in BEATS
    ]
    anchor = (now - timedelta(hours=2)).replace(second=0, microsecond=0)
    tasks = [
        interval_task("refresh-cache", 30, anchor=anchor, task="tests.add"),
        interval_task("sync-inventory", 60, anchor=anchor, task="tests.add"),
        interval_task("send-digests", 300, anchor=anchor, task="tests.add"),
    ]
    tasks.append(crontab_task("nightly-report", "15 3 * * *", "Europe/Berlin", task="tests.add"))
    died = now - timedelta(seconds=BEATS[3][3])
    slow = (now - timedelta(minutes=27), now - timedelta(minutes=24))
    rows: list[Run] = []
    for task in tasks[:3]:
        every = timedelta(seconds=task.interval_every or 60)
        slot = anchor
        # from 59 minutes ago: every run lies inside the dashboard's hour, none on its edge
        while slot <= now - timedelta(seconds=1):
            if slot >= now - timedelta(minutes=59):
                rows.append(_run(rng, task, slot, nodes, died, slow))
            slot += every
        last = rows[-1]
        if task.name == "refresh-cache":  # just claimed, not published yet
            last.status = RunStatus.CLAIMED
            last.dispatched_at = last.started_at = last.finished_at = None
        elif task.name == "sync-inventory":  # running
            last.status, last.finished_at = RunStatus.STARTED, None
        PeriodicTask.objects.filter(pk=task.pk).update(last_slot_at=slot - every, next_slot_at=slot)
    Run.objects.bulk_create(rows)
    return Seeded(nodes, tasks, list(Run.objects.order_by("slot")))


def _run(
    rng: random.Random,
    task: PeriodicTask,
    slot: datetime,
    nodes: list[BeatNode],
    died: datetime,
    slow: tuple[datetime, datetime],
) -> Run:
    live = nodes[:3] if slot > died else nodes
    node = rng.choice(live)
    late = timedelta(milliseconds=rng.lognormvariate(2.3, 0.6))  # mostly 5-25 ms
    if rng.random() < 0.06:
        late = timedelta(milliseconds=rng.uniform(120, 600))
    if slow[0] <= slot <= slow[1]:
        late = timedelta(seconds=rng.uniform(1.1, 3.5))
    status = RunStatus.SUCCEEDED
    if rng.random() < 0.03:
        status = RunStatus.FAILED
    missed = task.name == "sync-inventory" and died - timedelta(minutes=2) <= slot <= died
    fields: dict[str, object] = {
        "claimed_at": slot + late,
        "dispatched_at": slot + late + timedelta(milliseconds=1),
        "started_at": slot + late + timedelta(milliseconds=8),
        "finished_at": slot + late + timedelta(milliseconds=rng.uniform(200, 2500)),
    }
    if missed:
        status = RunStatus.MISSED
        fields = {"claimed_at": slot + timedelta(minutes=2)}
        node = nodes[0]
    return Run(
        periodic_task=task,
        task_name=task.task,
        kind=RunKind.SCHEDULED,
        slot=slot,
        status=status,
        claimed_by=node.node_id,
        celery_task_id=str(uuid.uuid4()),
        error="ConnectionError: upstream refused" if status == RunStatus.FAILED else "",
        **fields,
    )
