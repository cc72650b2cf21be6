"""Django system checks for ``settings.DRIFTSAFE``.

Stable ids (documented in the settings reference):

========================  ==============================================================
``celery_driftsafe.E001``  ``DRIFTSAFE`` (or ``DRIFTSAFE_INTERNALS``) is not a dict
``celery_driftsafe.E002``  unknown key in ``DRIFTSAFE`` (or ``DRIFTSAFE_INTERNALS``)
``celery_driftsafe.E003``  a choice setting has a value outside its choices
``celery_driftsafe.E004``  a number setting is not a positive number (seconds: at most 100 years)
``celery_driftsafe.E005``  ``REDIS_URL`` is not a Redis URL
``celery_driftsafe.E006``  ``TIME_AUTHORITY`` is ``redis`` but ``REDIS_URL`` is not set
``celery_driftsafe.E007``  ``KEY_PREFIX`` is not a non-empty string without spaces
``celery_driftsafe.E008``  ``MISFIRE_GRACE_SECONDS`` is negative or over 100 years
``celery_driftsafe.E009``  ``CELERY_APP`` is not a dotted path
``celery_driftsafe.E010``  ``USE_TZ`` is not ``True`` (slots are aware UTC instants)
``celery_driftsafe.E011``  a switch (``FAST_PUBLISH``, ``CLAIM_PROCESS``) is not True or False
``celery_driftsafe.E012``  the database's ``AUTOCOMMIT`` is off (claims would never commit)
``celery_driftsafe.E013``  ``DATABASE_ROUTERS`` write this app's models to another database
``celery_driftsafe.E020``  ``METRICS_PORT`` / ``WORKER_METRICS_PORT`` is not a port number
``celery_driftsafe.E021``  metrics are switched on but prometheus-client is not installed
``celery_driftsafe.E022``  ``METRICS_ADDRESS`` is not an IP address or a host name
``celery_driftsafe.E023``  ``PRUNE_DUTY_CYCLE`` is not a number above 0 and at most 1
``celery_driftsafe.E024``  ``MIN_ROUND_INTERVAL_SECONDS`` is not a number from 0 to
                           ``MAX_LOOP_INTERVAL_SECONDS``
``celery_driftsafe.E028``  ``METRICS_TOKEN`` is not printable ASCII without spaces, or None
``celery_driftsafe.E030``  a whole-number setting is above its largest useful value
                           (:data:`INT_MAXIMA`)
``celery_driftsafe.E031``  ``NODE_DEAD_AFTER_SECONDS`` (from which the lease follows) or a
                           former ``LEASE_SECONDS`` is below :data:`MIN_LEASE_SECONDS`
``celery_driftsafe.E032``  ``NODE_DEAD_AFTER_SECONDS`` is below twice a former
                           ``HEARTBEAT_INTERVAL_SECONDS``
``celery_driftsafe.E033``  ``OPTIMISATIONS_OFF`` is not a list or tuple of known optimisation
                           names (:class:`~celery_driftsafe.core.stored_names.Optimisation`)
``celery_driftsafe.W001``  ``TIME_AUTHORITY`` is set to ``database`` on SQLite (no shared clock)
``celery_driftsafe.W002``  ``MAX_CLOCK_OFFSET_SECONDS`` is not below the hard bound
``celery_driftsafe.W003``  a former setting is set (:data:`~celery_driftsafe.conf.
                           DEPRECATED_SETTINGS`): still honoured, ignored from 0.4
``celery_driftsafe.W020``  ``METRICS_TOKEN`` is shorter than 32 characters
========================  ==============================================================
"""

from __future__ import annotations

import enum
import ipaddress
import logging
import re
import typing
from collections.abc import Iterable, Sequence
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings as django_settings
from django.core.checks import CheckMessage, Error, Warning
from django.db import connections

from celery_driftsafe import conf
from celery_driftsafe.core.stored_names import Optimisation
from celery_driftsafe.core.validation import seconds_in_calendar
from celery_driftsafe.exceptions import ConfigurationError

#: Start-up refusals speak for the beat.
_beat_logger = logging.getLogger("celery_driftsafe.scheduler")


def _declared() -> dict[str, Any]:
    """Each setting's declared type (``DRIFTSAFE`` key -> type) in :mod:`~celery_driftsafe.conf`."""
    hints = typing.get_type_hints(conf.DriftSafeSettings)
    return {name.upper(): hints[name] for name in conf.DriftSafeSettings.setting_names().values()}


