"""Admin of the run ledger: read-only history of every fired, skipped, missed and manual run.

The list is paginated and costs a fixed number of queries whatever the size of the ledger
(no per-row lookups: the task name and node are stored on the run). The filters' choices come
from the small tables (tasks, nodes), never from a ``DISTINCT`` over the ledger; each filter
reads a page of its own index (migration 0010), newest first, and the count is an estimate
(:class:`~celery_driftsafe.admin.paginator.EstimatedCountPaginator`), never a ``COUNT(*)`` of
the ledger.
"""

from __future__ import annotations

from typing import Any

from django.apps import apps
from django.contrib import admin
from django.db.models import Q, QuerySet
from django.http import HttpRequest
from django.urls import NoReverseMatch, reverse
from django.utils.html import format_html
from django.utils.http import urlencode
from django.utils.safestring import SafeString

from celery_driftsafe.admin.display import (
    AuthorityNowMixin,
    duration,
    instant,
    instant_field,
    lateness,
    page_now,
    status_badge,
)
from celery_driftsafe.admin.paginator import EstimatedCountPaginator
from celery_driftsafe.beat.recovery import stuck
from celery_driftsafe.models import BeatNode, PeriodicTask, Run, RunAttempt, RunKind

#: At most this many choices in the task and node filters; search finds the rest.
FILTER_CHOICES = 100
#: At most this many runs found by an exact Celery task id or idempotency key (one, normally).
SEARCH_EXACT_LIMIT = 1000
#: Up to this many tasks matching a search are named in the run query, more by a sub-query.
SEARCH_TASKS_LISTED = 500


class PeriodicTaskFilter(admin.SimpleListFilter):
    title = "periodic task"
    parameter_name = "periodic_task"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        rows = PeriodicTask.objects.order_by("name").values_list("pk", "name")[:FILTER_CHOICES]
        return [(str(pk), name) for pk, name in rows]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value and value.isdigit():
            return queryset.filter(periodic_task_id=int(value))
        return queryset


class NodeFilter(admin.SimpleListFilter):
    """The node that claimed the run; "admin" gathers the runs started from the admin."""

    title = "node"
    parameter_name = "node"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        nodes = BeatNode.objects.order_by("hostname", "pid").values_list("node_id", flat=True)
        return [("admin", "admin (run now)"), *((n, n) for n in nodes[:FILTER_CHOICES])]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value == "admin":  # manual runs: the partial index of the runs operators asked for
            return queryset.filter(kind=RunKind.MANUAL, claimed_by__startswith="admin")
        if value:
            return queryset.filter(claimed_by=value)
        return queryset


class LateFilter(admin.SimpleListFilter):
    """Scheduled runs that missed their task's deadline (see
    :mod:`celery_driftsafe.beat.deadlines`), newest first on their own partial index."""

    title = "deadline"
    parameter_name = "late"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("yes", "missed its deadline")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.value() == "yes":
            return queryset.filter(late_at__isnull=False)
        return queryset


class AttentionFilter(admin.SimpleListFilter):
    """Runs with no outcome ``STUCK_RUN_SECONDS`` after their claim (see
    :mod:`celery_driftsafe.beat.recovery`)."""

    title = "attention"
    parameter_name = "attention"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("stuck", "needs attention (no outcome)")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        now = page_now()
        if self.value() == "stuck" and now is not None:
            return queryset.filter(stuck(now))
        return queryset


def search_runs(queryset: QuerySet[Any], term: str) -> QuerySet[Any]:
    """The runs a search term finds, each part answered by an index rather than a scan of the
    ledger: the runs of the periodic tasks whose name or Celery task name contains the term
    (the task table is small; the runs come from the unique ``(periodic_task, slot)`` index),
    manual and ad hoc runs whose task name contains it (their partial index), and runs whose
    Celery task id, idempotency key or node is exactly the term.

    The tasks and the exact matches are looked up first and passed as values: a filter that
    names them outright lets the database plan the page from those indexes, where one
    ``OR`` of sub-queries made it walk the whole ledger newest first looking for matches
    (seconds at millions of runs when few or none match)."""
    term = term.strip()
    if not term:
        return queryset
    found = Q(claimed_by=term) | Q(
        kind__in=[RunKind.MANUAL, RunKind.ADHOC], task_name__icontains=term
    )
    matching = PeriodicTask.objects.filter(Q(name__icontains=term) | Q(task__icontains=term))
    tasks = list(matching.values_list("pk", flat=True)[: SEARCH_TASKS_LISTED + 1])
    if len(tasks) > SEARCH_TASKS_LISTED:
        # Many tasks: their runs are common, and walking the ledger newest first finds a
        # page soon; a sub-query spares sending thousands of ids.
        found |= Q(periodic_task_id__in=matching.values("pk"))
    elif tasks:
        found |= Q(periodic_task_id__in=tasks)
    exact = list(
        Run.objects.filter(Q(celery_task_id=term) | Q(idempotency_key=term)).values_list(
            "pk", flat=True
        )[:SEARCH_EXACT_LIMIT]
    )
    if exact:
        found |= Q(pk__in=exact)
    return queryset.filter(found)


