"""The claim transaction, against the real database: one conformance suite, every claimer.

SQLite runs the compare-and-swap claimer; PostgreSQL runs both (SKIP LOCKED and CAS).
Races are real: threads with their own connections claim the same due tasks at once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from contextlib import nullcontext
from datetime import UTC, date, datetime, timedelta, timezone
from typing import Any

import pytest
from django.conf import settings
from django.db import connection, transaction

from celery_driftsafe.claim.claimers import (
    Claimer,
    CompareAndSwapClaimer,
    SkipLockedClaimer,
    claimer_for,
)
from celery_driftsafe.claim.outbox import celery_task_id, reclaim_stale
from celery_driftsafe.core.schedules import Solar
from celery_driftsafe.models import PeriodicTask, Run, RunStatus
from celery_driftsafe.store.clock import authority_clock
from tests.skip_guard import configuration
from tests.support import T0
from tests.support.factories import (
    at_once,
    crontab_task,
    interval_task,
    many_interval_tasks,
    solar_task,
)

S = timedelta(seconds=1)


#: The ``make_claimer`` fixture (tests/claim/conftest.py).
MakeClaimer = Callable[..., Claimer]


@pytest.mark.django_db(transaction=True)
class TestClaimContract:
    def test_claims_due_task_once_and_advances(self, make_claimer: MakeClaimer) -> None:
        task = interval_task("t", 10, anchor=T0, next_slot_at=T0)
        result = make_claimer().claim(T0, "node-a")
        assert [(r.periodic_task_id, r.slot) for r in result.runs] == [(task.pk, T0)]
        run = Run.objects.get()
        assert run.status == RunStatus.CLAIMED and run.claimed_by == "node-a"
        assert run.celery_task_id == celery_task_id(task.pk, T0) == result.runs[0].celery_task_id
        task.refresh_from_db()
        assert task.next_slot_at == T0 + 10 * S
        assert task.last_slot_at == T0 and task.run_count == 1
        # claiming again at the same instant finds nothing
        assert make_claimer().claim(T0, "node-b").runs == []

    def test_boundary_slot_equal_to_now_is_due_one_microsecond_before_is_not(
        self, make_claimer: MakeClaimer
    ) -> None:
        interval_task("t", 10, anchor=T0, next_slot_at=T0)
        assert make_claimer().claim(T0 - timedelta(microseconds=1), "n").runs == []
        assert len(make_claimer().claim(T0, "n").runs) == 1

    def test_disabled_and_future_tasks_are_not_loaded(self, make_claimer: MakeClaimer) -> None:
        interval_task("off", 10, anchor=T0, next_slot_at=T0, enabled=False)
        interval_task("later", 10, anchor=T0, next_slot_at=T0 + 5 * S)
        result = make_claimer().claim(T0, "n")
        assert result.runs == [] and result.tasks_seen == 0

    def test_batch_size_bounds_a_round_oldest_first(self, make_claimer: MakeClaimer) -> None:
        for i in range(5):
            interval_task(f"t{i}", 60, anchor=T0 - i * S, next_slot_at=T0 - i * S)
        first = make_claimer(batch_size=3).claim(T0, "n")
        assert [r.slot for r in first.runs] == [T0 - 4 * S, T0 - 3 * S, T0 - 2 * S]
        second = make_claimer(batch_size=3).claim(T0, "n")
        assert len(second.runs) == 2

    def test_invalid_stored_schedule_disables_task_with_reason(
        self, make_claimer: MakeClaimer
    ) -> None:
        good = interval_task("good", 10, anchor=T0, next_slot_at=T0)
        bad = crontab_task("bad", "*/5 * * * *", next_slot_at=T0)
        PeriodicTask.objects.filter(pk=bad.pk).update(crontab_minute="99")  # edited in SQL
        result = make_claimer().claim(T0, "n")
        assert result.disabled == ["bad"]
        assert [r.periodic_task_id for r in result.runs] == [good.pk]
        bad.refresh_from_db()
        assert not bad.enabled and bad.next_slot_at is None
        assert "minute" in bad.disabled_reason and "99" in bad.disabled_reason

    def test_solar_task_fires_at_its_slot_and_skips_the_polar_night(
        self, make_claimer: MakeClaimer
    ) -> None:
        sunrise = Solar("sunrise", 69.6492, 18.9553)  # Tromso
        last = sunrise.next_after(datetime(2024, 11, 26, tzinfo=UTC))
        assert last is not None
        task = solar_task("tromso", "sunrise", 69.6492, 18.9553, next_slot_at=last)
        bad = solar_task("bad", "sunset", 52.5, 13.4, next_slot_at=last)
        PeriodicTask.objects.filter(pk=bad.pk).update(solar_latitude=95)  # edited in SQL
        assert make_claimer().claim(last - timedelta(microseconds=1), "n").runs == []
        result = make_claimer().claim(last + S, "n")
        assert [(r.periodic_task_id, r.slot) for r in result.runs] == [(task.pk, last)]
        assert result.disabled == ["bad"]
        task.refresh_from_db()
        assert task.next_slot_at == sunrise.next_after(last)
        assert task.next_slot_at is not None and task.next_slot_at.date() == date(2025, 1, 15)
        bad.refresh_from_db()
        assert not bad.enabled and "solar_latitude" in bad.disabled_reason

    def test_misfire_records_missed_rows(self, make_claimer: MakeClaimer) -> None:
        interval_task("hourly", 3600, anchor=T0, next_slot_at=T0, misfire_policy="fire_once")
        now = T0 + timedelta(hours=3, minutes=10)
        result = make_claimer().claim(now, "n")
        assert [r.slot for r in result.runs] == [T0 + timedelta(hours=3)]
        statuses = Counter(Run.objects.values_list("status", flat=True))
        assert statuses == {"claimed": 1, "missed": 3}

    def test_a_day_of_missed_slots_is_one_span_row(self, make_claimer: MakeClaimer) -> None:
        """Recovering from a day down writes two rows per task (the catch-up run and one span
        of missed slots with its first, last and count), not one row per missed slot."""
        tasks = [interval_task(f"m{i}", 60, anchor=T0, next_slot_at=T0) for i in range(3)]
        now = T0 + timedelta(days=1, seconds=90)  # grace 60 s: the latest slot is still on time
        result = make_claimer().claim(now, "n")
        assert sorted(r.slot for r in result.runs) == [T0 + timedelta(days=1, minutes=1)] * 3
        assert result.missed == 3 * 1441
        for task in tasks:
            rows = Run.objects.filter(periodic_task=task)
            assert rows.count() == 2
            span = rows.get(status="missed")
            assert (span.slot, span.missed_until, span.missed_count) == (
                T0,
                T0 + timedelta(days=1),
                1441,
            )
            assert "1441 slots from" in span.error

    def test_a_slot_late_because_the_beats_were_busy_fires(self, make_claimer: MakeClaimer) -> None:
        interval_task(
            "late", 60, anchor=T0, next_slot_at=T0, misfire_policy="skip", misfire_grace_seconds=5
        )
        now = T0 + timedelta(seconds=50)
        result = make_claimer().claim(now, "n", busy_since=T0 - timedelta(seconds=10))
        assert [r.slot for r in result.runs] == [T0] and result.late_from_load == 1
        assert result.missed == 0 and result.oldest_slot == T0
        interval_task(
            "down", 60, anchor=T0, next_slot_at=T0, misfire_policy="skip", misfire_grace_seconds=5
        )
        result = make_claimer().claim(now, "n", busy_since=T0 + timedelta(seconds=20))
        assert result.runs == [] and result.missed == 1

    def test_after_downtime_fire_once_claims_one_run(self, make_claimer: MakeClaimer) -> None:
        """Tasks every 3 s, the beats down for 8 minutes, then a beat's first round (its
        stretch of claiming begins now): fire_once claims one run, under the latest slot, and
        one span row for the other 160, 20 of them within the grace; fire_all claims its
        latest FIRE_ALL_MAX (100). A task whose slots fell due while the beats were claiming
        (a slow round) still fires every one of them."""
        once = interval_task("once", 3, anchor=T0, next_slot_at=T0)  # the default policy
        every = interval_task("all", 3, anchor=T0, next_slot_at=T0, misfire_policy="fire_all")
        now = T0 + timedelta(minutes=8, seconds=1)
        result = make_claimer().claim(now, "n", busy_since=now)
        slots = Counter[int]()
        for run in result.runs:
            slots[run.periodic_task_id] += 1
        assert slots == {once.pk: 1, every.pk: 100}
        latest = T0 + timedelta(minutes=8)
        assert [r.slot for r in result.runs if r.periodic_task_id == once.pk] == [latest]
        spans = {
            task: (span.slot, span.missed_until, span.missed_count)
            for task, span in (
                (t, Run.objects.get(periodic_task=t, status="missed")) for t in (once, every)
            )
        }
        assert spans == {
            once: (T0, latest - 3 * S, 160),
            every: (T0, latest - 300 * S, 61),
        }
        assert result.missed == 160 + 61
        slow = interval_task("slow", 1, anchor=now, next_slot_at=now)
        later = now + 2.5 * S
        result = make_claimer().claim(later, "n", busy_since=now - timedelta(hours=1))
        assert [r.slot for r in result.runs if r.periodic_task_id == slow.pk] == [
            now,
            now + S,
            now + 2 * S,
        ]
        assert not Run.objects.filter(periodic_task=slow, status="missed").exists()

    def test_race_many_threads_one_winner_per_slot(self, make_claimer: MakeClaimer) -> None:
        tasks = [interval_task(f"t{i}", 5, anchor=T0, next_slot_at=T0) for i in range(30)]

        def worker(n: int) -> list[tuple[int | None, datetime | None]]:
            claimed = []
            for now in (T0, T0 + 5 * S, T0 + 10 * S):
                result = make_claimer(batch_size=7).claim(now, f"node-{n}")
                claimed.extend((r.periodic_task_id, r.slot) for r in result.runs)
                while result.tasks_seen:
                    result = make_claimer(batch_size=7).claim(now, f"node-{n}")
                    claimed.extend((r.periodic_task_id, r.slot) for r in result.runs)
            return claimed

        claimed = [slot for slots in at_once(6, worker) for slot in slots]
        counts = Counter(claimed)
        assert max(counts.values()) == 1, "a slot was claimed twice"
        expected = {(t.pk, T0 + k * 5 * S) for t in tasks for k in range(3)}
        assert set(counts) == expected, "a slot was lost"
        assert Run.objects.count() == len(expected)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("edit", ["save", "queryset update"])
@pytest.mark.usefixtures("cas_supported")
def test_an_edit_made_while_the_cas_claimer_plans_is_claimed_with_the_new_schedule(
    edit: str,
) -> None:
    """The compare-and-swap claimer reads due tasks without locks, then plans. An edit that
    commits in between and keeps the next slot (hourly to every two hours, at an even hour)
    used to let the swap succeed with the plan of the row as read: the task then fired an hour
    later, by the old schedule, once. Now the swap also compares ``changed_at``, which saves
    and queryset updates of anything but the claim's state stamp: the round loses, and the
    next one plans from the edited row."""
    now = authority_clock().now()
    even_hour = now.replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
    even_hour += timedelta(hours=even_hour.hour % 2)
    task = crontab_task("edited", "0 * * * *", next_slot_at=even_hour)

    class EditedWhilePlanning(CompareAndSwapClaimer):
        def _plans(self, tasks: Any, *args: Any) -> Any:
            if edit == "save":
                row = PeriodicTask.objects.get(pk=task.pk)
                row.crontab_hour = "*/2"
                row.save()
            else:  # a bulk edit: it computes the next slot itself (changes.reschedule)
                PeriodicTask.objects.filter(pk=task.pk).update(crontab_hour="*/2")
            return super()._plans(tasks, *args)

    lost = EditedWhilePlanning().claim(even_hour, "node-a")
    task.refresh_from_db()
    assert task.crontab_hour == "*/2" and task.next_slot_at == even_hour, "the edit kept the slot"
    assert lost.runs == [] and not Run.objects.exists()
    won = CompareAndSwapClaimer().claim(even_hour, "node-a")
    assert [r.slot for r in won.runs] == [even_hour]
    task.refresh_from_db()
    assert task.next_slot_at == even_hour + timedelta(hours=2)


@pytest.mark.skipif(
    connection.vendor != "sqlite", reason=configuration("only SQLite stores instants as text")
)
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("column", ["next_slot_at", "changed_at"])
def test_the_cas_claimer_wins_a_task_whose_instants_raw_sql_spelled_otherwise(column: str) -> None:
    """A raw SQL write on SQLite may store an instant as ``2026-03-01T12:00:00`` where Django
    writes ``2026-03-01 12:00:00``; Django reads both. The swap compared the column with
    Django's spelling of the value read, lost every round, and the task never fired. It now
    compares the text as stored, and the claim writes Django's spelling back."""
    task = interval_task("spelled", 10, anchor=T0, next_slot_at=T0)
    table = PeriodicTask._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE {table} SET {column} = replace({column}, ' ', 'T')")
        cursor.execute(f"SELECT CAST({column} AS text) FROM {table}")
        assert "T" in cursor.fetchone()[0]
    result = CompareAndSwapClaimer().claim(T0, "node-a")
    assert [r.slot for r in result.runs] == [T0]
    task.refresh_from_db()
    assert task.next_slot_at == T0 + 10 * S
    assert CompareAndSwapClaimer().claim(T0 + 10 * S, "node-a").runs, "and the next slot"


