"""The operations commands: ``driftsafe_status`` and ``driftsafe_import``."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from celery import Celery
from celery.schedules import crontab, schedule, solar
from django.conf import settings
from django.core.management import CommandError, call_command, execute_from_command_line
from django.test import override_settings

from celery_driftsafe.core.preview import instant_text
from celery_driftsafe.core.schedules import Solar
from celery_driftsafe.definitions import changes
from celery_driftsafe.models import BeatNode, PeriodicTask, Run, RunStatus, TaskSource
from celery_driftsafe.testing import FakeClock, inject_authority_clock
from tests.support import T0
from tests.support.factories import crontab_task, interval_task

#: A second Celery app, for ``driftsafe_import --app`` (not made the current app).
OTHER_APP = Celery("commands-tests-other", set_as_current=False)
OTHER_APP.conf.beat_schedule = {"other-app-task": {"task": "other.task", "schedule": 60.0}}


@pytest.fixture
def app(app: Celery) -> Celery:
    """conftest's installed app, in Europe/Berlin."""
    app.conf.timezone = "Europe/Berlin"
    return app


def run(*args: str) -> str:
    out = io.StringIO()
    call_command(*args, stdout=out, no_color=True)
    return out.getvalue()


# -- driftsafe_status ------------------------------------------------------------------------


def _node(
    name: str, now: datetime, *, age: float = 0.0, offset: float | None = 0.01, **fields: Any
) -> BeatNode:
    return BeatNode.objects.create(
        node_id=f"{name}:1:ab",
        hostname=name,
        pid=1,
        started_at=now - timedelta(hours=1),
        last_heartbeat_at=now - timedelta(seconds=age),
        clock_offset_seconds=offset,
        clock_rtt_seconds=0.002 if offset is not None else None,
        **fields,
    )


@pytest.mark.django_db
def test_status_exits_2_when_no_node_is_alive() -> None:
    now = changes.authority_now()
    _node("old", now, age=3600)
    _node("quit", now, stopped_at=now)
    out = io.StringIO()
    with pytest.raises(CommandError, match="no beat node is alive") as raised:
        call_command("driftsafe_status", stdout=out, no_color=True)
    assert raised.value.returncode == 2
    text = out.getvalue()
    assert "0 alive of 2" in text and " dead " in text and " stopped " in text


@pytest.mark.django_db
@pytest.mark.parametrize("policy", ["fail_closed", "fail_open"])
def test_status_exits_3_naming_an_unreachable_redis_and_what_it_stops(
    settings: Any, policy: str
) -> None:
    """Beats alive but the configured Redis not answering: slots still fire, so the command
    says the cluster is degraded rather than down, names Redis and what its absence stops
    under the project's policy, and exits with a status of its own for a readiness probe."""
    _node("up", changes.authority_now())
    out = io.StringIO()
    call_command("driftsafe_status", stdout=out, no_color=True)  # Redis answers: exit 0
    assert "redis: reachable" in out.getvalue()
    settings.DRIFTSAFE = {
        **settings.DRIFTSAFE,
        "REDIS_URL": "redis://127.0.0.1:9/0",  # nothing listens there
        "TIME_AUTHORITY": "database",
        "REDIS_UNAVAILABLE": policy,
    }
    out = io.StringIO()
    with pytest.raises(CommandError, match=r"^degraded: Redis does not answer") as raised:
        call_command("driftsafe_status", stdout=out, no_color=True)
    assert raised.value.returncode == 3
    said = str(raised.value)
    assert "REDIS_URL unreachable: " in said and "127.0.0.1:9" in said
    stops = "do not run" if policy == "fail_closed" else "run on the database's checks alone"
    assert stops in said and f"REDIS_UNAVAILABLE = '{policy}'" in said
    assert "slots keep being claimed" in said
    assert "redis: unreachable: " in out.getvalue()


@pytest.mark.django_db
def test_status_hint_names_the_app_for_celery_a(settings: Any) -> None:
    def hint() -> str:
        with pytest.raises(CommandError) as raised:
            call_command("driftsafe_status", stdout=io.StringIO(), no_color=True)
        return str(raised.value)

    assert "`celery -A <the module of your Celery app> beat -S " in hint()
    other = "tests.management.test_commands:OTHER_APP"
    settings.DRIFTSAFE = {**settings.DRIFTSAFE, "CELERY_APP": other}
    assert f"(start `celery -A {other} beat -S driftsafe`)" in hint()


