"""Deadlines (celery_driftsafe.beat.deadlines): late runs and stale tasks, on the real database
(SQLite and PostgreSQL), with time passed in as the beats pass the authority's ``now``."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.core.exceptions import ValidationError
from django.db import connection
from django.test import override_settings

from celery_driftsafe.beat.deadlines import check_deadlines, watched
from celery_driftsafe.models import PeriodicTask, Run, RunKind, RunStatus
from celery_driftsafe.signals import run_deadline_missed, task_became_stale
from tests.support import T0
from tests.support.factories import at_once, interval_task, many_interval_tasks

pytestmark = pytest.mark.django_db(transaction=True)  # racing checks use threads

MINUTE = timedelta(minutes=1)
S = timedelta(seconds=1)


def _run(task: PeriodicTask, minute: int, status: str, **fields: Any) -> Run:
    return Run.objects.create(
        periodic_task=task,
        task_name=task.task,
        slot=T0 + minute * MINUTE,
        status=status,
        claimed_at=T0 + minute * MINUTE,
        **fields,
    )


@pytest.fixture
def received() -> Iterator[dict[str, list[dict[str, Any]]]]:
    got: dict[str, list[dict[str, Any]]] = {"late": [], "stale": []}

    def late(sender: Any, **kwargs: Any) -> None:
        got["late"].append(kwargs)

    def stale(sender: Any, **kwargs: Any) -> None:
        got["stale"].append(kwargs)

    run_deadline_missed.connect(late, weak=False)
    task_became_stale.connect(stale, weak=False)
    yield got
    run_deadline_missed.disconnect(late)
    task_became_stale.disconnect(stale)


def test_every_scheduled_run_not_succeeded_by_its_deadline_is_flagged_late_once(
    received: dict[str, list[dict[str, Any]]],
) -> None:
    task = interval_task("watched", 60, anchor=T0, deadline_seconds=30)
    succeeded = _run(task, 0, RunStatus.SUCCEEDED)
    failed = _run(task, 1, RunStatus.FAILED)
    running = _run(task, 2, RunStatus.STARTED)
    never_taken = _run(task, 3, RunStatus.DISPATCHED)
    skipped = _run(task, 4, RunStatus.SKIPPED)
    missed = _run(task, 5, RunStatus.MISSED)
    in_time = _run(task, 6, RunStatus.STARTED)  # its deadline, 6 min 30 s, is still to come
    manual = Run.objects.create(
        periodic_task=task, task_name=task.task, kind=RunKind.MANUAL, slot=T0 + 90 * S
    )
    now = T0 + 6 * MINUTE + 29 * S
    done = check_deadlines(now)
    late = [failed, running, never_taken, skipped, missed]
    assert sorted(done.late) == sorted(run.pk for run in late)
    flagged = dict(Run.objects.values_list("pk", "late_at"))
    assert {pk for pk, at in flagged.items() if at is not None} == {run.pk for run in late}
    assert all(flagged[run.pk] == now for run in late)
    assert flagged[succeeded.pk] is None and flagged[in_time.pk] is None
    assert flagged[manual.pk] is None
    # The receivers got each late run once, with its task, deadline and the instant found.
    assert sorted(event["run"].pk for event in received["late"]) == sorted(r.pk for r in late)
    first = next(event for event in received["late"] if event["run"].pk == failed.pk)
    assert first["task"].pk == task.pk
    assert first["deadline"] == failed.slot + timedelta(seconds=30)
    assert first["late_at"] == now
    assert first["run"].status == RunStatus.FAILED
    # A later check reports nothing again; the run whose deadline then passes is reported.
    again = check_deadlines(now + 2 * S)
    assert again.late == [in_time.pk]
    assert len(received["late"]) == len(late) + 1


def test_tasks_without_a_deadline_are_not_watched_and_their_runs_never_late(
    received: dict[str, list[dict[str, Any]]],
) -> None:
    plain = interval_task("plain", 60, anchor=T0)
    failed = _run(plain, 0, RunStatus.FAILED)
    assert check_deadlines(T0 + 10 * MINUTE).late == []
    assert Run.objects.get(pk=failed.pk).late_at is None
    assert received["late"] == []
    assert list(watched()) == []


def test_racing_beats_report_each_late_run_exactly_once(
    received: dict[str, list[dict[str, Any]]],
) -> None:
    task = interval_task("raced", 60, anchor=T0, deadline_seconds=1)
    runs = [_run(task, minute, RunStatus.FAILED) for minute in range(40)]
    results = at_once(4, lambda n: check_deadlines(T0 + 50 * MINUTE + n * timedelta(0, 0, 1)))
    reported = [pk for result in results for pk in result.late]
    assert sorted(reported) == sorted(run.pk for run in runs)  # each once, none twice
    assert sorted(event["run"].pk for event in received["late"]) == sorted(reported)
    assert len(received["stale"]) == 1  # the task became stale once, for one of the beats


@override_settings(DRIFTSAFE_INTERNALS={"STALE_AFTER_SLOTS": 3})
def test_a_task_is_stale_after_its_last_slots_failed_and_fresh_again_after_a_success(
    received: dict[str, list[dict[str, Any]]], caplog: pytest.LogCaptureFixture
) -> None:
    task = interval_task("flaky", 60, anchor=T0, deadline_seconds=10)
    _run(task, 0, RunStatus.SUCCEEDED)
    _run(task, 1, RunStatus.FAILED)
    _run(task, 2, RunStatus.FAILED)
    assert check_deadlines(T0 + 3 * MINUTE).stale == []  # two slots without success: not yet
    _run(task, 3, RunStatus.DISPATCHED)  # no worker took it
    now = T0 + 3 * MINUTE + 11 * S
    with caplog.at_level(logging.INFO, logger="celery_driftsafe.deadlines"):
        assert check_deadlines(now).stale == [task.pk]
    assert PeriodicTask.objects.get(pk=task.pk).stale_since == now
    assert [(event["task"].pk, event["since"], event["slots"]) for event in received["stale"]] == [
        (task.pk, now, 3)
    ]
    assert any(getattr(r, "action", "") == "task-stale" for r in caplog.records)
    assert check_deadlines(now + S).stale == []  # signalled once
    assert len(received["stale"]) == 1
    # A user's save of the task loaded while it was stale does not clear the flag...
    loaded = PeriodicTask.objects.get(pk=task.pk)
    PeriodicTask.objects.filter(pk=task.pk).update(stale_since=None)
    loaded.description = "edited"
    loaded.save()
    assert PeriodicTask.objects.get(pk=task.pk).stale_since is None  # nor writes it back
    PeriodicTask.objects.filter(pk=task.pk).update(stale_since=now)
    # ...a success does.
    _run(task, 4, RunStatus.SUCCEEDED)
    assert check_deadlines(T0 + 4 * MINUTE + 11 * S).fresh == [task.pk]
    assert PeriodicTask.objects.get(pk=task.pk).stale_since is None


@override_settings(DRIFTSAFE_INTERNALS={"STALE_AFTER_SLOTS": 5})
def test_a_missed_row_counts_as_the_slots_it_stands_for_and_removing_the_deadline_clears_stale(
    received: dict[str, list[dict[str, Any]]],
) -> None:
    task = interval_task("downtime", 60, anchor=T0, deadline_seconds=10)
    _run(task, 0, RunStatus.MISSED, missed_count=5, missed_until=T0 + 4 * MINUTE)
    assert check_deadlines(T0 + 10 * MINUTE).stale == [task.pk]
    PeriodicTask.objects.filter(pk=task.pk).update(deadline_seconds=None)
    assert check_deadlines(T0 + 11 * MINUTE).fresh == [task.pk]
    assert PeriodicTask.objects.get(pk=task.pk).stale_since is None
    assert list(watched()) == []


def test_a_receiver_that_raises_is_logged_and_the_others_and_the_check_go_on(
    received: dict[str, list[dict[str, Any]]], caplog: pytest.LogCaptureFixture
) -> None:
    def broken(sender: Any, **kwargs: Any) -> None:
        raise RuntimeError("the pager is down")

    run_deadline_missed.connect(broken, weak=False)
    try:
        task = interval_task("alerting", 60, anchor=T0, deadline_seconds=5)
        runs = [_run(task, minute, RunStatus.FAILED) for minute in range(2)]
        with caplog.at_level(logging.ERROR, logger="celery_driftsafe.deadlines"):
            done = check_deadlines(T0 + 5 * MINUTE)
    finally:
        run_deadline_missed.disconnect(broken)
    assert sorted(done.late) == sorted(run.pk for run in runs)
    assert len(received["late"]) == 2
    failures = [r for r in caplog.records if getattr(r, "action", "") == "deadline-receiver-failed"]
    assert len(failures) == 2 and "the pager is down" in failures[0].getMessage()


@pytest.mark.parametrize("bad", [0, -5, float("nan"), float("inf"), 1e12])
def test_a_deadline_that_is_not_a_positive_number_of_seconds_is_refused_naming_the_field(
    bad: float,
) -> None:
    task = PeriodicTask(
        name="bad",
        task="tests.add",
        schedule_kind="interval",
        interval_every=60,
        interval_unit="seconds",
        interval_anchor=T0,
        deadline_seconds=bad,
    )
    with pytest.raises(ValidationError) as raised:
        task.full_clean()
    assert "deadline_seconds" in raised.value.message_dict
    assert "positive number of seconds" in raised.value.message_dict["deadline_seconds"][0]


def test_the_check_reads_the_tasks_with_a_deadline_on_an_index() -> None:
    many_interval_tasks(20_000, T0)
    interval_task("one", 60, anchor=T0, deadline_seconds=10)
    interval_task("two", 60, anchor=T0, stale_since=T0)
    analyze = "ANALYZE TABLE" if connection.vendor == "mysql" else "ANALYZE"
    with connection.cursor() as cursor:
        cursor.execute(f"{analyze} celery_driftsafe_periodictask")
    plan = watched().order_by("pk").explain()
    if connection.vendor == "mysql":
        # No partial indexes: both plain ones (migration 0020), merged. MariaDB: "index_merge
        # ... Using sort_union(driftsafe_task_deadline_s,driftsafe_task_stale_since)".
        assert "union(" in plan, plan
        assert "driftsafe_task_deadline_s" in plan and "driftsafe_task_stale_since" in plan, plan
    else:
        # PostgreSQL: "Index Scan using driftsafe_task_deadline on celery_driftsafe_periodictask";
        # SQLite: "SCAN celery_driftsafe_periodictask USING INDEX driftsafe_task_deadline".
        assert "driftsafe_task_deadline" in plan, plan
    assert {task.name for task in watched()} == {"one", "two"}


# -- the admin ------------------------------------------------------------------------------


def test_the_admin_form_takes_a_deadline_and_refuses_a_bad_one_on_its_field(
    admin_client: Any, app: Any
) -> None:
    from tests.support.admin_forms import ADD, form_data, form_errors

    errors = form_errors(admin_client.post(ADD, form_data(deadline_seconds="-3")))
    assert list(errors) == ["deadline_seconds"], errors
    assert admin_client.post(ADD, form_data(deadline_seconds="90")).status_code == 302
    assert PeriodicTask.objects.get(name="nightly").deadline_seconds == 90


def test_the_admin_lists_and_filters_late_runs_and_stale_tasks(admin_client: Any, app: Any) -> None:
    from tests.support.admin_forms import RUNS, TASKS

    task = interval_task("watched", 60, anchor=T0, deadline_seconds=10)
    fine = interval_task("fine", 60, anchor=T0, deadline_seconds=10)
    late = [_run(task, minute, RunStatus.FAILED) for minute in range(3)]
    on_time = _run(fine, 0, RunStatus.SUCCEEDED)
    now = T0 + 5 * MINUTE
    check_deadlines(now)

    runs = admin_client.get(RUNS + "?late=yes")
    assert {run.pk for run in runs.context["cl"].result_list} == {run.pk for run in late}
    every = admin_client.get(RUNS)
    assert on_time.pk in {run.pk for run in every.context["cl"].result_list}
    assert "deadline missed" in every.content.decode().lower()
    assert now.isoformat() in every.content.decode()  # the late runs' late_at, as a tooltip

    tasks = admin_client.get(TASKS + "?stale=yes")
    assert [t.name for t in tasks.context["cl"].result_list] == ["watched"]
    page = admin_client.get(TASKS + f"{task.pk}/change/").content.decode()  # on the task's page
    assert "stale since" in page.lower() and now.isoformat() in page


@override_settings(DRIFTSAFE_INTERNALS={"STALE_AFTER_SLOTS": 2})
def test_runs_whose_deadline_passed_over_an_hour_before_any_check_are_not_flagged_but_stale(
    received: dict[str, list[dict[str, Any]]],
) -> None:
    """All beats were down: the check reads each task's runs of the last hour before the
    deadline (LOOKBACK), so older runs are left; the task is stale all the same."""
    task = interval_task("long-down", 60, anchor=T0, deadline_seconds=10)
    old = [_run(task, minute, RunStatus.FAILED) for minute in range(2)]
    done = check_deadlines(T0 + 2 * 60 * MINUTE)
    assert done.late == [] and done.stale == [task.pk]
    assert all(Run.objects.get(pk=run.pk).late_at is None for run in old)


def test_driftsafe_status_counts_the_late_runs_and_names_the_stale_tasks() -> None:
    import io
    import json

    from django.core.management import call_command

    from celery_driftsafe.definitions import changes
    from celery_driftsafe.models import BeatNode

    now = changes.authority_now()
    BeatNode.objects.create(
        node_id="up:1:ab", hostname="up", pid=1, started_at=now, last_heartbeat_at=now
    )
    task = interval_task("overdue", 60, anchor=now - 10 * MINUTE, deadline_seconds=10)
    for minutes in (4, 3, 2):
        Run.objects.create(
            periodic_task=task,
            task_name=task.task,
            slot=now - minutes * MINUTE,
            status=RunStatus.FAILED,
        )
    check_deadlines(now)
    out = io.StringIO()
    call_command("driftsafe_status", stdout=out, no_color=True)
    text = out.getvalue()
    assert "runs that missed their deadline since" in text and ": 3\n" in text, text
    assert "stale tasks (no success in their last slots):\n  overdue since " in text, text
    out = io.StringIO()
    call_command("driftsafe_status", "--json", stdout=out)
    data = json.loads(out.getvalue())
    assert data["late_count"] == 3
    assert [stale["task"] for stale in data["stale_tasks"]] == ["overdue"]


@pytest.mark.parametrize(
    ("raw", "check_id"),
    [
        ({"DEADLINE_CHECK_INTERVAL_SECONDS": 0}, "celery_driftsafe.E004"),
        ({"DEADLINE_CHECK_INTERVAL_SECONDS": "2"}, "celery_driftsafe.E004"),
        ({"STALE_AFTER_SLOTS": 0}, "celery_driftsafe.E004"),
        ({"STALE_AFTER_SLOTS": 5000}, "celery_driftsafe.E030"),
    ],
)
def test_bad_deadline_settings_are_refused_naming_the_setting(
    raw: dict[str, Any], check_id: str
) -> None:
    from celery_driftsafe import checks

    (key,) = raw
    found = [(m.id, m.msg) for m in checks._check_raw(raw)]
    assert [i for i, _ in found] == [check_id] and key in found[0][1], found
