"""The demo's count: every due slot, what fired it, what ran, and the timeline picture.

All instants are the time authority's. For each task, the slots due in the window come from
its schedule (the package's schedule values), never from what fired. A slot *fired* when a
beat
claimed and published it (a ``Run`` row with ``dispatched_at``, or ``started_at``: see below);
it *ran* when the task body wrote its ``Execution`` row. A slot is *doubled* when it has two
runs or its body ran twice, *missed* when it was due and its body never ran, *early* when it
was claimed, dispatched or started before its slot. Lateness is ``dispatched_at - slot``.

A beat marks a run dispatched right after publishing it, but only while the run is still
``claimed``: when the worker starts it first, ``dispatched_at`` stays empty. Such a run was
published all the same (a worker started it), and its lateness is taken from ``started_at``,
an upper bound; the table says how many.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from celery_driftsafe.testing.recording import percentile


@dataclass
class Beat:
    """What the demo knows about one beat it started."""

    label: str
    skew: float
    verified: float | None
    pid: int


@dataclass
class Firing:
    slot: datetime
    node: str  # beat label, or "?" for a node the demo did not start
    lateness: float
    ran: int
    dispatch_recorded: bool = True


@dataclass
class TaskCount:
    name: str
    schedule: str
    due: int = 0
    fired: int = 0
    ran: int = 0
    doubled: list[datetime] = field(default_factory=list)
    missed: list[datetime] = field(default_factory=list)
    early: list[datetime] = field(default_factory=list)
    unexpected: list[datetime] = field(default_factory=list)
    firings: list[Firing] = field(default_factory=list)

    def lateness(self, quantile: float) -> float | None:
        values = [f.lateness for f in self.firings]
        return percentile(values, 100 * quantile) if values else None


@dataclass
class NodeCount:
    beat: Beat
    offset: float | None = None
    rtt: float | None = None
    fired: int = 0
    stopped: bool = False


@dataclass
class Count:
    start: datetime
    end: datetime
    tasks: list[TaskCount]
    nodes: list[NodeCount]
    doubled_outside: int = 0
    caught_redeliveries: int = 0

    @property
    def problems(self) -> int:
        return self.doubled_outside + sum(
            len(t.doubled) + len(t.missed) + len(t.early) + len(t.unexpected) for t in self.tasks
        )


def count(start: datetime, end: datetime, beats: list[Beat]) -> Count:
    """Count the slots in ``[start, end)`` of every task in the database."""
    from shop.models import Execution

    from celery_driftsafe.models import BeatNode, PeriodicTask, Run, RunKind

    nodes = {node.pid: node for node in BeatNode.objects.all()}
    label_of = {nodes[b.pid].node_id: b.label for b in beats if b.pid in nodes}
    executions = Counter(Execution.objects.exclude(run_id=None).values_list("run_id", flat=True))
    runs_by_task = defaultdict(list)
    result = Count(start, end, [], [])
    for run in Run.objects.filter(kind=RunKind.SCHEDULED).exclude(periodic_task=None):
        runs_by_task[run.periodic_task_id].append(run)
        result.caught_redeliveries += run.duplicate_deliveries
    for task in PeriodicTask.objects.order_by("name"):
        row = TaskCount(task.name, task.schedule.describe())
        due = set(task.schedule.slots_between(start, end))
        row.due = len(due)
        by_slot = defaultdict(list)
        for run in runs_by_task[task.pk]:
            by_slot[run.slot].append(run)
        for slot, runs in sorted(by_slot.items()):
            ran = sum(executions[run.pk] for run in runs)
            inside = start <= slot < end
            if len(runs) > 1 or ran > 1:
                if inside:
                    row.doubled.append(slot)
                else:
                    result.doubled_outside += 1
            if not inside:
                continue
            if slot not in due:
                row.unexpected.append(slot)
            fired = [r for r in runs if r.dispatched_at or r.started_at]
            if fired:
                row.fired += 1
                run = fired[0]
                sent = run.dispatched_at or run.started_at
                row.firings.append(
                    Firing(
                        slot,
                        label_of.get(run.claimed_by, "?"),
                        (sent - slot).total_seconds(),
                        ran,
                        dispatch_recorded=run.dispatched_at is not None,
                    )
                )
            row.ran += 1 if ran else 0
            if any(
                moment is not None and moment < slot
                for r in runs
                for moment in (r.claimed_at, r.dispatched_at, r.started_at)
            ):
                row.early.append(slot)
        row.missed = sorted(s for s in due if not any(executions[r.pk] for r in by_slot.get(s, [])))
        result.tasks.append(row)
    fired_by = Counter(f.node for t in result.tasks for f in t.firings)
    for beat in beats:
        node = nodes.get(beat.pid)
        result.nodes.append(
            NodeCount(
                beat,
                offset=node.clock_offset_seconds if node else None,
                rtt=node.clock_rtt_seconds if node else None,
                fired=fired_by[beat.label],
                stopped=bool(node and node.stopped_at),
            )
        )
    return result


def _signed(value: float, digits: int) -> str:
    """``+1.250``; never ``-0.000`` for a value that rounds to zero."""
    return f"{round(value, digits) + 0.0:+.{digits}f}"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def table(result: Count) -> str:
    """The per-task table and the per-node table, as text."""
    header = (
        f"{'task':<24} {'schedule':<19} {'due':>4} {'fired':>5} {'ran':>4} {'doubled':>7} "
        f"{'missed':>6}  {'never early':<11} {'p50 late':>8} {'p99 late':>8}"
    )
    lines = [
        f"Slots due from {result.start:%H:%M:%S.%f}"[:-3]
        + f" to {result.end:%H:%M:%S.%f}"[:-3]
        + " UTC (time authority), per task:",
        "",
        header,
        "-" * len(header),
    ]
    for row in result.tasks:
        lines.append(
            f"{row.name:<24} {row.schedule:<19} {row.due:>4} {row.fired:>5} {row.ran:>4} "
            f"{len(row.doubled):>7} {len(row.missed):>6}  "
            f"{'ok' if not row.early else f'{len(row.early)} EARLY':<11} "
            f"{_ms(row.lateness(0.5)):>8} {_ms(row.lateness(0.99)):>8}"
        )
    due = sum(r.due for r in result.tasks)
    fired = sum(r.fired for r in result.tasks)
    ran = sum(r.ran for r in result.tasks)
    doubled = sum(len(r.doubled) for r in result.tasks)
    missed = sum(len(r.missed) for r in result.tasks)
    early = sum(len(r.early) for r in result.tasks)
    lines += [
        "-" * len(header),
        f"{'all tasks':<44} {due:>4} {fired:>5} {ran:>4} {doubled:>7} {missed:>6}  "
        f"{'ok' if not early else f'{early} EARLY':<11}",
    ]
    unexpected = sum(len(r.unexpected) for r in result.tasks)
    if unexpected:
        lines.append(f"{unexpected} runs at instants that are not slots of their schedule!")
    unrecorded = sum(not f.dispatch_recorded for r in result.tasks for f in r.firings)
    if unrecorded:
        lines.append(
            f"Runs the worker started before their beat recorded dispatched_at: "
            f"{unrecorded} (their lateness is started_at - slot)"
        )
    lines += [
        "",
        f"Slots doubled before or after the window (start-up, shut-down): {result.doubled_outside}",
        f"Redeliveries DriftSafeTask caught and did not execute: {result.caught_redeliveries}",
        "",
        "Beats (offset = authority - node wall clock, measured NTP-style by the node itself):",
        "",
        f"{'beat':<6} {'clock skew':>10} {'verified':>9} {'measured offset':>16} "
        f"{'± (rtt/2)':>9} {'slots fired':>11}  stopped cleanly",
    ]
    for node in result.nodes:
        beat = node.beat
        verified = "-" if beat.verified is None else f"{beat.verified:+.3f} s"
        offset = "-" if node.offset is None else f"{_signed(node.offset, 3)} s"
        error = "-" if node.rtt is None else f"{node.rtt / 2 * 1000:.1f} ms"
        lines.append(
            f"{beat.label:<6} {beat.skew:>+8.1f} s {verified:>9} {offset:>16} {error:>9} "
            f"{node.fired:>11}  {'yes' if node.stopped else 'NO'}"
        )
    return "\n".join(line.rstrip() for line in lines)


_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b")
# Lateness dots: from dispatched_at (True), or from started_at when the beat's mark came late.
_LATENESS_MARKS = {True: {"s": 18, "marker": "o"}, False: {"s": 30, "marker": "D"}}


def picture(result: Count, path: Path) -> str | None:
    """Draw which node fired which slot, and how late, to ``path`` (PNG). Returns why not,
    when it could not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return (
            "no picture: matplotlib is not installed (pip install matplotlib, "
            "or run bash example_project/demo/demo.sh)"
        )
    colors = {n.beat.label: _COLORS[i % len(_COLORS)] for i, n in enumerate(result.nodes)}
    colors["?"] = "#7f7f7f"
    names = [t.name for t in result.tasks]
    fig, (top, bottom) = plt.subplots(
        2,
        1,
        sharex=True,
        figsize=(12, 2.2 + 0.55 * len(names) + 2.4),
        gridspec_kw={"height_ratios": [max(len(names), 2) * 0.55, 2.4]},
    )

    def x(slot: datetime) -> float:
        return (slot - result.start).total_seconds()

    for row, task in enumerate(result.tasks):
        for firing in task.firings:
            top.scatter(x(firing.slot), row, s=70, color=colors[firing.node], zorder=3)
            bottom.scatter(
                x(firing.slot),
                firing.lateness * 1000,
                zorder=3,
                color=colors[firing.node],
                **_LATENESS_MARKS[firing.dispatch_recorded],
            )
        for slot in task.doubled:
            top.scatter(
                x(slot), row, s=260, facecolors="none", edgecolors="black", linewidths=2, zorder=4
            )
        for slot in task.missed:
            top.scatter(x(slot), row, s=140, marker="x", color="#d62728", linewidths=3, zorder=4)
    top.set_yticks(range(len(names)), names)
    top.set_ylim(len(names) - 0.5, -0.5)
    top.grid(axis="x", alpha=0.3)
    for node in result.nodes:
        offset = "" if node.offset is None else f", measured offset {_signed(node.offset, 2)} s"
        top.scatter(
            [],
            [],
            s=70,
            color=colors[node.beat.label],
            label=f"beat {node.beat.label}: clock {node.beat.skew:+.1f} s{offset}, "
            f"fired {node.fired}",
        )
    top.scatter([], [], s=140, marker="x", color="#d62728", linewidths=3, label="missed")
    top.scatter([], [], s=260, facecolors="none", edgecolors="black", linewidths=2, label="doubled")
    top.legend(
        loc="upper center",
        bbox_to_anchor=(0.5, -0.02 - 0.1 / max(len(names), 1)),
        ncol=3,
        fontsize=8,
        frameon=False,
    )
    doubled = sum(len(t.doubled) for t in result.tasks)
    missed = sum(len(t.missed) for t in result.tasks)
    due = sum(t.due for t in result.tasks)
    top.set_title(
        f"Which beat fired which slot: {due} slots due, {doubled} doubled, {missed} missed",
        fontsize=11,
    )
    if any(not f.dispatch_recorded for t in result.tasks for f in t.firings):
        bottom.scatter(
            [],
            [],
            color="#7f7f7f",
            **_LATENESS_MARKS[False],
            label="dispatch not recorded: started_at - slot",
        )
        bottom.legend(loc="best", fontsize=8)
    bottom.axhline(0, color="#d62728", linewidth=1)
    bottom.text(
        0,
        0,
        " slot instant: a run below this line would be early",
        color="#d62728",
        fontsize=8,
        va="bottom",
    )
    bottom.set_ylabel("dispatched after\nits slot (ms)")
    bottom.set_ylim(bottom=min(-5.0, bottom.get_ylim()[0]))
    bottom.set_xlabel(f"seconds after {result.start:%H:%M:%S} UTC (time authority)")
    bottom.grid(alpha=0.3)
    fig.suptitle(
        "celery_driftsafe demo: beats with skewed clocks, every slot exactly once", fontsize=13
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def verdict(result: Count) -> str:
    due = sum(t.due for t in result.tasks)
    doubled = sum(len(t.doubled) for t in result.tasks) + result.doubled_outside
    missed = sum(len(t.missed) for t in result.tasks)
    early = sum(len(t.early) for t in result.tasks)
    return (
        f"{due} slots due, {doubled} doubled, {missed} missed, {early} early "
        f"({len(result.nodes)} beats)"
    )
