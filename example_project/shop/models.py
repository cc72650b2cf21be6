"""What the shop's task bodies leave behind: one row per execution.

celery_driftsafe's own ledger (``Run``) says which slots were claimed and dispatched; these
rows are written by the task bodies themselves, so anyone can check that every run reached
its body exactly once (the demo counts them, the admin lists them).
"""

from __future__ import annotations

import os
from datetime import datetime
from typing import Any

from django.db import models
from django.utils import timezone

from celery_driftsafe import HEADER_RUN_ID, HEADER_SLOT


class Execution(models.Model):
    """One execution of a task body."""

    task_name = models.CharField(max_length=200)
    run_id = models.BigIntegerField(
        null=True, blank=True, db_index=True, help_text="celery_driftsafe Run id, if any."
    )
    slot = models.DateTimeField(null=True, blank=True, help_text="The slot this run fired for.")
    celery_task_id = models.CharField(max_length=255, blank=True)
    worker = models.CharField(max_length=255, blank=True, help_text="Worker host name and pid.")
    executed_at = models.DateTimeField(help_text="The worker's own clock when the body ran.")

    class Meta:
        ordering = ["-executed_at"]

    def __str__(self) -> str:
        return f"{self.task_name} @ {self.slot or 'ad hoc'}"

    @classmethod
    def record(cls, task_name: str, request: Any) -> Execution:
        """Record the body of ``task_name`` running for Celery ``request`` (``self.request``
        of a bound task): the run and slot come from celery_driftsafe's message headers."""
        slot = getattr(request, HEADER_SLOT, None)
        return cls.objects.create(
            task_name=task_name,
            run_id=getattr(request, HEADER_RUN_ID, None),
            slot=datetime.fromisoformat(slot) if slot else None,
            celery_task_id=request.id or "",
            worker=f"{request.hostname or '?'}:{os.getpid()}",
            executed_at=timezone.now(),
        )
