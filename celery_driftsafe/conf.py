"""The settings surface: one typed, read-on-access view of ``settings.DRIFTSAFE``.

A project sets a handful of keys in one dict in Django settings::

    DRIFTSAFE = {
        "REDIS_URL": "redis://127.0.0.1:6379/0",
        "TIME_AUTHORITY": "auto",
    }

The keys a project may set are :data:`PROJECT_SETTINGS` (the settings page's first table) and
:data:`TUNING_SETTINGS` (each for the reason the page gives). Every other value the code reads
is a constant of this module, with its reason, or follows from a setting (a lease from
``NODE_DEAD_AFTER_SECONDS``); the beat's longest wait is Celery's own
``beat_max_loop_interval`` (:attr:`~celery_driftsafe.scheduler.DriftSafeScheduler.max_interval`).
The former settings (:data:`DEPRECATED_SETTINGS`) are honoured for one more release, with a
``DeprecationWarning`` and check W003 naming what replaces each.

The package's own tests and benchmarks change constants through a setting of their own,
``DRIFTSAFE_INTERNALS`` (:func:`internal_settings`): no project sets it, and it may change in any
release.

:func:`get_settings` builds a :class:`DriftSafeSettings` from them each time it is asked after a
change (Django's ``setting_changed`` signal clears the cache), so ``override_settings`` works
in tests and nothing is read at import time. Values are validated by the system checks in
:mod:`celery_driftsafe.checks`; :func:`get_settings` raises :class:`ConfigurationError` for a
value it cannot use at all.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from django.conf import settings as django_settings

from celery_driftsafe.core import instants
from celery_driftsafe.core.stored_names import (
    MisfirePolicy,
    Optimisation,
    RedisUnavailablePolicy,
    TimeAuthority,
)
from celery_driftsafe.exceptions import ConfigurationError

#: The fixed part of the default key prefix (and the prefix of a settings object built by hand).
DEFAULT_KEY_PREFIX = "driftsafe"
#: The parts of a ``DATABASES`` entry that identify a database (and so a project).
DATABASE_IDENTITY = ("ENGINE", "NAME", "HOST", "PORT")
#: The Django setting through which this package's tests and benchmarks change constants.
INTERNALS = "DRIFTSAFE_INTERNALS"

# -- Constants: values no project has a reason to change (each was a setting up to 0.2) -----
# Tests and benchmarks change them through DRIFTSAFE_INTERNALS; nothing else does.

#: Runs one claim round takes at most. A round is one transaction whose rows are held in
#: memory; a wave larger than a batch is claimed ahead (in a thread, and in a helper process)
#: while the last batch is published, so a larger batch buys little and holds more at once.
CLAIM_BATCH_SIZE = 500
#: Messages written to the broker in one pipelined write (on Redis): 100 already pays one
#: round trip for a hundred messages; more only holds more in memory at once.
PUBLISH_BATCH_SIZE = 100
#: Shortest time from the start of one claim round to the next (unless the last took a full
#: batch): slots due a few milliseconds apart go out together, at most 20 ms later, and a
#: beat pays a round (a dozen statements) per 20 ms, not per slot.
MIN_ROUND_INTERVAL_SECONDS = 0.02
#: How often a beat re-measures its offset from the time authority: an offset only ever warns
#: (due-ness never reads a beat's clock), and a step of the wall clock is measured at once.
CLOCK_SYNC_INTERVAL_SECONDS = 60.0
#: Round trips per offset measurement; the one with the lowest round trip wins. Five find a
#: quiet round trip on a loaded network for five round trips a minute.
CLOCK_SYNC_SAMPLES = 5
#: A beat whose clock is this far from the authority stops claiming until it is back. Not an
#: accuracy bound (due-ness never reads a beat's clock; MAX_CLOCK_OFFSET_SECONDS warns):
#: a clock on a wrong time zone is off by whole hours, at most 14, and keeps time, so it
#: only warns; a difference of more than a day is no clock keeping time on either side (a
#: clock reset by a dead battery, a server restored from an old snapshot), and when it is the
#: authority that is wrong, every beat stops rather than fire a day of slots at once or record
#: them missed. It was six hours up to 0.2, which stopped beats on a time zone mistake.
HARD_CLOCK_OFFSET_SECONDS = 24 * 3600.0
#: The longest a beat waits between two looks at the schedule when Celery's
#: ``beat_max_loop_interval`` (or ``celery beat --max-interval``) is not set: an edit reaches a
#: beat without Redis (no wake-up) at its next look, and a paused beat looks again this soon.
MAX_LOOP_INTERVAL_SECONDS = 1.0
#: A run still ``dispatched`` this long after its claim takes the result backend's outcome
#: when it holds one, asked again at each reconciliation: a worker that ran the task has
#: recorded its outcome well within a minute of the claim, unless the task is still running.
RESULT_LOOKUP_SECONDS = 60.0
#: A run with no outcome this long after its claim is reconciled (a ``started`` run whose
#: lock nobody holds becomes ``failed``) and listed under "needs attention": a running task's
#: lock is renewed while it runs, so an hour only decides when a lost run is noticed.
STUCK_RUN_SECONDS = 3600.0
#: How often a beat looks for late runs of tasks with a ``deadline_seconds``: a missed
#: deadline is reported at most this long after it passed (one indexed read per look).
DEADLINE_CHECK_INTERVAL_SECONDS = 2.0
#: A task with a deadline none of whose last three slots past their deadline succeeded is
#: flagged stale: one late run is a blip, three in a row a pattern.
STALE_AFTER_SLOTS = 3
#: Runs one pruning statement deletes: one short transaction locking only its own rows.
PRUNE_BATCH_SIZE = 500
#: The share of a pruning pass spent deleting: a quarter prunes about 3,400 runs a second
#: (twenty times what 10,000 every-minute tasks add) while leaving the claim loop the rest.
PRUNE_DUTY_CYCLE = 0.25

# -- Values that follow from a setting ------------------------------------------------------

#: Heartbeats a beat sends within ``NODE_DEAD_AFTER_SECONDS``: five may be late (a long round,
#: a slow database) before a live beat is taken for dead.
HEARTBEATS_PER_DEAD_AFTER = 6


def default_key_prefix(database: Mapping[str, Any]) -> str:
    """``driftsafe:<8 hex digits>``: a short stable hash of ``database``'s ENGINE, NAME, HOST
    and PORT (a ``DATABASES`` entry).

    Every beat and worker of one project use the same database, so they share the prefix;
    projects with different databases get different prefixes, so their locks and wake-ups stay
    apart on one Redis database. Processes of one project that name the database differently
    (``localhost`` here, ``127.0.0.1`` there) must set ``KEY_PREFIX`` explicitly.
    """
    identity = [str(database.get(part) or "") for part in DATABASE_IDENTITY]
    digest = hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:8]
    return f"{DEFAULT_KEY_PREFIX}:{digest}"


@dataclass(frozen=True)
class DriftSafeSettings:
    """Every value the code reads, with its default. A project sets the keys of
    :data:`PROJECT_SETTINGS` and :data:`TUNING_SETTINGS` (upper-case names) in
    ``settings.DRIFTSAFE``; the rest are this module's constants or follow from a setting."""

    # -- what a project sets (PROJECT_SETTINGS) --------------------------------------------

    #: Redis for locks, wake-up notifications and (optionally) the time authority.
    #: ``None``: no Redis; locks fall back to the database and beats poll for changes.
    redis_url: str | None = None
    #: Whose clock decides due-ness: ``database`` (the database server's clock), ``redis``
    #: (Redis ``TIME``), ``local`` (this process's wall clock; one machine only), or ``auto``:
    #: the database's where it has one (PostgreSQL, MySQL), else Redis' when ``REDIS_URL`` is
    #: set, else the local clock (see :func:`celery_driftsafe.store.clock.resolve_time_authority`).
    time_authority: TimeAuthority = TimeAuthority.AUTO
    #: Dotted path of the project's Celery app (``"proj.celery:app"``), for the admin's task
    #: name checks and "run now". ``None``: Celery's current app.
    celery_app: str | None = None
    #: Default misfire policy of a task that does not set its own.
    misfire_policy: MisfirePolicy = MisfirePolicy.FIRE_ONCE
    #: Seconds past its slot after which a slot counts as missed (default for tasks).
    misfire_grace_seconds: float = 60.0
    #: What ``DriftSafeTask`` does when Redis cannot be reached.
    redis_unavailable: RedisUnavailablePolicy = RedisUnavailablePolicy.FAIL_CLOSED
    #: A node whose measured offset from the authority exceeds this logs a warning.
    max_clock_offset_seconds: float = 1.0
    #: Finished runs (succeeded, skipped, revoked) are deleted this many seconds after their
    #: claim, with their attempts, lock rows and fencing counters (see
    #: :mod:`celery_driftsafe.ledger.retention`). ``None``: kept forever.
    run_retention_seconds: float | None = 7 * 86400.0
    #: The same for runs that did not succeed (failed, missed, expired). ``None``: kept forever.
    failed_run_retention_seconds: float | None = 30 * 86400.0
    #: A beat serves its Prometheus metrics on this TCP port (needs the ``metrics`` extra).
    #: ``None``: no metrics. Each beat on one host needs its own port.
    metrics_port: int | None = None
    #: A worker's main process serves its Prometheus metrics on this TCP port (a prefork pool
    #: also needs ``PROMETHEUS_MULTIPROC_DIR``; see the monitoring how-to). ``None``: none.
    worker_metrics_port: int | None = None
    #: The bearer token a scraper sends to the metrics view (``Authorization: Bearer <token>``).
    #: ``None``: only logged-in users allowed to view tasks, runs and nodes see the view.
    #: Kept out of the settings' ``repr``.
    metrics_token: str | None = dataclasses.field(default=None, repr=False)

    # -- tuning, each for the reason the settings page gives (TUNING_SETTINGS) ------------

    #: Prefix of every Redis key and channel this package uses. :func:`get_settings` derives
    #: the default from the default database (:func:`default_key_prefix`), so two projects
    #: sharing one Redis database never see each other's locks or wake-ups.
    key_prefix: str = DEFAULT_KEY_PREFIX
    #: The address the metrics ports listen on: this host only by default; ``"0.0.0.0"`` (or
    #: ``"::"``) serves every interface, to anyone who can reach the host.
    metrics_address: str = "127.0.0.1"
    #: A node whose heartbeat is older than this is considered dead. The lease of a claimed
    #: run and the heartbeat interval follow from it.
    node_dead_after_seconds: float = 30.0
    #: Message expiry of a scheduled run whose task sets no ``expires_seconds``: seconds
    #: after its slot, on the time authority's clock. ``None``: such messages never expire.
    run_expires_seconds: float | None = 86400.0
    #: Upper bound on catch-up runs one ``fire_all`` task gets after downtime.
    fire_all_max: int = 100
    #: The most slots one backfill may cover (``driftsafe_backfill``, the admin's action): a
    #: longer range is refused, naming this setting. Counts the slots that already have a run.
    backfill_max_slots: int = 1000
    #: How often a beat prunes the ledger (one beat at a time, in a thread of its own).
    #: ``None``: beats never prune; run ``manage.py driftsafe_prune`` from cron instead.
    prune_interval_seconds: float | None = 60.0
    #: Publish with each task's Celery message built once and filled in per slot (the same
    #: message ``apply_async`` sends; see :mod:`celery_driftsafe.publish.fast_path`, which falls
    #: back to ``apply_async`` where it cannot be exact). False: always ``apply_async``.
    fast_publish: bool = True

    # -- constants and values that follow from a setting (DEPRECATED_SETTINGS as keys) -----

    #: Seconds a claimed run may stay undispatched before another beat re-publishes it; a
    #: worker's run lock lives as long between renewals. ``NODE_DEAD_AFTER_SECONDS``.
    lease_seconds: float = 30.0
    #: Seconds between node heartbeats: ``NODE_DEAD_AFTER_SECONDS`` /
    #: :data:`HEARTBEATS_PER_DEAD_AFTER`.
    heartbeat_interval_seconds: float = 30.0 / HEARTBEATS_PER_DEAD_AFTER
    #: :data:`CLAIM_BATCH_SIZE`.
    claim_batch_size: int = CLAIM_BATCH_SIZE
    #: :data:`PUBLISH_BATCH_SIZE`.
    publish_batch_size: int = PUBLISH_BATCH_SIZE
    #: In a wave (a full claim batch), claim the next batches in a helper process of the
    #: beat's own while the beat publishes (see :mod:`celery_driftsafe.claim.helper_process`).
    #: False (tests and benchmarks only): in a thread of the beat.
    claim_process: bool = True
    #: :data:`HARD_CLOCK_OFFSET_SECONDS`.
    hard_clock_offset_seconds: float = HARD_CLOCK_OFFSET_SECONDS
    #: :data:`CLOCK_SYNC_INTERVAL_SECONDS`.
    clock_sync_interval_seconds: float = CLOCK_SYNC_INTERVAL_SECONDS
    #: :data:`CLOCK_SYNC_SAMPLES`.
    clock_sync_samples: int = CLOCK_SYNC_SAMPLES
    #: The beat's longest wait without Celery's ``beat_max_loop_interval``:
    #: :data:`MAX_LOOP_INTERVAL_SECONDS` (the scheduler's ``max_interval`` is what it waits).
    max_loop_interval_seconds: float = MAX_LOOP_INTERVAL_SECONDS
    #: :data:`MIN_ROUND_INTERVAL_SECONDS`.
    min_round_interval_seconds: float = MIN_ROUND_INTERVAL_SECONDS
    #: :data:`STUCK_RUN_SECONDS`.
    stuck_run_seconds: float = STUCK_RUN_SECONDS
    #: :data:`RESULT_LOOKUP_SECONDS`.
    result_lookup_seconds: float = RESULT_LOOKUP_SECONDS
    #: How often each beat looks for runs that will never hear from a worker (expired, lost,
    #: outcomes in the result backend), in a thread of its own: as often as the youngest of
    #: them come of age, ``result_lookup_seconds``.
    reconcile_interval_seconds: float = RESULT_LOOKUP_SECONDS
    #: :data:`DEADLINE_CHECK_INTERVAL_SECONDS`; ``None`` (tests only): never.
    deadline_check_interval_seconds: float | None = DEADLINE_CHECK_INTERVAL_SECONDS
    #: :data:`STALE_AFTER_SLOTS`.
    stale_after_slots: int = STALE_AFTER_SLOTS
    #: :data:`PRUNE_BATCH_SIZE`.
    prune_batch_size: int = PRUNE_BATCH_SIZE
    #: :data:`PRUNE_DUTY_CYCLE`.
    prune_duty_cycle: float = PRUNE_DUTY_CYCLE
    #: Performance mechanisms switched off, by name (:class:`~celery_driftsafe.core.stored_names.
    #: Optimisation`, a list or tuple): each only saves time, and off the beat does the same
    #: work the plain way (for measuring what each one buys; the benchmarks'
    #: ``DRIFTSAFE_BENCH_OFF``).
    optimisations_off: tuple[Optimisation, ...] = ()

    def __post_init__(self) -> None:
        names = self.optimisations_off
        known = Optimisation.values
        if not isinstance(names, list | tuple) or not all(
            isinstance(name, str) and name in known for name in names
        ):
            raise ConfigurationError(
                "OPTIMISATIONS_OFF",
                names,
                "must be a list or tuple of optimisation names",
                "known: " + ", ".join(known),
            )
        object.__setattr__(self, "optimisations_off", tuple(map(Optimisation, names)))

    def optimised(self, name: Optimisation) -> bool:
        """Whether the mechanism ``name`` is on (not in ``OPTIMISATIONS_OFF``)."""
        return name not in self.optimisations_off

    @classmethod
    def setting_names(cls) -> dict[str, str]:
        """Map of upper-case key to attribute name, for every value (settings, tuning and
        the internal ones :data:`INTERNALS` may set)."""
        return {f.name.upper(): f.name for f in dataclasses.fields(cls)}


