"""Template filters of the admin's pages: ``{% load driftsafe_admin %}``."""

from __future__ import annotations

from typing import Any

from django import template

from celery_driftsafe.monitoring import cluster

register = template.Library()


@register.filter
def may_view_cluster(user: Any) -> bool:
    """Whether ``user`` may open the cluster dashboard (links to it are shown only then)."""
    return cluster.may_view(user)