def _results_url() -> str | None:
    """The django-celery-results TaskResult list in this admin, when installed."""
    if not apps.is_installed("django_celery_results"):
        return None
    try:
        return reverse("admin:django_celery_results_taskresult_changelist")
    except NoReverseMatch:
        return None


class RunAttemptInline(admin.TabularInline):  # type: ignore[type-arg]
    """The attempts of a run whose body retried (a run without retries has none: the run's
    own row is its one attempt)."""

    model = RunAttempt
    extra = 0
    can_delete = False
    fields = ("number", "outcome_badge", "worker", "started", "finished", "fencing_token", "error")
    readonly_fields = fields
    ordering = ("number",)
    verbose_name_plural = "attempts (Celery retries of this run)"

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    @admin.display(description="outcome")
    def outcome_badge(self, attempt: RunAttempt) -> SafeString | str:
        return status_badge(attempt.outcome)

    @admin.display(description="started")
    def started(self, attempt: RunAttempt) -> SafeString | str:
        return instant(attempt.started_at, milliseconds=True)

    @admin.display(description="finished")
    def finished(self, attempt: RunAttempt) -> SafeString | str:
        return instant(attempt.finished_at, milliseconds=True)


class RunAdmin(AuthorityNowMixin, admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = (
        "run",
        "task_name",
        "kind",
        "slot_at",
        "status_badge",
        "claimed_by",
        "claimed",
        "dispatched",
        "started",
        "finished",
        "lateness_text",
        "duration_text",
        "late",
        "attempts",
        "result",
    )
    list_filter = ("status", AttentionFilter, LateFilter, "kind", PeriodicTaskFilter, NodeFilter)
    #: Searched by :func:`search_runs` (every part on an index), not by Django's ``icontains``
    #: over the ledger.
    search_fields = ("task_name", "celery_task_id", "=claimed_by")
    search_help_text = (
        "Part of a periodic task's name or Celery task name (or of a manual or ad hoc run's task "
        "name); or exactly a Celery task id, idempotency key or node."
    )
    list_per_page = 100
    show_full_result_count = False
    paginator = EstimatedCountPaginator
    readonly_fields = (
        "task_name",
        "periodic_task",
        "kind",
        "slot_at",
        "status_badge",
        "claimed_by",
        "claimed",
        "dispatched",
        "started",
        "finished",
        "lateness_text",
        "duration_text",
        "late",
        "celery_task_id",
        "result",
        "idempotency_key",
        "fencing_token",
        "dispatch_attempts",
        "attempts",
        "duplicate_deliveries",
        "expires",
        "worker",
        "lock_store",
        "lease",
        "replaced_by",
        "error",
    )
    fields = readonly_fields
    inlines = (RunAttemptInline,)

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Any], search_term: str
    ) -> tuple[QuerySet[Any], bool]:
        return search_runs(queryset, search_term), False

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    expires = instant_field("expires_at", "expires at", milliseconds=True)
    lease = instant_field("lease_until", "lease until", milliseconds=True)

    @admin.display(description="run", ordering="id")
    def run(self, run: Run) -> str:
        return f"#{run.pk}"

    @admin.display(description="slot", ordering="slot")
    def slot_at(self, run: Run) -> SafeString | str:
        return instant(run.slot, milliseconds=True)

    @admin.display(description="status", ordering="status")
    def status_badge(self, run: Run) -> SafeString | str:
        return status_badge(run.status)

    @admin.display(description="claimed", ordering="claimed_at")
    def claimed(self, run: Run) -> SafeString | str:
        return instant(run.claimed_at, milliseconds=True, same_day_as=run.slot)

    @admin.display(description="dispatched", ordering="dispatched_at")
    def dispatched(self, run: Run) -> SafeString | str:
        return instant(run.dispatched_at, milliseconds=True, same_day_as=run.slot)

    @admin.display(description="started", ordering="started_at")
    def started(self, run: Run) -> SafeString | str:
        return instant(run.started_at, milliseconds=True, same_day_as=run.slot)

    @admin.display(description="finished", ordering="finished_at")
    def finished(self, run: Run) -> SafeString | str:
        return instant(run.finished_at, milliseconds=True, same_day_as=run.slot)

    @admin.display(description="lateness")
    def lateness_text(self, run: Run) -> SafeString | str:
        return lateness(run.lateness)

    @admin.display(description="duration")
    def duration_text(self, run: Run) -> str:
        return duration(run.duration)

    @admin.display(description="deadline missed")
    def late(self, run: Run) -> SafeString | str:
        """When a beat found the run late (its task's deadline passed without a success)."""
        return instant(run.late_at, milliseconds=True, same_day_as=run.slot)

    @admin.display(description="attempts", ordering="attempt")
    def attempts(self, run: Run) -> int:
        """How many attempts the body had (Celery retries + 1), from the run row alone."""
        return run.attempt + 1

    @admin.display(description="result")
    def result(self, run: Run) -> SafeString | str:
        base = _results_url()
        if base is None or not run.celery_task_id:
            return "—"
        return format_html(
            '<a href="{}?{}">task result</a>', base, urlencode({"task_id": run.celery_task_id})
        )