@pytest.mark.skipif(
    connection.vendor != "sqlite", reason=configuration("only SQLite stores instants as text")
)
@pytest.mark.django_db(transaction=True)
def test_a_due_instant_raw_sql_spelled_with_a_t_falls_due_on_time() -> None:
    """On SQLite ``2026-03-01T12:00:00`` (a raw SQL write) sorts after every instant of that
    day as Django spells them (a space), so compared with the claim's ``now`` as text the task
    fell due only at midnight. It falls due on time, and is written back in Django's spelling."""
    interval_task("t-spelled", 60, anchor=T0, next_slot_at=T0)
    table = PeriodicTask._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {table} SET due_at = replace(due_at, ' ', 'T'), "
            "next_slot_at = replace(next_slot_at, ' ', 'T')"
        )
        cursor.execute(f"SELECT CAST(due_at AS text) FROM {table}")
        assert cursor.fetchone()[0].startswith("2026-03-01T12:00:00")
    assert CompareAndSwapClaimer().claim(T0 - S, "node-a").runs == [], "not early"
    assert [r.slot for r in CompareAndSwapClaimer().claim(T0 + 5 * S, "node-a").runs] == [T0]
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT CAST(due_at AS text) FROM {table}")
        assert cursor.fetchone()[0].startswith("2026-03-01 12:01:00")


