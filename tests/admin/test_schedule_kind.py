"""The task form asks for the schedule kind first: nothing chosen and nothing of a kind filled
in on the add page, each kind's inputs in a section of their own (the page's script shows the
chosen kind's only: see test_browser.py), and only the chosen kind's inputs read."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.urls import reverse

from celery_driftsafe.admin.forms import PREVIEW_BUTTON
from celery_driftsafe.models import PeriodicTask
from celery_driftsafe.models.schedule_fields import CRONTAB_FIELDS, KIND_INPUTS
from tests.support import T0
from tests.support.admin_forms import ADD, form_data, form_errors
from tests.support.factories import crontab_task, interval_task

KINDS = ("interval", "crontab", "one_off", "solar")


def _form(response: Any) -> Any:
    return response.context["adminform"].form


def _section(html: str, kind: str) -> str:
    """The HTML of a kind's fieldset."""
    start = html.index(f"driftsafe-kind-{kind}")
    return html[start : html.index("</fieldset>", start)]


@pytest.mark.django_db
def test_the_add_form_has_no_kind_chosen_and_nothing_of_a_kind_filled_in(
    admin_client: Any, app: Any
) -> None:
    response = admin_client.get(ADD)
    html = response.content.decode()
    form = _form(response)
    assert form["schedule_kind"].value() in ("", None)
    radios = re.findall(r'<input type="radio" name="schedule_kind"[^>]*>', html)
    assert len(radios) == 4 and not any("checked" in radio for radio in radios)
    for name in (*CRONTAB_FIELDS, "interval_every", "interval_unit", "solar_event"):
        assert form[name].value() in ("", None), name
    # every kind's inputs in a section of its own, and the script that shows the chosen one
    for kind in KINDS:
        section = _section(html, kind)
        for name in KIND_INPUTS[kind]:
            assert f'name="{name}' in section, (kind, name)
    assert 'name="timezone"' in _section(html, "crontab")
    assert "celery_driftsafe/schedule_kind.js" in html
    # the kind comes before its inputs
    assert html.index('name="schedule_kind"') < html.index('name="interval_every"')


@pytest.mark.django_db
def test_a_missing_kind_is_an_error_on_the_kind_and_nothing_is_saved(
    admin_client: Any, app: Any
) -> None:
    for button in ("_save", PREVIEW_BUTTON):
        data = form_data(schedule_kind=None, crontab_minute="", _save=None)
        data[button] = "x"
        errors = form_errors(admin_client.post(ADD, data))
        assert errors == {
            "schedule_kind": [
                "Choose how the task is scheduled: interval, crontab, one-off or solar."
            ]
        }, button
    assert not PeriodicTask.objects.exists()


@pytest.mark.django_db
def test_each_kind_s_missing_inputs_are_errors_on_those_fields(admin_client: Any, app: Any) -> None:
    empty = {name: "" for name in (*CRONTAB_FIELDS, "interval_unit")}
    expected = {
        "interval": {"interval_every", "interval_unit"},
        "crontab": set(CRONTAB_FIELDS) - {"crontab_second"},  # "is empty; write '*' …"
        "one_off": {"one_off_at"},
        "solar": {"solar_event", "solar_latitude", "solar_longitude"},
    }
    for kind, fields in expected.items():
        errors = form_errors(admin_client.post(ADD, form_data(schedule_kind=kind, **empty)))
        assert set(errors) == fields, (kind, errors)
    errors = form_errors(
        admin_client.post(ADD, form_data(schedule_kind="interval", interval_every="5", **empty))
    )
    assert errors == {"interval_unit": ["Choose the unit of the interval."]}


@pytest.mark.django_db
def test_the_inputs_of_the_other_kinds_are_not_read(admin_client: Any, app: Any) -> None:
    """A page without JavaScript shows every kind's inputs: what was typed into another kind's
    is neither an error nor saved."""
    response = admin_client.post(
        ADD,
        form_data(
            schedule_kind="interval",
            interval_every="30",
            crontab_minute="99",  # out of range: an error if it were read
            crontab_hour="",
            solar_latitude="north",
            one_off_at_0="someday",
            one_off_at_1="",
        ),
    )
    assert response.status_code == 302, form_errors(response)
    task = PeriodicTask.objects.get(name="nightly")
    assert (task.schedule_kind, task.interval_every, task.interval_unit) == (
        "interval",
        30,
        "seconds",
    )
    # the other kinds' fields hold the model's defaults, as for a task saved from code
    assert (task.crontab_minute, task.crontab_hour, task.solar_latitude, task.one_off_at) == (
        "*",
        "*",
        None,
        None,
    )


@pytest.mark.django_db
def test_a_change_keeps_what_the_task_has_in_the_other_kinds_fields(
    admin_client: Any, app: Any
) -> None:
    task = crontab_task("report", "0 3 * * *", timezone="Europe/Berlin")
    change = reverse("admin:celery_driftsafe_periodictask_change", args=[task.pk])
    response = admin_client.post(
        change,
        form_data(
            name="report",
            schedule_kind="interval",
            interval_every="10",
            interval_unit="minutes",
            crontab_minute="",
            crontab_hour="",
        ),
    )
    assert response.status_code == 302, form_errors(response)
    task.refresh_from_db()
    assert (task.schedule_kind, task.interval_every, task.interval_unit) == (
        "interval",
        10,
        "minutes",
    )
    assert (task.crontab_minute, task.crontab_hour) == ("0", "3")


@pytest.mark.django_db
@pytest.mark.parametrize("kind", ["interval", "crontab"])
def test_the_change_form_opens_on_the_task_s_own_kind(
    admin_client: Any, app: Any, kind: str
) -> None:
    task = (
        interval_task("tick", 60, anchor=T0)
        if kind == "interval"
        else crontab_task("tock", "0 3 * * *", timezone="UTC")
    )
    html = admin_client.get(
        reverse("admin:celery_driftsafe_periodictask_change", args=[task.pk])
    ).content.decode()
    radios = re.findall(r'<input type="radio" name="schedule_kind"[^>]*>', html)
    assert [radio for radio in radios if "checked" in radio] == [
        next(radio for radio in radios if f'value="{kind}"' in radio)
    ]
