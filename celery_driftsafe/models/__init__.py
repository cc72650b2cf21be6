"""The tables: periodic task definitions, the run ledger, and the beat nodes.

One module per family: :mod:`~celery_driftsafe.models.choices` (the names stored in the
columns), :mod:`~celery_driftsafe.models.periodic_task`, :mod:`~celery_driftsafe.models.runs`
and :mod:`~celery_driftsafe.models.coordination` (beat nodes and database locks). Import them
from here: ``from celery_driftsafe.models import PeriodicTask, Run``.
"""

from celery_driftsafe.models.calendars import Calendar
from celery_driftsafe.models.choices import (
    IntervalUnit,
    MisfirePolicy,
    OverlapPolicy,
    RunKind,
    RunStatus,
    ScheduleKind,
    SolarEvent,
    TaskSource,
)
from celery_driftsafe.models.coordination import BeatNode, Lock
from celery_driftsafe.models.periodic_task import (
    CLAIM_FIELDS,
    SCHEDULE_ERROR_FIELDS,
    STAND_IN_ANCHOR,
    PeriodicTask,
    PeriodicTaskQuerySet,
    disabled_by_scheduler,
    schedule_failure,
    schedule_problem,
    unreadable_instants,
)
from celery_driftsafe.models.runs import Run, RunAttempt

__all__ = [
    "CLAIM_FIELDS",
    "SCHEDULE_ERROR_FIELDS",
    "STAND_IN_ANCHOR",
    "BeatNode",
    "Calendar",
    "IntervalUnit",
    "Lock",
    "MisfirePolicy",
    "OverlapPolicy",
    "PeriodicTask",
    "PeriodicTaskQuerySet",
    "Run",
    "RunAttempt",
    "RunKind",
    "RunStatus",
    "ScheduleKind",
    "SolarEvent",
    "TaskSource",
    "disabled_by_scheduler",
    "schedule_failure",
    "schedule_problem",
    "unreadable_instants",
]