@pytest.mark.django_db(transaction=True)  # run_from_argv closes the connections
def test_status_exit_status_through_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        execute_from_command_line(["manage.py", "driftsafe_status", "--no-color"])
    assert exited.value.code == 2
    assert "(none registered)" in capsys.readouterr().out
    _node("up", changes.authority_now())
    execute_from_command_line(["manage.py", "driftsafe_status", "--no-color"])  # no exit


@pytest.mark.django_db
def test_status_reports_nodes_offsets_due_counts_and_failures() -> None:
    now = changes.authority_now()
    _node("steady", now, offset=0.004)
    _node("skewed", now, offset=-1.3)
    _node("paused", now, offset=None, claiming_paused_reason="clock offset absurd")
    _node("gone", now, age=120)
    due = interval_task("due", 60, anchor=T0, next_slot_at=now - timedelta(minutes=3))
    interval_task("soon", 60, anchor=T0, next_slot_at=now + timedelta(seconds=20))
    later = interval_task("later", 60, anchor=T0, next_slot_at=now + timedelta(hours=1))
    PeriodicTask.objects.filter(pk=later.pk).update(enabled=False)
    Run.objects.create(
        periodic_task=due,
        task_name="tests.add",
        slot=now - timedelta(hours=1),
        status=RunStatus.FAILED,
        claimed_by="steady:1:ab",
        error="ZeroDivisionError: division by zero\ntraceback…",
    )
    Run.objects.create(
        periodic_task=due,
        task_name="tests.add",
        slot=now - timedelta(days=3),
        status=RunStatus.FAILED,
        error="too old to list",
    )
    Run.objects.create(
        periodic_task=due,
        task_name="tests.add",
        slot=now - timedelta(hours=2),
        status=RunStatus.CLAIMED,
    )
    text = run("driftsafe_status")
    assert "3 alive of 4" in text
    assert "+0.004 s ±1.0 ms" in text
    assert "-1.300 s ±1.0 ms  EXCEEDS BOUND" in text
    assert "PAUSED: clock offset absurd" in text
    assert "2 enabled, 1 disabled; due now 1" in text and "due within a minute 1" in text
    assert "runs claimed but not yet dispatched: 1" in text
    assert "failed or missed runs since" in text and ": 1\n" in text
    assert "tests.add" in text and "ZeroDivisionError: division by zero" in text
    assert "too old to list" not in text and "traceback" not in text

    data = json.loads(run("driftsafe_status", "--json", "--since", "100"))
    assert data["alive"] == 3 and data["due_now"] == 1 and data["failure_count"] == 2
    skewed = next(n for n in data["nodes"] if n["hostname"] == "skewed")
    assert skewed["offset_exceeds_bound"] is True and skewed["state"] == "alive"
    assert data["recent_failures"][0]["error"] == "ZeroDivisionError: division by zero"


@pytest.mark.django_db
def test_status_task_next_lists_the_previews_slots_in_both_zones() -> None:
    clock = FakeClock(datetime(2026, 3, 27, 12, 0, tzinfo=UTC))
    with inject_authority_clock(clock):
        crontab_task("nightly", "30 2 * * *", "Europe/Berlin", jitter_seconds=20, max_runs=3)
        text = run("driftsafe_status", "--task", "nightly", "--next", "10")
        expected = changes.preview(PeriodicTask.objects.get(name="nightly"), clock.now())
        data = json.loads(run("driftsafe_status", "--task", "nightly", "--json"))
    lines = text.splitlines()
    assert lines[0].startswith("next slots of nightly (Europe/Berlin and UTC)")
    assert lines[1].startswith(
        "  2026-03-28 02:30:00 +01:00  2026-03-28 01:30:00 UTC  fires 01:30:"
    )
    assert lines[2].startswith(
        "  2026-03-29 03:00:00 +02:00  2026-03-29 01:00:00 UTC  fires 01:00:"
    )
    assert lines[2].endswith("(jitter)  DST: UTC offset +01:00 -> +02:00")
    assert lines[3].startswith("  2026-03-30 02:30:00 +02:00  2026-03-30 00:30:00 UTC")
    assert "DST" not in lines[3]
    assert lines[4] == "  no further slot: max runs: it reached 3 runs"
    assert len(lines) == 5
    assert [row["slot"] for row in data["slots"]] == [r.slot.isoformat() for r in expected.rows]
    assert [row["due"] for row in data["slots"]] == [r.due.isoformat() for r in expected.rows]
    assert [row["fires_at"] for row in data["slots"]] == [row["due"] for row in data["slots"]]
    assert data["slots"][1]["offset_change"] == ["+01:00", "+02:00"]
    assert data["end"] == "max runs: it reached 3 runs"


