"""One date-time format on every admin page of the package: ``2027-01-01 01:15:00`` (with
milliseconds where they matter, or only the time next to an instant of the same day), in the
admin's time zone, which each page names once. Django's own rendering of a date-time field
(``Jan. 1, 2027, 1:15 a.m.``) appears nowhere."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
from django.contrib import admin
from django.db import models
from django.test import override_settings
from django.urls import reverse

from celery_driftsafe.definitions import changes
from celery_driftsafe.models import BeatNode, PeriodicTask, Run
from tests.support.cluster_data import seed_cluster

#: Django's DATETIME_FORMAT ("N j, Y, P") and DATE_FORMAT ("N j, Y") in English.
DJANGO_DATE = re.compile(
    r"\b(Jan|Feb|March|April|May|June|July|Aug|Sept|Oct|Nov|Dec)\.? \d{1,2}, \d{4}"
)
#: What an instant's cell shows: the date and time, or only the time (same day as its row).
ONE_FORMAT = re.compile(r"(\d{4}-\d\d-\d\d )?\d\d:\d\d:\d\d(\.\d{3})?")
ZONE_IN_CELL = re.compile(r"\d\d:\d\d:\d\d(\.\d{3})? (UTC|[A-Z]{2,4}T)\b")
TIME_TAG = re.compile(r'<time datetime="[^"]+" title="[^"]+ UTC">([^<]*)</time>')


def _pages() -> dict[str, str]:
    """The package's admin pages, with every date-time field of their rows set."""
    now = changes.authority_now()
    seeded = seed_cluster(now)
    task = seeded.tasks[0]
    PeriodicTask.objects.filter(pk=task.pk).update(
        stale_since=now - timedelta(hours=1),
        valid_from=now - timedelta(days=1),
        valid_until=now + timedelta(days=30),
        max_runs=1000,
    )
    run = Run.objects.filter(periodic_task=task).order_by("-slot").first()
    assert run is not None
    Run.objects.filter(pk=run.pk).update(
        expires_at=now + timedelta(minutes=5),
        lease_until=now + timedelta(seconds=30),
        late_at=now,
        retry_at=now,
    )
    node = seeded.nodes[0]
    BeatNode.objects.filter(pk=node.pk).update(
        stopped_at=now, claiming_since=now - timedelta(hours=2)
    )
    return {
        "task list": reverse("admin:celery_driftsafe_periodictask_changelist"),
        "task page": reverse("admin:celery_driftsafe_periodictask_change", args=[task.pk]),
        "run list": reverse("admin:celery_driftsafe_run_changelist"),
        "run page": reverse("admin:celery_driftsafe_run_change", args=[run.pk]),
        "node list": reverse("admin:celery_driftsafe_beatnode_changelist"),
        "node page": reverse("admin:celery_driftsafe_beatnode_change", args=[node.pk]),
        "dashboard": reverse("admin:celery_driftsafe_dashboard"),
    }


@pytest.mark.django_db
@override_settings(TIME_ZONE="Europe/Berlin")
def test_every_page_shows_instants_in_one_format_and_names_the_zone_once(
    admin_client: Any, app: Any
) -> None:
    for name, url in _pages().items():
        response = admin_client.get(url)
        assert response.status_code == 200, name
        html = response.content.decode()
        assert not DJANGO_DATE.search(html), (name, DJANGO_DATE.search(html))
        assert "a.m." not in html and "p.m." not in html, name
        assert html.count("Times in Europe/Berlin") == 1, name
        # a zone in a cell ("12:00:00 CET"): the zone is said once, above
        visible = re.sub(r"<[^>]*>", " ", html)  # not the UTC tooltips
        assert not ZONE_IN_CELL.search(visible), (name, ZONE_IN_CELL.search(visible))
        shown = TIME_TAG.findall(html)
        if name == "dashboard":  # drawn as text, not <time> elements
            shown = re.findall(r"authority time</small><b>([^<]*)</b>", html)
        assert shown, name
        for text in shown:
            assert ONE_FORMAT.fullmatch(text), (name, text)


@pytest.mark.django_db
def test_the_task_page_shows_its_instants_in_the_one_format(admin_client: Any, app: Any) -> None:
    pages = _pages()
    html = admin_client.get(pages["task page"]).content.decode()
    for label in (
        "Due at",
        "Last slot",
        "Stale since",
        "Interval anchor",
        "Created",
        "Changed",
        "Last run",
        "Bounds and limits",
    ):
        assert f"<label>{label}:</label>" in html, label
    # each of the task's instants, as the list shows them
    task = PeriodicTask.objects.get(name="refresh-cache")
    for value in (task.due_at, task.stale_since, task.interval_anchor, task.created_at):
        assert value is not None
        assert f'<time datetime="{value.isoformat()}"' in html


def test_no_package_admin_shows_a_date_time_field_in_django_s_format() -> None:
    """A model's ``DateTimeField`` named in ``list_display``, ``readonly_fields`` or a
    read-only admin's ``fields`` is rendered by Django (``Jan. 1, 2027, 1:15 a.m.``): the
    package's admins show them through ``display.instant_field`` instead."""
    found = []
    for model, model_admin in admin.site._registry.items():
        if model._meta.app_label != "celery_driftsafe":
            continue
        admins = [model_admin, *(inline(model, admin.site) for inline in model_admin.inlines)]
        for shown_by in admins:
            names = [*getattr(shown_by, "list_display", ()), *shown_by.readonly_fields]
            fields = {field.name: field for field in shown_by.model._meta.get_fields()}
            found += [
                f"{type(shown_by).__name__}.{name}"
                for name in names
                if isinstance(fields.get(name), models.DateTimeField)
            ]
    assert found == []
