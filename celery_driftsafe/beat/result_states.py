"""Task states read from a Celery result backend many at a time (the reconciliation of plain
tasks' runs, :mod:`celery_driftsafe.beat.recovery`)."""

from __future__ import annotations

from typing import Any

from celery.backends.base import BaseKeyValueStoreBackend


def backend_states(app: Any, task_ids: list[str]) -> dict[str, str]:
    """The result backend's state of each of ``task_ids`` it holds a record of, in one request
    for a key-value backend (Redis and the like: ``MGET``) or django-celery-results' table,
    one look-up a task elsewhere. Raises when the app has no result backend."""
    backend = app.backend
    model = getattr(backend, "TaskModel", None)
    if model is not None and hasattr(model, "_default_manager"):  # django-celery-results
        return dict(
            model._default_manager.filter(task_id__in=task_ids).values_list("task_id", "status")
        )
    if isinstance(backend, BaseKeyValueStoreBackend):
        values = backend.mget([backend.get_key_for_task(task_id) for task_id in task_ids])
        return {
            task_id: backend.decode_result(value)["status"]
            for task_id, value in zip(task_ids, values, strict=True)
            if value
        }
    return {task_id: app.AsyncResult(task_id).state for task_id in task_ids}