@pytest.mark.django_db
def test_status_task_next_shows_fractions_and_the_slots_held_behind_the_one_before() -> None:
    """An interval of 1.5 s with a 3-second jitter: the instants have fractions of a second,
    and a slot whose own instant comes before the previous slot's fires with it."""
    clock = FakeClock(datetime(2026, 3, 27, 12, 0, 0, 250_000, tzinfo=UTC))
    with inject_authority_clock(clock):
        interval_task(
            "tight", 1_500_000, clock.now(), interval_unit="microseconds", jitter_seconds=3
        )
        text = run("driftsafe_status", "--task", "tight", "--next", "20")
        expected = changes.preview(PeriodicTask.objects.get(name="tight"), clock.now(), count=20)
        data = json.loads(run("driftsafe_status", "--task", "tight", "--next", "20", "--json"))
    lines = text.splitlines()[1:]
    assert lines[0].startswith("  2026-03-27 12:00:01.75 +00:00  2026-03-27 12:00:01.75 UTC ")
    for line, row in zip(lines, expected.rows, strict=True):
        assert f"fires {instant_text(row.fires_at, date=False)} UTC (jitter)" in line
        assert ("held: due" in line) == row.held
    assert any(row.held for row in expected.rows)
    assert [row["fires_at"] for row in data["slots"]] == [
        r.fires_at.isoformat() for r in expected.rows
    ]
    assert data["slots"][0]["slot"] == "2026-03-27T12:00:01.750000+00:00"


@pytest.mark.django_db
def test_status_task_names_an_unknown_task() -> None:
    with pytest.raises(CommandError, match="no periodic task is named 'nope'"):
        run("driftsafe_status", "--task", "nope")


class EveryOther(schedule):  # type: ignore[misc]
    """A custom Celery schedule class: not something the import can translate."""


# -- driftsafe_import: beat_schedule ---------------------------------------------------------


@pytest.mark.django_db
def test_import_beat_schedule_dry_run_then_idempotent_import(app: Any) -> None:
    app.conf.beat_schedule = {
        "every-30": {
            "task": "tests.any",
            "schedule": 30.0,
            "args": (1, 2),
            "options": {"queue": "fast"},
        },
        "nightly": {"task": "tests.any", "schedule": crontab(minute=30, hour=2), "args": (3, 4)},
        "unknown-task": {"task": "tests.unknown", "schedule": timedelta(minutes=5)},
        "dusk": {
            "task": "tests.any",
            "schedule": solar("dusk_civil", -33.8688, 151.2093),
            "kwargs": {"x": 1, "y": 2},
        },
    }
    text = run("driftsafe_import", "--source", "beat_schedule", "--dry-run")
    assert "would create every-30 (beat_schedule)" in text
    assert "warning: task 'tests.unknown' is not registered" in text
    assert "dry run, nothing written: 4 create" in text
    assert not PeriodicTask.objects.exists()

    assert "4 create" in run("driftsafe_import", "--source", "beat_schedule")
    every = PeriodicTask.objects.get(name="every-30")
    assert (every.interval_every, every.args, every.queue) == (30, [1, 2], "fast")
    assert every.source == TaskSource.BEAT_SCHEDULE and every.next_slot_at is not None
    nightly = PeriodicTask.objects.get(name="nightly")
    assert (nightly.crontab_minute, nightly.crontab_hour, nightly.timezone) == (
        "30",
        "2",
        "Europe/Berlin",
    )
    dusk = PeriodicTask.objects.get(name="dusk")
    assert (dusk.schedule_kind, dusk.solar_event, dusk.solar_latitude, dusk.solar_longitude) == (
        "solar",
        "dusk_civil",
        -33.8688,
        151.2093,
    )
    assert dusk.next_slot_at is not None
    assert dusk.schedule.first_at_or_after(dusk.next_slot_at) == dusk.next_slot_at
    state = list(PeriodicTask.objects.values_list("name", "interval_anchor", "next_slot_at"))

    assert "4 unchanged" in run("driftsafe_import", "--source", "beat_schedule")
    assert list(PeriodicTask.objects.values_list("name", "interval_anchor", "next_slot_at")) == (
        state
    )


