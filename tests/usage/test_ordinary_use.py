"""What a project does to the scheduler in its first week: stale saves, malformed rows, a paused
beat, a slim beat process, a broker that refuses one message. Real database, real Redis broker
(RabbitMQ where a refusal is the point); time from a fake clock."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.core.exceptions import ValidationError
from django.db import connection

from celery_driftsafe.beat import nodes
from celery_driftsafe.beat.recovery import reconcile
from celery_driftsafe.claim.claimers import claimer_for
from celery_driftsafe.claim.outbox import reclaim_stale
from celery_driftsafe.core.validation import json_problems
from celery_driftsafe.definitions.changes import schedule_unscheduled
from celery_driftsafe.models import PeriodicTask, Run, RunStatus
from celery_driftsafe.publish.dispatcher import Dispatcher
from celery_driftsafe.scheduler import DriftSafeScheduler
from celery_driftsafe.testing import FakeClock
from tests import settings as test_settings
from tests.skip_guard import configuration
from tests.support import T0, drain, rabbitmq_url
from tests.support.factories import interval_task

S = timedelta(seconds=1)
pytestmark = pytest.mark.django_db(transaction=True)


def _slots(task: PeriodicTask) -> list[datetime]:
    return sorted(
        s
        for s in Run.objects.filter(periodic_task=task).values_list("slot", flat=True)
        if s is not None
    )


# -- the claim owns its columns -------------------------------------------------------------


def test_stale_save_of_kwargs_never_moves_the_task_back(
    scheduler: DriftSafeScheduler, clock: FakeClock
) -> None:
    task = interval_task("t", 1, anchor=T0, next_slot_at=T0, args=[1], kwargs={"y": 1})
    stale = PeriodicTask.objects.get(pk=task.pk)  # an admin form opened now
    for _ in range(5):
        scheduler.run_round()
        clock.advance(S)
    stale.kwargs = {"y": 2}
    stale.save()  # 0.1 wrote next_slot_at = T0 back here and every claim hit the constraint
    fresh = PeriodicTask.objects.get(pk=task.pk)
    assert fresh.next_slot_at == T0 + 5 * S and fresh.run_count == 5
    assert fresh.kwargs == {"y": 2}
    for _ in range(3):
        scheduler.run_round()
        clock.advance(S)
    assert _slots(task) == [T0 + k * S for k in range(8)]
    messages = drain()
    assert len(messages) == 8 and messages[-1]["kwargs"] == {"y": 2}


def test_a_stale_save_never_switches_a_finished_task_back_on(
    scheduler: DriftSafeScheduler, clock: FakeClock
) -> None:
    """A run-once task loaded (by a script, a form) while enabled; the claim fires its run and
    disables it; the loaded instance is saved with another change. The save keeps the task
    disabled, as the claim left it: it used to count as a re-enable and fire a second run.
    Switching it on deliberately still schedules one more run."""
    task = interval_task("once", 1, anchor=T0, next_slot_at=T0, run_once=True)
    stale = PeriodicTask.objects.get(pk=task.pk)
    scheduler.run_round()
    finished = (False, "finished: run once: it fired its run")
    fresh = PeriodicTask.objects.get(pk=task.pk)
    assert (fresh.enabled, fresh.disabled_reason) == finished
    stale.description = "edited"
    stale.save()
    fresh = PeriodicTask.objects.get(pk=task.pk)
    assert (fresh.enabled, fresh.disabled_reason, fresh.description) == (*finished, "edited")
    assert (stale.enabled, stale.disabled_reason) == finished  # the instance says so too
    for _ in range(3):
        clock.advance(S)
        scheduler.run_round()
    assert _slots(task) == [T0]
    assert len(drain()) == 1
    stale.enabled = True
    stale.save()
    fresh = PeriodicTask.objects.get(pk=task.pk)
    assert fresh.enabled and fresh.disabled_reason == "" and fresh.next_slot_at is not None
    # The switch is noted only when both of its fields were loaded.
    assert fresh._switch_loaded == (True, "")
    assert not hasattr(PeriodicTask.objects.only("name", "enabled").get(), "_switch_loaded")


def test_stale_schedule_edit_starts_after_every_slot_that_has_a_run(
    scheduler: DriftSafeScheduler, clock: FakeClock
) -> None:
    task = interval_task("t", 2, anchor=T0, next_slot_at=T0)
    stale = PeriodicTask.objects.get(pk=task.pk)
    for _ in range(4):
        scheduler.run_round()
        clock.advance(S)
    # The schedule edit (2 s -> 1 s, same anchor) on an old instance; the authority's "now"
    # as the saving process sees it lags behind the last fired slot.
    stale.interval_every = 1
    stale.driftsafe_now = T0  # type: ignore[attr-defined]
    stale.save()
    fresh = PeriodicTask.objects.get(pk=task.pk)
    assert fresh.next_slot_at is not None and fresh.next_slot_at > max(_slots(task))


def test_a_slot_that_already_has_a_run_is_skipped_and_the_round_goes_on(
    scheduler: DriftSafeScheduler, clock: FakeClock
) -> None:
    taken = interval_task("taken", 10, anchor=T0, next_slot_at=T0)
    other = interval_task("other", 10, anchor=T0, next_slot_at=T0)
    Run.objects.create(
        periodic_task=taken,
        task_name="tests.add",
        slot=T0,
        status=RunStatus.SUCCEEDED,
        celery_task_id="earlier",
    )
    scheduler.run_round()
    assert [m["task"] for m in drain()] == ["tests.add"]  # only "other"'s run
    assert Run.objects.filter(periodic_task=other, slot=T0).exists()
    assert Run.objects.filter(periodic_task=taken).count() == 1
    taken.refresh_from_db()
    assert taken.next_slot_at == T0 + 10 * S and taken.enabled  # advanced, not disabled
    clock.advance(10 * S)
    scheduler.run_round()
    assert len(drain()) == 2  # both fire their next slot


def test_tasks_written_without_save_are_scheduled_by_the_beat(
    scheduler: DriftSafeScheduler, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """``bulk_create``, ``loaddata``, raw SQL and ``update(enabled=True)`` skip ``save()``, so
    such rows have no next slot (they never fired, silently). The beat gives each what
    ``save()`` would have: an anchor, the first slot after now and after every slot that has a
    run; no slot left or a broken schedule disables the task with the reason."""
    from celery_driftsafe.models import ScheduleKind

    def new(name: str, kind: str, **fields: Any) -> PeriodicTask:
        return PeriodicTask(name=name, task="tests.add", args=[1, 2], schedule_kind=kind, **fields)

    PeriodicTask.objects.bulk_create(
        [
            new("every-10s", ScheduleKind.INTERVAL, interval_every=10, interval_unit="seconds"),
            new("each-minute", ScheduleKind.CRONTAB, crontab_minute="*"),
            new("once-missed", ScheduleKind.ONE_OFF, one_off_at=T0 - 30 * S),
            new("broken", ScheduleKind.CRONTAB, crontab_minute="99"),
        ]
    )
    done = interval_task("re-enabled", 10, anchor=T0 - 60 * S, next_slot_at=T0 - 20 * S)
    ran_once = new("once-ran", ScheduleKind.ONE_OFF, one_off_at=T0 - 10 * S)
    ran_once.save()  # computes nothing to run: its instant already has a run (below)
    for task, slot in ((done, T0 - 20 * S), (done, T0 - 10 * S), (ran_once, T0 - 10 * S)):
        Run.objects.create(
            periodic_task=task, task_name="tests.add", slot=slot, status=RunStatus.SUCCEEDED
        )
    PeriodicTask.objects.filter(pk__in=[done.pk, ran_once.pk]).update(
        enabled=False, next_slot_at=None
    )
    PeriodicTask.objects.filter(pk__in=[done.pk, ran_once.pk]).update(enabled=True)
    assert PeriodicTask.objects.filter(enabled=True, due_at__isnull=True).count() == 6

    with caplog.at_level("INFO", logger="celery_driftsafe.changes"):
        scheduler.run_round()  # starts the look, in a thread of its own
        scheduler.unscheduled.join(10)
    scheduler.run_round()  # the next round claims what is due now
    tasks = {t.name: t for t in PeriodicTask.objects.all()}
    assert tasks["every-10s"].interval_anchor == T0  # the authority's now, as save() does
    assert tasks["every-10s"].next_slot_at == T0 + 10 * S
    assert tasks["each-minute"].next_slot_at == T0 + 60 * S
    assert tasks["re-enabled"].next_slot_at == T0 + 10 * S  # after now and its last run
    assert _slots(tasks["once-missed"]) == [T0 - 30 * S]  # a one-off keeps its instant: fired
    assert not tasks["once-ran"].enabled
    assert tasks["once-ran"].disabled_reason == "finished: no slot left after now"
    assert not tasks["broken"].enabled
    assert tasks["broken"].disabled_reason.startswith("disabled by the scheduler: crontab_minute")
    assert caplog.text.count("had no next slot (written without save())") == 4
    assert [m["task"] for m in drain()] == ["tests.add"]  # the one-off's catch-up
    clock.advance(60 * S)
    scheduler.run_round()  # and the next look, in its thread
    scheduler.unscheduled.join(10)
    assert _slots(tasks["every-10s"])[:1] == [T0 + 10 * S]
    assert _slots(tasks["each-minute"]) == [T0 + 60 * S]
    assert _slots(tasks["re-enabled"])[:3] == [T0 - 20 * S, T0 - 10 * S, T0 + 10 * S]
    # the one-off, fired, is left with no next slot by the claim: the look finishes it
    fired = PeriodicTask.objects.get(name="once-missed")
    assert (fired.enabled, fired.disabled_reason) == (False, "finished: no slot left after now")
    assert not PeriodicTask.objects.filter(enabled=True, due_at__isnull=True).exists()


def test_a_row_written_without_save_at_the_calendars_end_is_disabled_and_the_rest_scheduled(
    clock: FakeClock,
) -> None:
    """A one-off at 9999-12-31 23:59 with a day of jitter, written by ``bulk_create`` (which
    skips ``save()``'s checks): its due instant is past the calendar, which failed every pass
    of the beat's look for unscheduled tasks, for every task after it."""
    from celery_driftsafe.definitions.changes import schedule_unscheduled

    late = datetime(9999, 12, 31, 23, 59, tzinfo=UTC)
    PeriodicTask.objects.bulk_create(
        [
            PeriodicTask(
                name="a-end",
                task="tests.add",
                schedule_kind="one_off",
                one_off_at=late,
                jitter_seconds=86_400.0,
            ),
            PeriodicTask(
                name="b-fine", task="tests.add", schedule_kind="interval", interval_every=10
            ),
        ]
    )
    assert schedule_unscheduled(T0) == ["b-fine"]
    end = PeriodicTask.objects.get(name="a-end")
    assert (end.enabled, end.next_slot_at, end.due_at) == (False, None, None)
    assert end.disabled_reason.startswith("disabled by the scheduler: one_off_at: ")
    assert "OverflowError" in end.disabled_reason
    assert PeriodicTask.objects.get(name="b-fine").next_slot_at == T0 + 10 * S


# -- no data can stop a beat -----------------------------------------------------------------


def test_json_strings_in_args_and_kwargs_are_read_as_their_value(
    scheduler: DriftSafeScheduler,
) -> None:
    task = PeriodicTask(
        name="habit",
        task="tests.add",
        schedule_kind="interval",
        interval_every=10,
        interval_anchor=T0,
        args=json.dumps([1, 2]),
        kwargs=json.dumps({}),
    )
    task.save()
    task.refresh_from_db()
    assert task.args == [1, 2] and task.kwargs == {}
    # stored as a JSON string behind save()'s back: the claim reads it the same way
    PeriodicTask.objects.filter(pk=task.pk).update(args=json.dumps([3, 4]), next_slot_at=T0)
    scheduler.run_round()
    assert [m["args"] for m in drain()] == [[3, 4]]


def _nested(levels: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(levels - 1):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("field", "value", "wrong"),
    [
        ("args", "1, 2", "args"),
        ("args", {"x": 1}, "args"),
        ("kwargs", [1, 2], "kwargs"),
        ("kwargs", json.dumps([1]), "kwargs"),
        ("headers", {"id": "another-task-id"}, "headers"),
        ("headers", {"task": "evil.task"}, "headers"),
        ("headers", {"compression": "zlib"}, "headers"),
        ("priority", 999, "priority"),
        ("expires_seconds", -5.0, "expires_seconds"),
        ("expires_seconds", 1e12, "expires_seconds"),  # "never", past the calendar's end
        ("misfire_grace_seconds", -1.0, "misfire_grace_seconds"),
        ("misfire_grace_seconds", float("inf"), "misfire_grace_seconds"),
        ("misfire_policy", "sometimes", "misfire_policy"),
        ("timezone", "Mars/Olympus_Mons", "timezone"),
        # what Celery's json serializer cannot send, or a database cannot store as it is
        ("args", [1, float("nan")], "args"),
        ("kwargs", {"a": float("inf")}, "kwargs"),
        ("kwargs", {1: "a"}, "kwargs"),
        ("headers", {"x-note": "a\x00b"}, "headers"),
        ("args", [10**5000], "args"),
        ("args", _nested(100), "args"),
        ("args", "[" * 5000 + "]" * 5000, "args"),  # a JSON string too deep to decode
        ("crontab_minute", "1" * 5000, "crontab_minute"),  # past Python's digit limit
        # a slot there, plus its jitter or expiry, would leave the calendar
        ("valid_from", datetime(9999, 12, 31, tzinfo=UTC), "valid_from"),
        ("interval_anchor", datetime(9999, 12, 31, tzinfo=UTC), "interval_anchor"),
        ("one_off_at", datetime(9999, 12, 31, 23, tzinfo=UTC), "one_off_at"),
    ],
)
def test_save_refuses_what_the_task_could_not_fire_with(field: str, value: Any, wrong: str) -> None:
    fields: dict[str, Any] = {
        "schedule_kind": "interval",
        "interval_every": 10,
        "interval_anchor": T0,
    }
    if field in ("timezone", "crontab_minute"):
        fields = {"schedule_kind": "crontab", "crontab_minute": "0"}
    if field == "one_off_at":
        fields = {"schedule_kind": "one_off", "jitter_seconds": 3600.0}
    task = PeriodicTask(name="bad", task="tests.add", **{**fields, field: value})
    with pytest.raises(ValidationError) as caught:
        task.save()
    assert wrong in caught.value.message_dict
    assert not PeriodicTask.objects.exists()


def test_every_header_celery_kombu_or_this_package_reads_is_reserved() -> None:
    """The reserved headers hold Celery's own list (the protocol 2 headers and properties
    ``as_task_v2`` writes, every name of the worker's request context, the names Celery keeps
    out of a request's custom headers), the header kombu reads, and this package's."""
    from celery import Celery
    from celery.app.task import Context

    from celery_driftsafe.core import headers

    app = Celery("reserved", set_as_current=False)
    message = app.amqp.as_task_v2("an-id", "a.task", stamped_headers=["s"], s=1)
    celerys = {*message.headers, *message.properties}
    context = {name for name in vars(Context) if not name.startswith("__")}
    custom = Context({"lang": 1, "task": 1, "argsrepr": 1, "kwargsrepr": 1, "compression": 1})
    assert custom.headers is None  # Celery keeps these out of the custom headers
    kombus = {"compression"}  # kombu.Message.decode decompresses by it
    for name in {*celerys, *context, *kombus, *headers.ALL, "lang", "task", "argsrepr"}:
        assert headers.reserved(name), name
    problems = json_problems([], {}, {"tenant": "a", "x-trace": "b", "priority_hint": 1})
    assert problems == []  # a header of the project's own is not a reserved one


_BAD_ROWS: list[tuple[str, dict[str, Any], str]] = [
    ("args-object", {"args": {"a": 1}}, "args:"),
    ("args-text", {"args": "1, 2"}, "args:"),
    ("kwargs-list", {"kwargs": [1, 2]}, "kwargs:"),
    ("headers-protocol", {"headers": {"id": "x", "task": "y"}}, "headers:"),
    # kombu decompresses a message by its ``compression`` header: every message undecodable
    ("headers-compression", {"headers": {"compression": "zlib"}}, "headers: must not set"),
    ("headers-content", {"headers": {"content_type": "x"}}, "headers: must not set"),
    ("headers-own", {"headers": {"driftsafe_slot": "x"}}, "headers: must not set"),
    (
        "interval-overflow",
        {"interval_every": 2_000_000_000, "interval_unit": "days"},
        "interval_every:",
    ),
    ("zone", {"schedule_kind": "crontab", "timezone": "Nowhere/Atlantis"}, "timezone"),
    ("grace", {"misfire_grace_seconds": -3.0}, "misfire_grace_seconds:"),
    ("expiry", {"expires_seconds": -1.0}, "expires_seconds:"),
    # an expiry past the calendar's end failed every claim round, for every task
    ("expiry-overflow", {"expires_seconds": 1e12}, "expires_seconds:"),
    ("grace-overflow", {"misfire_grace_seconds": 1e12}, "misfire_grace_seconds:"),
    ("policy", {"overlap_policy": "maybe"}, "overlap_policy:"),
]


def test_each_malformed_row_is_disabled_with_its_reason_and_the_rest_fire(
    scheduler: DriftSafeScheduler, clock: FakeClock
) -> None:
    good = interval_task("good", 1, anchor=T0, next_slot_at=T0)
    bad = {}
    for name, _, _ in _BAD_ROWS:
        bad[name] = interval_task(name, 1, anchor=T0, next_slot_at=T0)
    for name, values, _ in _BAD_ROWS:  # behind save()'s back, as SQL or a migration would
        PeriodicTask.objects.filter(pk=bad[name].pk).update(**values)
    for _ in range(3):
        scheduler.run_round()
        clock.advance(S)
    assert _slots(good) == [T0, T0 + S, T0 + 2 * S]
    assert {m["task"] for m in drain()} == {"tests.add"}
    for name, _, reason in _BAD_ROWS:
        row = PeriodicTask.objects.get(pk=bad[name].pk)
        assert not row.enabled, name
        assert row.disabled_reason.startswith("disabled by the scheduler"), name
        assert reason in row.disabled_reason, (name, row.disabled_reason)
        assert not Run.objects.filter(periodic_task=row).exists(), name


def _rounds(
    scheduler: DriftSafeScheduler, clock: FakeClock, count: int, *, look: bool = False
) -> list[float]:
    """``count`` rounds a second apart, each as tick() runs it minus the wait; with ``look``,
    each also waits for the look for rows written without save() (a thread of its own).
    Returns each round's wait."""
    waits = []
    for _ in range(count):
        waits.append(scheduler._guarded_round())
        if look:
            scheduler.unscheduled.join(30)
        clock.advance(S)
    return waits


#: Rows written by raw SQL that the claim cannot plan or count: (name, SET clause, the field
#: its reason names). The first two stopped or slowed every round on both databases.
_RAW_BAD_ROWS: list[tuple[str, str, str]] = [
    # run_count + 1 overflowed: OverflowError (SQLite) or a failed ::bigint cast, which the
    # beat took for an outage (PostgreSQL), in every round, for every task
    ("run-count-full", f"run_count = {2**63 - 1}", "run_count:"),
    # planning asserted, the compare-and-swap never won the row: an ERROR line a round
    ("no-next-slot", "next_slot_at = NULL", "next_slot_at:"),
    ("interval-past-the-calendar", "interval_every = 2147483647, interval_unit = 'days'", "every:"),
]
if test_settings.TEST_DB == "sqlite":  # only SQLite stores text in a number column
    _RAW_BAD_ROWS += [
        ("run-count-text", "run_count = 'many'", "run_count:"),
        ("run-count-fraction", "run_count = 1.5", "run_count:"),
        ("every-text", "interval_every = 'often'", "interval_every:"),
        ("jitter-text", "jitter_seconds = 'some'", "jitter_seconds:"),
    ]


def test_rows_written_by_raw_sql_are_disabled_once_and_no_round_slows(
    scheduler: DriftSafeScheduler, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Each row is disabled with its reason in the first round, logged once; every round
    fires the good task and waits for its next slot (no back-off, no spin)."""
    good = interval_task("good", 1, anchor=T0, next_slot_at=T0)
    bad = {name: interval_task(name, 1, anchor=T0, next_slot_at=T0) for name, _, _ in _RAW_BAD_ROWS}
    with connection.cursor() as cursor:
        for name, change, _ in _RAW_BAD_ROWS:
            cursor.execute(
                f"UPDATE celery_driftsafe_periodictask SET {change} WHERE id = %s", [bad[name].pk]
            )
    with caplog.at_level("INFO"):
        waits = _rounds(scheduler, clock, 4)
    assert waits == [pytest.approx(1.0)] * 4  # the good task's next slot, each round
    assert _slots(good) == [T0 + k * S for k in range(4)]
    assert len(drain()) == 4
    for name, _, reason in _RAW_BAD_ROWS:
        row = PeriodicTask.objects.filter(pk=bad[name].pk).values("enabled", "disabled_reason")
        assert not row[0]["enabled"], name
        assert row[0]["disabled_reason"].startswith("disabled by the scheduler"), name
        assert reason in row[0]["disabled_reason"], (name, row[0]["disabled_reason"])
        assert not Run.objects.filter(periodic_task_id=bad[name].pk).exists(), name
        assert caplog.text.count(f"task {name} disabled") == 1, (name, caplog.text)
    assert "failed unexpectedly" not in caplog.text and "paused" not in caplog.text


@pytest.mark.skipif(
    test_settings.TEST_DB != "sqlite", reason=configuration("only SQLite stores any text")
)
def test_a_due_instant_that_is_no_instant_is_disabled_and_no_round_backs_off(
    scheduler: DriftSafeScheduler, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A ``due_at`` that sorts first but is no instant (here a UTC offset of 99 hours) made
    every round fail reading the next due instant, and the beat back off (up to 30 s)."""
    good = interval_task("good", 1, anchor=T0, next_slot_at=T0)
    broken = interval_task("broken", 60, anchor=T0, next_slot_at=T0 + 60 * S)
    with connection.cursor() as cursor:  # after now, before the good task's next slot
        cursor.execute(
            "UPDATE celery_driftsafe_periodictask SET due_at = '2026-03-01 12:00:00+99:00' "
            "WHERE id = %s",
            [broken.pk],
        )
    with caplog.at_level("INFO"):
        waits = _rounds(scheduler, clock, 3)
    assert waits == [pytest.approx(1.0)] * 3
    assert _slots(good) == [T0, T0 + S, T0 + 2 * S]
    row = PeriodicTask.objects.filter(pk=broken.pk).values("enabled", "disabled_reason").get()
    assert not row["enabled"] and row["disabled_reason"].startswith(
        "disabled by the scheduler: due_at:"
    )
    assert caplog.text.count("task broken disabled") == 1


@pytest.mark.skipif(
    test_settings.TEST_DB != "sqlite", reason=configuration("only SQLite stores any text")
)
def test_an_enabled_flag_of_two_reads_as_disabled_everywhere_and_the_beat_never_spins(
    scheduler: DriftSafeScheduler, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Django reads a stored 2 as false and the claim takes only 1; the next-due query took it
    as true: the beat saw a task due that it never claimed, and waited 10 ms a round."""
    good = interval_task("good", 1, anchor=T0, next_slot_at=T0)
    odd = interval_task("odd", 1, anchor=T0, next_slot_at=T0)
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE celery_driftsafe_periodictask SET enabled = 2 WHERE id = %s", [odd.pk]
        )
    with caplog.at_level("INFO"):
        waits = _rounds(scheduler, clock, 3, look=True)
    assert waits == [pytest.approx(1.0)] * 3
    assert _slots(good) == [T0, T0 + S, T0 + 2 * S]
    assert not PeriodicTask.objects.get(pk=odd.pk).enabled
    assert not Run.objects.filter(periodic_task=odd).exists()
    # The beat's look for rows written without save() stored it disabled, with the reason,
    # once; another look finds nothing more to do.
    with caplog.at_level("INFO"):
        assert schedule_unscheduled(clock.now()) == []
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT CAST(enabled AS INTEGER), disabled_reason FROM celery_driftsafe_periodictask"
            " WHERE id = %s",
            [odd.pk],
        )
        assert cursor.fetchone() == (
            0,
            "disabled by the scheduler: enabled held 2, not a boolean",
        )
    assert caplog.text.count("task odd disabled") == 1


@pytest.mark.skipif(
    test_settings.TEST_DB != "sqlite", reason=configuration("only SQLite stores any text")
)
def test_a_due_instant_django_reads_as_empty_is_scheduled_again_from_the_next_slot(
    scheduler: DriftSafeScheduler, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """``due_at = 'garbage'`` (raw SQL): Django reads it as empty and the claim never finds
    the task due, so it silently never fired. ``due_at`` is derived from the next slot: the
    beat's look for rows written without save() clears it and schedules the task again from
    its stored next slot, which then fires on time."""
    good = interval_task("good", 1, anchor=T0, next_slot_at=T0)
    lost = interval_task("lost", 1, anchor=T0, next_slot_at=T0 + S)
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE celery_driftsafe_periodictask SET due_at = 'garbage' WHERE id = %s", [lost.pk]
        )
    with caplog.at_level("INFO"):
        waits = _rounds(scheduler, clock, 3, look=True)
    assert waits == [pytest.approx(1.0)] * 3
    assert caplog.text.count("task lost had a due instant that is no instant ('garbage'") == 1
    assert _slots(lost) == [T0 + S, T0 + 2 * S]
    assert _slots(good) == [T0, T0 + S, T0 + 2 * S]
    lost.refresh_from_db()
    assert lost.enabled and lost.next_slot_at == lost.due_at == T0 + 3 * S


@pytest.mark.skipif(
    test_settings.TEST_DB != "sqlite", reason=configuration("only SQLite stores any text")
)
def test_a_row_the_orm_cannot_read_is_disabled_and_the_rest_fire(
    scheduler: DriftSafeScheduler, clock: FakeClock
) -> None:
    good = interval_task("good", 1, anchor=T0, next_slot_at=T0)
    broken = interval_task("broken", 1, anchor=T0, next_slot_at=T0)
    with connection.cursor() as cursor:  # JSON columns have a CHECK there; dates do not
        cursor.execute(
            "UPDATE celery_driftsafe_periodictask SET interval_anchor = "
            "'last tuesday' WHERE id = %s",
            [broken.pk],
        )
    scheduler.run_round()
    assert _slots(good) == [T0]
    row = PeriodicTask.objects.filter(pk=broken.pk).values("enabled", "disabled_reason").get()
    assert not row["enabled"] and row["disabled_reason"].startswith("disabled by the scheduler")


@pytest.mark.skipif(
    test_settings.TEST_DB != "sqlite", reason=configuration("only SQLite stores any text")
)
def test_a_row_the_orm_cannot_read_before_its_slot_does_not_fail_the_rounds(
    scheduler: DriftSafeScheduler, clock: FakeClock
) -> None:
    """Between rounds a beat builds the messages of tasks due soon; a row it cannot read there
    is the claim's to report (at its slot). Building ahead raised out of the round, which
    then backed off, up to 30 s, for every round until the claim met the row."""
    good = interval_task("good", 10, anchor=T0, next_slot_at=T0)
    broken = interval_task("broken", 60, anchor=T0, next_slot_at=T0 + 30 * S)
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE celery_driftsafe_periodictask SET interval_anchor = "
            "'2026-13-45 10:00:00' WHERE id = %s",
            [broken.pk],
        )
    for _ in range(4):
        assert scheduler.run_round() > 0
        clock.advance(10 * S)
    assert _slots(good) == [T0 + k * 10 * S for k in range(4)]
    row = PeriodicTask.objects.filter(pk=broken.pk).values("enabled", "disabled_reason").get()
    assert not row["enabled"] and row["disabled_reason"].startswith("disabled by the scheduler")


# -- a paused node cannot double-publish -------------------------------------------------------


def test_claims_taken_over_from_a_paused_node_are_not_published_by_it(
    broker_app: Any, clock: FakeClock
) -> None:
    interval_task("t", 10, anchor=T0, next_slot_at=T0)
    nodes.register("paused", T0)
    nodes.register("peer", T0)
    claimed = claimer_for().claim(T0, "paused").runs  # committed, then the process froze
    assert len(claimed) == 1
    clock.advance(40 * S)  # > NODE_DEAD_AFTER_SECONDS (30 s)
    nodes.heartbeat("peer", clock.now())
    assert nodes.mark_dead(clock.now(), timedelta(seconds=30), "peer") == ["paused"]
    taken = reclaim_stale(clock.now(), "peer", lease=timedelta(seconds=30))
    assert [r.run_id for r in taken] == [claimed[0].run_id]
    dispatcher = Dispatcher(broker_app, clock)
    assert dispatcher.dispatch(taken).published == [claimed[0].run_id]
    resumed = dispatcher.dispatch(claimed)  # the paused beat carries on where it stopped
    assert resumed.published == [] and resumed.lost == [claimed[0].run_id]
    assert len(drain()) == 1
    # its next heartbeat tells it that it was marked dead; it registers again
    assert nodes.heartbeat("paused", clock.now()) is False


def test_after_a_write_held_past_dead_after_the_batches_left_are_not_published(
    broker_app: Any, clock: FakeClock
) -> None:
    """The broker holds one of a beat's writes back (RabbitMQ's flow control, say) for longer
    than ``NODE_DEAD_AFTER_SECONDS``; meanwhile a peer marks the beat dead, takes its claims
    over and publishes them. The held batch goes out when the broker lets it (no one can call
    it back), but the batches after it are confirmed again and left to the peer: before, all
    of them went out twice."""
    for i in range(5):
        interval_task(f"t{i}", 10, anchor=T0, next_slot_at=T0)
    nodes.register("held", T0)
    nodes.register("peer", T0)
    claimed = claimer_for().claim(T0, "held").runs
    assert len(claimed) == 5
    dispatcher = Dispatcher(broker_app, clock, batch_size=2)
    write = dispatcher._publish_batch
    taken: list[Any] = []

    def held_back(runs: Any, *args: Any) -> None:
        write(runs, *args)
        if not taken:  # the first write took 40 s; the peer acted meanwhile
            clock.advance(40 * S)
            nodes.heartbeat("peer", clock.now())
            assert nodes.mark_dead(clock.now(), timedelta(seconds=30), "peer") == ["held"]
            taken.extend(reclaim_stale(clock.now(), "peer", lease=timedelta(seconds=30)))
            assert len(Dispatcher(broker_app, clock).dispatch(taken).published) == 5

    dispatcher._publish_batch = held_back  # type: ignore[method-assign]
    result = dispatcher.dispatch(claimed)
    first = [r.run_id for r in claimed[:2]]
    assert sorted(result.published) == sorted(first)
    assert sorted(result.lost) == sorted(r.run_id for r in claimed[2:])
    assert len(taken) == 5
    sent = [m["id"] for m in drain()]
    ids = {r.run_id: r.celery_task_id for r in claimed}
    # only the held write's two messages went out twice
    assert sorted(sent) == sorted(
        [ids[i] for i in first] * 2 + [ids[r.run_id] for r in claimed[2:]]
    )


def test_a_database_error_while_confirming_claims_again_is_not_taken_for_the_broker(
    broker_app: Any, clock: FakeClock
) -> None:
    """The second confirmation's database error ends the dispatch as the first one's does:
    the runs not yet out stay claimed, and the broker is not reported out of reach."""
    from django.db import OperationalError

    for i in range(3):
        interval_task(f"t{i}", 10, anchor=T0, next_slot_at=T0)
    nodes.register("slow", T0)
    claimed = claimer_for().claim(T0, "slow").runs
    dispatcher = Dispatcher(broker_app, clock, batch_size=1)
    write, confirm = dispatcher._publish_batch, dispatcher._still_owned

    def slow_write(runs: Any, *args: Any) -> None:
        write(runs, *args)
        clock.advance(40 * S)

    def confirm_once(runs: Any, result: Any) -> Any:
        if result.published:
            raise OperationalError("server closed the connection unexpectedly")
        return confirm(runs, result)

    dispatcher._publish_batch = slow_write  # type: ignore[method-assign]
    dispatcher._still_owned = confirm_once  # type: ignore[method-assign]
    with pytest.raises(OperationalError):
        dispatcher.dispatch(claimed)
    assert dispatcher.broker_down is None
    assert len(drain()) == 1
    assert Run.objects.filter(status=RunStatus.CLAIMED).count() == 3


def test_a_node_marked_dead_re_registers_at_its_next_heartbeat(
    scheduler: DriftSafeScheduler, clock: FakeClock
) -> None:
    scheduler.run_round()
    clock.advance(60 * S)
    nodes.mark_dead(clock.now(), timedelta(seconds=30), "peer")
    scheduler._next_heartbeat = 0.0
    scheduler.run_round()
    node = nodes.BeatNode.objects.get(node_id=scheduler.node_id)
    assert node.stopped_at is None and node.last_heartbeat_at == clock.now()


# -- partial failures stay partial -------------------------------------------------------------


def test_outbox_republishes_the_message_captured_at_claim_time(
    broker_app: Any, clock: FakeClock
) -> None:
    task = interval_task("t", 10, anchor=T0, next_slot_at=T0, args=[1, 1], queue="")
    claimed = claimer_for().claim(T0, "crashed").runs  # the beat died before publishing
    edited = PeriodicTask.objects.get(pk=task.pk)
    edited.args = [9, 9]
    edited.save()
    edited.delete()
    clock.advance(31 * S)
    taken = reclaim_stale(clock.now(), "peer", lease=timedelta(seconds=30))
    Dispatcher(broker_app, clock).dispatch(taken)
    sent = drain()
    assert [(m["id"], m["args"]) for m in sent] == [(claimed[0].celery_task_id, [1, 1])]


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        ({"options": {"headers": {"id": "forged-id", "task": "exp.danger"}}}, "must not set id"),
        ({"options": {"headers": {"compression": "zlib"}}}, "must not set compression"),
        ({"options": {"task_id": "forged-id"}}, "options: task_id"),
        ({"options": {"serializer": "pickle"}}, "options: serializer"),
        ({"options": {"link": {"task": "exp.danger"}}}, "options: link"),
        ({"options": {"queue": 5}}, "queue"),
        ({"options": {"priority": "high"}}, "priority"),
        ({"args": "abc"}, "args: must be a JSON list"),
        ({"kwargs": [1]}, "kwargs: must be a JSON object"),
    ],
    ids=lambda v: str(v)[:30],
)
def test_the_outbox_fails_a_captured_message_rewritten_behind_its_back(
    broker_app: Any, clock: FakeClock, message: dict[str, Any], reason: str
) -> None:
    """A claimed run's captured message is a stored value too: one that would set a
    reserved header or an option outside the task's publish fields is recorded failed with
    the reason, never published, and the other runs go out."""
    bad = interval_task("bad", 10, anchor=T0, next_slot_at=T0, task="exp.safe")
    good = interval_task("good", 10, anchor=T0, next_slot_at=T0)
    claimer_for().claim(T0, "crashed")  # the beat died before publishing
    run = Run.objects.get(periodic_task=bad)
    Run.objects.filter(pk=run.pk).update(message={**run.message, **message})
    clock.advance(31 * S)
    taken = reclaim_stale(clock.now(), "peer", lease=timedelta(seconds=30))
    result = Dispatcher(broker_app, clock).dispatch(taken)
    assert list(result.failed) == [run.pk]
    assert [m["task"] for m in drain()] == ["tests.add"]
    run.refresh_from_db()
    assert run.status == RunStatus.FAILED and reason in run.error, run.error
    assert run.error.startswith("the message captured at claim time cannot be published")
    assert Run.objects.get(periodic_task=good).status == RunStatus.DISPATCHED


@pytest.fixture
def amqp_app(settings: Any) -> Iterator[tuple[Any, str, str]]:
    """A Celery app on RabbitMQ with publisher confirms, and two queues: one that takes
    messages and one that refuses every message (``x-max-length`` 0, ``reject-publish``).
    Messages do not expire (the fake clock lies months back: RabbitMQ would drop them)."""
    from celery import Celery
    from kombu import Queue

    settings.DRIFTSAFE = {**settings.DRIFTSAFE, "RUN_EXPIRES_SECONDS": None}
    unique = uuid.uuid4().hex[:8]
    good, refusing = f"ok-{unique}", f"full-{unique}"
    app = Celery("driftsafe-amqp", broker=rabbitmq_url(), set_as_current=False)
    app.conf.broker_transport_options = {"confirm_publish": True}
    app.conf.broker_connection_retry_on_startup = False
    app.conf.task_queues = [
        Queue(good),
        Queue(refusing, queue_arguments={"x-max-length": 0, "x-overflow": "reject-publish"}),
    ]
    app.conf.task_default_queue = good
    app.conf.task_routes = {"refused.*": {"queue": refusing}}
    yield app, good, refusing
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        for name in (good, refusing):
            channel.queue_delete(name)
    app.close()


def _amqp_count(app: Any, queue: str) -> int:
    with app.connection_for_write() as conn:
        return int(conn.default_channel.queue_declare(queue, passive=True).message_count)


def test_a_message_the_broker_refuses_is_retried_alone_with_backoff(
    amqp_app: tuple[Any, str, str], clock: FakeClock
) -> None:
    app, good, _ = amqp_app
    interval_task("a", 60, anchor=T0, next_slot_at=T0)
    refused = interval_task("refused", 60, anchor=T0, next_slot_at=T0, task="refused.job")
    interval_task("b", 60, anchor=T0, next_slot_at=T0)
    nodes.register("n1", T0)
    result = Dispatcher(app, clock).dispatch(claimer_for().claim(T0, "n1").runs)
    run = Run.objects.get(periodic_task=refused)
    assert sorted(result.refused) == [run.pk] and len(result.published) == 2
    assert _amqp_count(app, good) == 2
    assert run.status == RunStatus.CLAIMED and run.retry_at == T0 + 2 * S
    assert "refused" in run.error and "Nack" in run.error, run.error
    # not before its retry_at, then once more, with a longer wait
    assert reclaim_stale(T0 + S, "n1", lease=timedelta(seconds=30)) == []
    clock.advance(2 * S)
    again = reclaim_stale(clock.now(), "n1", lease=timedelta(seconds=30))
    assert [r.run_id for r in again] == [run.pk]
    Dispatcher(app, clock).dispatch(again)
    run.refresh_from_db()
    assert run.dispatch_attempts == 2 and run.retry_at == clock.now() + 4 * S
    assert _amqp_count(app, good) == 2  # the others were not published again


def test_after_the_last_attempt_a_refused_run_is_recorded_failed(
    amqp_app: tuple[Any, str, str], clock: FakeClock
) -> None:
    from celery_driftsafe.publish.dispatcher import MAX_PUBLISH_ATTEMPTS

    app, _, _ = amqp_app
    task = interval_task("refused", 60, anchor=T0, next_slot_at=T0, task="refused.job")
    nodes.register("n1", T0)
    runs = claimer_for().claim(T0, "n1").runs
    Run.objects.filter(periodic_task=task).update(dispatch_attempts=MAX_PUBLISH_ATTEMPTS)
    runs = [type(r)(**{**r.__dict__, "dispatch_attempts": MAX_PUBLISH_ATTEMPTS}) for r in runs]
    Dispatcher(app, clock).dispatch(runs)
    run = Run.objects.get(periodic_task=task)
    assert run.status == RunStatus.FAILED and f"{MAX_PUBLISH_ATTEMPTS} times" in run.error


# -- no run stays dispatched forever -----------------------------------------------------------


def test_runs_past_their_expiry_are_recorded_expired(
    scheduler: DriftSafeScheduler, clock: FakeClock
) -> None:
    task = interval_task("t", 60, anchor=T0, next_slot_at=T0, expires_seconds=30.0)
    scheduler.run_round()
    message = drain()[0]
    run = Run.objects.get(periodic_task=task)
    assert run.expires_at == T0 + 30 * S and message["expires"] == (T0 + 30 * S).isoformat()
    lease = timedelta(seconds=30)
    assert reconcile(T0 + 59 * S, lease=lease).expired == []  # a worker may still take it
    assert reconcile(T0 + 61 * S, lease=lease).expired == [run.pk]
    run.refresh_from_db()
    assert run.status == RunStatus.EXPIRED and "expiry" in run.error


def test_a_started_run_whose_worker_is_gone_is_recorded_failed(clock: FakeClock) -> None:
    task = interval_task("t", 60, anchor=T0)
    run = Run.objects.create(
        periodic_task=task,
        task_name="tests.add",
        slot=T0,
        status=RunStatus.STARTED,
        started_at=T0,
        claimed_at=T0,
    )
    lease = timedelta(seconds=30)
    assert reconcile(T0 + 10 * S, lease=lease).lost == []  # not past STUCK_RUN_SECONDS
    assert reconcile(T0 + timedelta(hours=2), lease=lease).lost == [run.pk]
    run.refresh_from_db()
    assert run.status == RunStatus.FAILED and run.error.startswith("worker lost")
    assert run.fencing_token > 0  # a paused worker's late outcome is refused


def test_the_admin_lists_runs_without_an_outcome_under_needs_attention(
    admin_client: Any,
) -> None:
    from django.urls import reverse

    from celery_driftsafe.definitions.changes import authority_now

    now = authority_now()
    task = interval_task("t", 60, anchor=T0)
    old = Run.objects.create(
        periodic_task=task,
        task_name="tests.add",
        slot=T0,
        status=RunStatus.DISPATCHED,
        claimed_at=now - timedelta(hours=2),
        celery_task_id="old-and-silent",
    )
    Run.objects.create(
        periodic_task=task,
        task_name="tests.add",
        slot=T0 + S,
        status=RunStatus.DISPATCHED,
        claimed_at=now,
        celery_task_id="fresh-one",
    )
    page = admin_client.get(
        reverse("admin:celery_driftsafe_run_changelist"), {"attention": "stuck"}
    )
    assert page.status_code == 200
    listed = list(page.context["cl"].result_list)
    assert [r.pk for r in listed] == [old.pk]


def test_an_unexpected_error_in_a_round_is_logged_once_and_the_beat_carries_on(
    scheduler: DriftSafeScheduler,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    interval_task("t", 1, anchor=T0, next_slot_at=T0)
    real_claim = scheduler.claimer.claim
    failures = iter([True, True, False])

    def sometimes_broken(now: datetime, node_id: str, busy_since: datetime | None = None) -> Any:
        if next(failures):
            raise RuntimeError("a bug nobody foresaw")
        return real_claim(now, node_id, busy_since)

    monkeypatch.setattr(scheduler.claimer, "claim", sometimes_broken)
    waits = [scheduler._guarded_round() for _ in range(3)]  # what tick() does, minus the wait
    assert waits[0] > 0 and waits[1] > 0  # backed off, did not raise
    assert len([r for r in caplog.records if "failed unexpectedly" in r.getMessage()]) == 1
    assert len(drain()) == 1  # the third round claimed and published


def test_a_live_beats_claims_are_not_taken_over_by_lease_alone(clock: FakeClock) -> None:
    interval_task("t", 10, anchor=T0, next_slot_at=T0)
    nodes.register("slow", T0)
    claimed = claimer_for().claim(T0, "slow").runs  # publishing a huge batch, say
    lease, dead_after = timedelta(seconds=30), timedelta(seconds=30)
    clock.advance(40 * S)
    nodes.heartbeat("slow", clock.now() - 5 * S)  # it still heartbeats
    assert reclaim_stale(clock.now(), "peer", lease=lease, dead_after=dead_after) == []
    # its own outbox pass may retry it (the broker was away, say) ...
    mine = reclaim_stale(clock.now(), "slow", lease=lease, dead_after=dead_after)
    assert [r.run_id for r in mine] == [claimed[0].run_id]
    # ... and once its heartbeat is older than dead_after, anyone may
    Run.objects.update(claimed_at=T0)
    clock.advance(60 * S)
    taken = reclaim_stale(clock.now(), "peer", lease=lease, dead_after=dead_after)
    assert [r.run_id for r in taken] == [claimed[0].run_id]


def test_arguments_that_do_not_fit_a_registered_task_fail_the_run_and_disable_the_task(
    scheduler: DriftSafeScheduler, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Celery checks a registered task's arguments when it publishes; retrying cannot help.
    A row changed behind save() (which checks them) fails the slot that meets it, and the task
    is disabled with the reason, naming the signature, as other rows the beat cannot fire are:
    its later slots are not claimed to fail one by one."""
    bad = interval_task("bad", 10, anchor=T0, next_slot_at=T0, args=[1, 2, 3])
    interval_task("good", 10, anchor=T0, next_slot_at=T0)
    scheduler.run_round()
    assert len(drain()) == 1
    run = Run.objects.get(periodic_task=bad)
    assert run.status == RunStatus.FAILED and "signature" in run.error and run.retry_at is None
    bad.refresh_from_db()
    assert not bad.enabled and bad.next_slot_at is None
    assert bad.disabled_reason.startswith("disabled by the scheduler: tests.add(x, y)")
    assert "takes 2 positional arguments but 3 were given" in bad.disabled_reason
    (logged,) = [r for r in caplog.records if getattr(r, "action", "") == "disable"]
    assert logged.task == "bad" and logged.levelname == "ERROR"
    for _ in range(3):  # later slots: the good task fires, the bad one claims nothing
        clock.advance(10 * S)
        scheduler.run_round()
    assert len(drain()) == 3
    assert Run.objects.filter(periodic_task=bad).count() == 1


def test_a_row_corrected_before_its_failed_slot_is_recorded_stays_enabled(
    scheduler: DriftSafeScheduler,
) -> None:
    """The beat disables a task for its arguments only while its row still holds arguments
    the task cannot take (read again under a lock): one corrected meanwhile keeps firing."""
    bad = interval_task("bad", 10, anchor=T0, next_slot_at=T0, args=[1, 2, 3])
    (claimed,) = claimer_for().claim(T0, scheduler.node_id).runs
    PeriodicTask.objects.filter(pk=bad.pk).update(args=[1, 2])  # corrected behind save()
    scheduler.dispatcher.dispatch([claimed])
    assert Run.objects.get(periodic_task=bad).status == RunStatus.FAILED  # as it was captured
    bad.refresh_from_db()
    assert bad.enabled and bad.disabled_reason == ""