#: The settings a project sets: the settings page's first table.
PROJECT_SETTINGS = (
    "REDIS_URL",
    "TIME_AUTHORITY",
    "CELERY_APP",
    "MISFIRE_POLICY",
    "MISFIRE_GRACE_SECONDS",
    "REDIS_UNAVAILABLE",
    "MAX_CLOCK_OFFSET_SECONDS",
    "RUN_RETENTION_SECONDS",
    "FAILED_RUN_RETENTION_SECONDS",
    "METRICS_PORT",
    "WORKER_METRICS_PORT",
    "METRICS_TOKEN",
)
#: Settings a project changes only for the reason the settings page gives each ("Tuning").
TUNING_SETTINGS = (
    "KEY_PREFIX",
    "METRICS_ADDRESS",
    "NODE_DEAD_AFTER_SECONDS",
    "RUN_EXPIRES_SECONDS",
    "FIRE_ALL_MAX",
    "BACKFILL_MAX_SLOTS",
    "PRUNE_INTERVAL_SECONDS",
    "FAST_PUBLISH",
)
#: The release from which the former settings are ignored.
REMOVED_IN = "0.4"
_CONSTANT = "now a constant ({})"
#: Former settings (up to 0.2) and what replaces each: still honoured in this release, with a
#: ``DeprecationWarning`` and check W003 saying this.
DEPRECATED_SETTINGS: dict[str, str] = {
    "LEASE_SECONDS": "follows from NODE_DEAD_AFTER_SECONDS (the same number of seconds)",
    "HEARTBEAT_INTERVAL_SECONDS": (
        f"follows from NODE_DEAD_AFTER_SECONDS (a sixth of it, {HEARTBEATS_PER_DEAD_AFTER} "
        "heartbeats before a beat is taken for dead)"
    ),
    "MAX_LOOP_INTERVAL_SECONDS": (
        "replaced by Celery's own beat_max_loop_interval (CELERY_BEAT_MAX_LOOP_INTERVAL in "
        f"Django settings) or celery beat --max-interval; default {MAX_LOOP_INTERVAL_SECONDS:g}"
    ),
    "RECONCILE_INTERVAL_SECONDS": _CONSTANT.format(f"{RESULT_LOOKUP_SECONDS:g} s"),
    "CLAIM_BATCH_SIZE": _CONSTANT.format(CLAIM_BATCH_SIZE),
    "PUBLISH_BATCH_SIZE": _CONSTANT.format(PUBLISH_BATCH_SIZE),
    "CLAIM_PROCESS": _CONSTANT.format("on"),
    "HARD_CLOCK_OFFSET_SECONDS": _CONSTANT.format(f"{HARD_CLOCK_OFFSET_SECONDS:g} s, a day"),
    "CLOCK_SYNC_INTERVAL_SECONDS": _CONSTANT.format(f"{CLOCK_SYNC_INTERVAL_SECONDS:g} s"),
    "CLOCK_SYNC_SAMPLES": _CONSTANT.format(CLOCK_SYNC_SAMPLES),
    "MIN_ROUND_INTERVAL_SECONDS": _CONSTANT.format(f"{MIN_ROUND_INTERVAL_SECONDS:g} s"),
    "STUCK_RUN_SECONDS": _CONSTANT.format(f"{STUCK_RUN_SECONDS:g} s"),
    "RESULT_LOOKUP_SECONDS": _CONSTANT.format(f"{RESULT_LOOKUP_SECONDS:g} s"),
    "DEADLINE_CHECK_INTERVAL_SECONDS": _CONSTANT.format(f"{DEADLINE_CHECK_INTERVAL_SECONDS:g} s"),
    "STALE_AFTER_SLOTS": _CONSTANT.format(STALE_AFTER_SLOTS),
    "PRUNE_BATCH_SIZE": _CONSTANT.format(PRUNE_BATCH_SIZE),
    "PRUNE_DUTY_CYCLE": _CONSTANT.format(PRUNE_DUTY_CYCLE),
    "OPTIMISATIONS_OFF": (
        "removed: every mechanism is on (the benchmarks switch them off with DRIFTSAFE_BENCH_OFF)"
    ),
}
#: Keys ``settings.DRIFTSAFE`` accepts without a warning.
SETTINGS = PROJECT_SETTINGS + TUNING_SETTINGS