@pytest.mark.django_db
def test_import_refuses_arguments_the_registered_task_cannot_take(app: Any) -> None:
    """An entry whose arguments the task cannot take would fail every slot at publish: it is
    an error naming the signature, not imported, and the others are."""
    app.conf.beat_schedule = {
        "fits": {"task": "tests.add", "schedule": 30.0, "args": (1, 2)},
        "three": {"task": "tests.add", "schedule": 30.0, "args": (1, 2, 3)},
        "elsewhere": {"task": "tests.unknown", "schedule": 30.0, "args": (1, 2, 3)},
    }
    out = io.StringIO()
    with pytest.raises(CommandError, match="1 task"):
        call_command("driftsafe_import", "--source", "beat_schedule", stdout=out, no_color=True)
    [line] = [line for line in out.getvalue().splitlines() if "three" in line]
    assert line.startswith("error") and "args: tests.add(x, y) cannot be called" in line, line
    assert "takes 2 positional arguments but 3 were given" in line
    assert sorted(PeriodicTask.objects.values_list("name", flat=True)) == ["elsewhere", "fits"]


@pytest.mark.django_db
def test_import_updates_beat_schedule_rows_but_keeps_admin_rows(app: Any) -> None:
    app.conf.beat_schedule = {"every-30": {"task": "tests.any", "schedule": 30.0}}
    run("driftsafe_import", "--source", "beat_schedule")
    interval_task("mine", 60, anchor=T0)
    app.conf.beat_schedule = {
        "every-30": {"task": "tests.any", "schedule": 45.0},
        "mine": {"task": "tests.add", "schedule": 10.0, "args": [1, 2]},
    }
    text = run("driftsafe_import", "--source", "beat_schedule")
    assert "update       every-30 (beat_schedule): changes interval_every" in text
    assert (
        "kept         mine (beat_schedule): differs in interval_every; it is managed in "
        "the database" in text
    )
    assert PeriodicTask.objects.get(name="every-30").interval_every == 45
    assert PeriodicTask.objects.get(name="mine").interval_every == 60


@pytest.mark.django_db
def test_import_reports_entries_it_cannot_import_and_exits_1(app: Any) -> None:
    app.conf.beat_schedule = {
        "fine": {"task": "tests.any", "schedule": 10.0},
        "never": {"task": "tests.any", "schedule": -5},
        "custom": {"task": "tests.any", "schedule": EveryOther(timedelta(seconds=10))},
        "opaque-args": {"task": "tests.any", "schedule": 10.0, "args": (object(),)},
    }
    out = io.StringIO()
    with pytest.raises(CommandError, match="3 task"):
        call_command("driftsafe_import", "--source", "beat_schedule", stdout=out, no_color=True)
    text = out.getvalue()
    assert "error        never" in text and "must be longer than zero" in text
    assert "error        custom" in text and "EveryOther schedules are not supported" in text
    assert "error        opaque-args" in text and "args: object" in text
    assert "at [0] is not a JSON value" in text
    assert list(PeriodicTask.objects.values_list("name", flat=True)) == ["fine"]


# -- driftsafe_import: django-celery-beat ----------------------------------------------------


@pytest.fixture
def celery_beat() -> Iterator[Any]:
    """django-celery-beat installed for the test, with its tables created and dropped after."""
    pytest.importorskip("django_celery_beat", reason="django-celery-beat is not installed")
    from django.apps import apps
    from django.contrib import admin
    from django.db import connection

    registered = dict(admin.site._registry)  # re-populating the apps autodiscovers its admin
    try:
        with override_settings(INSTALLED_APPS=[*settings.INSTALLED_APPS, "django_celery_beat"]):
            from django_celery_beat import models

            tables = list(apps.get_app_config("django_celery_beat").get_models())
            with connection.schema_editor() as editor:
                for model in tables:
                    editor.create_model(model)
            try:
                yield models
            finally:
                with connection.schema_editor() as editor:
                    for model in reversed(tables):
                        editor.delete_model(model)
    finally:
        admin.site._registry.clear()
        admin.site._registry.update(registered)


