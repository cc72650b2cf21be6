"""Admin of periodic tasks: what runs next, what ran last and how late, and the form.

The list costs a fixed number of queries however many runs the ledger holds: each task's latest
run is found by a correlated sub-query on the unique ``(periodic_task, slot)`` index (read
backwards), and the page's runs are then read in one query (:class:`LastRunChangeList`).

Every write goes through :mod:`celery_driftsafe.definitions.changes`: the form saves the model
(its signals recompute the next slot once and wake the beats).

The common chores are actions: enable, disable, run now, backfill (a page for the range, the
slots it runs and skips, and a confirmation), reset schedule, and the "Run now"
button of a task's change page. The bulk actions use ``QuerySet.update()`` and therefore call
:func:`changes.reschedule` / :func:`changes.notify` themselves (a form's save goes through the
model's signals instead). Every action is written to Django's admin history (``LogEntry``) for
each task it changed, like an edit, and to the log.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any
from zoneinfo import ZoneInfo

from django.contrib import admin, messages
from django.contrib.admin.utils import unquote
from django.contrib.admin.views.main import ChangeList
from django.core.exceptions import PermissionDenied
from django.db import transaction
from django.db.models import OuterRef, QuerySet, Subquery
from django.http import HttpRequest, HttpResponse, HttpResponseNotAllowed, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html
from django.utils.safestring import SafeString

from celery_driftsafe.admin.display import (
    AuthorityNowMixin,
    instant,
    instant_field,
    lateness,
    local_text,
    page_now,
    relative,
    schedule_cell,
    status_badge,
)
from celery_driftsafe.admin.forms import (
    PREVIEW_ANCHOR,
    PREVIEW_BUTTON,
    PREVIEW_COUNT,
    PeriodicTaskForm,
)
from celery_driftsafe.celery_app import get_celery_app
from celery_driftsafe.conf import get_settings
from celery_driftsafe.core.preview import Preview, instant_text
from celery_driftsafe.core.stored_names import MAX_WAITING
from celery_driftsafe.definitions import changes
from celery_driftsafe.exceptions import (
    ClockError,
    ConfigurationError,
    ScheduleError,
    TaskModulesError,
    TaskRefused,
)
from celery_driftsafe.models import (
    PeriodicTask,
    Run,
    RunStatus,
    ScheduleKind,
    unreadable_instants,
)
from celery_driftsafe.models.schedule_fields import KIND_INPUTS
from celery_driftsafe.publish.backfill import (
    BackfillPlan,
    backfill_actor,
    parse_instant,
    plan_backfill,
    run_backfill,
)
from celery_driftsafe.publish.run_now import admin_actor, run_now
from celery_driftsafe.store.clock import authority_clock

if TYPE_CHECKING:
    from django.contrib.admin.options import _FieldOpts

#: The log of the admin's actions on tasks (``admin-enable``, ``admin-disable``, ``admin-reset``).
logger = logging.getLogger("celery_driftsafe.admin.task_actions")


def _schedulable(tasks: list[PeriodicTask]) -> tuple[list[PeriodicTask], list[str]]:
    """Split tasks into those that can fire and the messages for the others (the same checks
    as ``save()`` and the claim: schedule, JSON shapes, options)."""
    good, bad = [], []
    for task in tasks:
        problems = task.publish_problems()
        if problems:
            bad.append(f"{task.name}: " + "; ".join(map(str, problems)))
        else:
            good.append(task)
    return good, bad


def _last_run(field: str) -> Subquery:
    # The unique (periodic_task, slot) index read backwards: one index probe a task, where
    # "NULLS LAST" (not the index's order) sorted every run of the task.
    runs = Run.objects.filter(periodic_task=OuterRef("pk"), slot__isnull=False).order_by(
        "-slot", "-id"
    )
    return Subquery(runs.values(field)[:1])


class LastRunStatusFilter(admin.SimpleListFilter):
    """Filter tasks by the status of their latest run (or "never ran")."""

    title = "last run status"
    parameter_name = "last_run"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("never", "Never ran"), *((s.value, s.label) for s in RunStatus)]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        # An alias, not an annotation: the status is compared in the WHERE clause and not
        # selected again (the page's runs are read by LastRunChangeList).
        latest: QuerySet[Any] = queryset.alias(last_status=_last_run("status"))
        if value == "never":
            return latest.filter(last_status__isnull=True)
        if value in RunStatus.values:
            return latest.filter(last_status=value)
        return queryset


class StaleFilter(admin.SimpleListFilter):
    """Tasks none of whose last ``STALE_AFTER_SLOTS`` slots past their deadline succeeded."""

    title = "deadline"
    parameter_name = "stale"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("yes", "stale (no success in its last slots)")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.value() == "yes":
            return queryset.filter(stale_since__isnull=False)
        return queryset


class LastRunChangeList(ChangeList):
    """The task list reads each listed task's latest run in one query after the page is
    known (by the ids its one sub-query selected), not with a sub-query per column that the
    database evaluates also for every row an ``OFFSET`` skips."""

    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)
        try:
            listed = list(self.result_list)
        except (ValueError, TypeError, AttributeError):  # Django's reading of a stored instant
            broken = unreadable_instants(self.queryset.db)
            if not broken:
                raise
            # Rows written behind save() (raw SQL on SQLite) that Django cannot read are
            # named above the list, with what is wrong, and the list shows the others.
            names = dict(
                PeriodicTask.objects.using(self.queryset.db)
                .filter(pk__in=broken)
                .values_list("pk", "name")
            )
            for pk, problem in sorted(broken.items()):
                messages.error(
                    request,
                    f"Task {names.get(pk, pk)!r} (id {pk}) cannot be read and is not listed: "
                    f"{problem}. Correct the column with SQL, or delete the task.",
                )
            self.queryset = self.queryset.exclude(pk__in=broken)
            super().get_results(request)
            listed = list(self.result_list)
        ids = [task.last_run_pk for task in listed if task.last_run_pk is not None]
        runs = Run.objects.only("status", "slot", "claimed_at", "claimed_by").in_bulk(ids)
        for task in self.result_list:
            task.last_run_row = runs.get(task.last_run_pk)


def _kind_fieldset(
    kind: str, title: str, fields: tuple[Any, ...], description: str
) -> tuple[str, _FieldOpts]:
    """The section of one schedule kind's inputs, shown by the page's script (and by Django
    without it) when that kind is chosen: ``static/celery_driftsafe/schedule_kind.js``."""
    return (
        title,
        {
            "classes": ("driftsafe-kind", f"driftsafe-kind-{kind}"),
            "fields": fields,
            "description": description,
        },
    )


class PeriodicTaskAdmin(AuthorityNowMixin, admin.ModelAdmin):  # type: ignore[type-arg]
    """The periodic tasks' admin: the list, the form, the actions and the "Run now" view (see
    the module docstring)."""

    form = PeriodicTaskForm
    #: The columns a user scans, narrow enough for a laptop's screen without scrolling
    #: sideways; the task's path, time zone, bounds and limits, lateness and staleness are on
    #: its page (and the last two are filters).
    list_display = ("name", "schedule_text", "enabled", "next_slot", "last_run")
    list_display_links = ("name",)
    list_filter = (
        "enabled",
        "schedule_kind",
        LastRunStatusFilter,
        StaleFilter,
        "source",
        "timezone",
    )
    search_fields = ("name", "task")
    list_per_page = 100
    show_full_result_count = False
    actions = ("enable_tasks", "disable_tasks", "run_now", "backfill", "reset_schedule")
    radio_fields = {"schedule_kind": admin.VERTICAL}
    filter_horizontal = ("calendars",)
    readonly_fields = (
        "schedule_text",
        "next_slot",
        "due",
        "last_slot",
        "last_outcome",
        "waiting",
        "limits",
        "run_count",
        "consecutive_failures",
        "stale",
        "anchor",
        "source",
        "source_app",
        "created",
        "changed",
    )
    fieldsets = (
        (
            None,
            {
                "fields": (
                    "name",
                    "description",
                    "task",
                    "args",
                    "kwargs",
                    "enabled",
                    "disabled_reason",
                )
            },
        ),
        (
            "Schedule",
            {
                "fields": ("schedule_kind",),
                # Django shows a fieldset's description as HTML.
                "description": "Choose how the task is scheduled; the inputs of that kind "
                "follow.<noscript> Without JavaScript every kind's inputs are shown below: only "
                "the chosen kind's are read.</noscript>",
            },
        ),
        _kind_fieldset(
            ScheduleKind.INTERVAL,
            "Interval",
            (KIND_INPUTS[ScheduleKind.INTERVAL],),
            "Every N units, counted from the first save (or from valid from).",
        ),
        _kind_fieldset(
            ScheduleKind.CRONTAB,
            "Crontab",
            (KIND_INPUTS[ScheduleKind.CRONTAB], "timezone"),
            "Cron fields (* for every value), read in the time zone; the seconds are optional "
            "(empty: 0). A whole expression such as 0 3 * * * or @daily may be typed into the "
            "minute field alone.",
        ),
        _kind_fieldset(
            ScheduleKind.ONE_OFF,
            "One-off",
            KIND_INPUTS[ScheduleKind.ONE_OFF],
            "Runs once, at this instant.",
        ),
        _kind_fieldset(
            ScheduleKind.SOLAR,
            "Solar",
            (KIND_INPUTS[ScheduleKind.SOLAR],),
            "An event of the sun at a latitude and longitude.",
        ),
        (
            "Bounds and limits",
            {
                "fields": (
                    ("valid_from", "valid_until"),
                    ("run_once", "max_runs"),
                    "jitter_seconds",
                ),
                "description": "Optional. Slots outside [valid from, valid until) never fire; a "
                "task that fired its one run (run once) or reached max runs, or "
                "whose valid until has passed, is disabled by the scheduler with "
                "the reason. Jitter spreads each run over the first seconds of its "
                "slot, at an instant every beat computes alike.",
            },
        ),
        (
            "Excluded dates",
            {
                "fields": ("excluded_dates", "calendars"),
                "description": "Optional. No slot on these dates (in the task's time zone), or "
                "on a date or at a time of the chosen calendars, fires; such a slot is not "
                "recorded missed either: it is not a slot. Dates one a line or separated by "
                "commas, as YYYY-MM-DD.",
            },
        ),
        (
            "Policies",
            {
                "fields": (
                    "misfire_policy",
                    "misfire_grace_seconds",
                    "overlap_policy",
                    "deadline_seconds",
                    "pause_after_failures",
                ),
            },
        ),
        (
            "Publishing",
            {
                "classes": ("collapse",),
                "fields": (
                    "queue",
                    "exchange",
                    "routing_key",
                    "priority",
                    "expires_seconds",
                    "headers",
                ),
            },
        ),
        ("State", {"fields": readonly_fields}),
    )

    class Media:
        js = ("celery_driftsafe/schedule_kind.js",)

    def get_fieldsets(self, request: HttpRequest, obj: Any = None) -> Any:
        """No "State" section on the add page: a new task has none yet."""
        fieldsets = super().get_fieldsets(request, obj)
        return fieldsets if obj is not None else fieldsets[:-1]

    def get_queryset(self, request: HttpRequest) -> QuerySet[PeriodicTask]:
        queryset: QuerySet[PeriodicTask] = super().get_queryset(request)
        return queryset.annotate(last_run_pk=_last_run("pk"))

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return LastRunChangeList

    def get_object(
        self, request: HttpRequest, object_id: str, from_field: str | None = None
    ) -> PeriodicTask | None:
        """The task, or None; for a task Django cannot read (an instant column written with
        raw SQL on SQLite), which Django reports as missing, a message says what is wrong."""
        task: PeriodicTask | None = super().get_object(request, object_id, from_field)
        if task is None and from_field is None and object_id.isdigit():
            problem = unreadable_instants(self.get_queryset(request).db).get(int(object_id))
            if problem is not None:
                messages.error(
                    request,
                    f"Task id {object_id} cannot be read: {problem}. Correct the column with "
                    "SQL, or delete the task.",
                )
        return task

    # -- columns ------------------------------------------------------------------------------

    @admin.display(description="schedule")
    def schedule_text(self, task: PeriodicTask) -> SafeString | str:
        return schedule_cell(task)

    @admin.display(description="next slot", ordering="next_slot_at")
    def next_slot(self, task: PeriodicTask) -> SafeString | str:
        if task.next_slot_at is None:
            return "—"
        when = relative(task.next_slot_at, page_now())
        style = "" if task.enabled else "color:#999"
        return format_html(
            '<span style="{}">{}</span><br><small>{}</small>',
            style,
            instant(task.next_slot_at),
            when if task.enabled else "disabled",
        )

    @admin.display(description="last run", ordering=_last_run("slot"))
    def last_run(self, task: PeriodicTask) -> SafeString | str:
        run: Run | None = getattr(task, "last_run_row", None)
        if run is None:
            return "never"
        return format_html(
            '{}<br><small title="claimed by {}">{}</small>',
            status_badge(run.status),
            run.claimed_by or "?",
            instant(run.slot),
        )

    # -- the task's page --------------------------------------------------------------------

    due = instant_field("due_at", "due at")
    last_slot = instant_field("last_slot_at", "last slot")
    stale = instant_field("stale_since", "stale since")
    anchor = instant_field("interval_anchor", "interval anchor")
    created = instant_field("created_at", "created")
    changed = instant_field("changed_at", "changed")

    @admin.display(description="bounds and limits")
    def limits(self, task: PeriodicTask) -> str:
        """E.g. ``from 2026-05-01 00:00:00 · until … · 3 of 10 runs · once``, in the admin's
        time zone like the other instants."""
        parts = []
        if task.valid_from is not None:
            parts.append(f"from {local_text(task.valid_from)}")
        if task.valid_until is not None:
            parts.append(f"until {local_text(task.valid_until)}")
        if task.max_runs is not None:
            parts.append(f"{task.run_count} of {task.max_runs} runs")
        if task.run_once:
            parts.append("once")
        if task.jitter_seconds:
            jitter = task.jitter_seconds
            # Not a number: text stored behind save() (SQLite); the claim disables the task.
            parts.append(
                f"jitter {jitter:g} s" if isinstance(jitter, float | int) else "jitter invalid"
            )
        return " · ".join(parts) or "—"

    @admin.display(description="runs waiting")
    def waiting(self, task: PeriodicTask) -> SafeString | str:
        """How many runs of the task wait for its running run (overlap policies
        ``buffer_one``, ``buffer_all``), of how many may, linked to them in the run list (one
        count, on the page of one task)."""
        count = Run.objects.filter(periodic_task=task, status=RunStatus.WAITING).count()
        bound = MAX_WAITING.get(task.overlap_policy)  # type: ignore[call-overload]
        if not count:
            return "none" if bound is not None else "none (its overlap policy waits for nothing)"
        url = reverse("admin:celery_driftsafe_run_changelist", current_app=self.admin_site.name)
        of = (
            f" of at most {bound} (overlap policy {task.overlap_policy})"
            if bound is not None
            else f" (released by a beat's next pass: its overlap policy is now "
            f"{task.overlap_policy})"
        )
        return format_html(
            '<a href="{}?periodic_task={}&amp;status__exact=waiting">{} waiting</a>{}',
            url,
            task.pk,
            count,
            of,
        )

    @admin.display(description="last run")
    def last_outcome(self, task: PeriodicTask) -> SafeString | str:
        """The latest run's status, slot, lateness and claimer (one query, on the page of one
        task: the list reads its page's runs at once)."""
        pk = getattr(task, "last_run_pk", None)
        run = None if pk is None else Run.objects.filter(pk=pk).first()
        if run is None:
            return "never"
        late = None if run.slot is None or run.claimed_at is None else run.claimed_at - run.slot
        return format_html(
            "{} slot {}, claimed {} by {}",
            status_badge(run.status),
            instant(run.slot),
            lateness(late),
            run.claimed_by or "?",
        )

    # -- actions ------------------------------------------------------------------------------

    @admin.action(description="Enable selected tasks (next slot after now)", permissions=["change"])
    def enable_tasks(self, request: HttpRequest, queryset: QuerySet[PeriodicTask]) -> None:
        tasks, broken = _schedulable(list(queryset.filter(enabled=False)))
        for text in broken:
            self.message_user(request, f"Not enabled, it cannot fire: {text}", messages.ERROR)
        if not tasks:
            self.message_user(
                request, "No disabled task with a valid schedule was selected.", messages.WARNING
            )
            return
        try:
            with transaction.atomic():
                PeriodicTask.objects.filter(pk__in=[t.pk for t in tasks]).update(
                    enabled=True, disabled_reason=""
                )
                changes.reschedule(tasks)  # the same recomputation as a re-enabling save
        except ClockError as exc:
            self.message_user(request, f"Nothing enabled: {exc}", messages.ERROR)
            return
        self._log(request, "enable", tasks, "Enabled (action; next slot after now)")
        self.message_user(
            request,
            f"Enabled {len(tasks)} task(s): " + ", ".join(t.name for t in tasks),
            messages.SUCCESS,
        )

    @admin.action(description="Disable selected tasks", permissions=["change"])
    def disable_tasks(self, request: HttpRequest, queryset: QuerySet[PeriodicTask]) -> None:
        tasks = list(queryset.filter(enabled=True).only("pk", "name"))
        if not tasks:
            self.message_user(request, "No enabled task was selected.", messages.WARNING)
            return
        with transaction.atomic():
            PeriodicTask.objects.filter(pk__in=[t.pk for t in tasks]).update(
                enabled=False, disabled_reason=f"disabled in the admin by {request.user}"
            )
            transaction.on_commit(changes.notify)
        self._log(request, "disable", tasks, "Disabled (action)")
        self.message_user(request, f"Disabled {len(tasks)} task(s).", messages.SUCCESS)

    @admin.action(description="Run selected tasks now", permissions=["change"])
    def run_now(self, request: HttpRequest, queryset: QuerySet[PeriodicTask]) -> None:
        self._run_now(request, list(queryset))

    def _run_now(self, request: HttpRequest, tasks: list[PeriodicTask]) -> None:
        try:
            app = get_celery_app()
            clock = authority_clock()
            actor = admin_actor(request.user.get_username())
            for task in tasks:
                try:
                    result = run_now(task, app=app, clock=clock, actor=actor)
                except TaskRefused as exc:
                    self.message_user(request, f"Not run, {exc}", messages.ERROR)
                    continue
                if not result.created:
                    level, text = messages.WARNING, "already ran at this instant; not repeated"
                elif result.status == RunStatus.FAILED:
                    level, text = messages.ERROR, f"failed: {result.error}"
                elif result.deferred:
                    level, text = messages.SUCCESS, "queued, published when this request commits"
                elif result.status == RunStatus.DISPATCHED:
                    level, text = messages.SUCCESS, "dispatched"
                else:
                    level, text = (
                        messages.WARNING,
                        (
                            "claimed; the broker did not take it, a "
                            "beat will re-publish it after the lease"
                        ),
                    )
                self.message_user(
                    request,
                    f"Run now {task.name} (task id {result.celery_task_id}): {text}",
                    level,
                )
                if result.created:
                    self.log_change(
                        request,
                        task,
                        f"Run now: run #{result.run_id}, Celery "
                        f"task id {result.celery_task_id}: {text}",
                    )
        except (ClockError, ConfigurationError, TaskModulesError) as exc:
            self.message_user(request, f"Cannot run now: {exc}", messages.ERROR)

    @admin.action(description="Backfill past slots of a task…", permissions=["change"])
    def backfill(
        self, request: HttpRequest, queryset: QuerySet[PeriodicTask]
    ) -> HttpResponse | None:
        """A page for the range, then the slots it runs and skips, then (confirmed) the
        backfill (:mod:`celery_driftsafe.publish.backfill`). Nothing is written before the
        confirmation, and the confirmation plans again: a slot that got a run meanwhile is
        skipped."""
        tasks = list(queryset[:2])
        if len(tasks) != 1:
            self.message_user(request, "Backfill one task at a time.", messages.WARNING)
            return None
        task = tasks[0]
        context: dict[str, Any] = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "task": task,
            "title": f"Backfill {task.name}",
            "max_slots": get_settings().backfill_max_slots,
            "from_text": request.POST.get("backfill_from", ""),
            "to_text": request.POST.get("backfill_to", ""),
        }
        step = request.POST.get("backfill_step")
        if step in ("list", "confirm"):
            try:
                start = parse_instant(context["from_text"], task.timezone)
                end = parse_instant(context["to_text"], task.timezone)
                plan = plan_backfill(task, start, end)
            except (ValueError, TaskRefused, ScheduleError) as exc:
                context["error"] = str(exc)
            else:
                if step == "confirm":
                    self._backfill(request, plan)
                    return None
                context["plan"] = plan
                context["rows"] = backfill_rows(plan)
        return TemplateResponse(
            request, "admin/celery_driftsafe/periodictask/backfill.html", context
        )

    def _backfill(self, request: HttpRequest, plan: BackfillPlan) -> None:
        try:
            result = run_backfill(
                plan, actor=backfill_actor(admin_actor(request.user.get_username()))
            )
        except (ClockError, ConfigurationError, TaskModulesError) as exc:
            self.message_user(request, f"Cannot backfill: {exc}", messages.ERROR)
            return
        deferred = f" ({result.deferred} when this request commits)" if result.deferred else ""
        text = (
            f"Backfill of {plan.task.name} from {plan.start.isoformat()} to "
            f"{plan.end.isoformat()}: {result.inserted} runs inserted, {result.published} "
            f"published{deferred}, {len(plan.taken)} skipped (they had a run), {result.lost} taken "
            "meanwhile by a beat or another backfill"
        )
        level = messages.SUCCESS
        if result.unpublished:
            level = messages.WARNING
            text += (
                f"; {len(result.unpublished)} not published (a beat's outbox publishes those "
                "left claimed)"
            )
        self.message_user(request, text, level)
        self.log_change(request, plan.task, text)

    @admin.action(
        description="Reset schedule (next slot after now, no catch-up)", permissions=["change"]
    )
    def reset_schedule(self, request: HttpRequest, queryset: QuerySet[PeriodicTask]) -> None:
        tasks, broken = _schedulable(list(queryset))
        for text in broken:
            self.message_user(request, f"Not reset, it cannot fire: {text}", messages.ERROR)
        if not tasks:
            return
        try:
            with transaction.atomic():
                count = changes.reschedule(tasks)
        except ClockError as exc:
            self.message_user(request, f"Nothing reset: {exc}", messages.ERROR)
            return
        self._log(request, "reset", tasks, "Schedule reset (action; next slot after now)")
        self.message_user(request, f"Reset the schedule of {count} task(s).", messages.SUCCESS)

    def _log(
        self, request: HttpRequest, action: str, tasks: list[PeriodicTask], message: str
    ) -> None:
        """Into the admin history of each task, and the log."""
        for task in tasks:
            self.log_change(request, task, message)
        logger.info(
            "%s: %s by %s",
            action,
            ", ".join(t.name for t in tasks),
            request.user,
            extra={
                "action": f"admin-{action}",
                "task": [t.name for t in tasks],
                "node": admin_actor(request.user.get_username()),
            },
        )

    # -- "run now" on the change page ----------------------------------------------------------

    def get_urls(self) -> list[URLPattern]:
        info = self.opts.app_label, self.opts.model_name
        own = [
            path(
                "<path:object_id>/run-now/",
                self.admin_site.admin_view(self.run_now_view),
                name="{}_{}_run_now".format(*info),
            )
        ]
        return own + super().get_urls()

    def run_now_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """POST from the change page's "Run now" button: the same as the action, for one."""
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        task = self.get_object(request, unquote(object_id))
        info = self.opts.app_label, self.opts.model_name
        if task is None:
            self.message_user(request, f"No periodic task with id {object_id!r}.", messages.WARNING)
            return HttpResponseRedirect(
                reverse("admin:{}_{}_changelist".format(*info), current_app=self.admin_site.name)
            )
        if not self.has_change_permission(request, task):
            raise PermissionDenied
        self._run_now(request, [task])
        return HttpResponseRedirect(
            reverse(
                "admin:{}_{}_change".format(*info), args=[task.pk], current_app=self.admin_site.name
            )
        )

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        info = self.opts.app_label, self.opts.model_name
        context = dict(extra_context or {})
        context["driftsafe_run_now_url"] = reverse(
            "admin:{}_{}_run_now".format(*info),
            args=[object_id],
            current_app=self.admin_site.name,
        )
        return super().change_view(request, object_id, form_url, context)

    # -- the next slots on the change and add pages ----------------------------------------------

    def render_change_form(
        self,
        request: HttpRequest,
        context: dict[str, Any],
        add: bool = False,
        change: bool = False,
        form_url: str = "",
        obj: Any = None,
    ) -> HttpResponse:
        """The page with a table of the next slots: of the values in the form after its
        "Preview the next slots" button (nothing saved), or of the saved task when the change
        page is opened."""
        form = context["adminform"].form
        context["driftsafe_preview_button"] = PREVIEW_BUTTON
        preview: Preview | None = getattr(form, "preview", None)
        zone = form.instance.timezone
        if preview is not None:
            context["driftsafe_preview_of"] = "the values in the form (not saved)"
        elif obj is not None and request.method == "GET":
            context["driftsafe_preview_of"] = "the saved task"
            zone = obj.timezone
            now = page_now()
            try:
                if now is None:
                    raise ValueError("the time authority cannot be read")
                preview = changes.preview(obj, now, count=PREVIEW_COUNT)
            except (ScheduleError, OverflowError, ValueError) as exc:
                context["driftsafe_preview_error"] = f"The next slots cannot be computed: {exc}"
        if preview is not None:
            context["driftsafe_preview"] = preview_rows(preview)
            context["driftsafe_preview_end"] = preview.end
            context["driftsafe_preview_excluded"] = preview.excluded
            context["driftsafe_preview_zone"] = zone
            context["driftsafe_preview_disabled"] = not (obj or form.instance).enabled
        # The interval anchor a preview counted from, handed back with the next submit so that
        # the save counts from it too (forms.py).
        anchor = getattr(form, "previewed_anchor", None)
        if anchor is not None and preview is not None:
            context["driftsafe_preview_anchor"] = f"{instant_text(anchor)} UTC"
        if isinstance(form, PeriodicTaskForm) and form.previewed_anchor_token:
            context["driftsafe_preview_anchor_input"] = PREVIEW_ANCHOR
            context["driftsafe_preview_anchor_token"] = form.previewed_anchor_token
        return super().render_change_form(request, context, add, change, form_url, obj)


