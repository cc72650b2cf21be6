"""celery_driftsafe: several Celery beats, clocks apart, every periodic slot exactly once.

The package is a Django app (add ``"celery_driftsafe"`` to ``INSTALLED_APPS``) and a Celery
beat scheduler (``celery_driftsafe.scheduler:DriftSafeScheduler``).

The names a project's code uses are here, at the top (docs/reference/public-api.md)::

    from celery_driftsafe import Crontab, HEADER_SLOT, due_instant, lock_backend

They are loaded on first use: importing the app (as ``INSTALLED_APPS`` does, before Django
is set up) loads nothing else.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.2.0"

#: Each public name and the module that defines it (internal: the module may move, the name
#: stays here).
_PUBLIC = {
    **dict.fromkeys(
        ("Crontab", "Interval", "OneOff", "Schedule", "Solar"), "celery_driftsafe.core.schedules"
    ),
    "due_instant": "celery_driftsafe.core.jitter",
    **dict.fromkeys(
        (
            "HEADER_CELERY_BEAT",
            "HEADER_FENCING_TOKEN",
            "HEADER_LOCKS",
            "HEADER_PERIODIC_TASK_ID",
            "HEADER_RUN_ID",
            "HEADER_SLOT",
            "RESERVED_HEADERS",
            "RESERVED_PREFIXES",
        ),
        "celery_driftsafe.core.headers",
    ),
    "lock_backend": "celery_driftsafe.locks",
    "authority_clock": "celery_driftsafe.store.clock",
}

__all__ = [
    "HEADER_CELERY_BEAT",
    "HEADER_FENCING_TOKEN",
    "HEADER_LOCKS",
    "HEADER_PERIODIC_TASK_ID",
    "HEADER_RUN_ID",
    "HEADER_SLOT",
    "RESERVED_HEADERS",
    "RESERVED_PREFIXES",
    "Crontab",
    "Interval",
    "OneOff",
    "Schedule",
    "Solar",
    "authority_clock",
    "due_instant",
    "lock_backend",
]

if TYPE_CHECKING:
    from celery_driftsafe.core.headers import (
        HEADER_CELERY_BEAT,
        HEADER_FENCING_TOKEN,
        HEADER_LOCKS,
        HEADER_PERIODIC_TASK_ID,
        HEADER_RUN_ID,
        HEADER_SLOT,
        RESERVED_HEADERS,
        RESERVED_PREFIXES,
    )
    from celery_driftsafe.core.jitter import due_instant
    from celery_driftsafe.core.schedules import Crontab, Interval, OneOff, Schedule, Solar
    from celery_driftsafe.locks import lock_backend
    from celery_driftsafe.store.clock import authority_clock


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'celery_driftsafe' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups find it without this function
    return value
