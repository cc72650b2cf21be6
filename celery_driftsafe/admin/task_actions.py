"""The admin's actions on periodic tasks: enable, disable, run now, reset schedule, and the
"Run now" button of a task's change page.

The bulk actions use ``QuerySet.update()`` and therefore call :func:`changes.reschedule` /
:func:`changes.notify` themselves (a form's save goes through the model's signals instead).
Every action is written to Django's admin history (``LogEntry``) for each task it changed,
like an edit, and to the log.
"""

from __future__ import annotations

import logging
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.utils import unquote
from django.core.exceptions import PermissionDenied
from django.db import transaction
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseNotAllowed, HttpResponseRedirect
from django.urls import URLPattern, path, reverse

from celery_driftsafe.celery_app import get_celery_app
from celery_driftsafe.definitions import changes
from celery_driftsafe.exceptions import (
    ClockError,
    ConfigurationError,
    TaskModulesError,
    TaskRefused,
)
from celery_driftsafe.models import PeriodicTask, RunStatus
from celery_driftsafe.publish.run_now import admin_actor, run_now
from celery_driftsafe.store.clock import authority_clock

logger = logging.getLogger(__name__)


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


class PeriodicTaskActions(admin.ModelAdmin):  # type: ignore[type-arg]
    """The actions and the "Run now" view of the periodic tasks' admin
    (:class:`~celery_driftsafe.admin.tasks.PeriodicTaskAdmin`, which derives from it)."""

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