@pytest.mark.django_db
def test_only_updates_of_the_claims_own_state_leave_changed_at_as_it_was() -> None:
    task = interval_task("stamped", 60, anchor=T0, next_slot_at=T0)
    rows = PeriodicTask.objects.filter(pk=task.pk)
    rows.update(next_slot_at=T0 + S, last_slot_at=T0, run_count=1)
    assert rows.get().changed_at == task.changed_at
    rows.update(args=[5, 6])
    assert rows.get().changed_at > task.changed_at


def _isolation_of_a_new_connection() -> tuple[str, str]:
    """The isolation levels statements run at on a new connection (a new thread's): in a
    transaction and outside one."""

    def read(n: int) -> tuple[str, str]:
        levels = []
        for atomic in (transaction.atomic, nullcontext):
            with atomic(), connection.cursor() as cursor:
                if connection.vendor == "postgresql":
                    cursor.execute("SHOW transaction_isolation")
                elif connection.mysql_is_mariadb:  # type: ignore[attr-defined]
                    cursor.execute("SELECT @@tx_isolation")  # before 11.1 the only name
                else:
                    cursor.execute("SELECT @@transaction_isolation")
                levels.append(cursor.fetchone()[-1].lower().replace("-", " "))
        return levels[0], levels[1]

    inside, outside = at_once(1, read)[0]
    return inside, outside


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("level", ["serializable", "repeatable read"])
@pytest.mark.parametrize("where", ["options", "server"])
def test_beats_claim_at_read_committed_whatever_the_project_configures(
    make_claimer: MakeClaimer, level: str, where: str
) -> None:
    """A project whose database runs at SERIALIZABLE or REPEATABLE READ, set in ``DATABASES``
    (``OPTIONS["isolation_level"]``) or as the server's default for the database: racing
    claims there meet "could not serialize access due to concurrent update" (PostgreSQL),
    which a beat takes for an outage. A beat's process and its claim process set every
    connection to READ COMMITTED; the race then has one winner a slot."""
    from django.db.backends.signals import connection_created

    from celery_driftsafe.claim.helper_main import _set_up
    from celery_driftsafe.store.connections import read_committed_connections

    if connection.vendor == "sqlite":
        pytest.skip(configuration("SQLite has no isolation levels"))
    if where == "server" and connection.vendor != "postgresql":
        pytest.skip(
            configuration("a server-wide default needs MySQL's SET GLOBAL, shared by every test")
        )
    # An earlier test's beat in this process may have set it up already: start without it.
    connection_created.disconnect(dispatch_uid="celery_driftsafe.read_committed")
    rc = "read committed"
    options = connection.settings_dict.setdefault("OPTIONS", {})
    saved = dict(options)
    database = connection.ops.quote_name(connection.settings_dict["NAME"])
    if where == "server":
        with connection.cursor() as cursor:
            cursor.execute(
                f"ALTER DATABASE {database} SET default_transaction_isolation = %s", [level]
            )
    elif connection.vendor == "postgresql":
        from psycopg import IsolationLevel

        options["isolation_level"] = IsolationLevel[level.upper().replace(" ", "_")]
    else:
        options["isolation_level"] = level
    # OPTIONS set the level of transactions only; a server default, of every statement.
    project = (level, level if where == "server" or connection.vendor == "mysql" else rc)
    try:
        assert _isolation_of_a_new_connection() == project
        read_committed_connections()  # what a beat's set-up does
        assert _isolation_of_a_new_connection() == (rc, rc)
        connection_created.disconnect(dispatch_uid="celery_driftsafe.read_committed")
        assert _isolation_of_a_new_connection() == project
        internals = settings.DRIFTSAFE_INTERNALS
        _set_up("default", connection.settings_dict, (settings.DRIFTSAFE, internals), None)
        assert _isolation_of_a_new_connection() == (rc, rc)
        TestClaimContract().test_race_many_threads_one_winner_per_slot(make_claimer)
    finally:
        connection_created.disconnect(dispatch_uid="celery_driftsafe.read_committed")
        options.clear()
        options.update(saved)
        if where == "server":
            with connection.cursor() as cursor:
                cursor.execute(f"ALTER DATABASE {database} RESET default_transaction_isolation")


