"""The cluster dashboard: one admin page to look at rather than read.

* the beat nodes, each with its state, measured clock offset (drawn against
  ``MAX_CLOCK_OFFSET_SECONDS``), lag and what it fired in the last hour;
* a histogram of the dispatch lateness (slot to publish) of the recent runs;
* a timeline of the last hour: one lane per beat, one mark per run at its slot, coloured by
  how late it went out (missed slots and runs not yet published marked apart);
* what fires next.

Everything is drawn on the server (SVG and HTML/CSS in the template): no JavaScript, nothing
from a CDN, so it works in an admin without internet. The queries are bounded (see
:mod:`celery_driftsafe.monitoring.cluster`): the newest :data:`MAX_RUNS` runs of the last hour, the
:data:`NEXT_FIRES` nearest slots, at most ``cluster.MAX_NODES`` nodes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.template.response import TemplateResponse
from django.utils import timezone
from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

from celery_driftsafe.admin.display import local_text, read_authority, relative, seconds_text
from celery_driftsafe.conf import get_settings
from celery_driftsafe.models import BeatNode, PeriodicTask, RunStatus, unreadable_instants
from celery_driftsafe.monitoring import cluster
from celery_driftsafe.monitoring.health import beat_trouble, redis_outage_effects, redis_state

#: The timeline's window.
WINDOW = timedelta(hours=1)
#: At most this many runs are drawn (the newest of the window).
MAX_RUNS = 2000
#: Tasks listed under "fires next".
NEXT_FIRES = 15
#: At most this many lanes in the timeline; other claimers share the last one.
MAX_LANES = 12

# The drawing's geometry, in SVG user units.
WIDTH = 1200
LEFT = 190
RIGHT = 20
LANE = 34
TOP = 26
AXIS = 26

#: Lateness classes: (upper bound in seconds, CSS class, legend).
LATENESS_CLASSES: tuple[tuple[float, str, str], ...] = (
    (0.1, "on-time", "< 100 ms"),
    (1.0, "late", "100 ms to 1 s"),
    (float("inf"), "very-late", "≥ 1 s"),
)


def lateness_class(seconds: float | None, status: str) -> str:
    if status == RunStatus.MISSED:
        return "missed"
    if seconds is None:
        return "pending"
    if seconds < 0:
        return "early"
    for bound, name, _ in LATENESS_CLASSES:
        if seconds < bound:
            return name
    return LATENESS_CLASSES[-1][1]


@dataclass
class Mark:
    x: float
    y: float
    css: str
    title: str

    @property
    def corner(self) -> tuple[float, float]:
        """Top left of a square mark centred on (x, y)."""
        return round(self.x - 4, 1), round(self.y - 4, 1)


@dataclass
class Lane:
    label: str
    title: str
    y: float
    marks: list[Mark] = field(default_factory=list)

    @property
    def top(self) -> float:
        return self.y - 13

    @property
    def text_y(self) -> float:
        return self.y + 4


@dataclass
class Tick:
    x: float
    label: str


@dataclass
class Timeline:
    width: int
    height: int
    left: int
    right_edge: int
    lanes: list[Lane]
    ticks: list[Tick]
    runs: int

    @property
    def lane_width(self) -> int:
        return self.right_edge - self.left

    @property
    def grid_bottom(self) -> int:
        return self.height - 20

    @property
    def label_y(self) -> int:
        return self.height - 6

    def marks_svg(self) -> SafeString:
        """Every mark as SVG (built here, not in a template loop: there may be thousands)."""
        circle = '<circle class="ds-mark {}" cx="{}" cy="{}" r="4"><title>{}</title></circle>'
        square = (
            '<rect class="ds-mark missed" x="{}" y="{}" width="8" height="8">'
            "<title>{}</title></rect>"
        )
        parts = []
        for lane in self.lanes:
            for mark in lane.marks:
                if mark.css == "missed":
                    parts.append(square.format(*mark.corner, escape(mark.title)))
                else:
                    parts.append(circle.format(mark.css, mark.x, mark.y, escape(mark.title)))
        # safe: numbers, fixed class names, escaped titles
        return mark_safe("\n".join(parts))


@dataclass
class NodeRow:
    node: BeatNode
    state: str
    offset_text: str
    offset_exceeded: bool
    #: Where the offset bar starts and how wide it is, in percent of the cell (centre: 50).
    bar_left: float
    bar_width: float
    heartbeat: str
    lag: str
    fired: int
    p50: str
    worst: str


@dataclass
class Bar:
    label: str
    count: int
    x: float
    y: float
    width: float
    height: float

    @property
    def count_y(self) -> float:
        return round(self.y - 4, 1)

    @property
    def centre(self) -> float:
        return round(self.x + self.width / 2, 1)


def _short(node_id: str) -> str:
    """``host:pid`` of a node id ``host:pid:random``."""
    parts = node_id.split(":")
    return ":".join(parts[:2]) if len(parts) >= 3 else node_id


def timeline(
    runs: Sequence[cluster.RecentRun], nodes: Sequence[BeatNode], now: datetime
) -> Timeline:
    """Lanes (one per claimer, nodes first in their order) with a mark per run at its slot."""
    start = now - WINDOW
    span = WINDOW.total_seconds()
    right_edge = WIDTH - RIGHT
    usable = right_edge - LEFT
    order = [n.node_id for n in nodes]
    claimers = {run.claimed_by for run in runs}
    names = [n for n in order if n in claimers]
    names += sorted(claimers - set(names))
    if len(names) > MAX_LANES:
        names = [*names[: MAX_LANES - 1], "other"]
    lanes: dict[str, Lane] = {}
    for index, name in enumerate(names):
        label = "other claimers" if name == "other" else _short(name)
        lanes[name] = Lane(label, name, TOP + LANE * index + LANE / 2)
    for run in runs:
        instant = run.slot or run.claimed_at
        if instant is None or instant < start:
            continue
        lane = lanes.get(run.claimed_by) or lanes.get("other")
        if lane is None:
            continue
        x = LEFT + min((instant - start).total_seconds() / span, 1.0) * usable
        late = run.lateness
        if run.status == RunStatus.MISSED:
            what = "missed"
        elif late is None:
            what = f"{run.status}, not published yet"
        else:
            what = f"published {'+' if late >= 0 else ''}{seconds_text(late)} after its slot"
        title = (
            f"{run.task_name} · slot {local_text(instant, milliseconds=True)} · "
            f"{run.claimed_by} · {what} · {run.status}"
        )
        lane.marks.append(Mark(round(x, 1), lane.y, lateness_class(late, run.status), title))
    ticks = []
    first = (start + timedelta(minutes=10)).replace(second=0, microsecond=0)
    first -= timedelta(minutes=first.minute % 10)
    tick = first
    while tick <= now:
        if tick >= start:
            x = LEFT + (tick - start).total_seconds() / span * usable
            ticks.append(Tick(round(x, 1), f"{timezone.localtime(tick):%H:%M}"))
        tick += timedelta(minutes=10)
    height = TOP + LANE * max(len(lanes), 1) + AXIS
    return Timeline(
        WIDTH,
        height,
        LEFT,
        right_edge,
        list(lanes.values()),
        ticks,
        sum(len(lane.marks) for lane in lanes.values()),
    )


def bars(buckets: Sequence[cluster.Bucket], *, width: int = 560, height: int = 160) -> list[Bar]:
    """The histogram's bars, scaled to the tallest."""
    top = max((b.count for b in buckets), default=0) or 1
    slot = width / max(len(buckets), 1)
    out = []
    for i, bucket in enumerate(buckets):
        h = bucket.count / top * height
        out.append(
            Bar(
                bucket.label,
                bucket.count,
                round(i * slot + 4, 1),
                round(height - h + 18, 1),
                round(slot - 8, 1),
                round(h, 1),
            )
        )
    return out


