"""The cluster dashboard through Django's test client: what it shows for an hour of three beats,
that it is linked from the app index and the node list, that it needs the permissions to view
tasks, runs and nodes, and that its queries stay bounded with thousands of runs. (The browser
test in tests/admin/test_browser.py looks at it in Chromium.)"""

from __future__ import annotations

import re
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.urls import reverse

from celery_driftsafe.admin import dashboard
from celery_driftsafe.definitions import changes
from celery_driftsafe.models import BeatNode, Run, RunKind, RunStatus
from celery_driftsafe.monitoring import cluster
from tests.support.cluster_data import seed_cluster

DASHBOARD = reverse("admin:celery_driftsafe_dashboard")
T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def _count(html: str, pattern: str) -> int:
    return len(re.findall(pattern, html))


def _timeline(html: str) -> str:
    """The timeline's drawing (without its legend)."""
    return html.split('id="ds-timeline"')[1].split("</svg>")[0]


@pytest.mark.django_db
def test_dashboard_shows_nodes_lateness_timeline_and_what_fires_next(admin_client: Any) -> None:
    now = changes.authority_now()
    seeded = seed_cluster(now)
    response = admin_client.get(DASHBOARD)
    assert response.status_code == 200
    html = response.content.decode()
    window = seeded.runs  # all inside the hour
    published = [r for r in window if r.dispatched_at is not None]
    missed = [r for r in window if r.status == RunStatus.MISSED]
    pending = [r for r in window if r.status == RunStatus.CLAIMED]
    assert published and missed and pending

    # nodes: four rows, two states, one offset past the bound
    assert _count(html, 'class="ds-node"') == 4
    assert _count(html, "ds-state ds-state-alive") == 3
    assert _count(html, "ds-state ds-state-dead") == 1
    assert _count(html, "ds-offset ds-exceeded") == 1 and "-1.284 s" in html
    # the histogram counts every published run of the hour, once
    counts = [int(n) for n in re.findall(r"<title>[^<]*: (\d+) runs</title>", html)]
    assert len(counts) == len(cluster.LATENESS_EDGES)
    assert sum(counts) == len(published)
    assert f'id="ds-published">{len(published)}<' in html
    assert f'id="ds-missed">{len(missed)}<' in html
    slow = sum(1 for r in published if r.dispatched_at - r.slot >= timedelta(seconds=1))
    assert (
        slow
        and counts[cluster.LATENESS_EDGES.index(1.0)]
        + counts[cluster.LATENESS_EDGES.index(2.5)]
        + counts[-1]
        == slow
    )
    # the timeline: a lane per beat that fired, a mark per run, missed ones as squares
    assert _count(html, 'class="ds-lane"') == 4
    drawing = _timeline(html)
    assert _count(drawing, r'<circle class="ds-mark (on-time|late|very-late)"') == len(published)
    assert _count(drawing, '<circle class="ds-mark pending"') == len(pending)
    assert _count(drawing, '<rect class="ds-mark missed"') == len(missed)
    assert "beat-c:4103" in html and "very-late" in html
    # fires next: the tasks by their next slot, the nearest first
    next_table = html.split('id="ds-next"')[1].split("</table>")[0]
    names = re.findall(r'/change/">([^<]+)</a>', next_table)
    assert names[0] == "refresh-cache" and set(names) == {t.name for t in seeded.tasks}


@pytest.mark.django_db
def test_dashboard_is_linked_from_the_app_index_and_the_node_list(admin_client: Any) -> None:
    index = admin_client.get(reverse("admin:app_list", args=["celery_driftsafe"]))
    assert DASHBOARD in index.content.decode()
    assert "Beat nodes" in index.content.decode()  # the app's model list is still there
    nodes = admin_client.get(reverse("admin:celery_driftsafe_beatnode_changelist"))
    assert f'href="{DASHBOARD}" id="driftsafe-dashboard-link"' in nodes.content.decode()


@pytest.mark.django_db
def test_dashboard_needs_the_view_permissions_of_tasks_runs_and_nodes(client: Any) -> None:
    """It shows nodes, runs and task names: a user allowed to view only some of them gets
    403, and sees no link to it."""
    seed_cluster(changes.authority_now())
    user = User.objects.create_user("ops", password="pw", is_staff=True)
    nodes = reverse("admin:celery_driftsafe_beatnode_changelist")
    index = reverse("admin:app_list", args=["celery_driftsafe"])

    def grant(codename: str) -> None:
        user.user_permissions.add(Permission.objects.get(codename=codename))
        client.force_login(User.objects.get(pk=user.pk))  # no cached permissions

    client.force_login(user)
    assert client.get(DASHBOARD).status_code == 403
    grant("view_beatnode")  # the node list's own permission: not enough any more
    response = client.get(DASHBOARD)
    assert response.status_code == 403 and b"refresh-cache" not in response.content
    assert DASHBOARD not in client.get(nodes).content.decode()
    assert DASHBOARD not in client.get(index).content.decode()
    grant("view_run")
    assert client.get(DASHBOARD).status_code == 403
    grant("change_periodictask")  # the admin's rule: change implies view
    response = client.get(DASHBOARD)
    assert response.status_code == 200 and b"refresh-cache" in response.content
    assert DASHBOARD in client.get(nodes).content.decode()
    assert DASHBOARD in client.get(index).content.decode()


