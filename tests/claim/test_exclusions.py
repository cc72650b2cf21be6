"""Excluded dates and calendars through real claim rounds (each claimer the database has), the
task's row as the claim reads it, and the calendars' edits that move a task's next slot.

An excluded slot is not a slot: no run row of it exists, fired or missed, on time or after
downtime, whichever way the planner counts (``misfire_arithmetic`` on or off)."""

from __future__ import annotations

from datetime import date, datetime, timedelta
from typing import Any

import pytest
from django.core.exceptions import ValidationError

from celery_driftsafe.claim.claimers import Claimer
from celery_driftsafe.core.exclusions import Excluding
from celery_driftsafe.definitions import changes
from celery_driftsafe.models import Calendar, PeriodicTask, Run, RunStatus
from tests.support import T0
from tests.support.factories import crontab_task, interval_task

S = timedelta(seconds=1)
DAY = timedelta(days=1)


def _ledger(task: PeriodicTask) -> dict[datetime, tuple[str, int]]:
    """Every run row of ``task``: slot -> (status, how many slots it stands for)."""
    return {
        slot: (status, count)
        for slot, status, count in Run.objects.filter(periodic_task=task).values_list(
            "slot", "status", "missed_count"
        )
    }


def _no_arithmetic(settings: Any) -> None:
    settings.DRIFTSAFE_INTERNALS = {
        **settings.DRIFTSAFE_INTERNALS,
        "OPTIMISATIONS_OFF": ["misfire_arithmetic"],
    }


