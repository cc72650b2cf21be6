"""The admin and ``pause_after_failures``: the field and its help, the count shown, a clear
error for a bad value, and re-enabling (the form or the action) clearing the count."""

from __future__ import annotations

from typing import Any

import pytest
from django.urls import reverse

from celery_driftsafe.claim.pausing import pause_reason
from celery_driftsafe.models import PeriodicTask, disabled_by_scheduler
from tests.support import T0
from tests.support.admin_forms import ADD, TASKS, form_data, form_errors
from tests.support.factories import crontab_task

pytestmark = pytest.mark.django_db


def _paused(name: str = "nightly") -> PeriodicTask:
    """A task as a pause leaves it (see celery_driftsafe.claim.pausing)."""
    task = crontab_task(name, "*/15 * * * *", timezone="Europe/Berlin", pause_after_failures=3)
    PeriodicTask.objects.filter(pk=task.pk).update(
        enabled=False,
        disabled_reason=disabled_by_scheduler(pause_reason(3, 3, T0)),
        consecutive_failures=3,
        next_slot_at=None,
        due_at=None,
    )
    task.refresh_from_db()
    return task


def test_the_form_shows_the_field_its_help_and_the_count(admin_client: Any, app: Any) -> None:
    task = _paused()
    page = admin_client.get(
        reverse("admin:celery_driftsafe_periodictask_change", args=[task.pk])
    ).content.decode()
    assert 'name="pause_after_failures"' in page and 'value="3"' in page
    assert "Disable (pause) the task once this many of its runs in a row ended failed" in page
    assert "Consecutive failures" in page and "paused after 3 failed or missed runs" in page
    assert 'name="consecutive_failures"' not in page  # shown, not editable


def test_a_new_task_saves_its_limit_and_a_bad_one_is_an_error_on_the_field(
    admin_client: Any, app: Any
) -> None:
    errors = form_errors(admin_client.post(ADD, form_data(pause_after_failures="-2")))
    assert list(errors) == ["pause_after_failures"]
    assert "whole number of failed or missed runs in a row" in errors["pause_after_failures"][0]
    assert not PeriodicTask.objects.exists()
    errors = form_errors(admin_client.post(ADD, form_data(pause_after_failures="many")))
    assert list(errors) == ["pause_after_failures"]
    assert admin_client.post(ADD, form_data(pause_after_failures="5")).status_code == 302
    assert PeriodicTask.objects.get(name="nightly").pause_after_failures == 5


def test_re_enabling_in_the_form_clears_the_count(admin_client: Any, app: Any) -> None:
    task = _paused()
    change = reverse("admin:celery_driftsafe_periodictask_change", args=[task.pk])
    shown = {
        "initial-enabled": "False",
        "initial-disabled_reason": task.disabled_reason,
        "disabled_reason": task.disabled_reason,
        "pause_after_failures": "3",
    }
    response = admin_client.post(change, form_data(**shown))
    assert response.status_code == 302, form_errors(response)
    task.refresh_from_db()
    assert (task.enabled, task.consecutive_failures, task.disabled_reason) == (True, 0, "")
    assert task.next_slot_at is not None


def test_re_enabling_by_the_action_clears_the_count(admin_client: Any, app: Any) -> None:
    task = _paused()
    response = admin_client.post(
        TASKS, {"action": "enable_tasks", "_selected_action": [task.pk]}, follow=True
    )
    assert response.status_code == 200
    task.refresh_from_db()
    assert (task.enabled, task.consecutive_failures, task.disabled_reason) == (True, 0, "")
