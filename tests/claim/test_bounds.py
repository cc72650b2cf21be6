"""Bounds (valid from / valid until), run limits (run once, max runs) and deterministic jitter.

Pure parts (the bounded schedule, the run budget, the jitter) with properties; then every
bound through real claim rounds against the database, with each claimer the database has
(SQLite: compare-and-swap; PostgreSQL: SKIP LOCKED and compare-and-swap), time given by hand.
"""

from __future__ import annotations

from collections import Counter
from datetime import datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from celery_driftsafe.claim.claimers import Claimer
from celery_driftsafe.claim.outbox import celery_task_id
from celery_driftsafe.core.bounds import Bounded, bounded, run_budget
from celery_driftsafe.core.jitter import due_instant, offset
from celery_driftsafe.core.misfire import ClaimPlan, Jitter, limit_plan, plan_claim
from celery_driftsafe.core.schedules import Crontab, Interval, OneOff, Solar
from celery_driftsafe.definitions import changes
from celery_driftsafe.models import PeriodicTask, Run, RunStatus, ScheduleKind
from tests.support import T0
from tests.support.factories import crontab_task, interval_task, solar_task

S = timedelta(seconds=1)
US = timedelta(microseconds=1)

# -- pure: the bounded schedule ---------------------------------------------------------------

instants = st.integers(min_value=-10_000_000, max_value=10_000_000).map(lambda s: T0 + s * S)


@given(
    every=st.integers(min_value=1, max_value=5000),
    start=instants,
    until_after=st.integers(min_value=1, max_value=20_000),
    probe=instants,
)
@hsettings(max_examples=300, deadline=None)
def test_bounded_schedule_is_the_inner_slots_within_the_bounds(
    every: int, start: datetime, until_after: int, probe: datetime
) -> None:
    inner = Interval(every * S, T0)
    until = start + until_after * S
    schedule = Bounded(inner, start, until)
    expected = [
        s
        for s in inner.slots_between(start - 10 * every * S, until + 10 * every * S)
        if start <= s < until
    ]
    assert list(schedule.slots_between(start - 10 * every * S, until + 10 * every * S)) == (
        expected
    )
    following = [s for s in expected if s > probe]
    assert schedule.next_after(probe) == (following[0] if following else None)
    at_or_after = [s for s in expected if s >= probe]
    assert schedule.first_at_or_after(probe) == (at_or_after[0] if at_or_after else None)


def test_bounded_is_the_schedule_itself_without_bounds() -> None:
    inner = Crontab(minute="*/5")
    assert bounded(inner, None, None) is inner
    assert "from 2026-03-01 12:00:00 UTC" in bounded(inner, T0, None).describe()


def test_bounded_interval_catch_up_counts_arithmetically_within_the_bounds() -> None:
    """An outage of a bounded per-second interval: missed slots counted within the bounds."""
    schedule = Bounded(Interval(S, T0), T0 + 100 * S, T0 + 1000 * S)
    plan = plan_claim(schedule, T0 + 100 * S, T0 + 86_400 * S, policy="skip")
    assert plan.fire == [] and plan.next_slot is None
    assert plan.missed_span is not None and plan.missed_span.count == 900
    assert plan.missed_span.last == T0 + 999 * S


def test_run_budget_and_limit_plan() -> None:
    assert run_budget(run_once=False, max_runs=None, run_count=7) is None
    assert run_budget(run_once=False, max_runs=5, run_count=3) == 2
    assert run_budget(run_once=False, max_runs=5, run_count=9) == 0
    assert run_budget(run_once=True, max_runs=None, run_count=9) == 1
    assert run_budget(run_once=True, max_runs=5, run_count=5) == 0
    plan = ClaimPlan(fire=[T0, T0 + S, T0 + 2 * S], next_slot=T0 + 3 * S)
    assert limit_plan(plan, None) == (plan, False)
    assert limit_plan(plan, 4) == (plan, False)
    cut, used_up = limit_plan(plan, 2)
    assert (cut.fire, cut.next_slot, used_up) == ([T0, T0 + S], None, True)
    cut, used_up = limit_plan(plan, 0)
    assert (cut.fire, used_up) == ([], True)