@pytest.mark.django_db(transaction=True)
def test_import_django_celery_beat_tasks_idempotently(app: Any, celery_beat: Any) -> None:
    m = celery_beat
    last_run = datetime(2026, 2, 1, 8, 0, 7, tzinfo=UTC)
    ten_minutes = m.IntervalSchedule.objects.create(every=10, period="minutes")
    workdays = m.CrontabSchedule.objects.create(
        minute="30", hour="7", day_of_week="1-5", timezone="Europe/Berlin"
    )
    when = m.ClockedSchedule.objects.create(clocked_time=datetime(2030, 5, 1, 9, tzinfo=UTC))
    m.PeriodicTask.objects.create(
        name="poll",
        task="tests.any",
        interval=ten_minutes,
        args="[1, 2]",
        kwargs='{"z": 3}',
        queue="q",
        expire_seconds=60,
        last_run_at=last_run,
    )
    m.PeriodicTask.objects.create(name="morning", task="tests.any", crontab=workdays, enabled=False)
    m.PeriodicTask.objects.create(name="launch", task="tests.any", clocked=when, one_off=True)
    sun = m.SolarSchedule.objects.create(event="sunset", latitude=52.5, longitude=13.4)
    m.PeriodicTask.objects.create(name="dusk", task="tests.any", solar=sun)
    m.PeriodicTask.objects.create(
        name="bad-json", task="tests.any", interval=ten_minutes, args="[1,"
    )
    m.PeriodicTask.objects.create(
        name="once-interval", task="tests.any", interval=ten_minutes, one_off=True
    )

    out = io.StringIO()
    with pytest.raises(CommandError, match="1 task"):
        call_command(
            "driftsafe_import",
            "--source",
            "django_celery_beat",
            "--dry-run",
            stdout=out,
            no_color=True,
        )
    text = out.getvalue()
    assert "would create poll (django_celery_beat)" in text
    assert "would create dusk (django_celery_beat)" in text and "args is not valid JSON" in text
    assert "would create once-interval (django_celery_beat)" in text
    assert not PeriodicTask.objects.exists()

    with pytest.raises(CommandError):
        call_command("driftsafe_import", "--source", "django_celery_beat", stdout=io.StringIO())
    poll = PeriodicTask.objects.get(name="poll")
    assert (poll.interval_every, poll.interval_unit, poll.interval_anchor) == (
        10,
        "minutes",
        last_run,
    )
    assert (poll.args, poll.kwargs, poll.queue, poll.expires_seconds) == (
        [1, 2],
        {"z": 3},
        "q",
        60.0,
    )
    assert poll.source == TaskSource.DATABASE
    assert poll.next_slot_at is not None
    assert (poll.next_slot_at - last_run) % timedelta(minutes=10) == timedelta(0)
    morning = PeriodicTask.objects.get(name="morning")
    assert (
        morning.crontab_minute,
        morning.crontab_hour,
        morning.crontab_day_of_week,
        morning.timezone,
        morning.enabled,
    ) == ("30", "7", "1-5", "Europe/Berlin", False)
    launch = PeriodicTask.objects.get(name="launch")
    assert launch.schedule_kind == "one_off" and launch.next_slot_at == when.clocked_time
    dusk = PeriodicTask.objects.get(name="dusk")
    assert (dusk.schedule_kind, dusk.solar_event, dusk.solar_latitude, dusk.solar_longitude) == (
        "solar",
        "sunset",
        52.5,
        13.4,
    )
    assert dusk.next_slot_at == Solar("sunset", 52.5, 13.4).first_at_or_after(dusk.next_slot_at)
    once = PeriodicTask.objects.get(name="once-interval")
    assert (once.schedule_kind, once.run_once) == ("interval", True)
    assert PeriodicTask.objects.count() == 5

    # again: nothing changes; an edited source row is kept unless --update is given
    m.PeriodicTask.objects.filter(name="bad-json").delete()
    assert "5 unchanged" in run("driftsafe_import", "--source", "django_celery_beat")
    m.PeriodicTask.objects.filter(name="poll").update(queue="slow")
    text = run("driftsafe_import", "--source", "django_celery_beat")
    assert "kept         poll (django_celery_beat): differs in queue; use --update" in text
    assert PeriodicTask.objects.get(name="poll").queue == "q"
    assert "1 update" in run("driftsafe_import", "--source", "django_celery_beat", "--update")
    updated = PeriodicTask.objects.get(name="poll")
    assert updated.queue == "slow" and updated.next_slot_at == poll.next_slot_at


