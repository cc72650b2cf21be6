"""The calendars' admin: shared excluded dates ("public holidays DE"), each with the tasks on
it. Saving one moves the next slot of every task on it (see
:mod:`celery_driftsafe.definitions.calendars`)."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin

from celery_driftsafe.admin.forms import DatesField
from celery_driftsafe.models import Calendar


class CalendarForm(forms.ModelForm):  # type: ignore[type-arg]
    """Dates typed one a line or separated by commas; the crontab checked by our parser."""

    class Meta:
        model = Calendar
        fields = ["name", "description", "dates", "crontab"]
        field_classes = {"dates": DatesField}
        widgets = {
            "description": forms.Textarea(attrs={"rows": 2, "cols": 60}),
            "dates": forms.Textarea(attrs={"rows": 8, "cols": 30}),
        }


class CalendarAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    form = CalendarForm
    list_display = ("name", "date_count", "first_date", "last_date", "crontab", "task_count")
    search_fields = ("name", "description")
    readonly_fields = ("tasks_on_it",)
    fieldsets = (
        (None, {"fields": ("name", "description")}),
        (
            "Excluded",
            {
                "fields": ("dates", "crontab"),
                "description": "Read in the time zone of each task on the calendar. Saving "
                "moves the next slot of every task on it.",
            },
        ),
        ("Tasks", {"fields": ("tasks_on_it",)}),
    )

    @admin.display(description="dates")
    def date_count(self, calendar: Calendar) -> int:
        return len(calendar.dates or [])

    @admin.display(description="first")
    def first_date(self, calendar: Calendar) -> str:
        return min(calendar.dates) if calendar.dates else "—"

    @admin.display(description="last")
    def last_date(self, calendar: Calendar) -> str:
        return max(calendar.dates) if calendar.dates else "—"

    @admin.display(description="tasks")
    def task_count(self, calendar: Calendar) -> int:
        return calendar.tasks.count()

    @admin.display(description="tasks on it")
    def tasks_on_it(self, calendar: Calendar) -> Any:
        if calendar._state.adding:
            return "none yet (choose it on a task's page once saved)"
        names = list(calendar.tasks.order_by("name").values_list("name", flat=True)[:50])
        return ", ".join(names) or "none yet (choose it on a task's page)"
