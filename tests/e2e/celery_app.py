"""The Celery app of the end-to-end runs, configured the way a Django project does it."""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.e2e.settings")

app = Celery("e2e")
app.config_from_object("django.conf:settings", namespace="CELERY")


@app.task(name="e2e.tick")
def tick(*args: Any, **kwargs: Any) -> None:
    """Does nothing: the test counts messages, not work."""