@pytest.mark.django_db(transaction=True)
def test_import_reports_django_celery_beat_rows_a_task_cannot_send_and_imports_the_rest(
    app: Any, celery_beat: Any
) -> None:
    """django-celery-beat stores arguments as text, which may hold anything: nesting deep
    enough for Python's parser to give up (a ``RecursionError`` killed the import, importing
    nothing), NaN, numbers past Python's digit limit, a one-off in the year 9999. Each such
    row is an error in the report, naming its field; every other row is imported."""
    m = celery_beat
    every = m.IntervalSchedule.objects.create(every=10, period="minutes")
    late = m.ClockedSchedule.objects.create(clocked_time=datetime(9999, 12, 31, 23, tzinfo=UTC))
    m.PeriodicTask.objects.create(name="a-good", task="tests.any", interval=every, args="[1, 2]")
    m.PeriodicTask.objects.create(
        name="deep", task="tests.any", interval=every, args="[" * 100_000 + "]" * 100_000
    )
    m.PeriodicTask.objects.create(name="nan", task="tests.any", interval=every, kwargs='{"a": NaN}')
    m.PeriodicTask.objects.create(
        name="huge", task="tests.any", interval=every, headers='{"n": ' + "7" * 5000 + "}"
    )
    m.PeriodicTask.objects.create(name="late", task="tests.any", clocked=late, one_off=True)
    m.PeriodicTask.objects.create(name="z-good", task="tests.any", interval=every)
    out = io.StringIO()
    with pytest.raises(CommandError, match="4 task"):
        call_command(
            "driftsafe_import", "--source", "django_celery_beat", stdout=out, no_color=True
        )
    text = out.getvalue()
    assert "error        deep (django_celery_beat): args: nests 100000 levels deep" in text
    assert "error        nan (django_celery_beat): kwargs: holds NaN" in text
    assert "error        huge (django_celery_beat): headers: holds a whole number" in text
    assert "error        late (django_celery_beat): one_off_at: must be from" in text
    assert "2 create, 4 error" in text
    assert list(PeriodicTask.objects.values_list("name", "args")) == [
        ("a-good", [1, 2]),
        ("z-good", []),
    ]


@pytest.mark.django_db
def test_import_from_django_celery_beat_needs_it_installed(app: Any) -> None:
    with pytest.raises(CommandError, match="django_celery_beat is not in INSTALLED_APPS"):
        call_command("driftsafe_import", "--source", "django_celery_beat")
    assert "django_celery_beat is not installed: skipped" in run("driftsafe_import")
    # another app than the project's, named on the command line
    text = run(
        "driftsafe_import",
        "--app",
        "tests.management.test_commands:OTHER_APP",
        "--dry-run",
        "--source",
        "beat_schedule",
    )
    assert "would create other-app-task (beat_schedule)" in text
    assert "warning: task 'other.task' is not registered" in text