# -- pure: jitter ---------------------------------------------------------------------------


@given(
    name=st.text(min_size=1, max_size=30),
    slot=instants,
    spread=st.floats(min_value=0.001, max_value=3600),
)
@hsettings(max_examples=300, deadline=None)
def test_jitter_is_deterministic_and_within_the_spread(
    name: str, slot: datetime, spread: float
) -> None:
    first = offset(name, slot, spread)
    assert first == offset(name, slot.astimezone(), spread)  # same instant, any zone
    assert timedelta(0) <= first < timedelta(seconds=spread) + US
    assert due_instant(name, slot, spread) == slot + first
    assert offset(name, slot, None) == offset(name, slot, 0) == timedelta(0)


def test_jitter_spreads_a_wave_evenly_without_randomness() -> None:
    """100,000 tasks due at one instant, spread over 30 s: every second gets about 1/30."""
    counts = Counter(int(offset(f"task-{i}", T0, 30).total_seconds()) for i in range(100_000))
    assert sorted(counts) == list(range(30))
    mean = 100_000 / 30
    assert max(counts.values()) < mean * 1.1 and min(counts.values()) > mean * 0.9
    # and the same again: no randomness
    assert counts == Counter(
        int(offset(f"task-{i}", T0, 30).total_seconds()) for i in range(100_000)
    )


@given(
    every=st.integers(min_value=1, max_value=600),
    spread=st.integers(0, 900),
    grace=st.integers(0, 300),
    lag=st.integers(0, 5000),
    policy=st.sampled_from(["fire_once", "fire_all", "skip"]),
)
@hsettings(max_examples=300, deadline=None)
def test_plan_with_jitter_never_fires_early_and_measures_grace_from_the_jittered_instant(
    every: int, spread: int, grace: int, lag: int, policy: str
) -> None:
    schedule = Interval(every * S, T0)
    jitter = Jitter("wave-task", spread * S)
    now = T0 + lag * S
    plan = plan_claim(
        schedule, T0, now, policy=policy, grace=grace * S, jitter=jitter, fire_all_max=5
    )
    fired_or_missed = plan.fire + plan.missed
    assert all(jitter.due(s) <= now for s in fired_or_missed)
    on_time = [
        s for s in schedule.slots_between(T0, now + US) if now - grace * S <= jitter.due(s) <= now
    ]
    # every slot on time by its jittered instant fires (up to the first one not yet due)
    upcoming = plan.next_slot
    assert [s for s in on_time if upcoming is None or s < upcoming] == [
        s for s in plan.fire if jitter.due(s) >= now - grace * S
    ]
    # the next slot is the first one not yet due
    assert upcoming is not None and jitter.due(upcoming) > now
    assert all(jitter.due(s) <= now for s in schedule.slots_between(T0, upcoming))
    # without jitter the plan is the same as before jitter existed
    if spread == 0:
        assert plan == plan_claim(schedule, T0, now, policy=policy, grace=grace * S, fire_all_max=5)


# -- through real claim rounds -----------------------------------------------------------------


def _slots(task: PeriodicTask) -> list[tuple[datetime | None, str]]:
    return list(
        Run.objects.filter(periodic_task=task).order_by("slot").values_list("slot", "status")
    )