def node_rows(
    nodes: Sequence[BeatNode], runs: Sequence[cluster.RecentRun], now: datetime
) -> list[NodeRow]:
    settings = get_settings()
    dead_after = timedelta(seconds=settings.node_dead_after_seconds)
    bound = settings.max_clock_offset_seconds
    # The bar's full half-width is twice the warning bound (further off: clipped).
    scale = 2 * bound
    late_by_node: dict[str, list[float]] = defaultdict(list)
    fired: dict[str, int] = defaultdict(int)
    for run in runs:
        if run.status != RunStatus.MISSED:
            fired[run.claimed_by] += 1
        if run.lateness is not None:
            late_by_node[run.claimed_by].append(run.lateness)
    rows = []
    for node in nodes:
        offset = node.clock_offset_seconds
        if offset is None:
            text, left, width = "not measured", 50.0, 0.0
        else:
            text = f"{'+' if offset >= 0 else ''}{seconds_text(offset)}"
            share = max(-1.0, min(1.0, offset / scale)) * 50
            left, width = (50.0, share) if share >= 0 else (50.0 + share, -share)
        values = late_by_node.get(node.node_id, [])
        p50 = cluster.quantile(values, 0.5)
        worst = max(values) if values else None
        rows.append(
            NodeRow(
                node=node,
                state=node.state_at(now, dead_after),
                offset_text=text,
                offset_exceeded=node.offset_exceeds(bound),
                bar_left=round(left, 2),
                bar_width=round(width, 2),
                heartbeat=relative(node.last_heartbeat_at, now),
                lag="—" if node.lag_seconds is None else seconds_text(node.lag_seconds),
                fired=fired.get(node.node_id, 0),
                p50="—" if p50 is None else f"+{seconds_text(p50)}",
                worst="—" if worst is None else f"+{seconds_text(worst)}",
            )
        )
    return rows


