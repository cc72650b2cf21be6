"""A beat's Celery app that imports no task module (a slimmer deployment, or a beat rolled out
before the workers): the same configuration as :mod:`tests.e2e.celery_app`, no tasks."""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.e2e.settings")

app = Celery("e2e-slim")
app.config_from_object("django.conf:settings", namespace="CELERY")
