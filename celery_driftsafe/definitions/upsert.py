"""Creating or updating a periodic task by its name, under a row lock: the one write behind
the ``beat_schedule`` sync (:mod:`celery_driftsafe.definitions.beat_schedule`, every beat at start)
and
``manage.py driftsafe_import``.

Several writers may race (K beats starting at once): the unique task name decides who
creates a row, the row lock serialises updates, and a row whose fields already have the wanted
values is not written at all, so an interval's anchor is never moved by a repeat.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime
from enum import StrEnum
from typing import Any

from django.db import IntegrityError, transaction

from celery_driftsafe.models import PeriodicTask

#: Fields a sync or import never validates: the model sets them when the task is saved.
UNCHECKED = ["interval_anchor", "next_slot_at"]


def check_fields(task: PeriodicTask) -> None:
    """The model's validation of ``task``'s fields (raises ``ValidationError``), without the
    name's uniqueness: the database decides that, under the row lock or on insert."""
    task.full_clean(exclude=UNCHECKED, validate_unique=False, validate_constraints=False)


class Upserted(StrEnum):
    CREATED = "created"
    UPDATED = "updated"
    #: It exists and every field already has the wanted value.
    UNCHANGED = "unchanged"
    #: Not created: a row of that name exists (created meanwhile, or ``update=False``).
    EXISTS = "exists"
    #: Not updated: no row of that name (deleted meanwhile) and ``create=False``.
    MISSING = "missing"
    #: Not updated: ``may_update`` refused the existing row.
    REFUSED = "refused"


def upsert_by_name(
    name: str,
    fields: Mapping[str, Any],
    *,
    now: datetime | None,
    using: str = "default",
    on_create: Mapping[str, Any] | None = None,
    create: bool = True,
    update: bool = True,
    may_update: Callable[[PeriodicTask], bool] | None = None,
    validate: bool = False,
) -> Upserted:
    """Create the task ``name`` with ``fields`` (and ``on_create``), or set ``fields`` on it
    (``source`` is never changed); ``now`` is an authority reading for a new anchor and next
    slot. ``validate``: run the model's validation first (raises ``ValidationError``)."""
    with transaction.atomic(using=using):
        task = PeriodicTask.objects.using(using).select_for_update().filter(name=name).first()
        if task is None:
            if not create:
                return Upserted.MISSING
            task = PeriodicTask(name=name, **fields, **(on_create or {}))
            task.driftsafe_now = now  # type: ignore[attr-defined]
            if validate:
                check_fields(task)
            try:
                with transaction.atomic(using=using):
                    task.save(using=using)
            except IntegrityError:
                return Upserted.EXISTS  # another writer created it a moment ago
            return Upserted.CREATED
        if not update:
            return Upserted.EXISTS
        if may_update is not None and not may_update(task):
            return Upserted.REFUSED
        changed = {k: v for k, v in fields.items() if k != "source" and getattr(task, k) != v}
        if not changed:
            return Upserted.UNCHANGED
        for key, value in changed.items():
            setattr(task, key, value)
        task.driftsafe_now = now  # type: ignore[attr-defined]
        if validate:
            check_fields(task)
        task.save(using=using)
        return Upserted.UPDATED