def _choices() -> dict[str, tuple[str, ...]]:
    """Settings whose type is a string enum: the values they accept."""
    return {
        key: tuple(kind)
        for key, kind in _declared().items()
        if isinstance(kind, type) and issubclass(kind, enum.StrEnum)
    }


def _of_type(kind: type) -> tuple[str, ...]:
    """Settings declared exactly ``kind`` (not optional) that must be positive; a setting
    with a check of its own (``OWN_CHECK``) is left out."""
    return tuple(
        key for key, declared in _declared().items() if declared is kind and key not in OWN_CHECK
    )


def _switches() -> tuple[str, ...]:
    """Settings declared ``bool``: True or False, nothing else."""
    return tuple(key for key, declared in _declared().items() if declared is bool)


#: Number settings where None turns the feature off (keep forever, never prune, ...): the
#: hint of their check.
_POSITIVE_OR_NONE = {
    "RUN_EXPIRES_SECONDS": "for example 86400 (a day), or None for messages that never expire",
    "RUN_RETENTION_SECONDS": "for example 604800 (a week), or None to keep runs forever",
    "FAILED_RUN_RETENTION_SECONDS": "for example 2592000 (30 days), or None to keep them forever",
    "PRUNE_INTERVAL_SECONDS": "for example 60, or None when driftsafe_prune runs from cron",
    "DEADLINE_CHECK_INTERVAL_SECONDS": "for example 2, or None when no beat checks deadlines",
}
#: Number settings that accept 0 (checked on their own).
OWN_CHECK = ("MISFIRE_GRACE_SECONDS", "PRUNE_DUTY_CYCLE", "MIN_ROUND_INTERVAL_SECONDS")
#: Below this many characters, ``METRICS_TOKEN`` is warned about (W020).
MIN_TOKEN_LENGTH = 32
REDIS_SCHEMES = ("redis", "rediss", "unix", "redis+sentinel", "rediss+sentinel")
#: The largest useful value of each whole-number setting, and why: beyond it a beat holds
#: a round's rows, messages or statements in one piece for no gain (check E030).
INT_MAXIMA = {
    "CLAIM_BATCH_SIZE": (10_000, "one claim round's runs are one transaction and held in memory"),
    "PUBLISH_BATCH_SIZE": (10_000, "one pipelined write to the broker is held in memory"),
    "PRUNE_BATCH_SIZE": (10_000, "one pruning batch is one transaction that locks its rows"),
    "FIRE_ALL_MAX": (10_000, "a fire_all task's catch-up runs are claimed in one round"),
    "BACKFILL_MAX_SLOTS": (100_000, "a backfill's slots are listed in memory before it runs"),
    "CLOCK_SYNC_SAMPLES": (100, "each sample is a round trip to the time authority"),
    "STALE_AFTER_SLOTS": (1000, "a task's last slots are read at each deadline check"),
}
#: The shortest lease, ``NODE_DEAD_AFTER_SECONDS`` (check E031): run locks are renewed every
#: third of it, and a beat's claims must outlast the round that publishes them, or other beats
#: publish them too.
MIN_LEASE_SECONDS = 1.0
#: ``NODE_DEAD_AFTER_SECONDS`` is at least this many heartbeat intervals (check E032): a live
#: node whose heartbeat is a little late (a long round, a slow database) is not taken for dead.
HEARTBEATS_BEFORE_DEAD = 2