@pytest.mark.django_db(transaction=True)
class TestBoundsInTheClaim:
    def test_no_slot_before_valid_from_fires(self, claimer: Claimer) -> None:
        # stored next slot before the bound (e.g. written by SQL): the claim still holds it
        task = interval_task("from", 10, anchor=T0, next_slot_at=T0, valid_from=T0 + 25 * S)
        for now in (T0, T0 + 10 * S, T0 + 29 * S):
            assert claimer.claim(now, "n").runs == []
        task.refresh_from_db()
        assert task.next_slot_at == T0 + 30 * S and task.due_at == T0 + 30 * S
        assert [r.slot for r in claimer.claim(T0 + 30 * S, "n").runs] == [T0 + 30 * S]
        assert _slots(task) == [(T0 + 30 * S, RunStatus.CLAIMED)]

    def test_catch_up_never_reaches_before_valid_from(self, claimer: Claimer) -> None:
        task = interval_task(
            "from-catch-up",
            10,
            anchor=T0,
            next_slot_at=T0,
            valid_from=T0 + 100 * S,
            misfire_policy="fire_all",
        )
        result = claimer.claim(T0 + 500 * S, "n")
        slots = _slots(task)
        assert slots and min(s for s, _ in slots if s is not None) >= T0 + 100 * S
        # 41 slots from 100 to 500 s: the on-time ones fire, older ones fire or are recorded
        assert result.missed + len(result.runs) == 41

    def test_nothing_at_or_after_valid_until_and_then_the_task_is_disabled(
        self, claimer: Claimer
    ) -> None:
        task = interval_task("until", 10, anchor=T0, next_slot_at=T0, valid_until=T0 + 20 * S)
        assert [r.slot for r in claimer.claim(T0, "n").runs] == [T0]
        result = claimer.claim(T0 + 10 * S, "n")
        assert [r.slot for r in result.runs] == [T0 + 10 * S]
        assert result.finished == ["until"]  # T0 + 20 s is the bound itself: no slot left
        task.refresh_from_db()
        assert not task.enabled and task.next_slot_at is None and task.due_at is None
        assert task.disabled_reason.startswith("finished: valid until")
        assert claimer.claim(T0 + 100 * S, "n").runs == []
        assert _slots(task) == [(T0, "claimed"), (T0 + 10 * S, "claimed")]

    def test_catch_up_after_valid_until_fires_only_slots_before_it(self, claimer: Claimer) -> None:
        task = interval_task(
            "until-catch-up",
            10,
            anchor=T0,
            next_slot_at=T0,
            valid_until=T0 + 35 * S,
            misfire_policy="fire_once",
        )
        result = claimer.claim(T0 + 1000 * S, "n")
        assert [r.slot for r in result.runs] == [T0 + 30 * S]  # the latest slot before it
        assert result.missed == 3 and result.finished == ["until-catch-up"]
        assert max(s for s, _ in _slots(task) if s is not None) < T0 + 35 * S

    def test_message_expires_at_valid_until_at_the_latest(self, claimer: Claimer) -> None:
        interval_task(
            "expiring", 10, anchor=T0, next_slot_at=T0, valid_until=T0 + 15 * S, expires_seconds=60
        )
        interval_task(
            "short", 10, anchor=T0, next_slot_at=T0, valid_until=T0 + 15 * S, expires_seconds=3
        )
        runs = {r.task_name: r for r in claimer.claim(T0, "n").runs}
        expires = dict(Run.objects.values_list("periodic_task__name", "expires_at"))
        assert expires == {"expiring": T0 + 15 * S, "short": T0 + 3 * S}
        assert runs

    def test_run_once_with_every_kind(self, claimer: Claimer) -> None:
        sunset = Solar("sunset", 52.5, 13.4).first_at_or_after(T0)
        assert sunset is not None
        tasks = [
            interval_task("i", 10, anchor=T0, next_slot_at=T0, run_once=True),
            crontab_task("c", "* * * * *", next_slot_at=T0, run_once=True),
            solar_task("s", "sunset", 52.5, 13.4, next_slot_at=sunset, run_once=True),
        ]
        oneoff = PeriodicTask(
            name="o",
            task="tests.add",
            schedule_kind=ScheduleKind.ONE_OFF,
            one_off_at=T0,
            run_once=True,
        )
        oneoff.save()
        tasks.append(oneoff)
        end = sunset + timedelta(minutes=3)
        claimed = Counter()
        now = T0
        while now <= end:
            for run in claimer.claim(now, "n").runs:
                claimed[run.periodic_task_id] += 1
            now += timedelta(minutes=1) if now < sunset - timedelta(minutes=2) else 10 * S
        assert claimed == {task.pk: 1 for task in tasks}
        for task in tasks:
            task.refresh_from_db()
            assert not task.enabled and task.run_count == 1
            assert task.disabled_reason == "finished: run once: it fired its run"

    def test_run_once_fires_one_run_of_a_catch_up_and_again_once_re_enabled(
        self, claimer: Claimer
    ) -> None:
        task = interval_task(
            "once", 10, anchor=T0, next_slot_at=T0, run_once=True, misfire_policy="fire_all"
        )
        result = claimer.claim(T0 + 300 * S, "n")
        assert len(result.runs) == 1 and result.finished == ["once"]
        task.refresh_from_db()
        task.enabled = True
        task.save()  # re-enabled: one more run
        task.refresh_from_db()
        assert task.enabled and task.next_slot_at is not None
        result = claimer.claim(task.next_slot_at, "n")
        assert [r.slot for r in result.runs] == [task.next_slot_at]
        task.refresh_from_db()
        assert not task.enabled and task.run_count == 2

    def test_max_runs_stops_at_the_limit_also_within_a_catch_up(self, claimer: Claimer) -> None:
        task = interval_task(
            "three", 10, anchor=T0, next_slot_at=T0, max_runs=3, misfire_policy="fire_all"
        )
        assert len(claimer.claim(T0, "n").runs) == 1
        # an outage: 30 slots due, only the 2 runs left fire (the earliest of the catch-up)
        result = claimer.claim(T0 + 300 * S, "n")
        assert len(result.runs) == 2 and result.finished == ["three"]
        task.refresh_from_db()
        assert (task.enabled, task.run_count, task.next_slot_at) == (False, 3, None)
        assert task.disabled_reason == "finished: max runs: it reached 3 runs"
        assert Run.objects.filter(periodic_task=task, status=RunStatus.CLAIMED).count() == 3
        # re-enabled without raising the limit: disabled again, nothing fires
        task.enabled = True
        task.save()
        task.refresh_from_db()
        assert task.next_slot_at is not None
        result = claimer.claim(task.next_slot_at, "n")
        assert result.runs == [] and result.finished == ["three"]

    def test_first_slot_is_computed_from_valid_from(self) -> None:
        now = changes.authority_now()
        start = (now + timedelta(days=2)).replace(microsecond=0)
        interval = PeriodicTask(
            name="iv",
            task="tests.add",
            schedule_kind="interval",
            interval_every=3600,
            valid_from=start,
        )
        interval.save()
        assert interval.interval_anchor == start and interval.next_slot_at == start
        cron = PeriodicTask(
            name="cr",
            task="tests.add",
            schedule_kind="crontab",
            crontab_minute="0",
            crontab_hour="*",
            valid_from=start,
        )
        cron.save()
        assert cron.next_slot_at == Crontab(minute="0").first_at_or_after(start)
        past = PeriodicTask(
            name="late",
            task="tests.add",
            schedule_kind="one_off",
            one_off_at=now - timedelta(days=1),
            valid_from=now,
        )
        past.save()
        assert past.next_slot_at is None  # the one-off's instant is before the bound


