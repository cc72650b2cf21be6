"""``TIME_AUTHORITY = "auto"`` (the default): the database's clock where the database has one,
Redis' on SQLite with ``REDIS_URL``, the local clock on SQLite without Redis; and the README's
settings draw no system check message on the database a new project has (SQLite).

Run on both passes: the same tests resolve ``auto`` against SQLite and against PostgreSQL.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.core import checks as django_checks
from django.db import connection
from django.test import override_settings

from celery_driftsafe.conf import get_settings
from celery_driftsafe.exceptions import ConfigurationError
from celery_driftsafe.store.clock import (
    authority_from_settings,
    configured_time_authority,
    resolve_time_authority,
)

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_settings() -> dict[str, Any]:
    """The settings README's "Use it in your project" tells a user to paste, as they would
    land in a new project's ``settings.py``."""
    text = README.read_text()
    section = text[text.index("## Use it in your project") :]
    block = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert block is not None, "README's 'Use it in your project' has no python block"
    namespace: dict[str, Any] = {"INSTALLED_APPS": []}
    exec(block.group(1), namespace)
    return namespace


@pytest.mark.parametrize(
    ("setting", "vendor", "redis_url", "expected"),
    [
        ("auto", "postgresql", None, "database"),
        ("auto", "postgresql", "redis://cache:6379/0", "database"),
        ("auto", "mysql", "redis://cache:6379/0", "database"),
        ("auto", "sqlite", "redis://cache:6379/0", "redis"),
        ("auto", "sqlite", None, "local"),
        ("auto", "sqlite", "", "local"),
        ("auto", "oracle", None, "local"),  # no clock query for it: never "database"
        ("database", "sqlite", None, "database"),  # an explicit value is itself
        ("redis", "postgresql", "redis://cache:6379/0", "redis"),
        ("local", "postgresql", None, "local"),
    ],
)
def test_resolve_time_authority(
    setting: str, vendor: str, redis_url: str | None, expected: str
) -> None:
    assert resolve_time_authority(setting, vendor=vendor, redis_url=redis_url) == expected


def test_auto_is_the_default() -> None:
    with override_settings(DRIFTSAFE={}):
        assert get_settings().time_authority == "auto"


@pytest.mark.django_db
def test_auto_on_this_database_with_redis() -> None:
    with override_settings(DRIFTSAFE={"REDIS_URL": settings.DRIFTSAFE["REDIS_URL"]}):
        chosen = configured_time_authority()
        authority = authority_from_settings()
    expected = "redis" if connection.vendor == "sqlite" else "database"
    assert chosen == expected
    assert authority.name == expected
    authority.read()  # and it answers


@pytest.mark.django_db
def test_auto_on_this_database_without_redis() -> None:
    with override_settings(DRIFTSAFE={}):
        chosen = configured_time_authority()
        authority = authority_from_settings()
    expected = "local" if connection.vendor == "sqlite" else "database"
    assert chosen == expected
    assert authority.name == expected
    authority.read()


def test_an_unknown_authority_is_a_configuration_error() -> None:
    with (
        override_settings(DRIFTSAFE={"TIME_AUTHORITY": "ntp"}),
        pytest.raises(ConfigurationError, match="TIME_AUTHORITY"),
    ):
        authority_from_settings()


@pytest.mark.django_db
def test_readme_settings_draw_no_system_check_message() -> None:
    """What a user pastes from the README gives ``manage.py check`` (and every ``migrate``)
    nothing to say, on SQLite as on PostgreSQL."""
    pasted = readme_settings()
    assert pasted["INSTALLED_APPS"] == ["celery_driftsafe"]
    assert pasted["CELERY_BEAT_SCHEDULER"] == "driftsafe"
    with override_settings(DRIFTSAFE=pasted["DRIFTSAFE"]):
        messages = django_checks.run_checks(databases=["default"])
    ours = [m for m in messages if (m.id or "").startswith("celery_driftsafe.")]
    assert ours == []