def context(now: datetime) -> dict[str, Any]:
    """Everything the dashboard shows at the authority's ``now``."""
    nodes = cluster.nodes(now)
    runs = cluster.recent_runs(now - WINDOW, limit=MAX_RUNS)
    late = [r.lateness for r in runs if r.lateness is not None]
    buckets = cluster.histogram(late)
    upcoming = []
    unreadable: dict[int, str] = {}
    try:
        fires = cluster.next_fires(limit=NEXT_FIRES)
    except (ValueError, TypeError, AttributeError):  # Django's reading of a stored instant
        unreadable = unreadable_instants()
        if not unreadable:
            raise
        fires = cluster.next_fires(limit=NEXT_FIRES, leave_out=list(unreadable))
    for task in fires:
        due = task.due_at or task.next_slot_at
        # A row written without a next slot (raw SQL) is listed at its due instant; the
        # claim disables it.
        slot = task.next_slot_at or due
        assert due is not None and slot is not None  # next_fires: one of them is set
        upcoming.append(
            {
                "task": task,
                "at": local_text(slot, same_day_as=now),
                "relative": relative(due, now),
                "overdue": due <= now,
                "jitter": (due - slot).total_seconds(),
            }
        )
    settings = get_settings()
    redis_here = redis_state(settings.redis_url)
    trouble = beat_trouble(nodes, now)
    redis_cut_off = [
        {
            "node_id": node.node_id,
            "since": local_text(since, same_day_as=now),
            "error": node.redis_error,
        }
        for node in trouble.redis_cut_off
        if (since := node.redis_unreachable_since) is not None  # all: the cut-off have one
    ]
    return {
        "now_text": local_text(now, milliseconds=True),
        # Redis as this process reaches it, and the alive beats that do not reach it: what
        # that stops (the same words as driftsafe_status and the beat's log).
        "redis_here": redis_here,
        "redis_cut_off": redis_cut_off,
        "degraded": redis_outage_effects()
        if redis_cut_off or redis_here.startswith("unreachable")
        else "",
        # Beats alive but not heard from for a few heartbeats (the database out of their reach).
        "silence": trouble.silence_effects(),
        "nodes": node_rows(nodes, runs, now),
        "alive": sum(
            1
            for n in nodes
            if n.state_at(now, timedelta(seconds=settings.node_dead_after_seconds)) == "alive"
        ),
        "offset_bound": seconds_text(settings.max_clock_offset_seconds),
        "bars": bars(buckets),
        "published": len(late),
        "missed": sum(1 for r in runs if r.status == RunStatus.MISSED),
        "runs_shown": len(runs),
        "runs_capped": len(runs) >= MAX_RUNS,
        "oldest_shown": local_text(runs[-1].claimed_at, same_day_as=now)
        if runs and runs[-1].claimed_at
        else "",
        "max_runs": MAX_RUNS,
        "p50": _q(late, 0.5),
        "p99": _q(late, 0.99),
        "worst": f"+{seconds_text(max(late))}" if late else "—",
        "timeline": timeline(runs, nodes, now),
        "classes": [(name, legend) for _, name, legend in LATENESS_CLASSES],
        "upcoming": upcoming,
        # Tasks whose stored instants Django cannot read (SQLite): named, not read.
        "unreadable": [
            {"pk": pk, "name": name, "problem": unreadable[pk]}
            for pk, name in PeriodicTask.objects.filter(pk__in=unreadable)
            .order_by("name")
            .values_list("pk", "name")
        ]
        if unreadable
        else [],
        "backlog": cluster.backlog(now),
    }


def _q(values: Sequence[float], q: float) -> str:
    found = cluster.quantile(values, q)
    return "—" if found is None else f"+{seconds_text(found)}"


def dashboard_view(model_admin: Any, request: Any) -> TemplateResponse:
    """The page (wrapped in ``admin_view`` by the node admin's URLs)."""
    now = read_authority()
    page: dict[str, Any] = {
        **model_admin.admin_site.each_context(request),
        "title": "Cluster dashboard",
        "opts": model_admin.model._meta,
        "now": now,
    }
    if now is not None:
        page.update(context(now))
    return TemplateResponse(request, "admin/celery_driftsafe/dashboard.html", page)
