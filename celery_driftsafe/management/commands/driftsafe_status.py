"""``manage.py driftsafe_status``: are the beats alive, whose clock is off, what is due, what
failed lately.

Exit status: 0 when at least one beat node is alive and every dependency answers, 2 when no
node is alive (so a monitoring probe can run it as is), 3 when nodes are alive but a dependency
is degraded (the configured Redis does not answer this command or an alive beat: the output
says what that stops), 4 when the database does not answer (nothing can be claimed), 1 for any
other error (for example an unreachable time authority).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DatabaseError, InterfaceError
from django.db.models import Count, Min, Q

from celery_driftsafe.celery_app import app_argument
from celery_driftsafe.conf import get_settings
from celery_driftsafe.core.preview import instant_text, offset_text
from celery_driftsafe.exceptions import ClockError, ConfigurationError, ScheduleError
from celery_driftsafe.models import BeatNode, PeriodicTask, Run, RunStatus
from celery_driftsafe.monitoring.health import beat_trouble, redis_outage_effects, redis_state

#: Exit status when no beat node is alive.
NO_NODE_ALIVE = 2
#: Exit status when beat nodes are alive but a dependency does not answer (degraded).
DEGRADED = 3
#: Exit status when the database does not answer this command.
DATABASE_UNREACHABLE = 4
_FAILED = (RunStatus.FAILED, RunStatus.MISSED)


@dataclass
class NodeReport:
    node_id: str
    hostname: str
    pid: int
    state: str
    heartbeat_age_seconds: float
    clock_offset_seconds: float | None
    clock_rtt_seconds: float | None
    offset_exceeds_bound: bool
    claiming_paused_reason: str
    #: Since when this node's Redis has not answered it (ISO), and why; None: it answers.
    redis_unreachable_since: str | None = None
    redis_error: str = ""


@dataclass
class Status:
    """Everything the command reports (also its ``--json`` output)."""

    authority: str
    now: str
    max_clock_offset_seconds: float
    nodes: list[NodeReport] = field(default_factory=list)
    alive: int = 0
    tasks_enabled: int = 0
    tasks_disabled: int = 0
    due_now: int = 0
    due_within_minute: int = 0
    oldest_due_slot: str | None = None
    undispatched_runs: int = 0
    failures_since: str = ""
    failure_count: int = 0
    recent_failures: list[dict[str, Any]] = field(default_factory=list)
    #: Runs flagged late (their task's deadline passed without a success) since
    #: ``failures_since``, and the tasks flagged stale (see docs/howto/deadlines.md).
    late_count: int = 0
    stale_tasks: list[dict[str, Any]] = field(default_factory=list)
    #: The configured Redis as this command reached it: ``reachable``, ``not configured`` or
    #: ``unreachable: <why>``; and, when it does not answer, what that stops.
    redis: str = "not configured"
    degraded: list[str] = field(default_factory=list)


def collect(now: datetime, *, since: timedelta, limit: int, authority: str) -> Status:
    """Gather the status at the authority's ``now`` (a handful of queries)."""
    settings = get_settings()
    dead_after = timedelta(seconds=settings.node_dead_after_seconds)
    bound = settings.max_clock_offset_seconds
    status = Status(authority=authority, now=now.isoformat(), max_clock_offset_seconds=bound)
    nodes = list(BeatNode.objects.order_by("hostname", "pid"))
    for node in nodes:
        state = node.state_at(now, dead_after)
        status.nodes.append(
            NodeReport(
                node_id=node.node_id,
                hostname=node.hostname,
                pid=node.pid,
                state=state,
                heartbeat_age_seconds=(now - node.last_heartbeat_at).total_seconds(),
                clock_offset_seconds=node.clock_offset_seconds,
                clock_rtt_seconds=node.clock_rtt_seconds,
                offset_exceeds_bound=node.offset_exceeds(bound),
                claiming_paused_reason=node.claiming_paused_reason,
                redis_unreachable_since=(
                    node.redis_unreachable_since.isoformat()
                    if node.redis_unreachable_since
                    else None
                ),
                redis_error=node.redis_error,
            )
        )
    status.alive = sum(1 for n in status.nodes if n.state == "alive")
    status.redis = redis_state(settings.redis_url)
    trouble = beat_trouble(nodes, now)
    cut_off = [node.node_id for node in trouble.redis_cut_off]
    if status.redis.startswith("unreachable") or cut_off:
        status.degraded.append(redis_outage_effects(str(settings.redis_unavailable)))
    if cut_off:
        status.degraded.append(f"beats that do not reach Redis: {', '.join(cut_off)}")
    if trouble.silent:
        status.degraded.append(trouble.silence_effects())
    counts = PeriodicTask.objects.aggregate(
        n_enabled=Count("pk", filter=Q(enabled=True)),
        n_disabled=Count("pk", filter=Q(enabled=False)),
        due_now=Count("pk", filter=Q(enabled=True, due_at__lte=now)),
        due_soon=Count(
            "pk", filter=Q(enabled=True, due_at__gt=now, due_at__lte=now + timedelta(minutes=1))
        ),
        oldest=Min("next_slot_at", filter=Q(enabled=True, due_at__lte=now)),
    )
    status.tasks_enabled, status.tasks_disabled = counts["n_enabled"], counts["n_disabled"]
    status.due_now, status.due_within_minute = counts["due_now"], counts["due_soon"]
    status.oldest_due_slot = counts["oldest"].isoformat() if counts["oldest"] else None
    status.undispatched_runs = Run.objects.filter(status=RunStatus.CLAIMED).count()
    start = now - since
    failures = Run.objects.filter(status__in=_FAILED, slot__gte=start)
    status.failures_since = start.isoformat()
    status.failure_count = failures.count()
    # Both on their partial indexes: the late runs', the tasks with a deadline or stale.
    status.late_count = Run.objects.filter(late_at__isnull=False, slot__gte=start).count()
    for name, since_at in (
        PeriodicTask.objects.filter(stale_since__isnull=False)
        .order_by("stale_since", "name")
        .values_list("name", "stale_since")[:limit]
    ):
        if since_at is not None:  # the filter asks for one
            status.stale_tasks.append({"task": name, "stale_since": since_at.isoformat()})
    for run in failures.order_by("-slot", "-id")[:limit]:
        status.recent_failures.append(
            {
                "run": run.pk,
                "task": run.task_name,
                "slot": run.slot.isoformat() if run.slot else None,
                "status": run.status,
                "node": run.claimed_by,
                "error": (run.error.splitlines() or [""])[0],
            }
        )
    return status


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:+.3f} s"