@pytest.mark.django_db(transaction=True)
def test_a_broken_open_connection_does_not_stop_a_beats_set_up() -> None:
    """An open connection that no longer works (a socket closed under it, as after a fork)
    is closed by the set-up, not raised from it; the next statement opens a new one at READ
    COMMITTED."""
    from django.db.backends.signals import connection_created

    from celery_driftsafe.store.connections import read_committed_connections

    if connection.vendor != "postgresql":
        pytest.skip(
            configuration("elsewhere a connection Django set up at READ COMMITTED is left as it is")
        )
    connection.ensure_connection()
    connection.connection.close()  # the driver's: Django still holds it as open
    try:
        read_committed_connections()
        assert connection.connection is None
        assert PeriodicTask.objects.count() == 0  # a new connection
    finally:
        connection_created.disconnect(dispatch_uid="celery_driftsafe.read_committed")


@pytest.mark.django_db(transaction=True)
def test_claimer_for_picks_skip_locked_where_available() -> None:
    claimer = claimer_for()
    skip_locked = connection.features.has_select_for_update_skip_locked
    expected = SkipLockedClaimer if skip_locked else CompareAndSwapClaimer
    assert skip_locked == (connection.vendor in ("postgresql", "mysql"))
    assert type(claimer) is expected


@pytest.mark.django_db(transaction=True)
def test_claim_round_query_count_does_not_grow_with_due_tasks(
    django_assert_max_num_queries: Any,
) -> None:
    for i in range(200):
        interval_task(f"t{i}", 60, anchor=T0, next_slot_at=T0)
    claimer = claimer_for()
    # SELECT, INSERT, UPDATE (+ savepoint/transaction statements); SQLite splits big bulk
    # writes by its variable limit, which is per 999 parameters, not per task.
    limit = 8 if connection.vendor == "postgresql" else 40
    with django_assert_max_num_queries(limit):
        result = claimer.claim(T0, "n")
    assert len(result.runs) == 200


