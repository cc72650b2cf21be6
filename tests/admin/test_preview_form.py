"""The task form's "Preview the next slots" button and the change page's table of the next
slots, through Django's test client."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.contrib.admin.models import LogEntry
from django.core import signing
from django.urls import reverse

from celery_driftsafe.admin.forms import PREVIEW_ANCHOR, PREVIEW_BUTTON
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


#: An instant with a fraction of a second: a new interval's anchor, and so its slots, have one.
FINE_NOW = datetime(2026, 3, 27, 12, 0, 0, 250_000, tzinfo=UTC)


def interval_post(**overrides: Any) -> dict[str, Any]:
    """A new interval task every second with a jitter of 3 s (three periods), ten runs."""
    values = {
        "name": "tight",
        "schedule_kind": "interval",
        "interval_every": "1",
        "interval_unit": "seconds",
        "jitter_seconds": "3",
        "max_runs": "10",
        **overrides,
    }
    return form_data(**values)


@pytest.mark.django_db
def test_a_preview_taken_before_a_save_is_what_the_beat_fires_after_it(
    admin_client: Any, app: Any, driftsafe_clock: FakeClock, driftsafe: Any
) -> None:
    """Preview a new interval task (1 s, jitter 3 s), let time pass, save the form the preview
    was shown in, and let the beat fire: the ledger has the previewed slots, each claimed and
    dispatched at the instant the preview said it fires, which for the slots held behind the
    one before is later than their own due instant."""
    driftsafe_clock.set(FINE_NOW)
    data = interval_post()
    previewed = admin_client.post(ADD, {**preview_post(**data)})
    form = previewed.context["adminform"].form
    preview = form.preview
    assert preview is not None and len(preview.rows) == 10
    assert preview.end == "max runs: it reached 10 runs"
    assert preview.anchor == FINE_NOW  # counted from the preview's instant
    page = response_text(previewed)
    assert "The interval counts from 2026-03-27 12:00:00.25 UTC" in page
    assert [row["utc"] for row in slot_rows(previewed)][:2] == [
        "2026-03-27 12:00:01.25",
        "2026-03-27 12:00:02.25",
    ]
    held = [row for row in preview.rows if row.held]
    assert held, "a jitter of three periods holds some slot behind the one before"
    for row, shown in zip(preview.rows, slot_rows(previewed), strict=True):
        assert shown["fires"] == row.fires_text
        assert shown["held"] == (f"held: due {row.due_text}, fires with the slot before" * row.held)

    # Time passes before Save is pressed; the page hands the preview's anchor back.
    driftsafe_clock.advance(0.6)
    token = previewed.context["driftsafe_preview_anchor_token"]
    assert f'name="{PREVIEW_ANCHOR}" value="{token}"' in page
    saved = admin_client.post(ADD, {**data, PREVIEW_ANCHOR: token})
    assert saved.status_code == 302
    task = PeriodicTask.objects.get(name="tight")
    assert task.interval_anchor == FINE_NOW
    assert task.next_slot_at == preview.rows[0].slot

    driftsafe.advance_to(preview.rows[-1].fires_at + timedelta(seconds=5))
    runs = list(driftsafe.runs("tight").values("slot", "claimed_at", "dispatched_at"))
    assert [run["slot"] for run in runs] == [row.slot for row in preview.rows]
    for run, row in zip(runs, preview.rows, strict=True):
        assert run["claimed_at"] >= row.due  # never before its own instant
        assert run["claimed_at"] == row.fires_at  # at the instant previewed
        assert run["dispatched_at"] == row.fires_at
    published = [m.published_at for m in driftsafe.messages("tight")]
    assert published == [row.fires_at for row in preview.rows]
    # The instants the preview showed as due are not those of the held slots: the old preview
    # (their own due instants) would have promised them earlier than they fire.
    assert [run["claimed_at"] for run in runs] != [row.due for row in preview.rows]


@pytest.mark.django_db
def test_saving_without_the_previews_anchor_counts_from_the_save(
    admin_client: Any, app: Any, clock: FakeClock
) -> None:
    """Without a preview (or with an anchor not signed by the preview, or one after now) the
    save anchors the interval at its own now, as before."""
    clock.set(FINE_NOW)
    assert admin_client.post(ADD, interval_post()).status_code == 302
    assert PeriodicTask.objects.get(name="tight").interval_anchor == FINE_NOW
    for forged in ("2026-03-27T11:00:00+00:00", signing.dumps("2026-03-27T13:00:00+00:00")):
        PeriodicTask.objects.all().delete()
        clock.advance(1)
        posted = admin_client.post(ADD, {**interval_post(), PREVIEW_ANCHOR: forged})
        assert posted.status_code == 302
        assert PeriodicTask.objects.get(name="tight").interval_anchor == clock.now()


@pytest.mark.django_db
def test_a_previews_anchor_is_kept_through_another_preview_and_a_submit_with_errors(
    admin_client: Any, app: Any, clock: FakeClock
) -> None:
    clock.set(FINE_NOW)
    first = admin_client.post(ADD, preview_post(**interval_post()))
    token = first.context["driftsafe_preview_anchor_token"]
    clock.advance(0.5)
    again = admin_client.post(ADD, {**preview_post(**interval_post()), PREVIEW_ANCHOR: token})
    assert again.context["adminform"].form.preview.anchor is None  # the carried one is used
    assert [row["utc"] for row in slot_rows(again)] == [row["utc"] for row in slot_rows(first)]
    assert "The interval counts from 2026-03-27 12:00:00.25 UTC" in response_text(again)
    wrong = admin_client.post(ADD, {**interval_post(max_runs="0"), PREVIEW_ANCHOR: token})
    assert set(form_errors(wrong)) == {"max_runs"}
    carried = wrong.context["driftsafe_preview_anchor_token"]
    clock.advance(0.5)
    assert admin_client.post(ADD, {**interval_post(), PREVIEW_ANCHOR: carried}).status_code == 302
    assert PeriodicTask.objects.get(name="tight").interval_anchor == FINE_NOW


@pytest.mark.django_db
def test_saving_still_saves(admin_client: Any, app: Any, clock: FakeClock) -> None:
    assert admin_client.post(ADD, form_data()).status_code == 302
    assert PeriodicTask.objects.filter(name="nightly").exists()


def response_text(response: Any) -> str:
    return str(response.content.decode())