@pytest.mark.django_db
def test_dashboard_queries_stay_bounded_with_thousands_of_runs(
    admin_client: Any, django_assert_max_num_queries: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = changes.authority_now()
    seed_cluster(now)
    node = BeatNode.objects.first()
    assert node is not None
    Run.objects.bulk_create(
        Run(
            task_name="tests.add",
            kind=RunKind.SCHEDULED,
            status=RunStatus.SUCCEEDED,
            slot=now - timedelta(seconds=i),
            claimed_at=now - timedelta(seconds=i),
            dispatched_at=now - timedelta(seconds=i) + timedelta(milliseconds=5),
            claimed_by=node.node_id,
            celery_task_id=str(uuid.uuid4()),
        )
        for i in range(1, 3001)
    )
    monkeypatch.setattr(dashboard, "MAX_RUNS", 500)
    # session and user, the authority, nodes, runs (two per status), counts, next fires
    with django_assert_max_num_queries(32):
        response = admin_client.get(DASHBOARD)
    html = response.content.decode()
    assert _count(_timeline(html), r'class="ds-mark ') == 500  # the newest 500 of the hour
    assert "capped at 500" in html


def test_timeline_puts_a_run_at_its_slot_in_its_beats_lane() -> None:
    now = T0
    nodes = [
        BeatNode(node_id="a:1:x", hostname="a", pid=1),
        BeatNode(node_id="b:2:y", hostname="b", pid=2),
    ]
    runs = [
        cluster.RecentRun(
            1,
            "t",
            RunStatus.SUCCEEDED,
            now - timedelta(minutes=30),
            "b:2:y",
            now,
            now - timedelta(minutes=30) + timedelta(seconds=2),
        ),
        cluster.RecentRun(
            2, "t", RunStatus.MISSED, now - timedelta(minutes=45), "a:1:x", now, None
        ),
        cluster.RecentRun(
            3, "t", RunStatus.SUCCEEDED, now - timedelta(hours=2), "a:1:x", now, now
        ),  # before the window: not drawn
    ]
    drawn = dashboard.timeline(runs, nodes, now)
    assert [lane.label for lane in drawn.lanes] == ["a:1", "b:2"]
    (missed,) = drawn.lanes[0].marks
    (late,) = drawn.lanes[1].marks
    usable = dashboard.WIDTH - dashboard.RIGHT - dashboard.LEFT
    assert late.x == pytest.approx(dashboard.LEFT + usable / 2, abs=0.1)
    assert late.css == "very-late" and "+2.000 s" in late.title
    assert missed.css == "missed" and missed.x == pytest.approx(
        dashboard.LEFT + usable / 4, abs=0.1
    )
    assert [t.label for t in drawn.ticks] == ["11:10", "11:20", "11:30", "11:40", "11:50", "12:00"]
    assert drawn.runs == 2


def test_histogram_and_quantiles() -> None:
    buckets = cluster.histogram([0.004, 0.009, 0.03, 0.3, 2.0, 45.0, -0.1])
    assert [b.count for b in buckets] == [3, 0, 1, 0, 0, 1, 0, 1, 0, 0, 1]
    assert buckets[0].label == "<10ms" and buckets[2].label == "<50ms"
    assert buckets[-1].label == "≥30s"
    assert cluster.quantile([3.0, 1.0, 2.0, 4.0], 0.5) == 2.0
    assert cluster.quantile([3.0, 1.0, 2.0, 4.0], 0.99) == 4.0
    assert cluster.quantile([], 0.5) is None


@pytest.mark.django_db
def test_recent_runs_are_the_newest_across_statuses() -> None:
    now = changes.authority_now()
    statuses = [
        RunStatus.SUCCEEDED,
        RunStatus.FAILED,
        RunStatus.MISSED,
        RunStatus.SUCCEEDED,
        RunStatus.DISPATCHED,
        RunStatus.SUCCEEDED,
        RunStatus.FAILED,
    ]
    Run.objects.bulk_create(
        Run(
            task_name="tests.add",
            status=statuses[i % len(statuses)],
            slot=now - timedelta(seconds=i),
            claimed_at=now - timedelta(seconds=i),
            claimed_by="beat-a:1:x",
            celery_task_id=str(uuid.uuid4()),
        )
        for i in range(200)
    )
    Run.objects.create(
        task_name="tests.add",
        status=RunStatus.FAILED,
        claimed_by="x",
        slot=now - timedelta(hours=2),
        claimed_at=now - timedelta(hours=2),
    )
    newest = list(
        Run.objects.filter(claimed_at__gte=now - timedelta(hours=1))
        .order_by("-claimed_at")
        .values_list("pk", flat=True)
    )
    for limit in (1, 5, 17, 150, 500):
        got = cluster.recent_runs(now - timedelta(hours=1), limit=limit)
        assert [r.pk for r in got] == newest[:limit]


@pytest.mark.django_db
def test_a_jittered_slot_is_not_backlog_before_its_jittered_instant() -> None:
    from celery_driftsafe.models import PeriodicTask
    from tests.support.factories import interval_task

    now = changes.authority_now()
    task = interval_task("jittered", 60, anchor=now - timedelta(hours=1))
    PeriodicTask.objects.filter(pk=task.pk).update(
        next_slot_at=now - timedelta(seconds=10), due_at=now + timedelta(seconds=20)
    )
    assert cluster.backlog(now) == 0 and cluster.oldest_due(now) is None
    PeriodicTask.objects.filter(pk=task.pk).update(due_at=now - timedelta(seconds=5))
    assert cluster.backlog(now) == 1
    assert cluster.oldest_due(now) == now - timedelta(seconds=5)
    assert [t.name for t in cluster.next_fires()] == ["jittered"]
