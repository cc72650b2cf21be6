"""The settings object and its system checks."""

from __future__ import annotations

import re
from typing import Any

import pytest
from celery import Celery
from django.conf import settings as django_settings
from django.core.checks import Error, Warning
from django.db import connection
from django.test import override_settings

from celery_driftsafe import checks, conf
from celery_driftsafe.definitions import changes
from celery_driftsafe.exceptions import ConfigurationError
from celery_driftsafe.locks import RedisLockBackend, lock_backend
from celery_driftsafe.scheduler import DriftSafeScheduler
from celery_driftsafe.store.redis import channel, key_prefix
from tests import settings as test_settings

PROJECT_A = {
    "ENGINE": "django.db.backends.postgresql",
    "NAME": "shop",
    "HOST": "db1",
    "PORT": "5432",
    "USER": "shop",
}
PROJECT_B = {**PROJECT_A, "NAME": "billing"}


def split(raw: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``override_settings`` arguments for ``raw``: a project's keys in ``DRIFTSAFE``, the
    constants in ``DRIFTSAFE_INTERNALS`` (where the package's own tests change them)."""
    internal = {k: v for k, v in raw.items() if k in conf.DEPRECATED_SETTINGS}
    public = {k: v for k, v in raw.items() if k not in internal}
    return {"DRIFTSAFE": public, "DRIFTSAFE_INTERNALS": internal}


def test_defaults_without_driftsafe_setting() -> None:
    with override_settings(DRIFTSAFE={}, DRIFTSAFE_INTERNALS={}):
        settings = conf.get_settings()
    derived = conf.default_key_prefix(django_settings.DATABASES["default"])
    assert settings == conf.DriftSafeSettings(key_prefix=derived)
    assert settings.time_authority == "auto"
    assert settings.misfire_policy == "fire_once"
    assert settings.lease_seconds == settings.node_dead_after_seconds == 30.0
    assert settings.heartbeat_interval_seconds == 5.0
    assert settings.hard_clock_offset_seconds == conf.HARD_CLOCK_OFFSET_SECONDS == 86400.0
    assert settings.reconcile_interval_seconds == settings.result_lookup_seconds == 60.0


def test_read_on_access_so_overrides_apply() -> None:
    with override_settings(DRIFTSAFE_INTERNALS={"CLAIM_BATCH_SIZE": 7}):
        assert conf.get_settings().claim_batch_size == 7
    with override_settings(DRIFTSAFE_INTERNALS={"CLAIM_BATCH_SIZE": 9}):
        assert conf.get_settings().claim_batch_size == 9
    with override_settings(DRIFTSAFE={"MISFIRE_GRACE_SECONDS": 9.0}):
        assert conf.get_settings().misfire_grace_seconds == 9.0


def test_a_project_sets_at_most_twelve_settings_and_every_value_has_one_place() -> None:
    assert len(conf.PROJECT_SETTINGS) <= 12
    surface = [*conf.PROJECT_SETTINGS, *conf.TUNING_SETTINGS, *conf.DEPRECATED_SETTINGS]
    assert len(surface) == len(set(surface))
    assert set(surface) == set(conf.DriftSafeSettings.setting_names())


def test_the_lease_and_the_heartbeat_follow_from_the_dead_after() -> None:
    settings = conf.build_settings({"NODE_DEAD_AFTER_SECONDS": 60.0}, database={})
    assert settings.lease_seconds == 60.0
    assert settings.heartbeat_interval_seconds == 10.0
    own = conf.build_settings(
        {"NODE_DEAD_AFTER_SECONDS": 60.0}, internals={"LEASE_SECONDS": 5.0}, database={}
    )
    assert own.lease_seconds == 5.0 and own.heartbeat_interval_seconds == 10.0


@pytest.mark.parametrize(
    ("key", "value", "attribute", "says"),
    [
        ("CLAIM_BATCH_SIZE", 7, "claim_batch_size", "now a constant (500)"),
        ("LEASE_SECONDS", 12.0, "lease_seconds", "follows from NODE_DEAD_AFTER_SECONDS"),
        ("MAX_LOOP_INTERVAL_SECONDS", 2.0, "max_loop_interval_seconds", "beat_max_loop_interval"),
        ("OPTIMISATIONS_OFF", ["prebuild"], "optimisations_off", "DRIFTSAFE_BENCH_OFF"),
        ("HARD_CLOCK_OFFSET_SECONDS", 60.0, "hard_clock_offset_seconds", "a day"),
    ],
)
def test_a_former_setting_still_works_for_a_release_with_a_deprecation_warning(
    key: str, value: Any, attribute: str, says: str
) -> None:
    with override_settings(DRIFTSAFE={key: value}):
        with pytest.warns(DeprecationWarning, match=re.escape(f"DRIFTSAFE[{key!r}]")) as caught:
            settings = conf.get_settings()
        messages = checks.check_settings()
    (warning,) = caught
    assert says in str(warning.message) and "0.4" in str(warning.message)
    honoured = getattr(settings, attribute)
    assert honoured == (tuple(value) if isinstance(value, list) else value)
    (check,) = [m for m in messages if m.id == "celery_driftsafe.W003"]
    assert isinstance(check, Warning) and says in check.msg and not check.is_serious()
    assert "Renamed or removed" in (check.hint or "")


def test_internals_take_only_the_constants() -> None:
    with (
        override_settings(DRIFTSAFE_INTERNALS={"REDIS_URL": "redis://x"}),
        pytest.raises(ConfigurationError, match=r"not an internal value.*set it in DRIFTSAFE"),
    ):
        conf.get_settings()
    with override_settings(DRIFTSAFE_INTERNALS={"REDIS_URL": "redis://x"}):
        assert [m.id for m in checks.check_settings()] == ["celery_driftsafe.E002"]


def test_the_beat_waits_at_most_celery_s_beat_max_loop_interval(settings: Any) -> None:
    app = Celery("max-interval", set_as_current=False)
    assert DriftSafeScheduler(app, lazy=True).max_interval == conf.MAX_LOOP_INTERVAL_SECONDS
    app.conf.beat_max_loop_interval = 3
    assert DriftSafeScheduler(app, lazy=True).max_interval == 3.0
    # celery beat --max-interval wins, as with Celery's own schedulers
    assert DriftSafeScheduler(app, lazy=True, max_interval=7).max_interval == 7.0
    # the former setting still applies where Celery's is not set
    settings.DRIFTSAFE_INTERNALS = {"MAX_LOOP_INTERVAL_SECONDS": 2.5}
    other = Celery("max-interval-2", set_as_current=False)
    assert DriftSafeScheduler(other, lazy=True).max_interval == 2.5


def test_unknown_key_names_setting_and_known_keys() -> None:
    with (
        override_settings(DRIFTSAFE={"REDIS_ULR": "redis://x"}),
        pytest.raises(
            ConfigurationError, match=r"DRIFTSAFE\['REDIS_ULR'\].*unknown setting.*REDIS_URL"
        ) as info,
    ):
        conf.get_settings()
    assert info.value.setting == "REDIS_ULR"


def test_driftsafe_must_be_a_dict() -> None:
    with override_settings(DRIFTSAFE=["nope"]):
        messages = checks.check_settings()
    assert [m.id for m in messages] == ["celery_driftsafe.E001"]


@pytest.mark.parametrize(
    ("raw", "check_id", "fragment"),
    [
        ({"TIMEOUT": 3}, "celery_driftsafe.E002", "unknown setting"),
        (
            {"TIME_AUTHORITY": "ntp"},
            "celery_driftsafe.E003",
            "one of: auto, database, redis, local",
        ),
        ({"MISFIRE_POLICY": "often"}, "celery_driftsafe.E003", "fire_once"),
        ({"REDIS_UNAVAILABLE": "panic"}, "celery_driftsafe.E003", "fail_closed"),
        ({"CLAIM_BATCH_SIZE": 0}, "celery_driftsafe.E004", "positive whole number"),
        ({"CLAIM_BATCH_SIZE": 2.5}, "celery_driftsafe.E004", "positive whole number"),
        ({"CLAIM_BATCH_SIZE": True}, "celery_driftsafe.E004", "positive whole number"),
        ({"LEASE_SECONDS": -1}, "celery_driftsafe.E004", "positive number of seconds"),
        ({"LEASE_SECONDS": "30"}, "celery_driftsafe.E004", "positive number of seconds"),
        ({"LEASE_SECONDS": float("inf")}, "celery_driftsafe.E004", "up to a hundred years"),
        ({"RUN_EXPIRES_SECONDS": 1e12}, "celery_driftsafe.E004", "up to a hundred years"),
        ({"REDIS_URL": "http://x"}, "celery_driftsafe.E005", "not a Redis URL"),
        ({"TIME_AUTHORITY": "redis", "REDIS_URL": None}, "celery_driftsafe.E006", "REDIS_URL"),
        ({"KEY_PREFIX": "a b"}, "celery_driftsafe.E007", "without spaces"),
        ({"MISFIRE_GRACE_SECONDS": -5}, "celery_driftsafe.E008", ">= 0"),
        ({"MISFIRE_GRACE_SECONDS": 1e12}, "celery_driftsafe.E008", "up to a hundred years"),
        ({"CELERY_APP": 3}, "celery_driftsafe.E009", "dotted path"),
        ({"FAST_PUBLISH": "yes"}, "celery_driftsafe.E011", "True or False"),
        ({"FAST_PUBLISH": 1}, "celery_driftsafe.E011", "True or False"),
        ({"MIN_ROUND_INTERVAL_SECONDS": -0.01}, "celery_driftsafe.E024", "from 0 to"),
        ({"MIN_ROUND_INTERVAL_SECONDS": "0.02"}, "celery_driftsafe.E024", "from 0 to"),
        (
            {"MIN_ROUND_INTERVAL_SECONDS": 2, "MAX_LOOP_INTERVAL_SECONDS": 1},
            "celery_driftsafe.E024",
            "MAX_LOOP_INTERVAL_SECONDS (1)",
        ),
        # ranges and relations a type does not tell
        ({"CLAIM_BATCH_SIZE": 10**9}, "celery_driftsafe.E030", "more than 10,000"),
        ({"PUBLISH_BATCH_SIZE": 10**6}, "celery_driftsafe.E030", "at most 10,000"),
        ({"PRUNE_BATCH_SIZE": 10**6}, "celery_driftsafe.E030", "one transaction"),
        ({"FIRE_ALL_MAX": 10**6}, "celery_driftsafe.E030", "catch-up runs"),
        ({"CLOCK_SYNC_SAMPLES": 1000}, "celery_driftsafe.E030", "more than 100"),
        ({"LEASE_SECONDS": 1e-9}, "celery_driftsafe.E031", "below 1 s"),
        ({"LEASE_SECONDS": 0.5}, "celery_driftsafe.E031", "at least 1"),
        ({"NODE_DEAD_AFTER_SECONDS": 0.5}, "celery_driftsafe.E031", "at least 1"),
        (
            {"NODE_DEAD_AFTER_SECONDS": 15, "HEARTBEAT_INTERVAL_SECONDS": 10},
            "celery_driftsafe.E032",
            "below 2 x HEARTBEAT_INTERVAL_SECONDS (10)",
        ),
        (
            {"HEARTBEAT_INTERVAL_SECONDS": 20},
            "celery_driftsafe.E032",
            "taken for dead between two heartbeats",
        ),
    ],
)
def test_bad_values_get_stable_ids_and_name_the_setting(
    raw: dict[str, object], check_id: str, fragment: str
) -> None:
    with override_settings(**split(raw)):
        messages = [m for m in checks.check_settings() if m.id == check_id]
    assert messages, f"no {check_id} for {raw}"
    message = messages[0]
    assert isinstance(message, Error)
    key = next(iter(raw))
    assert f"DRIFTSAFE[{key!r}]" in message.msg or key in message.msg
    assert fragment in f"{message.msg} {message.hint}"


def test_good_settings_pass() -> None:
    good = {
        "REDIS_URL": "rediss://:pw@cache:6380/2",
        "TIME_AUTHORITY": "redis",
        "LEASE_SECONDS": 1,
        "CLAIM_BATCH_SIZE": 10_000,
        "CLOCK_SYNC_SAMPLES": 100,
        "HEARTBEAT_INTERVAL_SECONDS": 1.0,
        "NODE_DEAD_AFTER_SECONDS": 2.0,
        "MISFIRE_GRACE_SECONDS": 0,
        "MIN_ROUND_INTERVAL_SECONDS": 0,
        "KEY_PREFIX": "app:ds",
    }
    with override_settings(**split(good)):
        assert checks.check_settings() == []


def test_warning_bound_must_be_below_hard_bound() -> None:
    with override_settings(
        DRIFTSAFE={"MAX_CLOCK_OFFSET_SECONDS": 10},
        DRIFTSAFE_INTERNALS={"HARD_CLOCK_OFFSET_SECONDS": 5},
    ):
        messages = checks.check_settings()
    assert [(type(m), m.id) for m in messages] == [(Warning, "celery_driftsafe.W002")]


def test_sqlite_with_database_authority_warns() -> None:
    with override_settings(DRIFTSAFE={"TIME_AUTHORITY": "database"}):
        messages = checks.check_database()
    if connection.vendor == "sqlite":
        assert [m.id for m in messages] == ["celery_driftsafe.W001"]
        assert "TIME_AUTHORITY" in messages[0].hint
    else:
        assert messages == []


def test_use_tz_false_is_a_check_error_with_a_hint() -> None:
    with override_settings(USE_TZ=False):
        messages = checks.check_use_tz()
    assert [m.id for m in messages] == ["celery_driftsafe.E010"]
    assert isinstance(messages[0], Error)
    assert "USE_TZ = False" in messages[0].msg
    assert "set USE_TZ = True" in (messages[0].hint or "")
    assert checks.check_use_tz() == []  # the test settings have USE_TZ = True


def test_autocommit_off_is_a_check_error_and_the_beat_refuses_to_start() -> None:
    """With AUTOCOMMIT off Django commits nothing: a claim's runs would be rolled back when
    the connection closes, after their messages went out."""
    database = django_settings.DATABASES["default"]
    database["AUTOCOMMIT"] = False  # no connection is opened here (no database access)
    try:
        messages = checks.check_autocommit()
        with pytest.raises(SystemExit) as info:
            DriftSafeScheduler(
                app=Celery("ac", broker="memory://", set_as_current=False),
                install_signal_handlers=False,
            )
    finally:
        database["AUTOCOMMIT"] = True
    assert [m.id for m in messages] == ["celery_driftsafe.E012"]
    assert isinstance(messages[0], Error)
    assert "DATABASES['default']['AUTOCOMMIT'] = False" in messages[0].msg
    assert "remove AUTOCOMMIT" in (messages[0].hint or "")
    assert "celery_driftsafe.E012" in str(info.value.code)
    assert checks.check_autocommit() == []  # the test settings keep Django's default


class RunsElsewhere:
    """A project's router that keeps the run ledger on another database."""

    def db_for_write(self, model: Any, **hints: Any) -> str | None:
        return "other" if model._meta.model_name == "run" else None

    db_for_read = db_for_write

    def allow_migrate(self, db: str, app_label: str, model_name: str = "", **hints: Any) -> Any:
        return False if model_name == "run" and db == "default" else None


def test_a_router_sending_this_apps_models_elsewhere_is_a_check_error() -> None:
    """Beats and workers use 'default': the admin would write runs the beats never see."""
    with override_settings(DATABASE_ROUTERS=[f"{__name__}.RunsElsewhere"]):
        messages = checks.check_routing()
        with pytest.raises(SystemExit) as info:
            DriftSafeScheduler(
                app=Celery("routed", broker="memory://", set_as_current=False),
                install_signal_handlers=False,
            )
    assert [m.id for m in messages] == ["celery_driftsafe.E013"]
    assert isinstance(messages[0], Error)
    assert messages[0].msg.endswith(
        "celery_driftsafe.Run writes go to 'other'; "
        "celery_driftsafe.Run is not migrated on 'default'"
    )
    assert "app_label 'celery_driftsafe'" in (messages[0].hint or "")
    assert "celery_driftsafe.E013" in str(info.value.code)
    assert checks.check_routing() == []  # no routers in the test settings


class ReadsFromAReplica:
    """The common primary/replica router: every read to a replica, every write to default."""

    def db_for_read(self, model: Any, **hints: Any) -> str:
        return "replica"

    def db_for_write(self, model: Any, **hints: Any) -> str:
        return "default"


def test_a_router_reading_from_a_replica_is_no_error() -> None:
    """Beats and workers read 'default' themselves; the admin reading a replica is fine."""
    with override_settings(DATABASE_ROUTERS=[f"{__name__}.ReadsFromAReplica"]):
        assert checks.check_routing() == []


def test_beat_refuses_to_start_with_the_check_message_when_checks_were_skipped() -> None:
    app = Celery("refuse", broker="memory://", set_as_current=False)
    with override_settings(USE_TZ=False), pytest.raises(SystemExit) as info:
        DriftSafeScheduler(app=app, install_signal_handlers=False)
    text = str(info.value.code)
    assert "celery_driftsafe.E010" in text and "USE_TZ = False" in text
    assert "HINT: set USE_TZ = True" in text


def test_default_key_prefix_is_per_database_and_stable() -> None:
    a = conf.build_settings({}, database=PROJECT_A)
    b = conf.build_settings({}, database=PROJECT_B)
    assert re.fullmatch(r"driftsafe:[0-9a-f]{8}", a.key_prefix)
    assert a.key_prefix != b.key_prefix
    # every beat and worker of one project computes the same prefix (USER does not count)
    assert conf.build_settings({}, database={**PROJECT_A, "USER": "beat"}) == a
    for part in conf.DATABASE_IDENTITY:
        assert conf.build_settings({}, database={**PROJECT_A, part: "other"}) != a
    # an explicit KEY_PREFIX still wins
    explicit = conf.build_settings({"KEY_PREFIX": "shop:ds"}, database=PROJECT_A)
    assert key_prefix(explicit) == "shop:ds"


def test_two_databases_get_disjoint_lock_keys_and_channels() -> None:
    raw = {"REDIS_URL": test_settings.REDIS_URL}
    a = conf.build_settings(raw, database=PROJECT_A)
    b = conf.build_settings(raw, database=PROJECT_B)
    locks_a, locks_b = lock_backend(a), lock_backend(b)
    assert isinstance(locks_a, RedisLockBackend) and isinstance(locks_b, RedisLockBackend)
    keys_a = {locks_a.lock_key("run:1"), locks_a.fence_key("run:1"), channel(a, "changes")}
    keys_b = {locks_b.lock_key("run:1"), locks_b.fence_key("run:1"), channel(b, "changes")}
    assert len(keys_a) == len(keys_b) == 3
    assert not keys_a & keys_b
    assert all(key.startswith(key_prefix(a) + ":") for key in keys_a)
    assert all(key.startswith(key_prefix(b) + ":") for key in keys_b)


@pytest.mark.redis
def test_projects_sharing_one_redis_database_do_not_see_each_others_locks_or_wakeups(
    redis_client: Any,
) -> None:
    raw = {"REDIS_URL": test_settings.REDIS_URL}
    a = conf.build_settings(raw, database=PROJECT_A)
    b = conf.build_settings(raw, database=PROJECT_B)
    held = lock_backend(a).lock("run:1", ttl=30)
    assert held.acquire(blocking=False)
    try:
        # the same lock name in project A is taken; in project B it is free
        assert not lock_backend(a).lock("run:1", ttl=30).acquire(blocking=False)
        other = lock_backend(b).lock("run:1", ttl=30)
        assert other.acquire(blocking=False)
        other.release()
    finally:
        held.release()

    # one subscriber per project, as each project's beats subscribe on their own
    subscribers = {name: redis_client.pubsub() for name in ("a", "b")}
    for name, project in (("a", a), ("b", b)):
        subscribers[name].subscribe(channel(project, "changes"))
        confirmation = subscribers[name].get_message(timeout=10.0)
        assert confirmation is not None and confirmation["type"] == "subscribe"
    # project A's schedule change, published the way the package does it
    with override_settings(DRIFTSAFE={**raw, "KEY_PREFIX": a.key_prefix}):
        assert changes.notify()
    received: dict[str, list[str]] = {}
    for name, pubsub in subscribers.items():
        received[name] = []
        while (message := pubsub.get_message(timeout=1.0)) is not None:
            if message["type"] == "message":
                received[name].append(message["channel"].decode())
        pubsub.close()
    # A's beats wake up; B's subscription got nothing
    assert received == {"a": [channel(a, "changes")], "b": []}