@pytest.mark.django_db(transaction=True)
class TestJitterInTheClaim:
    def test_never_before_the_jittered_instant_and_the_slot_stays_the_identity(
        self, claimer: Claimer
    ) -> None:
        task = interval_task("jittered", 60, anchor=T0, next_slot_at=T0, jitter_seconds=30)
        due = T0 + offset("jittered", T0, 30)
        assert due > T0
        assert claimer.claim(due - US, "n").runs == []
        task.refresh_from_db()
        assert task.next_slot_at == T0 and task.due_at == due  # the claim set the due instant
        result = claimer.claim(due, "n")
        assert [(r.slot, r.celery_task_id) for r in result.runs] == [
            (T0, celery_task_id(task.pk, T0))
        ]
        assert result.oldest_slot == due  # the beats' lag counts from the jittered instant
        task.refresh_from_db()
        following = T0 + 60 * S
        assert task.next_slot_at == following
        assert task.due_at == following + offset("jittered", following, 30)

    def test_misfire_grace_is_measured_from_the_jittered_instant(self, claimer: Claimer) -> None:
        name = next(n for n in (f"g{i}" for i in range(1000)) if offset(n, T0, 30) > 15 * S)
        shift = offset(name, T0, 30)
        interval_task(
            name,
            3600,
            anchor=T0,
            next_slot_at=T0,
            jitter_seconds=30,
            misfire_policy="skip",
            misfire_grace_seconds=5,
        )
        other = name + "-late"
        interval_task(
            other,
            3600,
            anchor=T0,
            next_slot_at=T0,
            jitter_seconds=30,
            misfire_policy="skip",
            misfire_grace_seconds=5,
        )
        # 5 s after its jittered instant (more than 5 s after the slot): on time
        result = claimer.claim(T0 + shift + 5 * S, "n")
        fired = {Run.objects.get(pk=r.run_id).periodic_task.name for r in result.runs}
        assert name in fired
        # the other task's instant plus its grace is earlier or later: judged by its own
        late_due = T0 + offset(other, T0, 30)
        status = Run.objects.filter(periodic_task__name=other).values_list("status", flat=True)
        if late_due + 5 * S < T0 + shift + 5 * S:
            assert list(status) == [RunStatus.MISSED]
        elif late_due <= T0 + shift + 5 * S:
            assert list(status) == [RunStatus.CLAIMED]
        else:
            assert list(status) == []

    def test_a_wave_is_spread_over_the_jitter_each_task_once_none_early(
        self, claimer: Claimer
    ) -> None:
        count = 600
        PeriodicTask.objects.bulk_create(
            PeriodicTask(
                name=f"wave-{i:04d}",
                task="tests.add",
                schedule_kind="crontab",
                crontab_minute="*",
                jitter_seconds=30,
                next_slot_at=T0,
            )
            for i in range(count)
        )
        per_second: Counter[int] = Counter()
        names = dict(PeriodicTask.objects.values_list("pk", "name"))
        for second in range(0, 31):
            now = T0 + second * S
            for run in claimer.claim(now, "n").runs:
                assert run.slot == T0
                due = T0 + offset(names[run.periodic_task_id], T0, 30)
                assert due <= now < due + S  # never early, and claimed within the second
                per_second[second] += 1
        assert sum(per_second.values()) == count
        assert Run.objects.filter(slot=T0).count() == count
        assert max(per_second.values()) < 3 * count / 30  # spread, not a wall at T0

    def test_an_edit_of_the_jitter_or_the_name_recomputes_the_due_instant(self) -> None:
        task = PeriodicTask(
            name="edit", task="tests.add", schedule_kind="crontab", crontab_minute="*"
        )
        task.save()
        assert task.due_at == task.next_slot_at
        task.jitter_seconds = 20
        task.save()
        stored = PeriodicTask.objects.get(pk=task.pk)
        assert stored.next_slot_at is not None
        assert stored.due_at == stored.next_slot_at + offset("edit", stored.next_slot_at, 20)
        stored.name = "renamed"
        stored.save()
        renamed = PeriodicTask.objects.get(pk=task.pk)
        assert renamed.next_slot_at is not None
        assert renamed.due_at == renamed.next_slot_at + offset("renamed", renamed.next_slot_at, 20)

    def test_one_off_keeps_its_instant_as_slot_with_jitter(self, claimer: Claimer) -> None:
        task = PeriodicTask(
            name="launch",
            task="tests.add",
            schedule_kind="one_off",
            one_off_at=T0,
            jitter_seconds=10,
        )
        task.save()
        task.refresh_from_db()
        assert task.next_slot_at == T0 and task.due_at == T0 + offset("launch", T0, 10)
        assert claimer.claim(task.due_at - US, "n").runs == []
        assert [r.slot for r in claimer.claim(task.due_at, "n").runs] == [T0]


