"""The admin at scale and in the history: "run now" from a task's change page, every action in
Django's admin history (LogEntry), and the run list's count that never counts the ledger."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.contrib.admin.models import CHANGE, LogEntry
from django.db import connection
from django.urls import reverse

from celery_driftsafe.admin.paginator import EstimatedCountPaginator, estimated_rows
from celery_driftsafe.models import PeriodicTask, Run, RunKind, RunStatus
from tests import settings as test_settings
from tests.skip_guard import configuration
from tests.support import QUEUE, drain
from tests.support.factories import crontab_task, interval_task

TASKS = reverse("admin:celery_driftsafe_periodictask_changelist")
RUNS = reverse("admin:celery_driftsafe_run_changelist")
T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def change_url(task: PeriodicTask) -> str:
    return reverse("admin:celery_driftsafe_periodictask_change", args=[task.pk])


def run_now_url(task: PeriodicTask) -> str:
    return reverse("admin:celery_driftsafe_periodictask_run_now", args=[task.pk])


def history(task: PeriodicTask) -> list[str]:
    entries = LogEntry.objects.filter(object_id=str(task.pk), action_flag=CHANGE).order_by("pk")
    return [entry.get_change_message() for entry in entries]


@pytest.mark.django_db(transaction=True)
def test_run_now_button_on_the_change_page_runs_the_task_and_is_in_its_history(
    admin_client: Any, app: Any
) -> None:
    task = crontab_task("report", "0 3 * * *", queue=QUEUE)
    page = admin_client.get(change_url(task)).content.decode()
    assert f'action="{run_now_url(task)}"' in page and ">Run now</button>" in page
    response = admin_client.post(run_now_url(task), follow=True)
    assert response.redirect_chain[-1][0] == change_url(task)
    run = Run.objects.get()
    assert (run.kind, run.status, run.claimed_by) == (
        RunKind.MANUAL,
        RunStatus.DISPATCHED,
        "admin:admin",
    )
    assert [m["id"] for m in drain(QUEUE)] == [run.celery_task_id]
    assert any("dispatched" in str(m) for m in response.context["messages"])
    [entry] = history(task)
    assert f"run #{run.pk}" in entry and run.celery_task_id in entry
    assert LogEntry.objects.get().user.username == "admin"


@pytest.mark.django_db
def test_run_now_view_wants_a_post_and_the_change_permission(
    admin_client: Any, client: Any, django_user_model: Any, app: Any
) -> None:
    task = interval_task("t", 60, anchor=T0)
    assert admin_client.get(run_now_url(task)).status_code == 405
    viewer = django_user_model.objects.create_user("viewer", password="pw", is_staff=True)
    from django.contrib.auth.models import Permission

    viewer.user_permissions.add(Permission.objects.get(codename="view_periodictask"))
    client.force_login(viewer)
    assert ">Run now</button>" not in client.get(change_url(task)).content.decode()
    assert client.post(run_now_url(task)).status_code == 403
    assert not Run.objects.exists() and not LogEntry.objects.exists()
    missing = reverse("admin:celery_driftsafe_periodictask_run_now", args=[999999])
    assert admin_client.post(missing).status_code == 302


@pytest.mark.django_db
def test_every_action_is_written_to_the_admin_history(
    admin_client: Any, app: Any, django_capture_on_commit_callbacks: Any
) -> None:
    first = interval_task("first", 60, anchor=T0)
    second = interval_task("second", 60, anchor=T0)
    selected = {"_selected_action": [first.pk, second.pk]}
    with django_capture_on_commit_callbacks(execute=True):
        admin_client.post(TASKS, {"action": "disable_tasks", **selected})
        admin_client.post(TASKS, {"action": "enable_tasks", **selected})
        admin_client.post(TASKS, {"action": "reset_schedule", **selected})
    for task in (first, second):
        assert history(task) == [
            "Disabled (action)",
            "Enabled (action; next slot after now)",
            "Schedule reset (action; next slot after now)",
        ]
    # A task the action did not change gets no entry (nothing to enable here).
    admin_client.post(TASKS, {"action": "enable_tasks", "_selected_action": [first.pk]})
    assert len(history(first)) == 3


# -- the run list's count ------------------------------------------------------------------


def _runs(count: int) -> None:
    task = interval_task("t", 60, anchor=T0)
    Run.objects.bulk_create(
        Run(
            periodic_task=task,
            task_name="tests.add",
            slot=T0 + timedelta(minutes=i),
            status=RunStatus.FAILED if i % 2 else RunStatus.SUCCEEDED,
            claimed_at=T0,
        )
        for i in range(count)
    )


class SmallLimit(EstimatedCountPaginator):
    count_limit = 5


@pytest.mark.django_db
def test_a_filtered_list_is_counted_up_to_the_limit_only() -> None:
    _runs(14)
    failed = Run.objects.filter(status=RunStatus.FAILED)
    assert SmallLimit(failed, 2).count == 6  # 7 failed runs: "more than 5"
    assert EstimatedCountPaginator(failed, 2).count == 7  # below the limit: exact


@pytest.mark.django_db
def test_the_unfiltered_list_takes_postgresqls_estimate() -> None:
    _runs(14)
    runs = Run.objects.all()
    if connection.vendor != "postgresql":
        assert estimated_rows(Run, "default") is None
        assert SmallLimit(runs, 2).count == 6
        return
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE celery_driftsafe_run")
    assert estimated_rows(Run, "default") == 14
    Run.objects.filter(status=RunStatus.FAILED).delete()  # the estimate lags until ANALYZE
    assert SmallLimit(runs, 2).count == 14
    assert EstimatedCountPaginator(runs, 2).count == 7  # small: counted exactly


@pytest.mark.django_db
def test_the_run_list_never_counts_the_whole_ledger(
    admin_client: Any, django_assert_max_num_queries: Any
) -> None:
    from django.test.utils import CaptureQueriesContext

    _runs(30)
    admin_client.get(RUNS)  # the session and user are loaded once
    for url in (
        RUNS,
        RUNS + "?status__exact=failed",
        RUNS + "?kind__exact=manual",
        RUNS + "?node=admin",
    ):
        with CaptureQueriesContext(connection) as queries:
            response = admin_client.get(url)
        assert response.status_code == 200
        counts = [q["sql"] for q in queries.captured_queries if "COUNT(" in q["sql"].upper()]
        assert counts and all("LIMIT" in sql.upper() for sql in counts), (url, counts)


@pytest.mark.skipif(
    test_settings.TEST_DB != "postgres", reason=configuration("query plans of PostgreSQL")
)
@pytest.mark.django_db
@pytest.mark.parametrize("kind", [RunKind.MANUAL, RunKind.ADHOC, RunKind.BACKFILL])
def test_the_run_list_filtered_by_kind_reads_the_partial_index(
    admin_client: Any, kind: str
) -> None:
    """Every kind but the beats' own has a partial index: the page and its count read it, not
    the ledger newest first (every row of a big ledger when the kind is rare). With sequential
    scans off, so that the plan of a table of a few rows is the plan of a big one."""
    _runs(30)
    admin_client.get(RUNS)  # the session and user are loaded once
    plans: list[str] = []

    def explain(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if sql.startswith("SELECT") and '"celery_driftsafe_run"."kind"' in sql:
            with connection.cursor() as cursor:
                cursor.execute("EXPLAIN " + sql, params)
                plans.append("\n".join(row[0] for row in cursor.fetchall()))
        return execute(sql, params, many, context)

    with connection.cursor() as cursor:
        cursor.execute("SET enable_seqscan = off")
    try:
        with connection.execute_wrapper(explain):
            response = admin_client.get(RUNS, {"kind__exact": kind})
    finally:
        with connection.cursor() as cursor:
            cursor.execute("RESET enable_seqscan")
    assert response.status_code == 200
    assert len(plans) >= 2, plans  # the count and the page
    for plan in plans:
        assert "driftsafe_run_operator" in plan, plan
