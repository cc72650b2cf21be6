"""Settings of the example project.

SQLite by default (``EXAMPLE_SQLITE_PATH``, default ``example.sqlite3`` beside manage.py);
PostgreSQL with one variable::

    EXAMPLE_DATABASE=postgres://postgres@127.0.0.1:5432/driftsafe_example

Redis from ``EXAMPLE_REDIS_URL`` (default redis://127.0.0.1:6379): celery_driftsafe's locks and
wake-ups use database ``EXAMPLE_REDIS_DB`` (default 0), the Celery broker the next one.
"""

import os
from pathlib import Path
from urllib.parse import urlsplit

import django
from celery.schedules import crontab

BASE_DIR = Path(__file__).resolve().parent.parent
SECRET_KEY = os.environ.get("EXAMPLE_SECRET_KEY", "example-only-change-me")
DEBUG = os.environ.get("EXAMPLE_DEBUG", "1") == "1"
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
USE_TZ = True
TIME_ZONE = "UTC"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_celery_results",
    "celery_driftsafe",
    "shop",
]
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "example_project.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
STATIC_URL = "static/"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"


# Several beats and a worker write to one SQLite file: wait for its lock rather than fail, and
# take the lock at BEGIN (Django 5.1+) so that two writers never deadlock upgrading it.
_SQLITE_OPTIONS: dict[str, object] = {"timeout": 30}
if django.VERSION >= (5, 1):
    _SQLITE_OPTIONS["transaction_mode"] = "IMMEDIATE"


def _database(url: str | None) -> dict[str, object]:
    if not url:
        return {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": os.environ.get("EXAMPLE_SQLITE_PATH", str(BASE_DIR / "example.sqlite3")),
            "OPTIONS": _SQLITE_OPTIONS,
        }
    parts = urlsplit(url)
    if parts.scheme not in ("postgres", "postgresql"):
        raise ValueError(f"EXAMPLE_DATABASE={url!r}: use postgres://user@host:port/name")
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": parts.path.lstrip("/") or "driftsafe_example",
        "USER": parts.username or "postgres",
        "PASSWORD": parts.password or "",
        "HOST": parts.hostname or "127.0.0.1",
        "PORT": str(parts.port or 5432),
    }


DATABASES = {"default": _database(os.environ.get("EXAMPLE_DATABASE"))}
_on_sqlite = DATABASES["default"]["ENGINE"].endswith("sqlite3")

REDIS_URL = os.environ.get("EXAMPLE_REDIS_URL", "redis://127.0.0.1:6379").rstrip("/")
REDIS_DB = int(os.environ.get("EXAMPLE_REDIS_DB", "0"))

# celery_driftsafe: one dict, every key documented in docs/reference/settings.md.
DRIFTSAFE = {
    "REDIS_URL": f"{REDIS_URL}/{REDIS_DB}",
    "KEY_PREFIX": "example",
    # SQLite has no server clock shared by processes; Redis TIME is the authority then.
    "TIME_AUTHORITY": "redis" if _on_sqlite else "database",
}

CELERY_BROKER_URL = f"{REDIS_URL}/{REDIS_DB + 1}"
CELERY_RESULT_BACKEND = "django-db"  # django-celery-results: results in the admin too
CELERY_RESULT_EXTENDED = True  # store task names and arguments with the results
CELERY_BEAT_SCHEDULER = "celery_driftsafe.scheduler:DriftSafeScheduler"
CELERY_TIMEZONE = "UTC"
# Mirrored into celery_driftsafe's PeriodicTask table when a beat starts; more tasks can be
# added in the admin (the demo adds two the same way).
CELERY_BEAT_SCHEDULE = {
    "heartbeat-every-2s": {"task": "shop.tasks.heartbeat", "schedule": 2.0},
    "report-every-minute": {
        "task": "shop.tasks.sales_report",
        "schedule": crontab(minute="*"),
        "kwargs": {"region": "emea"},
    },
}
