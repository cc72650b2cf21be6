"""Admin of beat nodes: who is alive, and whose clock is off.

Liveness is judged on the authority's clock: a node whose last heartbeat is older than
``NODE_DEAD_AFTER_SECONDS`` is dead. An offset beyond ``MAX_CLOCK_OFFSET_SECONDS`` is
highlighted; due-ness never depends on it, but the node's NTP needs attention.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.html import format_html
from django.utils.safestring import SafeString

from celery_driftsafe.admin.display import (
    AuthorityNowMixin,
    instant,
    instant_field,
    page_now,
    relative,
    seconds_text,
)
from celery_driftsafe.conf import get_settings
from celery_driftsafe.models import BeatNode
from celery_driftsafe.monitoring import cluster

_STATE_COLOURS = {"alive": "#2e7d32", "dead": "#ba2121", "stopped": "#777777"}


def _dead_after() -> timedelta:
    return timedelta(seconds=get_settings().node_dead_after_seconds)


class NodeStateFilter(admin.SimpleListFilter):
    title = "state"
    parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("alive", "alive"), ("dead", "dead"), ("stopped", "stopped")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value, now = self.value(), page_now()
        if value == "stopped":
            return queryset.filter(stopped_at__isnull=False)
        if value not in ("alive", "dead") or now is None:
            return queryset
        running = queryset.filter(stopped_at__isnull=True)
        horizon = now - _dead_after()
        if value == "alive":
            return running.filter(last_heartbeat_at__gte=horizon)
        return running.filter(last_heartbeat_at__lt=horizon)


class BeatNodeAdmin(AuthorityNowMixin, admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = (
        "node_id",
        "hostname",
        "pid",
        "version",
        "state",
        "heartbeat",
        "offset",
        "rtt",
        "clock_measured",
        "claiming",
        "lag",
    )
    list_filter = (NodeStateFilter, "hostname")
    show_full_result_count = False
    search_fields = ("node_id", "hostname")
    list_per_page = 100
    readonly_fields = (
        "node_id",
        "hostname",
        "pid",
        "version",
        "state",
        "started",
        "heartbeat",
        "offset",
        "rtt",
        "clock_measured",
        "stopped",
        "claiming",
        "lag",
        "claiming_since_at",
    )
    fields = readonly_fields

    claiming_since_at = instant_field("claiming_since", "claiming since")

    def get_urls(self) -> list[Any]:
        """The cluster dashboard (``<node list>/dashboard/``), before the change view's
        catch-all."""
        from django.urls import path

        from celery_driftsafe.admin.dashboard import dashboard_view

        def view(request: HttpRequest) -> Any:
            # It shows tasks, runs and nodes: it needs the permission to view each.
            if not cluster.may_view(request.user):
                from django.core.exceptions import PermissionDenied

                raise PermissionDenied
            return dashboard_view(self, request)

        dashboard = path(
            "dashboard/", self.admin_site.admin_view(view), name="celery_driftsafe_dashboard"
        )
        return [dashboard, *super().get_urls()]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # a node writes its own row; dead ones may be deleted

    @admin.display(description="state")
    def state(self, node: BeatNode) -> SafeString | str:
        now = page_now()
        if now is None:
            return "unknown (time authority unreachable)"
        state = node.state_at(now, _dead_after())
        return format_html(
            '<strong class="driftsafe-node-{}" style="color:{}">{}</strong>',
            state,
            _STATE_COLOURS[state],
            state,
        )

    @admin.display(description="last heartbeat", ordering="last_heartbeat_at")
    def heartbeat(self, node: BeatNode) -> SafeString | str:
        return format_html(
            "{}<br><small>{}</small>",
            instant(node.last_heartbeat_at),
            relative(node.last_heartbeat_at, page_now()),
        )

    @admin.display(description="started", ordering="started_at")
    def started(self, node: BeatNode) -> SafeString | str:
        return instant(node.started_at)

    @admin.display(description="stopped", ordering="stopped_at")
    def stopped(self, node: BeatNode) -> SafeString | str:
        return instant(node.stopped_at)

    @admin.display(description="clock offset", ordering="clock_offset_seconds")
    def offset(self, node: BeatNode) -> SafeString | str:
        value = node.clock_offset_seconds
        if value is None:
            return "not measured"
        text = f"{'+' if value >= 0 else ''}{seconds_text(value)}"
        bound = get_settings().max_clock_offset_seconds
        if node.offset_exceeds(bound):
            return format_html(
                '<strong class="driftsafe-offset-exceeded" style="color:#ba2121" '
                'title="beyond MAX_CLOCK_OFFSET_SECONDS = {} s: check NTP on this host">'
                "⚠ {}</strong>",
                bound,
                text,
            )
        return format_html('<span class="driftsafe-offset-ok">{}</span>', text)

    @admin.display(description="round trip", ordering="clock_rtt_seconds")
    def rtt(self, node: BeatNode) -> str:
        value = node.clock_rtt_seconds
        return "—" if value is None else f"{value * 1000:.1f} ms (±{value * 500:.1f} ms)"

    @admin.display(description="measured", ordering="clock_measured_at")
    def clock_measured(self, node: BeatNode) -> SafeString | str:
        return instant(node.clock_measured_at)

    @admin.display(description="lag", ordering="lag_seconds")
    def lag(self, node: BeatNode) -> SafeString | str:
        """How far behind its slots the node's recent rounds fired; past the misfire grace the
        beats are saturated (they cannot keep up), and by how much is shown."""
        value = node.lag_seconds
        if value is None:
            return "—"
        grace = get_settings().misfire_grace_seconds
        if value > grace:
            return format_html(
                '<strong class="driftsafe-saturated" style="color:#ba2121" '
                'title="past MISFIRE_GRACE_SECONDS = {} s: add beats or spread the schedule">'
                "⚠ saturated: {} behind</strong>",
                grace,
                seconds_text(value),
            )
        return seconds_text(value)

    @admin.display(description="claiming")
    def claiming(self, node: BeatNode) -> SafeString | str:
        if node.claiming_paused_reason:
            return format_html(
                '<span style="color:#ba2121">paused: {}</span>', node.claiming_paused_reason
            )
        return "active"
