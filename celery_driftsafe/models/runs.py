"""The run ledger: one row per run, and one per attempt that ended in a retry."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.db import models

from celery_driftsafe.models.choices import RunKind, RunStatus
from celery_driftsafe.models.periodic_task import PeriodicTask


class Run(models.Model):
    """The run ledger: one row per fired, skipped or missed slot (and per manual/ad-hoc run).

    ``(periodic_task, slot)`` is unique: the idempotency key of a firing. Instants are the
    authority's time. ``fencing_token`` is the token of the last writer; a write carrying an
    older token is refused.
    """

    # No index of its own: the unique (periodic_task, slot) constraint's index leads with it.
    periodic_task = models.ForeignKey(
        PeriodicTask,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="runs",
        db_index=False,
    )
    task_name = models.CharField(max_length=200, help_text="Celery task name at claim time.")
    kind = models.CharField(max_length=16, choices=RunKind.choices, default=RunKind.SCHEDULED)
    slot = models.DateTimeField(null=True, blank=True)
    # Unique where set (an ad-hoc run's key): migration 0012 makes the unique index partial,
    # ``WHERE idempotency_key IS NOT NULL``, so a scheduled run (no key) adds no entry to it.
    # MySQL, which has no partial indexes, keeps its plain unique index (it allows many NULLs).
    idempotency_key = models.CharField(max_length=255, null=True, blank=True)
    status = models.CharField(max_length=16, choices=RunStatus.choices, default=RunStatus.CLAIMED)
    claimed_by = models.CharField(max_length=255, blank=True, help_text="Node id of the claimer.")
    claimed_at = models.DateTimeField(null=True, blank=True)
    dispatched_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    celery_task_id = models.CharField(max_length=255, blank=True)
    fencing_token = models.BigIntegerField(default=0)
    dispatch_attempts = models.PositiveIntegerField(default=0)
    duplicate_deliveries = models.PositiveIntegerField(
        default=0, help_text="Deliveries of this run that were skipped as duplicates."
    )
    worker = models.CharField(max_length=255, blank=True)
    lock_store = models.CharField(
        max_length=200,
        null=True,
        blank=True,
        help_text="Where the worker that started the run holds its lock (the driftsafe_locks "
        "header's value): only a worker locking there may take the run over. Empty: not "
        "started, or started before this was recorded.",
    )
    lease_until = models.DateTimeField(
        null=True,
        blank=True,
        help_text="Until when the worker running it holds its lease, renewed with its lock: "
        "nobody takes a started run over before then, even if the lock itself was lost "
        "(a Redis flush or restart). Empty: not started, or started before this was recorded.",
    )
    replaced_by = models.BigIntegerField(
        null=True,
        blank=True,
        help_text="Overlap policy replace: the id of the run (of a later slot) that replaced "
        "this one while it ran; the run ends revoked, whatever its body did. Empty: not "
        "replaced.",
    )
    error = models.TextField(blank=True)
    message = models.JSONField(
        default=dict,
        blank=True,
        help_text="What the run is published with, captured at claim time: args, kwargs and "
        "publish options. The outbox re-publishes exactly this.",
    )
    expires_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="The run's message expires at this instant of the time authority.",
    )
    retry_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="A refused publish is tried again at this instant (backoff).",
    )
    attempt = models.PositiveIntegerField(
        default=0,
        help_text="Celery's retry count of the current (or last) attempt: 0 for the first. "
        "Earlier attempts are kept as RunAttempt rows.",
    )
    missed_count = models.PositiveIntegerField(
        default=1,
        help_text="A missed row may stand for a span of missed slots: how many, from its slot "
        "to missed_until.",
    )
    late_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="When a beat found this scheduled run late: its task has a deadline, and "
        "the run had not succeeded by its slot plus the deadline. Empty: not late (or "
        "not checked).",
    )
    missed_until = models.DateTimeField(
        null=True,
        blank=True,
        help_text="The last slot of the span a missed row stands for (empty for one slot).",
    )

    class Meta:
        ordering = ["-slot", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["periodic_task", "slot"], name="driftsafe_run_slot_once"
            ),
            # Overlap policies ``buffer_one`` and ``buffer_all``: at most one run of a task
            # (``buffer_all``: BUFFER_ALL_MAX_WAITING) waits for its running run. The ledger's
            # statement that makes a run wait counts the others while it holds the task's row
            # (Ledger.wait), so of deliveries trying at once only as many wait as may. Migration
            # 0019's partial unique index ``driftsafe_run_one_waiting`` (one a task) is dropped
            # by 0023.
        ]
        indexes = [
            models.Index(fields=["status", "claimed_at"], name="driftsafe_run_outbox"),
            # Looked up by exact id only: a plain index (``db_index`` would add a second one,
            # for LIKE, on PostgreSQL). A task's runs newest first read the unique
            # (periodic_task, slot) index backwards.
            models.Index(fields=["celery_task_id"], name="driftsafe_run_celery_id"),
            # The admin's run list (newest first) and its filters, without a sort or a scan of
            # the ledger (see docs/explanation/performance.md).
            models.Index(fields=["-slot", "-id"], name="driftsafe_run_recent"),
            models.Index(fields=["status", "-slot", "-id"], name="driftsafe_run_status_recent"),
            models.Index(fields=["claimed_by", "-slot", "-id"], name="driftsafe_run_node_recent"),
            # Runs an operator asked for (run now, ad hoc calls, backfills): the kind filter,
            # the "admin" node and the search of their task names.
            models.Index(
                fields=["-slot", "-id"],
                name="driftsafe_run_operator",
                condition=models.Q(kind__in=["manual", "adhoc", "backfill"]),
            ),
            # The admin's "missed its deadline" filter: the late runs only, newest first.
            models.Index(
                fields=["-slot", "-id"],
                name="driftsafe_run_late",
                condition=models.Q(late_at__isnull=False),
            ),
        ]

    def __str__(self) -> str:
        when = self.slot.isoformat() if self.slot else "ad hoc"
        return f"{self.task_name} @ {when} ({self.status})"

    @property
    def lateness(self) -> timedelta | None:
        """How long after its slot the run was claimed."""
        if self.slot is None or self.claimed_at is None:
            return None
        return self.claimed_at - self.slot

    @property
    def duration(self) -> timedelta | None:
        if self.started_at is None or self.finished_at is None:
            return None
        return self.finished_at - self.started_at

    @property
    def task_result(self) -> Any | None:
        """The django-celery-results ``TaskResult`` of this run's Celery task id, when that app
        is installed and the result was stored (it is looked up, never copied)."""
        from django.apps import apps

        if not self.celery_task_id or not apps.is_installed("django_celery_results"):
            return None
        task_result = apps.get_model("django_celery_results", "TaskResult")
        return task_result.objects.filter(task_id=self.celery_task_id).first()


class RunAttempt(models.Model):
    """An attempt of a run that ended in a retry (``self.retry()``, ``autoretry_for``); the
    run row itself holds the current or last attempt. A run without retries has none."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="attempts")
    number = models.PositiveIntegerField(help_text="Celery's retry count: 0 for the first.")
    outcome = models.CharField(max_length=16, choices=RunStatus.choices)
    worker = models.CharField(max_length=255, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    fencing_token = models.BigIntegerField(default=0)
    error = models.TextField(blank=True)

    class Meta:
        ordering = ["run", "number"]
        constraints = [
            models.UniqueConstraint(fields=["run", "number"], name="driftsafe_attempt_once"),
        ]

    def __str__(self) -> str:
        return f"run {self.run_id} attempt {self.number} ({self.outcome})"