def _error(key: str, value: Any, problem: str, hint: str, id_: str) -> Error:
    return Error(f"DRIFTSAFE[{key!r}] = {value!r}: {problem}", hint=hint, id=id_)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Validate every key of ``settings.DRIFTSAFE`` (and of ``DRIFTSAFE_INTERNALS``, the
    package's own tests' and benchmarks')."""
    try:
        given = conf.raw_settings()
        internals = conf.internal_settings()
    except ConfigurationError as exc:
        return [Error(str(exc), hint="DRIFTSAFE must be a dict", id="celery_driftsafe.E001")]
    return list(_check_surface(given, internals)) + list(_check_raw({**given, **internals}))


def _check_surface(given: dict[str, Any], internals: dict[str, Any]) -> Iterable[CheckMessage]:
    """Keys a project may set in ``DRIFTSAFE`` (the former ones with W003), and the keys of
    ``DRIFTSAFE_INTERNALS``."""
    for key in sorted(set(given) - set(conf.SETTINGS) - set(conf.DEPRECATED_SETTINGS)):
        yield _error(
            key,
            given[key],
            "unknown setting",
            "known: " + ", ".join(sorted(conf.SETTINGS)),
            "celery_driftsafe.E002",
        )
    for key in sorted(set(given) & set(conf.DEPRECATED_SETTINGS)):
        yield Warning(
            conf.deprecation_message(key),
            hint="remove it from DRIFTSAFE (see 'Renamed or removed' in the settings reference)",
            id="celery_driftsafe.W003",
        )
    for key in sorted(set(internals) - set(conf.DEPRECATED_SETTINGS)):
        yield Error(
            f"{conf.INTERNALS}[{key!r}] = {internals[key]!r}: not an internal value",
            hint=f"{conf.INTERNALS} is for this package's tests and benchmarks"
            + ("; set it in DRIFTSAFE" if key in conf.SETTINGS else ""),
            id="celery_driftsafe.E002",
        )


def _check_raw(raw: dict[str, Any]) -> Iterable[CheckMessage]:
    """The values of ``raw`` (``DRIFTSAFE`` with ``DRIFTSAFE_INTERNALS`` over it)."""
    known = conf.DriftSafeSettings.setting_names()
    defaults = conf.DriftSafeSettings()
    for key, choices in _choices().items():
        if key in raw and raw[key] not in choices:
            yield _error(
                key,
                raw[key],
                "not a valid choice",
                "one of: " + ", ".join(choices),
                "celery_driftsafe.E003",
            )
    for key in _of_type(int):
        value = raw.get(key, 1)
        if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            yield _error(
                key,
                value,
                "must be a positive whole number",
                f"for example {getattr(defaults, known[key])}",
                "celery_driftsafe.E004",
            )
    for key in _of_type(float):
        value = raw.get(key, 1.0)
        if not (seconds_in_calendar(value) and value > 0):
            yield _error(
                key,
                value,
                "must be a positive number of seconds, up to a hundred years",
                f"for example {getattr(defaults, known[key])}",
                "celery_driftsafe.E004",
            )
    for key in _switches():
        value = raw.get(key, True)
        if not isinstance(value, bool):
            yield _error(
                key,
                value,
                "must be True or False",
                f"for example {getattr(defaults, known[key])}",
                "celery_driftsafe.E011",
            )
    redis_url = raw.get("REDIS_URL")
    if redis_url is not None and (
        not isinstance(redis_url, str) or urlsplit(redis_url).scheme not in REDIS_SCHEMES
    ):
        yield _error(
            "REDIS_URL",
            redis_url,
            "not a Redis URL",
            "use redis://host:6379/0, rediss:// for TLS, unix:///path, or None for no Redis",
            "celery_driftsafe.E005",
        )
    if raw.get("TIME_AUTHORITY") == "redis" and not redis_url:
        yield _error(
            "TIME_AUTHORITY",
            "redis",
            "needs DRIFTSAFE['REDIS_URL']",
            "set REDIS_URL, or use TIME_AUTHORITY 'auto' (the default) or 'database'",
            "celery_driftsafe.E006",
        )
    prefix = raw.get("KEY_PREFIX", "driftsafe")
    if not (isinstance(prefix, str) and prefix and not any(c.isspace() for c in prefix)):
        yield _error(
            "KEY_PREFIX",
            prefix,
            "must be a non-empty string without spaces",
            "for example 'driftsafe' or 'myproject:driftsafe'",
            "celery_driftsafe.E007",
        )
    app_path = raw.get("CELERY_APP")
    if app_path is not None and not (isinstance(app_path, str) and app_path.strip()):
        yield _error(
            "CELERY_APP",
            app_path,
            "must be a dotted path to a Celery app, or None",
            "for example 'proj.celery:app'",
            "celery_driftsafe.E009",
        )
    for key, hint in _POSITIVE_OR_NONE.items():
        value = raw.get(key)
        if value is not None and not (seconds_in_calendar(value) and value > 0):
            yield _error(
                key,
                value,
                "must be a positive number of seconds up to a hundred years, or None",
                hint,
                "celery_driftsafe.E004",
            )
    grace = raw.get("MISFIRE_GRACE_SECONDS", 0)
    if not (seconds_in_calendar(grace) and grace >= 0):
        yield _error(
            "MISFIRE_GRACE_SECONDS",
            grace,
            "must be a number of seconds >= 0, up to a hundred years",
            "for example 60",
            "celery_driftsafe.E008",
        )
    duty = raw.get("PRUNE_DUTY_CYCLE", defaults.prune_duty_cycle)
    if not (_is_number(duty) and 0 < duty <= 1):
        yield _error(
            "PRUNE_DUTY_CYCLE",
            duty,
            "must be a number above 0 and at most 1 (the share of a pass spent deleting)",
            f"for example {defaults.prune_duty_cycle}; 1 deletes without pausing",
            "celery_driftsafe.E023",
        )
    spacing = raw.get("MIN_ROUND_INTERVAL_SECONDS", defaults.min_round_interval_seconds)
    longest = raw.get("MAX_LOOP_INTERVAL_SECONDS", defaults.max_loop_interval_seconds)
    if not (
        _is_number(spacing) and spacing >= 0 and (not _is_number(longest) or spacing <= longest)
    ):
        yield _error(
            "MIN_ROUND_INTERVAL_SECONDS",
            spacing,
            f"must be a number of seconds from 0 to MAX_LOOP_INTERVAL_SECONDS ({longest!r})",
            f"for example {defaults.min_round_interval_seconds}; 0 claims whenever a slot is due",
            "celery_driftsafe.E024",
        )
    yield from _check_relations(raw, defaults)
    yield from _check_metrics(raw)
    yield from _check_optimisations(raw.get("OPTIMISATIONS_OFF", ()))
    warn = raw.get("MAX_CLOCK_OFFSET_SECONDS", defaults.max_clock_offset_seconds)
    hard = raw.get("HARD_CLOCK_OFFSET_SECONDS", defaults.hard_clock_offset_seconds)
    if _is_number(warn) and _is_number(hard) and warn >= hard:
        yield Warning(
            f"DRIFTSAFE['MAX_CLOCK_OFFSET_SECONDS'] = {warn!r} is not below "
            f"DRIFTSAFE['HARD_CLOCK_OFFSET_SECONDS'] = {hard!r}",
            hint="the warning bound should be smaller than the bound that stops claiming",
            id="celery_driftsafe.W002",
        )


def _check_relations(
    raw: dict[str, Any], defaults: conf.DriftSafeSettings
) -> Iterable[CheckMessage]:
    """Ranges a type does not tell (a batch of a billion runs, a lease of a nanosecond) and
    settings that only make sense together; a value E004 already refuses is not judged again."""
    known = conf.DriftSafeSettings.setting_names()
    for key, (largest, why) in INT_MAXIMA.items():
        value = raw.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > largest:
            yield _error(
                key,
                value,
                f"is more than {largest:,}: {why}",
                f"for example {getattr(defaults, known[key])}; at most {largest:,}",
                "celery_driftsafe.E030",
            )
    dead = raw.get("NODE_DEAD_AFTER_SECONDS", defaults.node_dead_after_seconds)
    lease_key = "LEASE_SECONDS" if "LEASE_SECONDS" in raw else "NODE_DEAD_AFTER_SECONDS"
    lease = raw.get(lease_key, defaults.lease_seconds)
    if seconds_in_calendar(lease) and 0 < lease < MIN_LEASE_SECONDS:
        yield _error(
            lease_key,
            lease,
            f"is below {MIN_LEASE_SECONDS:g} s: run locks are renewed every third of it, and "
            "other beats would publish a beat's claims again while it still publishes them",
            f"for example {defaults.lease_seconds}; at least {MIN_LEASE_SECONDS:g}",
            "celery_driftsafe.E031",
        )
    beat = raw.get("HEARTBEAT_INTERVAL_SECONDS")
    if (
        beat is not None
        and seconds_in_calendar(beat)
        and seconds_in_calendar(dead)
        and beat > 0
        and 0 < dead < HEARTBEATS_BEFORE_DEAD * beat
    ):
        yield _error(
            "NODE_DEAD_AFTER_SECONDS",
            dead,
            f"is below {HEARTBEATS_BEFORE_DEAD} x HEARTBEAT_INTERVAL_SECONDS ({beat!r}): a live "
            "beat would be taken for dead between two heartbeats, and its claims published "
            "by another beat",
            f"for example {defaults.node_dead_after_seconds} with heartbeats every "
            f"{defaults.heartbeat_interval_seconds} s; at least {HEARTBEATS_BEFORE_DEAD} "
            "heartbeat intervals, better five or more",
            "celery_driftsafe.E032",
        )


def _check_optimisations(value: Any) -> Iterable[CheckMessage]:
    """``OPTIMISATIONS_OFF``: a list or tuple of :class:`Optimisation` names."""
    known = "known: " + ", ".join(Optimisation.values)
    if not isinstance(value, list | tuple):
        yield _error(
            "OPTIMISATIONS_OFF",
            value,
            "must be a list or tuple of optimisation names",
            f"for example ['prebuild']; {known}",
            "celery_driftsafe.E033",
        )
        return
    for name in value:
        if not (isinstance(name, str) and name in Optimisation.values):
            yield _error(
                "OPTIMISATIONS_OFF",
                value,
                f"{name!r} is not an optimisation's name",
                known,
                "celery_driftsafe.E033",
            )


def _check_metrics(raw: dict[str, Any]) -> Iterable[CheckMessage]:
    from celery_driftsafe.monitoring.metrics import EXTRA_HINT, prometheus_missing

    switched_on = []
    for key in ("METRICS_PORT", "WORKER_METRICS_PORT"):
        port = raw.get(key)
        if port is None:
            continue
        switched_on.append(key)
        if not (isinstance(port, int) and not isinstance(port, bool) and 0 <= port < 65536):
            yield _error(
                key,
                port,
                "must be a TCP port number (0-65535), or None",
                "for example 9808; 0 takes any free port (logged); None serves no metrics",
                "celery_driftsafe.E020",
            )
    address = raw.get("METRICS_ADDRESS", "127.0.0.1")
    if not _is_address(address):
        yield _error(
            "METRICS_ADDRESS",
            address,
            "must be an IP address or a host name (no port, no scheme)",
            "for example '127.0.0.1' (this host only, the default), one interface's address, "
            "or '0.0.0.0' (every interface: see what that exposes in the monitoring how-to)",
            "celery_driftsafe.E022",
        )
    token = raw.get("METRICS_TOKEN")
    if token is not None and not (
        isinstance(token, str)
        and token.isascii()
        and token.isprintable()
        and " " not in token
        and token
    ):
        yield _error(
            "METRICS_TOKEN",
            "<hidden>" if isinstance(token, str) else type(token).__name__,
            "must be printable ASCII without spaces (the metrics view's bearer token), or None",
            "for example secrets.token_urlsafe(32), read from the environment or a secrets file",
            "celery_driftsafe.E028",
        )
    elif isinstance(token, str) and len(token) < MIN_TOKEN_LENGTH:
        yield Warning(
            f"DRIFTSAFE['METRICS_TOKEN'] has {len(token)} characters: a short bearer token "
            "can be guessed",
            hint=f"use at least {MIN_TOKEN_LENGTH} random characters, for example "
            "secrets.token_urlsafe(32)",
            id="celery_driftsafe.W020",
        )
    missing = prometheus_missing() if switched_on else None
    if missing:
        yield _error(
            switched_on[0],
            raw[switched_on[0]],
            "metrics are switched on but prometheus-client is not installed",
            f"{EXTRA_HINT}, or set it to None",
            "celery_driftsafe.E021",
        )


_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def _is_address(value: Any) -> bool:
    """An IP address (v4 or v6) or a DNS host name: what a socket can listen on."""
    if not isinstance(value, str) or not value:
        return False
    try:
        ipaddress.ip_address(value)
    except ValueError:
        name = value.removesuffix(".")
        return len(name) <= 253 and all(_HOST_LABEL.fullmatch(p) for p in name.split("."))
    return True


def check_use_tz(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Slots, claims and heartbeats are aware UTC datetimes: Django must store them so."""
    use_tz = getattr(django_settings, "USE_TZ", False)
    if use_tz is True:
        return []
    return [
        Error(
            f"USE_TZ = {use_tz!r}: celery_driftsafe stores every slot, claim and heartbeat as an "
            "aware UTC instant, which Django does only with USE_TZ = True",
            hint="set USE_TZ = True in the Django settings (TIME_ZONE stays the zone shown to "
            "people; each periodic task keeps its own crontab time zone)",
            id="celery_driftsafe.E010",
        )
    ]


def check_autocommit(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """A claim, a mark and a worker's ledger write are each committed by ``atomic()`` or by
    autocommit. With ``AUTOCOMMIT`` off, Django commits neither: a beat would publish runs
    whose rows are rolled back when its connection closes, and workers reject their messages
    as unknown runs."""
    database = getattr(django_settings, "DATABASES", {}).get("default", {})
    if database.get("AUTOCOMMIT", True) is not False:
        return []
    return [
        Error(
            "DATABASES['default']['AUTOCOMMIT'] = False: Django then commits no transaction, "
            "so celery_driftsafe's claims and ledger writes would be rolled back when a "
            "connection closes, after their messages went out",
            hint="remove AUTOCOMMIT from DATABASES['default'] (Django's default is True); "
            "code that wants its own transactions uses transaction.atomic()",
            id="celery_driftsafe.E012",
        )
    ]


def check_routing(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Beats and workers use the ``default`` database; a router that writes this app's models
    elsewhere (or keeps its tables out of ``default``) would leave the admin and the beats on
    different tables. Reads are not judged: a router sending them to a replica of ``default``
    is common, and what the admin shows from there is only as old as the replica."""
    from django.apps import apps
    from django.db import DEFAULT_DB_ALIAS, router

    problems = []
    config = apps.get_app_config("celery_driftsafe")
    for model in config.get_models():
        label = model._meta.label
        alias = router.db_for_write(model)
        if alias != DEFAULT_DB_ALIAS:
            problems.append(f"{label} writes go to {alias!r}")
        if not router.allow_migrate_model(DEFAULT_DB_ALIAS, model):
            problems.append(f"{label} is not migrated on 'default'")
    if not problems:
        return []
    return [
        Error(
            "DATABASE_ROUTERS route celery_driftsafe's models away from the 'default' database, "
            f"which beats and workers use: {'; '.join(problems)}",
            hint="return None (or 'default') for app_label 'celery_driftsafe' in your routers' "
            "db_for_write and allow_migrate",
            id="celery_driftsafe.E013",
        )
    ]


def startup_errors() -> list[CheckMessage]:
    """The errors among this package's checks, for a process that may run without Django's
    system checks (``celery beat`` runs none): the scheduler refuses to start on any."""
    messages = check_settings() + check_use_tz() + check_autocommit() + check_routing()
    return [m for m in messages if m.is_serious()]


def describe(message: CheckMessage) -> str:
    """One line as ``manage.py check`` prints it: ``id: message HINT: hint``."""
    text = f"{message.id}: {message.msg}"
    return f"{text} HINT: {message.hint}" if message.hint else text


def check_database(
    app_configs: Any = None, databases: Sequence[str] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    """Warn when ``TIME_AUTHORITY`` is set to ``database`` on a database without a clock of
    its own (SQLite). ``auto``, the default, picks Redis or the local clock there instead, and
    the beat says which at its start (log action ``local-authority``), so a new project on
    SQLite gets no warning from every management command."""
    try:
        raw = conf.raw_settings()
    except ConfigurationError:
        return []  # reported by check_settings
    if raw.get("TIME_AUTHORITY", "auto") != "database":
        return []
    if connections["default"].vendor != "sqlite":
        return []
    return [
        Warning(
            "DRIFTSAFE['TIME_AUTHORITY'] is 'database' but the database is SQLite, whose clock "
            "is each process's own wall clock, so beats on different machines share no clock",
            hint="remove TIME_AUTHORITY (the default 'auto' takes Redis' clock when REDIS_URL is "
            "set), set it to 'redis', or use PostgreSQL",
            id="celery_driftsafe.W001",
        )
    ]


def refuse_bad_configuration(node_id: str) -> None:
    """``celery beat`` runs no system checks: refuse to start on any error they would
    report, with their message and hint, and without a traceback."""
    errors = startup_errors()
    if not errors:
        return
    for message in errors:
        _beat_logger.critical(
            "%s", describe(message), extra={"action": "config-error", "node": node_id}
        )
    raise SystemExit(
        "celery_driftsafe cannot start:\n" + "\n".join(describe(message) for message in errors)
    )
