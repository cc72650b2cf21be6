"""Django application config: checks and signals are connected here and nowhere else."""

from __future__ import annotations

from django.apps import AppConfig


class DriftSafeConfig(AppConfig):
    name = "celery_driftsafe"
    verbose_name = "Drift-safe periodic tasks"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from celery.signals import (
            task_postrun,
            task_prerun,
            task_revoked,
            worker_init,
            worker_shutdown,
        )
        from django.core import checks
        from django.core.signals import setting_changed
        from django.db.models.signals import m2m_changed, post_delete, post_save, pre_delete

        from celery_driftsafe import checks as driftsafe_checks
        from celery_driftsafe import conf
        from celery_driftsafe.definitions import calendars, changes
        from celery_driftsafe.models import Calendar, PeriodicTask
        from celery_driftsafe.models.periodic_task import prepare_saves_with
        from celery_driftsafe.monitoring import metrics_server
        from celery_driftsafe.worker import plain_task_receivers, request

        setting_changed.connect(conf.clear_cache, dispatch_uid="driftsafe-settings-cache")
        checks.register(driftsafe_checks.check_settings, checks.Tags.compatibility)
        checks.register(driftsafe_checks.check_use_tz, checks.Tags.compatibility)
        checks.register(driftsafe_checks.check_autocommit, checks.Tags.database)
        checks.register(driftsafe_checks.check_routing, checks.Tags.database)
        checks.register(driftsafe_checks.check_database, checks.Tags.database)
        # Before a task's save() writes: its next slot kept right (the models call it, the
        # definitions layer above them provides it).
        prepare_saves_with(changes.prepare_save)
        post_save.connect(changes.after_change, sender=PeriodicTask, dispatch_uid="driftsafe-post")
        post_delete.connect(
            changes.after_change, sender=PeriodicTask, dispatch_uid="driftsafe-delete"
        )
        # A calendar's dates copied into its tasks' rows, their next slots moved.
        post_save.connect(
            calendars.after_calendar_save, sender=Calendar, dispatch_uid="driftsafe-calendar"
        )
        pre_delete.connect(
            calendars.before_calendar_delete, sender=Calendar, dispatch_uid="driftsafe-cal-del"
        )
        post_delete.connect(
            calendars.after_calendar_delete, sender=Calendar, dispatch_uid="driftsafe-cal-gone"
        )
        m2m_changed.connect(
            calendars.after_links_change,
            sender=PeriodicTask.calendars.through,
            dispatch_uid="driftsafe-calendar-links",
        )
        # Worker side: a revoked or expired run message is recorded (runs' messages only).
        task_revoked.connect(request.on_task_revoked, dispatch_uid="driftsafe-revoked")
        # Worker side: a plain task's run (no DriftSafeTask base) gets its body's outcome.
        task_prerun.connect(
            plain_task_receivers.on_task_prerun, dispatch_uid="driftsafe-plain-start"
        )
        task_postrun.connect(
            plain_task_receivers.on_task_postrun, dispatch_uid="driftsafe-plain-end"
        )
        # Worker side: serve metrics on WORKER_METRICS_PORT (a no-op when it is not set).
        worker_init.connect(metrics_server.on_worker_init, dispatch_uid="driftsafe-metrics-init")
        worker_shutdown.connect(
            metrics_server.on_worker_shutdown, dispatch_uid="driftsafe-metrics-stop"
        )


def ensure_django() -> None:
    """Set Django up if nobody has yet (a ``celery beat`` started without it)."""
    import django
    from django.apps import apps

    if not apps.ready:
        django.setup()
