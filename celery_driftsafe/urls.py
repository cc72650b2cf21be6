"""URLs of celery_driftsafe outside the admin.

``path("driftsafe/", include("celery_driftsafe.urls"))`` serves the database-derived metrics
at ``driftsafe/metrics``."""

from __future__ import annotations

from django.urls import path

from celery_driftsafe.monitoring import views

app_name = "celery_driftsafe"
urlpatterns = [path("metrics", views.metrics, name="metrics")]
