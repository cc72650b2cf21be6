"""The settings object and its system checks."""

from __future__ import annotations

import pytest
from django.core.checks import Error, Warning
from django.db import connection
from django.test import override_settings

from celery_driftsafe import checks, conf
from celery_driftsafe.exceptions import ConfigurationError


def test_defaults_without_driftsafe_setting() -> None:
    with override_settings(DRIFTSAFE={}):
        settings = conf.get_settings()
    assert settings == conf.DriftSafeSettings()
    assert settings.time_authority == "database"
    assert settings.misfire_policy == "fire_once"


def test_read_on_access_so_overrides_apply() -> None:
    with override_settings(DRIFTSAFE={"CLAIM_BATCH_SIZE": 7}):
        assert conf.get_settings().claim_batch_size == 7
    with override_settings(DRIFTSAFE={"CLAIM_BATCH_SIZE": 9}):
        assert conf.get_settings().claim_batch_size == 9


def test_unknown_key_names_setting_and_known_keys() -> None:
    with override_settings(DRIFTSAFE={"REDIS_ULR": "redis://x"}), pytest.raises(
        ConfigurationError, match=r"DRIFTSAFE\['REDIS_ULR'\].*unknown setting.*REDIS_URL"
    ) as info:
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
        ({"TIME_AUTHORITY": "ntp"}, "celery_driftsafe.E003", "one of: database, redis, local"),
        ({"MISFIRE_POLICY": "often"}, "celery_driftsafe.E003", "fire_once"),
        ({"REDIS_UNAVAILABLE": "panic"}, "celery_driftsafe.E003", "fail_closed"),
        ({"CLAIM_BATCH_SIZE": 0}, "celery_driftsafe.E004", "positive whole number"),
        ({"CLAIM_BATCH_SIZE": 2.5}, "celery_driftsafe.E004", "positive whole number"),
        ({"CLAIM_BATCH_SIZE": True}, "celery_driftsafe.E004", "positive whole number"),
        ({"LEASE_SECONDS": -1}, "celery_driftsafe.E004", "positive number of seconds"),
        ({"LEASE_SECONDS": "30"}, "celery_driftsafe.E004", "positive number of seconds"),
        ({"REDIS_URL": "http://x"}, "celery_driftsafe.E005", "not a Redis URL"),
        ({"TIME_AUTHORITY": "redis", "REDIS_URL": None}, "celery_driftsafe.E006", "REDIS_URL"),
        ({"KEY_PREFIX": "a b"}, "celery_driftsafe.E007", "without spaces"),
        ({"MISFIRE_GRACE_SECONDS": -5}, "celery_driftsafe.E008", ">= 0"),
        ({"CELERY_APP": 3}, "celery_driftsafe.E009", "dotted path"),
    ],
)
def test_bad_values_get_stable_ids_and_name_the_setting(
    raw: dict[str, object], check_id: str, fragment: str
) -> None:
    with override_settings(DRIFTSAFE=raw):
        messages = [m for m in checks.check_settings() if m.id == check_id]
    assert messages, f"no {check_id} for {raw}"
    message = messages[0]
    assert isinstance(message, Error)
    key = next(iter(raw))
    assert f"DRIFTSAFE[{key!r}]" in message.msg or key in message.msg
    assert fragment in f"{message.msg} {message.hint}"


def test_good_settings_pass() -> None:
    good = {"REDIS_URL": "rediss://:pw@cache:6380/2", "TIME_AUTHORITY": "redis",
            "LEASE_SECONDS": 10, "MISFIRE_GRACE_SECONDS": 0, "KEY_PREFIX": "app:ds"}
    with override_settings(DRIFTSAFE=good):
        assert checks.check_settings() == []


def test_warning_bound_must_be_below_hard_bound() -> None:
    with override_settings(DRIFTSAFE={"MAX_CLOCK_OFFSET_SECONDS": 10,
                                      "HARD_CLOCK_OFFSET_SECONDS": 5}):
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
