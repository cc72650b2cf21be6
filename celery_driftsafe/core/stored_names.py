"""The names celery_driftsafe stores and reads: run statuses and kinds, the misfire and overlap
policies, and the choices of the settings. Defined once, here, as string enums (a member *is*
its string: ``RunStatus.CLAIMED == "claimed"``), and used by the models (their ``choices``:
:mod:`celery_driftsafe.models` exports these very classes), the settings and their checks, the
claim and the task.

Django-free, like the pure core: a stored name carries the label people read, and its class
gives a Django field's ``choices`` (and ``values``, ``labels``) as Django's ``TextChoices``
does.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import EnumType, StrEnum
from typing import Self, cast


class _StoredNameType(EnumType):
    """The class side of a :class:`StoredName`: what a Django field and a form read."""

    @property
    def choices(cls) -> list[tuple[str, str]]:
        """``(value, label)`` of every member, for a field's ``choices``."""
        return [(member.value, member.label) for member in _members(cls)]

    @property
    def values(cls) -> list[str]:
        return [member.value for member in _members(cls)]

    @property
    def labels(cls) -> list[str]:
        return [member.label for member in _members(cls)]


def _members(cls: EnumType) -> Iterable[StoredName]:
    return cast("Iterable[StoredName]", cls)


class StoredName(StrEnum, metaclass=_StoredNameType):
    """A name stored in the database, written ``NAME = "value", "Label"``: the member is its
    value, and has the label people read."""

    _label: str

    def __new__(cls, value: str, label: str | None = None) -> Self:
        member = str.__new__(cls, value)
        member._value_ = value
        member._label = value if label is None else label
        return member

    @property
    def label(self) -> str:
        return self._label


class RunStatus(StoredName):
    """Where a run is in its life (see docs/reference/ledger.md)."""

    CLAIMED = "claimed", "Claimed"
    DISPATCHED = "dispatched", "Dispatched"
    STARTED = "started", "Started"
    RETRYING = "retrying", "Retry scheduled"
    #: Overlap policies ``buffer_one`` and ``buffer_all``: came while the task's previous run
    #: was running, and waits in the ledger (not in a worker) to be published again when that
    #: run ends.
    WAITING = "waiting", "Waiting for the running run"
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed"
    SKIPPED = "skipped", "Skipped"
    MISSED = "missed", "Missed"
    EXPIRED = "expired", "Expired"
    REVOKED = "revoked", "Revoked"


#: Not started yet: waiting for a worker (the first delivery, or the next attempt after a
#: retry), or, under overlap policy ``buffer_one`` or ``buffer_all``, for the task's running
#: run to end.
PRE_START = (RunStatus.CLAIMED, RunStatus.DISPATCHED, RunStatus.RETRYING, RunStatus.WAITING)
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


class RunKind(StoredName):
    """Why a run exists: a slot of its schedule, an operator's "run now", an ad-hoc call, a
    past slot of its schedule run by a backfill."""

    SCHEDULED = "scheduled", "Scheduled"
    MANUAL = "manual", "Run now"
    ADHOC = "adhoc", "Ad-hoc call"
    BACKFILL = "backfill", "Backfill"


class MisfirePolicy(StoredName):
    """What a task does with missed slots: past the misfire grace, or after downtime (see
    :mod:`celery_driftsafe.core.misfire`)."""

    FIRE_ONCE = "fire_once", "Fire once for all missed slots"
    FIRE_ALL = "fire_all", "Fire every missed slot (bounded)"
    SKIP = "skip", "Skip to the next future slot"


class OverlapPolicy(StoredName):
    """Whether a slot runs while the previous run of its task is still running."""

    ALLOW = "allow", "Allow overlapping runs"
    SKIP = "skip", "Skip a slot while the previous run is running"
    BUFFER_ONE = (
        "buffer_one",
        "Keep one slot waiting while the previous run is running (skip any further)",
    )
    BUFFER_ALL = (
        "buffer_all",
        "Keep every slot waiting while the previous run is running; run them in slot order",
    )
    REPLACE = (
        "replace",
        "Replace the running run: revoke it (terminate where the pool can), then run",
    )


#: Overlap policy ``buffer_all``: how many runs of a task may wait at once; a slot that finds
#: that many waiting is skipped. A waiting run costs a ledger row only (no worker, no message),
#: so the bound is about lateness: a task whose body keeps outlasting its interval falls one
#: slot further behind with each slot, and past ten the backlog is a fault to see (the skipped
#: runs say so), not a burst to absorb. How late a waiting run may still run is the task's
#: own, per task: its ``expires_seconds`` (a run still waiting at its expiry is expired).
BUFFER_ALL_MAX_WAITING = 10
#: The overlap policies under which a run that finds its task running waits, and how many runs
#: of a task may wait at once under each.
MAX_WAITING = {OverlapPolicy.BUFFER_ONE: 1, OverlapPolicy.BUFFER_ALL: BUFFER_ALL_MAX_WAITING}
BUFFERING = tuple(MAX_WAITING)
#: The overlap policies whose runs wait in the ledger for the task's running run: the
#: buffering ones, and ``replace`` (its run waits for the body it replaced to be gone; one at
#: a time, a later slot replacing an earlier waiting one).
WAITING_POLICIES = (*BUFFERING, OverlapPolicy.REPLACE)


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


class Optimisation(StoredName):
    """A performance mechanism the ``OPTIMISATIONS_OFF`` setting can switch off (each one only
    saves time: off, the beat does the same work the plain way). ``FAST_PUBLISH``,
    ``CLAIM_PROCESS``, ``PUBLISH_BATCH_SIZE`` and ``MIN_ROUND_INTERVAL_SECONDS`` are settings of
    their own and not named here."""

    REDIS_WRITER = "redis_writer", "The fast path writes Redis messages itself, not via kombu"
    PREBUILD = "prebuild", "Messages of the tasks due soonest are built while the beat waits"
    CLAIM_AHEAD = "claim_ahead", "The next batch of a wave is claimed while one is published"
    C_TIMESTAMPS = "c_timestamps", "The claim reads instants with psycopg's C timestamptz loader"
    PLAIN_INSTANCES = "plain_instances", "Due tasks are built by setting their attributes"
    JSON_COLUMNS = "json_columns", "Due tasks' JSON columns are read without Django's converter"
    GC_FREEZE = "gc_freeze", "Long-lived objects are frozen out of full garbage collections"
    GC_YOUNG = "gc_young", "The youngest garbage generation is collected less often"
    STATEMENT_CACHE = "statement_cache", "A round's statements are compiled to SQL once"
    ISO_TEXTS = "iso_texts", "Instants' ISO texts are remembered"
    MISFIRE_ARITHMETIC = "misfire_arithmetic", "Misfire plans take shortcuts instead of walking"
    PLAIN_INSERT = "plain_insert", "The claim inserts without ON CONFLICT first"
    INTERNED_NAMES = "interned_names", "Message templates hold interned task names"
    DELIVERY_TAGS = "delivery_tags", "The Redis writer counts its delivery tags from one UUID4"
    EXPIRY_SHORTCUT = "expiry_shortcut", "A run's expiry is its slot plus seconds where it can be"