def deprecation_message(key: str) -> str:
    """What a project that sets the former setting ``key`` is told."""
    return (
        f"DRIFTSAFE[{key!r}] is deprecated: {DEPRECATED_SETTINGS[key]}; it is honoured in "
        f"this release and ignored from {REMOVED_IN}"
    )


_cached: DriftSafeSettings | None = None


def raw_settings() -> dict[str, Any]:
    """The ``DRIFTSAFE`` dict from Django settings (empty when absent)."""
    value = getattr(django_settings, "DRIFTSAFE", {})
    if not isinstance(value, dict):
        raise ConfigurationError(
            "DRIFTSAFE", value, "must be a dict", "set DRIFTSAFE = {'REDIS_URL': ...} in settings"
        )
    return value


def internal_settings() -> dict[str, Any]:
    """``DRIFTSAFE_INTERNALS`` from Django settings (empty when absent): the constants and
    derived values (keys of :data:`DEPRECATED_SETTINGS`) this package's own tests and
    benchmarks change. Not a project's to set: it may change in any release."""
    value = getattr(django_settings, INTERNALS, {})
    if not isinstance(value, dict):
        raise ConfigurationError(INTERNALS, value, "must be a dict", "for tests and benchmarks")
    return value


def default_database() -> dict[str, Any]:
    """``DATABASES['default']`` from Django settings (empty when there is none)."""
    databases = getattr(django_settings, "DATABASES", None) or {}
    default = databases.get("default") if isinstance(databases, dict) else None
    return default if isinstance(default, dict) else {}