@pytest.mark.django_db(transaction=True)
class TestExcludedSlotsInTheClaim:
    def test_an_excluded_slot_is_neither_fired_nor_missed_on_time(self, claimer: Claimer) -> None:
        # T0 is 2026-03-01 12:00 UTC, a Sunday; a daily task at noon, 2 March excluded
        task = interval_task(
            "daily", 86_400, anchor=T0, next_slot_at=T0, excluded_dates=["2026-03-02"]
        )
        fired = []
        now = T0
        while now <= T0 + 4 * DAY:
            fired += [run.slot for run in claimer.claim(now, "n").runs]
            now += 6 * 3600 * S
        assert fired == [T0, T0 + 2 * DAY, T0 + 3 * DAY, T0 + 4 * DAY]
        assert T0 + DAY not in _ledger(task)
        task.refresh_from_db()
        assert task.next_slot_at == T0 + 5 * DAY

    @pytest.mark.parametrize("policy", ["fire_once", "fire_all", "skip"])
    @pytest.mark.parametrize("arithmetic", [True, False])
    def test_after_downtime_excluded_slots_are_not_counted_missed(
        self, claimer: Claimer, policy: str, arithmetic: bool, settings: Any
    ) -> None:
        if not arithmetic:
            _no_arithmetic(settings)
        # an hourly task down for ten days; two whole days and every night hour excluded
        calendar = Calendar.objects.create(
            name="nights", dates=["2026-03-03", "2026-03-05"], crontab="* 0-5 * * *"
        )
        task = interval_task("hourly", 3600, anchor=T0, next_slot_at=T0, misfire_policy=policy)
        task.calendars.add(calendar)  # reschedules from the authority's now: back to T0
        PeriodicTask.objects.filter(pk=task.pk).update(next_slot_at=T0)
        task.refresh_from_db()
        assert task.calendar_exclusions == {
            "dates": ["2026-03-03", "2026-03-05"],
            "crontabs": ["* 0-5 * * *"],
        }
        schedule = task.schedule
        assert isinstance(schedule, Excluding)
        now = T0 + 10 * DAY + 30 * 60 * S
        expected = list(schedule.slots_between(T0, now))
        assert len(expected) == 241 - 2 * 24 - 8 * 6  # 12:00 to 12:00 ten days on
        claimer.claim(now, "n")
        ledger = _ledger(task)
        assert all(not schedule.excludes(slot) for slot in ledger)
        assert sum(count for _, count in ledger.values()) == len(expected)
        fired = sorted(slot for slot, (status, _) in ledger.items() if status == RunStatus.CLAIMED)
        if policy == "skip":  # the latest slot is 30 min old, past the grace: none fires
            assert fired == []
        else:
            assert fired and fired[-1] == expected[-1]
        task.refresh_from_db()
        assert task.next_slot_at == schedule.next_after(now)
        # a second round a week later: again only the slots not excluded
        later = now + 7 * DAY
        claimer.claim(later, "n")
        total = sum(count for _, count in _ledger(task).values())
        assert total == len(list(schedule.slots_between(T0, later)))

    def test_per_second_exclusion_through_the_plain_interval_path(self, claimer: Claimer) -> None:
        """A plain 1 s interval is what the planner's grid arithmetic takes; with an exclusion
        crontab it must not: every third second neither fires nor is missed."""
        calendar = Calendar.objects.create(name="thirds", crontab="*/3 * * * * *")
        task = interval_task("every-second", 1, anchor=T0, next_slot_at=T0 + S)
        task.calendars.add(calendar)
        PeriodicTask.objects.filter(pk=task.pk).update(next_slot_at=T0 + S)
        now = T0
        fired = []
        for _ in range(12):
            now += S
            fired += [run.slot for run in claimer.claim(now, "n").runs]
        assert [(slot - T0).seconds for slot in fired] == [1, 2, 4, 5, 7, 8, 10, 11]
        # and a catch-up over 100 s: 67 slots of 100 are not excluded
        result = claimer.claim(now + 100 * S, "n")
        ledger = _ledger(task)
        assert all((slot - T0).seconds % 3 for slot in ledger)
        assert result.missed + len(result.runs) == len([s for s in range(13, 113) if s % 3])

    def test_a_stale_next_slot_on_an_excluded_date_moves_on(self, claimer: Claimer) -> None:
        task = interval_task("stale", 86_400, anchor=T0, next_slot_at=T0 + DAY)
        # excluded behind the save's back (raw update): the claim still skips it
        PeriodicTask.objects.filter(pk=task.pk).update(excluded_dates=["2026-03-02"])
        assert claimer.claim(T0 + DAY, "n").runs == []
        assert _ledger(task) == {}
        task.refresh_from_db()
        assert task.next_slot_at == T0 + 2 * DAY
        assert [r.slot for r in claimer.claim(T0 + 2 * DAY, "n").runs] == [T0 + 2 * DAY]

    def test_a_task_whose_every_slot_is_excluded_finishes_with_the_reason(
        self, claimer: Claimer
    ) -> None:
        task = interval_task("never", 60, anchor=T0, next_slot_at=T0)
        PeriodicTask.objects.filter(pk=task.pk).update(
            calendar_exclusions={"dates": [], "crontabs": ["* * * * *"]}
        )
        result = claimer.claim(T0, "n")
        assert result.runs == [] and result.finished == ["never"]
        task.refresh_from_db()
        assert not task.enabled
        assert task.disabled_reason.startswith("finished: excluded dates: every slot left")
        assert _ledger(task) == {}

    def test_unreadable_exclusions_disable_only_that_task(self, claimer: Claimer) -> None:
        bad = interval_task("bad-dates", 60, anchor=T0, next_slot_at=T0)
        good = interval_task("good", 60, anchor=T0, next_slot_at=T0)
        PeriodicTask.objects.filter(pk=bad.pk).update(excluded_dates=["2026-02-30"])
        result = claimer.claim(T0, "n")
        assert [run.periodic_task_id for run in result.runs] == [good.pk]
        assert result.disabled == ["bad-dates"]
        bad.refresh_from_db()
        assert not bad.enabled and "excluded_dates" in bad.disabled_reason
        assert "'2026-02-30' is no date" in bad.disabled_reason


