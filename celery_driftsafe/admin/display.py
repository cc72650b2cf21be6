"""How the admin shows things to operators: instants, durations, statuses, schedules.

Instants are shown in one format on every page of the package, ``2027-01-01 01:15:00``, in
the admin's current time zone (``TIME_ZONE``, or the one activated for the request), with the
UTC value in the tooltip; each page names the zone once, under its title (the template
``admin/celery_driftsafe/times_in.html``), not in every cell. A model's date-time field shown
read-only goes through :func:`instant_field`: Django's own rendering of it
(``Jan. 1, 2027, 1:15 a.m.``) is another format. Relative texts ("in 4 s", "12 s ago") and
node liveness need the authority's *now*: :class:`AuthorityNowMixin` reads it once per admin page
and :func:`page_now` hands it to the column methods while the page renders.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextvars import ContextVar
from datetime import UTC, datetime, timedelta
from typing import Any

from django.contrib import admin
from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString

from celery_driftsafe.exceptions import ClockError, ConfigurationError, ScheduleError
from celery_driftsafe.models import STAND_IN_ANCHOR, PeriodicTask, RunStatus, ScheduleKind
from celery_driftsafe.store.clock import authority_clock

logger = logging.getLogger(__name__)

_page_now: ContextVar[datetime | None] = ContextVar("driftsafe_admin_now", default=None)

#: Status -> badge colour.
STATUS_COLOURS: dict[str, str] = {
    RunStatus.CLAIMED: "#79aec8",
    RunStatus.DISPATCHED: "#417690",
    RunStatus.STARTED: "#205067",
    RunStatus.WAITING: "#8e6fb0",
    RunStatus.SUCCEEDED: "#2e7d32",
    RunStatus.FAILED: "#ba2121",
    RunStatus.SKIPPED: "#777777",
    RunStatus.MISSED: "#c77700",
}


def read_authority() -> datetime | None:
    """One reading of the time authority, or None (logged) when it cannot be read."""
    try:
        return authority_clock().now()
    except (ClockError, ConfigurationError) as exc:
        logger.warning(
            "admin page without the authority's time: %s", exc, extra={"action": "admin-clock"}
        )
        return None


def page_now() -> datetime | None:
    """The authority's time read for the page being rendered (None outside a page)."""
    return _page_now.get()