def build_settings(
    raw: dict[str, Any],
    *,
    database: Mapping[str, Any] | None = None,
    internals: Mapping[str, Any] | None = None,
    warn: bool = True,
) -> DriftSafeSettings:
    """Build a settings object from a ``DRIFTSAFE`` dict (and ``internals``, a
    ``DRIFTSAFE_INTERNALS`` dict); unknown keys raise. A former setting in ``raw`` is honoured
    with a ``DeprecationWarning`` (unless ``warn`` is false).

    Without ``KEY_PREFIX`` the prefix is derived from ``database`` (default: Django's
    ``DATABASES['default']``), see :func:`default_key_prefix`; the lease and the heartbeat
    interval follow from ``NODE_DEAD_AFTER_SECONDS`` unless set themselves."""
    names = DriftSafeSettings.setting_names()
    unknown = sorted(set(raw) - set(SETTINGS) - set(DEPRECATED_SETTINGS))
    if unknown:
        raise ConfigurationError(
            unknown[0],
            raw[unknown[0]],
            "unknown setting",
            "known settings: " + ", ".join(sorted(SETTINGS)),
        )
    internals = internals or {}
    foreign = sorted(set(internals) - set(DEPRECATED_SETTINGS))
    if foreign:
        raise ConfigurationError(
            foreign[0],
            internals[foreign[0]],
            f"not an internal value ({INTERNALS} is for this package's tests and benchmarks)",
            "set it in DRIFTSAFE"
            if foreign[0] in SETTINGS
            else "known: " + ", ".join(sorted(DEPRECATED_SETTINGS)),
        )
    if warn:
        for key in sorted(set(raw) & set(DEPRECATED_SETTINGS)):
            warnings.warn(deprecation_message(key), DeprecationWarning, stacklevel=3)
    values = {names[key]: value for key, value in {**raw, **internals}.items()}
    if "key_prefix" not in values:
        values["key_prefix"] = default_key_prefix(
            default_database() if database is None else database
        )
    dead_after = values.get("node_dead_after_seconds", DriftSafeSettings.node_dead_after_seconds)
    if isinstance(dead_after, int | float) and not isinstance(dead_after, bool):
        values.setdefault("lease_seconds", dead_after)
        values.setdefault("heartbeat_interval_seconds", dead_after / HEARTBEATS_PER_DEAD_AFTER)
    if "result_lookup_seconds" in values:
        values.setdefault("reconcile_interval_seconds", values["result_lookup_seconds"])
    return DriftSafeSettings(**values)


def get_settings() -> DriftSafeSettings:
    """The current settings (cached until Django's ``setting_changed`` fires for DRIFTSAFE or
    DRIFTSAFE_INTERNALS)."""
    global _cached
    if _cached is None:
        _cached = build_settings(raw_settings(), internals=internal_settings())
        _switch_core(_cached)
    return _cached


def _switch_core(settings: DriftSafeSettings) -> None:
    """The pure core reads no settings: its switches (``OPTIMISATIONS_OFF``) are set here,
    each time the settings are read after a change."""
    instants.remember_iso_texts(settings.optimised(Optimisation.ISO_TEXTS))


def clear_cache(**kwargs: Any) -> None:
    """``setting_changed`` receiver: forget the cached settings."""
    global _cached
    if kwargs.get("setting", "DRIFTSAFE") in ("DRIFTSAFE", INTERNALS):
        _cached = None
        try:  # the core's switches now, not at the next read of the settings
            _switch_core(build_settings(raw_settings(), internals=internal_settings(), warn=False))
        except ConfigurationError:  # the checks say what is wrong; every mechanism on
            _switch_core(DriftSafeSettings())