@pytest.mark.django_db(transaction=True)
def test_stale_claims_are_reclaimed_once_with_same_task_id() -> None:
    task = interval_task("t", 10, anchor=T0, next_slot_at=T0)
    claimer_for().claim(T0, "dead-node")
    lease = timedelta(seconds=30)
    assert reclaim_stale(T0 + 29 * S, "alive", lease=lease) == []
    # exactly at the lease boundary: not yet stale (claimed_at < now - lease is strict)
    assert reclaim_stale(T0 + 30 * S, "alive", lease=lease) == []
    taken = reclaim_stale(T0 + 31 * S, "alive", lease=lease)
    assert [r.celery_task_id for r in taken] == [celery_task_id(task.pk, T0)]
    assert reclaim_stale(T0 + 31 * S, "other", lease=lease) == []
    run = Run.objects.get()
    assert run.claimed_by == "alive" and run.dispatch_attempts == 2


@pytest.mark.django_db
def test_due_tasks_read_with_the_c_loader_equal_djangos_reading() -> None:
    """pg_loaders.load_models reads what ``list(queryset)`` reads (every field, each instant's
    tzinfo object included, JSON of every shape), with psycopg's C ``timestamptz`` loader on
    PostgreSQL in UTC and only on that cursor; elsewhere it is ``list(queryset)``."""
    import django
    from django.db import transaction

    from celery_driftsafe.store.loaders import _loader_for, _plain_instances, load_models

    instants = [
        datetime(2026, 3, 29, 0, 59, 59, 999999, tzinfo=UTC),
        datetime(1, 1, 2, tzinfo=UTC),
        datetime(9999, 12, 30, 23, 59, 59, tzinfo=UTC),
    ]
    for i, when in enumerate(instants):
        interval_task(f"probe-{i}", 60, anchor=instants[0], kwargs={"n": i, "s": "é"})
        # the ends of the calendar, past save()'s checks (which keep a task's runs inside it)
        PeriodicTask.objects.filter(name=f"probe-{i}").update(
            interval_anchor=when, next_slot_at=when, valid_until=when if i else None
        )
    # JSON of other shapes than the commonest ("[]", "{}"), written past save()'s checks
    PeriodicTask.objects.filter(name="probe-1").update(args=["x", 1.5, None], headers={"k": []})
    PeriodicTask.objects.filter(name="probe-2").update(kwargs="text", args=[{}])
    PeriodicTask.objects.filter(name="probe-0").update(args=[])
    with transaction.atomic():
        due = PeriodicTask.objects.order_by("id").select_for_update()
        loader = _loader_for(connection)
        ours = load_models(due)
        djangos = list(due)
    assert (loader is not None) == (connection.vendor == "postgresql")
    if loader is not None:
        assert "psycopg" in loader.__module__
        with connection.cursor() as cursor:  # the connection keeps Django's own loader
            assert cursor.cursor.adapters.get_loader(1184, 0).__module__.startswith("django")
    fields = [f.attname for f in PeriodicTask._meta.concrete_fields]
    if django.VERSION[:2] <= (5, 2):
        # built without from_db (a third of reading a task), its own addition included
        assert _plain_instances(PeriodicTask, tuple(fields))
    assert len(ours) == len(djangos) == 3
    for mine, theirs in zip(ours, djangos, strict=True):
        assert type(mine) is PeriodicTask and vars(mine).keys() == vars(theirs).keys()
        assert mine._switch_loaded == theirs._switch_loaded == (True, "")
        assert (mine._state.adding, mine._state.db) == (theirs._state.adding, theirs._state.db)
        for name in fields:
            a, b = getattr(mine, name), getattr(theirs, name)
            assert a == b and type(a) is type(b), name
            if isinstance(a, datetime):
                assert a.tzinfo is b.tzinfo is UTC, name


