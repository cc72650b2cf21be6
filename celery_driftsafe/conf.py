"""The settings surface: one typed, read-on-access view of ``settings.DRIFTSAFE``.

Every setting lives in one dict in Django settings::

    DRIFTSAFE = {
        "REDIS_URL": "redis://127.0.0.1:6379/0",
        "TIME_AUTHORITY": "auto",
    }

:func:`get_settings` builds a :class:`DriftSafeSettings` from it each time it is asked after a
change (Django's ``setting_changed`` signal clears the cache), so ``override_settings`` works
in tests and nothing is read at import time. Values are validated by the system checks in
:mod:`celery_driftsafe.checks`; :func:`get_settings` raises :class:`ConfigurationError` for a
value it cannot use at all.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
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
    """Every setting, with its default. Keys in ``settings.DRIFTSAFE`` are the upper-case names."""

    #: Redis for locks, wake-up notifications and (optionally) the time authority.
    #: ``None``: no Redis; locks fall back to the database and beats poll for changes.
    redis_url: str | None = None
    #: Prefix of every Redis key and channel this package uses. :func:`get_settings` derives
    #: the default from the default database (:func:`default_key_prefix`), so two projects
    #: sharing one Redis database never see each other's locks or wake-ups.
    key_prefix: str = DEFAULT_KEY_PREFIX
    #: Whose clock decides due-ness: ``database`` (the database server's clock), ``redis``
    #: (Redis ``TIME``), ``local`` (this process's wall clock; one machine only), or ``auto``:
    #: the database's where it has one (PostgreSQL, MySQL), else Redis' when ``REDIS_URL`` is
    #: set, else the local clock (see :func:`celery_driftsafe.store.clock.resolve_time_authority`).
    time_authority: TimeAuthority = TimeAuthority.AUTO
    #: The most runs one claim round takes.
    claim_batch_size: int = 500
    #: Messages written to the broker in one pipelined write (kombu's publish batch, on
    #: transports that have one: Redis). 1: one write per message.
    publish_batch_size: int = 100
    #: Publish with each task's Celery message built once and filled in per slot (the same
    #: message ``apply_async`` sends; see :mod:`celery_driftsafe.publish.fast_path`, which falls
    #: back to ``apply_async`` where it cannot be exact). False: always ``apply_async``.
    fast_publish: bool = True
    #: In a wave (a full claim batch), claim the next batches in a helper process of the
    #: beat's own while the beat publishes (see :mod:`celery_driftsafe.claim.helper_process`).
    #: False: in a thread of the beat. Only on databases with ``SKIP LOCKED``.
    claim_process: bool = True
    #: Seconds a claimed run may stay undispatched before another beat re-publishes it.
    lease_seconds: float = 30.0
    #: A node whose measured offset from the authority exceeds this logs a warning.
    max_clock_offset_seconds: float = 1.0
    #: A node whose measured offset exceeds this stops claiming (its clock answer is absurd).
    hard_clock_offset_seconds: float = 3600.0 * 6
    #: How often a node re-measures its offset from the authority.
    clock_sync_interval_seconds: float = 60.0
    #: Round trips per offset measurement; the one with the lowest round trip wins.
    clock_sync_samples: int = 5
    #: Default misfire policy of a task that does not set its own.
    misfire_policy: MisfirePolicy = MisfirePolicy.FIRE_ONCE
    #: Seconds past its slot after which a slot counts as missed (default for tasks).
    misfire_grace_seconds: float = 60.0
    #: Upper bound on catch-up runs one ``fire_all`` task gets after downtime.
    fire_all_max: int = 100
    #: The most slots one backfill may cover (``driftsafe_backfill``, the admin's action): a
    #: longer range is refused, naming this setting. Counts the slots that already have a run.
    backfill_max_slots: int = 1000
    #: Seconds between node heartbeats.
    heartbeat_interval_seconds: float = 5.0
    #: A node whose heartbeat is older than this is considered dead.
    node_dead_after_seconds: float = 30.0
    #: The longest a beat sleeps between two looks at the schedule.
    max_loop_interval_seconds: float = 1.0
    #: The shortest time from the start of one claim round to the start of the next, unless
    #: the last round took a full batch. Slots falling due a few milliseconds apart are then
    #: claimed and published together: a slot may go out up to this much later, and the beat
    #: and the database pay for a round (a dozen statements) per this interval, not per slot.
    #: 0: a round whenever a slot is due.
    min_round_interval_seconds: float = 0.02
    #: Message expiry of a scheduled run whose task sets no ``expires_seconds``: seconds
    #: after its slot, on the time authority's clock. ``None``: such messages never expire.
    run_expires_seconds: float | None = 86400.0
    #: A run with no outcome this many seconds after its claim is reconciled (a ``started``
    #: run whose lock nobody holds becomes ``failed``) and listed under "needs attention" in
    #: the admin.
    stuck_run_seconds: float = 3600.0
    #: A run still ``dispatched`` this many seconds after its claim takes the result backend's
    #: outcome when it holds one (``SUCCESS``, ``FAILURE``, ``REVOKED``): how a plain task's
    #: run (no ``DriftSafeTask``) gets its outcome; asked again each minute until it has one.
    result_lookup_seconds: float = 60.0
    #: How often each beat looks for runs that will never hear from a worker (expired, lost,
    #: outcomes in the result backend), in a thread of its own: they are a minute
    #: (``RESULT_LOOKUP_SECONDS``), an hour (``STUCK_RUN_SECONDS``) or a day
    #: (``RUN_EXPIRES_SECONDS``) old, and looking for expired ones reads the runs still
    #: waiting for an outcome (~200 ms in a steady 100,000-task stream).
    reconcile_interval_seconds: float = 60.0
    #: How often each beat looks for late runs and stale tasks of the tasks with a
    #: ``deadline_seconds`` (in a thread of its own; one indexed read of those tasks, and one
    #: of each one's recent runs): a missed deadline is reported at most this long after it
    #: passed (plus a claim round). ``None``: beats never check deadlines.
    deadline_check_interval_seconds: float | None = 2.0
    #: A task with a deadline none of whose last this many slots past their deadline
    #: succeeded (a late success counts) is flagged stale
    #: (``PeriodicTask.stale_since``, the ``task_became_stale`` signal), until a run succeeds.
    stale_after_slots: int = 3
    #: What ``DriftSafeTask`` does when Redis cannot be reached.
    redis_unavailable: RedisUnavailablePolicy = RedisUnavailablePolicy.FAIL_CLOSED
    #: Finished runs (succeeded, skipped, revoked) are deleted this many seconds after their
    #: claim, with their attempts, lock rows and fencing counters (see
    #: :mod:`celery_driftsafe.ledger.retention`). ``None``: kept forever.
    run_retention_seconds: float | None = 7 * 86400.0
    #: The same for runs that did not succeed (failed, missed, expired). ``None``: kept forever.
    failed_run_retention_seconds: float | None = 30 * 86400.0
    #: How often a beat prunes the ledger (one beat at a time, in a thread of its own).
    #: ``None``: beats never prune; run ``manage.py driftsafe_prune`` from cron instead.
    prune_interval_seconds: float | None = 60.0
    #: Runs one pruning statement deletes (with their attempts, lock rows and counters).
    prune_batch_size: int = 500
    #: The share of a pruning pass's time spent deleting (0 < share <= 1): after a batch that
    #: took ``t`` seconds the pass pauses ``t * (1 - share) / share``. Lower is gentler on
    #: the claim loop and slower to clear a backlog.
    prune_duty_cycle: float = 0.25
    #: Dotted path of the project's Celery app (``"proj.celery:app"``), for the admin's task
    #: name checks and "run now". ``None``: Celery's current app.
    celery_app: str | None = None
    #: A beat serves its Prometheus metrics on this TCP port (needs the ``metrics`` extra).
    #: ``None``: no metrics. Each beat on one host needs its own port.
    metrics_port: int | None = None
    #: A worker's main process serves its Prometheus metrics on this TCP port (a prefork pool
    #: also needs ``PROMETHEUS_MULTIPROC_DIR``; see the monitoring how-to). ``None``: none.
    worker_metrics_port: int | None = None
    #: The address the metrics ports listen on: this host only by default; ``"0.0.0.0"`` (or
    #: ``"::"``) serves every interface, to anyone who can reach the host.
    metrics_address: str = "127.0.0.1"
    #: The bearer token a scraper sends to the metrics view (``Authorization: Bearer <token>``).
    #: ``None``: only logged-in users allowed to view tasks, runs and nodes see the view.
    #: Kept out of the settings' ``repr``.
    metrics_token: str | None = dataclasses.field(default=None, repr=False)
    #: Performance mechanisms switched off, by name (:class:`~celery_driftsafe.core.stored_names.
    #: Optimisation`, a list or tuple): each only saves time, and off the beat does the same
    #: work the plain way (for measuring what each one buys).
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
        """Map of ``DRIFTSAFE`` key (upper case) to attribute name."""
        return {f.name.upper(): f.name for f in dataclasses.fields(cls)}


_cached: DriftSafeSettings | None = None


def raw_settings() -> dict[str, Any]:
    """The ``DRIFTSAFE`` dict from Django settings (empty when absent)."""
    value = getattr(django_settings, "DRIFTSAFE", {})
    if not isinstance(value, dict):
        raise ConfigurationError(
            "DRIFTSAFE", value, "must be a dict", "set DRIFTSAFE = {'REDIS_URL': ...} in settings"
        )
    return value


def default_database() -> dict[str, Any]:
    """``DATABASES['default']`` from Django settings (empty when there is none)."""
    databases = getattr(django_settings, "DATABASES", None) or {}
    default = databases.get("default") if isinstance(databases, dict) else None
    return default if isinstance(default, dict) else {}


def build_settings(
    raw: dict[str, Any], *, database: Mapping[str, Any] | None = None
) -> DriftSafeSettings:
    """Build a settings object from a ``DRIFTSAFE`` dict; unknown keys raise.

    Without ``KEY_PREFIX`` the prefix is derived from ``database`` (default: Django's
    ``DATABASES['default']``), see :func:`default_key_prefix`."""
    names = DriftSafeSettings.setting_names()
    unknown = sorted(set(raw) - set(names))
    if unknown:
        raise ConfigurationError(
            unknown[0],
            raw[unknown[0]],
            "unknown setting",
            "known settings: " + ", ".join(sorted(names)),
        )
    values = {names[key]: value for key, value in raw.items()}
    if "key_prefix" not in values:
        values["key_prefix"] = default_key_prefix(
            default_database() if database is None else database
        )
    return DriftSafeSettings(**values)


def get_settings() -> DriftSafeSettings:
    """The current settings (cached until Django's ``setting_changed`` fires for DRIFTSAFE)."""
    global _cached
    if _cached is None:
        _cached = build_settings(raw_settings())
        _switch_core(_cached)
    return _cached


def _switch_core(settings: DriftSafeSettings) -> None:
    """The pure core reads no settings: its switches (``OPTIMISATIONS_OFF``) are set here,
    each time the settings are read after a change."""
    instants.remember_iso_texts(settings.optimised(Optimisation.ISO_TEXTS))


def clear_cache(**kwargs: Any) -> None:
    """``setting_changed`` receiver: forget the cached settings."""
    global _cached
    if kwargs.get("setting", "DRIFTSAFE") == "DRIFTSAFE":
        _cached = None
        try:  # the core's switches now, not at the next read of the settings
            _switch_core(build_settings(raw_settings()))
        except ConfigurationError:  # the checks say what is wrong; every mechanism on
            _switch_core(DriftSafeSettings())
