"""Excluded dates and calendars in the admin, through Django's test client: the task form's
date list (errors naming the entry), its calendars, the preview that skips excluded slots and
says how many, and the calendars' own pages."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from django.urls import reverse

from celery_driftsafe.admin.forms import PREVIEW_BUTTON
from celery_driftsafe.models import Calendar, PeriodicTask
from celery_driftsafe.testing import FakeClock, inject_authority_clock
from tests.support.admin_forms import ADD, form_data, form_errors
from tests.support.factories import crontab_task

#: Wednesday 2026-12-23, noon UTC.
NOW = datetime(2026, 12, 23, 12, 0, tzinfo=UTC)
CALENDARS = reverse("admin:celery_driftsafe_calendar_changelist")
CALENDAR_ADD = reverse("admin:celery_driftsafe_calendar_add")


@pytest.fixture
def clock() -> Iterator[FakeClock]:
    clock = FakeClock(NOW)
    with inject_authority_clock(clock):
        yield clock


def weekdays_at_seven(**overrides: Any) -> dict[str, Any]:
    return form_data(
        name="morning",
        crontab_minute="0",
        crontab_hour="7",
        crontab_day_of_week="mon-fri",
        **overrides,
    )


@pytest.mark.django_db
def test_bad_dates_are_named_and_nothing_is_saved(admin_client: Any, app: Any, clock: Any) -> None:
    response = admin_client.post(
        ADD, weekdays_at_seven(excluded_dates="2026-12-24\n24.12.2026, 2026-02-30")
    )
    errors = form_errors(response)
    assert list(errors) == ["excluded_dates"]
    assert "'24.12.2026', '2026-02-30' are no dates" in errors["excluded_dates"][0]
    assert not PeriodicTask.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_dates_and_calendars_saved_from_the_form_skip_their_slots(
    admin_client: Any, app: Any, clock: Any
) -> None:
    holidays = Calendar.objects.create(name="holidays DE", dates=["2026-12-25", "2026-12-26"])
    response = admin_client.post(
        ADD,
        weekdays_at_seven(excluded_dates="2026-12-24, 2026-12-24", calendars=[str(holidays.pk)]),
    )
    assert response.status_code == 302, form_errors(response)
    task = PeriodicTask.objects.get(name="morning")
    assert task.excluded_dates == ["2026-12-24"]
    assert task.calendar_exclusions == {"dates": ["2026-12-25", "2026-12-26"], "crontabs": []}
    # Thursday 24th and Friday 25th excluded: next is Monday 28th, 07:00 Berlin (06:00 UTC)
    assert task.next_slot_at == datetime(2026, 12, 28, 6, 0, tzinfo=UTC)


@pytest.mark.django_db
def test_the_preview_skips_excluded_slots_and_says_how_many(
    admin_client: Any, app: Any, clock: Any
) -> None:
    shutdown = Calendar.objects.create(name="shutdown", dates=["2026-12-28", "2026-12-29"])
    data = weekdays_at_seven(excluded_dates="2026-12-24", calendars=[str(shutdown.pk)])
    del data["_save"]
    data[PREVIEW_BUTTON] = "Preview"
    response = admin_client.post(ADD, data)
    assert response.status_code == 200
    rows = response.context["driftsafe_preview"]
    assert [row["local"][:10] for row in rows[:3]] == ["2026-12-25", "2026-12-30", "2026-12-31"]
    # the 24th comes before the first row; between the first and the last: the 28th and 29th
    assert response.context["driftsafe_preview_excluded"] == 2
    assert b"Skips 2 excluded slots" in response.content
    assert not PeriodicTask.objects.exists()


@pytest.mark.django_db
def test_the_calendar_form_names_its_fields_at_fault(admin_client: Any) -> None:
    response = admin_client.post(
        CALENDAR_ADD, {"name": "bad", "description": "", "dates": "2026-13-01", "crontab": "* *"}
    )
    errors = form_errors(response)
    assert set(errors) == {"dates", "crontab"}
    assert "'2026-13-01' is no date" in errors["dates"][0]
    assert "needs 5 fields" in errors["crontab"][0]
    assert not Calendar.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_saving_a_calendar_in_the_admin_moves_its_tasks(
    admin_client: Any, app: Any, clock: Any
) -> None:
    task = crontab_task("nightly", "0 3 * * *")
    assert task.next_slot_at == datetime(2026, 12, 24, 3, 0, tzinfo=UTC)
    calendar = Calendar.objects.create(name="eve")
    calendar.tasks.add(task)
    change = reverse("admin:celery_driftsafe_calendar_change", args=[calendar.pk])
    response = admin_client.post(
        change, {"name": "eve", "description": "", "dates": "2026-12-24", "crontab": ""}
    )
    assert response.status_code == 302
    task.refresh_from_db()
    assert task.next_slot_at == datetime(2026, 12, 25, 3, 0, tzinfo=UTC)
    page = admin_client.get(change)
    assert b"nightly" in page.content
    listing = admin_client.get(CALENDARS)
    assert listing.status_code == 200 and b"eve" in listing.content