@pytest.mark.django_db
def test_due_tasks_reach_a_projects_post_init_receiver() -> None:
    """A project listening to ``post_init`` for the task model (a field tracker, say) sees
    every task the claim reads: the instances are then built by Django's ``from_db``."""
    from django.db import transaction
    from django.db.models.signals import post_init

    from celery_driftsafe.store.loaders import load_models

    for i in range(3):
        interval_task(f"probe-{i}", 60, anchor=T0, next_slot_at=T0)
    seen: list[int] = []

    def receiver(sender: Any, instance: PeriodicTask, **kwargs: Any) -> None:
        seen.append(instance.pk)

    post_init.connect(receiver, sender=PeriodicTask)
    try:
        with transaction.atomic():
            loaded = load_models(PeriodicTask.objects.order_by("id").select_for_update())
    finally:
        post_init.disconnect(receiver, sender=PeriodicTask)
    assert seen == [task.pk for task in loaded] and len(seen) == 3


def test_celery_task_id_is_a_version_8_uuid_led_by_the_slot() -> None:
    """The same (task, slot) gives the same id; the first 48 bits are the slot's Unix
    milliseconds, so ids sort by slot; the rest is SHA-1 of the task and the exact slot, so
    two tasks (or two slots within one millisecond) never share an id."""
    import hashlib
    import uuid

    namespace = uuid.UUID("6f1c2b0e-5d0a-4c55-9a43-3f2f0c1d7e11").bytes
    slots = [T0, T0 + timedelta(microseconds=1), T0 + timedelta(days=400, seconds=7)]
    ids = {}
    for pk in (1, 42, 99_999, 2**40):
        for slot in slots:
            value = uuid.UUID(celery_task_id(pk, slot))
            assert str(value) == celery_task_id(pk, slot)
            assert value.version == 8 and value.variant == uuid.RFC_4122
            assert value.int >> 80 == int(slot.timestamp() * 1000)
            digest = hashlib.sha1(namespace + f"{pk}:{slot.isoformat()}".encode()).digest()
            kept = (1 << 80) - 1 & ~((0xF000 << 64) | (0xC000 << 48))
            assert value.int & kept == int.from_bytes(digest[:10], "big") & kept
            ids[pk, slot] = str(value)
    assert len(set(ids.values())) == len(ids)
    for pk in (1, 42):
        in_order = [ids[pk, slot] for slot in (T0, slots[-1])]  # a millisecond or more apart
        assert in_order == sorted(in_order)  # as text, the order of the slots
        minutes = [celery_task_id(pk, T0 + timedelta(minutes=i)) for i in range(200)]
        assert minutes == sorted(minutes)
    before_1970 = datetime(1969, 7, 20, 20, 17, tzinfo=UTC)
    assert uuid.UUID(celery_task_id(1, before_1970)).int >> 80 == 0


def test_remembered_iso_texts_are_isoformat_in_every_zone() -> None:
    """iso_text keeps the texts of the instants a burst repeats, keyed by instant and offset:
    the same instant given in another zone after a UTC one still prints in its own zone (the
    two compare equal), and so does its run's task id; the store stays bounded."""
    from zoneinfo import ZoneInfo

    from celery_driftsafe.core import instants as _instants

    utc = datetime(2026, 3, 29, 0, 30, 0, 250, tzinfo=UTC)
    paris = utc.astimezone(ZoneInfo("Europe/Paris"))
    plus_one = utc.astimezone(timezone(timedelta(hours=1)))
    assert utc == paris == plus_one
    _instants._iso_texts.clear()
    paris_alone = celery_task_id(7, paris)  # nothing remembered yet
    for _ in range(2):  # once to remember, once to read back
        assert [_instants.iso_text(v) for v in (utc, paris, plus_one)] == [
            "2026-03-29T00:30:00.000250+00:00",
            "2026-03-29T01:30:00.000250+01:00",
            "2026-03-29T01:30:00.000250+01:00",
        ]
        assert celery_task_id(7, utc) != celery_task_id(7, paris) == paris_alone
    for i in range(_instants.ISO_TEXTS_KEPT + 10):
        instant = T0 + timedelta(seconds=i)
        assert _instants.iso_text(instant) == instant.isoformat()
    assert len(_instants._iso_texts) <= _instants.ISO_TEXTS_KEPT


@pytest.mark.django_db
def test_next_due_is_the_earliest_due_instant_of_an_enabled_task() -> None:
    """The first entry of the due index, as MIN(due_at) over enabled tasks: a disabled task
    and an enabled one with no due instant are not it; None when nothing is due ever."""
    from celery_driftsafe.claim.claimers import next_due

    assert next_due() is None
    interval_task("off", 60, anchor=T0, next_slot_at=T0, enabled=False)
    open_ended = interval_task("none", 60, anchor=T0, next_slot_at=T0 + S)
    PeriodicTask.objects.filter(pk=open_ended.pk).update(next_slot_at=None, due_at=None)
    assert next_due() is None
    interval_task("later", 60, anchor=T0, next_slot_at=T0 + 30 * S)
    interval_task("sooner", 60, anchor=T0, next_slot_at=T0 + 20 * S)
    assert next_due() == T0 + 20 * S