def test_one_off_schedule_within_bounds() -> None:
    assert Bounded(OneOff(T0), T0 + S, None).first_at_or_after(T0 - S) is None
    assert Bounded(OneOff(T0), None, T0 + S).first_at_or_after(T0 - S) == T0


@pytest.mark.django_db(transaction=True)
def test_a_sub_second_interval_fires_each_of_its_slots(claimer: Claimer) -> None:
    """django-celery-beat and Celery can hold intervals of a fraction of a second: stored in
    microseconds, they fire like any interval."""
    task = PeriodicTask(
        name="half",
        task="tests.add",
        schedule_kind="interval",
        interval_every=500_000,
        interval_unit="microseconds",
        interval_anchor=T0,
    )
    task.save()
    PeriodicTask.objects.filter(pk=task.pk).update(next_slot_at=T0)
    slots = [r.slot for r in claimer.claim(T0 + timedelta(milliseconds=1200), "n").runs]
    assert slots == [T0, T0 + timedelta(milliseconds=500), T0 + timedelta(milliseconds=1000)]
    task.refresh_from_db()
    assert task.next_slot_at == task.due_at == T0 + timedelta(milliseconds=1500)


@pytest.mark.django_db
@pytest.mark.parametrize(("every", "refused"), [(1, True), (9_999, True), (10_000, False)])
def test_an_interval_shorter_than_10_ms_is_refused_on_the_field(every: int, refused: bool) -> None:
    """A microsecond's interval made a million slots a second: the beat claimed 10,000 runs
    of it a round, every round, and every other task fired seconds late. The shortest is
    10 ms, the beat's shortest wait between rounds."""
    from django.core.exceptions import ValidationError

    task = PeriodicTask(
        name="quick",
        task="tests.add",
        schedule_kind="interval",
        interval_every=every,
        interval_unit="microseconds",
        interval_anchor=T0,
    )
    if not refused:
        task.full_clean()
        return
    with pytest.raises(ValidationError) as caught:
        task.full_clean()
    assert "shorter than the shortest interval, 10 ms" in str(caught.value.message_dict)
    assert list(caught.value.message_dict) == ["interval_every"]