class Command(BaseCommand):
    help = (
        "Show beat nodes (alive/dead, clock offsets), due counts and recent failures. "
        f"Exits {NO_NODE_ALIVE} when no beat node is alive."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true", help="print one JSON document")
        parser.add_argument(
            "--since",
            type=float,
            default=24.0,
            metavar="HOURS",
            help="failures of the last HOURS hours (default 24)",
        )
        parser.add_argument(
            "--task",
            metavar="NAME",
            help="instead of the status, list the next slots of the task NAME (see --next)",
        )
        parser.add_argument(
            "--next",
            type=int,
            default=10,
            metavar="N",
            help="with --task: how many slots to list (default 10)",
        )
        parser.add_argument(
            "--failures",
            type=int,
            default=10,
            metavar="N",
            help="list at most N recent failures (default 10)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        from celery_driftsafe.store.clock import authority_from_settings

        if options["task"] is not None:
            self._preview(options["task"], max(options["next"], 0), options["json"])
            return
        authority = None
        try:
            authority = authority_from_settings()
            now = authority.read()
            status = collect(
                now,
                since=timedelta(hours=options["since"]),
                limit=max(options["failures"], 0),
                authority=authority.name,
            )
        except (DatabaseError, InterfaceError, ClockError, ConfigurationError) as exc:
            database = isinstance(exc, DatabaseError | InterfaceError) or (
                isinstance(exc, ClockError) and getattr(authority, "name", "") == "database"
            )
            if not database:
                raise CommandError(f"cannot read the time authority: {exc}") from exc
            raise CommandError(
                f"the database does not answer ({str(exc).strip()}): no beat can claim a slot "
                "until it does, and the slots due meanwhile meet their misfire policy",
                returncode=DATABASE_UNREACHABLE,
            ) from exc
        if options["json"]:
            self.stdout.write(json.dumps(asdict(status), indent=2))
        else:
            self._print(status)
        if status.alive == 0:
            raise CommandError(
                f"no beat node is alive: nothing is claiming slots (start `celery -A "
                f"{app_argument()} beat -S driftsafe`)",
                returncode=NO_NODE_ALIVE,
            )
        if status.degraded:
            raise CommandError(
                "degraded: " + "; ".join(status.degraded) + f" (REDIS_URL {status.redis} here)",
                returncode=DEGRADED,
            )

    def _preview(self, name: str, count: int, as_json: bool) -> None:
        """The next ``count`` slots of the task ``name``, at the authority's now as a save of
        the task reads it."""
        from celery_driftsafe.definitions.changes import authority_now, preview

        task = PeriodicTask.objects.filter(name=name).first()
        if task is None:
            raise CommandError(
                f"no periodic task is named {name!r} (the names are listed in the admin, or "
                "by PeriodicTask.objects.values_list('name'))"
            )
        try:
            now = authority_now()
        except (ClockError, ConfigurationError) as exc:
            raise CommandError(f"cannot read the time authority: {exc}") from exc
        try:
            result = preview(task, now, count=count)
        except (ScheduleError, OverflowError) as exc:
            raise CommandError(f"the schedule of {name!r} cannot be evaluated: {exc}") from exc
        if as_json:
            rows = [
                {
                    "slot": row.slot.isoformat(),
                    "due": row.due.isoformat(),
                    "fires_at": row.fires_at.isoformat(),
                    "local": row.local.isoformat(),
                    "offset_change": None
                    if row.offset_change is None
                    else [offset_text(value) for value in row.offset_change],
                }
                for row in result.rows
            ]
            self.stdout.write(
                json.dumps({"task": name, "now": now.isoformat(), "slots": rows, "end": result.end})
            )
            return
        out = self.stdout.write
        out(f"next slots of {name} ({task.timezone} and UTC), at {now.isoformat()}:")
        if not task.enabled:
            out(self.style.WARNING("  the task is disabled: it fires none of these until enabled"))
        for row in result.rows:
            line = f"  {row.local_text}  {instant_text(row.slot)} UTC"
            if row.jittered:
                line += f"  fires {row.fires_text} UTC (jitter)"
            if row.held:
                line += f", held: due {row.due_text}, fires with the slot before"
            if row.offset_change is not None:
                line += f"  DST: {row.offset_change_text('->')}"
            out(line)
        if result.end is not None:
            out(f"  no further slot: {result.end}")

    def _print(self, status: Status) -> None:
        out, style = self.stdout.write, self.style
        out(f"time authority: {status.authority}, now {status.now}")
        redis_line = f"redis: {status.redis}"
        out(style.ERROR(redis_line) if status.degraded else redis_line)
        out(
            f"\nbeat nodes ({status.alive} alive of {len(status.nodes)}; offset bound "
            f"±{status.max_clock_offset_seconds} s):"
        )
        if not status.nodes:
            out("  (none registered)")
        for node in status.nodes:
            offset = _seconds(node.clock_offset_seconds)
            if node.clock_rtt_seconds is not None:
                offset += f" ±{node.clock_rtt_seconds / 2 * 1000:.1f} ms"
            if node.offset_exceeds_bound:
                offset = style.WARNING(offset + "  EXCEEDS BOUND")
            state = {"alive": style.SUCCESS, "dead": style.ERROR}.get(node.state, style.NOTICE)(
                node.state
            )
            line = (
                f"  {node.node_id:<40} {state:<7} heartbeat "
                f"{node.heartbeat_age_seconds:.1f} s ago  offset {offset}"
            )
            if node.claiming_paused_reason:
                line += style.ERROR(f"  PAUSED: {node.claiming_paused_reason}")
            if node.redis_unreachable_since:
                line += style.ERROR(
                    f"  REDIS UNREACHABLE since {node.redis_unreachable_since}: {node.redis_error}"
                )
            out(line)
        out(
            f"\ntasks: {status.tasks_enabled} enabled, {status.tasks_disabled} disabled; "
            f"due now {status.due_now} (oldest slot {status.oldest_due_slot or '-'}), "
            f"due within a minute {status.due_within_minute}"
        )
        out(f"runs claimed but not yet dispatched: {status.undispatched_runs}")
        out(f"\nfailed or missed runs since {status.failures_since}: {status.failure_count}")
        for failure in status.recent_failures:
            out(
                f"  #{failure['run']} {failure['task']} slot {failure['slot']} "
                f"{failure['status']} on {failure['node'] or '-'}: {failure['error']}"
            )
        out(f"runs that missed their deadline since {status.failures_since}: {status.late_count}")
        if status.stale_tasks:
            out(style.WARNING("stale tasks (no success in their last slots):"))
            for stale in status.stale_tasks:
                out(f"  {stale['task']} since {stale['stale_since']}")
