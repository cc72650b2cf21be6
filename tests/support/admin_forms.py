"""The admin's task form as the tests post it: its URLs, a valid add-form POST, the errors of
a form shown again."""

from __future__ import annotations

from typing import Any

from django.urls import reverse

TASKS = reverse("admin:celery_driftsafe_periodictask_changelist")
ADD = reverse("admin:celery_driftsafe_periodictask_add")
RUNS = reverse("admin:celery_driftsafe_run_changelist")


def form_data(**overrides: Any) -> dict[str, Any]:
    """A valid add-form POST for a crontab task; ``overrides`` replace fields."""
    data: dict[str, Any] = {
        "name": "nightly",
        "task": "tests.add",
        "args": "[1, 2]",
        "kwargs": "{}",
        "enabled": "on",
        "disabled_reason": "",
        "schedule_kind": "crontab",
        "interval_every": "",
        "interval_unit": "seconds",
        "crontab_minute": "*/15",
        "crontab_hour": "*",
        "crontab_day_of_month": "*",
        "crontab_month_of_year": "*",
        "crontab_day_of_week": "*",
        "timezone": "Europe/Berlin",
        "one_off_at_0": "",
        "one_off_at_1": "",
        "misfire_policy": "",
        "misfire_grace_seconds": "",
        "overlap_policy": "allow",
        "queue": "",
        "exchange": "",
        "routing_key": "",
        "priority": "",
        "expires_seconds": "",
        "headers": "{}",
        "_save": "Save",
    }
    data.update(overrides)
    return {k: v for k, v in data.items() if v is not None}


def form_errors(response: Any) -> dict[str, list[str]]:
    assert response.status_code == 200, "an invalid form is shown again, not saved"
    return {k: list(v) for k, v in response.context["adminform"].form.errors.items()}