@pytest.mark.django_db(transaction=True)
def test_a_microsecond_interval_stored_behind_save_is_disabled_and_the_round_goes_on(
    claimer: Claimer,
) -> None:
    """Stored by SQL, a 1 µs interval is disabled with the reason in the claim, and the
    other tasks of the round fire: no round of 10,000 runs of it."""
    good = interval_task("good", 1, anchor=T0, next_slot_at=T0)
    quick = interval_task("quick", 1, anchor=T0, next_slot_at=T0)
    PeriodicTask.objects.filter(pk=quick.pk).update(interval_unit="microseconds")
    result = claimer.claim(T0 + timedelta(milliseconds=500), "n")
    assert [(r.periodic_task_id, r.slot) for r in result.runs] == [(good.pk, T0)]
    assert result.disabled == ["quick"]
    quick.refresh_from_db()
    assert not quick.enabled
    assert "shorter than the shortest interval, 10 ms" in quick.disabled_reason


@hsettings(max_examples=200, deadline=None)
@given(
    expires=st.one_of(st.none(), st.floats(min_value=0, max_value=10**6)),
    default=st.one_of(st.none(), st.floats(min_value=0, max_value=10**6)),
    jitter=st.one_of(st.none(), st.floats(min_value=0, max_value=3600)),
    until=st.one_of(st.none(), st.integers(min_value=-(10**6), max_value=10**6)),
)
def test_a_runs_expiry_is_message_expirys_with_or_without_bounds(
    expires: float | None, default: float | None, jitter: float | None, until: int | None
) -> None:
    """The claim's expiry of a run (a shortcut without jitter and bounds) is the one
    :func:`message_expiry` gives from the task's limits, whatever is set."""
    from celery_driftsafe.claim.claimers import run_expiry
    from celery_driftsafe.conf import DriftSafeSettings
    from celery_driftsafe.core.bounds import message_expiry

    slot = T0 + timedelta(minutes=7)
    task = PeriodicTask(
        name="expiry",
        expires_seconds=expires,
        jitter_seconds=jitter,
        valid_until=None if until is None else slot + timedelta(seconds=until),
    )
    settings = DriftSafeSettings(run_expires_seconds=default)
    seconds = default if expires is None else expires
    assert run_expiry(task, slot, settings) == message_expiry(slot, task.limits, seconds)


def test_a_valid_from_past_the_calendars_last_slot_finishes_the_task_naming_it() -> None:
    """Stored behind save() (9999-12-31): the reason named a valid until of None."""
    from celery_driftsafe.core.bounds import Limits
    from celery_driftsafe.core.misfire import plan_limited

    end = datetime.max.replace(tzinfo=T0.tzinfo)
    schedule = bounded(Interval(S, T0), end, None)
    plan, finished = plan_limited(schedule, T0, T0, Limits("t", valid_from=end))
    assert plan == ClaimPlan()
    assert finished == f"valid from {end}: no slot is left after it"