@pytest.mark.django_db(transaction=True)
def test_import_every_kind_and_option_django_celery_beat_stores(app: Any, celery_beat: Any) -> None:
    """One django-celery-beat task of every schedule kind and with every option it stores:
    each is brought over, and the per-task table has nothing in its "not" column."""
    m = celery_beat
    start = datetime(2030, 1, 1, 6, 0, 0, tzinfo=UTC)
    end = datetime(2030, 12, 31, 23, 0, tzinfo=UTC)
    last_run = datetime(2026, 2, 1, 8, 0, 7, tzinfo=UTC)
    ninety = m.IntervalSchedule.objects.create(every=90, period="seconds")
    micro = m.IntervalSchedule.objects.create(every=5_000_000, period="microseconds")
    half = m.IntervalSchedule.objects.create(every=500_000, period="microseconds")
    daily = m.IntervalSchedule.objects.create(every=2, period="days")
    nyc = m.CrontabSchedule.objects.create(
        minute="15",
        hour="9",
        day_of_week="mon-fri",
        day_of_month="*",
        month_of_year="*",
        timezone="America/New_York",
    )
    sun = m.SolarSchedule.objects.create(event="dawn_civil", latitude=-33.8688, longitude=151.2093)
    when = m.ClockedSchedule.objects.create(clocked_time=datetime(2031, 5, 1, 9, tzinfo=UTC))
    m.PeriodicTask.objects.create(
        name="everything",
        task="tests.any",
        interval=ninety,
        args="[1, 2]",
        kwargs='{"z": 3}',
        queue="q",
        exchange="ex",
        routing_key="rk",
        priority=7,
        headers='{"x-team": "ops"}',
        expire_seconds=60,
        start_time=start,
        last_run_at=last_run,
        total_run_count=41,
        description="all the options",
    )
    m.PeriodicTask.objects.create(name="micro", task="tests.any", interval=micro)
    m.PeriodicTask.objects.create(name="half-second", task="tests.any", interval=half)
    m.PeriodicTask.objects.create(
        name="every-two-days", task="tests.any", interval=daily, enabled=False
    )
    m.PeriodicTask.objects.create(
        name="weekday-nyc",
        task="tests.any",
        crontab=nyc,
        start_time=start,
        expires=end,
        one_off=True,
    )
    m.PeriodicTask.objects.create(
        name="dawn", task="tests.any", solar=sun, one_off=True, enabled=False
    )
    m.PeriodicTask.objects.create(
        name="launch",
        task="tests.any",
        clocked=when,
        one_off=True,
        expires=datetime(2031, 5, 2, tzinfo=UTC),
    )

    text = run("driftsafe_import", "--source", "django_celery_beat")
    assert "7 create" in text
    assert text.count("everything was brought over") == 7, text
    assert "NOT" not in text
    for line in (
        "| start_time",
        "| expires",
        "| one_off",
        "| total_run_count",
        "| last_run_at",
        "| description",
        "| headers",
        "| priority",
        "| expire_seconds",
    ):
        assert line in text, line

    task = PeriodicTask.objects.get(name="everything")
    assert (task.schedule_kind, task.interval_every, task.interval_unit) == (
        "interval",
        90,
        "seconds",
    )
    assert (
        task.args,
        task.kwargs,
        task.queue,
        task.exchange,
        task.routing_key,
        task.priority,
        task.headers,
        task.expires_seconds,
        task.description,
    ) == ([1, 2], {"z": 3}, "q", "ex", "rk", 7, {"x-team": "ops"}, 60.0, "all the options")
    assert (task.valid_from, task.interval_anchor, task.next_slot_at) == (start, start, start)
    assert (task.last_slot_at, task.run_count, task.enabled) == (last_run, 41, True)
    micro_task = PeriodicTask.objects.get(name="micro")
    assert (micro_task.interval_every, micro_task.interval_unit) == (5, "seconds")
    half_task = PeriodicTask.objects.get(name="half-second")
    assert (half_task.interval_every, half_task.interval_unit) == (500_000, "microseconds")
    assert half_task.schedule.describe() == "every 0.5 seconds"
    two_days = PeriodicTask.objects.get(name="every-two-days")
    assert (two_days.interval_every, two_days.interval_unit, two_days.enabled) == (2, "days", False)
    nyc_task = PeriodicTask.objects.get(name="weekday-nyc")
    assert (
        nyc_task.crontab_minute,
        nyc_task.crontab_hour,
        nyc_task.crontab_day_of_week,
        nyc_task.timezone,
    ) == ("15", "9", "mon-fri", "America/New_York")
    assert (nyc_task.valid_from, nyc_task.valid_until, nyc_task.run_once) == (start, end, True)
    # the first slot: the first weekday 09:15 in New York at or after start_time
    assert nyc_task.next_slot_at == datetime(2030, 1, 1, 14, 15, tzinfo=UTC)
    dawn = PeriodicTask.objects.get(name="dawn")
    assert (
        dawn.schedule_kind,
        dawn.solar_event,
        dawn.solar_latitude,
        dawn.solar_longitude,
        dawn.run_once,
        dawn.enabled,
    ) == ("solar", "dawn_civil", -33.8688, 151.2093, True, False)
    launch = PeriodicTask.objects.get(name="launch")
    assert (launch.schedule_kind, launch.one_off_at, launch.run_once, launch.valid_until) == (
        "one_off",
        when.clocked_time,
        True,
        datetime(2031, 5, 2, tzinfo=UTC),
    )
    assert launch.next_slot_at == when.clocked_time
    assert "7 unchanged" in run("driftsafe_import", "--source", "django_celery_beat")


