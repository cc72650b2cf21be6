"""The task form's "Preview the next slots" button and the change page's table of the next
slots, through Django's test client."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from django.contrib.admin.models import LogEntry
from django.urls import reverse

from celery_driftsafe.admin.forms import PREVIEW_BUTTON
from celery_driftsafe.definitions import changes
from celery_driftsafe.models import PeriodicTask
from celery_driftsafe.testing import FakeClock, inject_authority_clock
from tests.support.admin_forms import ADD, form_data, form_errors
from tests.support.factories import crontab_task

#: Noon UTC, two days before Berlin's clocks go forward (2026-03-29, 02:00 CET -> 03:00 CEST).
NOW = datetime(2026, 3, 27, 12, 0, tzinfo=UTC)


@pytest.fixture
def clock() -> Iterator[FakeClock]:
    clock = FakeClock(NOW)
    with inject_authority_clock(clock):
        yield clock


def preview_post(**overrides: Any) -> dict[str, Any]:
    data = form_data(**overrides)
    del data["_save"]
    data[PREVIEW_BUTTON] = "Preview the next slots"
    return data


def written() -> tuple[list[dict[str, Any]], int]:
    """Every task row as stored, and how many admin log entries there are."""
    return list(PeriodicTask.objects.order_by("pk").values()), LogEntry.objects.count()


def slot_rows(response: Any) -> list[dict[str, str]]:
    assert response.status_code == 200
    return list(response.context["driftsafe_preview"])


@pytest.mark.django_db
def test_previewing_a_new_task_shows_its_slots_and_saves_nothing(
    admin_client: Any, app: Any, clock: FakeClock
) -> None:
    before = written()
    response = admin_client.post(
        ADD, preview_post(crontab_minute="30", crontab_hour="2", jitter_seconds="20")
    )
    assert written() == before
    rows = slot_rows(response)
    assert len(rows) == 10
    assert rows[0]["local"] == "2026-03-28 02:30:00 +01:00"
    assert rows[0]["utc"] == "2026-03-28 01:30:00"
    assert rows[1]["local"] == "2026-03-29 03:00:00 +02:00"  # 02:30 does not exist that night
    assert rows[1]["dst"] == "UTC offset +01:00 → +02:00"
    assert [row["dst"] for row in rows].count("") == 9
    assert all(row["due"] for row in rows)  # jittered: the due instant is shown
    # A day apart, no slot waits for the one before: each fires at its own instant.
    assert all(row["fires"] == row["due"] and not row["held"] for row in rows)
    assert response.context["driftsafe_preview_zone"] == "Europe/Berlin"
    page = response.content.decode()
    assert "The next slots of the values in the form (not saved)" in page
    assert "2026-03-29 03:00:00 +02:00" in page and "UTC offset +01:00 → +02:00" in page
    assert 'name="_driftsafe_preview"' in page
    assert 'value="30"' in page  # the form as typed
    assert "errornote" not in page


@pytest.mark.django_db
def test_previewing_an_edit_shows_the_edited_slots_and_leaves_the_task_as_it_was(
    admin_client: Any, app: Any, clock: FakeClock
) -> None:
    task = crontab_task("nightly", "30 2 * * *", "Europe/Berlin", max_runs=3)
    change = reverse("admin:celery_driftsafe_periodictask_change", args=[task.pk])
    saved = slot_rows(admin_client.get(change))
    assert response_text(admin_client.get(change)).count("The next slots of the saved task") == 1
    assert [row["local"] for row in saved] == [
        "2026-03-28 02:30:00 +01:00",
        "2026-03-29 03:00:00 +02:00",
        "2026-03-30 02:30:00 +02:00",
    ]
    before = written()
    response = admin_client.post(
        change, preview_post(crontab_minute="0", crontab_hour="4", max_runs="2")
    )
    assert written() == before
    assert [row["local"] for row in slot_rows(response)] == [
        "2026-03-28 04:00:00 +01:00",
        "2026-03-29 04:00:00 +02:00",
    ]
    assert response.context["driftsafe_preview_end"] == "max runs: it reached 2 runs"
    assert "No further slot: max runs: it reached 2 runs." in response_text(response)
    PeriodicTask.objects.filter(pk=task.pk).update(enabled=False)
    assert "The task is disabled: it fires none of these" in response_text(admin_client.get(change))
    assert [row.slot for row in changes.preview(task, NOW, count=3).rows] == [
        datetime(2026, 3, 28, 1, 30, tzinfo=UTC),
        datetime(2026, 3, 29, 1, 0, tzinfo=UTC),
        datetime(2026, 3, 30, 0, 30, tzinfo=UTC),
    ]


@pytest.mark.django_db
def test_previewing_bad_values_shows_form_errors_not_slots(
    admin_client: Any, app: Any, clock: FakeClock
) -> None:
    before = written()
    response = admin_client.post(ADD, preview_post(crontab_hour="25", timezone="Mars/Olympus"))
    assert written() == before
    errors = form_errors(response)
    assert set(errors) >= {"crontab_hour", "timezone"}
    assert "driftsafe_preview" not in response.context
    assert "errornote" in response_text(response)


@pytest.mark.django_db
def test_saving_still_saves(admin_client: Any, app: Any, clock: FakeClock) -> None:
    assert admin_client.post(ADD, form_data()).status_code == 302
    assert PeriodicTask.objects.filter(name="nightly").exists()


def response_text(response: Any) -> str:
    return str(response.content.decode())
