"""The names celery_driftsafe stores and reads: run statuses and kinds, the misfire and overlap
policies, and the choices of the settings. Defined once, here, as string enums (a member *is*
its string: ``RunStatus.CLAIMED == "claimed"``), and used by the models (their ``choices``),
the settings and their checks, the claim and the task.

Django-free, like the pure core: the models add the labels people read.
"""

from __future__ import annotations

from enum import StrEnum


class RunStatus(StrEnum):
    """Where a run is in its life (see docs/reference/ledger.md)."""

    CLAIMED = "claimed"
    DISPATCHED = "dispatched"
    STARTED = "started"
    RETRYING = "retrying"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    SKIPPED = "skipped"
    MISSED = "missed"
    EXPIRED = "expired"
    REVOKED = "revoked"


#: Waiting for a worker: the first delivery, or the next attempt after a retry.
PRE_START = (RunStatus.CLAIMED, RunStatus.DISPATCHED, RunStatus.RETRYING)
#: A run's ``error`` while a worker runs it again after its first worker was lost.
TAKEN_OVER = "taken over: the worker that started it was lost (its lease ran out)"
#: A run in one of these has its outcome; nothing changes it any more.
FINISHED = (
    RunStatus.SUCCEEDED,
    RunStatus.FAILED,
    RunStatus.SKIPPED,
    RunStatus.MISSED,
    RunStatus.EXPIRED,
    RunStatus.REVOKED,
)


class RunKind(StrEnum):
    """Why a run exists: a slot of its schedule, an operator's "run now", an ad-hoc call."""

    SCHEDULED = "scheduled"
    MANUAL = "manual"
    ADHOC = "adhoc"


class MisfirePolicy(StrEnum):
    """What a task does with missed slots: past the misfire grace, or after downtime (see
    :mod:`celery_driftsafe.core.misfire`)."""

    FIRE_ONCE = "fire_once"
    FIRE_ALL = "fire_all"
    SKIP = "skip"


class OverlapPolicy(StrEnum):
    """Whether a slot runs while the previous run of its task is still running."""

    ALLOW = "allow"
    SKIP = "skip"


class TimeAuthority(StrEnum):
    """Whose clock decides due-ness (the ``TIME_AUTHORITY`` setting). ``auto`` is resolved to
    one of the others by the database and ``REDIS_URL`` (``clock.resolve_time_authority``)."""

    AUTO = "auto"
    DATABASE = "database"
    REDIS = "redis"
    LOCAL = "local"


class RedisUnavailablePolicy(StrEnum):
    """What ``DriftSafeTask`` does when Redis cannot be reached (``REDIS_UNAVAILABLE``)."""

    FAIL_CLOSED = "fail_closed"
    FAIL_OPEN = "fail_open"