@pytest.mark.django_db
def test_import_beat_schedule_reports_options_it_does_not_bring_over(app: Any) -> None:
    app.conf.beat_schedule = {
        "until-new-year": {
            "task": "tests.any",
            "schedule": crontab(minute=0, hour=3),
            "options": {"expires": datetime(2031, 1, 1, 0, 0), "queue": "q", "countdown": 5},
            "relative": True,
        },
        "plain": {
            "task": "tests.any",
            "schedule": 30.0,
            "options": {"expires": 20, "overlap_policy": "buffer_all"},
        },
        "quick": {"task": "tests.any", "schedule": timedelta(milliseconds=250)},
    }
    text = run("driftsafe_import", "--source", "beat_schedule")
    assert "3 create" in text
    assert "| options.expires" in text and "valid_until" in text
    assert "| options.countdown" in text and "not a publish option this package sends" in text
    assert "| relative" in text
    assert text.count("everything was brought over") == 2
    quick = PeriodicTask.objects.get(name="quick")
    assert (quick.interval_every, quick.interval_unit) == (250_000, "microseconds")
    task = PeriodicTask.objects.get(name="until-new-year")
    # naive datetimes are read in the app's time zone (Europe/Berlin), as Celery does
    assert task.valid_until == datetime(2030, 12, 31, 23, 0, tzinfo=UTC)
    assert task.queue == "q" and task.expires_seconds is None
    assert PeriodicTask.objects.get(name="plain").expires_seconds == 20.0
    assert "| options.overlap_policy | overlap_policy" in text
    assert PeriodicTask.objects.get(name="plain").overlap_policy == "buffer_all"
    assert PeriodicTask.objects.get(name="quick").overlap_policy == "allow"


@pytest.mark.django_db(transaction=True)  # the connection is closed and pointed elsewhere
def test_status_exits_4_when_the_database_does_not_answer(settings: Any, tmp_path: Any) -> None:
    """With the database out of reach nothing can be claimed: the command says so, and what
    that stops, with a status of its own (whichever clock is the time authority)."""
    from django.db import connection

    from celery_driftsafe.testing.processes import free_port

    _node("up", changes.authority_now())
    saved = dict(connection.settings_dict)
    connection.close()
    if connection.vendor == "sqlite":  # no server to lose: a file that cannot be opened
        connection.settings_dict["NAME"] = str(tmp_path / "no-such-folder" / "db.sqlite3")
    else:
        connection.settings_dict.update(HOST="127.0.0.1", PORT=str(free_port()))
    try:
        for authority in ("database", "redis"):
            settings.DRIFTSAFE = {**settings.DRIFTSAFE, "TIME_AUTHORITY": authority}
            with pytest.raises(CommandError) as raised:
                call_command("driftsafe_status", stdout=io.StringIO(), no_color=True)
            assert raised.value.returncode == 4, (authority, raised.value)
            said = str(raised.value)
            assert said.startswith("the database does not answer (")
            assert "no beat can claim a slot until it does" in said
    finally:
        connection.close()
        connection.settings_dict.clear()
        connection.settings_dict.update(saved)


@pytest.mark.django_db
def test_status_exits_3_naming_a_beat_silent_for_a_few_heartbeats(admin_client: Any) -> None:
    """A beat alive but not heard from for over three heartbeat intervals (the database out of
    its reach, say) is named, by the command (exit 3) and on the dashboard, before it is dead;
    one heartbeating or dead is not."""
    from django.urls import reverse

    now = changes.authority_now()
    _node("steady", now, age=1)
    _node("quiet", now, age=20)  # 5 s heartbeats: silent after 15 s, dead after 30 s
    _node("gone", now, age=120)
    with pytest.raises(CommandError) as raised:
        call_command("driftsafe_status", stdout=io.StringIO(), no_color=True)
    assert raised.value.returncode == 3
    said = str(raised.value)
    assert "beats silent for over 15 s" in said and "quiet:1:ab" in said
    assert "steady:1:ab" not in said and "gone:1:ab" not in said
    page = admin_client.get(reverse("admin:celery_driftsafe_dashboard")).content.decode()
    assert 'id="ds-silent"' in page and "quiet:1:ab" in page.split('id="ds-silent"')[1][:400]
    BeatNode.objects.filter(node_id="quiet:1:ab").update(last_heartbeat_at=now)
    call_command("driftsafe_status", stdout=io.StringIO(), no_color=True)  # exit 0
