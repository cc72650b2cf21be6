"""The scheduler's one way to disable a task by its id: the claim's for a row it cannot read,
the dispatcher's for a run whose arguments do not fit, the pause after repeated failures
(:mod:`celery_driftsafe.claim.pausing`)."""

from __future__ import annotations

import logging

from celery_driftsafe.models import PeriodicTask, disabled_by_scheduler

logger = logging.getLogger("celery_driftsafe.claim")


def disable_by_id(using: str, pk: int, problem: str, *, name: str | None = None) -> str:
    """Disable the task ``pk``, which cannot be read, planned or published, with the reason
    (logged once, here), and without a next slot, as the claim leaves a task it disables; its
    name (read here unless given)."""
    if name is None:
        found = PeriodicTask.objects.using(using).filter(pk=pk).values_list("name", flat=True)
        name = str(found.first() or pk)
    logger.error("task %s disabled: %s", name, problem, extra={"action": "disable", "task": name})
    PeriodicTask.objects.using(using).filter(pk=pk).update(
        enabled=False,
        next_slot_at=None,
        due_at=None,
        disabled_reason=disabled_by_scheduler(problem),
    )
    return name