def backfill_rows(plan: BackfillPlan) -> list[dict[str, str]]:
    """The slots of a backfill's plan in order, each to run or skipped (with the run it has),
    as the confirmation page lists them."""
    zone = ZoneInfo(plan.task.timezone)
    rows = [(slot, "run", "runs") for slot in plan.to_run]
    rows += [
        (taken.slot, "skip", f"skipped: run #{taken.run_id} ({taken.kind}, {taken.status})")
        for taken in plan.taken
    ]
    return [
        {
            "utc": slot.isoformat(),
            "local": f"{slot.astimezone(zone):%Y-%m-%d %H:%M:%S %Z}",
            "what": what,
            "note": note,
        }
        for slot, what, note in sorted(rows)
    ]


def preview_rows(preview: Preview) -> list[dict[str, str]]:
    """The preview's rows as the page shows them (texts, so no template filter moves them to
    the site's time zone), with fractions of a second where the instants have them: ``fires``
    is when the slot is claimed and dispatched (jittered rows; without a jitter, at the slot),
    ``held`` says when that is later than the slot's own due instant ``due``."""
    return [
        {
            "local": row.local_text,
            "utc": instant_text(row.slot),
            "due": row.due_text if row.jittered else "",
            "fires": row.fires_text if row.jittered else "",
            "held": f"held: due {row.due_text}, fires with the slot before" if row.held else "",
            "dst": row.offset_change_text("→"),
        }
        for row in preview.rows
    ]
