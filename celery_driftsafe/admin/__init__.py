"""The Django admin of celery_driftsafe: periodic tasks, the run ledger and the beat nodes.

* :mod:`~celery_driftsafe.admin.tasks` — what runs next and what ran; a form that validates
  everything before saving; its actions (enable, disable, run now, reset schedule).
* :mod:`~celery_driftsafe.admin.runs` — the read-only ledger: slot, status, node, instants,
  lateness and duration, with a link to the django-celery-results result.
* :mod:`~celery_driftsafe.admin.nodes` — each beat's heartbeat and measured clock offset.
* :mod:`~celery_driftsafe.admin.calendars` — shared calendars of excluded dates.
"""

from __future__ import annotations

from django.contrib import admin

from celery_driftsafe.admin.calendars import CalendarAdmin
from celery_driftsafe.admin.nodes import BeatNodeAdmin
from celery_driftsafe.admin.runs import RunAdmin
from celery_driftsafe.admin.tasks import PeriodicTaskAdmin
from celery_driftsafe.models import BeatNode, Calendar, PeriodicTask, Run

__all__ = ["BeatNodeAdmin", "CalendarAdmin", "PeriodicTaskAdmin", "RunAdmin"]

admin.site.register(PeriodicTask, PeriodicTaskAdmin)
admin.site.register(Run, RunAdmin)
admin.site.register(BeatNode, BeatNodeAdmin)
admin.site.register(Calendar, CalendarAdmin)
