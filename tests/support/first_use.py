"""A new project as Celery's "First steps with Django" makes it, and the settings README's "Use
it in your project" gives: what the first-use tests build a project from."""

from __future__ import annotations

from pathlib import Path

#: ``proj/celery.py`` and ``proj/__init__.py``, word for word as Celery's "First steps with
#: Django" writes them, and the ``tasks.py`` of an app ``demoapp``.
GUIDE_CELERY = """\
import os

from celery import Celery

# Set the default Django settings module for the 'celery' program.
os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'proj.settings')

app = Celery('proj')

# Using a string here means the worker doesn't have to serialize
# the configuration object to child processes.
# - namespace='CELERY' means all celery-related configuration keys
#   should have a `CELERY_` prefix.
app.config_from_object('django.conf:settings', namespace='CELERY')

# Load task modules from all registered Django apps.
app.autodiscover_tasks()


@app.task(bind=True, ignore_result=True)
def debug_task(self):
    print(f'Request: {self.request!r}')
"""
GUIDE_INIT = """\
# This will make sure the app is always imported when
# Django starts so that shared_task will use this app.
from .celery import app as celery_app

__all__ = ('celery_app',)
"""
DEMO_TASKS = """\
from celery import shared_task


@shared_task
def tick():
    return "tick"
"""
README_REDIS = "redis://127.0.0.1:6379/0"
ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def readme_block() -> str:
    text = README.read_text()
    section = text[text.index("## Use it in your project") :]
    start = section.index("```python\n") + len("```python\n")
    return section[start : section.index("```", start)]