@pytest.mark.django_db(transaction=True)
def test_due_tasks_come_from_the_index_on_a_task_table_without_statistics() -> None:
    """With no planner statistics for the task table (autovacuum off, a restored dump, tasks
    created a moment ago), PostgreSQL planned a round's ``ORDER BY due_at, id LIMIT n FOR
    UPDATE SKIP LOCKED`` as a read of every due task and a sort; the claim, and building
    ahead, take them from the ``(enabled, due_at, id)`` index in order."""
    if connection.vendor != "postgresql":
        pytest.skip(configuration("a PostgreSQL planner setting"))
    table = PeriodicTask._meta.db_table
    with connection.cursor() as cursor:
        # 5,000 fresh rows cross autovacuum's threshold: its ANALYZE could write the statistics
        # back between the DELETE below and the EXPLAIN, and the precondition would fail.
        cursor.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = false)")
    try:
        _due_tasks_come_from_the_index(table)
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"ALTER TABLE {table} RESET (autovacuum_enabled)")


def _due_tasks_come_from_the_index(table: str) -> None:
    from celery_driftsafe.publish.prebuild import CHUNK, Prebuilder

    many_interval_tasks(5000, T0)
    with connection.cursor() as cursor:
        # No statistics: none of the columns', and the table's size unknown, as before its first
        # VACUUM or ANALYZE. The size that such a pass left behind (an earlier test's: 0 rows
        # on pages since filled, seen in CI) would make the planner count on one due row and
        # read the index for it, whatever the claim asks for.
        cursor.execute(f"DELETE FROM pg_statistic WHERE starelid = '{table}'::regclass")
        cursor.execute(
            "UPDATE pg_class SET reltuples = -1, relpages = 0, relallvisible = 0 "
            f"WHERE oid = '{table}'::regclass"
        )
    plans: list[str] = []

    def explain(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if sql.startswith("SELECT") and "ORDER BY" in sql and "LIMIT" in sql:
            with connection.cursor() as cursor:
                cursor.execute("EXPLAIN " + sql, params)
                plans.append("\n".join(row[0] for row in cursor.fetchall()))
        return execute(sql, params, many, context)

    claimer = SkipLockedClaimer(batch_size=100)
    with connection.execute_wrapper(explain), transaction.atomic():
        list(claimer._due(T0, lock=True))
    assert "Sort" in plans[-1], f"the table has statistics, so this test shows nothing:\n{plans}"
    plans.clear()
    with connection.execute_wrapper(explain):
        result = claimer.claim(T0, "n")
        fast = type(
            "Fast",
            (),
            {
                "active": lambda self: True,
                "prebuild": lambda *a: True,
                "has_template": lambda self, pk: False,
            },
        )()
        built = Prebuilder(fast, lambda task, slot: None).run(T0, budget=0.0)  # type: ignore[arg-type]
    assert len(result.runs) == 100 and built == CHUNK
    assert len(plans) == 2
    for plan in plans:
        assert "Sort" not in plan and "driftsafe_task_due_at_id" in plan, plan


@pytest.mark.django_db(transaction=True)
def test_the_insert_is_plain_until_a_slot_already_has_a_run(
    make_claimer: MakeClaimer, caplog: pytest.LogCaptureFixture
) -> None:
    """A batch goes as a plain insert (on PostgreSQL cheaper than ``ON CONFLICT``; never
    MySQL's ``INSERT IGNORE`` or SQLite's ``OR IGNORE``, which would also drop a row a
    constraint refuses); when one of its slots already has a run, the batch goes again
    skipping that row (PostgreSQL: ``ON CONFLICT DO NOTHING``; elsewhere the taken slot is
    looked up first), and the rest of the batch is claimed, nothing disabled."""
    from django.test.utils import CaptureQueriesContext

    free = [interval_task(f"free{i}", 10, anchor=T0, next_slot_at=T0) for i in range(3)]
    taken = interval_task("taken", 10, anchor=T0, next_slot_at=T0)
    Run.objects.create(periodic_task=taken, task_name="tests.add", slot=T0 + 10 * S)
    table = connection.ops.quote_name(Run._meta.db_table)
    postgresql = connection.vendor == "postgresql"

    def inserts(queries: CaptureQueriesContext) -> list[bool]:
        """For each insert of the run table: did the database skip taken slots itself?"""
        sqls = [q["sql"] for q in queries.captured_queries]
        assert not any("IGNORE" in sql.upper() for sql in sqls)
        return [
            "ON CONFLICT DO NOTHING" in sql
            for sql in sqls
            if sql.startswith((f"INSERT INTO {table}", f"INSERT  INTO {table}"))
        ]

    def rollbacks(queries: CaptureQueriesContext) -> int:
        return sum(q["sql"].startswith("ROLLBACK TO SAVEPOINT") for q in queries.captured_queries)

    with CaptureQueriesContext(connection) as first:
        result = make_claimer().claim(T0, "node-a")
    assert inserts(first) == [False] and rollbacks(first) == 0 and len(result.runs) == 4
    with CaptureQueriesContext(connection) as second, caplog.at_level("WARNING"):
        result = make_claimer().claim(T0 + 10 * S, "node-a")
    # The first insert was refused and rolled back to its savepoint (MySQL's driver records
    # no text for a refused statement), then the batch went again without the taken slot.
    assert rollbacks(second) == 1 and inserts(second)[-1:] == [postgresql]
    if postgresql:
        assert inserts(second) == [False, True]
    assert sorted(r.periodic_task_id for r in result.runs) == sorted(t.pk for t in free)
    assert all(r.run_id for r in result.runs)
    assert [r.getMessage() for r in caplog.records] == [
        f"slot {T0 + 10 * S} of taken already has a run; skipped (the task was saved or "
        "rescheduled onto a slot that fired)"
    ]  # the task named, nothing refused or disabled
    assert Run.objects.filter(periodic_task=taken, slot=T0 + 10 * S, claimed_by="").exists()
    taken.refresh_from_db()
    assert taken.enabled and taken.next_slot_at == T0 + 20 * S  # past the taken slot


def _refuse_task_name(name: str) -> tuple[list[str], list[str], str]:
    """SQL that makes the database refuse a run row of task ``name`` (a project's constraint:
    a CHECK where the database can add one, a trigger on SQLite), the SQL that removes it, and
    the start of the database's reason."""
    table = Run._meta.db_table
    if connection.vendor == "sqlite":
        return (
            [
                f"CREATE TRIGGER test_refused BEFORE INSERT ON {table} "
                f"WHEN NEW.task_name = '{name}' BEGIN SELECT RAISE(ABORT, 'test_refused'); END"
            ],
            ["DROP TRIGGER test_refused"],
            "test_refused",
        )
    add = f"ALTER TABLE {table} ADD CONSTRAINT test_refused CHECK (task_name <> '{name}')"
    drop = f"ALTER TABLE {table} DROP CONSTRAINT test_refused"
    if connection.vendor == "mysql":
        return [add], [drop], "(4025, 'CONSTRAINT `test_refused` failed"
    return [add], [drop], f'new row for relation "{table}" violates check constraint "test_refused"'


@pytest.mark.django_db(transaction=True)
def test_a_run_row_the_database_refuses_disables_its_task_and_the_batch_goes_on(
    make_claimer: MakeClaimer, caplog: pytest.LogCaptureFixture
) -> None:
    """A constraint of the project's refuses one task's run row. The plain insert is refused,
    so is its retry that skips taken slots (the slot is not taken), and the batch is inserted
    task by task: that task is disabled with the database's reason, the others are claimed.
    Every database: MySQL's ``INSERT IGNORE`` and SQLite's ``OR IGNORE`` would drop such a row
    with a warning, so the claim does not use them."""
    good = [interval_task(f"good{i}", 10, anchor=T0, next_slot_at=T0) for i in range(3)]
    bad = interval_task("bad", 10, anchor=T0, next_slot_at=T0, task="tests.refused")
    add, drop, reason = _refuse_task_name("tests.refused")
    with connection.cursor() as cursor:
        for sql in add:
            cursor.execute(sql)
    try:
        with caplog.at_level("WARNING"):
            result = make_claimer().claim(T0, "node-a")
    finally:
        with connection.cursor() as cursor:
            for sql in drop:
                cursor.execute(sql)
    assert sorted(r.periodic_task_id for r in result.runs) == sorted(t.pk for t in good)
    assert all(r.run_id for r in result.runs)
    assert result.disabled == ["bad"]
    assert caplog.text.count("claim batch refused") == 1
    assert "already has a run" not in caplog.text
    bad.refresh_from_db()
    assert not bad.enabled
    assert bad.disabled_reason.startswith(
        f"disabled by the scheduler: the database refused its run row: {reason}"
    ), bad.disabled_reason
    assert not Run.objects.filter(periodic_task=bad).exists()
    assert Run.objects.filter(periodic_task__in=good, slot=T0).count() == 3


@pytest.mark.django_db(transaction=True)
def test_a_crontab_whose_next_slot_is_in_1900_is_one_span_and_the_round_goes_on(
    make_claimer: MakeClaimer,
) -> None:
    """``next_slot_at`` in 1900 on an every-minute crontab (raw SQL, a restored backup): its
    66 million missed minutes are counted, not listed (listing them outlasted the test's
    timeout), so the round completes, the good task fires on time and the bad one fires once
    with one span row counting exactly every other minute since."""
    good = interval_task("good", 10, anchor=T0, next_slot_at=T0)
    bad = crontab_task("bad", "* * * * *", next_slot_at=T0)
    first = datetime(1900, 1, 1, tzinfo=UTC)
    PeriodicTask.objects.filter(pk=bad.pk).update(next_slot_at=first)
    now = T0 + 5 * S
    result = make_claimer().claim(now, "n", busy_since=now - 30 * S)
    assert sorted((r.periodic_task_id, r.slot) for r in result.runs) == sorted(
        [(good.pk, T0), (bad.pk, T0)]
    ), "T0 is on a whole minute: the latest downtime slot of the bad task"
    span = Run.objects.get(periodic_task=bad, status=RunStatus.MISSED)
    minutes = (T0 - first) // timedelta(minutes=1)
    assert (span.slot, span.missed_until, span.missed_count) == (
        first,
        T0 - timedelta(minutes=1),
        minutes,
    )
    bad.refresh_from_db()
    assert bad.enabled and bad.next_slot_at == T0 + timedelta(minutes=1)