@pytest.mark.django_db(transaction=True)
class TestCalendarEditsMoveTheNextSlot:
    def _daily(self, name: str) -> tuple[PeriodicTask, date]:
        """A task every day at 03:00 UTC, saved now; the local date of its next slot."""
        task = crontab_task(name, "0 3 * * *")
        assert task.next_slot_at is not None
        return task, task.next_slot_at.date()

    def test_adding_the_next_date_to_a_calendar_moves_every_task_on_it(self) -> None:
        first, day = self._daily("first")
        second, _ = self._daily("second")
        calendar = Calendar.objects.create(name="holidays")
        calendar.tasks.add(first, second)
        for task in (first, second):
            task.refresh_from_db()
            assert task.next_slot_at is not None and task.next_slot_at.date() == day
        calendar.dates = [day.isoformat(), (day + DAY).isoformat()]
        calendar.save()
        for task in (first, second):
            task.refresh_from_db()
            assert task.next_slot_at is not None
            assert task.next_slot_at.date() == day + 2 * DAY
            assert task.due_at == task.next_slot_at
        # the date taken out again: back to the first slot after now
        calendar.dates = [(day + DAY).isoformat()]
        calendar.save()
        first.refresh_from_db()
        assert first.next_slot_at is not None and first.next_slot_at.date() == day

    def test_links_and_deletes_from_either_side(self) -> None:
        task, day = self._daily("linked")
        calendar = Calendar.objects.create(name="one day", dates=[day.isoformat()])
        task.calendars.add(calendar)
        task.refresh_from_db()
        assert task.next_slot_at is not None and task.next_slot_at.date() == day + DAY
        task.calendars.remove(calendar)
        task.refresh_from_db()
        assert task.next_slot_at is not None and task.next_slot_at.date() == day
        assert task.calendar_exclusions is None
        calendar.tasks.add(task)
        task.refresh_from_db()
        assert task.next_slot_at is not None and task.next_slot_at.date() == day + DAY
        calendar.tasks.clear()
        task.refresh_from_db()
        assert task.next_slot_at is not None and task.next_slot_at.date() == day
        task.calendars.set([calendar])
        calendar.delete()
        task.refresh_from_db()
        assert task.calendar_exclusions is None
        assert task.next_slot_at is not None and task.next_slot_at.date() == day

    def test_a_task_save_never_writes_back_the_calendars_part(self) -> None:
        task, day = self._daily("stale-instance")
        loaded = PeriodicTask.objects.get(pk=task.pk)  # before the calendar
        calendar = Calendar.objects.create(name="later", dates=[day.isoformat()])
        task.calendars.add(calendar)
        loaded.description = "edited"
        loaded.save()
        loaded.refresh_from_db()
        assert loaded.calendar_exclusions == {"dates": [day.isoformat()], "crontabs": []}
        assert loaded.next_slot_at is not None and loaded.next_slot_at.date() == day + DAY

    def test_own_excluded_dates_reschedule_on_save(self) -> None:
        task, day = self._daily("own")
        task.excluded_dates = [day.isoformat()]
        task.save()
        task.refresh_from_db()
        assert task.next_slot_at is not None and task.next_slot_at.date() == day + DAY
        preview = changes.preview(task, changes.authority_now(), count=3)
        assert [row.slot.date() for row in preview.rows] == [day + DAY * n for n in (1, 2, 3)]


@pytest.mark.django_db
class TestValidation:
    def test_task_dates_are_checked_and_stored_sorted(self) -> None:
        task = PeriodicTask(
            name="v",
            task="tests.add",
            schedule_kind="interval",
            interval_every=60,
            excluded_dates=["2026-12-26", "2026-12-25", "2026-12-25"],
        )
        task.full_clean()
        assert task.excluded_dates == ["2026-12-25", "2026-12-26"]
        task.excluded_dates = ["2026-12-25", "christmas"]
        with pytest.raises(ValidationError) as raised:
            task.full_clean()
        assert "'christmas' is no date" in raised.value.message_dict["excluded_dates"][0]

    def test_a_calendar_names_its_field_at_fault(self) -> None:
        with pytest.raises(ValidationError) as raised:
            Calendar(name="c", dates=["2026-13-01"], crontab="* * *").full_clean()
        assert set(raised.value.message_dict) == {"dates", "crontab"}
        with pytest.raises(ValidationError):
            Calendar.objects.create(name="d", crontab="61 * * * *")
        assert not Calendar.objects.exists()

    def test_excluding_every_slot_is_refused(self) -> None:
        task = PeriodicTask(
            name="nothing-left",
            task="tests.add",
            schedule_kind="crontab",
            crontab_minute="0",
            crontab_hour="7",
            crontab_day_of_week="sat",
            calendar_exclusions={"dates": [], "crontabs": ["* * * * sat,sun"]},
        )
        with pytest.raises(ValidationError) as raised:
            task.full_clean()
        assert "every slot of the schedule is excluded" in str(
            raised.value.message_dict["excluded_dates"]
        )