class AuthorityNowMixin:
    """Reads the authority once per list or detail page and renders the page with it."""

    def _with_now(self, view: Any, *args: Any, **kwargs: Any) -> HttpResponse:
        token = _page_now.set(read_authority())
        try:
            response: HttpResponse = view(*args, **kwargs)
            render = getattr(response, "render", None)
            if render is not None and not getattr(response, "is_rendered", True):
                render()  # the columns read page_now() while the template renders
            return response
        finally:
            _page_now.reset(token)

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        return self._with_now(super().changelist_view, request, extra_context)  # type: ignore[misc]

    def changeform_view(
        self,
        request: HttpRequest,
        object_id: str | None = None,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        view = super().changeform_view  # type: ignore[misc]
        return self._with_now(view, request, object_id, form_url, extra_context)


# -- instants and durations ------------------------------------------------------------------


def local_text(
    value: datetime, *, milliseconds: bool = False, same_day_as: datetime | None = None
) -> str:
    """``2026-03-01 13:00:00`` in the admin's current time zone (said once on the page); only
    ``13:00:00`` when it is on the local date of ``same_day_as`` (shown next to it)."""
    local = timezone.localtime(value)
    short = same_day_as is not None and timezone.localtime(same_day_as).date() == local.date()
    text = f"{local:%H:%M:%S}" if short else f"{local:%Y-%m-%d %H:%M:%S}"
    if milliseconds:
        text += f".{local.microsecond // 1000:03d}"
    return text


def instant(
    value: datetime | None, *, milliseconds: bool = False, same_day_as: datetime | None = None
) -> SafeString | str:
    """An instant in the admin's time zone, with its UTC value as the tooltip (see
    :func:`local_text`)."""
    if value is None:
        return "—"
    utc = value.astimezone(UTC).isoformat()
    return format_html(
        '<time datetime="{}" title="{} UTC">{}</time>',
        utc,
        utc.removesuffix("+00:00"),
        local_text(value, milliseconds=milliseconds, same_day_as=same_day_as),
    )


def instant_field(
    name: str, description: str, *, milliseconds: bool = False
) -> Callable[[Any, Any], SafeString | str]:
    """A read-only admin field showing the model's date-time field ``name`` as :func:`instant`
    does. Listed under its own name in ``readonly_fields`` (the field's name would make Django
    show it in its own format)::

        due = instant_field("due_at", "due at")
    """

    @admin.display(description=description, ordering=name)
    def show(model_admin: Any, obj: Any) -> SafeString | str:
        return instant(getattr(obj, name), milliseconds=milliseconds)

    return show


def seconds_text(seconds: float) -> str:
    """``0.012 s``, ``42.5 s``, ``3 min 5 s``, ``2 h 3 min``, ``3 d 4 h`` (sign kept)."""
    sign = "-" if seconds < 0 else ""
    left = abs(seconds)
    if left < 10:
        return f"{sign}{left:.3f} s"
    if left < 60:
        return f"{sign}{left:.1f} s"
    whole = int(left)
    days, rest = divmod(whole, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{sign}{days} d {hours} h"
    if hours:
        return f"{sign}{hours} h {minutes} min"
    return f"{sign}{minutes} min {secs} s"


def duration(value: timedelta | None) -> str:
    return "—" if value is None else seconds_text(value.total_seconds())


def lateness(value: timedelta | None) -> SafeString | str:
    """Claimed minus slot; an early claim (negative) is shown in red: it must never happen."""
    if value is None:
        return "—"
    seconds = value.total_seconds()
    if seconds < 0:
        return format_html(
            '<span class="driftsafe-early" style="color:#ba2121;font-weight:bold" '
            'title="claimed before its slot">{}</span>',
            seconds_text(seconds),
        )
    return f"+{seconds_text(seconds)}"


def relative(value: datetime, now: datetime | None) -> str:
    """``in 4.000 s`` / ``12.0 s ago`` against ``now`` (empty without a reading)."""
    if now is None:
        return ""
    seconds = (value - now).total_seconds()
    return f"in {seconds_text(seconds)}" if seconds >= 0 else f"{seconds_text(-seconds)} ago"


def status_badge(status: str | None) -> SafeString | str:
    if not status:
        return "—"
    label = RunStatus(status).label if status in RunStatus.values else status
    return format_html(
        '<span class="driftsafe-status driftsafe-status-{}" style="color:#fff;background:{};'
        'padding:1px 6px;border-radius:8px;white-space:nowrap">{}</span>',
        status,
        STATUS_COLOURS.get(status, "#777777"),
        label,
    )


# -- schedules -----------------------------------------------------------------------------


def _cron_description(expression: str) -> str | None:
    """cron-descriptor's English text for ``expression``, or None if it is not installed."""
    try:
        from cron_descriptor import ExpressionDescriptor, Options
    except ImportError:
        return None
    options = Options()
    options.use_24hour_time_format = True
    options.verbose = False
    try:
        return str(ExpressionDescriptor(expression, options).get_description())
    except Exception:  # its parser is stricter in places than ours; fall back to ours
        return None


def describe_schedule(task: PeriodicTask) -> str:
    """Human-readable schedule: cron-descriptor for crontabs when installed, else the
    schedule's own ``describe()``. Raises :class:`ScheduleError` for a broken schedule."""
    schedule = task.build_schedule(anchor=STAND_IN_ANCHOR)
    if task.schedule_kind == ScheduleKind.CRONTAB:
        # cron-descriptor reads six fields with the seconds first, like us.
        expression = " ".join(
            str(getattr(task, f"crontab_{name}")).strip()
            for name in ("second", "minute", "hour", "day_of_month", "month_of_year", "day_of_week")
            if name != "second" or str(task.crontab_second or "0").strip() != "0"
        )
        text = _cron_description(expression)
        if text:
            return f"{text} ({task.timezone})"
    if task.schedule_kind == ScheduleKind.ONE_OFF and task.one_off_at is not None:
        return f"once at {local_text(task.one_off_at)}"
    return schedule.describe()


def schedule_cell(task: PeriodicTask) -> SafeString | str:
    try:
        return describe_schedule(task)
    except (ScheduleError, ValueError, OverflowError, TypeError) as exc:  # a row written
        # behind save() (raw SQL, QuerySet.update): the page shows it broken, not a 500
        return format_html('<span style="color:#ba2121">invalid: {}</span>', str(exc))
